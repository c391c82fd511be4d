//! `config.json` as published (a serde mirror with every optional spelling) and the
//! validated runtime config the models are built from.
use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

use crate::error::{CaptureError, Result};

/// The decoder families this crate implements, one file each under `models/`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// `LlamaForCausalLM` (Llama 2/3, SmolLM2, ...).
    Llama,
    /// `MistralForCausalLM` (Llama with sliding-window attention).
    Mistral,
    /// `Qwen2ForCausalLM` (bias on the q/k/v projections).
    Qwen2,
    /// `Qwen3ForCausalLM` (RMS norm on each query and key head, explicit head_dim).
    Qwen3,
}

impl Architecture {
    /// The Hugging Face class name.
    pub fn hf_name(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Mistral => "MistralForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
            Architecture::Qwen3 => "Qwen3ForCausalLM",
        }
    }

    fn from_hf_name(name: &str) -> Result<Self> {
        match name {
            "LlamaForCausalLM" => Ok(Architecture::Llama),
            "MistralForCausalLM" => Ok(Architecture::Mistral),
            "Qwen2ForCausalLM" => Ok(Architecture::Qwen2),
            "Qwen3ForCausalLM" => Ok(Architecture::Qwen3),
            _ => Err(CaptureError::UnknownArchitecture {
                name: name.to_string(),
            }),
        }
    }
}

/// RoPE parameters as either `rope_parameters` (transformers 5) or `rope_scaling` (older) spell them.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct RawRope {
    /// `rope_type` (or the older `type`): default, linear, llama3.
    #[serde(alias = "type")]
    pub rope_type: Option<String>,
    /// Base frequency (transformers 5 keeps it here).
    pub rope_theta: Option<f64>,
    /// Scaling factor (linear, llama3).
    pub factor: Option<f64>,
    /// llama3: low-frequency factor.
    pub low_freq_factor: Option<f64>,
    /// llama3: high-frequency factor.
    pub high_freq_factor: Option<f64>,
    /// llama3: context length the model was pre-trained with.
    pub original_max_position_embeddings: Option<f64>,
}

/// `config.json` exactly as Hugging Face checkpoints publish it; every field that some
/// checkpoints omit is optional here and defaulted in [`ModelConfig::from_raw`].
#[derive(Debug, Clone, Deserialize)]
pub struct RawConfig {
    /// `architectures[0]` names the model class.
    #[serde(default)]
    pub architectures: Vec<String>,
    /// `model_type` (llama, mistral, qwen2, qwen3), a fallback when `architectures` is absent.
    pub model_type: Option<String>,
    /// Residual width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (GQA); defaults to the query heads.
    pub num_key_value_heads: Option<usize>,
    /// Per-head width; defaults to hidden_size / num_attention_heads.
    pub head_dim: Option<usize>,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// RMS norm epsilon.
    pub rms_norm_eps: Option<f64>,
    /// Older spelling of the RoPE base.
    pub rope_theta: Option<f64>,
    /// transformers 5 spelling of RoPE base and scaling.
    pub rope_parameters: Option<RawRope>,
    /// Older spelling of RoPE scaling.
    pub rope_scaling: Option<RawRope>,
    /// Activation of the MLP; only silu is implemented.
    pub hidden_act: Option<String>,
    /// Llama: bias on q/k/v/o.
    pub attention_bias: Option<bool>,
    /// Llama: bias on gate/up/down.
    pub mlp_bias: Option<bool>,
    /// Whether the LM head shares the embedding (irrelevant to capture: no LM head is loaded).
    pub tie_word_embeddings: Option<bool>,
    /// Mistral: sliding attention window.
    pub sliding_window: Option<usize>,
    /// Qwen2/3: whether sliding-window attention is used.
    pub use_sliding_window: Option<bool>,
    /// Qwen2/3, transformers 5: attention kind of every layer.
    pub layer_types: Option<Vec<String>>,
    /// Checkpoint dtype (older spelling).
    pub torch_dtype: Option<String>,
    /// Checkpoint dtype (transformers 5 spelling).
    pub dtype: Option<String>,
    /// Anything else, kept for provenance.
    #[serde(flatten)]
    pub other: BTreeMap<String, serde_json::Value>,
}

