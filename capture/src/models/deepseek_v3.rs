//! `DeepseekV3ForCausalLM` (DeepSeek-V3/R1, Kimi-K2 with `model_type` `kimi_k2`, and the
//! language model of Kimi-K2.5, which nests this config under `text_config`): multi-head
//! latent attention (MLA) and, after `first_k_dense_replace` dense layers, mixtures of experts
//! with a shared expert and DeepSeek's grouped sigmoid router (see [`crate::models::moe`]).
//!
//! MLA, per layer: queries come from `q_proj`, or from the low-rank `q_a_proj` -> RMS norm ->
//! `q_b_proj` when `q_lora_rank` is set; keys and values from one latent
//! (`kv_a_proj_with_mqa` -> RMS norm -> `kv_b_proj`) plus a rotary key part shared by every
//! head. RoPE covers only the last `qk_rope_head_dim` of each query/key head, in DeepSeek's
//! interleaved pair layout (`rope_interleave`, the default). YaRN scaling multiplies cos/sin
//! by its attention factor and, through `mscale_all_dim`, the softmax scale by `mscale^2`.
//!
//! Tensor parallelism: whole heads per rank (`q_proj`/`q_b_proj` and `kv_b_proj` column-
//! parallel, `o_proj` row-parallel); the down-projections `q_a_proj` and `kv_a_proj_with_mqa`
//! and their norms are replicated. Experts are divided among ranks.
//!
//! Checkpoint layout (`<m>` = `model.`, or `language_model.model.` for the Kimi-K2.5 wrapper,
//! whose vision tensors are never read): `<m>embed_tokens.weight`, `<m>layers.<i>.
//! {input_layernorm, post_attention_layernorm}.weight`, `<m>layers.<i>.self_attn.{q_proj |
//! q_a_proj, q_a_layernorm, q_b_proj}`, `.self_attn.{kv_a_proj_with_mqa, kv_a_layernorm,
//! kv_b_proj, o_proj}`, `<m>layers.<i>.mlp.*` (dense or MoE), `<m>norm.weight`. Multi-token
//! prediction layers (`<m>layers.<num_hidden_layers>`) and the LM head are not read.
use serde::Deserialize;
use tch::Tensor;

use super::hf_config::ConfigFile;
use super::llama::{self, SelfAttention, StackConfig, StackShape};
use super::{LayeredModel, ModelConfig, ModelInfo};
use crate::error::{CaptureError, Result};
use crate::gpu::{sdpa, sections};
use crate::kernels::AttentionKernel;
use crate::load::LoadCtx;
use crate::models::layers::{RmsNorm, Rope, RopeScaling, RopeTables};
use crate::models::moe::{MoeLayers, MoeSpec, Routing};
use crate::models::tp::{check_split, ColumnParallelLinear, ReplicatedLinear, RowParallelLinear};

/// transformers builds MLA's two latent norms with the default epsilon, not `rms_norm_eps`.
const LATENT_NORM_EPS: f64 = 1e-6;

/// DeepSeek-V3's own `config.json` fields, defaulted as transformers' `DeepseekV3Config`.
#[derive(Debug, Deserialize)]
struct RawDeepseek {
    moe_intermediate_size: Option<usize>,
    n_routed_experts: Option<usize>,
    n_shared_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    n_group: Option<usize>,
    topk_group: Option<usize>,
    routed_scaling_factor: Option<f64>,
    norm_topk_prob: Option<bool>,
    first_k_dense_replace: Option<usize>,
    kv_lora_rank: Option<usize>,
    /// Absent means transformers' default (1536); `null` means full-rank queries (`q_proj`).
    #[serde(default = "default_q_lora_rank")]
    q_lora_rank: Option<usize>,
    qk_rope_head_dim: Option<usize>,
    qk_nope_head_dim: Option<usize>,
    v_head_dim: Option<usize>,
    rope_interleave: Option<bool>,
    /// DeepSeek's original configs name the router's score function; only sigmoid is V3's.
    scoring_func: Option<String>,
}

fn default_q_lora_rank() -> Option<usize> {
    Some(1536)
}

