//! `LlamaForCausalLM` (Llama 2/3/3.1 incl. llama3 RoPE scaling, SmolLM2, GQA, optional biases).
//!
//! Checkpoint layout: `model.embed_tokens`, `model.layers.<i>.{input_layernorm,
//! self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}`, `model.norm`.
//! The LM head (tied or not) is never read: capture stops at the residual stream.
use tch::{Device, Kind, Tensor};

use super::hf_config::{ConfigFile, RawConfig};
use super::{BatchContext, Layer, LayeredModel, ModelConfig, ModelInfo};
use crate::error::{CaptureError, Result};
use crate::gpu::{sdpa, sections};
use crate::kernels::AttentionKernel;
use crate::load::LoadCtx;
use crate::models::layers::{RmsNorm, Rope, RopeTables, Rotary};
use crate::models::moe::{FeedForward, MoeLayers};
use crate::models::tp::{
    check_split, ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
};
use crate::scalar;

/// Llama's validated runtime config. Mistral, Qwen2 and Qwen3 are Llama-shaped: they read
/// their configs into the same fields and name their own model.
#[derive(Debug, Clone)]
pub(crate) struct LlamaConfig {
    /// The Hugging Face class name.
    pub architecture: &'static str,
    /// Residual width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// RMS norm epsilon.
    pub rms_norm_eps: f64,
    /// Rotary embedding base and scaling.
    pub rope: Rope,
    /// Bias on q/k/v.
    pub qkv_bias: bool,
    /// Bias on o_proj.
    pub o_bias: bool,
    /// Bias on gate/up/down.
    pub mlp_bias: bool,
    /// Sliding attention window (Mistral), if any.
    pub sliding_window: Option<usize>,
    /// Mixture-of-experts layers (Qwen3-MoE), if any; the others have the dense MLP.
    pub moe: Option<MoeLayers>,
    /// Builds this family's model from these fields: Llama's stack, or a family's variant.
    pub model: LoadModel,
}

/// How a Llama-shaped family builds its model: Llama's stack with its own attention.
pub(crate) type LoadModel = fn(&LoadCtx, &LlamaConfig) -> Result<Box<dyn LayeredModel>>;

/// `LlamaForCausalLM`: `attention_bias` on q/k/v/o, `mlp_bias` on gate/up/down.
pub(crate) fn parse(file: &ConfigFile) -> Result<Box<dyn ModelConfig>> {
    let raw = file.decoder()?;
    let bias = raw.attention_bias.unwrap_or(false);
    Ok(Box::new(LlamaConfig {
        qkv_bias: bias,
        o_bias: bias,
        mlp_bias: raw.mlp_bias.unwrap_or(false),
        ..LlamaConfig::from_raw("LlamaForCausalLM", &raw)?
    }))
}

impl LlamaConfig {
    /// Resolves defaults and alternative spellings of the fields every Llama-shaped family
    /// shares, and rejects what the model cannot run; no biases, no window and Llama's model
    /// (each family's parser sets its own).
    pub fn from_raw(architecture: &'static str, raw: &RawConfig) -> Result<Self> {
        let unsupported = |m: String| CaptureError::Unsupported(format!("{architecture}: {m}"));
        if raw.num_attention_heads == 0
            || raw.hidden_size == 0
            || raw.num_hidden_layers == 0
            || raw.vocab_size == 0
        {
            return Err(unsupported(
                "hidden_size, num_attention_heads, num_hidden_layers and vocab_size must all be > 0".into(),
            ));
        }
        let num_kv_heads = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
        if num_kv_heads == 0 || !raw.num_attention_heads.is_multiple_of(num_kv_heads) {
            return Err(unsupported(format!(
                "num_attention_heads = {} is not a multiple of num_key_value_heads = {num_kv_heads}",
                raw.num_attention_heads
            )));
        }
        let head_dim = match raw.head_dim {
            Some(d) => d,
            None if raw.hidden_size.is_multiple_of(raw.num_attention_heads) => {
                raw.hidden_size / raw.num_attention_heads
            }
            None => {
                return Err(unsupported(format!(
                "no head_dim and hidden_size = {} is not a multiple of num_attention_heads = {}",
                raw.hidden_size, raw.num_attention_heads
            )))
            }
        };
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(unsupported(format!(
                "head_dim = {head_dim} must be even and > 0 for rotary embeddings"
            )));
        }
        if let Some(act) = raw.hidden_act.as_deref() {
            if act != "silu" {
                return Err(unsupported(format!(
                    "hidden_act = {act:?}; only \"silu\" is implemented"
                )));
            }
        }
        Ok(LlamaConfig {
            architecture,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_layers: raw.num_hidden_layers,
            num_heads: raw.num_attention_heads,
            num_kv_heads,
            head_dim,
            vocab_size: raw.vocab_size,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            rope: raw.rope().map_err(unsupported)?,
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            sliding_window: None,
            moe: None,
            model: |ctx, cfg| Ok(Box::new(Stack::<Attention>::load(ctx, cfg)?)),
        })
    }
}

