//! `Qwen2ForCausalLM`: the Llama computation (see `llama.rs`, whose layers it loads) with a
//! bias on the q, k and v projections and none on o_proj — the config conversion sets
//! `qkv_bias = true, o_bias = false` for this architecture, and the fused column-parallel
//! q|k|v layer shards those biases with their rows. Sliding-window Qwen2 configs are
//! rejected there.
use super::llama;
use crate::config::ModelConfig;

/// The Llama layout plus `self_attn.{q,k,v}_proj.bias`.
pub fn tensor_shapes(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    llama::tensor_shapes(cfg)
}

/// Qwen2 runs as the Llama stack; only its weights differ.
pub type Model = llama::Model;
