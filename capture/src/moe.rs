//! Mixture-of-experts feed-forward blocks: a router that picks each token's experts (Qwen3-MoE's
//! softmax top-k, or DeepSeek-V3's sigmoid scores with a correction bias and group-limited
//! top-k), this rank's routed experts, and an optional shared expert.
//!
//! Expert parallelism for prefill: rank `r` of `tp` holds whole experts
//! `[r * E / tp, (r + 1) * E / tp)`, routes every token itself (the router is replicated), runs
//! only its own experts on the tokens routed to them, and adds its slice of the shared expert
//! (a TP-split SwiGLU MLP). One all-reduce — the row-parallel one — completes the layer, so no
//! all-to-all is needed.
//!
//! Checkpoint layout (`<p>` = `model.layers.<i>.mlp`): `<p>.gate.weight` `[E, hidden]`,
//! DeepSeek's `<p>.gate.e_score_correction_bias` `[E]`, `<p>.experts.<j>.{gate,up}_proj.weight`
//! `[moe_intermediate, hidden]`, `<p>.experts.<j>.down_proj.weight` `[hidden, moe_intermediate]`,
//! `<p>.shared_experts.{gate,up,down}_proj.weight`. This is what transformers 5.24's
//! `save_pretrained` writes too (it fuses experts in memory only).
use tch::{Device, Kind, Tensor};

use crate::error::Result;
use crate::layers::Mlp;
use crate::load::{LoadCtx, MoeKernel};
use crate::quant::Weight;
use crate::tp::{check_split, PartialSum};

/// How a router turns logits into each token's experts and their weights.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Routing {
    /// Qwen3-MoE: logits in the compute dtype, softmax in f32, top-k, optionally renormalised,
    /// weights back in the compute dtype.
    Softmax {
        /// Renormalise the chosen probabilities to sum to 1.
        norm_topk_prob: bool,
    },
    /// DeepSeek-V3: f32 logits, sigmoid scores; experts chosen by score + correction bias within
    /// the best `topk_group` of `n_group` groups (a group's score: its two best); weights are
    /// the plain scores, optionally renormalised, times `routed_scaling_factor`.
    GroupedSigmoid {
        /// Expert groups.
        n_group: usize,
        /// Groups a token may draw experts from.
        topk_group: usize,
        /// Renormalise the chosen scores to sum to 1.
        norm_topk_prob: bool,
        /// Multiplies the weights.
        routed_scaling_factor: f64,
    },
}

/// A MoE feed-forward block's shape and routing.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct MoeSpec {
    /// Config field that counts the routed experts (named in errors).
    pub experts_field: &'static str,
    /// Routed experts.
    pub num_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Each routed expert's MLP width.
    pub intermediate_size: usize,
    /// The shared expert's MLP width, if the block has one.
    pub shared_intermediate_size: Option<usize>,
    /// How experts are chosen.
    pub routing: Routing,
}

impl MoeSpec {
    /// What is wrong with these values, if anything (for the family's parser to wrap).
    pub fn problem(&self) -> Option<String> {
        let (e, k) = (self.num_experts, self.top_k);
        if e == 0 || self.intermediate_size == 0 {
            return Some(format!(
                "{} = {e} and moe_intermediate_size = {} must be > 0",
                self.experts_field, self.intermediate_size
            ));
        }
        if k == 0 || k > e {
            return Some(format!(
                "num_experts_per_tok = {k} must be between 1 and {} = {e}",
                self.experts_field
            ));
        }
        if let Routing::GroupedSigmoid {
            n_group,
            topk_group,
            ..
        } = self.routing
        {
            if n_group == 0 || !e.is_multiple_of(n_group) {
                return Some(format!(
                    "{} = {e} is not a multiple of n_group = {n_group}",
                    self.experts_field
                ));
            }
            if e / n_group < 2 {
                return Some(format!(
                    "n_group = {n_group} leaves {} expert(s) per group; a group's score needs 2",
                    e / n_group
                ));
            }
            if topk_group == 0 || topk_group > n_group {
                return Some(format!(
                    "topk_group = {topk_group} must be between 1 and n_group = {n_group}"
                ));
            }
            if k > topk_group * (e / n_group) {
                return Some(format!(
                    "num_experts_per_tok = {k} exceeds the {} experts of topk_group = {topk_group} groups",
                    topk_group * (e / n_group)
                ));
            }
        }
        None
    }
}

/// Which decoder layers have a MoE block (the others a dense MLP), and its shape.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct MoeLayers {
    /// The block every sparse layer has.
    pub spec: MoeSpec,
    /// Per decoder layer: sparse or dense.
    pub sparse: Vec<bool>,
}

impl MoeLayers {
    /// Whether any layer is dense / sparse.
    fn has(&self, sparse: bool) -> bool {
        self.sparse.contains(&sparse)
    }

