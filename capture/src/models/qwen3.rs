//! `Qwen3ForCausalLM`: Llama-shaped, but every query and key head is RMS-normalised over
//! `head_dim` before RoPE, and `head_dim` is explicit (often != hidden / heads).
//!
//! Checkpoint layout: as Llama plus `model.layers.<i>.self_attn.{q,k}_norm.weight` of `[head_dim]`.
use hslake_schemas::CapturePoint;
use tch::{Kind, Tensor};

use super::{llama, Captures, DecoderModel};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::layers::{apply_rotary, Mlp, RmsNorm, Rotary};
use crate::tp::{ColumnParallelLinear, LoadCtx, RowParallelLinear, VocabParallelEmbedding};

/// Every tensor this architecture reads, with its full shape.
pub fn tensor_shapes(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let mut v = llama::tensor_shapes(cfg);
    for i in 0..cfg.num_layers {
        v.push((
            format!("model.layers.{i}.self_attn.q_norm.weight"),
            vec![cfg.head_dim],
        ));
        v.push((
            format!("model.layers.{i}.self_attn.k_norm.weight"),
            vec![cfg.head_dim],
        ));
    }
    v
}

/// Causal GQA attention with per-head q/k RMS norm; this rank holds `heads / tp` query heads.
struct Attention {
    q_proj: ColumnParallelLinear,
    k_proj: ColumnParallelLinear,
    v_proj: ColumnParallelLinear,
    o_proj: RowParallelLinear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    heads: i64,
    kv_heads: i64,
    head_dim: i64,
}

impl Attention {
    fn load(ctx: &LoadCtx, prefix: &str, cfg: &ModelConfig) -> Result<Self> {
        let (h, d, tp) = (cfg.hidden_size, cfg.head_dim, ctx.comm.world_size());
        let (q, kv) = (cfg.num_heads * d, cfg.num_kv_heads * d);
        Ok(Attention {
            q_proj: ColumnParallelLinear::load(
                ctx,
                &format!("{prefix}.q_proj"),
                h,
                q,
                cfg.qkv_bias,
            )?,
            k_proj: ColumnParallelLinear::load(
                ctx,
                &format!("{prefix}.k_proj"),
                h,
                kv,
                cfg.qkv_bias,
            )?,
            v_proj: ColumnParallelLinear::load(
                ctx,
                &format!("{prefix}.v_proj"),
                h,
                kv,
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

    fn forward(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let (b, t) = (x.size()[0], x.size()[1]);
        // 1. Project and split heads: [b, t, hidden] -> [b, t, heads, d].
        let q = self
            .q_proj
            .forward(x)?
            .f_view([b, t, self.heads, self.head_dim])?;
        let k = self
            .k_proj
            .forward(x)?
            .f_view([b, t, self.kv_heads, self.head_dim])?;
        let v = self
            .v_proj
            .forward(x)?
            .f_view([b, t, self.kv_heads, self.head_dim])?;
        // 2. Normalise each head over d, then [b, t, heads, d] -> [b, heads, t, d].
        let q = self.q_norm.forward(&q)?.f_transpose(1, 2)?;
        let k = self.k_norm.forward(&k)?.f_transpose(1, 2)?;
        let v = v.f_transpose(1, 2)?;
        // 3. Rotate positions into q and k.
        let q = apply_rotary(&q, cos, sin)?;
        let k = apply_rotary(&k, cos, sin)?;
        // 4. Causal attention; right padding is never attended by a real token.
        let y = Tensor::f_scaled_dot_product_attention::<Tensor>(
            &q, &k, &v, None, 0.0, true, None, true,
        )?;
        // 5. [b, heads, t, d] -> [b, t, heads*d] -> row-parallel projection and all-reduce.
        let y = y
            .f_transpose(1, 2)?
            .f_reshape([b, t, self.heads * self.head_dim])?;
        self.o_proj.forward(&y)
    }
}

/// Pre-norm decoder layer: `x + attn(norm(x))`, then `x + mlp(norm(x))`.
struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

impl DecoderLayer {
    fn load(ctx: &LoadCtx, prefix: &str, cfg: &ModelConfig) -> Result<Self> {
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        Ok(DecoderLayer {
            input_layernorm: RmsNorm::load(ctx, &format!("{prefix}.input_layernorm"), h, eps)?,
            self_attn: Attention::load(ctx, &format!("{prefix}.self_attn"), cfg)?,
            post_attention_layernorm: RmsNorm::load(
                ctx,
                &format!("{prefix}.post_attention_layernorm"),
                h,
                eps,
            )?,
            mlp: Mlp::load(ctx, &format!("{prefix}.mlp"), cfg)?,
        })
    }

    fn forward(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let x = x.f_add(
            &self
                .self_attn
                .forward(&self.input_layernorm.forward(x)?, cos, sin)?,
        )?;
        Ok(x.f_add(
            &self
                .mlp
                .forward(&self.post_attention_layernorm.forward(&x)?)?,
        )?)
    }
}

/// The decoder stack up to the final norm.
pub struct Model {
    embed_tokens: VocabParallelEmbedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    rotary: Rotary,
    kind: Kind,
}

impl Model {
    /// Loads this rank's slice of every weight.
    pub fn load(ctx: &LoadCtx, cfg: &ModelConfig) -> Result<Self> {
        let layers = (0..cfg.num_layers)
            .map(|i| DecoderLayer::load(ctx, &format!("model.layers.{i}"), cfg))
            .collect::<Result<_>>()?;
        Ok(Model {
            embed_tokens: VocabParallelEmbedding::load(
                ctx,
                "model.embed_tokens.weight",
                cfg.vocab_size,
                cfg.hidden_size,
            )?,
            layers,
            norm: RmsNorm::load(ctx, "model.norm", cfg.hidden_size, cfg.rms_norm_eps)?,
            rotary: Rotary::new(cfg, ctx.device)?,
            kind: ctx.kind,
        })
    }
}

impl DecoderModel for Model {
    fn forward(&self, input_ids: &Tensor, points: &[CapturePoint]) -> Result<Vec<Tensor>> {
        let mut captures = Captures::new(points, self.layers.len())?;
        let last = captures.last_layer(self.layers.len());
        let t = input_ids.size()[1];
        let (cos, sin) = self.rotary.cos_sin(t, self.kind)?; // [1, 1, t, d]
        let mut x = self.embed_tokens.forward(input_ids)?; // [b, t, hidden]
        for (i, layer) in self.layers.iter().enumerate().take(last + 1) {
            x = layer.forward(&x, &cos, &sin)?;
            captures.after_layer(i, &x);
        }
        captures.final_norm(|| self.norm.forward(&x))?;
        captures.finish()
    }
}