/// DeepSeek-V3's validated runtime config.
#[derive(Debug, Clone)]
pub(crate) struct DeepseekConfig {
    /// The Hugging Face class name recorded in the manifest.
    architecture: &'static str,
    /// Prefix of the decoder's tensor names (`model.`, or a wrapper's `language_model.model.`).
    prefix: &'static str,
    hidden_size: usize,
    /// Dense layers' MLP width.
    intermediate_size: usize,
    num_layers: usize,
    num_heads: usize,
    vocab_size: usize,
    rms_norm_eps: f64,
    rope: Rope,
    rope_interleave: bool,
    /// Rank of the query down-projection; `None` = one full-rank `q_proj`.
    q_lora_rank: Option<usize>,
    kv_lora_rank: usize,
    qk_nope_head_dim: usize,
    qk_rope_head_dim: usize,
    v_head_dim: usize,
    /// Bias on `q_a_proj`, `kv_a_proj_with_mqa` and `o_proj`.
    attention_bias: bool,
    /// Softmax scale: `qk_head_dim^-0.5`, times YaRN's `mscale^2`.
    softmax_scale: f64,
    moe: MoeLayers,
}

/// `DeepseekV3ForCausalLM` (also `model_type` `deepseek_v3` or `kimi_k2`).
pub(crate) fn parse(file: &ConfigFile) -> Result<Box<dyn ModelConfig>> {
    Ok(Box::new(DeepseekConfig::from_file(
        file,
        "DeepseekV3ForCausalLM",
        "model.",
    )?))
}

/// Kimi-K2.5 (`KimiK25ForConditionalGeneration`): a DeepSeek-V3 language model under
/// `text_config`, its tensors under `language_model.`; the vision tower is not read.
pub(crate) fn parse_kimi_k25(file: &ConfigFile) -> Result<Box<dyn ModelConfig>> {
    const NAME: &str = "KimiK25ForConditionalGeneration";
    let text = file.section("text_config")?;
    if let Some(t) = text.model_type() {
        if t != "deepseek_v3" && t != "kimi_k2" {
            return Err(CaptureError::Unsupported(format!(
                "{NAME}: text_config.model_type = {t:?}; expected \"deepseek_v3\" or \"kimi_k2\""
            )));
        }
    }
    Ok(Box::new(DeepseekConfig::from_file(
        &text,
        NAME,
        "language_model.model.",
    )?))
}