    /// The counts tensor parallelism must split: the dense MLP width if a dense layer exists
    /// (`dense` names it), the routed experts and the shared expert's width if a sparse one does.
    pub fn split_counts(&self, dense: (&'static str, usize)) -> Vec<(&'static str, usize)> {
        let mut counts = Vec::new();
        if self.has(false) {
            counts.push(dense);
        }
        if self.has(true) {
            counts.push((self.spec.experts_field, self.spec.num_experts));
            if let Some(width) = self.spec.shared_intermediate_size {
                counts.push(("moe_intermediate_size * n_shared_experts", width));
            }
        }
        counts
    }
}

/// A decoder layer's feed-forward sublayer.
pub(crate) enum FeedForward {
    /// SwiGLU MLP, TP-split.
    Dense(Mlp),
    /// Routed experts (and a shared one), experts divided among ranks.
    Sparse(Box<SparseMoe>),
}

impl FeedForward {
    /// `<prefix>` (`model.layers.<i>.mlp`) of layer `layer`: sparse if `moe` says so, else a
    /// dense MLP of width `dense_intermediate` (with biases if `bias`).
    pub fn load(
        ctx: &LoadCtx,
        prefix: &str,
        layer: usize,
        hidden: usize,
        dense_intermediate: usize,
        bias: bool,
        moe: Option<&MoeLayers>,
    ) -> Result<Self> {
        match moe {
            Some(m) if m.sparse.get(layer).copied().unwrap_or(false) => Ok(FeedForward::Sparse(
                Box::new(SparseMoe::load(ctx, prefix, hidden, &m.spec)?),
            )),
            _ => Ok(FeedForward::Dense(Mlp::load(
                ctx,
                prefix,
                hidden,
                dense_intermediate,
                bias,
            )?)),
        }
    }

    /// `[b, t, hidden] -> [b, t, hidden]`, complete on every rank.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            FeedForward::Dense(m) => m.forward(x),
            FeedForward::Sparse(m) => m.forward(x),
        }
    }
}

/// Router, this rank's experts, the shared expert's slice, and the all-reduce that sums them.
pub(crate) struct SparseMoe {
    router: Router,
    experts: Experts,
    shared: Option<Mlp>,
    sum: PartialSum,
}

impl SparseMoe {
    /// Loads `<prefix>.{gate,experts.<j>,shared_experts}` for this rank.
    pub fn load(ctx: &LoadCtx, prefix: &str, hidden: usize, spec: &MoeSpec) -> Result<Self> {
        let shared = match spec.shared_intermediate_size {
            Some(width) => Some(Mlp::load(
                ctx,
                &format!("{prefix}.shared_experts"),
                hidden,
                width,
                false,
            )?),
            None => None,
        };
        Ok(SparseMoe {
            router: Router::load(ctx, &format!("{prefix}.gate"), hidden, spec)?,
            experts: Experts::load(ctx, &format!("{prefix}.experts"), hidden, spec)?,
            shared,
            sum: PartialSum::new(ctx),
        })
    }

    /// `[b, t, hidden] -> [b, t, hidden]`, complete on every rank.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let size = x.size();
        let hidden = size[size.len() - 1];
        // 1. Route every token: [b * t, hidden] -> weights and expert ids, each [b * t, top_k].
        let tokens = x.f_reshape([-1, hidden])?;
        let (weights, ids) = self.router.route(&tokens)?;
        // 2. This rank's experts on their tokens, weighted: [b * t, hidden] -> [b, t, hidden].
        let routed = self
            .experts
            .forward(&tokens, &weights, &ids)?
            .f_view(size.as_slice())?;
        // 3. Shared expert and the sum. At TP 1 exactly transformers' `routed + shared(x)`;
        //    otherwise both join one partial (the shared expert's is unsummed) and one all-reduce.
        if self.sum.world_size() == 1 {
            return match &self.shared {
                Some(s) => Ok(routed.f_add(&s.forward(x)?)?),
                None => Ok(routed),
            };
        }
        let kind = x.kind();
        let partial = match &self.shared {
            Some(s) => s.partial(x)?.f_add_(&routed)?,
            None => routed.f_to_kind(self.sum.kind(kind))?,
        };
        self.sum.finish(partial, None, kind)
    }
}

/// Chooses each token's experts; replicated on every rank.
struct Router {
    /// `[E, hidden]`: compute dtype for softmax routing, f32 for DeepSeek's.
    weight: Tensor,
    /// DeepSeek's `e_score_correction_bias` `[E]` (f32).
    correction: Option<Tensor>,
    top_k: i64,
    routing: Routing,
}

impl Router {
    /// Loads `<prefix>.weight` (and DeepSeek's `<prefix>.e_score_correction_bias`).
    fn load(ctx: &LoadCtx, prefix: &str, hidden: usize, spec: &MoeSpec) -> Result<Self> {
        let (e, weight) = (spec.num_experts, format!("{prefix}.weight"));
        let (weight, correction) = match spec.routing {
            Routing::Softmax { .. } => (ctx.full(&weight, &[e, hidden])?, None),
            // transformers keeps this router in f32 whatever the model's dtype
            // (`_keep_in_fp32_modules_strict`), so its choices do not depend on it.
            Routing::GroupedSigmoid { .. } => (
                ctx.full_f32(&weight, &[e, hidden])?,
                Some(ctx.full_f32(&format!("{prefix}.e_score_correction_bias"), &[e])?),
            ),
        };
        Ok(Router {
            weight,
            correction,
            top_k: spec.top_k as i64,
            routing: spec.routing.clone(),
        })
    }

