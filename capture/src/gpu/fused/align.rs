//! A MoE layer's expert alignment and weighted un-permutation for its grouped GEMMs, where
//! libtorch's path (`models/moe/align.rs`) runs a stable sort, counts, a running sum, the
//! inverse permutation, weighting, masking and the top-k sum:
//!
//! - Alignment, three kernels: per-chunk counts of each expert's assignments, one block that
//!   turns them into each chunk's first position per expert (and the int32 group ends of
//!   `_grouped_mm`), and one warp per chunk that places every assignment at its position. The
//!   order is a stable sort by expert, then assignment (token, then slot): the rows the grouped
//!   GEMMs see are the ones `argsort(stable)` gives.
//! - Un-permutation, a gather: each output value sums its token's k expert rows, each times
//!   its routing weight (bf16 x bf16 rounded, or bf16 x f32), rows of another rank's experts
//!   as zeros, in the order libtorch's sum over the top-k dimension adds them (four
//!   accumulators by slot modulo 4, then combined), rounded to bf16 once. No scatter, no
//!   atomics.
use tch::{Kind, Tensor};

use super::{cuda_of, grid, Args, Family};
use crate::error::Result;

const SOURCE: &str = r#"
#define FULL 0xffffffffu
#define MAXE 1024

// Alignment. Assignment a (token a / k, slot a % k) of expert id belongs to local group
// id - first if that is in 0..local, else to `local` (another rank's, sorted past the groups).
// The assignments are cut into chunks of CHUNK, one warp each.
#define CHUNK 1024
__device__ __forceinline__ int group_of(i64 id, i64 first, i64 local) {
    i64 r = id - first;
    return (r >= 0 && r < local) ? (int)r : (int)local;
}

// counts [chunks, local + 1]: each chunk's assignments per group.
extern "C" __global__ void align_count(const i64* ids, int* counts, u64 nk, i64 first, i64 local) {
    __shared__ int cnt[MAXE + 1];
    u64 c = blockIdx.x;
    int groups = (int)local + 1;
    for (int g = threadIdx.x; g < groups; g += 32) cnt[g] = 0;
    __syncwarp();
    for (u64 a = c * CHUNK + threadIdx.x; a < nk && a < (c + 1) * CHUNK; a += 32)
        atomicAdd(&cnt[group_of(ids[a], first, local)], 1);
    __syncwarp();
    for (int g = threadIdx.x; g < groups; g += 32) counts[c * groups + g] = cnt[g];
}

// One block: base [chunks, local + 1] = where each chunk's first assignment of each group goes
// (the groups' running totals over the chunks before it, after every earlier group), and
// ends [local] (int32) = the groups' inclusive running totals.
extern "C" __global__ void align_scan(const int* counts, int* base, int* ends, u64 chunks,
                                      i64 local) {
    __shared__ int start[MAXE + 1];
    int groups = (int)local + 1;
    for (int g = threadIdx.x; g < groups; g += blockDim.x) {
        int run = 0;
        for (u64 c = 0; c < chunks; ++c) { base[c * groups + g] = run; run += counts[c * groups + g]; }
        start[g] = run;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int run = 0;
        for (int g = 0; g < groups; ++g) { int total = start[g]; start[g] = run; run += total; }
    }
    __syncthreads();
    for (int g = threadIdx.x; g < groups; g += blockDim.x) {
        for (u64 c = 0; c < chunks; ++c) base[c * groups + g] += start[g];
        if (g < (int)local) ends[g] = start[g + 1];
    }
}

// One warp per chunk, 32 assignments at a time in order: each goes after every earlier one of
// its group (the chunk's base, what earlier steps placed, its lower-lane peers of this step).
// rows[pos] = its token, inverse[a] = pos.
extern "C" __global__ void align_place(const i64* ids, const int* base, i64* rows, i64* inverse,
                                       u64 nk, u64 k, i64 first, i64 local) {
    __shared__ int next[MAXE + 1];
    u64 c = blockIdx.x;
    int groups = (int)local + 1;
    u32 lane = threadIdx.x, lt = (1u << lane) - 1u;
    for (int g = lane; g < groups; g += 32) next[g] = base[c * groups + g];
    __syncwarp();
    for (u64 a0 = c * CHUNK; a0 < nk && a0 < (c + 1) * CHUNK; a0 += 32) {
        u64 a = a0 + lane;
        bool valid = a < nk && a < (c + 1) * CHUNK;
        int g = valid ? group_of(ids[a], first, local) : -1;
        u32 peers = __match_any_sync(FULL, g);
        int pos = valid ? next[g] + __popc(peers & lt) : 0;
        __syncwarp();
        if (valid && (peers & lt) == 0u) next[g] += __popc(peers);
        __syncwarp();
        if (valid) { rows[pos] = (i64)(a / k); inverse[a] = (i64)pos; }
    }
}

