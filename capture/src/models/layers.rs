//! Building blocks the decoder families share: RMS norm, rotary embedding (with its
//! scaling variants), and the SwiGLU MLP. Each mirrors the Hugging Face implementation's
//! order of operations and dtypes, so f32 results agree to rounding.
use tch::{Device, Kind, Tensor};

use crate::error::Result;
use crate::gpu::fused::{elementwise, norm};
use crate::gpu::sections;
use crate::kernels::{Fusion, NormKernel};
use crate::load::LoadCtx;
use crate::models::tp::{ColumnParallelLinear, RowParallelLinear};
use crate::scalar;

/// Rotary position embedding parameters: the base frequency and how it is rescaled.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Rope {
    /// Base frequency.
    pub theta: f64,
    /// Frequency rescaling.
    pub scaling: RopeScaling,
}

/// How rotary frequencies are derived from the base.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Positions divided by `factor`.
    Linear {
        /// Divisor of the frequencies.
        factor: f64,
    },
    /// Llama 3.1's frequency-dependent rescaling.
    Llama3 {
        /// Overall factor.
        factor: f64,
        /// Wavelengths above original/low_freq_factor are divided by `factor`.
        low_freq_factor: f64,
        /// Wavelengths below original/high_freq_factor are kept.
        high_freq_factor: f64,
        /// Pre-training context length.
        original_max_position_embeddings: f64,
    },
    /// YaRN: frequencies blended between interpolated (`/ factor`) and kept across a ramp of
    /// dimensions, and cos/sin multiplied by an attention factor.
    Yarn {
        /// Context extension factor.
        factor: f64,
        /// Pre-training context length.
        original_max_position_embeddings: f64,
        /// Rotations above which a frequency is kept.
        beta_fast: f64,
        /// Rotations below which a frequency is interpolated.
        beta_slow: f64,
        /// Multiplies cos and sin.
        attention_factor: f64,
        /// Whether the ramp's ends are rounded outwards to whole dimensions.
        truncate: bool,
        /// DeepSeek's softmax-scale mscale (0 = none); unused by the rotation itself.
        mscale_all_dim: f64,
    },
}

/// `weight * x / sqrt(mean(x^2) + eps)`, computed in f32 and cast back like transformers does.
pub(crate) struct RmsNorm {
    weight: Tensor,
    eps: f64,
    /// How it runs: `--norm` on CUDA, always exact on the CPU.
    kernel: NormKernel,
}

impl RmsNorm {
    /// Loads `<prefix>.weight` of shape `[dim]`, replicated on every rank.
    pub fn load(ctx: &LoadCtx, prefix: &str, dim: usize, eps: f64) -> Result<Self> {
        Ok(RmsNorm {
            weight: ctx.full(&format!("{prefix}.weight"), &[dim])?,
            eps,
            kernel: match ctx.device.is_cuda() {
                true => ctx.kernels.norm,
                false => NormKernel::Exact,
            },
        })
    }

    /// A norm of `weight` computed as `kernel` says (`hslake debug kernels` compares them).
    pub fn new(weight: Tensor, eps: f64, kernel: NormKernel) -> Self {
        RmsNorm {
            weight,
            eps,
            kernel,
        }
    }

    /// `sum + residual` (written into `sum`, which the caller owns alone) and its norm: one
    /// kernel with `--norm fused`, else libtorch's add then [`RmsNorm::forward`].
    pub fn forward_add(&self, sum: Tensor, residual: &Tensor) -> Result<(Tensor, Tensor)> {
        if self.kernel == NormKernel::Fused {
            if let Some(normed) = sections::time("add + norm (fused)", || {
                norm::add_rms_norm(&sum, residual, &self.weight, self.eps)
            })? {
                return Ok((sum, normed));
            }
        }
        let mut sum = sum;
        let sum = sections::time("residual add", || Ok(sum.f_add_(residual)?))?;
        let normed = sections::time("norm", || self.forward(&sum))?;
        Ok((sum, normed))
    }