impl DeepseekConfig {
    /// Resolves defaults and rejects what the model cannot run, naming `architecture`.
    fn from_file(
        file: &ConfigFile,
        architecture: &'static str,
        prefix: &'static str,
    ) -> Result<Self> {
        let unsupported = |m: String| CaptureError::Unsupported(format!("{architecture}: {m}"));
        let raw = file.decoder()?;
        let ds: RawDeepseek = file.fields()?;
        if raw.hidden_size == 0
            || raw.num_attention_heads == 0
            || raw.num_hidden_layers == 0
            || raw.vocab_size == 0
        {
            return Err(unsupported(
                "hidden_size, num_attention_heads, num_hidden_layers and vocab_size must all be > 0".into(),
            ));
        }
        if let Some(act) = raw.hidden_act.as_deref().filter(|a| *a != "silu") {
            return Err(unsupported(format!(
                "hidden_act = {act:?}; only \"silu\" is implemented"
            )));
        }
        if let Some(f) = ds.scoring_func.as_deref().filter(|f| *f != "sigmoid") {
            return Err(unsupported(format!(
                "scoring_func = {f:?}; DeepSeek-V3 routing is \"sigmoid\""
            )));
        }
        let rope_dim = ds.qk_rope_head_dim.unwrap_or(64);
        let nope = ds.qk_nope_head_dim.unwrap_or(128);
        let v_head_dim = ds.v_head_dim.unwrap_or(128);
        let kv_lora_rank = ds.kv_lora_rank.unwrap_or(512);
        if rope_dim == 0 || !rope_dim.is_multiple_of(2) {
            return Err(unsupported(format!(
                "qk_rope_head_dim = {rope_dim} must be even and > 0 for rotary embeddings"
            )));
        }
        if v_head_dim == 0 || kv_lora_rank == 0 || ds.q_lora_rank == Some(0) {
            return Err(unsupported(format!(
                "v_head_dim = {v_head_dim}, kv_lora_rank = {kv_lora_rank} and q_lora_rank = {:?} \
                 must be > 0 (q_lora_rank may be null)",
                ds.q_lora_rank
            )));
        }
        let rope = raw.rope().map_err(unsupported)?;
        let moe_width = ds.moe_intermediate_size.unwrap_or(2048);
        let shared = ds.n_shared_experts.unwrap_or(1);
        let spec = MoeSpec {
            experts_field: "n_routed_experts",
            num_experts: ds.n_routed_experts.unwrap_or(256),
            top_k: ds.num_experts_per_tok.unwrap_or(8),
            intermediate_size: moe_width,
            shared_intermediate_size: (shared > 0).then_some(moe_width * shared),
            routing: Routing::GroupedSigmoid {
                n_group: ds.n_group.unwrap_or(8),
                topk_group: ds.topk_group.unwrap_or(4),
                norm_topk_prob: ds.norm_topk_prob.unwrap_or(true),
                routed_scaling_factor: ds.routed_scaling_factor.unwrap_or(2.5),
            },
        };
        let first_dense = ds.first_k_dense_replace.unwrap_or(3);
        let sparse: Vec<bool> = (0..raw.num_hidden_layers)
            .map(|i| i >= first_dense)
            .collect();
        if sparse.contains(&true) {
            if let Some(problem) = spec.problem() {
                return Err(unsupported(problem));
            }
        }
        Ok(DeepseekConfig {
            architecture,
            prefix,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_layers: raw.num_hidden_layers,
            num_heads: raw.num_attention_heads,
            vocab_size: raw.vocab_size,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            softmax_scale: softmax_scale(nope + rope_dim, &rope),
            rope,
            rope_interleave: ds.rope_interleave.unwrap_or(true),
            q_lora_rank: ds.q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim: nope,
            qk_rope_head_dim: rope_dim,
            v_head_dim,
            attention_bias: raw.attention_bias.unwrap_or(false),
            moe: MoeLayers { spec, sparse },
        })
    }
}

/// `qk_head_dim^-0.5`, times `mscale^2` with YaRN's `mscale_all_dim` (transformers'
/// `yarn_apply_mscale`): the softmax sharpening that goes with YaRN's longer context.
fn softmax_scale(qk_head_dim: usize, rope: &Rope) -> f64 {
    let scale = (qk_head_dim as f64).powf(-0.5);
    match rope.scaling {
        RopeScaling::Yarn {
            factor,
            mscale_all_dim,
            ..
        } if mscale_all_dim != 0.0 => {
            let m = if factor <= 1.0 {
                1.0
            } else {
                0.1 * mscale_all_dim * factor.ln() + 1.0
            };
            scale * m * m
        }
        _ => scale,
    }
}

impl ModelConfig for DeepseekConfig {
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
        let mut counts = vec![("num_attention_heads", self.num_heads)];
        counts.extend(
            self.moe
                .split_counts(("intermediate_size", self.intermediate_size)),
        );
        check_split(tp, &counts)
    }

    fn load_stack(&self, ctx: &LoadCtx) -> Result<Box<dyn LayeredModel>> {
        Ok(Box::new(llama::Stack::<Attention>::load(ctx, self)?))
    }
}

impl StackConfig for DeepseekConfig {
    fn stack(&self) -> StackShape<'_> {
        StackShape {
            prefix: self.prefix,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            mlp_bias: false,
            moe: Some(&self.moe),
            num_layers: self.num_layers,
            vocab_size: self.vocab_size,
            rms_norm_eps: self.rms_norm_eps,
            // The rotary tables cover only the rope part of each head.
            rotary_dim: self.qk_rope_head_dim,
            rope: &self.rope,
            sliding_window: None,
        }
    }
}