// out [n, hidden] bf16: for each token and pair of columns, its k rows of y [n * k, hidden]
// (row inverse[a] for assignment a) times the assignment's weight, zero for another rank's
// experts, summed as libtorch sums a [n, k, hidden] tensor over k (acc[slot % 4], combined
// ((0 + 1) + 2) + 3), rounded to bf16. Weights bf16 (each product rounded to bf16 first) or
// f32 (`wf32`: the f32 product).
extern "C" __global__ void unpermute(const u32* y, const i64* inverse, const i64* ids,
                                     const void* w, u32* out, u64 n, u64 k, u64 pairs,
                                     i64 first, i64 local, u64 wf32) {
    u64 total = n * pairs;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        u64 tok = i / pairs, col = i - tok * pairs;
        float lo[4] = {0.0f, 0.0f, 0.0f, 0.0f}, hi[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (u64 j = 0; j < k; ++j) {
            u64 a = tok * k + j;
            i64 r = ids[a] - first;
            float plo = 0.0f, phi = 0.0f;
            if (r >= 0 && r < local) {
                u32 v = y[(u64)inverse[a] * pairs + col];
                if (wf32) {
                    float wt = ((const float*)w)[a];
                    plo = __fmul_rn(bf(v & 0xffffu), wt);
                    phi = __fmul_rn(bf(v >> 16), wt);
                } else {
                    u16 wt = ((const u16*)w)[a];
                    plo = bf(mul_bf(v & 0xffffu, wt));
                    phi = bf(mul_bf(v >> 16, wt));
                }
            }
            lo[j & 3] = __fadd_rn(lo[j & 3], plo);
            hi[j & 3] = __fadd_rn(hi[j & 3], phi);
        }
        float sl = __fadd_rn(__fadd_rn(__fadd_rn(lo[0], lo[1]), lo[2]), lo[3]);
        float sh = __fadd_rn(__fadd_rn(__fadd_rn(hi[0], hi[1]), hi[2]), hi[3]);
        out[i] = rn(sl) | ((u32)rn(sh) << 16);
    }
}
"#;

pub(super) static KERNELS: Family = Family::new(
    "MoE alignment",
    SOURCE,
    c"hslake_moe_align.cu",
    &[c"align_count", c"align_scan", c"align_place", c"unpermute"],
);

/// The most groups the alignment counts (the kernels' MAXE).
const MAX_EXPERTS: i64 = 1024;
/// Assignments per alignment chunk (the kernels' CHUNK).
const CHUNK: i64 = 1024;

/// Where a layer's assignments go for its grouped GEMMs.
pub(crate) struct Aligned {
    /// `[n * k]` int64: the token of each sorted position (the rows `x` is gathered by).
    pub rows: Tensor,
    /// `[local]` int32: each local expert's group end in the sorted positions.
    pub ends: Tensor,
    /// `[n * k]` int64: each assignment's sorted position.
    pub inverse: Tensor,
}

