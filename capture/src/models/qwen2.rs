//! `Qwen2ForCausalLM`: the Llama computation (see `llama.rs`, whose model it loads) with a
//! bias on the q, k and v projections and none on o_proj; the fused column-parallel q|k|v
//! layer shards those biases with their rows. Sliding-window Qwen2 configs are rejected.
use super::hf_config::ConfigFile;
use super::llama::LlamaConfig;
use super::ModelConfig;
use crate::error::Result;

/// Qwen2 runs as the Llama stack; only its biases differ.
pub(crate) fn parse(file: &ConfigFile) -> Result<Box<dyn ModelConfig>> {
    const NAME: &str = "Qwen2ForCausalLM";
    let raw = file.decoder()?;
    raw.refuse_sliding_layers(NAME)?;
    Ok(Box::new(LlamaConfig {
        qkv_bias: true,
        ..LlamaConfig::from_raw(NAME, &raw)?
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_q_k_v_biases_and_none_on_o_proj() {
        let c = parse(&ConfigFile::for_test(serde_json::json!({}))).unwrap();
        let biases: Vec<String> = crate::fixtures::layer_biases(&*c, 0);
        assert_eq!(
            biases,
            [
                "model.layers.0.self_attn.q_proj.bias",
                "model.layers.0.self_attn.k_proj.bias",
                "model.layers.0.self_attn.v_proj.bias"
            ]
        );
    }

    #[test]
    fn refuses_sliding_window_layers() {
        let e = parse(&ConfigFile::for_test(
            serde_json::json!({"use_sliding_window": true}),
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains("Qwen2ForCausalLM: sliding-window layers"), "{e}");
        let mixed = serde_json::json!({"layer_types": ["full_attention", "sliding_attention"]});
        assert!(parse(&ConfigFile::for_test(mixed)).is_err());
    }
}
