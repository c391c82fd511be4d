//! `Qwen3ForCausalLM`: Llama-shaped, but every query and key head is RMS-normalised over
//! `head_dim` before RoPE, and `head_dim` is explicit (often != hidden / heads).
//!
//! Checkpoint layout: as Llama plus `model.layers.<i>.self_attn.{q,k}_norm.weight` of `[head_dim]`;
//! the decoder layers and the stack are Llama's, with this attention.
use tch::Tensor;

use super::hf_config::ConfigFile;
use super::llama::{self, LlamaConfig, SelfAttention};
use super::ModelConfig;
use crate::error::Result;
use crate::gpu::sections;
use crate::load::LoadCtx;
use crate::models::layers::{RmsNorm, RopeTables};

/// `Qwen3ForCausalLM`: explicit `head_dim`, `attention_bias` on q/k/v and o; sliding-window
/// configs are refused.
pub(crate) fn parse(file: &ConfigFile) -> Result<Box<dyn ModelConfig>> {
    const NAME: &str = "Qwen3ForCausalLM";
    let raw = file.decoder()?;
    raw.refuse_sliding_layers(NAME)?;
    let bias = raw.attention_bias.unwrap_or(false);
    Ok(Box::new(LlamaConfig {
        qkv_bias: bias,
        o_bias: bias,
        model: |ctx, cfg| Ok(Box::new(llama::Stack::<Attention>::load(ctx, cfg)?)),
        ..LlamaConfig::from_raw(NAME, &raw)?
    }))
}

/// Llama's attention with an RMS norm on each query and key head; this rank holds
/// `heads / tp` query heads.
pub(crate) struct Attention {
    /// The q|k|v and o projections and this rank's head counts.
    base: llama::Attention,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
}

impl SelfAttention for Attention {
    type Config = LlamaConfig;

    fn load(ctx: &LoadCtx, prefix: &str, cfg: &LlamaConfig) -> Result<Self> {
        let (d, eps) = (cfg.head_dim, cfg.rms_norm_eps);
        Ok(Attention {
            base: llama::Attention::load(ctx, prefix, cfg)?,
            q_norm: RmsNorm::load(ctx, &format!("{prefix}.q_norm"), d, eps)?,
            k_norm: RmsNorm::load(ctx, &format!("{prefix}.k_norm"), d, eps)?,
        })
    }

    fn forward(&self, x: &Tensor, rope: &RopeTables, mask: Option<&Tensor>) -> Result<Tensor> {
        let (b, t) = (x.size()[0], x.size()[1]);
        let base = &self.base;
        let (heads, kv_heads, d) = (base.heads, base.kv_heads, base.head_dim);
        // 1. Project: [b, t, hidden] -> [b, t, (heads + 2 kv_heads) * d], this rank's q | k | v,
        //    and split heads as views: [b, t, heads, d].
        let qkv = sections::time("qkv projection", || base.qkv_proj.forward(x))?;
        let q = qkv.f_narrow(2, 0, heads * d)?.f_view([b, t, heads, d])?;
        let k = qkv
            .f_narrow(2, heads * d, kv_heads * d)?
            .f_view([b, t, kv_heads, d])?;
        let v = qkv
            .f_narrow(2, (heads + kv_heads) * d, kv_heads * d)?
            .f_view([b, t, kv_heads, d])?;
        // 2. Normalise each head over d, rotate positions in, then [b, t, heads, d] ->
        //    [b, heads, t, d].
        let (q, k) = sections::time("q/k norm", || {
            Ok((self.q_norm.forward(&q)?, self.k_norm.forward(&k)?))
        })?;
        let (q, k) = sections::time("rope", || Ok((rope.apply(&q)?, rope.apply(&k)?)))?;
        let (q, k) = (q.f_transpose(1, 2)?, k.f_transpose(1, 2)?);
        let v = v.f_transpose(1, 2)?;
        // 3-4. Attention and output projection, as in Llama.
        base.attend(&q, &k, &v, mask)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_an_explicit_head_dim_and_reads_q_k_norms_of_that_width() {
        let c = parse(&ConfigFile::for_test(
            serde_json::json!({"num_attention_heads": 4, "head_dim": 32}),
        ))
        .unwrap();
        let specs = crate::tools::dry_run::tensors_read(&*c).unwrap();
        let shape = |name: &str| {
            specs
                .iter()
                .find(|s| s.name == name)
                .map(|s| s.shape.clone())
        };
        assert_eq!(
            shape("model.layers.0.self_attn.q_proj.weight"),
            Some(vec![128, 64])
        );
        assert_eq!(
            shape("model.layers.0.self_attn.k_proj.weight"),
            Some(vec![64, 64])
        );
        assert_eq!(
            shape("model.layers.0.self_attn.q_norm.weight"),
            Some(vec![32])
        );
        assert_eq!(
            shape("model.layers.0.self_attn.k_norm.weight"),
            Some(vec![32])
        );
    }
}