impl ModelConfig for LlamaConfig {
    fn info(&self) -> ModelInfo {
        ModelInfo {
            architecture: self.architecture,
            hidden_size: self.hidden_size,
            num_layers: self.num_layers,
            vocab_size: self.vocab_size,
            quantization: None,
        }
    }

    fn check_tp(&self, tp: usize) -> Result<()> {
        let mlp = ("intermediate_size", self.intermediate_size);
        let mut counts = vec![
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
        ];
        match &self.moe {
            Some(moe) => counts.extend(moe.split_counts(mlp)),
            None => counts.push(mlp),
        }
        check_split(tp, &counts)
    }

    fn load_stack(&self, ctx: &LoadCtx) -> Result<Box<dyn LayeredModel>> {
        (self.model)(ctx, self)
    }
}

/// What the pre-norm decoder stack ([`Stack`]) needs of a family's config: every family whose
/// layers are `x + attn(norm(x))`, `x + mlp(norm(x))` shares the stack and brings its attention.
pub(crate) struct StackShape<'a> {
    /// Prefix of the decoder's tensor names: `model.`, or a wrapper's `language_model.model.`.
    pub prefix: &'a str,
    /// Residual width.
    pub hidden_size: usize,
    /// Dense MLP width.
    pub intermediate_size: usize,
    /// Bias on the dense MLP's gate/up/down.
    pub mlp_bias: bool,
    /// Mixture-of-experts layers, if any; the others have the dense MLP.
    pub moe: Option<&'a MoeLayers>,
    /// Decoder layers.
    pub num_layers: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Epsilon of the layer norms and the final norm.
    pub rms_norm_eps: f64,
    /// Width the rotary tables cover: the head, or MLA's rope part of it.
    pub rotary_dim: usize,
    /// Rotary base and scaling.
    pub rope: &'a Rope,
    /// Attention window (Mistral): a batch wider than it attends through a sliding mask.
    pub sliding_window: Option<usize>,
}

/// A family config the decoder stack can load from; kept by the stack, which loads its
/// layers from it one at a time.
pub(crate) trait StackConfig: Clone + 'static {
    /// The stack's shape under this config.
    fn stack(&self) -> StackShape<'_>;
}

impl StackConfig for LlamaConfig {
    fn stack(&self) -> StackShape<'_> {
        StackShape {
            prefix: "model.",
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            mlp_bias: self.mlp_bias,
            moe: self.moe.as_ref(),
            num_layers: self.num_layers,
            vocab_size: self.vocab_size,
            rms_norm_eps: self.rms_norm_eps,
            rotary_dim: self.head_dim,
            rope: &self.rope,
            sliding_window: self.sliding_window,
        }
    }
}

