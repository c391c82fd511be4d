//! Megatron-style tensor-parallel layers. A column-parallel linear holds a slice of the
//! output features and needs no communication; a row-parallel linear holds a slice of the
//! input features and all-reduces its partial products, so the residual stream is complete
//! on every rank after each one.
use std::rc::Rc;

use tch::{Device, Kind, Tensor};

use crate::error::{CaptureError, Result};
use crate::gpu::comm::Communicator;
use crate::kernels::TpReduce;
use crate::load::LoadCtx;
use crate::quant::weight::Weight;
use crate::scalar;

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
    weight: Weight,
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
        let weights = parts
            .iter()
            .map(|(prefix, out)| Weight::split(ctx, prefix, *out, in_features, 0))
            .collect::<Result<Vec<_>>>()?;
        let prefixes: Vec<&str> = parts.iter().map(|(p, _)| *p).collect();
        let weight = Weight::cat(ctx, &prefixes, weights)?;
        let bias = if bias {
            let slices = parts
                .iter()
                .map(|(prefix, out)| ctx.split(&format!("{prefix}.bias"), &[*out], 0))
                .collect::<Result<Vec<_>>>()?;
            Some(ctx.concat(slices)?)
        } else {
            None
        };
        Ok(ColumnParallelLinear { weight, bias })
    }

    /// `[.., in] -> [.., out / tp]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.f_linear(&self.weight.matrix()?, self.bias.as_ref())?)
    }
}

/// `y = x W^T + b` with `W: [out, in]` split along `in`; partial products are summed across ranks.
pub(crate) struct RowParallelLinear {
    weight: Weight,
    bias: Option<Tensor>,
    sum: PartialSum,
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
        let weight = Weight::split(ctx, prefix, out_features, in_features, 1)?;
        // The bias is added once, after the sum, so every rank holds all of it.
        let bias = if bias {
            Some(ctx.full(&format!("{prefix}.bias"), &[out_features])?)
        } else {
            None
        };
        Ok(RowParallelLinear {
            weight,
            bias,
            sum: PartialSum::new(ctx),
        })
    }

    /// `[.., in / tp] -> [.., out]`, complete on every rank.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.sum.world_size() == 1 {
            // Nothing to sum, so the bias goes into the GEMM as in transformers' nn.Linear.
            return Ok(x.f_linear(&self.weight.matrix()?, self.bias.as_ref())?);
        }
        self.sum
            .finish(self.partial(x)?, self.bias.as_ref(), self.weight.kind())
    }

    /// This rank's unsummed `[.., out]` product, without bias, in [`PartialSum::kind`]: for a
    /// caller that adds other partials (a MoE layer's experts) before the one all-reduce.
    pub fn partial(&self, x: &Tensor) -> Result<Tensor> {
        let w = self.weight.matrix()?;
        match self.sum.reduce {
            TpReduce::F32 => linear_f32(x, &w),
            TpReduce::Compute => Ok(x.f_linear::<Tensor>(&w, None)?),
        }
    }
}

/// The all-reduce that completes row-parallel outputs: partials kept in f32 or in the compute
/// dtype (per [`TpReduce`]), summed across ranks, the bias added once and the sum rounded once.
#[derive(Clone)]
pub(crate) struct PartialSum {
    comm: Rc<dyn Communicator>,
    reduce: TpReduce,
}

impl PartialSum {
    /// The context's communicator and reduction.
    pub fn new(ctx: &LoadCtx) -> Self {
        PartialSum {
            comm: ctx.comm.clone(),
            reduce: ctx.kernels.tp_reduce,
        }
    }

    /// Number of ranks taking part.
    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// The dtype partials of a `kind` computation are summed in.
    pub fn kind(&self, kind: Kind) -> Kind {
        match self.reduce {
            TpReduce::F32 => Kind::Float,
            TpReduce::Compute => kind,
        }
    }

    /// Sums `partial` across ranks, adds `bias`, and returns the result as `kind`.
    pub fn finish(&self, mut partial: Tensor, bias: Option<&Tensor>, kind: Kind) -> Result<Tensor> {
        self.comm.all_reduce_sum(&mut partial)?;
        if let Some(b) = bias {
            // In place, so an f32 sum stays f32 and the bias joins it before the one rounding.
            partial = partial.f_add_(b)?;
        }
        Ok(if partial.kind() == kind {
            partial
        } else {
            partial.f_to_kind(kind)?
        })
    }
}