/// How rotary frequencies are derived from the base.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Positions divided by `factor`.
    Linear {
        /// Divisor of the frequencies.
        factor: f64,
    },
    /// Llama 3.1's frequency-dependent rescaling.
    Llama3 {
        /// Overall factor.
        factor: f64,
        /// Wavelengths above original/low_freq_factor are divided by `factor`.
        low_freq_factor: f64,
        /// Wavelengths below original/high_freq_factor are kept.
        high_freq_factor: f64,
        /// Pre-training context length.
        original_max_position_embeddings: f64,
    },
}

/// The validated runtime config every model is built from.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Which decoder family.
    pub architecture: Architecture,
    /// Residual width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// RMS norm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base frequency.
    pub rope_theta: f64,
    /// RoPE frequency scaling.
    pub rope_scaling: RopeScaling,
    /// Bias on q/k/v.
    pub qkv_bias: bool,
    /// Bias on o_proj.
    pub o_bias: bool,
    /// Bias on gate/up/down.
    pub mlp_bias: bool,
    /// Sliding attention window (Mistral), if any.
    pub sliding_window: Option<usize>,
    /// Whether the LM head is tied to the embedding.
    pub tie_word_embeddings: bool,
    /// The checkpoint's dtype as config.json names it, if it does.
    pub checkpoint_dtype: Option<String>,
}

