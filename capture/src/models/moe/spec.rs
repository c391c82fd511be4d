//! A MoE block as a family's config describes it: how many experts, how wide, how they are
//! chosen ([`Routing`]), which layers are sparse, and the checks a config must pass.
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

#[cfg(test)]
mod tests {
    use super::*;

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
