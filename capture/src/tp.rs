//! Megatron-style tensor-parallel layers. A column-parallel linear holds a slice of the
//! output features and needs no communication; a row-parallel linear holds a slice of the
//! input features and all-reduces its partial products, so the residual stream is complete
//! on every rank after each one.
use std::rc::Rc;

use tch::Tensor;

use crate::comm::Communicator;
use crate::error::{CaptureError, Result};
use crate::load::LoadCtx;

/// Checks that `tp` ranks can split every one of `counts` (name, size) evenly; the error names
/// them all and the sizes that would work.
pub(crate) fn check_split(tp: usize, counts: &[(&str, usize)]) -> Result<()> {
    let fits = |t: usize| t > 0 && counts.iter().all(|(_, n)| n.is_multiple_of(t));
    if fits(tp) {
        return Ok(());
    }
    let smallest = counts.iter().map(|(_, n)| *n).min().unwrap_or(1);
    let valid: Vec<String> = (1..=smallest)
        .filter(|&t| fits(t))
        .map(|t| t.to_string())
        .collect();
    Err(CaptureError::TensorParallelSize {
        tp,
        counts: counts
            .iter()
            .map(|(name, n)| format!("{name} = {n}"))
            .collect::<Vec<_>>()
            .join(", "),
        valid: valid.join(", "),
    })
}

/// `y = x W^T + b` with `W: [out, in]` split along `out`; each rank produces `out / tp` features.
pub(crate) struct ColumnParallelLinear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl ColumnParallelLinear {
    /// Several column-parallel linears over the same input, run as one GEMM: `parts` are
    /// `(prefix, full out_features)`, and this rank's rows of each `<prefix>.weight` (and
    /// `.bias`) are stacked in that order, so the output holds this rank's `out_0 / tp`
    /// features, then its `out_1 / tp`, and so on. Each rank stacks only its own slices,
    /// which keeps the Megatron split of every part (and its heads) unchanged.
    pub fn load_fused(
        ctx: &LoadCtx,
        parts: &[(&str, usize)],
        in_features: usize,
        bias: bool,
    ) -> Result<Self> {
        let stack = |suffix: &str, with_in: bool| -> Result<Tensor> {
            let slices = parts
                .iter()
                .map(|(prefix, out)| {
                    let shape = if with_in {
                        vec![*out, in_features]
                    } else {
                        vec![*out]
                    };
                    ctx.split(&format!("{prefix}.{suffix}"), &shape, 0)
                })
                .collect::<Result<Vec<_>>>()?;
            ctx.concat(slices)
        };
        let weight = stack("weight", true)?;
        let bias = if bias {
            Some(stack("bias", false)?)
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
pub(crate) struct RowParallelLinear {
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
        if self.comm.world_size() == 1 {
            // Nothing to sum, so the bias goes into the GEMM as in transformers' nn.Linear.
            return Ok(x.f_linear(&self.weight, self.bias.as_ref())?);
        }
        let mut y = x.f_linear::<Tensor>(&self.weight, None)?;
        self.comm.all_reduce_sum(&mut y)?;
        Ok(match &self.bias {
            Some(b) => y.f_add_(b)?,
            None => y,
        })
    }
}

/// Token embedding split by vocabulary rows: each rank looks up the ids it owns, writes
/// zeros for the rest, and the all-reduce assembles the full `[.., hidden]` rows.
pub(crate) struct VocabParallelEmbedding {
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
        let weight = ctx.rows(name, &[vocab, hidden], start, end)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::Checkpoint;
    use crate::comm::LocalComm;
    use safetensors::tensor::TensorView;
    use tch::{Device, Kind};

    /// A checkpoint of f32 tensors whose values are `0, 1, 2, ...` scaled by `1/8`.
    fn checkpoint(dir: &std::path::Path, tensors: &[(&str, Vec<usize>)]) -> Checkpoint {
        let bytes: Vec<Vec<u8>> = tensors
            .iter()
            .enumerate()
            .map(|(k, (_, s))| {
                (0..s.iter().product::<usize>())
                    .flat_map(|i| ((i + 10 * k) as f32 / 8.0).to_le_bytes())
                    .collect()
            })
            .collect();
        let views: Vec<(String, TensorView)> = tensors
            .iter()
            .zip(&bytes)
            .map(|((n, s), b)| {
                let view = TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap();
                (n.to_string(), view)
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
        Checkpoint::open(dir).unwrap()
    }

    fn ctx(checkpoint: &Checkpoint, comm: LocalComm) -> LoadCtx<'_> {
        LoadCtx {
            source: checkpoint,
            comm: Rc::new(comm),
            device: Device::Cpu,
            kind: Kind::Float,
            norm: Default::default(),
        }
    }

    #[test]
    fn fused_columns_equal_each_ranks_separate_projections_side_by_side() {
        let d = tempfile::tempdir().unwrap();
        let w = checkpoint(
            d.path(),
            &[
                ("a.weight", vec![4, 3]),
                ("a.bias", vec![4]),
                ("b.weight", vec![2, 3]),
                ("b.bias", vec![2]),
            ],
        );
        let x = Tensor::from_slice(&[1.0f32, -2.0, 0.5, 3.0, 0.25, -1.0]).view([1, 2, 3]);
        for comm in LocalComm::group(2) {
            let c = ctx(&w, comm);
            let fused = ColumnParallelLinear::load_fused(&c, &[("a", 4), ("b", 2)], 3, true)
                .unwrap()
                .forward(&x)
                .unwrap();
            let a = ColumnParallelLinear::load_fused(&c, &[("a", 4)], 3, true).unwrap();
            let b = ColumnParallelLinear::load_fused(&c, &[("b", 2)], 3, true).unwrap();
            let separate = Tensor::cat(&[a.forward(&x).unwrap(), b.forward(&x).unwrap()], -1);
            // Each rank holds 2 of a's 4 features and 1 of b's 2.
            assert_eq!(fused.size(), vec![1, 2, 3]);
            assert!(fused.allclose(&separate, 1e-6, 1e-6, false));
        }
    }

    #[test]
    fn fused_load_names_the_missing_or_misshapen_original_tensor() {
        let d = tempfile::tempdir().unwrap();
        let w = checkpoint(
            d.path(),
            &[("a.weight", vec![4, 3]), ("b.weight", vec![2, 3])],
        );
        let c = ctx(&w, LocalComm::group(1).remove(0));
        let load = |parts: &[(&str, usize)], bias| {
            ColumnParallelLinear::load_fused(&c, parts, 3, bias)
                .err()
                .unwrap()
                .to_string()
        };
        let e = load(&[("a", 4), ("b", 2)], true);
        assert!(e.contains("missing tensor \"a.bias\""), "{e}");
        let e = load(&[("a", 4), ("b", 5)], false);
        assert!(e.contains("tensor \"b.weight\" has shape [2, 3]"), "{e}");
    }

    #[test]
    fn impossible_tp_size_names_the_counts_and_the_sizes_that_work() {
        // SmolLM2-135M: 9 heads, 3 KV heads, MLP 1536.
        let counts = [
            ("num_attention_heads", 9),
            ("num_key_value_heads", 3),
            ("intermediate_size", 1536),
        ];
        assert!(check_split(3, &counts).is_ok());
        let e = check_split(2, &counts).unwrap_err().to_string();
        assert_eq!(
            e,
            "tensor-parallel size 2 is impossible for this model: num_attention_heads = 9, \
             num_key_value_heads = 3, intermediate_size = 1536; the TP size must divide each of \
             them (valid here: 1, 3)"
        );
    }
}