/// The attention sublayer of a decoder layer: Llama's, Qwen3's, or DeepSeek's MLA.
pub(crate) trait SelfAttention: Sized + 'static {
    /// The family config it loads from.
    type Config: StackConfig;

    /// Loads `<prefix>.*` (this rank's heads).
    fn load(ctx: &LoadCtx, prefix: &str, cfg: &Self::Config) -> Result<Self>;

    /// `[b, t, hidden] -> [b, t, hidden]` (complete on every rank), causal unless `mask`
    /// (boolean `[t, t]`, true = attend) replaces the causal pattern.
    fn forward(&self, x: &Tensor, rope: &RopeTables, mask: Option<&Tensor>) -> Result<Tensor>;
}

/// Causal self-attention with grouped KV heads; this rank holds `heads / tp` query heads.
pub(crate) struct Attention {
    /// This rank's q, k and v rows stacked: one GEMM for all three projections.
    pub qkv_proj: ColumnParallelLinear,
    o_proj: RowParallelLinear,
    /// This rank's query heads.
    pub heads: i64,
    /// This rank's key/value heads.
    pub kv_heads: i64,
    /// Per-head width.
    pub head_dim: i64,
    /// `--attention`.
    kernel: AttentionKernel,
}

impl SelfAttention for Attention {
    type Config = LlamaConfig;

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
            heads: (cfg.num_heads / tp) as i64,
            kv_heads: (cfg.num_kv_heads / tp) as i64,
            head_dim: d as i64,
            kernel: ctx.kernels.attention,
        })
    }

    fn forward(&self, x: &Tensor, rope: &RopeTables, mask: Option<&Tensor>) -> Result<Tensor> {
        let (b, t) = (x.size()[0], x.size()[1]);
        let (heads, kv_heads, d) = (self.heads, self.kv_heads, self.head_dim);
        // 1. Project: [b, t, hidden] -> [b, t, (heads + 2 kv_heads) * d], this rank's q | k | v.
        let qkv = sections::time("qkv projection", || self.qkv_proj.forward(x))?;
        // 2. Rotate positions into q and k at once: they are adjacent heads of one output,
        //    [b, t, heads + kv_heads, d]; then [b, t, heads, d] -> [b, heads, t, d] views.
        let qk = qkv
            .f_narrow(2, 0, (heads + kv_heads) * d)?
            .f_view([b, t, heads + kv_heads, d])?;
        let qk = sections::time("rope", || rope.apply(&qk))?;
        let q = qk.f_narrow(2, 0, heads)?.f_transpose(1, 2)?;
        let k = qk.f_narrow(2, heads, kv_heads)?.f_transpose(1, 2)?;
        let v = qkv
            .f_narrow(2, (heads + kv_heads) * d, kv_heads * d)?
            .f_view([b, t, kv_heads, d])?
            .f_transpose(1, 2)?;
        // 3-4. Attention and output projection.
        self.attend(&q, &k, &v, mask)
    }
}

impl Attention {
    /// Steps 3 and 4 of the forward: attention of `[b, heads, t, d]` queries over
    /// `[b, kv_heads, t, d]` keys and values (any strides with unit stride over `d`), then the
    /// output projection; `[b, t, hidden]`, complete on every rank.
    pub(crate) fn attend(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (b, t) = (q.size()[0], q.size()[2]);
        // 3. Causal attention; right padding sits after every real token, so no real token sees it.
        //    An explicit mask (sliding window) replaces the built-in causal one. The kernels read
        //    these strided views as they are (unit stride over d is all they need).
        let y = sections::time("attention", || {
            sdpa::attention(q, k, v, mask, None, true, self.kernel)
        })?;
        // 4. [b, heads, t, d] -> [b, t, heads*d] -> row-parallel projection and all-reduce.
        sections::time("o projection", || {
            let y = y
                .f_transpose(1, 2)?
                .f_reshape([b, t, self.heads * self.head_dim])?;
            self.o_proj.forward(&y)
        })
    }
}