/// Where queries come from.
enum QueryProjection {
    /// `q_proj`: `[heads * qk_head_dim, hidden]`, column-parallel.
    Full(ColumnParallelLinear),
    /// `q_a_proj` (replicated) -> `q_a_layernorm` -> `q_b_proj` (column-parallel).
    LowRank {
        down: ReplicatedLinear,
        norm: RmsNorm,
        up: ColumnParallelLinear,
    },
}

/// Multi-head latent attention; this rank holds `heads / tp` whole heads.
struct Attention {
    q: QueryProjection,
    kv_a_proj_with_mqa: ReplicatedLinear,
    kv_a_layernorm: RmsNorm,
    kv_b_proj: ColumnParallelLinear,
    o_proj: RowParallelLinear,
    /// This rank's heads.
    heads: i64,
    nope: i64,
    rope: i64,
    v: i64,
    kv_lora: i64,
    scale: f64,
    interleave: bool,
    /// `--attention`.
    kernel: AttentionKernel,
}

impl SelfAttention for Attention {
    type Config = DeepseekConfig;

    fn load(ctx: &LoadCtx, prefix: &str, cfg: &DeepseekConfig) -> Result<Self> {
        let (h, heads, bias) = (cfg.hidden_size, cfg.num_heads, cfg.attention_bias);
        let (nope, rope, v) = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim);
        let name = |n: &str| format!("{prefix}.{n}");
        let q_rows = heads * (nope + rope);
        let q = match cfg.q_lora_rank {
            None => QueryProjection::Full(ColumnParallelLinear::load_fused(
                ctx,
                &[(&name("q_proj"), q_rows)],
                h,
                false,
            )?),
            Some(r) => QueryProjection::LowRank {
                down: ReplicatedLinear::load(ctx, &name("q_a_proj"), h, r, bias)?,
                norm: RmsNorm::load(ctx, &name("q_a_layernorm"), r, LATENT_NORM_EPS)?,
                up: ColumnParallelLinear::load_fused(
                    ctx,
                    &[(&name("q_b_proj"), q_rows)],
                    r,
                    false,
                )?,
            },
        };
        let kv_lora = cfg.kv_lora_rank;
        Ok(Attention {
            q,
            kv_a_proj_with_mqa: ReplicatedLinear::load(
                ctx,
                &name("kv_a_proj_with_mqa"),
                h,
                kv_lora + rope,
                bias,
            )?,
            kv_a_layernorm: RmsNorm::load(ctx, &name("kv_a_layernorm"), kv_lora, LATENT_NORM_EPS)?,
            kv_b_proj: ColumnParallelLinear::load_fused(
                ctx,
                &[(&name("kv_b_proj"), heads * (nope + v))],
                kv_lora,
                false,
            )?,
            o_proj: RowParallelLinear::load(ctx, &name("o_proj"), heads * v, h, bias)?,
            heads: (heads / ctx.comm.world_size()) as i64,
            nope: nope as i64,
            rope: rope as i64,
            v: v as i64,
            kv_lora: kv_lora as i64,
            scale: cfg.softmax_scale,
            interleave: cfg.rope_interleave,
            kernel: ctx.kernels.attention,
        })
    }

    fn forward(&self, x: &Tensor, rope: &RopeTables, mask: Option<&Tensor>) -> Result<Tensor> {
        let (b, t) = (x.size()[0], x.size()[1]);
        let (heads, nope, r, v) = (self.heads, self.nope, self.rope, self.v);
        let rotate = |x: &Tensor| match self.interleave {
            true => rope.apply_interleaved(x),
            false => rope.apply(x),
        };
        // 1. Queries: [b, t, hidden] -> [b, t, heads, nope + rope], this rank's heads.
        let q = sections::time("mla q projections", || match &self.q {
            QueryProjection::Full(p) => p.forward(x),
            QueryProjection::LowRank { down, norm, up } => {
                up.forward(&norm.forward(&down.forward(x)?)?)
            }
        })?
        .f_view([b, t, heads, nope + r])?;
        // 2. The latent and the shared rotary key: [b, t, kv_lora + rope] -> a normed
        //    [b, t, kv_lora] and [b, t, 1, rope].
        let (compressed, latent) = sections::time("mla kv_a projection + norm", || {
            let compressed = self.kv_a_proj_with_mqa.forward(x)?;
            let latent =
                self.kv_a_layernorm
                    .forward(&compressed.f_narrow(2, 0, self.kv_lora)?)?;
            Ok((compressed, latent))
        })?;
        // 3. Rotate the shared key and the query's rope part.
        let (k_rot, q_rot) = sections::time("rope", || {
            Ok((
                rotate(&compressed.f_narrow(2, self.kv_lora, r)?.f_unsqueeze(2)?)?,
                rotate(&q.f_narrow(3, nope, r)?)?,
            ))
        })?;
        // 4. Keys and values from the latent: [b, t, heads, nope + v].
        let kv = sections::time("mla kv_b projection", || self.kv_b_proj.forward(&latent))?
            .f_view([b, t, heads, nope + v])?;
        // 5. The query's rope part joined to its position-free part; every head's key ends in
        //    the one shared rotary part.
        let (q, k) = sections::time("mla q/k assembly", || {
            let q = Tensor::f_cat(&[q.f_narrow(3, 0, nope)?, q_rot], 3)?;
            let k = Tensor::f_cat(
                &[
                    kv.f_narrow(3, 0, nope)?,
                    k_rot.f_expand([b, t, heads, r], false)?,
                ],
                3,
            )?;
            Ok((q, k))
        })?;
        let values = kv.f_narrow(3, nope, v)?;
        // 6. Causal attention over [b, heads, t, *] (right padding never reaches a real token),
        //    with DeepSeek's softmax scale.
        let y = sections::time("attention", || {
            sdpa::attention(
                &q.f_transpose(1, 2)?,
                &k.f_transpose(1, 2)?,
                &values.f_transpose(1, 2)?,
                mask,
                Some(self.scale),
                false,
                self.kernel,
            )
        })?;
        // 7. [b, heads, t, v] -> [b, t, heads * v] -> row-parallel projection and all-reduce.
        sections::time("o projection", || {
            let y = y.f_transpose(1, 2)?.f_reshape([b, t, heads * v])?;
            self.o_proj.forward(&y)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny DeepSeek-V3 config: hidden 64, 4 heads, 3 layers (1 dense), 8 experts in 2
    /// groups, with `extra`'s fields added or replaced.
    fn file(extra: serde_json::Value) -> ConfigFile {
        let mut f = ConfigFile::for_test(
            serde_json::json!({"architectures": ["DeepseekV3ForCausalLM"],
            "num_attention_heads": 4, "num_hidden_layers": 3, "intermediate_size": 96,
            "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
            "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "q_lora_rank": 24,
            "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 12}),
        );
        f.json
            .as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        f
    }

    fn shapes(cfg: &dyn ModelConfig) -> std::collections::BTreeMap<String, Vec<usize>> {
        crate::tools::dry_run::tensors_read(cfg)
            .unwrap()
            .into_iter()
            .map(|s| (s.name, s.shape))
            .collect()
    }

    #[test]
    fn reads_mla_with_and_without_q_lora_and_moe_after_the_dense_layers() {
        let s = shapes(&*parse(&file(serde_json::json!({}))).unwrap());
        let at = |n: &str| s.get(n).cloned();
        assert_eq!(
            at("model.layers.0.self_attn.q_a_proj.weight"),
            Some(vec![24, 64])
        );
        assert_eq!(
            at("model.layers.0.self_attn.q_b_proj.weight"),
            Some(vec![96, 24])
        );
        assert_eq!(
            at("model.layers.0.self_attn.kv_a_proj_with_mqa.weight"),
            Some(vec![24, 64])
        );
        assert_eq!(
            at("model.layers.0.self_attn.kv_b_proj.weight"),
            Some(vec![112, 16])
        );
        assert_eq!(
            at("model.layers.0.self_attn.o_proj.weight"),
            Some(vec![64, 48])
        );
        assert_eq!(
            at("model.layers.0.mlp.gate_proj.weight"),
            Some(vec![96, 64])
        );
        assert_eq!(
            at("model.layers.1.mlp.gate.e_score_correction_bias"),
            Some(vec![8])
        );
        assert_eq!(
            at("model.layers.2.mlp.experts.7.down_proj.weight"),
            Some(vec![64, 32])
        );
        assert_eq!(
            at("model.layers.2.mlp.shared_experts.up_proj.weight"),
            Some(vec![32, 64])
        );
        assert_eq!(at("model.layers.0.mlp.gate.weight"), None);
        assert_eq!(at("model.layers.0.self_attn.q_proj.weight"), None);
        let s = shapes(&*parse(&file(serde_json::json!({"q_lora_rank": null}))).unwrap());
        assert_eq!(
            s.get("model.layers.0.self_attn.q_proj.weight"),
            Some(&vec![96, 64])
        );
        assert!(!s.contains_key("model.layers.0.self_attn.q_a_proj.weight"));
    }

    #[test]
    fn the_kimi_k25_wrapper_reads_the_language_model_under_its_prefix() {
        let inner = file(serde_json::json!({"model_type": "kimi_k2"})).json;
        let wrapper = ConfigFile {
            path: "/m/config.json".into(),
            json: serde_json::json!({"architectures": ["KimiK25ForConditionalGeneration"],
                "text_config": inner, "vision_config": {"hidden_size": 32}}),
        };
        let c = parse_kimi_k25(&wrapper).unwrap();
        assert_eq!(c.info().architecture, "KimiK25ForConditionalGeneration");
        let s = shapes(&*c);
        assert!(
            s.keys().all(|n| n.starts_with("language_model.model.")),
            "{s:?}"
        );
        assert!(s.contains_key("language_model.model.layers.2.mlp.gate.weight"));
        let bare = ConfigFile {
            path: "/m/config.json".into(),
            json: serde_json::json!({"architectures": ["KimiK25ForConditionalGeneration"]}),
        };
        let e = parse_kimi_k25(&bare).err().unwrap().to_string();
        assert!(e.contains("no \"text_config\" object"), "{e}");
    }

    #[test]
    fn yarn_mscale_all_dim_sharpens_the_softmax_and_plain_rope_does_not() {
        let c = DeepseekConfig::from_file(&file(serde_json::json!({})), "D", "model.").unwrap();
        assert_eq!(c.softmax_scale, 24f64.powf(-0.5));
        let c = DeepseekConfig::from_file(
            &file(
                serde_json::json!({"rope_scaling": {"type": "yarn", "factor": 40.0,
                "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 64}}),
            ),
            "D",
            "model.",
        )
        .unwrap();
        let m = 0.1 * 40f64.ln() + 1.0;
        assert_eq!(c.softmax_scale, 24f64.powf(-0.5) * m * m);
    }

    #[test]
    fn names_bad_values_and_tp_sizes_that_do_not_divide_heads_or_experts() {
        let e = |extra| parse(&file(extra)).err().unwrap().to_string();
        assert_eq!(
            e(serde_json::json!({"n_group": 3})),
            "unsupported model config: DeepseekV3ForCausalLM: n_routed_experts = 8 is not a \
             multiple of n_group = 3"
        );
        assert!(e(serde_json::json!({"qk_rope_head_dim": 7})).contains("qk_rope_head_dim = 7"));
        assert!(e(serde_json::json!({"scoring_func": "softmax"})).contains("scoring_func"));
        assert!(e(serde_json::json!({"q_lora_rank": 0})).contains("q_lora_rank = Some(0)"));
        let c = parse(&file(
            serde_json::json!({"n_routed_experts": 6, "n_group": 1}),
        ))
        .unwrap();
        assert!(c.check_tp(2).is_ok());
        let tp4 = c.check_tp(4).unwrap_err().to_string();
        assert!(tp4.contains("n_routed_experts = 6"), "{tp4}");
        let c = parse(&file(serde_json::json!({"num_attention_heads": 6}))).unwrap();
        let tp4 = c.check_tp(4).unwrap_err().to_string();
        assert!(tp4.contains("num_attention_heads = 6"), "{tp4}");
    }
}