    /// `[n, hidden]` -> (weights `[n, top_k]`, expert ids `[n, top_k]` int64).
    fn route(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        match (&self.routing, &self.correction) {
            (Routing::Softmax { norm_topk_prob }, _) => softmax_top_k(
                &x.f_linear::<Tensor>(&self.weight, None)?,
                self.top_k,
                *norm_topk_prob,
            ),
            (
                Routing::GroupedSigmoid {
                    n_group,
                    topk_group,
                    norm_topk_prob,
                    routed_scaling_factor,
                },
                Some(correction),
            ) => {
                let logits = x
                    .f_to_kind(Kind::Float)?
                    .f_linear::<Tensor>(&self.weight, None)?;
                grouped_sigmoid_top_k(
                    &logits,
                    correction,
                    GroupedTopK {
                        top_k: self.top_k,
                        n_group: *n_group as i64,
                        topk_group: *topk_group as i64,
                        norm_topk_prob: *norm_topk_prob,
                        routed_scaling_factor: *routed_scaling_factor,
                    },
                )
            }
            (Routing::GroupedSigmoid { .. }, None) => Err(crate::error::CaptureError::Pipeline(
                "a grouped sigmoid router was loaded without its correction bias".into(),
            )),
        }
    }
}

/// Qwen3-MoE's routing of `logits: [n, E]` (compute dtype): softmax in f32, the `k` largest,
/// renormalised if `norm`, weights returned in the logits' dtype.
fn softmax_top_k(logits: &Tensor, k: i64, norm: bool) -> Result<(Tensor, Tensor)> {
    let probs = logits.f_softmax(-1, Kind::Float)?;
    let (mut top, ids) = probs.f_topk(k, -1, true, true)?;
    if norm {
        top = top.f_div(&top.f_sum_dim_intlist([-1i64].as_slice(), true, None)?)?;
    }
    Ok((top.f_to_kind(logits.kind())?, ids))
}

/// DeepSeek-V3's router settings for one call of [`grouped_sigmoid_top_k`].
#[derive(Debug, Clone, Copy)]
struct GroupedTopK {
    top_k: i64,
    n_group: i64,
    topk_group: i64,
    norm_topk_prob: bool,
    routed_scaling_factor: f64,
}

/// DeepSeek-V3's routing of f32 `logits: [n, E]`, in transformers' `DeepseekV3TopkRouter`
/// order of operations (its `topk` calls and `sorted` flags too, so ties break alike).
fn grouped_sigmoid_top_k(
    logits: &Tensor,
    correction: &Tensor,
    p: GroupedTopK,
) -> Result<(Tensor, Tensor)> {
    let (n, e) = (logits.size()[0], logits.size()[1]);
    let per_group = e / p.n_group;
    // 1. Scores, and the biased scores that only choose: [n, E].
    let scores = logits.f_sigmoid()?;
    let choice = scores.f_add(correction)?;
    // 2. A group's score is the sum of its two best biased scores: [n, n_group]; keep the best
    //    `topk_group` groups and hide every other expert.
    let group_scores = choice
        .f_view([n, p.n_group, per_group])?
        .f_topk(2, -1, true, true)?
        .0
        .f_sum_dim_intlist([-1i64].as_slice(), false, None)?;
    let group_idx = group_scores.f_topk(p.topk_group, -1, true, false)?.1;
    let mut group_mask = group_scores.f_zeros_like()?;
    let _ = group_mask.f_scatter_value_(1, &group_idx, 1.0)?;
    let expert_mask = group_mask
        .f_unsqueeze(-1)?
        .f_expand([n, p.n_group, per_group], false)?
        .f_reshape([n, e])?
        .f_to_kind(Kind::Bool)?;
    let choice = choice.f_masked_fill(&expert_mask.f_logical_not()?, f64::NEG_INFINITY)?;
    // 3. The top-k experts among those; their weights are the unbiased scores.
    let ids = choice.f_topk(p.top_k, -1, true, false)?.1;
    let mut weights = scores.f_gather(1, &ids, false)?;
    if p.norm_topk_prob {
        let denominator = weights
            .f_sum_dim_intlist([-1i64].as_slice(), true, None)?
            .f_add_scalar(1e-20)?;
        weights = weights.f_div(&denominator)?;
    }
    Ok((weights.f_mul_scalar(p.routed_scaling_factor)?, ids))
}

/// One routed expert: SwiGLU with gate and up stacked into one weight (quantized experts stay
/// quantized until the expert runs).
struct Expert {
    /// `[2 * moe_intermediate, hidden]`: gate rows, then up rows.
    gate_up: Weight,
    /// `[hidden, moe_intermediate]`.
    down: Weight,
}