/// Pre-norm decoder layer: `x + attn(norm(x))`, then `x + mlp(norm(x))` (the MLP dense, or a
/// mixture of experts).
struct DecoderLayer<A> {
    input_layernorm: RmsNorm,
    self_attn: A,
    post_attention_layernorm: RmsNorm,
    mlp: FeedForward,
}

impl<A: SelfAttention> DecoderLayer<A> {
    fn load(ctx: &LoadCtx, layer: usize, cfg: &A::Config) -> Result<Self> {
        let s = cfg.stack();
        let prefix = format!("{}layers.{layer}", s.prefix);
        let (h, eps) = (s.hidden_size, s.rms_norm_eps);
        Ok(DecoderLayer {
            input_layernorm: RmsNorm::load(ctx, &format!("{prefix}.input_layernorm"), h, eps)?,
            self_attn: A::load(ctx, &format!("{prefix}.self_attn"), cfg)?,
            post_attention_layernorm: RmsNorm::load(
                ctx,
                &format!("{prefix}.post_attention_layernorm"),
                h,
                eps,
            )?,
            mlp: FeedForward::load(
                ctx,
                &format!("{prefix}.mlp"),
                layer,
                (h, s.intermediate_size),
                s.mlp_bias,
                s.moe,
            )?,
        })
    }
}

impl<A: SelfAttention> Layer for DecoderLayer<A> {
    fn forward(&self, x: &Tensor, batch: &BatchContext) -> Result<Tensor> {
        // The residual sums go into the sublayers' fresh outputs, which nothing else holds;
        // addition commutes, so the bits are transformers' `x + sublayer(x)`. The first sum
        // and the norm after it may be one kernel (`--norm fused`).
        let normed = sections::time("norm", || self.input_layernorm.forward(x))?;
        let attn = self
            .self_attn
            .forward(&normed, &batch.rope, batch.mask.as_ref())?;
        let (h, normed) = self.post_attention_layernorm.forward_add(attn, x)?;
        let mut out = self.mlp.forward(&normed)?;
        sections::time("residual add", || Ok(out.f_add_(&h)?))
    }
}

/// What a pre-norm decoder stack keeps beside its layers, with Llama's attention or another
/// family's: the embeddings, the final norm, the rotary tables, and the config its layers load
/// from.
pub(crate) struct Stack<A: SelfAttention = Attention> {
    cfg: A::Config,
    embed_tokens: VocabParallelEmbedding,
    norm: RmsNorm,
    rotary: Rotary,
    kind: Kind,
    device: Device,
}

impl<A: SelfAttention> Stack<A> {
    /// Loads this rank's slice of the embeddings and the final norm.
    pub fn load(ctx: &LoadCtx, cfg: &A::Config) -> Result<Self> {
        let s = cfg.stack();
        Ok(Stack {
            embed_tokens: VocabParallelEmbedding::load(
                ctx,
                &format!("{}embed_tokens.weight", s.prefix),
                s.vocab_size,
                s.hidden_size,
            )?,
            norm: RmsNorm::load(
                ctx,
                &format!("{}norm", s.prefix),
                s.hidden_size,
                s.rms_norm_eps,
            )?,
            rotary: Rotary::new(s.rotary_dim, s.rope, ctx.device, ctx.kernels.rope)?,
            kind: ctx.kind,
            device: ctx.device,
            cfg: cfg.clone(),
        })
    }
}

impl<A: SelfAttention> LayeredModel for Stack<A> {
    fn num_layers(&self) -> usize {
        self.cfg.stack().num_layers
    }

    fn embed(&self, input_ids: &Tensor) -> Result<(Tensor, BatchContext)> {
        let t = input_ids.size()[1];
        let mask = match self.cfg.stack().sliding_window {
            Some(w) if (w as i64) < t => Some(sliding_mask(t, w as i64, self.device)?),
            _ => None,
        };
        let batch = BatchContext {
            rope: self.rotary.tables(t, self.kind)?,
            mask,
        };
        let x = sections::time("embed", || self.embed_tokens.forward(input_ids))?;
        Ok((x, batch))
    }

