//! Megatron-style tensor-parallel layers. A column-parallel linear holds a slice of the
//! output features and needs no communication; a row-parallel linear holds a slice of the
//! input features and all-reduces its partial products, so the residual stream is complete
//! on every rank after each one.
use std::rc::Rc;

use tch::{Device, Kind, Tensor};

use crate::comm::Communicator;
use crate::error::Result;
use crate::weights::{Shard, Weights};

/// What every layer needs to load its rank's slice of its weights.
pub struct LoadCtx<'a> {
    /// The checkpoint.
    pub weights: &'a Weights,
    /// This rank's communicator.
    pub comm: Rc<dyn Communicator>,
    /// Where the weights go.
    pub device: Device,
    /// The compute dtype.
    pub kind: Kind,
}

impl LoadCtx<'_> {
    /// This rank's part of dimension `dim` of `name` (full shape `shape`).
    pub fn split(&self, name: &str, shape: &[usize], dim: usize) -> Result<Tensor> {
        let shard = Shard::Split {
            dim,
            rank: self.comm.rank(),
            world: self.comm.world_size(),
        };
        self.weights
            .load(name, shape, shard, self.device, self.kind)
    }

    /// The whole of `name`, replicated on every rank.
    pub fn full(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.weights
            .load(name, shape, Shard::Full, self.device, self.kind)
    }
}

/// `y = x W^T + b` with `W: [out, in]` split along `out`; each rank produces `out / tp` features.
pub struct ColumnParallelLinear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl ColumnParallelLinear {
    /// Loads `<prefix>.weight` (and `<prefix>.bias` if `bias`) of full shape `[out, in]`.
    pub fn load(
        ctx: &LoadCtx,
        prefix: &str,
        in_features: usize,
        out_features: usize,
        bias: bool,
    ) -> Result<Self> {
        let weight = ctx.split(&format!("{prefix}.weight"), &[out_features, in_features], 0)?;
        let bias = if bias {
            Some(ctx.split(&format!("{prefix}.bias"), &[out_features], 0)?)
        } else {
            None
        };
        Ok(ColumnParallelLinear { weight, bias })
    }

    /// `[.., in] -> [.., out / tp]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.f_linear(&self.weight, self.bias.as_ref())?)
    }
}

/// `y = x W^T + b` with `W: [out, in]` split along `in`; partial products are summed across ranks.
pub struct RowParallelLinear {
    weight: Tensor,
    bias: Option<Tensor>,
    comm: Rc<dyn Communicator>,
}

impl RowParallelLinear {
    /// Loads `<prefix>.weight` (and `<prefix>.bias` if `bias`) of full shape `[out, in]`.
    pub fn load(
        ctx: &LoadCtx,
        prefix: &str,
        in_features: usize,
        out_features: usize,
        bias: bool,
    ) -> Result<Self> {
        let weight = ctx.split(&format!("{prefix}.weight"), &[out_features, in_features], 1)?;
        // The bias is added once, after the sum, so every rank holds all of it.
        let bias = if bias {
            Some(ctx.full(&format!("{prefix}.bias"), &[out_features])?)
        } else {
            None
        };
        Ok(RowParallelLinear {
            weight,
            bias,
            comm: ctx.comm.clone(),
        })
    }

    /// `[.., in / tp] -> [.., out]`, complete on every rank.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut y = x.f_linear::<Tensor>(&self.weight, None)?;
        self.comm.all_reduce_sum(&mut y)?;
        Ok(match &self.bias {
            Some(b) => y.f_add(b)?,
            None => y,
        })
    }
}

/// Token embedding split by vocabulary rows: each rank looks up the ids it owns, writes
/// zeros for the rest, and the all-reduce assembles the full `[.., hidden]` rows.
pub struct VocabParallelEmbedding {
    weight: Tensor,
    start: i64,
    end: i64,
    comm: Rc<dyn Communicator>,
}

impl VocabParallelEmbedding {
    /// Loads rows of `<name>` (full shape `[vocab, hidden]`) owned by this rank.
    pub fn load(ctx: &LoadCtx, name: &str, vocab: usize, hidden: usize) -> Result<Self> {
        let world = ctx.comm.world_size();
        let per_rank = vocab.div_ceil(world);
        let start = (ctx.comm.rank() * per_rank).min(vocab);
        let end = (start + per_rank).min(vocab);
        let weight = ctx.weights.load(
            name,
            &[vocab, hidden],
            Shard::Rows { start, end },
            ctx.device,
            ctx.kind,
        )?;
        Ok(VocabParallelEmbedding {
            weight,
            start: start as i64,
            end: end as i64,
            comm: ctx.comm.clone(),
        })
    }

    /// `[b, t]` token ids (int64) -> `[b, t, hidden]`.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        if self.comm.world_size() == 1 {
            return Ok(Tensor::f_embedding(&self.weight, ids, -1, false, false)?);
        }
        let owned = ids.f_ge(self.start)?.f_logical_and(&ids.f_lt(self.end)?)?;
        let rows = self.end - self.start;
        if rows == 0 {
            // More ranks than rows: this rank contributes nothing but must still join the sum.
            let mut sizes = ids.size();
            sizes.push(self.weight.size()[1]);
            let mut out = Tensor::f_zeros(&sizes, (self.weight.kind(), self.weight.device()))?;
            self.comm.all_reduce_sum(&mut out)?;
            return Ok(out);
        }
        let local = ids.f_sub_scalar(self.start)?.f_clamp(0, rows - 1)?;
        let mut out = Tensor::f_embedding(&self.weight, &local, -1, false, false)?
            .f_mul(&owned.f_unsqueeze(-1)?.f_to_kind(self.weight.kind())?)?;
        self.comm.all_reduce_sum(&mut out)?;
        Ok(out)
    }
}