/// This rank's routed experts: whole experts `first..first + local.len()` of `num_experts`.
struct Experts {
    local: Vec<Expert>,
    first: usize,
    num_experts: i64,
    intermediate: i64,
    /// With [`MoeKernel::Grouped`]: the experts' weights stacked, `local`'s dense matrices being
    /// views into them (one copy in memory).
    stacked: Option<Stacked>,
}

/// A layer's expert weights stacked for grouped GEMMs, in the checkpoint's `[out, in]` layout
/// per expert, stored as the checkpoint stores them: a quantized stack is dequantized as one
/// tensor when the layer runs (a few kernels for all experts, not a few per expert).
struct Stacked {
    /// `[experts, 2 * moe_intermediate, hidden]`.
    gate_up: Weight,
    /// `[experts, hidden, moe_intermediate]`.
    down: Weight,
}

impl Stacked {
    /// Empty stacks for `count` experts stored like `first`, when `_grouped_mm` can run them:
    /// bf16 matrices on CUDA (the kernel's only dtype there), rows whose byte strides are
    /// multiples of 16 (the kernel's alignment), and FP8 rows in whole blocks. `None` keeps the
    /// loop.
    fn for_experts_like(first: &Expert, count: usize, device: Device) -> Result<Option<Stacked>> {
        let kind = first.gate_up.kind();
        let aligned = |w: &Weight| {
            w.shape().last().copied().unwrap_or(0) * kind.elt_size_in_bytes() as i64 % 16 == 0
        };
        if (device.is_cuda() && kind != Kind::BFloat16)
            || !aligned(&first.gate_up)
            || !aligned(&first.down)
        {
            return Ok(None);
        }
        match (
            first.gate_up.empty_stack(count)?,
            first.down.empty_stack(count)?,
        ) {
            (Some(gate_up), Some(down)) => Ok(Some(Stacked { gate_up, down })),
            _ => Ok(None),
        }
    }

    /// Copies expert `j`'s weights into the stacks and points it at them, so that its own
    /// tensors are freed as it is loaded: one layer's experts never exist twice.
    fn adopt(&self, j: usize, expert: &mut Expert) -> Result<()> {
        for (stack, weight) in [
            (&self.gate_up, &mut expert.gate_up),
            (&self.down, &mut expert.down),
        ] {
            if !weight.move_into(stack, j)? {
                return Err(crate::error::CaptureError::Unsupported(format!(
                    "--moe-kernel grouped: this rank's expert {j} of the layer is stored in another \
                     format than its first (dense or quantized), and grouped GEMMs need one; use \
                     --moe-kernel loop"
                )));
            }
        }
        Ok(())
    }
}

/// Where every routed-expert weight is read: one whole linear `name` (a module prefix), dense
/// or quantized as the checkpoint stores it.
fn expert_weight(
    ctx: &LoadCtx,
    name: &str,
    out_features: usize,
    in_features: usize,
) -> Result<Weight> {
    ctx.linear_full(name, out_features, in_features)
}

impl Experts {
    /// Loads this rank's `<prefix>.<j>.{gate,up,down}_proj.weight`.
    fn load(ctx: &LoadCtx, prefix: &str, hidden: usize, spec: &MoeSpec) -> Result<Self> {
        let (e, i, tp) = (
            spec.num_experts,
            spec.intermediate_size,
            ctx.comm.world_size(),
        );
        // Experts are never cut: a TP size that does not divide them is refused by name.
        check_split(tp, &[(spec.experts_field, e)])?;
        let per_rank = e / tp;
        let first = ctx.comm.rank() * per_rank;
        let mut local = Vec::with_capacity(per_rank);
        let mut stacked = None;
        for j in first..first + per_rank {
            let name = |proj: &str| format!("{prefix}.{j}.{proj}");
            let (gate, up) = (name("gate_proj"), name("up_proj"));
            let parts = vec![
                expert_weight(ctx, &gate, i, hidden)?,
                expert_weight(ctx, &up, i, hidden)?,
            ];
            let mut expert = Expert {
                gate_up: Weight::cat(ctx, &[&gate, &up], parts)?,
                down: expert_weight(ctx, &name("down_proj"), hidden, i)?,
            };
            if j == first && ctx.moe == MoeKernel::Grouped {
                stacked = Stacked::for_experts_like(&expert, per_rank, ctx.device)?;
                if stacked.is_none() {
                    tracing::debug!("{prefix}: experts keep the per-expert loop (a dtype, width or FP8 block layout grouped GEMMs cannot take)");
                }
            }
            if let Some(s) = &stacked {
                s.adopt(j - first, &mut expert)?;
            }
            local.push(expert);
        }
        Ok(Experts {
            local,
            first,
            num_experts: e as i64,
            intermediate: i as i64,
            stacked,
        })
    }