/// The stable alignment of `ids [n, k]` (int64) by local expert `id - first` in `0..local`,
/// other ranks' assignments after every group.
pub(crate) fn align(ids: &Tensor, first: i64, local: i64) -> Result<Option<Aligned>> {
    let Some(device) = cuda_of(ids, Kind::Int64) else {
        return Ok(None);
    };
    let [n, k] = ids.size()[..] else {
        return Ok(None);
    };
    if !ids.is_contiguous() || !(1..=MAX_EXPERTS).contains(&local) || k < 1 {
        return Ok(None);
    }
    let (Some(count), Some(scan), Some(place)) = (
        KERNELS.kernel(device, 2),
        KERNELS.kernel(device, 3),
        KERNELS.kernel(device, 4),
    ) else {
        return Ok(None);
    };
    let nk = n * k;
    let chunks = (nk + CHUNK - 1) / CHUNK;
    let on = |kind| (kind, ids.device());
    let counts = Tensor::f_empty([chunks.max(1), local + 1], on(Kind::Int))?;
    let base = Tensor::f_empty([chunks.max(1), local + 1], on(Kind::Int))?;
    let ends = Tensor::f_empty([local], on(Kind::Int))?;
    let rows = Tensor::f_empty([nk], on(Kind::Int64))?;
    let inverse = Tensor::f_empty([nk], on(Kind::Int64))?;
    // SAFETY: each launch's slots follow its kernel's parameters; ids holds nk int64, counts
    // and base chunks x (local + 1) int32, ends local int32, rows and inverse nk int64, all
    // contiguous on `device` and held until the launches are queued, in order on one stream.
    unsafe {
        Args::default()
            .ptr(ids)
            .ptr(&counts)
            .int(nk)
            .int(first)
            .int(local)
            .launch(count, device, chunks as u64, 32)?;
        Args::default()
            .ptr(&counts)
            .ptr(&base)
            .ptr(&ends)
            .int(chunks)
            .int(local)
            .launch(scan, device, 1, 1024)?;
        Args::default()
            .ptr(ids)
            .ptr(&base)
            .ptr(&rows)
            .ptr(&inverse)
            .int(nk)
            .int(k)
            .int(first)
            .int(local)
            .launch(place, device, chunks as u64, 32)?;
    }
    Ok(Some(Aligned {
        rows,
        ends,
        inverse,
    }))
}

/// Each token's `k` rows of `y [n * k, hidden]` (bf16, sorted as [`align`] placed them) times
/// its routing `weights [n, k]` (bf16 or f32), other ranks' experts as zeros, summed over the k
/// in libtorch's order: `[n, hidden]` bf16.
pub(crate) fn unpermute(
    y: &Tensor,
    inverse: &Tensor,
    ids: &Tensor,
    weights: &Tensor,
    first: i64,
    local: i64,
) -> Result<Option<Tensor>> {
    let Some(device) = cuda_of(y, Kind::BFloat16) else {
        return Ok(None);
    };
    let (Ok([nk, hidden]), Ok([n, k])) = (
        <[i64; 2]>::try_from(y.size()),
        <[i64; 2]>::try_from(ids.size()),
    ) else {
        return Ok(None);
    };
    let wf32 = match weights.kind() {
        Kind::Float => true,
        Kind::BFloat16 => false,
        _ => return Ok(None),
    };
    let fits = y.is_contiguous()
        && hidden % 2 == 0
        && nk == n * k
        && [inverse, ids].iter().all(|t| {
            cuda_of(t, Kind::Int64) == Some(device) && t.is_contiguous() && t.numel() as i64 == nk
        })
        && weights.device() == y.device()
        && weights.is_contiguous()
        && weights.size() == [n, k];
    if !fits {
        return Ok(None);
    }
    let Some(kernel) = KERNELS.kernel(device, 5) else {
        return Ok(None);
    };
    let out = Tensor::f_empty([n, hidden], (Kind::BFloat16, y.device()))?;
    let units = (n * hidden / 2) as u64;
    // SAFETY: the slots follow (y, inverse, ids, w, out, n, k, pairs, first, local, wf32); y
    // holds n k rows of hidden bf16, inverse and ids n k int64 (inverse's values < n k, as
    // `align` wrote them), weights n k values of the kind wf32 says, out n x hidden, all
    // contiguous on `device` and held until the launch is queued.
    unsafe {
        Args::default()
            .ptr(y)
            .ptr(inverse)
            .ptr(ids)
            .ptr(weights)
            .ptr(&out)
            .int(n)
            .int(k)
            .int(hidden / 2)
            .int(first)
            .int(local)
            .int(i64::from(wf32))
            .launch(kernel, device, grid(device, units, 256), 256)?
    };
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    #[test]
    fn cpu_tensors_are_left_to_libtorch() {
        let ids = Tensor::zeros([4, 2], (Kind::Int64, Device::Cpu));
        assert!(align(&ids, 0, 8).unwrap().is_none());
        let y = Tensor::zeros([8, 4], (Kind::BFloat16, Device::Cpu));
        let w = Tensor::zeros([4, 2], (Kind::Float, Device::Cpu));
        assert!(unpermute(&y, &ids, &ids, &w, 0, 8).unwrap().is_none());
    }
}
