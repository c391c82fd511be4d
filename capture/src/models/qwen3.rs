//! `Qwen3ForCausalLM`: Llama-shaped, but every query and key head is RMS-normalised over
//! `head_dim` before RoPE, and `head_dim` is explicit (often != hidden / heads).
//!
//! Checkpoint layout: as Llama plus `model.layers.<i>.self_attn.{q,k}_norm.weight` of `[head_dim]`.
use hslake_schemas::CapturePoint;
use tch::{Kind, Tensor};

use super::{llama, Captures, DecoderModel};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::layers::{Mlp, RmsNorm, RopeTables, Rotary};
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
    /// This rank's q, k and v rows stacked: one GEMM for all three projections.
    qkv_proj: ColumnParallelLinear,
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

    fn forward(&self, x: &Tensor, rope: &RopeTables) -> Result<Tensor> {
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
        // 3. Causal attention; right padding is never attended by a real token.
        let y = Tensor::f_scaled_dot_product_attention::<Tensor>(
            &q, &k, &v, None, 0.0, true, None, true,
        )?;
        // 4. [b, heads, t, d] -> [b, t, heads*d] -> row-parallel projection and all-reduce.
        let y = y.f_transpose(1, 2)?.f_reshape([b, t, heads * d])?;
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

    /// A new tensor; `x` is never written (a capture may hold it).
    fn forward(&self, x: &Tensor, rope: &RopeTables) -> Result<Tensor> {
        // As in llama.rs: residual sums go into the sublayers' fresh outputs.
        let h = self
            .self_attn
            .forward(&self.input_layernorm.forward(x)?, rope)?
            .f_add_(x)?;
        Ok(self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&h)?)?
            .f_add_(&h)?)
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
        let rope = self.rotary.tables(t, self.kind)?;
        let mut x = self.embed_tokens.forward(input_ids)?; // [b, t, hidden]
        for (i, layer) in self.layers.iter().enumerate().take(last + 1) {
            x = layer.forward(&x, &rope)?;
            captures.after_layer(i, &x);
        }
        captures.final_norm(|| self.norm.forward(&x))?;
        captures.finish()
    }
}
