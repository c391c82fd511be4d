//! `config.json` as published: the file (its JSON, for the registry to dispatch on and for
//! architectures with fields of their own), and a serde mirror of the fields the decoder
//! families share, with every optional spelling. Each architecture converts the mirror into
//! its own validated runtime config.
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{CaptureError, Result};
use crate::models::layers::{Rope, RopeScaling};

/// A checkpoint's `config.json`, read but not yet interpreted.
pub(crate) struct ConfigFile {
    /// Where it was read from (named in errors).
    pub path: PathBuf,
    /// Its contents.
    pub json: serde_json::Value,
}

impl ConfigFile {
    /// Reads `<dir>/config.json`.
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| CaptureError::Io {
            path: path.clone(),
            source,
        })?;
        let json = serde_json::from_str(&text).map_err(|e| CaptureError::Config {
            path: path.clone(),
            message: e.to_string(),
        })?;
        Ok(ConfigFile { path, json })
    }

    /// `architectures[0]`, if the file names one.
    pub fn architecture(&self) -> Option<&str> {
        self.json.get("architectures")?.get(0)?.as_str()
    }

    /// `model_type`, if present.
    pub fn model_type(&self) -> Option<&str> {
        self.json.get("model_type")?.as_str()
    }

    /// The shared decoder fields at the top level. (A multimodal wrapper that nests its
    /// language model under `text_config` reads them from [`ConfigFile::section`] instead.)
    pub fn decoder(&self) -> Result<RawConfig> {
        self.fields()
    }

    /// This file's fields as `T` (an architecture's own serde mirror); errors name the file.
    pub fn fields<T: serde::de::DeserializeOwned>(&self) -> Result<T> {
        T::deserialize(&self.json).map_err(|e| CaptureError::Config {
            path: self.path.clone(),
            message: e.to_string(),
        })
    }

    /// The object under `key` (e.g. a wrapper's `text_config`) as a config of its own.
    pub fn section(&self, key: &str) -> Result<ConfigFile> {
        match self.json.get(key) {
            Some(json) if json.is_object() => Ok(ConfigFile {
                path: self.path.clone(),
                json: json.clone(),
            }),
            _ => Err(CaptureError::Config {
                path: self.path.clone(),
                message: format!(
                    "no {key:?} object (the language model's config is expected there)"
                ),
            }),
        }
    }
}

#[cfg(test)]
impl ConfigFile {
    /// A small Llama-shaped config (hidden 64, 8 heads over 2 KV heads, MLP 128, 2 layers,
    /// vocabulary 100, no architecture named) with `extra`'s fields added or replaced.
    pub fn for_test(extra: serde_json::Value) -> Self {
        let mut json = serde_json::json!({"hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
            "vocab_size": 100});
        if let (Some(base), Some(extra)) = (json.as_object_mut(), extra.as_object()) {
            base.extend(extra.clone());
        }
        ConfigFile {
            path: "/m/config.json".into(),
            json,
        }
    }
}

/// RoPE parameters as either `rope_parameters` (transformers 5) or `rope_scaling` (older) spell them.
#[derive(Debug, Clone, Default, Deserialize)]
pub(crate) struct RawRope {
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
    /// llama3, yarn: context length the model was pre-trained with.
    pub original_max_position_embeddings: Option<f64>,
    /// yarn: rotations above which frequencies are kept (default 32).
    pub beta_fast: Option<f64>,
    /// yarn: rotations below which frequencies are interpolated (default 1).
    pub beta_slow: Option<f64>,
    /// yarn: explicit factor on cos/sin (else derived from `factor` and the mscales).
    pub attention_factor: Option<f64>,
    /// yarn: numerator mscale of the derived attention factor.
    pub mscale: Option<f64>,
    /// yarn: denominator mscale; DeepSeek also squares it into the softmax scale.
    pub mscale_all_dim: Option<f64>,
    /// yarn: whether the correction range is rounded outwards to whole dimensions (default true).
    pub truncate: Option<bool>,
}