/// `y = x W^T + b` with the whole weight on every rank: the small down-projections (MLA's
/// `q_a_proj`, `kv_a_proj_with_mqa`) whose outputs every rank needs in full.
pub(crate) struct ReplicatedLinear {
    weight: Weight,
    bias: Option<Tensor>,
}

impl ReplicatedLinear {
    /// Loads `<prefix>.weight` of full shape `[out, in]` (and `<prefix>.bias` if `bias`).
    pub fn load(
        ctx: &LoadCtx,
        prefix: &str,
        in_features: usize,
        out_features: usize,
        bias: bool,
    ) -> Result<Self> {
        let weight = Weight::full(ctx, prefix, out_features, in_features)?;
        let bias = if bias {
            Some(ctx.full(&format!("{prefix}.bias"), &[out_features])?)
        } else {
            None
        };
        Ok(ReplicatedLinear { weight, bias })
    }

    /// `[.., in] -> [.., out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.f_linear(&self.weight.matrix()?, self.bias.as_ref())?)
    }
}

/// `x W^T` as f32, the products of `x: [.., in]` and `w: [out, in]` accumulated in f32 and
/// never rounded to their own dtype.
fn linear_f32(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if w.kind() == Kind::Float {
        return Ok(x.f_linear::<Tensor>(w, None)?);
    }
    let mut shape = x.size();
    let inner = shape.last().copied().unwrap_or(0);
    let rows = x.f_reshape([-1, inner])?; // [n, in]
    let y = match x.device() {
        // cuBLAS's bf16 (or f16) GEMM with an f32 output: same speed as the rounded one.
        Device::Cuda(_) => rows.f_mm_dtype(&w.f_tr()?, Kind::Float)?,
        // libtorch 2.11 has no CPU kernel for mm.dtype. A bf16 or f16 product is exact in f32,
        // so the upcast GEMM is the same arithmetic (on this CPU it is also faster than bf16's).
        _ => rows
            .f_to_kind(Kind::Float)?
            .f_mm(&w.f_to_kind(Kind::Float)?.f_tr()?)?,
    }; // [n, out]
    if let Some(last) = shape.last_mut() {
        *last = w.size()[0];
    }
    Ok(y.f_view(shape.as_slice())?)
}