    fn load_layer(&self, ctx: &LoadCtx, layer: usize) -> Result<Box<dyn Layer>> {
        Ok(Box::new(DecoderLayer::<A>::load(ctx, layer, &self.cfg)?))
    }

    fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        sections::time("final norm", || self.norm.forward(x))
    }
}

/// The boolean `[t, t]` mask of a sliding attention window of `window` positions: each
/// position attends to itself and the `window - 1` before it.
pub(crate) fn sliding_mask(t: i64, window: i64, device: Device) -> Result<Tensor> {
    let i = scalar::arange(t, Kind::Int64, device)?.f_unsqueeze(1)?; // [t, 1]
    let j = i.f_view([1, t])?; // [1, t]
    let causal = j.f_le_tensor(&i)?;
    let in_window = j.f_gt_tensor(&i.f_sub(&scalar::int(window)?)?)?;
    Ok(causal.f_logical_and(&in_window)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama(extra: serde_json::Value) -> Result<LlamaConfig> {
        LlamaConfig::from_raw("LlamaForCausalLM", &ConfigFile::for_test(extra).decoder()?)
    }

    #[test]
    fn defaults_head_dim_kv_heads_and_eps_from_the_other_fields() {
        let c = llama(serde_json::json!({"num_key_value_heads": null})).unwrap();
        assert_eq!((c.head_dim, c.num_kv_heads, c.rms_norm_eps), (8, 8, 1e-6));
        assert_eq!(c.rope.theta, 10000.0);
    }

    #[test]
    fn rejects_what_the_model_cannot_run_naming_the_architecture() {
        let e = |extra| llama(extra).unwrap_err().to_string();
        assert_eq!(
            e(serde_json::json!({"hidden_act": "gelu"})),
            "unsupported model config: LlamaForCausalLM: hidden_act = \"gelu\"; only \"silu\" is implemented"
        );
        assert!(e(serde_json::json!({"num_key_value_heads": 3}))
            .contains("not a multiple of num_key_value_heads = 3"));
        assert!(e(serde_json::json!({"head_dim": 7})).contains("head_dim = 7 must be even"));
        assert!(
            e(serde_json::json!({"rope_scaling": {"rope_type": "longrope"}}))
                .contains("rope_type \"longrope\"")
        );
    }

    #[test]
    fn attention_bias_covers_q_k_v_and_o_and_mlp_bias_the_mlp() {
        let c = parse(&ConfigFile::for_test(
            serde_json::json!({"attention_bias": true}),
        ))
        .unwrap();
        let names: Vec<String> = crate::fixtures::layer_biases(&*c, 0);
        assert_eq!(
            names,
            [
                "model.layers.0.self_attn.q_proj.bias",
                "model.layers.0.self_attn.k_proj.bias",
                "model.layers.0.self_attn.v_proj.bias",
                "model.layers.0.self_attn.o_proj.bias"
            ]
        );
        let c = parse(&ConfigFile::for_test(serde_json::json!({"mlp_bias": true}))).unwrap();
        let biases = crate::tools::dry_run::tensors_read(&*c)
            .unwrap()
            .into_iter()
            .filter(|s| s.name.ends_with(".bias"))
            .count();
        assert_eq!(biases, 2 * 3);
    }

    #[test]
    fn window_mask_keeps_the_last_w_positions_up_to_the_diagonal() {
        let m = sliding_mask(4, 2, Device::Cpu)
            .unwrap()
            .to_kind(Kind::Int64);
        let rows: Vec<Vec<i64>> = (0..4)
            .map(|r| Vec::<i64>::try_from(m.get(r)).unwrap())
            .collect();
        assert_eq!(
            rows,
            vec![
                vec![1, 0, 0, 0],
                vec![1, 1, 0, 0],
                vec![0, 1, 1, 0],
                vec![0, 0, 1, 1]
            ]
        );
    }
}
