//! `LlamaForCausalLM` (Llama 2/3/3.1 incl. llama3 RoPE scaling, SmolLM2, GQA, optional biases).
//!
//! Checkpoint layout: `model.embed_tokens`, `model.layers.<i>.{input_layernorm,
//! self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}`, `model.norm`.
//! The LM head (tied or not) is never read: capture stops at the residual stream.
use hslake_schemas::CapturePoint;
use tch::{Kind, Tensor};

use super::{Captures, DecoderModel};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::layers::{apply_rotary, Mlp, RmsNorm, Rotary};
use crate::tp::{ColumnParallelLinear, LoadCtx, RowParallelLinear, VocabParallelEmbedding};

/// Every tensor this architecture reads, with its full shape.
pub fn tensor_shapes(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let (h, d) = (cfg.hidden_size, cfg.head_dim);
    let (q, kv) = (cfg.num_heads * d, cfg.num_kv_heads * d);
    let mut v = vec![
        (
            "model.embed_tokens.weight".to_string(),
            vec![cfg.vocab_size, h],
        ),
        ("model.norm.weight".into(), vec![h]),
    ];
    for i in 0..cfg.num_layers {
        let p = format!("model.layers.{i}");
        v.push((format!("{p}.input_layernorm.weight"), vec![h]));
        v.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
        for (name, rows) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
            v.push((format!("{p}.self_attn.{name}.weight"), vec![rows, h]));
            if cfg.qkv_bias {
                v.push((format!("{p}.self_attn.{name}.bias"), vec![rows]));
            }
        }
        v.push((format!("{p}.self_attn.o_proj.weight"), vec![h, q]));
        if cfg.o_bias {
            v.push((format!("{p}.self_attn.o_proj.bias"), vec![h]));
        }
        v.extend(Mlp::tensor_shapes(&format!("{p}.mlp"), cfg));
    }
    v
}

/// Causal self-attention with grouped KV heads; this rank holds `heads / tp` query heads.
struct Attention {
    q_proj: ColumnParallelLinear,
    k_proj: ColumnParallelLinear,
    v_proj: ColumnParallelLinear,
    o_proj: RowParallelLinear,
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
            heads: (cfg.num_heads / tp) as i64,
            kv_heads: (cfg.num_kv_heads / tp) as i64,
            head_dim: d as i64,
        })
    }

    fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (b, t) = (x.size()[0], x.size()[1]);
        // 1. Project: [b, t, hidden] -> [b, t, heads*d] -> [b, t, heads, d] -> [b, heads, t, d].
        let q = self
            .q_proj
            .forward(x)?
            .f_view([b, t, self.heads, self.head_dim])?
            .f_transpose(1, 2)?;
        let k = self
            .k_proj
            .forward(x)?
            .f_view([b, t, self.kv_heads, self.head_dim])?
            .f_transpose(1, 2)?;
        let v = self
            .v_proj
            .forward(x)?
            .f_view([b, t, self.kv_heads, self.head_dim])?
            .f_transpose(1, 2)?;
        // 2. Rotate positions into q and k.
        let q = apply_rotary(&q, cos, sin)?;
        let k = apply_rotary(&k, cos, sin)?;
        // 3. Causal attention; right padding sits after every real token, so no real token sees it.
        //    An explicit mask (sliding window) replaces the built-in causal one.
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

    fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let x = x.f_add(&self.self_attn.forward(
            &self.input_layernorm.forward(x)?,
            cos,
            sin,
            mask,
        )?)?;
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

impl Model {
    /// The forward with an optional boolean `[t, t]` attention mask (true = attend) in place of
    /// the causal one; Mistral's sliding window uses it.
    pub(crate) fn forward_masked(
        &self,
        input_ids: &Tensor,
        points: &[CapturePoint],
        mask: Option<&Tensor>,
    ) -> Result<Vec<Tensor>> {
        let mut captures = Captures::new(points, self.layers.len())?;
        let last = captures.last_layer(self.layers.len());
        let t = input_ids.size()[1];
        let (cos, sin) = self.rotary.cos_sin(t, self.kind)?; // [1, 1, t, d]
        let mut x = self.embed_tokens.forward(input_ids)?; // [b, t, hidden]
        for (i, layer) in self.layers.iter().enumerate().take(last + 1) {
            x = layer.forward(&x, &cos, &sin, mask)?;
            captures.after_layer(i, &x);
        }
        captures.final_norm(|| self.norm.forward(&x))?;
        captures.finish()
    }
}

impl DecoderModel for Model {
    fn forward(&self, input_ids: &Tensor, points: &[CapturePoint]) -> Result<Vec<Tensor>> {
        self.forward_masked(input_ids, points, None)
    }
}