    /// Normalises over the last dimension (any strides); `x` itself is never written.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.kernel == NormKernel::Fused {
            if let Some(normed) = norm::rms_norm(x, &self.weight, self.eps)? {
                return Ok(normed);
            }
        }
        if self.kernel != NormKernel::Exact {
            let dim = x.size().last().copied().unwrap_or(1).max(1);
            // ||x||_2 accumulated in f32 straight from x; squaring it back costs at most an
            // f32 rounding or two in rstd. The Frobenius norm of each row as a [dim, 1] matrix
            // is libtorch's vector 2-norm over the row (`norm(2, -1)`'s reduction) without a
            // Scalar operand (crate::scalar says why).
            let rstd = x
                .f_unsqueeze(-1)?
                .f_linalg_norm_ord_str("fro", [-2i64, -1].as_slice(), true, Kind::Float)?
                .f_squeeze_dim(-1)?
                .f_square_()?
                .f_div_(&scalar::float(dim as f64)?)?
                .f_add_(&scalar::float(self.eps)?)?
                .f_rsqrt_()?;
            // x (compute dtype) * rstd (f32) is computed in f32 and rounded once as it is
            // stored: transformers' `(x32 * rstd).to(dtype)` without the f32 copy of x.
            let normed = Tensor::f_empty(x.size().as_slice(), (x.kind(), x.device()))?;
            let mut normed = x.f_mul_out(&normed, &rstd)?;
            return Ok(normed.f_mul_(&self.weight)?);
        }
        let x32 = x.f_to_kind(Kind::Float)?;
        let rstd = x32
            .f_square()?
            .f_mean_dim(-1, true, None)?
            .f_add_(&scalar::float(self.eps)?)?
            .f_rsqrt_()?;
        // transformers' `(x32 * rstd).to(dtype)` as one kernel: the product is computed in f32
        // and rounded to `dtype` as it is stored, the same bits without the f32 intermediate.
        // Multiplication commutes, so the in-place `*= weight` is its `weight * normed`.
        let normed = Tensor::f_empty(x.size().as_slice(), (x.kind(), x.device()))?;
        let mut normed = x32.f_mul_out(&normed, &rstd)?;
        Ok(normed.f_mul_(&self.weight)?)
    }
}

/// Rotary position embedding: inverse frequencies fixed at load time, cos/sin per forward.
pub(crate) struct Rotary {
    inv_freq: Tensor,
    /// YaRN's factor on cos and sin (1 otherwise).
    attention_factor: f64,
    /// `--rope`: how the tables are applied.
    fusion: Fusion,
}

