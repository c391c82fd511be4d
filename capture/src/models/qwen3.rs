//! `Qwen3ForCausalLM`: Llama-shaped, but every query and key head is RMS-normalised over
//! `head_dim` before RoPE, and `head_dim` is explicit (often != hidden / heads).
//!
//! Checkpoint layout: as Llama plus `model.layers.<i>.self_attn.{q,k}_norm.weight` of `[head_dim]`;
//! the decoder layers and the stack are Llama's, with this attention.
use tch::Tensor;

use super::hf_config::ConfigFile;
use super::llama::{self, unsupported, LlamaConfig, SelfAttention};
use super::{DecoderModel, ModelConfig, ModelInfo};
use crate::error::Result;
use crate::layers::{RmsNorm, RopeTables};
use crate::load::LoadCtx;
use crate::tp::{ColumnParallelLinear, RowParallelLinear};

/// Llama's fields; `attention_bias` applies to q/k/v and o.
#[derive(Debug, Clone, PartialEq)]
struct Qwen3Config(LlamaConfig);

/// `Qwen3ForCausalLM`: explicit `head_dim`, optional `attention_bias`; sliding-window configs
/// are rejected.
pub(crate) fn parse(file: &ConfigFile) -> Result<Box<dyn ModelConfig>> {
    const NAME: &str = "Qwen3ForCausalLM";
    let raw = file.decoder()?;
    if raw.qwen_sliding_layers() {
        return Err(unsupported(
            NAME,
            "sliding-window layers (use_sliding_window / layer_types) are not implemented".into(),
        ));
    }
    let bias = raw.attention_bias.unwrap_or(false);
    Ok(Box::new(Qwen3Config(LlamaConfig {
        qkv_bias: bias,
        o_bias: bias,
        ..LlamaConfig::from_raw(NAME, &raw)?
    })))
}

impl ModelConfig for Qwen3Config {
    fn info(&self) -> ModelInfo {
        self.0.info()
    }

    fn check_tp(&self, tp: usize) -> Result<()> {
        self.0.check_tp(tp)
    }

    fn load(&self, ctx: &LoadCtx) -> Result<Box<dyn DecoderModel>> {
        Ok(Box::new(llama::Model::<Attention>::load(ctx, &self.0)?))
    }
}

/// Causal GQA attention with per-head q/k RMS norm; this rank holds `heads / tp` query heads.
struct Attention {
    /// This rank's q, k and v rows stacked: one GEMM for all three projections.
    qkv_proj: ColumnParallelLinear,
    o_proj: RowParallelLinear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    heads: i64,
    kv_heads: i64,
    head_dim: i64,
}

impl SelfAttention for Attention {
    fn load(ctx: &LoadCtx, prefix: &str, cfg: &LlamaConfig) -> Result<Self> {
        let (h, d, tp) = (cfg.hidden_size, cfg.head_dim, ctx.comm.world_size());
        let (q, kv) = (cfg.num_heads * d, cfg.num_kv_heads * d);
        let names = ["q_proj", "k_proj", "v_proj"].map(|n| format!("{prefix}.{n}"));
        Ok(Attention {
            qkv_proj: ColumnParallelLinear::load_fused(
                ctx,
                &[(&names[0], q), (&names[1], kv), (&names[2], kv)],
                h,
                cfg.qkv_bias,
            )?,
            o_proj: RowParallelLinear::load(ctx, &format!("{prefix}.o_proj"), q, h, cfg.o_bias)?,
            q_norm: RmsNorm::load(ctx, &format!("{prefix}.q_norm"), d, cfg.rms_norm_eps)?,
            k_norm: RmsNorm::load(ctx, &format!("{prefix}.k_norm"), d, cfg.rms_norm_eps)?,
            heads: (cfg.num_heads / tp) as i64,
            kv_heads: (cfg.num_kv_heads / tp) as i64,
            head_dim: d as i64,
        })
    }

    fn forward(&self, x: &Tensor, rope: &RopeTables, mask: Option<&Tensor>) -> Result<Tensor> {
        let (b, t) = (x.size()[0], x.size()[1]);
        let (heads, kv_heads, d) = (self.heads, self.kv_heads, self.head_dim);
        // 1. Project: [b, t, hidden] -> [b, t, (heads + 2 kv_heads) * d], this rank's q | k | v,
        //    and split heads as views: [b, t, heads, d].
        let qkv = self.qkv_proj.forward(x)?;
        let q = qkv.f_narrow(2, 0, heads * d)?.f_view([b, t, heads, d])?;
        let k = qkv
            .f_narrow(2, heads * d, kv_heads * d)?
            .f_view([b, t, kv_heads, d])?;
        let v = qkv
            .f_narrow(2, (heads + kv_heads) * d, kv_heads * d)?
            .f_view([b, t, kv_heads, d])?;
        // 2. Normalise each head over d, rotate positions in, then [b, t, heads, d] ->
        //    [b, heads, t, d].
        let q = rope.apply(&self.q_norm.forward(&q)?)?.f_transpose(1, 2)?;
        let k = rope.apply(&self.k_norm.forward(&k)?)?.f_transpose(1, 2)?;
        let v = v.f_transpose(1, 2)?;
        // 3. Causal attention (unless a mask replaces it); right padding is never attended
        //    by a real token.
        let y = Tensor::f_scaled_dot_product_attention(
            &q,
            &k,
            &v,
            mask,
            0.0,
            mask.is_none(),
            None,
            true,
        )?;
        // 4. [b, heads, t, d] -> [b, t, heads*d] -> row-parallel projection and all-reduce.
        let y = y.f_transpose(1, 2)?.f_reshape([b, t, heads * d])?;
        self.o_proj.forward(&y)
    }
}
