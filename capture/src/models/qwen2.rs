//! `Qwen2ForCausalLM`: the Llama computation (see `llama.rs`, whose model it loads) with a
//! bias on the q, k and v projections and none on o_proj; the fused column-parallel q|k|v
//! layer shards those biases with their rows. Sliding-window Qwen2 configs are rejected.
use super::hf_config::ConfigFile;
use super::llama::{unsupported, LlamaConfig};
use super::ModelConfig;
use crate::error::Result;

/// Qwen2 runs as the Llama stack; only its biases differ.
pub(crate) fn parse(file: &ConfigFile) -> Result<Box<dyn ModelConfig>> {
    const NAME: &str = "Qwen2ForCausalLM";
    let raw = file.decoder()?;
    if raw.qwen_sliding_layers() {
        return Err(unsupported(
            NAME,
            "sliding-window layers (use_sliding_window / layer_types) are not implemented".into(),
        ));
    }
    Ok(Box::new(LlamaConfig {
        qkv_bias: true,
        ..LlamaConfig::from_raw(NAME, &raw)?
    }))
}
