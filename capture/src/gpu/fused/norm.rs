//! RMS norm in one kernel, bf16, with the `fast` norm's roundings (`--norm fast`, in
//! `RmsNorm::forward`): `rstd = rsqrt(sqrt(Σx²)² / dim + eps)` in f32, `x * rstd` rounded to
//! bf16, then `* weight` rounded again; and the same after a residual add (libtorch's bf16 add,
//! one rounding), which is written back beside the normed copy. One read of `x` (two with the
//! add) and one write per output, where libtorch's fast path runs seven kernels.
//!
//! The sum of squares is reduced in this kernel's order, not libtorch's (which depends on the
//! shape through its reduction heuristics), so `rstd` can differ from `fast`'s in its last f32
//! bit and move a bf16 rounding of the output: floor-level, as `fast` is against `exact`.
use tch::{Kind, Tensor};

use super::{cuda_of, grid, Args, Family};
use crate::error::Result;

const SOURCE: &str = r#"
// The fast norm's rstd from the row's f32 sum of squares: libtorch's norm (sqrt of the sum),
// squared, times 1/dim (libtorch divides by a scalar through its f32 reciprocal), plus eps,
// rsqrtf.
__device__ __forceinline__ float rstd_of(float sumsq, float inv_dim, float eps) {
    float n = __fsqrt_rn(sumsq);
    return rsqrtf(__fadd_rn(__fmul_rn(__fmul_rn(n, n), inv_dim), eps));
}

__device__ __forceinline__ u32 add2(u32 a, u32 b) {
    return add_bf(a & 0xffffu, b & 0xffffu) | ((u32)add_bf(a >> 16, b >> 16) << 16);
}

__device__ __forceinline__ float sq2(float acc, u32 v) {
    float a = bf(v & 0xffffu), b = bf(v >> 16);
    return fmaf(b, b, fmaf(a, a, acc));
}

__device__ __forceinline__ u32 norm2(u32 v, u32 w, float rstd) {
    u16 lo = mul_bf(rn(__fmul_rn(bf(v & 0xffffu), rstd)), w & 0xffffu);
    u16 hi = mul_bf(rn(__fmul_rn(bf(v >> 16), rstd)), w >> 16);
    return lo | ((u32)hi << 16);
}

// Row r of x begins at (r / inner) * so + (r % inner) * si elements (even offsets); with ADD,
// x is `a` [rows, dim] contiguous and gets a + res. out [rows, dim] contiguous; dim even.
struct Rows {
    u16* x; const u16* res; const u16* w; u16* out;
    u64 rows, dim, inner, so, si; float inv_dim, eps;
};

template <bool ADD>
__device__ __forceinline__ float pass1(const Rows& p, u32* xr, const u32* rr, u64 j0, u64 step) {
    float acc = 0.0f;
    for (u64 j = j0; j < p.dim / 2; j += step) {
        u32 v = xr[j];
        if (ADD) { v = add2(v, rr[j]); xr[j] = v; }
        acc = sq2(acc, v);
    }
    return acc;
}

__device__ __forceinline__ void pass2(const Rows& p, const u32* xr, u32* o, float rstd, u64 j0,
                                      u64 step) {
    const u32* w = (const u32*)p.w;
    for (u64 j = j0; j < p.dim / 2; j += step) o[j] = norm2(xr[j], w[j], rstd);
}

// One warp per row, for rows of at most a few thousand values.
template <bool ADD> __device__ void rms_warp(const Rows& p) {
    u32 lane = threadIdx.x & 31u;
    u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    for (u64 r = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < p.rows; r += warps) {
        u32* xr = (u32*)(p.x + (r / p.inner) * p.so + (r % p.inner) * p.si);
        const u32* rr = ADD ? (const u32*)(p.res + r * p.dim) : 0;
        float acc = pass1<ADD>(p, xr, rr, lane, 32);
        for (int k = 16; k > 0; k >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, k));
        __syncwarp();
        pass2(p, xr, (u32*)(p.out + r * p.dim), rstd_of(acc, p.inv_dim, p.eps), lane, 32);
    }
}

