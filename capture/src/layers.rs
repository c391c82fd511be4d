//! Building blocks the decoder families share: RMS norm, rotary embedding (with its
//! scaling variants), and the SwiGLU MLP. Each mirrors the Hugging Face implementation's
//! order of operations and dtypes, so f32 results agree to rounding.
use tch::{Device, Kind, Tensor};

use crate::config::{ModelConfig, RopeScaling};
use crate::error::Result;
use crate::tp::{ColumnParallelLinear, LoadCtx, RowParallelLinear};

/// `weight * x / sqrt(mean(x^2) + eps)`, computed in f32 and cast back like transformers does.
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    /// Loads `<prefix>.weight` of shape `[dim]`, replicated on every rank.
    pub fn load(ctx: &LoadCtx, prefix: &str, dim: usize, eps: f64) -> Result<Self> {
        Ok(RmsNorm {
            weight: ctx.full(&format!("{prefix}.weight"), &[dim])?,
            eps,
        })
    }

    /// Normalises over the last dimension.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let kind = x.kind();
        let x32 = x.f_to_kind(Kind::Float)?;
        let var = x32.f_pow_tensor_scalar(2)?.f_mean_dim(-1, true, None)?;
        let normed = x32.f_mul(&var.f_add_scalar(self.eps)?.f_rsqrt()?)?;
        Ok(self.weight.f_mul(&normed.f_to_kind(kind)?)?)
    }
}

/// Rotary position embedding: inverse frequencies fixed at load time, cos/sin per forward.
pub struct Rotary {
    inv_freq: Tensor,
}

impl Rotary {
    /// Inverse frequencies `1 / theta^(2i/d)`, rescaled per the config's RoPE type, in f32.
    pub fn new(cfg: &ModelConfig, device: Device) -> Result<Self> {
        let d = cfg.head_dim as i64;
        // Computed on the CPU, as transformers does when it builds the model: CUDA's division
        // and pow differ from the CPU's in the last bit, and that shifts every angle.
        let exponent = Tensor::f_arange_start_step(0, d, 2, (Kind::Int64, Device::Cpu))?
            .f_to_kind(Kind::Float)?
            .f_div_scalar(d as f64)?;
        let inv_freq = Tensor::f_pow_scalar(cfg.rope_theta, &exponent)?.f_reciprocal()?;
        let inv_freq = match cfg.rope_scaling {
            RopeScaling::None => inv_freq,
            RopeScaling::Linear { factor } => inv_freq.f_div_scalar(factor)?,
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                // Long wavelengths are divided by `factor`, short ones kept, the band between
                // interpolated; same formula and order as transformers' _compute_llama3_parameters.
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                let wavelen = inv_freq
                    .f_reciprocal()?
                    .f_mul_scalar(2.0 * std::f64::consts::PI)?;
                let scaled = inv_freq.f_div_scalar(factor)?;
                let llama = scaled.f_where_self(&wavelen.f_gt(low_wavelen)?, &inv_freq)?;
                let smooth = wavelen
                    .f_reciprocal()?
                    .f_mul_scalar(old)?
                    .f_sub_scalar(low_freq_factor)?
                    .f_div_scalar(high_freq_factor - low_freq_factor)?;
                let smoothed = smooth
                    .f_neg()?
                    .f_add_scalar(1.0)?
                    .f_mul(&llama)?
                    .f_div_scalar(factor)?
                    .f_add(&smooth.f_mul(&llama)?)?;
                let medium = wavelen
                    .f_lt(high_wavelen)?
                    .f_logical_not()?
                    .f_logical_and(&wavelen.f_gt(low_wavelen)?.f_logical_not()?)?;
                smoothed.f_where_self(&medium, &llama)?
            }
        };
        Ok(Rotary {
            inv_freq: inv_freq.f_to_device(device)?,
        })
    }

    /// `(cos, sin)`, each `[1, 1, t, head_dim]` in `kind`, for positions `0..t`.
    pub fn cos_sin(&self, t: i64, kind: Kind) -> Result<(Tensor, Tensor)> {
        let pos = Tensor::f_arange(t, (Kind::Float, self.inv_freq.device()))?;
        // [t, 1] * [1, d/2] -> [t, d/2] angles; duplicated -> [t, d].
        let freqs = pos.f_unsqueeze(1)?.f_mul(&self.inv_freq.f_unsqueeze(0)?)?;
        let emb = Tensor::f_cat(&[&freqs, &freqs], -1)?;
        let cos = emb
            .f_cos()?
            .f_to_kind(kind)?
            .f_unsqueeze(0)?
            .f_unsqueeze(0)?;
        let sin = emb
            .f_sin()?
            .f_to_kind(kind)?
            .f_unsqueeze(0)?
            .f_unsqueeze(0)?;
        Ok((cos, sin))
    }
}

/// `x * cos + rotate_half(x) * sin` for `x: [b, heads, t, head_dim]`.
pub fn apply_rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.size()[3] / 2;
    let x1 = x.f_narrow(3, 0, half)?;
    let x2 = x.f_narrow(3, half, half)?;
    let rotated = Tensor::f_cat(&[&x2.f_neg()?, &x1], 3)?;
    Ok(x.f_mul(cos)?.f_add(&rotated.f_mul(sin)?)?)
}

/// SwiGLU MLP: `down(silu(gate(x)) * up(x))`, gate/up column-parallel, down row-parallel.
pub struct Mlp {
    gate_proj: ColumnParallelLinear,
    up_proj: ColumnParallelLinear,
    down_proj: RowParallelLinear,
}

impl Mlp {
    /// Loads `<prefix>.{gate,up,down}_proj`.
    pub fn load(ctx: &LoadCtx, prefix: &str, cfg: &ModelConfig) -> Result<Self> {
        let (h, i, b) = (cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias);
        Ok(Mlp {
            gate_proj: ColumnParallelLinear::load(ctx, &format!("{prefix}.gate_proj"), h, i, b)?,
            up_proj: ColumnParallelLinear::load(ctx, &format!("{prefix}.up_proj"), h, i, b)?,
            down_proj: RowParallelLinear::load(ctx, &format!("{prefix}.down_proj"), i, h, b)?,
        })
    }

    /// `[b, t, hidden] -> [b, t, hidden]` (complete on every rank).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let gate = self.gate_proj.forward(x)?.f_silu()?; // [b, t, intermediate / tp]
        let up = self.up_proj.forward(x)?; // [b, t, intermediate / tp]
        self.down_proj.forward(&gate.f_mul(&up)?)
    }

    /// Checkpoint names and full shapes this MLP reads.
    pub fn tensor_shapes(prefix: &str, cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let mut v = vec![
            (format!("{prefix}.gate_proj.weight"), vec![i, h]),
            (format!("{prefix}.up_proj.weight"), vec![i, h]),
            (format!("{prefix}.down_proj.weight"), vec![h, i]),
        ];
        if cfg.mlp_bias {
            v.push((format!("{prefix}.gate_proj.bias"), vec![i]));
            v.push((format!("{prefix}.up_proj.bias"), vec![i]));
            v.push((format!("{prefix}.down_proj.bias"), vec![h]));
        }
        v
    }
}
