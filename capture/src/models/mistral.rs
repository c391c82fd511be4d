//! `MistralForCausalLM`: the Llama computation (see `llama.rs`) with sliding-window attention:
//! token i attends to j only when `i - window < j <= i`. Llama's stack applies the window
//! (`StackShape::sliding_window`); sequences no longer than the window are plain causal and
//! take the fused causal path.
use super::hf_config::ConfigFile;
use super::llama::LlamaConfig;
use super::ModelConfig;
use crate::error::Result;

/// `MistralForCausalLM`: `sliding_window` from the config; no biases.
pub(crate) fn parse(file: &ConfigFile) -> Result<Box<dyn ModelConfig>> {
    let raw = file.decoder()?;
    Ok(Box::new(LlamaConfig {
        sliding_window: raw.sliding_window,
        ..LlamaConfig::from_raw("MistralForCausalLM", &raw)?
    }))
}