impl Rotary {
    /// Inverse frequencies `1 / theta^(2i/d)` for `head_dim = d`, rescaled per `rope`, in f32;
    /// tables applied as `fusion` says.
    pub fn new(head_dim: usize, rope: &Rope, device: Device, fusion: Fusion) -> Result<Self> {
        let d = head_dim as i64;
        // Computed on the CPU, as transformers does when it builds the model: CUDA's division
        // and pow differ from the CPU's in the last bit, and that shifts every angle.
        // (Scalar operands as 0-dim tensors: crate::scalar.)
        let f = scalar::float;
        let exponent = scalar::arange((d + 1) / 2, Kind::Int64, Device::Cpu)? // 0, 2, 4, ..
            .f_mul(&scalar::int(2)?)?
            .f_to_kind(Kind::Float)?
            .f_div(&f(d as f64)?)?;
        let inv_freq = f(rope.theta)?.f_pow(&exponent)?.f_reciprocal()?;
        let inv_freq = match rope.scaling {
            RopeScaling::None => inv_freq,
            RopeScaling::Linear { factor } => inv_freq.f_div(&f(factor)?)?,
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
                    .f_mul(&f(2.0 * std::f64::consts::PI)?)?;
                let scaled = inv_freq.f_div(&f(factor)?)?;
                let long = wavelen.f_gt_tensor(&f(low_wavelen)?)?;
                let llama = scaled.f_where_self(&long, &inv_freq)?;
                let smooth = wavelen
                    .f_reciprocal()?
                    .f_mul(&f(old)?)?
                    .f_sub(&f(low_freq_factor)?)?
                    .f_div(&f(high_freq_factor - low_freq_factor)?)?;
                let smoothed = smooth
                    .f_neg()?
                    .f_add(&f(1.0)?)?
                    .f_mul(&llama)?
                    .f_div(&f(factor)?)?
                    .f_add(&smooth.f_mul(&llama)?)?;
                let medium = wavelen
                    .f_lt_tensor(&f(high_wavelen)?)?
                    .f_logical_not()?
                    .f_logical_and(&long.f_logical_not()?)?;
                smoothed.f_where_self(&medium, &llama)?
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                truncate,
                ..
            } => {
                // transformers' _compute_yarn_parameters, step for step: `pos_freqs` is
                // theta^(2i/d), extrapolation its reciprocal, interpolation 1 / (factor * it).
                let pos_freqs = f(rope.theta)?.f_pow(&exponent)?;
                let interpolation = pos_freqs.f_mul(&f(factor)?)?.f_reciprocal()?;
                let (low, high) = yarn_correction_range(
                    head_dim as f64,
                    rope.theta,
                    original_max_position_embeddings,
                    beta_fast,
                    beta_slow,
                    truncate,
                );
                let high = if low == high { high + 0.001 } else { high };
                let ramp = scalar::arange(d / 2, Kind::Float, Device::Cpu)?
                    .f_sub(&f(low)?)?
                    .f_div(&f(high - low)?)?
                    .f_clamp_tensor(Some(&f(0.0)?), Some(&f(1.0)?))?;
                let extrapolation_factor = ramp.f_neg()?.f_add(&f(1.0)?)?;
                let kept = extrapolation_factor.f_neg()?.f_add(&f(1.0)?)?;
                interpolation
                    .f_mul(&kept)?
                    .f_add(&inv_freq.f_mul(&extrapolation_factor)?)?
            }
        };
        let attention_factor = match rope.scaling {
            RopeScaling::Yarn {
                attention_factor, ..
            } => attention_factor,
            _ => 1.0,
        };
        Ok(Rotary {
            inv_freq: inv_freq.f_to_device(device)?,
            attention_factor,
            fusion,
        })
    }

    /// cos and sin in `kind` for positions `0..t`, computed once per forward.
    pub fn tables(&self, t: i64, kind: Kind) -> Result<RopeTables> {
        let pos = scalar::arange(t, Kind::Float, self.inv_freq.device())?;
        // [t, 1] * [1, d/2] -> [t, d/2] angles; duplicated -> [t, d].
        let freqs = pos.f_unsqueeze(1)?.f_mul(&self.inv_freq.f_unsqueeze(0)?)?;
        RopeTables::new(
            &Tensor::f_cat(&[&freqs, &freqs], -1)?,
            self.attention_factor,
            kind,
            self.fusion,
        )
    }
}

