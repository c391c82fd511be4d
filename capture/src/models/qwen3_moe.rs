//! `Qwen3MoeForCausalLM`: Qwen3's attention (q/k RMS norms, GQA, explicit `head_dim`) and
//! Llama's decoder stack, with a mixture of experts in place of the MLP in every layer that
//! `decoder_sparse_step` selects and `mlp_only_layers` does not exclude.
//!
//! Routing (transformers' `Qwen3MoeTopKRouter`): logits in the compute dtype, softmax in f32,
//! top `num_experts_per_tok`, renormalised if `norm_topk_prob`. No shared expert.
//!
//! Checkpoint layout: as Qwen3, and in sparse layers `model.layers.<i>.mlp.gate.weight` and
//! `model.layers.<i>.mlp.experts.<j>.{gate,up,down}_proj.weight` (see [`crate::models::moe`]).
use serde::Deserialize;

use super::hf_config::ConfigFile;
use super::llama::{self, LlamaConfig};
use super::{qwen3, ModelConfig};
use crate::error::{CaptureError, Result};
use crate::models::moe::{MoeLayers, MoeSpec, Routing};

const NAME: &str = "Qwen3MoeForCausalLM";

/// The MoE fields of a Qwen3-MoE `config.json`, defaulted as transformers' `Qwen3MoeConfig`.
#[derive(Debug, Deserialize)]
struct RawMoe {
    /// Routed experts (`save_pretrained` of transformers 5 writes `num_local_experts`).
    #[serde(alias = "num_local_experts")]
    num_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
}

/// `Qwen3MoeForCausalLM`: Qwen3's fields plus the experts; sliding-window configs are refused.
pub(crate) fn parse(file: &ConfigFile) -> Result<Box<dyn ModelConfig>> {
    let raw = file.decoder()?;
    raw.refuse_sliding_layers(NAME)?;
    let moe: RawMoe = file.fields()?;
    let base = LlamaConfig::from_raw(NAME, &raw)?;
    let bias = raw.attention_bias.unwrap_or(false);
    Ok(Box::new(LlamaConfig {
        qkv_bias: bias,
        o_bias: bias,
        moe: Some(moe_layers(&moe, base.num_layers)?),
        model: |ctx, cfg| Ok(Box::new(llama::Stack::<qwen3::Attention>::load(ctx, cfg)?)),
        ..base
    }))
}

/// Which layers are sparse (transformers' `Qwen3MoeDecoderLayer` rule) and their block.
fn moe_layers(raw: &RawMoe, num_layers: usize) -> Result<MoeLayers> {
    let unsupported = |m: String| CaptureError::Unsupported(format!("{NAME}: {m}"));
    let num_experts = raw.num_experts.unwrap_or(128);
    let step = raw.decoder_sparse_step.unwrap_or(1);
    if step == 0 {
        return Err(unsupported("decoder_sparse_step = 0; expected >= 1".into()));
    }
    let dense_only = raw.mlp_only_layers.clone().unwrap_or_default();
    let sparse: Vec<bool> = (0..num_layers)
        .map(|i| num_experts > 0 && !dense_only.contains(&i) && (i + 1).is_multiple_of(step))
        .collect();
    let spec = MoeSpec {
        experts_field: "num_experts",
        num_experts,
        top_k: raw.num_experts_per_tok.unwrap_or(8),
        intermediate_size: raw.moe_intermediate_size.unwrap_or(768),
        shared_intermediate_size: None,
        routing: Routing::Softmax {
            norm_topk_prob: raw.norm_topk_prob.unwrap_or(false),
        },
    };
    if sparse.contains(&true) {
        if let Some(problem) = spec.problem() {
            return Err(unsupported(problem));
        }
    }
    Ok(MoeLayers { spec, sparse })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_with(extra: serde_json::Value) -> Result<Box<dyn ModelConfig>> {
        let mut json = serde_json::json!({"num_attention_heads": 4, "head_dim": 16,
            "num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32});
        if let (Some(base), Some(extra)) = (json.as_object_mut(), extra.as_object()) {
            base.extend(extra.clone());
        }
        parse(&ConfigFile::for_test(json))
    }

    fn names(cfg: &dyn ModelConfig) -> Vec<String> {
        crate::tools::dry_run::tensors_read(cfg)
            .unwrap()
            .into_iter()
            .map(|s| s.name)
            .collect()
    }

    #[test]
    fn sparse_step_and_mlp_only_layers_choose_the_dense_layers() {
        let c = parse_with(serde_json::json!({"decoder_sparse_step": 2, "mlp_only_layers": [3]}))
            .unwrap();
        let n = names(&*c);
        // Layers 1 and 3 fall on the step; 3 is forced dense, so only layer 1 has experts.
        for (layer, sparse) in [(0, false), (1, true), (2, false), (3, false)] {
            let gate = format!("model.layers.{layer}.mlp.gate.weight");
            let dense = format!("model.layers.{layer}.mlp.gate_proj.weight");
            assert_eq!(n.contains(&gate), sparse, "layer {layer}");
            assert_eq!(n.contains(&dense), !sparse, "layer {layer}");
        }
        assert!(n.contains(&"model.layers.1.mlp.experts.7.down_proj.weight".to_string()));
        assert!(n.contains(&"model.layers.1.self_attn.q_norm.weight".to_string()));
    }

    #[test]
    fn reads_the_expert_count_under_either_name() {
        let mut file = ConfigFile::for_test(serde_json::json!({"num_attention_heads": 4,
            "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}));
        file.json.as_object_mut().unwrap().remove("num_experts");
        let n = names(&*parse(&file).unwrap());
        assert!(n.contains(&"model.layers.0.mlp.experts.3.up_proj.weight".to_string()));
        assert!(!n.contains(&"model.layers.0.mlp.experts.4.up_proj.weight".to_string()));
    }

    #[test]
    fn refuses_bad_moe_values_and_tp_sizes_that_cut_experts() {
        let e = |extra| parse_with(extra).err().unwrap().to_string();
        assert_eq!(
            e(serde_json::json!({"num_experts_per_tok": 9})),
            "unsupported model config: Qwen3MoeForCausalLM: num_experts_per_tok = 9 must be \
             between 1 and num_experts = 8"
        );
        assert!(
            e(serde_json::json!({"decoder_sparse_step": 0})).contains("decoder_sparse_step = 0")
        );
        let c = parse_with(
            serde_json::json!({"num_experts": 6, "num_attention_heads": 4,
            "num_key_value_heads": 4}),
        )
        .unwrap();
        assert!(c.check_tp(2).is_ok());
        let e = c.check_tp(4).unwrap_err().to_string();
        assert!(e.contains("num_experts = 6"), "{e}");
        assert!(e.contains("valid here: 1, 2"), "{e}");
    }
}