/// Token embedding split by vocabulary rows: each rank looks up the ids it owns, writes
/// zeros for the rest, and the all-reduce assembles the full `[.., hidden]` rows. The sum adds
/// one row to zeros, which is exact in any dtype, so this reduction never rounds.
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
        let (start, end) = (scalar::int(self.start)?, scalar::int(self.end)?);
        let owned = ids
            .f_ge_tensor(&start)?
            .f_logical_and(&ids.f_lt_tensor(&end)?)?;
        let rows = self.end - self.start;
        if rows == 0 {
            // More ranks than rows: this rank contributes nothing but must still join the sum.
            let mut sizes = ids.size();
            sizes.push(self.weight.size()[1]);
            let mut out = Tensor::f_zeros(&sizes, (self.weight.kind(), self.weight.device()))?;
            self.comm.all_reduce_sum(&mut out)?;
            return Ok(out);
        }
        let (first, last) = (scalar::int(0)?, scalar::int(rows - 1)?);
        let local = ids
            .f_sub(&start)?
            .f_clamp_tensor(Some(&first), Some(&last))?;
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
    use crate::gpu::comm::LocalComm;
    use crate::kernels::Kernels;
    use safetensors::tensor::TensorView;

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
            kernels: Kernels::default(),
            hold_dequantized: false,
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

    /// Tiny models that split 4 ways (8 heads over 4 KV heads, MLP 128), one per family, the
    /// Llama one with biases on every projection so the row-parallel bias path runs too.
    const TINY_TP4: &[(&str, &str)] = &[
        (
            "llama_bias",
            r#"{"architectures": ["LlamaForCausalLM"], "attention_bias": true, "mlp_bias": true}"#,
        ),
        (
            "mistral_window",
            r#"{"architectures": ["MistralForCausalLM"], "sliding_window": 5}"#,
        ),
        ("qwen2", r#"{"architectures": ["Qwen2ForCausalLM"]}"#),
        (
            "qwen3_qk_norm",
            r#"{"architectures": ["Qwen3ForCausalLM"], "head_dim": 16}"#,
        ),
    ];

    fn tiny_tp4_config(arch: &str) -> String {
        let mut c: serde_json::Value = serde_json::from_str(arch).unwrap();
        let shared = serde_json::json!({"hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 4,
            "vocab_size": 50, "rms_norm_eps": 1e-5, "rope_theta": 10000.0});
        for (k, v) in shared.as_object().unwrap() {
            c[k] = v.clone();
        }
        c.to_string()
    }

    /// Rank 0's bf16 states (as f32) of every layer and the final norm, run by `tp` in-process
    /// ranks on two sequences of 12 tokens.
    fn bf16_states(dir: &std::path::Path, tp: usize, reduce: TpReduce) -> Vec<Vec<f32>> {
        let points: Vec<_> = (0..3)
            .map(hslake_schemas::CapturePoint::LayerOutput)
            .chain([hslake_schemas::CapturePoint::FinalNorm])
            .collect();
        let ids: Vec<i64> = (0..24).map(|i| (i * 17 + 3) % 50).collect();
        std::thread::scope(|s| {
            let ranks: Vec<_> = LocalComm::group(tp)
                .into_iter()
                .map(|comm| {
                    let (points, ids) = (&points, &ids);
                    s.spawn(move || {
                        let _no_grad = tch::no_grad_guard();
                        let cfg = crate::models::registry::read_config(dir).unwrap();
                        let w = Checkpoint::open(dir).unwrap();
                        let mut c = ctx(&w, comm);
                        c.kind = Kind::BFloat16;
                        c.kernels.tp_reduce = reduce;
                        let model = cfg.load(&c).unwrap();
                        let ids = Tensor::from_slice(ids).view([2, 12]);
                        let states = model.forward(&ids, points).unwrap();
                        states
                            .iter()
                            .map(|t| Vec::<f32>::try_from(t.to_kind(Kind::Float).flatten(0, -1)))
                            .collect::<std::result::Result<Vec<_>, _>>()
                            .unwrap()
                    })
                })
                .collect();
            let mut all: Vec<_> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
            all.swap_remove(0)
        })
    }

    /// The smallest cosine between corresponding 64-wide token vectors of `a` and `b`.
    fn min_token_cosine(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
        let mut worst = 1.0f64;
        for (x, y) in a.iter().zip(b) {
            assert_eq!(x.len(), y.len());
            for (u, v) in x.chunks(64).zip(y.chunks(64)) {
                let dot: f64 = u.iter().zip(v).map(|(p, q)| *p as f64 * *q as f64).sum();
                let norm = |w: &[f32]| w.iter().map(|p| (*p as f64).powi(2)).sum::<f64>().sqrt();
                worst = worst.min(dot / (norm(u) * norm(v)).max(1e-30));
            }
        }
        worst
    }

    #[test]
    fn f32_reduction_keeps_tp_two_and_four_as_close_to_tp_one_as_one_rounding_allows() {
        let d = tempfile::tempdir().unwrap();
        for (name, arch) in TINY_TP4 {
            let dir = d.path().join(name);
            crate::fixtures::write_model(&dir, &tiny_tp4_config(arch), None);
            let one = bf16_states(&dir, 1, TpReduce::F32);
            for tp in [2, 4] {
                let f32_sum = min_token_cosine(&one, &bf16_states(&dir, tp, TpReduce::F32));
                // The reason for the f32 reduction: partials rounded to bf16 and summed in
                // bf16 round twice more per row-parallel layer than TP 1 does.
                let bf16_sum = min_token_cosine(&one, &bf16_states(&dir, tp, TpReduce::Compute));
                eprintln!(
                    "{name} TP {tp} vs TP 1, min per-token cosine: f32 reduction {f32_sum:.8}, \
                     bf16 reduction {bf16_sum:.8}"
                );
                assert!(
                    f32_sum >= 0.99999,
                    "{name} TP {tp}: f32 reduction {f32_sum}"
                );
                assert!(
                    bf16_sum < f32_sum,
                    "{name} TP {tp}: bf16 reduction {bf16_sum} is no worse than f32's {f32_sum}"
                );
            }
        }
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