/// The dimensions `(low, high)` between which YaRN ramps from kept to interpolated frequencies
/// (transformers' `find_correction_range`, in f64 as Python computes it).
fn yarn_correction_range(
    dim: f64,
    base: f64,
    original: f64,
    beta_fast: f64,
    beta_slow: f64,
    truncate: bool,
) -> (f64, f64) {
    let at = |rotations: f64| {
        (dim * (original / (rotations * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * base.ln())
    };
    let (mut low, mut high) = (at(beta_fast), at(beta_slow));
    if truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    (low.max(0.0), high.min(dim - 1.0))
}

/// One forward's rotary tables, shaped `[1, t, 1, ..]` for `[b, t, heads, head_dim]` inputs.
pub(crate) struct RopeTables {
    cos: Tensor,
    /// `sin` whole (contiguous), for the fused kernel.
    sin: Tensor,
    /// `-sin` over the first half of `head_dim`: `rotate_half` negates `x2` there.
    sin_lo_neg: Tensor,
    /// `sin` over the second half, which holds each frequency once, as the first half does.
    sin_hi: Tensor,
    /// `--rope`.
    fusion: Fusion,
}

impl RopeTables {
    /// From the `[t, head_dim]` f32 angles of positions `0..t`; cos and sin are multiplied by
    /// `factor` in f32 (YaRN) before they are rounded to `kind`, as transformers does.
    pub(crate) fn new(emb: &Tensor, factor: f64, kind: Kind, fusion: Fusion) -> Result<Self> {
        let (t, d) = (emb.size()[0], emb.size()[1]);
        let half = d / 2;
        let scaled = |x: Tensor| -> Result<Tensor> {
            // Multiplying by 1 is exact, so plain RoPE skips the kernel.
            Ok(if factor == 1.0 {
                x
            } else {
                x.f_mul(&scalar::float(factor)?)?
            })
        };
        // [1, t, 1, d] broadcasts over the heads of a `[b, t, heads, d]` projection output.
        let cos = scaled(emb.f_cos()?)?
            .f_to_kind(kind)?
            .f_view([1, t, 1, d])?;
        let sin = scaled(emb.f_sin()?)?
            .f_to_kind(kind)?
            .f_view([1, t, 1, d])?;
        Ok(RopeTables {
            cos,
            sin_lo_neg: sin.f_narrow(3, 0, half)?.f_neg()?,
            sin_hi: sin.f_narrow(3, half, half)?,
            sin,
            fusion,
        })
    }

    /// The fused kernel's result, where `--rope fused` and it applies.
    fn fused(&self, x: &Tensor, interleaved: bool) -> Result<Option<Tensor>> {
        match self.fusion {
            Fusion::Fused => elementwise::rope(x, &self.cos, &self.sin, interleaved),
            Fusion::Torch => Ok(None),
        }
    }

    /// `x * cos + rotate_half(x) * sin` for `x: [b, t, heads, head_dim]` (any strides, e.g. a
    /// slice of a fused projection), as a new tensor; `x` is not written.
    ///
    /// Bit-identical to transformers' formula with fewer kernels and bytes: `rotate_half(x) *
    /// sin` is `[x2 * -sin_lo, x1 * sin_hi]` (negation is exact and rounding is symmetric), so
    /// each half is one multiply written straight into its place, with no negated copy and no
    /// concatenation; then one multiply by cos and one in-place sum, in transformers' order.
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        if let Some(out) = self.fused(x, false)? {
            return Ok(out);
        }
        let size = x.size();
        let half = size[3] / 2;
        let rotated = Tensor::f_empty(size.as_slice(), (x.kind(), x.device()))?;
        let _ = x
            .f_narrow(3, half, half)?
            .f_mul_out(&rotated.f_narrow(3, 0, half)?, &self.sin_lo_neg)?;
        let _ = x
            .f_narrow(3, 0, half)?
            .f_mul_out(&rotated.f_narrow(3, half, half)?, &self.sin_hi)?;
        Ok(x.f_mul(&self.cos)?.f_add_(&rotated)?)
    }

    /// RoPE on pairs `(x0, x1), (x2, x3), ...` of `x: [b, t, heads, d]` (DeepSeek's checkpoint
    /// layout), each pair rotated by one frequency, written de-interleaved: evens' results in
    /// the first half, odds' in the second — transformers' `apply_rotary_pos_emb_interleave`,
    /// `[x_even * cos - x_odd * sin, x_odd * cos + x_even * sin]` in the same order of operations.
    /// Queries and keys both come out in that order, so their dot products are those of the
    /// interleaved vectors.
    pub fn apply_interleaved(&self, x: &Tensor) -> Result<Tensor> {
        if let Some(out) = self.fused(x, true)? {
            return Ok(out);
        }
        let size = x.size();
        let half = size[3] / 2;
        let cos = self.cos.f_narrow(3, 0, half)?;
        let sin = &self.sin_hi;
        let even = x.f_slice(3, 0, None, 2)?;
        let odd = x.f_slice(3, 1, None, 2)?;
        let out = Tensor::f_empty(size.as_slice(), (x.kind(), x.device()))?;
        let mut lo = even.f_mul_out(&out.f_narrow(3, 0, half)?, &cos)?;
        let _ = lo.f_sub_(&odd.f_mul(sin)?)?;
        let mut hi = odd.f_mul_out(&out.f_narrow(3, half, half)?, &cos)?;
        let _ = hi.f_add_(&even.f_mul(sin)?)?;
        Ok(out)
    }
}

/// `silu(gate) * up` of a gate/up GEMM's output `[.., 2n]` (gate columns first): `[.., n]`,
/// by our kernel under `--activation fused` where it applies, else by libtorch (SiLU in place:
/// the caller hands over the GEMM output, which nothing else holds).
pub(crate) fn silu_mul(gate_up: &Tensor, n: i64, fusion: Fusion) -> Result<Tensor> {
    if fusion == Fusion::Fused {
        if let Some(out) = elementwise::silu_mul(gate_up, n)? {
            return Ok(out);
        }
    }
    let gate = gate_up.f_narrow(-1, 0, n)?.f_silu_()?;
    Ok(gate.f_mul(&gate_up.f_narrow(-1, n, n)?)?)
}

/// The profile's section names of one MLP's three steps.
pub(crate) struct MlpSections {
    /// The gate/up GEMM.
    pub gate_up: &'static str,
    /// SiLU-and-mul.
    pub act: &'static str,
    /// The down GEMM (and its all-reduce).
    pub down: &'static str,
}

/// A decoder layer's dense MLP.
pub(crate) const DENSE_MLP: MlpSections = MlpSections {
    gate_up: "mlp gate_up",
    act: "mlp silu * up",
    down: "mlp down",
};

/// A MoE layer's shared expert.
pub(crate) const SHARED_EXPERT: MlpSections = MlpSections {
    gate_up: "shared expert gate_up",
    act: "shared expert silu * up",
    down: "shared expert down",
};

/// SwiGLU MLP: `down(silu(gate(x)) * up(x))`, gate/up column-parallel, down row-parallel.
pub(crate) struct Mlp {
    /// This rank's gate rows then its up rows: one GEMM for both.
    gate_up_proj: ColumnParallelLinear,
    down_proj: RowParallelLinear,
    /// `intermediate_size / tp`: where the up half of the fused output starts.
    local_intermediate: i64,
    /// `--activation`.
    activation: Fusion,
    sections: MlpSections,
}

impl Mlp {
    /// Loads `<prefix>.{gate,up,down}_proj` (`hidden -> intermediate -> hidden`, with biases
    /// if `bias`), gate and up stacked into one weight; profiled under `sections`' names.
    pub fn load(
        ctx: &LoadCtx,
        prefix: &str,
        (hidden, intermediate): (usize, usize),
        bias: bool,
        sections: MlpSections,
    ) -> Result<Self> {
        let (h, i, b) = (hidden, intermediate, bias);
        let (gate, up) = (format!("{prefix}.gate_proj"), format!("{prefix}.up_proj"));
        Ok(Mlp {
            gate_up_proj: ColumnParallelLinear::load_fused(ctx, &[(&gate, i), (&up, i)], h, b)?,
            down_proj: RowParallelLinear::load(ctx, &format!("{prefix}.down_proj"), i, h, b)?,
            local_intermediate: (i / ctx.comm.world_size()) as i64,
            activation: ctx.kernels.activation,
            sections,
        })
    }

    /// `[b, t, hidden] -> [b, t, hidden]` (complete on every rank).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let act = self.activation(x)?;
        sections::time(self.sections.down, || self.down_proj.forward(&act))
    }

    /// This rank's unsummed output (see [`RowParallelLinear::partial`]), for a MoE layer that
    /// sums its shared expert and its routed experts in one all-reduce.
    pub fn partial(&self, x: &Tensor) -> Result<Tensor> {
        let act = self.activation(x)?;
        sections::time(self.sections.down, || self.down_proj.partial(&act))
    }

    /// `silu(gate(x)) * up(x)`: `[b, t, intermediate / tp]`.
    fn activation(&self, x: &Tensor) -> Result<Tensor> {
        // [b, t, 2 * intermediate / tp], which nothing else holds.
        let gate_up = sections::time(self.sections.gate_up, || self.gate_up_proj.forward(x))?;
        sections::time(self.sections.act, || {
            silu_mul(&gate_up, self.local_intermediate, self.activation)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf16(size: &[i64], seed: i64) -> Tensor {
        tch::manual_seed(seed);
        Tensor::randn(size, (Kind::Float, Device::Cpu)).to_kind(Kind::BFloat16)
    }

    #[test]
    fn rope_on_a_strided_slice_equals_the_rotate_half_formula_bit_for_bit() {
        let (t, d) = (5, 8);
        tch::manual_seed(1);
        let angles = Tensor::rand([t, d / 2], (Kind::Float, Device::Cpu)).g_mul_scalar(7.0);
        let emb = Tensor::cat(&[&angles, &angles], -1);
        // Heads 1..5 of 7, as a slice of a fused q|k|v output would be.
        let x = bf16(&[2, t, 7, d], 2).narrow(2, 1, 4);
        let before = x.copy();
        let got = RopeTables::new(&emb, 1.0, Kind::BFloat16, Fusion::Torch)
            .unwrap()
            .apply(&x)
            .unwrap();
        // transformers: [b, heads, t, d] with cos/sin [1, 1, t, d], q * cos + rotate_half(q) * sin.
        let xt = x.transpose(1, 2);
        let cos = emb.cos().to_kind(Kind::BFloat16).view([1, 1, t, d]);
        let sin = emb.sin().to_kind(Kind::BFloat16).view([1, 1, t, d]);
        let (x1, x2) = (xt.narrow(3, 0, d / 2), xt.narrow(3, d / 2, d / 2));
        let rotated = Tensor::cat(&[&x2.neg(), &x1], 3);
        let expected = (&xt * &cos + rotated * &sin).transpose(1, 2);
        assert!(got.equal(&expected));
        assert!(x.equal(&before), "the input was written");
    }

    #[test]
    fn interleaved_rope_equals_transformers_pairwise_formula_bit_for_bit() {
        let (t, d) = (4, 8);
        tch::manual_seed(7);
        let angles = Tensor::rand([t, d / 2], (Kind::Float, Device::Cpu)).g_mul_scalar(5.0);
        let emb = Tensor::cat(&[&angles, &angles], -1);
        let x = bf16(&[2, t, 5, 12], 8).narrow(3, 4, d);
        let got = RopeTables::new(&emb, 1.25, Kind::BFloat16, Fusion::Torch)
            .unwrap()
            .apply_interleaved(&x)
            .unwrap();
        // transformers: cos/sin scaled in f32, rounded, then their first halves.
        let cos = (emb.cos() * 1.25)
            .to_kind(Kind::BFloat16)
            .narrow(1, 0, d / 2);
        let sin = (emb.sin() * 1.25)
            .to_kind(Kind::BFloat16)
            .narrow(1, 0, d / 2);
        let (cos, sin) = (cos.view([1, t, 1, d / 2]), sin.view([1, t, 1, d / 2]));
        let (x1, x2) = (x.slice(3, 0, None, 2), x.slice(3, 1, None, 2));
        let expected = Tensor::cat(&[&x1 * &cos - &x2 * &sin, &x2 * &cos + &x1 * &sin], 3);
        assert!(got.equal(&expected));
    }

    #[test]
    fn yarn_ramp_bounds_follow_the_rotation_counts_and_stay_inside_the_head() {
        // DeepSeek-V3: 64 rotary dims, base 10000, 4096 pre-training positions, betas 32 / 1.
        let (low, high) = yarn_correction_range(64.0, 10000.0, 4096.0, 32.0, 1.0, true);
        assert_eq!((low, high), (10.0, 23.0));
        let (low, high) = yarn_correction_range(8.0, 10000.0, 1e9, 32.0, 1.0, false);
        assert_eq!((low > 0.0, high), (true, 7.0));
    }

    /// `Rotary::new`'s inverse frequencies transcribed with libtorch's Scalar operands, as they
    /// were computed before crate::scalar (and as transformers computes them).
    fn reference_inv_freq(head_dim: i64, rope: &Rope) -> Tensor {
        let d = head_dim;
        let exponent = Tensor::arange_start_step(0, d, 2, (Kind::Int64, Device::Cpu))
            .to_kind(Kind::Float)
            .g_div_scalar(d as f64);
        let inv_freq = Tensor::pow_scalar(rope.theta, &exponent).reciprocal();
        match rope.scaling {
            RopeScaling::None => inv_freq,
            RopeScaling::Linear { factor } => inv_freq.g_div_scalar(factor),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor: lf,
                high_freq_factor: hf,
                original_max_position_embeddings: old,
            } => {
                let wavelen = inv_freq
                    .reciprocal()
                    .g_mul_scalar(2.0 * std::f64::consts::PI);
                let llama = inv_freq
                    .g_div_scalar(factor)
                    .where_self(&wavelen.gt(old / lf), &inv_freq);
                let smooth = wavelen
                    .reciprocal()
                    .g_mul_scalar(old)
                    .g_sub_scalar(lf)
                    .g_div_scalar(hf - lf);
                let smoothed = (smooth.neg().g_add_scalar(1.0) * &llama).g_div_scalar(factor)
                    + smooth * &llama;
                let medium = wavelen
                    .lt(old / hf)
                    .logical_not()
                    .logical_and(&wavelen.gt(old / lf).logical_not());
                smoothed.where_self(&medium, &llama)
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                truncate,
                ..
            } => {
                let interpolation = Tensor::pow_scalar(rope.theta, &exponent)
                    .g_mul_scalar(factor)
                    .reciprocal();
                let (low, high) = yarn_correction_range(
                    d as f64,
                    rope.theta,
                    original_max_position_embeddings,
                    beta_fast,
                    beta_slow,
                    truncate,
                );
                let ramp = Tensor::arange(d / 2, (Kind::Float, Device::Cpu))
                    .g_sub_scalar(low)
                    .g_div_scalar(high - low)
                    .clamp(0.0, 1.0);
                let extrapolation = ramp.neg().g_add_scalar(1.0);
                let kept = extrapolation.neg().g_add_scalar(1.0);
                interpolation * kept + &inv_freq * extrapolation
            }
        }
    }

    #[test]
    fn inverse_frequencies_of_every_scaling_equal_the_scalar_formulas_bit_for_bit() {
        let yarn = |truncate| RopeScaling::Yarn {
            factor: 40.0,
            original_max_position_embeddings: 4096.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: 1.0,
            truncate,
            mscale_all_dim: 0.0,
        };
        let scalings = [
            RopeScaling::None,
            RopeScaling::Linear { factor: 3.0 },
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192.0,
            },
            yarn(true),
            yarn(false),
        ];
        for scaling in scalings {
            for (head_dim, theta) in [(64, 10000.0), (128, 500000.0), (6, 1e6)] {
                let rope = Rope {
                    theta,
                    scaling: scaling.clone(),
                };
                let got =
                    Rotary::new(head_dim as usize, &rope, Device::Cpu, Fusion::Torch).unwrap();
                let want = reference_inv_freq(head_dim, &rope);
                assert_eq!(got.inv_freq.kind(), Kind::Float);
                assert!(got.inv_freq.equal(&want), "{rope:?}, head_dim {head_dim}");
            }
        }
    }

    #[test]
    fn rope_tables_for_more_positions_than_memory_holds_are_an_out_of_memory_error() {
        let rope = Rope {
            theta: 10000.0,
            scaling: RopeScaling::None,
        };
        let rotary = Rotary::new(16, &rope, Device::Cpu, Fusion::Torch).unwrap();
        let tables = rotary.tables(5, Kind::BFloat16).unwrap();
        assert_eq!(tables.cos.size(), [1, 5, 1, 16]);
        // 2^50 positions: libtorch refuses the allocation, and that is an error, not a panic
        // (with a Scalar operand, tch panicked on it).
        let err = rotary.tables(1 << 50, Kind::BFloat16).err().unwrap();
        assert!(
            matches!(err, crate::error::CaptureError::OutOfMemory { .. }),
            "{err}"
        );
    }

    fn norm(weight: Tensor) -> RmsNorm {
        RmsNorm {
            weight,
            eps: 1e-6,
            kernel: NormKernel::Exact,
        }
    }

    #[test]
    fn rms_norm_matches_transformers_bit_for_bit_and_leaves_its_input_alone() {
        for kind in [Kind::BFloat16, Kind::Float] {
            let x = bf16(&[2, 3, 6, 16], 3).to_kind(kind).narrow(2, 1, 4);
            let before = x.copy();
            let w = bf16(&[16], 4).to_kind(kind);
            let got = norm(w.shallow_clone()).forward(&x).unwrap();
            let x32 = x.to_kind(Kind::Float);
            let var = x32.pow_tensor_scalar(2).mean_dim(-1, true, None);
            let expected = &w * (x32 * (var + 1e-6).rsqrt()).to_kind(kind);
            assert_eq!(got.kind(), kind);
            assert!(got.equal(&expected), "{kind:?}");
            assert!(x.equal(&before), "{kind:?}: the input was written");
        }
    }

    #[test]
    fn fast_rms_norm_is_the_vector_norm_formula_bit_for_bit() {
        // The Frobenius norm of [dim, 1] rows against libtorch's `norm(2, -1)`, with which the
        // fast path was written and measured.
        let x = bf16(&[4, 16, 64], 5).narrow(2, 0, 48);
        let w = bf16(&[48], 6);
        let fast = RmsNorm {
            weight: w.shallow_clone(),
            eps: 1e-6,
            kernel: NormKernel::Fast,
        }
        .forward(&x)
        .unwrap();
        let rstd = x
            .norm_scalaropt_dim_dtype(2.0, [-1i64].as_slice(), true, Kind::Float)
            .square()
            .g_div_scalar(48.0)
            .g_add_scalar(1e-6)
            .rsqrt();
        let expected = (x.to_kind(Kind::Float) * rstd).to_kind(Kind::BFloat16) * w;
        assert!(fast.equal(&expected));
    }

    #[test]
    fn fast_rms_norm_rounds_like_the_exact_one_almost_everywhere() {
        // The fast path only runs on CUDA in a capture; its operations exist on the CPU too,
        // which lets this test check it against transformers' formula.
        let x = bf16(&[4, 16, 64], 5).narrow(2, 0, 48);
        let w = bf16(&[48], 6);
        let exact = norm(w.shallow_clone()).forward(&x).unwrap();
        let fast = RmsNorm {
            weight: w,
            eps: 1e-6,
            kernel: NormKernel::Fast,
        }
        .forward(&x)
        .unwrap();
        assert_eq!(fast.kind(), Kind::BFloat16);
        assert_eq!(fast.size(), exact.size());
        let (e, f) = (exact.to_kind(Kind::Float), fast.to_kind(Kind::Float));
        // Never more than one unit in the last place (2^-7 of the value's binade)...
        let d = (&f - &e).abs();
        assert!(d.le_tensor(&(e.abs() / 128.0)).all().int64_value(&[]) == 1);
        // ...and almost always none.
        let differing = d.gt(0.0).sum(Kind::Int64).int64_value(&[]);
        assert!(
            differing * 100 <= e.numel() as i64,
            "{differing} of {}",
            e.numel()
        );
    }
}
