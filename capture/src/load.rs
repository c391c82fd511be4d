//! What every layer needs to load its rank's slice of its weights: where tensors come from (a
//! checkpoint, or a dry run that only checks them), the communicator, the device, the compute
//! dtype and the kernel choices. Layers and tensor-parallel linears both depend on this, never
//! on each other's options.
use std::rc::Rc;

use tch::{Device, Kind, Tensor};

use crate::comm::Communicator;
use crate::error::{Result, TensorProblem};
use crate::quant::{Quantization, Weight};

/// How RMS norms are computed on CUDA.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NormKernel {
    /// transformers' own sequence of operations (an f32 copy of `x`, its square, their mean,
    /// `(x * rstd)` rounded to the compute dtype, then `* weight` rounded again):
    /// bit-identical to transformers.
    Exact,
    /// The same two roundings, but the mean square comes from one f32 reduction over `x` (no
    /// f32 copy, no squared copy): 40 % of the memory traffic. `rstd` can differ from the exact
    /// one in its last f32 bit, which moves a bf16 rounding in about one element in 10^5.
    #[default]
    Fast,
}

impl std::str::FromStr for NormKernel {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "exact" => Ok(NormKernel::Exact),
            "fast" => Ok(NormKernel::Fast),
            _ => Err(format!("unknown norm kernel {s:?}; expected exact or fast")),
        }
    }
}

/// How a MoE layer runs its routed experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MoeKernel {
    /// One GEMM pair per expert over its tokens (a stable sort by expert first); quantized
    /// experts are dequantized one at a time.
    Loop,
    /// All of a layer's experts in two grouped GEMMs (libtorch's `_grouped_mm`, as
    /// transformers' `grouped_mm` experts run), their weights stacked at load; a quantized
    /// stack is dequantized whole as the layer runs. Shapes the kernel cannot take keep the
    /// loop. The default: on an H200 1.49x the loop on Qwen3-30B-A3B's 128 narrow experts, equal
    /// on DeepSeek-V3's 256 wide ones.
    #[default]
    Grouped,
}

impl std::str::FromStr for MoeKernel {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "loop" => Ok(MoeKernel::Loop),
            "grouped" => Ok(MoeKernel::Grouped),
            _ => Err(format!(
                "unknown MoE kernel {s:?}; expected loop or grouped"
            )),
        }
    }
}

/// How FP8 and INT4 weights are dequantized on a GPU (on the CPU always with PyTorch
/// operations). Both give the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DequantKernel {
    /// One kernel of our own per weight, compiled at first use by NVRTC: reads each stored
    /// byte once and writes the matrix once (falls back to `torch` where it does not apply).
    #[default]
    Fused,
    /// PyTorch operations: two or three passes over memory.
    Torch,
}

impl std::str::FromStr for DequantKernel {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "fused" => Ok(DequantKernel::Fused),
            "torch" => Ok(DequantKernel::Torch),
            _ => Err(format!(
                "unknown dequantization kernel {s:?}; expected fused or torch"
            )),
        }
    }
}

/// What a row-parallel linear sums across tensor-parallel ranks (unused at TP 1, where there is
/// nothing to sum and the GEMM rounds its output once, as transformers' does).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TpReduce {
    /// Each rank's partial product stays in f32 (a bf16 x bf16 -> f32 GEMM), the all-reduce
    /// sums f32, and the sum (plus bias) is rounded to the compute dtype once: the single
    /// rounding of TP 1, at twice the all-reduce bytes.
    #[default]
    F32,
    /// Partial products rounded to the compute dtype and summed in it: every row-parallel
    /// layer rounds twice more than at TP 1, and the error compounds through the depth.
    Compute,
}

impl TpReduce {
    /// The name the CLI takes (`f32` or `bf16`).
    pub fn name(self) -> &'static str {
        match self {
            TpReduce::F32 => "f32",
            TpReduce::Compute => "bf16",
        }
    }
}

impl std::fmt::Display for TpReduce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for TpReduce {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "f32" => Ok(TpReduce::F32),
            // The compute dtype: "bf16" is what it is in practice, "compute" says it for f16.
            "bf16" | "compute" => Ok(TpReduce::Compute),
            _ => Err(format!(
                "unknown tensor-parallel reduction {s:?}; expected f32 or bf16 (the compute dtype)"
            )),
        }
    }
}

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
    /// How RMS norms are computed.
    pub norm: NormKernel,
    /// What row-parallel linears sum across ranks.
    pub reduce: TpReduce,
    /// How MoE layers run their routed experts.
    pub moe: MoeKernel,
    /// How quantized weights are dequantized.
    pub dequant: DequantKernel,
}

impl LoadCtx<'_> {
    /// This rank's part of dimension `dim` of `name` (full shape `shape`).
    pub fn split(&self, name: &str, shape: &[usize], dim: usize) -> Result<Tensor> {
        let shard = Shard::Split {
            dim,
            rank: self.comm.rank(),
            world: self.comm.world_size(),
        };
        self.source
            .tensor(name, shape, shard, self.device, self.kind)
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

    /// This rank's part of dimension `dim` of the `[out, in]` weight of linear `prefix`, in the
    /// checkpoint's format (dense or quantized).
    pub fn linear_split(&self, prefix: &str, out: usize, inp: usize, dim: usize) -> Result<Weight> {
        let shard = Shard::Split {
            dim,
            rank: self.comm.rank(),
            world: self.comm.world_size(),
        };
        Weight::load(self, prefix, out, inp, shard)
    }

    /// The whole `[out, in]` weight of linear `prefix`, in the checkpoint's format.
    pub fn linear_full(&self, prefix: &str, out: usize, inp: usize) -> Result<Weight> {
        Weight::load(self, prefix, out, inp, Shard::Full)
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
    fn norm_kernel_parses_and_names_the_choices() {
        assert_eq!("fast".parse::<NormKernel>(), Ok(NormKernel::Fast));
        assert_eq!("exact".parse::<NormKernel>(), Ok(NormKernel::Exact));
        let err = "fused".parse::<NormKernel>().unwrap_err();
        assert!(err.contains("exact or fast"), "{err}");
    }

    #[test]
    fn tp_reduce_parses_both_names_and_prints_the_cli_one() {
        assert_eq!("f32".parse::<TpReduce>(), Ok(TpReduce::F32));
        assert_eq!("bf16".parse::<TpReduce>(), Ok(TpReduce::Compute));
        assert_eq!("compute".parse::<TpReduce>(), Ok(TpReduce::Compute));
        assert_eq!(TpReduce::Compute.to_string(), "bf16");
        let err = "f16x".parse::<TpReduce>().unwrap_err();
        assert!(err.contains("expected f32 or bf16"), "{err}");
    }

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