/// The decoder fields of `config.json` exactly as Hugging Face checkpoints publish them;
/// every field that some checkpoints omit is optional here and defaulted by the architecture.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct RawConfig {
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
    /// Activation of the MLP.
    pub hidden_act: Option<String>,
    /// Bias on the attention projections (Llama: q/k/v/o).
    pub attention_bias: Option<bool>,
    /// Bias on gate/up/down (Llama).
    pub mlp_bias: Option<bool>,
    /// Sliding attention window (Mistral).
    pub sliding_window: Option<usize>,
    /// Whether sliding-window attention is used (Qwen2/3).
    pub use_sliding_window: Option<bool>,
    /// Attention kind of every layer (Qwen2/3, transformers 5).
    pub layer_types: Option<Vec<String>>,
    /// Longest context (yarn derives its factor from it when the file gives none).
    pub max_position_embeddings: Option<f64>,
    /// Pre-training context at the top level (Phi-3 style); it wins over the RoPE section's.
    pub original_max_position_embeddings: Option<f64>,
}

impl RawConfig {
    /// The RoPE base and scaling from whichever spelling the file uses; `Err` says what is
    /// wrong with them.
    pub fn rope(&self) -> std::result::Result<Rope, String> {
        let rope = self
            .rope_parameters
            .clone()
            .or_else(|| self.rope_scaling.clone())
            .unwrap_or_default();
        let theta = rope.rope_theta.or(self.rope_theta).unwrap_or(10000.0);
        let scaling = match rope.rope_type.as_deref().unwrap_or("default") {
            "default" => RopeScaling::None,
            "linear" => match rope.factor {
                Some(factor) if factor > 0.0 => RopeScaling::Linear { factor },
                _ => return Err("linear RoPE scaling needs a positive factor".into()),
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
                    return Err(
                        "llama3 RoPE scaling needs factor, low_freq_factor < high_freq_factor and \
                         original_max_position_embeddings"
                            .into(),
                    )
                }
            },
            "yarn" => self.yarn(&rope)?,
            other => {
                return Err(format!(
                    "rope_type {other:?}; implemented: default, linear, llama3, yarn"
                ))
            }
        };
        Ok(Rope { theta, scaling })
    }

    /// YaRN's parameters with transformers' defaults and derivations (`_compute_yarn_parameters`).
    fn yarn(&self, rope: &RawRope) -> std::result::Result<RopeScaling, String> {
        let original = self
            .original_max_position_embeddings
            .or(rope.original_max_position_embeddings)
            .or(self.max_position_embeddings)
            .filter(|o| *o > 0.0)
            .ok_or("yarn RoPE scaling needs original_max_position_embeddings > 0")?;
        let factor = match (rope.factor, self.max_position_embeddings) {
            (Some(f), _) => f,
            (None, Some(max)) => max / original,
            (None, None) => {
                return Err("yarn RoPE scaling needs a factor (or max_position_embeddings)".into())
            }
        };
        if factor <= 0.0 {
            return Err(format!(
                "yarn RoPE scaling needs a positive factor, got {factor}"
            ));
        }
        let mscale = |scale: f64, m: f64| {
            if scale <= 1.0 {
                1.0
            } else {
                0.1 * m * scale.ln() + 1.0
            }
        };
        // A zero mscale counts as absent, as Python's truthiness makes it in transformers.
        let nonzero = |v: Option<f64>| v.filter(|m| *m != 0.0);
        let attention_factor = match (
            rope.attention_factor,
            nonzero(rope.mscale),
            nonzero(rope.mscale_all_dim),
        ) {
            (Some(a), _, _) => a,
            (None, Some(m), Some(all)) => mscale(factor, m) / mscale(factor, all),
            _ => mscale(factor, 1.0),
        };
        Ok(RopeScaling::Yarn {
            factor,
            original_max_position_embeddings: original,
            beta_fast: nonzero(rope.beta_fast).unwrap_or(32.0),
            beta_slow: nonzero(rope.beta_slow).unwrap_or(1.0),
            attention_factor,
            truncate: rope.truncate.unwrap_or(true),
            mscale_all_dim: rope.mscale_all_dim.unwrap_or(0.0),
        })
    }

    /// Refuses sliding-window layers (Qwen2/3 spell them `use_sliding_window` and
    /// `layer_types`), which `architecture` does not implement.
    pub fn refuse_sliding_layers(&self, architecture: &str) -> Result<()> {
        let sliding_layers = self
            .layer_types
            .iter()
            .flatten()
            .any(|t| t != "full_attention");
        if self.use_sliding_window == Some(true) || sliding_layers {
            return Err(CaptureError::Unsupported(format!(
                "{architecture}: sliding-window layers (use_sliding_window / layer_types) are not implemented"
            )));
        }
        Ok(())
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
        let old = raw(&format!(r#"{{{BASE}, "rope_theta": 500000.0}}"#));
        let new = raw(&format!(
            r#"{{{BASE}, "rope_parameters": {{"rope_type": "default", "rope_theta": 500000.0}}}}"#
        ));
        assert_eq!(old.rope().unwrap().theta, 500000.0);
        assert_eq!(new.rope().unwrap(), old.rope().unwrap());
    }

    #[test]
    fn reads_llama3_scaling_from_old_rope_scaling_key() {
        let c = raw(&format!(
            r#"{{{BASE}, "rope_theta": 5e5, "rope_scaling": {{"type": "llama3",
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}}}"#
        ));
        assert!(
            matches!(c.rope().unwrap().scaling, RopeScaling::Llama3 { factor, .. } if factor == 8.0)
        );
    }

    #[test]
    fn rejects_unknown_rope_type() {
        let c = raw(&format!(
            r#"{{{BASE}, "rope_scaling": {{"rope_type": "longrope", "factor": 4.0}}}}"#
        ));
        assert!(c.rope().unwrap_err().contains("rope_type \"longrope\""));
    }

    #[test]
    fn yarn_derives_the_attention_factor_from_the_mscales_and_defaults_the_betas() {
        let c = raw(&format!(
            r#"{{{BASE}, "max_position_embeddings": 4096, "rope_scaling": {{"type": "yarn",
            "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096}}}}"#
        ));
        let RopeScaling::Yarn {
            attention_factor,
            beta_fast,
            beta_slow,
            mscale_all_dim,
            ..
        } = c.rope().unwrap().scaling
        else {
            panic!("not yarn")
        };
        let m = |x: f64| 0.1 * x * 40f64.ln() + 1.0;
        assert_eq!(attention_factor, m(1.0) / m(0.707));
        assert_eq!((beta_fast, beta_slow, mscale_all_dim), (32.0, 1.0, 0.707));
    }

    #[test]
    fn yarn_without_factor_or_context_names_what_is_missing() {
        let c = raw(&format!(
            r#"{{{BASE}, "rope_scaling": {{"type": "yarn"}}}}"#
        ));
        assert!(c
            .rope()
            .unwrap_err()
            .contains("original_max_position_embeddings"));
        let c = raw(&format!(
            r#"{{{BASE}, "rope_scaling": {{"type": "yarn", "original_max_position_embeddings": 64}}}}"#
        ));
        assert!(c.rope().unwrap_err().contains("needs a factor"));
    }

    #[test]
    fn a_missing_required_field_names_the_file_and_the_field() {
        let file = ConfigFile {
            path: "/m/config.json".into(),
            json: serde_json::json!({"architectures": ["LlamaForCausalLM"], "hidden_size": 8}),
        };
        assert_eq!(file.architecture(), Some("LlamaForCausalLM"));
        let e = file.decoder().unwrap_err().to_string();
        assert!(
            e.starts_with("/m/config.json: not a usable Hugging Face config: missing field"),
            "{e}"
        );
    }
}
