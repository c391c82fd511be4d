//! SiLU-and-mul and rotary embeddings in one kernel each, bf16, bit-identical to the libtorch
//! operations they replace (`Mlp`'s activation, `RopeTables::apply` and `apply_interleaved`):
//! every intermediate libtorch rounds to bf16 is rounded here too, in the same order, and the
//! f32 operations are the same IEEE operations (`__fmul_rn` and friends: nothing is contracted
//! into a fused multiply-add that libtorch computes in two kernels).
use tch::{Kind, Tensor};

use super::{cuda_of, grid, Args, Family};
use crate::error::Result;

const SOURCE: &str = r#"
// silu(g) rounded to bf16, as libtorch's silu (x / (1 + exp(-x)) in f32), times u, rounded.
__device__ __forceinline__ u32 silu_mul1(u32 g, u32 u) {
    float x = bf((u16)g);
    u16 s = rn(__fdiv_rn(x, __fadd_rn(1.0f, expf(-x))));
    return mul_bf(s, (u16)u);
}

// gate_up [rows, 2n] bf16 (gate then up), out [rows, n]; in u32 pairs: `pairs` = n / 2.
template <typename I> __device__ void silu_mul_impl(const u32* gu, u32* out, I rows, I pairs) {
    I total = rows * pairs;
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (I)gridDim.x * blockDim.x) {
        I r = i / pairs, c = i - r * pairs;
        u32 g = gu[r * 2 * pairs + c], u = gu[r * 2 * pairs + pairs + c];
        out[i] = silu_mul1(g & 0xffffu, u & 0xffffu) | (silu_mul1(g >> 16, u >> 16) << 16);
    }
}

extern "C" __global__ void silu_mul(const u32* gu, u32* out, u64 rows, u64 pairs) {
    if (rows * pairs < 0x40000000ull) silu_mul_impl<u32>(gu, out, (u32)rows, (u32)pairs);
    else silu_mul_impl<u64>(gu, out, rows, pairs);
}

// x [b, t, h, d] at strides (sb, st, sh, 1), out [b, t, h, d] contiguous, cos and sin [t, d].
// One thread per rotated pair: (j, j + d/2) for rotate-half, (2j, 2j + 1) interleaved, whose
// results go to j and j + d/2.
template <typename I, bool INTERLEAVED>
__device__ void rope_impl(const u16* x, const u16* cos, const u16* sin, u16* out, I b, I t, I h,
                          I d, I sb, I st, I sh) {
    I half = d / 2, total = b * t * h * half;
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (I)gridDim.x * blockDim.x) {
        I j = i % half, r = i / half;
        I hh = r % h; r /= h;
        I tt = r % t, bb = r / t;
        const u16* xr = x + bb * sb + tt * st + hh * sh;
        const u16* c = cos + tt * d;
        const u16* s = sin + tt * d;
        u16* o = out + ((bb * t + tt) * h + hh) * d;
        u16 lo, hi;
        if (INTERLEAVED) {
            // [even * cos - odd * sin, odd * cos + even * sin], cos and sin of frequency j.
            u16 e = xr[2 * j], od = xr[2 * j + 1], cj = c[j], sj = s[half + j];
            lo = rn(__fsub_rn(bf(mul_bf(e, cj)), bf(mul_bf(od, sj))));
            hi = add_bf(mul_bf(od, cj), mul_bf(e, sj));
        } else {
            // x * cos + rotate_half(x) * sin, rotate_half's negation on sin (exact).
            u16 x1 = xr[j], x2 = xr[j + half];
            lo = add_bf(mul_bf(x1, c[j]), mul_bf(x2, s[j] ^ 0x8000u));
            hi = add_bf(mul_bf(x2, c[j + half]), mul_bf(x1, s[j + half]));
        }
        o[j] = lo;
        o[j + half] = hi;
    }
}

#define ROPE(NAME, INTERLEAVED) \
extern "C" __global__ void NAME(const u16* x, const u16* cos, const u16* sin, u16* out, u64 b, \
    u64 t, u64 h, u64 d, u64 sb, u64 st, u64 sh, u64 narrow) { \
    if (narrow) rope_impl<u32, INTERLEAVED>(x, cos, sin, out, (u32)b, (u32)t, (u32)h, (u32)d, \
                                            (u32)sb, (u32)st, (u32)sh); \
    else rope_impl<u64, INTERLEAVED>(x, cos, sin, out, b, t, h, d, sb, st, sh); }
ROPE(rope_half, false)
ROPE(rope_interleaved, true)
"#;