// One block per row, for wide rows.
template <bool ADD> __device__ void rms_block(const Rows& p) {
    __shared__ float partial[32];
    __shared__ float rstd;
    u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    for (u64 r = blockIdx.x; r < p.rows; r += gridDim.x) {
        u32* xr = (u32*)(p.x + (r / p.inner) * p.so + (r % p.inner) * p.si);
        const u32* rr = ADD ? (const u32*)(p.res + r * p.dim) : 0;
        float acc = pass1<ADD>(p, xr, rr, threadIdx.x, blockDim.x);
        for (int k = 16; k > 0; k >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, k));
        if (lane == 0) partial[warp] = acc;
        __syncthreads();
        if (threadIdx.x == 0) {
            float s = 0.0f;
            for (u32 k = 0; k < (blockDim.x + 31u) / 32u; ++k) s = __fadd_rn(s, partial[k]);
            rstd = rstd_of(s, p.inv_dim, p.eps);
        }
        __syncthreads();
        pass2(p, xr, (u32*)(p.out + r * p.dim), rstd, threadIdx.x, blockDim.x);
        __syncthreads();
    }
}

#define NORM(NAME, ADD, IMPL) \
extern "C" __global__ void NAME(u16* x, const u16* res, const u16* w, u16* out, u64 rows, \
    u64 dim, u64 inner, u64 so, u64 si, float inv_dim, float eps) { \
    Rows p = {x, res, w, out, rows, dim, inner, so, si, inv_dim, eps}; IMPL<ADD>(p); }
NORM(rms_norm_warp, false, rms_warp)
NORM(add_rms_norm_warp, true, rms_warp)
NORM(rms_norm_block, false, rms_block)
NORM(add_rms_norm_block, true, rms_block)
"#;

pub(super) static KERNELS: Family = Family::new(
    "RMS norm",
    SOURCE,
    c"hslake_norm.cu",
    &[
        c"rms_norm_warp",
        c"add_rms_norm_warp",
        c"rms_norm_block",
        c"add_rms_norm_block",
    ],
);

const THREADS: u32 = 256;
/// Rows up to this wide get one warp each; wider ones a block.
const WARP_ROW: i64 = 2048;

/// How the rows of `x [.., dim]` are laid out: `(rows, inner, so, si)` with row `r` at
/// `(r / inner) * so + (r % inner) * si`, if its leading dimensions collapse into at most two
/// (a contiguous tensor into one; a head view of a fused projection into tokens and heads).
pub(crate) fn row_layout(x: &Tensor) -> Option<(i64, i64, i64, i64)> {
    let (size, stride) = (x.size(), x.stride());
    let n = size.len().checked_sub(1)?;
    if stride.get(n) != Some(&1) {
        return None;
    }
    // Merged dimensions, innermost last: (size, stride).
    let mut dims: Vec<(i64, i64)> = vec![];
    for i in 0..n {
        match dims.last_mut() {
            Some(d) if d.1 == size[i] * stride[i] => *d = (d.0 * size[i], stride[i]),
            _ if size[i] == 1 => {}
            _ => dims.push((size[i], stride[i])),
        }
    }
    match dims[..] {
        [] => Some((1, 1, 0, 0)),
        [(rows, so)] => Some((rows, 1, so, 0)),
        [(outer, so), (inner, si)] => Some((outer * inner, inner, so, si)),
        _ => None,
    }
}

