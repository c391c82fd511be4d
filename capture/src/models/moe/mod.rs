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
//! `save_pretrained` writes too (it fuses experts in memory only).//!
//! [`spec`] holds what a config says of a block, [`router`] picks experts, [`experts`] runs
//! them; this file puts them together as a layer's feed-forward.
use tch::Tensor;

use crate::error::Result;
use crate::gpu::sections;
use crate::load::LoadCtx;
use crate::models::layers::{Mlp, DENSE_MLP, SHARED_EXPERT};
use crate::models::tp::PartialSum;
use experts::Experts;
use router::Router;

pub(crate) mod align;
mod experts;
pub(crate) mod router;
mod spec;

pub(crate) use spec::{MoeLayers, MoeSpec, Routing};

/// A decoder layer's feed-forward sublayer.
pub(crate) enum FeedForward {
    /// SwiGLU MLP, TP-split.
    Dense(Mlp),
    /// Routed experts (and a shared one), experts divided among ranks.
    Sparse(Box<SparseMoe>),
}

impl FeedForward {
    /// `<prefix>` (`model.layers.<i>.mlp`) of layer `layer`: sparse if `moe` says so, else a
    /// dense MLP `hidden -> dense_intermediate -> hidden` (with biases if `bias`).
    pub fn load(
        ctx: &LoadCtx,
        prefix: &str,
        layer: usize,
        (hidden, dense_intermediate): (usize, usize),
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
                (hidden, dense_intermediate),
                bias,
                DENSE_MLP,
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
                (hidden, width),
                false,
                SHARED_EXPERT,
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
                Some(s) => {
                    let shared = s.forward(x)?;
                    sections::time("moe + shared sum", || Ok(routed.f_add(&shared)?))
                }
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