    /// The weighted sum of this rank's experts' outputs for tokens `x: [n, hidden]` routed by
    /// `weights`/`ids` `[n, top_k]`: `[n, hidden]` in `x`'s dtype, zero where no local expert
    /// was chosen.
    ///
    /// Tokens are grouped by expert (a stable sort of the chosen ids), so each expert runs one
    /// GEMM pair over its contiguous slice of assignments, and experts nobody chose are skipped.
    /// Results are scattered back with `index_add_` expert by expert in ascending order, as
    /// transformers adds them; a token meets each expert at most once, so the sum's order
    /// within an expert does not matter.
    fn forward(&self, x: &Tensor, weights: &Tensor, ids: &Tensor) -> Result<Tensor> {
        if let Some(stacked) = &self.stacked {
            return self.forward_grouped(stacked, x, weights, ids);
        }
        let k = ids.size()[1];
        // 1. Assignments [n * k] sorted by expert: their tokens and weights.
        let flat = ids.f_reshape([-1])?;
        let order = flat.f_argsort_stable(true, 0, false)?;
        let tokens = order.f_floor_divide_scalar(k)?;
        let slot_weights = weights.f_reshape([-1])?.f_index_select(0, &order)?;
        // 2. How many assignments each expert has: one small copy to the host per layer.
        let counts = flat
            .f_bincount::<Tensor>(None, self.num_experts)?
            .f_to_device(Device::Cpu)?;
        let counts = Vec::<i64>::try_from(counts)?;
        let mut out = x.f_zeros_like()?;
        let mut start: i64 = counts[..self.first].iter().sum();
        for (expert, &count) in self.local.iter().zip(&counts[self.first..]) {
            if count > 0 {
                // 3. [count, hidden] -> [count, 2 * inter] -> [count, inter] -> [count, hidden].
                let rows = tokens.f_narrow(0, start, count)?;
                // A quantized expert's matrices are made here, only for experts that run.
                let gate_up = x
                    .f_index_select(0, &rows)?
                    .f_linear::<Tensor>(&expert.gate_up.matrix()?, None)?;
                let i = self.intermediate;
                let act = gate_up
                    .f_narrow(-1, 0, i)?
                    .f_silu()?
                    .f_mul(&gate_up.f_narrow(-1, i, i)?)?;
                // The weight multiplies in its own dtype (f32 for DeepSeek) before the rounding
                // to x's dtype, as transformers does.
                let y = act
                    .f_linear::<Tensor>(&expert.down.matrix()?, None)?
                    .f_mul(&slot_weights.f_narrow(0, start, count)?.f_unsqueeze(1)?)?
                    .f_to_kind(x.kind())?;
                let _ = out.f_index_add_(0, &rows, &y)?;
            }
            start += count;
        }
        Ok(out)
    }
}