/// Norms `x`'s rows (adding `residual` into them first, if given) in one kernel.
fn run(x: &Tensor, residual: Option<&Tensor>, weight: &Tensor, eps: f64) -> Result<Option<Tensor>> {
    let Some(device) = cuda_of(x, Kind::BFloat16) else {
        return Ok(None);
    };
    let dim = x.size().last().copied().unwrap_or(0);
    let Some((rows, inner, so, si)) = row_layout(x) else {
        return Ok(None);
    };
    let weight_fits = cuda_of(weight, Kind::BFloat16) == Some(device)
        && weight.is_contiguous()
        && weight.numel() as i64 == dim;
    let residual_fits = residual.is_none_or(|r| {
        cuda_of(r, Kind::BFloat16) == Some(device)
            && r.is_contiguous()
            && x.is_contiguous()
            && r.size() == x.size()
    });
    let aligned = dim % 2 == 0 && so % 2 == 0 && si % 2 == 0;
    if !weight_fits || !residual_fits || !aligned || dim == 0 {
        return Ok(None);
    }
    let wide = dim > WARP_ROW;
    let index = 2 * usize::from(wide) + usize::from(residual.is_some());
    let Some(kernel) = KERNELS.kernel(device, index) else {
        return Ok(None);
    };
    let out = Tensor::f_empty(x.size().as_slice(), (Kind::BFloat16, x.device()))?;
    // A block per row, or a warp per row.
    let blocks = match wide {
        true => grid(device, rows as u64, 1),
        false => grid(device, rows as u64 * 32, THREADS),
    };
    // SAFETY: the slots follow (x, res, w, out, rows, dim, inner, so, si, inv_dim, eps); x's
    // rows lie where (rows, inner, so, si) says, residual and out are rows x dim contiguous,
    // weight holds dim values, all bf16 on `device` and held until the launch is queued. x is
    // written (the sum) only with a residual, when it is the contiguous sublayer output.
    unsafe {
        Args::default()
            .ptr(x)
            .ptr(residual.unwrap_or(x))
            .ptr(weight)
            .ptr(&out)
            .int(rows)
            .int(dim)
            .int(inner)
            .int(so)
            .int(si)
            .f32(1.0 / dim as f32)
            .f32(eps as f32)
            .launch(kernel, device, blocks, THREADS)?
    };
    Ok(Some(out))
}

/// `x` normed over its last dimension (rows laid out as [`row_layout`] takes them) by `weight`;
/// `None` where the kernel does not apply.
pub(crate) fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Option<Tensor>> {
    run(x, None, weight, eps)
}

/// `sum += residual` in place (contiguous bf16, one rounding per value as libtorch's add), and
/// the normed sum; `None`, `sum` untouched, where the kernel does not apply.
pub(crate) fn add_rms_norm(
    sum: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
    eps: f64,
) -> Result<Option<Tensor>> {
    run(sum, Some(residual), weight, eps)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    #[test]
    fn rows_collapse_into_tokens_and_heads_or_are_refused() {
        let x = Tensor::zeros([2, 3, 8], (Kind::Float, Device::Cpu));
        assert_eq!(row_layout(&x), Some((6, 1, 8, 0)));
        // Query heads of a fused q|k|v projection: [b, t, heads, d] inside [b, t, 3 * heads * d].
        let qkv = Tensor::zeros([2, 3, 3 * 4 * 8], (Kind::Float, Device::Cpu));
        let q = qkv.narrow(2, 0, 4 * 8).view([2, 3, 4, 8]);
        assert_eq!(row_layout(&q), Some((24, 4, 96, 8)));
        // A transposed view keeps three leading strides that do not merge.
        let t = Tensor::zeros([2, 4, 3, 8], (Kind::Float, Device::Cpu)).transpose(1, 2);
        assert_eq!(row_layout(&t.narrow(0, 0, 2).narrow(2, 0, 3)), None);
        assert_eq!(row_layout(&x.transpose(1, 2)), None);
    }

    #[test]
    fn cpu_tensors_are_left_to_libtorch() {
        let x = Tensor::zeros([2, 8], (Kind::BFloat16, Device::Cpu));
        let w = Tensor::ones([8], (Kind::BFloat16, Device::Cpu));
        assert!(rms_norm(&x, &w, 1e-6).unwrap().is_none());
        assert!(add_rms_norm(&x, &x, &w, 1e-6).unwrap().is_none());
    }
}
