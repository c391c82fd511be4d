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
use crate::layers::{Mlp, RmsNorm, RopeTables, Rotary};
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
    /// This rank's q, k and v rows stacked: one GEMM for all three projections.
    qkv_proj: ColumnParallelLinear,
    o_proj: RowParallelLinear,
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
            heads: (cfg.num_heads / tp) as i64,
            kv_heads: (cfg.num_kv_heads / tp) as i64,
            head_dim: d as i64,
        })
    }

    fn forward(&self, x: &Tensor, rope: &RopeTables, mask: Option<&Tensor>) -> Result<Tensor> {
        let (b, t) = (x.size()[0], x.size()[1]);
        let (heads, kv_heads, d) = (self.heads, self.kv_heads, self.head_dim);
        // 1. Project: [b, t, hidden] -> [b, t, (heads + 2 kv_heads) * d], this rank's q | k | v.
        let qkv = self.qkv_proj.forward(x)?;
        // 2. Rotate positions into q and k at once: they are adjacent heads of one output,
        //    [b, t, heads + kv_heads, d]; then [b, t, heads, d] -> [b, heads, t, d] views.
        let qk = qkv
            .f_narrow(2, 0, (heads + kv_heads) * d)?
            .f_view([b, t, heads + kv_heads, d])?;
        let qk = rope.apply(&qk)?;
        let q = qk.f_narrow(2, 0, heads)?.f_transpose(1, 2)?;
        let k = qk.f_narrow(2, heads, kv_heads)?.f_transpose(1, 2)?;
        let v = qkv
            .f_narrow(2, (heads + kv_heads) * d, kv_heads * d)?
            .f_view([b, t, kv_heads, d])?
            .f_transpose(1, 2)?;
        // 3. Causal attention; right padding sits after every real token, so no real token sees it.
        //    An explicit mask (sliding window) replaces the built-in causal one. The kernels read
        //    these strided views as they are (unit stride over d is all they need).
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
    fn forward(&self, x: &Tensor, rope: &RopeTables, mask: Option<&Tensor>) -> Result<Tensor> {
        // The residual sums go into the sublayers' fresh outputs, which nothing else holds;
        // addition commutes, so the bits are transformers' `x + sublayer(x)`.
        let h = self
            .self_attn
            .forward(&self.input_layernorm.forward(x)?, rope, mask)?
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
        let rope = self.rotary.tables(t, self.kind)?;
        let mut x = self.embed_tokens.forward(input_ids)?; // [b, t, hidden]
        for (i, layer) in self.layers.iter().enumerate().take(last + 1) {
            x = layer.forward(&x, &rope, mask)?;
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