impl ModelConfig {
    /// Reads and validates `<dir>/config.json`.
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| CaptureError::Io {
            path: path.clone(),
            source,
        })?;
        let raw: RawConfig = serde_json::from_str(&text).map_err(|e| CaptureError::Config {
            path: path.clone(),
            message: e.to_string(),
        })?;
        Self::from_raw(&raw)
    }

    /// Resolves defaults and alternative spellings, and rejects what the models cannot run.
    pub fn from_raw(raw: &RawConfig) -> Result<Self> {
        let architecture = match (raw.architectures.first(), raw.model_type.as_deref()) {
            (Some(name), _) => Architecture::from_hf_name(name)?,
            (None, Some("llama")) => Architecture::Llama,
            (None, Some("mistral")) => Architecture::Mistral,
            (None, Some("qwen2")) => Architecture::Qwen2,
            (None, Some("qwen3")) => Architecture::Qwen3,
            (None, other) => {
                return Err(CaptureError::UnknownArchitecture {
                    name: other
                        .unwrap_or("<no architectures and no model_type>")
                        .to_string(),
                })
            }
        };
        let unsupported = |m: String| {
            Err(CaptureError::Unsupported(format!(
                "{}: {m}",
                architecture.hf_name()
            )))
        };
        if raw.num_attention_heads == 0
            || raw.hidden_size == 0
            || raw.num_hidden_layers == 0
            || raw.vocab_size == 0
        {
            return unsupported(
                "hidden_size, num_attention_heads, num_hidden_layers and vocab_size must all be > 0".into(),
            );
        }
        let num_kv_heads = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
        if num_kv_heads == 0 || !raw.num_attention_heads.is_multiple_of(num_kv_heads) {
            return unsupported(format!(
                "num_attention_heads = {} is not a multiple of num_key_value_heads = {num_kv_heads}",
                raw.num_attention_heads
            ));
        }
        let head_dim = match raw.head_dim {
            Some(d) => d,
            None if raw.hidden_size.is_multiple_of(raw.num_attention_heads) => {
                raw.hidden_size / raw.num_attention_heads
            }
            None => {
                return unsupported(format!(
                "no head_dim and hidden_size = {} is not a multiple of num_attention_heads = {}",
                raw.hidden_size, raw.num_attention_heads
            ))
            }
        };
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return unsupported(format!(
                "head_dim = {head_dim} must be even and > 0 for rotary embeddings"
            ));
        }
        if let Some(act) = raw.hidden_act.as_deref() {
            if act != "silu" {
                return unsupported(format!(
                    "hidden_act = {act:?}; only \"silu\" is implemented"
                ));
            }
        }
        let rope = raw
            .rope_parameters
            .clone()
            .or_else(|| raw.rope_scaling.clone())
            .unwrap_or_default();
        let rope_theta = rope.rope_theta.or(raw.rope_theta).unwrap_or(10000.0);
        let rope_scaling = match rope.rope_type.as_deref().unwrap_or("default") {
            "default" => RopeScaling::None,
            "linear" => match rope.factor {
                Some(factor) if factor > 0.0 => RopeScaling::Linear { factor },
                _ => return unsupported("linear RoPE scaling needs a positive factor".into()),
            },
            "llama3" => match (
                rope.factor,
                rope.low_freq_factor,
                rope.high_freq_factor,
                rope.original_max_position_embeddings,
            ) {
                (Some(factor), Some(low), Some(high), Some(orig)) if high > low && factor > 0.0 => {
                    RopeScaling::Llama3 {
                        factor,
                        low_freq_factor: low,
                        high_freq_factor: high,
                        original_max_position_embeddings: orig,
                    }
                }
                _ => {
                    return unsupported(
                        "llama3 RoPE scaling needs factor, low_freq_factor < high_freq_factor and \
                         original_max_position_embeddings"
                            .into(),
                    )
                }
            },
            other => {
                return unsupported(format!(
                    "rope_type {other:?}; implemented: default, linear, llama3"
                ))
            }
        };
        let (qkv_bias, o_bias, mlp_bias) = match architecture {
            Architecture::Llama => {
                let b = raw.attention_bias.unwrap_or(false);
                (b, b, raw.mlp_bias.unwrap_or(false))
            }
            Architecture::Mistral => (false, false, false),
            Architecture::Qwen2 => (true, false, false),
            Architecture::Qwen3 => (
                raw.attention_bias.unwrap_or(false),
                raw.attention_bias.unwrap_or(false),
                false,
            ),
        };
        let sliding_window = match architecture {
            Architecture::Mistral => raw.sliding_window,
            Architecture::Qwen2 | Architecture::Qwen3 => {
                let sliding_layers = raw
                    .layer_types
                    .iter()
                    .flatten()
                    .any(|t| t != "full_attention");
                if raw.use_sliding_window == Some(true) || sliding_layers {
                    return unsupported("sliding-window layers (use_sliding_window / layer_types) are not implemented".into());
                }
                None
            }
            Architecture::Llama => None,
        };
        Ok(ModelConfig {
            architecture,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_layers: raw.num_hidden_layers,
            num_heads: raw.num_attention_heads,
            num_kv_heads,
            head_dim,
            vocab_size: raw.vocab_size,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            qkv_bias,
            o_bias,
            mlp_bias,
            sliding_window,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            checkpoint_dtype: raw.dtype.clone().or_else(|| raw.torch_dtype.clone()),
        })
    }

    /// Checks that `tp` ranks can split this model's heads and MLP evenly.
    pub fn check_tp(&self, tp: usize) -> Result<()> {
        let fits = |t: usize| {
            t > 0
                && self.num_heads.is_multiple_of(t)
                && self.num_kv_heads.is_multiple_of(t)
                && self.intermediate_size.is_multiple_of(t)
        };
        if fits(tp) {
            return Ok(());
        }
        let valid: Vec<String> = (1..=self.num_kv_heads)
            .filter(|&t| fits(t))
            .map(|t| t.to_string())
            .collect();
        Err(CaptureError::TensorParallelSize {
            tp,
            heads: self.num_heads,
            kv_heads: self.num_kv_heads,
            intermediate: self.intermediate_size,
            valid: valid.join(", "),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(json: &str) -> RawConfig {
        serde_json::from_str(json).unwrap()
    }

    const BASE: &str = r#""hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 100"#;

    #[test]
    fn reads_rope_theta_from_either_spelling() {
        let old = raw(&format!(
            r#"{{"architectures": ["LlamaForCausalLM"], {BASE}, "rope_theta": 500000.0}}"#
        ));
        let new = raw(&format!(
            r#"{{"architectures": ["LlamaForCausalLM"], {BASE}, "rope_parameters": {{"rope_type": "default", "rope_theta": 500000.0}}}}"#
        ));
        assert_eq!(ModelConfig::from_raw(&old).unwrap().rope_theta, 500000.0);
        assert_eq!(
            ModelConfig::from_raw(&new).unwrap(),
            ModelConfig::from_raw(&old).unwrap()
        );
    }

    #[test]
    fn reads_llama3_scaling_from_old_rope_scaling_key() {
        let c = raw(&format!(
            r#"{{"architectures": ["LlamaForCausalLM"], {BASE}, "rope_theta": 5e5, "rope_scaling": {{"type": "llama3",
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}}}"#
        ));
        let m = ModelConfig::from_raw(&c).unwrap();
        assert!(matches!(m.rope_scaling, RopeScaling::Llama3 { factor, .. } if factor == 8.0));
        assert_eq!(m.head_dim, 8);
    }

    #[test]
    fn names_unknown_architecture() {
        let c = raw(&format!(
            r#"{{"architectures": ["GPT2LMHeadModel"], {BASE}}}"#
        ));
        let e = ModelConfig::from_raw(&c).unwrap_err().to_string();
        assert!(
            e.contains("unknown architecture \"GPT2LMHeadModel\""),
            "{e}"
        );
    }

    #[test]
    fn rejects_unknown_rope_type_and_non_silu() {
        let c = raw(&format!(
            r#"{{"architectures": ["LlamaForCausalLM"], {BASE}, "rope_scaling": {{"rope_type": "yarn", "factor": 4.0}}}}"#
        ));
        assert!(ModelConfig::from_raw(&c)
            .unwrap_err()
            .to_string()
            .contains("rope_type \"yarn\""));
        let c = raw(&format!(
            r#"{{"architectures": ["LlamaForCausalLM"], {BASE}, "hidden_act": "gelu"}}"#
        ));
        assert!(ModelConfig::from_raw(&c)
            .unwrap_err()
            .to_string()
            .contains("gelu"));
    }

    #[test]
    fn qwen3_keeps_explicit_head_dim_and_qwen2_has_qkv_bias() {
        let c = raw(&format!(
            r#"{{"architectures": ["Qwen3ForCausalLM"], {BASE}, "head_dim": 16}}"#
        ));
        assert_eq!(ModelConfig::from_raw(&c).unwrap().head_dim, 16);
        let c = raw(&format!(
            r#"{{"architectures": ["Qwen2ForCausalLM"], {BASE}}}"#
        ));
        let m = ModelConfig::from_raw(&c).unwrap();
        assert!(m.qkv_bias && !m.o_bias);
    }

    #[test]
    fn impossible_tp_size_names_head_counts_and_valid_sizes() {
        // SmolLM2-135M: 9 heads, 3 KV heads, MLP 1536.
        let c = raw(
            r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
            "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152}"#,
        );
        let m = ModelConfig::from_raw(&c).unwrap();
        assert!(m.check_tp(3).is_ok());
        let e = m.check_tp(2).unwrap_err().to_string();
        assert!(
            e.contains("num_attention_heads = 9, num_key_value_heads = 3"),
            "{e}"
        );
        assert!(e.contains("valid here: 1, 3"), "{e}");
    }
}