impl Experts {
    /// [`Experts::forward`] as two grouped GEMMs over every assignment at once, in transformers'
    /// `grouped_mm_experts_forward` order: assignments sorted by expert (this rank's; others'
    /// sort past the last group and are zeroed), `gate_up`, SwiGLU, `down`, times the routing
    /// weight in its dtype, back in token order, summed over the top-k in that dtype and
    /// rounded to `x`'s. No copy to the host: the groups' ends stay on the device.
    fn forward_grouped(
        &self,
        s: &Stacked,
        x: &Tensor,
        weights: &Tensor,
        ids: &Tensor,
    ) -> Result<Tensor> {
        let (n, k, hidden) = (ids.size()[0], ids.size()[1], x.size()[1]);
        let local = self.local.len() as i64;
        // 1. Each assignment's local expert, or `local` (past every group) for another rank's.
        let rel = ids.f_reshape([-1])?.f_sub_scalar(self.first as i64)?;
        let mine = rel.f_ge(0)?.f_logical_and(&rel.f_lt(local)?)?;
        let key = rel.f_where_scalarother(&mine, local)?;
        let (_, perm) = key.f_sort_stable(true, 0, false)?;
        // 2. Group ends: the running count of assignments per local expert, as int32.
        let ends = key
            .f_bincount::<Tensor>(None, local + 1)?
            .f_narrow(0, 0, local)?
            .f_cumsum(0, Kind::Int)?;
        let xs = x.f_index_select(0, &perm.f_floor_divide_scalar(k)?)?;
        // A quantized stack's matrices exist from here to their GEMM.
        let gate_up = xs.f_internal_grouped_mm(
            &s.gate_up.matrix()?.f_transpose(-2, -1)?,
            Some(&ends),
            None::<&Tensor>,
            None,
        )?;
        let i = self.intermediate;
        let act = gate_up
            .f_narrow(-1, 0, i)?
            .f_silu()?
            .f_mul(&gate_up.f_narrow(-1, i, i)?)?;
        let y = act.f_internal_grouped_mm(
            &s.down.matrix()?.f_transpose(-2, -1)?,
            Some(&ends),
            None::<&Tensor>,
            None,
        )?;
        // 3. Weighted; rows past the last group are left unwritten by the kernel, so they are
        //    replaced (not multiplied) by zero.
        let sorted_weights = weights.f_reshape([-1])?.f_index_select(0, &perm)?;
        let y = y.f_mul(&sorted_weights.f_unsqueeze(1)?)?.f_masked_fill(
            &mine
                .f_index_select(0, &perm)?
                .f_logical_not()?
                .f_unsqueeze(1)?,
            0.0,
        )?;
        // 4. Back in assignment order, summed over each token's top-k.
        let inverse = perm.f_argsort(0, false)?;
        Ok(y.f_index_select(0, &inverse)?
            .f_view([n, k, hidden])?
            .f_sum_dim_intlist([1i64].as_slice(), false, None::<Kind>)?
            .f_to_kind(x.kind())?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::DequantKernel;

    /// transformers' `DeepseekV3TopkRouter.forward` transcribed op for op with plain tensors.
    fn reference_grouped(logits: &Tensor, bias: &Tensor, p: GroupedTopK) -> (Tensor, Tensor) {
        let n = logits.size()[0];
        let e = logits.size()[1];
        let scores = logits.sigmoid();
        let choice = &scores + bias;
        let group_scores = choice
            .view([n, p.n_group, e / p.n_group])
            .topk(2, -1, true, true)
            .0
            .sum_dim_intlist([-1i64].as_slice(), false, None);
        let group_idx = group_scores.topk(p.topk_group, -1, true, false).1;
        let group_mask = group_scores.zeros_like().scatter_value(1, &group_idx, 1.0);
        let mask = group_mask
            .unsqueeze(-1)
            .expand([n, p.n_group, e / p.n_group], false)
            .reshape([n, e]);
        let choice = choice.masked_fill(&mask.to_kind(Kind::Bool).logical_not(), f64::NEG_INFINITY);
        let ids = choice.topk(p.top_k, -1, true, false).1;
        let mut w = scores.gather(1, &ids, false);
        if p.norm_topk_prob {
            w = &w / (w.sum_dim_intlist([-1i64].as_slice(), true, None) + 1e-20);
        }
        (w * p.routed_scaling_factor, ids)
    }

    fn params(n_group: i64, topk_group: i64) -> GroupedTopK {
        GroupedTopK {
            top_k: 2,
            n_group,
            topk_group,
            norm_topk_prob: true,
            routed_scaling_factor: 2.5,
        }
    }

    #[test]
    fn grouped_sigmoid_routing_equals_the_reference_bit_for_bit() {
        tch::manual_seed(11);
        let logits = Tensor::randn([64, 8], (Kind::Float, Device::Cpu));
        let bias = Tensor::randn([8], (Kind::Float, Device::Cpu)) * 0.3;
        for (g, tg) in [(1, 1), (2, 1), (4, 2), (4, 4)] {
            let (w, ids) = grouped_sigmoid_top_k(&logits, &bias, params(g, tg)).unwrap();
            let (rw, rids) = reference_grouped(&logits, &bias, params(g, tg));
            assert!(ids.equal(&rids), "n_group {g}, topk_group {tg}");
            assert!(w.equal(&rw), "n_group {g}, topk_group {tg}");
        }
    }

    #[test]
    fn experts_outside_the_chosen_groups_are_never_picked_even_with_the_best_scores() {
        // 4 groups of 2; expert 0 has by far the best score, but its group's pair sum loses.
        let logits =
            Tensor::from_slice(&[9.0f32, -9.0, 1.0, 1.0, 0.0, 0.0, -1.0, -1.0]).view([1, 8]);
        let bias = Tensor::zeros([8], (Kind::Float, Device::Cpu));
        let (_, ids) = grouped_sigmoid_top_k(&logits, &bias, params(4, 1)).unwrap();
        let mut ids = Vec::<i64>::try_from(ids.flatten(0, -1)).unwrap();
        ids.sort();
        assert_eq!(ids, [2, 3]);
    }

    #[test]
    fn the_correction_bias_chooses_but_does_not_weigh() {
        let logits = Tensor::from_slice(&[0.0f32, 0.5, 0.1, 0.2]).view([1, 4]);
        let bias = Tensor::from_slice(&[3.0f32, 0.0, 3.0, 0.0]);
        let p = GroupedTopK {
            norm_topk_prob: false,
            routed_scaling_factor: 1.0,
            ..params(1, 1)
        };
        let (w, ids) = grouped_sigmoid_top_k(&logits, &bias, p).unwrap();
        let ids = Vec::<i64>::try_from(ids.flatten(0, -1)).unwrap();
        let mut sorted = ids.clone();
        sorted.sort();
        assert_eq!(sorted, [0, 2]);
        let w = Vec::<f32>::try_from(w.flatten(0, -1)).unwrap();
        let sigmoid = |v: f32| 1.0 / (1.0 + (-v).exp());
        for (id, got) in ids.iter().zip(w) {
            let want = sigmoid([0.0, 0.5, 0.1, 0.2][*id as usize]);
            assert!((got - want).abs() < 1e-6, "expert {id}: {got} vs {want}");
        }
    }

    #[test]
    fn softmax_routing_renormalises_only_when_asked() {
        let logits = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 0.5]).view([1, 4]);
        let (plain, ids) = softmax_top_k(&logits, 2, false).unwrap();
        assert_eq!(Vec::<i64>::try_from(ids.flatten(0, -1)).unwrap(), [2, 1]);
        let total = plain.sum(Kind::Float).double_value(&[]);
        assert!(total < 0.95, "{total}");
        let (normed, _) = softmax_top_k(&logits, 2, true).unwrap();
        assert!((normed.sum(Kind::Float).double_value(&[]) - 1.0).abs() < 1e-6);
    }

