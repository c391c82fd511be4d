//! Choosing each token's experts: Qwen3-MoE's softmax top-k, and DeepSeek-V3's sigmoid scores
//! with a correction bias and group-limited top-k; replicated on every rank.
use tch::{Kind, Tensor};

use super::spec::{MoeSpec, Routing};
use crate::error::{CaptureError, Result};
use crate::gpu::fused::route as fused;
use crate::gpu::sections;
use crate::kernels::Fusion;
use crate::load::LoadCtx;
use crate::scalar;

/// Chooses each token's experts; replicated on every rank.
pub(super) struct Router {
    /// `[E, hidden]`: compute dtype for softmax routing, f32 for DeepSeek's.
    weight: Tensor,
    /// DeepSeek's `e_score_correction_bias` `[E]` (f32).
    correction: Option<Tensor>,
    top_k: i64,
    routing: Routing,
    /// `--moe-route`: the top-k in one kernel of ours, or libtorch's operations.
    fusion: Fusion,
}

impl Router {
    /// Loads `<prefix>.weight` (and DeepSeek's `<prefix>.e_score_correction_bias`).
    pub fn load(ctx: &LoadCtx, prefix: &str, hidden: usize, spec: &MoeSpec) -> Result<Self> {
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
            fusion: ctx.kernels.moe_route,
        })
    }

    /// `[n, hidden]` -> (weights `[n, top_k]`, expert ids `[n, top_k]` int64).
    pub fn route(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        match (&self.routing, &self.correction) {
            (Routing::Softmax { norm_topk_prob }, _) => {
                let logits = sections::time("router logits", || {
                    Ok(x.f_linear::<Tensor>(&self.weight, None)?)
                })?;
                sections::time("router top-k", || {
                    softmax_top_k(&logits, self.top_k, *norm_topk_prob, self.fusion)
                })
            }
            (
                Routing::GroupedSigmoid {
                    n_group,
                    topk_group,
                    norm_topk_prob,
                    routed_scaling_factor,
                },
                Some(correction),
            ) => {
                let logits = sections::time("router logits", || {
                    Ok(x.f_to_kind(Kind::Float)?
                        .f_linear::<Tensor>(&self.weight, None)?)
                })?;
                let p = GroupedTopK {
                    top_k: self.top_k,
                    n_group: *n_group as i64,
                    topk_group: *topk_group as i64,
                    norm_topk_prob: *norm_topk_prob,
                    routed_scaling_factor: *routed_scaling_factor,
                };
                sections::time("router top-k", || {
                    grouped_sigmoid_top_k(&logits, correction, p, self.fusion)
                })
            }
            (Routing::GroupedSigmoid { .. }, None) => Err(CaptureError::Pipeline(
                "a grouped sigmoid router was loaded without its correction bias".into(),
            )),
        }
    }
}

/// Qwen3-MoE's routing of `logits: [n, E]` (compute dtype): softmax in f32, the `k` largest,
/// renormalised if `norm`, weights returned in the logits' dtype; in our kernel where `fusion`
/// asks for it and it applies, else by libtorch's operations.
pub(crate) fn softmax_top_k(
    logits: &Tensor,
    k: i64,
    norm: bool,
    fusion: Fusion,
) -> Result<(Tensor, Tensor)> {
    if fusion == Fusion::Fused {
        if let Some(routed) = fused::softmax_topk(logits, k, norm)? {
            return Ok(routed);
        }
    }
    let probs = logits.f_softmax(-1, Kind::Float)?;
    let (mut top, ids) = probs.f_topk(k, -1, true, true)?;
    if norm {
        top = top.f_div(&top.f_sum_dim_intlist([-1i64].as_slice(), true, None)?)?;
    }
    Ok((top.f_to_kind(logits.kind())?, ids))
}

/// DeepSeek-V3's router settings for one call of [`grouped_sigmoid_top_k`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct GroupedTopK {
    /// Experts per token.
    pub top_k: i64,
    /// Expert groups.
    pub n_group: i64,
    /// Groups a token may draw from.
    pub topk_group: i64,
    /// Renormalise the chosen scores.
    pub norm_topk_prob: bool,
    /// Multiplies the weights.
    pub routed_scaling_factor: f64,
}

/// DeepSeek-V3's routing of f32 `logits: [n, E]`, in transformers' `DeepseekV3TopkRouter`
/// order of operations (its `topk` calls and `sorted` flags too, so ties break alike); in our
/// kernel where `fusion` asks for it and it applies.
pub(crate) fn grouped_sigmoid_top_k(
    logits: &Tensor,
    correction: &Tensor,
    p: GroupedTopK,
    fusion: Fusion,
) -> Result<(Tensor, Tensor)> {
    if fusion == Fusion::Fused {
        let kernel = fused::Grouped {
            top_k: p.top_k,
            n_group: p.n_group,
            topk_group: p.topk_group,
            norm: p.norm_topk_prob,
            scale: p.routed_scaling_factor,
        };
        if let Some(routed) = fused::grouped_topk(logits, correction, kernel)? {
            return Ok(routed);
        }
    }
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
    let ones = Tensor::f_ones(group_idx.size(), (group_mask.kind(), group_mask.device()))?;
    let _ = group_mask.f_scatter_(1, &group_idx, &ones)?;
    let expert_mask = group_mask
        .f_unsqueeze(-1)?
        .f_expand([n, p.n_group, per_group], false)?
        .f_reshape([n, e])?
        .f_to_kind(Kind::Bool)?;
    let hidden = expert_mask.f_logical_not()?;
    let choice = choice.f_masked_fill_tensor(&hidden, &scalar::float(f64::NEG_INFINITY)?)?;
    // 3. The top-k experts among those; their weights are the unbiased scores.
    let ids = choice.f_topk(p.top_k, -1, true, false)?.1;
    let mut weights = scores.f_gather(1, &ids, false)?;
    if p.norm_topk_prob {
        let denominator = weights
            .f_sum_dim_intlist([-1i64].as_slice(), true, None)?
            .f_add(&scalar::float(1e-20)?)?;
        weights = weights.f_div(&denominator)?;
    }
    let scale = scalar::float(p.routed_scaling_factor)?;
    Ok((weights.f_mul(&scale)?, ids))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

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
            let (w, ids) =
                grouped_sigmoid_top_k(&logits, &bias, params(g, tg), Fusion::Torch).unwrap();
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
        let (_, ids) = grouped_sigmoid_top_k(&logits, &bias, params(4, 1), Fusion::Torch).unwrap();
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
        let (w, ids) = grouped_sigmoid_top_k(&logits, &bias, p, Fusion::Torch).unwrap();
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
        let (plain, ids) = softmax_top_k(&logits, 2, false, Fusion::Torch).unwrap();
        assert_eq!(Vec::<i64>::try_from(ids.flatten(0, -1)).unwrap(), [2, 1]);
        let total = plain.sum(Kind::Float).double_value(&[]);
        assert!(total < 0.95, "{total}");
        let (normed, _) = softmax_top_k(&logits, 2, true, Fusion::Torch).unwrap();
        assert!((normed.sum(Kind::Float).double_value(&[]) - 1.0).abs() < 1e-6);
    }
}