pub(super) static KERNELS: Family = Family::new(
    "SiLU-and-mul and RoPE",
    SOURCE,
    c"hslake_elementwise.cu",
    &[c"silu_mul", c"rope_half", c"rope_interleaved"],
);

const THREADS: u32 = 256;

/// `silu(gate) * up` of `gate_up [.., 2n]` (the gate columns first): `[.., n]` in one kernel;
/// `None` unless `gate_up` is a contiguous bf16 CUDA tensor and `n` even.
pub(crate) fn silu_mul(gate_up: &Tensor, n: i64) -> Result<Option<Tensor>> {
    let Some(device) = cuda_of(gate_up, Kind::BFloat16) else {
        return Ok(None);
    };
    let mut size = gate_up.size();
    let last = size.len().wrapping_sub(1);
    if size.get(last) != Some(&(2 * n)) || n % 2 != 0 || !gate_up.is_contiguous() {
        return Ok(None);
    }
    let Some(kernel) = KERNELS.kernel(device, 0) else {
        return Ok(None);
    };
    size[last] = n;
    let out = Tensor::f_empty(size.as_slice(), (Kind::BFloat16, gate_up.device()))?;
    let pairs = n / 2;
    let rows = if n == 0 { 0 } else { out.numel() as i64 / n };
    let units = (rows * pairs) as u64;
    // SAFETY: (gate_up, out, rows, pairs) is the kernel's signature; gate_up holds rows x 2n
    // and out rows x n contiguous bf16 on `device`, both held by the caller and this function.
    unsafe {
        Args::default()
            .ptr(gate_up)
            .ptr(&out)
            .int(rows)
            .int(pairs)
            .launch(kernel, device, grid(device, units, THREADS), THREADS)?
    };
    Ok(Some(out))
}

/// RoPE of `x [b, t, h, d]` (unit stride over `d`) by the `[.., t, .., d]` tables `cos` and
/// `sin` (contiguous): rotate-half, or DeepSeek's interleaved pairs written de-interleaved if
/// `interleaved`; a new contiguous tensor. `None` unless all three are bf16 on one GPU.
pub(crate) fn rope(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    interleaved: bool,
) -> Result<Option<Tensor>> {
    let Some(device) = cuda_of(x, Kind::BFloat16) else {
        return Ok(None);
    };
    let [b, t, h, d] = x.size()[..] else {
        return Ok(None);
    };
    let (stride, table) = (x.stride(), t * d);
    let tables_fit = [cos, sin].iter().all(|c| {
        cuda_of(c, Kind::BFloat16) == Some(device) && c.is_contiguous() && c.numel() as i64 == table
    });
    if !tables_fit || stride[3] != 1 || d % 2 != 0 || stride.iter().any(|&s| s < 0) {
        return Ok(None);
    }
    let Some(kernel) = KERNELS.kernel(device, if interleaved { 2 } else { 1 }) else {
        return Ok(None);
    };
    let out = Tensor::f_empty([b, t, h, d], (Kind::BFloat16, x.device()))?;
    let units = (b * t * h * (d / 2)) as u64;
    // 32-bit indices while every unit index and every element offset read or written fits.
    let reach = (b * t * h * d).max((b - 1) * stride[0] + (t - 1) * stride[1] + h * stride[2] + d);
    let narrow = i64::from(reach < 1 << 30 && units < 1 << 30);
    // SAFETY: the slots follow the kernel's (x, cos, sin, out, b, t, h, d, sb, st, sh, narrow);
    // x is read at the strides given, cos and sin hold t x d values, out b x t x h x d, all
    // bf16 on `device` and held until the launch is queued.
    unsafe {
        Args::default()
            .ptr(x)
            .ptr(cos)
            .ptr(sin)
            .ptr(&out)
            .int(b)
            .int(t)
            .int(h)
            .int(d)
            .int(stride[0])
            .int(stride[1])
            .int(stride[2])
            .int(narrow)
            .launch(kernel, device, grid(device, units, THREADS), THREADS)?
    };
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    #[test]
    fn cpu_tensors_are_left_to_libtorch() {
        let x = Tensor::zeros([2, 8], (Kind::BFloat16, Device::Cpu));
        assert!(silu_mul(&x, 4).unwrap().is_none());
        let q = Tensor::zeros([1, 3, 2, 4], (Kind::BFloat16, Device::Cpu));
        let table = Tensor::zeros([3, 4], (Kind::BFloat16, Device::Cpu));
        assert!(rope(&q, &table, &table, false).unwrap().is_none());
    }
}