    /// Scattered values in [-1, 1] fixed by `salt`, without the global generator: tests run
    /// in parallel threads, and two that seed it at once would draw each other's numbers (an
    /// expert set built twice must have the same weights both times).
    fn scattered(shape: &[i64], salt: i64) -> Tensor {
        let n: i64 = shape.iter().product();
        (Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.73 + salt as f64 * 1.37)
            .sin()
            .view(shape)
    }

    /// Experts `first..first + count` of 6 (hidden 8, width 4) with scattered weights.
    fn experts(first: usize, count: usize) -> Experts {
        let all: Vec<Expert> = (0..6)
            .map(|j| Expert {
                gate_up: Weight::Dense(scattered(&[8, 8], 2 * j)),
                down: Weight::Dense(scattered(&[8, 4], 2 * j + 1)),
            })
            .collect();
        Experts {
            local: all.into_iter().skip(first).take(count).collect(),
            first,
            num_experts: 6,
            intermediate: 4,
            stacked: None,
        }
    }

    /// [`experts`] with the grouped kernel's stacked weights.
    fn grouped_experts(first: usize, count: usize) -> Experts {
        let mut ex = experts(first, count);
        let stacked = Stacked::for_experts_like(&ex.local[0], count, Device::Cpu)
            .unwrap()
            .expect("hidden 8 and width 4 in f32 are 16-byte rows");
        for (j, e) in ex.local.iter_mut().enumerate() {
            stacked.adopt(j, e).unwrap();
        }
        ex.stacked = Some(stacked);
        ex
    }

    /// Token by token, choice by choice: `sum_j w_j * down_e(silu(gate_e x) * up_e x)` over
    /// the choices `e` that `ex` holds.
    fn naive(ex: &Experts, x: &Tensor, w: &Tensor, ids: &Tensor) -> Tensor {
        let out = x.zeros_like();
        for n in 0..x.size()[0] {
            for j in 0..ids.size()[1] {
                let e = ids.int64_value(&[n, j]) as usize;
                let Some(expert) = e.checked_sub(ex.first).and_then(|l| ex.local.get(l)) else {
                    continue;
                };
                let gu = x
                    .get(n)
                    .linear::<Tensor>(&expert.gate_up.matrix().unwrap(), None);
                let act = gu.narrow(0, 0, 4).silu() * gu.narrow(0, 4, 4);
                let y = act.linear::<Tensor>(&expert.down.matrix().unwrap(), None)
                    * w.double_value(&[n, j]);
                let _ = out.get(n).f_add_(&y).unwrap();
            }
        }
        out
    }

    #[test]
    fn grouped_experts_equal_a_token_by_token_loop_and_split_across_ranks() {
        tch::manual_seed(22);
        let x = Tensor::randn([10, 8], (Kind::Float, Device::Cpu));
        let w = Tensor::rand([10, 2], (Kind::Float, Device::Cpu));
        // Two distinct experts per token; expert 5 is never chosen.
        let firsts: Vec<i64> = (0..10).map(|n| n % 5).collect();
        let ids = Tensor::stack(
            &[
                Tensor::from_slice(&firsts),
                Tensor::from_slice(&firsts).remainder(4).g_add_scalar(1),
            ],
            1,
        );
        let whole = experts(0, 6);
        let got = whole.forward(&x, &w, &ids).unwrap();
        let want = naive(&whole, &x, &w, &ids);
        assert!(got.allclose(&want, 1e-5, 1e-5, false));
        // Ranks of 3 experts each sum to the whole.
        let (r0, r1) = (experts(0, 3), experts(3, 3));
        let halves = r0.forward(&x, &w, &ids).unwrap() + r1.forward(&x, &w, &ids).unwrap();
        assert!(halves.allclose(&got, 1e-5, 1e-5, false));
        assert!(r1.forward(&x, &w, &ids).unwrap().allclose(
            &naive(&r1, &x, &w, &ids),
            1e-5,
            1e-5,
            false
        ));
    }

    #[test]
    fn grouped_gemm_experts_equal_the_loop_on_every_rank() {
        tch::manual_seed(23);
        let x = Tensor::randn([12, 8], (Kind::Float, Device::Cpu));
        let w = Tensor::rand([12, 2], (Kind::Float, Device::Cpu));
        // Expert 5 is never chosen, expert 0 by every fourth token: empty and small groups.
        let a: Vec<i64> = (0..12).map(|n| [0, 1, 2, 3][n % 4]).collect();
        let b: Vec<i64> = (0..12).map(|n| [4, 3, 1, 2][n % 4]).collect();
        let ids = Tensor::stack(&[Tensor::from_slice(&a), Tensor::from_slice(&b)], 1);
        for (first, count) in [(0, 6), (0, 3), (3, 3), (2, 2)] {
            let looped = experts(first, count).forward(&x, &w, &ids).unwrap();
            let grouped = grouped_experts(first, count).forward(&x, &w, &ids).unwrap();
            assert!(
                grouped.allclose(&looped, 1e-5, 1e-5, false),
                "experts {first}..{}: max diff {}",
                first + count,
                (&grouped - &looped).abs().max().double_value(&[])
            );
        }
    }

