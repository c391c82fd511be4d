//! What every layer needs to load its rank's slice of its weights: where tensors come from (a
//! checkpoint, or a dry run that only checks them), the communicator, the device, the compute
//! dtype and the kernel choices. Layers and tensor-parallel linears both depend on this, never
//! on each other's options.
use std::rc::Rc;

use tch::{Device, Kind, Tensor};

use crate::error::{Result, TensorProblem};
use crate::gpu::comm::Communicator;
use crate::kernels::Kernels;
use crate::quant::config::Quantization;

/// Which part of a weight a rank holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shard {
    /// The whole tensor (replicated on every rank).
    Full,
    /// Rank `rank` of `world` contiguous, equal parts of dimension `dim`.
    Split {
        /// Dimension split across ranks (0 = rows of a `[out, in]` weight).
        dim: usize,
        /// This rank.
        rank: usize,
        /// Number of ranks.
        world: usize,
    },
    /// Rows `start..end` of dimension 0 (uneven splits such as a vocabulary).
    Rows {
        /// First row.
        start: usize,
        /// One past the last row.
        end: usize,
    },
}

impl Shard {
    /// The shape of this rank's part of `name`, whose full shape is `full`.
    pub(crate) fn local_shape(
        self,
        name: &str,
        full: &[usize],
    ) -> std::result::Result<Vec<usize>, TensorProblem> {
        let mut shape = full.to_vec();
        match self {
            Shard::Full => {}
            Shard::Rows { start, end } => shape[0] = end - start,
            Shard::Split { dim, world, .. } => {
                if !full[dim].is_multiple_of(world) {
                    return Err(TensorProblem::Unsplittable {
                        name: name.to_string(),
                        dim,
                        size: full[dim],
                        parts: world,
                    });
                }
                shape[dim] /= world;
            }
        }
        Ok(shape)
    }
}

/// Where a model's weights come from as it loads: the checkpoint, or a dry run that checks
/// names, shapes and dtypes and reads no data. Models load through this alone, so the
/// pre-flight check is the loading code itself.
pub(crate) trait TensorSource {
    /// This rank's `shard` of `name`, whose full shape must be `shape`, on `device` as `kind`.
    fn tensor(
        &self,
        name: &str,
        shape: &[usize],
        shard: Shard,
        device: Device,
        kind: Kind,
    ) -> Result<Tensor>;

    /// This rank's `shard` of `name` as stored (no conversion), on `device`; its dtype must be
    /// one of `accept` (quantized weights: float8_e4m3fn values, packed int32 codes).
    fn stored(
        &self,
        name: &str,
        shape: &[usize],
        shard: Shard,
        device: Device,
        accept: &[Kind],
    ) -> Result<Tensor>;

    /// Whether the source holds a tensor named `name` (which linears carry FP8 scales).
    fn has(&self, name: &str) -> bool;

    /// How the checkpoint's linear weights are stored.
    fn quantization(&self) -> &Quantization;

    /// Whether returned tensors hold the checkpoint's values (false for a dry run's
    /// placeholders, whose values must not be checked).
    fn reads_data(&self) -> bool;

    /// `parts` (tensors this source returned) joined along dimension 0.
    fn concat(&self, parts: Vec<Tensor>) -> Result<Tensor>;
}

/// What every layer needs to load its rank's slice of its weights.
pub(crate) struct LoadCtx<'a> {
    /// Where tensors come from.
    pub source: &'a dyn TensorSource,
    /// This rank's communicator.
    pub comm: Rc<dyn Communicator>,
    /// Where the weights go.
    pub device: Device,
    /// The compute dtype.
    pub kind: Kind,
    /// How the layers compute.
    pub kernels: Kernels,
    /// Whether a quantized stack of experts is dequantized once as its layer loads and held
    /// so, rather than in every forward: a streamed layer serves every batch of its pass, and
    /// the memory plan already counts the dequantized stack (as per-forward scratch).
    pub hold_dequantized: bool,
}

impl LoadCtx<'_> {
    /// This rank's part of dimension `dim` of `name` (full shape `shape`).
    pub fn split(&self, name: &str, shape: &[usize], dim: usize) -> Result<Tensor> {
        self.source
            .tensor(name, shape, self.split_shard(dim), self.device, self.kind)
    }

    /// This rank's equal part of dimension `dim` of a tensor.
    pub fn split_shard(&self, dim: usize) -> Shard {
        Shard::Split {
            dim,
            rank: self.comm.rank(),
            world: self.comm.world_size(),
        }
    }

    /// The whole of `name`, replicated on every rank.
    pub fn full(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.source
            .tensor(name, shape, Shard::Full, self.device, self.kind)
    }

    /// The whole of `name` in f32 whatever the compute dtype: weights transformers keeps in f32
    /// (DeepSeek-V3's router and its correction bias).
    pub fn full_f32(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.source
            .tensor(name, shape, Shard::Full, self.device, Kind::Float)
    }

    /// Rows `start..end` of `name` (full shape `shape`).
    pub fn rows(&self, name: &str, shape: &[usize], start: usize, end: usize) -> Result<Tensor> {
        self.source.tensor(
            name,
            shape,
            Shard::Rows { start, end },
            self.device,
            self.kind,
        )
    }

    /// Tensors loaded through this context, stacked along dimension 0.
    pub fn concat(&self, parts: Vec<Tensor>) -> Result<Tensor> {
        self.source.concat(parts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_split_names_the_dimension_that_does_not_divide() {
        let split = |world| Shard::Split {
            dim: 1,
            rank: 0,
            world,
        };
        assert_eq!(split(2).local_shape("w", &[4, 6]), Ok(vec![4, 3]));
        assert_eq!(
            split(4).local_shape("w", &[4, 6]).unwrap_err().to_string(),
            "tensor \"w\": dimension 1 of size 6 does not split into 4 equal parts"
        );
        let rows = Shard::Rows { start: 3, end: 5 };
        assert_eq!(rows.local_shape("e", &[5, 2]), Ok(vec![2, 2]));
    }
}