    /// Experts `first..first + count` of 6 (hidden 8, width 8) with scattered INT4 weights
    /// (groups of 8), stacked for the grouped kernel if `grouped`.
    fn int4_experts(first: usize, count: usize, grouped: bool) -> Experts {
        let int4 = |out: i64, salt: i64| Weight::Int4 {
            // Every bit pattern of the words: scattered values across the whole i32 range.
            packed: (scattered(&[out, 1], salt) * i32::MAX as f64).to_kind(Kind::Int),
            scale: scattered(&[out, 1], salt + 100).abs() * 0.2,
            group: 8,
            kind: Kind::Float,
            dequant: DequantKernel::Fused,
        };
        let all: Vec<Expert> = (0..6)
            .map(|j| Expert {
                gate_up: int4(16, 2 * j),
                down: int4(8, 2 * j + 1),
            })
            .collect();
        let mut ex = Experts {
            local: all.into_iter().skip(first).take(count).collect(),
            first,
            num_experts: 6,
            intermediate: 8,
            stacked: None,
        };
        if grouped {
            let stacked = Stacked::for_experts_like(&ex.local[0], count, Device::Cpu)
                .unwrap()
                .expect("INT4 experts stack");
            for (j, e) in ex.local.iter_mut().enumerate() {
                stacked.adopt(j, e).unwrap();
            }
            ex.stacked = Some(stacked);
        }
        ex
    }

    #[test]
    fn grouped_gemms_over_a_dequantized_stack_equal_the_loop_over_each_expert() {
        tch::manual_seed(25);
        let x = Tensor::randn([12, 8], (Kind::Float, Device::Cpu));
        let w = Tensor::rand([12, 2], (Kind::Float, Device::Cpu));
        let a: Vec<i64> = (0..12).map(|n| [0, 1, 2, 3][n % 4]).collect();
        let b: Vec<i64> = (0..12).map(|n| [4, 3, 1, 2][n % 4]).collect();
        let ids = Tensor::stack(&[Tensor::from_slice(&a), Tensor::from_slice(&b)], 1);
        for (first, count) in [(0, 6), (3, 3)] {
            let looped = int4_experts(first, count, false)
                .forward(&x, &w, &ids)
                .unwrap();
            let grouped = int4_experts(first, count, true)
                .forward(&x, &w, &ids)
                .unwrap();
            assert!(
                grouped.allclose(&looped, 1e-5, 1e-5, false),
                "experts {first}..{}: max diff {}",
                first + count,
                (&grouped - &looped).abs().max().double_value(&[])
            );
            assert!(looped.abs().max().double_value(&[]) > 0.0);
        }
    }

    #[test]
    fn grouped_gemms_are_not_used_where_the_kernel_cannot_run_them() {
        // A width whose f32 rows are not a multiple of 16 bytes keeps the loop.
        let odd = Expert {
            gate_up: Weight::Dense(Tensor::randn([6, 5], (Kind::Float, Device::Cpu))),
            down: Weight::Dense(Tensor::randn([5, 3], (Kind::Float, Device::Cpu))),
        };
        assert!(Stacked::for_experts_like(&odd, 2, Device::Cpu)
            .unwrap()
            .is_none());
    }

    fn spec(routing: Routing) -> MoeSpec {
        MoeSpec {
            experts_field: "n_routed_experts",
            num_experts: 8,
            top_k: 2,
            intermediate_size: 16,
            shared_intermediate_size: None,
            routing,
        }
    }

    fn grouped(n_group: usize, topk_group: usize) -> Routing {
        Routing::GroupedSigmoid {
            n_group,
            topk_group,
            norm_topk_prob: true,
            routed_scaling_factor: 1.0,
        }
    }

    #[test]
    fn impossible_groupings_are_named() {
        let problem = |r| spec(r).problem().unwrap_or_default();
        assert_eq!(problem(grouped(2, 1)), "");
        assert_eq!(
            problem(grouped(3, 1)),
            "n_routed_experts = 8 is not a multiple of n_group = 3"
        );
        assert!(problem(grouped(8, 1)).contains("1 expert(s) per group"));
        assert!(problem(grouped(2, 3)).contains("topk_group = 3 must be between 1 and n_group = 2"));
        let too_many = MoeSpec {
            top_k: 3,
            ..spec(grouped(4, 1))
        };
        assert!(too_many
            .problem()
            .unwrap()
            .contains("exceeds the 2 experts"));
        let none = MoeSpec {
            top_k: 0,
            ..spec(Routing::Softmax {
                norm_topk_prob: false,
            })
        };
        assert!(none.problem().unwrap().contains("num_experts_per_tok = 0"));
    }
}
