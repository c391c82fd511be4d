//! MoE routers in one kernel each, one warp per token, where libtorch's path
//! (`models/moe/router.rs`) runs about eight small ones: Qwen3-MoE's softmax top-k (renormalised
//! or not) and DeepSeek-V3's grouped sigmoid top-k with its correction bias. Each reproduces
//! libtorch's order of operations: the persistent warp softmax's reductions, `topk`'s selection
//! (the k-th largest value's ties resolved by lowest index) and its output order (unsorted: the
//! greater values by index, then the ties; sorted: libtorch's 32-slot bitonic network), and the
//! shuffle tree in which libtorch sums a row of k weights.
use tch::{Kind, Tensor};

use super::{cuda_of, grid, Args, Family};
use crate::error::Result;

const SOURCE: &str = r#"
#define FULL 0xffffffffu
#define WARPS 8
#define MAXE 1024
#define NEG_INF __int_as_float(0xff800000)

// libtorch topk's radix order of an f32 (-0 below +0, NaN above everything); 0 is no value's.
__device__ __forceinline__ u32 key_of(float f) {
    u32 x = __float_as_uint(f);
    if (f != f) return FULL;
    return (x & 0x80000000u) ? ~x : (x | 0x80000000u);
}
__device__ __forceinline__ float float_of(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k ^ 0x80000000u) : ~k);
}

// The k-th largest of key[0..e) counting repeats: k rounds of a warp argmax (largest key, then
// lowest index), each taking one element.
__device__ u32 kth_key(const u32* key, u32* taken, int e, int k, u32 lane) {
    taken[lane] = 0u;
    __syncwarp();
    u32 kth = 0u;
    for (int round = 0; round < k; ++round) {
        u32 best = 0u;
        int at = 0x7fffffff;
        for (int i = lane; i < e; i += 32) {
            u32 kk = key[i];
            if (!((taken[i >> 5] >> (i & 31)) & 1u) && kk > best) { best = kk; at = i; }
        }
        for (int off = 16; off > 0; off >>= 1) {
            u32 ob = __shfl_xor_sync(FULL, best, off);
            int oa = __shfl_xor_sync(FULL, at, off);
            if (ob > best || (ob == best && oa < at)) { best = ob; at = oa; }
        }
        if (lane == 0) taken[at >> 5] |= 1u << (at & 31);
        __syncwarp();
        kth = best;
    }
    return kth;
}

// libtorch's top-k output order without sorting: every key above the k-th by index, then keys
// equal to it by index until k are taken.
__device__ void gather_topk(const u32* key, int e, int k, u32 kth, u32* out_key, int* out_idx,
                            u32 lane) {
    u32 lt = (1u << lane) - 1u;
    int base = 0;
    for (int c = 0; c < e; c += 32) {
        int i = c + lane;
        bool p = i < e && key[i] > kth;
        u32 b = __ballot_sync(FULL, p);
        if (p) { int at = base + __popc(b & lt); out_key[at] = key[i]; out_idx[at] = i; }
        base += __popc(b);
    }
    for (int c = 0; c < e && base < k; c += 32) {
        int i = c + lane;
        bool p = i < e && key[i] == kth;
        u32 b = __ballot_sync(FULL, p);
        int at = base + __popc(b & lt);
        if (p && at < k) { out_key[at] = key[i]; out_idx[at] = i; }
        base += __popc(b);
    }
    __syncwarp();
}

// libtorch's sort of a top-k result (at most 32 values, descending): its in-place bitonic
// network over 32 slots, 16 threads, invalid slots sorting to the end.
__device__ __forceinline__ bool gt(float a, float b) { return (a != a && b == b) || a > b; }
__device__ __forceinline__ void bitonic_swap(float* k, int* v, bool* ok, u32 a, u32 b, bool dir) {
    bool swap = (gt(k[a], k[b]) && ok[a]) || !ok[b];
    if (swap == dir) {
        float tk = k[a]; k[a] = k[b]; k[b] = tk;
        int tv = v[a]; v[a] = v[b]; v[b] = tv;
        bool to = ok[a]; ok[a] = ok[b]; ok[b] = to;
    }
}
__device__ void bitonic32(float* k, int* v, bool* ok, u32 lane) {
    for (u32 size = 2; size < 32; size *= 2) {
        bool flag = (lane & (size / 2)) != 0;
        for (u32 stride = size / 2; stride > 0; stride /= 2) {
            __syncwarp();
            if (lane < 16) { u32 pos = 2 * lane - (lane & (stride - 1)); bitonic_swap(k, v, ok, pos, pos + stride, flag); }
        }
    }
    for (u32 stride = 16; stride > 0; stride /= 2) {
        __syncwarp();
        if (lane < 16) { u32 pos = 2 * lane - (lane & (stride - 1)); bitonic_swap(k, v, ok, pos, pos + stride, false); }
    }
    __syncwarp();
}

// The sum of v over lanes 0..k-1 as libtorch reduces a row of k values: lane j of a block
// last_pow2(k) wide holds (0 + v_j) + (0 + v_{j+width}), then a shuffle-down tree 1, 2, 4...
// Every lane returns lane 0's sum.
__device__ float row_sum(float v, int k, u32 lane) {
    int width = 1;
    while (width * 2 <= k) width *= 2;
    float second = __shfl_down_sync(FULL, v, width);
    float own = lane < (u32)width ? __fadd_rn(0.0f, v) : 0.0f;
    float extra = (lane < (u32)width && lane + width < (u32)k) ? __fadd_rn(0.0f, second) : 0.0f;
    float s = __fadd_rn(__fadd_rn(__fadd_rn(own, extra), 0.0f), 0.0f);
    for (int off = 1; off < width; off <<= 1) s = __fadd_rn(s, __shfl_down_sync(FULL, s, off));
    return __shfl_sync(FULL, s, 0);
}

__device__ __forceinline__ u32 pow2_at_least(u32 e) { u32 p = 1; while (p < e) p *= 2; return p; }

// Qwen3-MoE: logits [n, e] bf16 -> weights [n, k] bf16, ids [n, k] int64. Softmax in f32 as
// libtorch's persistent warp softmax computes it (lane l of a row w = min(pow2(e), 32) wide
// holds elements l, l + w, ...; max and the sum of exp(x - max) per lane in that order, then
// an xor butterfly), the top k sorted, renormalised if `norm`, rounded to bf16.
extern "C" __global__ void softmax_topk(const u16* logits, u16* weights, i64* ids, u64 n, u64 e64,
                                        u64 k64, u64 norm) {
    __shared__ u32 keys[WARPS][MAXE];
    __shared__ u32 taken[WARPS][32];
    __shared__ u32 skey[WARPS][32];
    __shared__ int sidx[WARPS][32];
    __shared__ float sk[WARPS][32];
    __shared__ int si[WARPS][32];
    __shared__ bool sv[WARPS][32];
    int e = (int)e64, k = (int)k64;
    u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    u32 p2 = pow2_at_least((u32)e), w = p2 < 32u ? p2 : 32u, iters = p2 / w;
    u32* key = keys[warp];
    for (u64 tok = (u64)blockIdx.x * WARPS + warp; tok < n; tok += (u64)gridDim.x * WARPS) {
        const u16* row = logits + tok * e64;
        float mx = NEG_INF, sum = 0.0f;
        if (lane < w) {
            mx = lane < (u32)e ? bf(row[lane]) : NEG_INF;
            for (u32 it = 1; it < iters; ++it) {
                u32 i = lane + it * w;
                float v = i < (u32)e ? bf(row[i]) : NEG_INF;
                mx = mx > v ? mx : v;
            }
        }
        for (u32 off = w / 2; off > 0; off >>= 1) {
            float o = __shfl_xor_sync(FULL, mx, off, w);
            mx = mx < o ? o : mx;
        }
        if (lane < w) {
            for (u32 it = 0; it < iters; ++it) {
                u32 i = lane + it * w;
                float v = i < (u32)e ? bf(row[i]) : NEG_INF;
                float x = expf(__fsub_rn(v, mx));
                sum = __fadd_rn(sum, x);
                if (i < (u32)e) key[i] = __float_as_uint(x);
            }
        }
        for (u32 off = w / 2; off > 0; off >>= 1) sum = __fadd_rn(sum, __shfl_xor_sync(FULL, sum, off, w));
        if (lane < w) {
            for (u32 it = 0; it < iters; ++it) {
                u32 i = lane + it * w;
                if (i < (u32)e) key[i] = key_of(__fdiv_rn(__uint_as_float(key[i]), sum));
            }
        }
        __syncwarp();
        u32 kth = kth_key(key, taken[warp], e, k, lane);
        gather_topk(key, e, k, kth, skey[warp], sidx[warp], lane);
        bool ok = lane < (u32)k;
        sk[warp][lane] = ok ? float_of(skey[warp][lane]) : 0.0f;
        si[warp][lane] = ok ? sidx[warp][lane] : 0;
        sv[warp][lane] = ok;
        bitonic32(sk[warp], si[warp], sv[warp], lane);
        float top = sk[warp][lane];
        float total = row_sum(ok ? top : 0.0f, k, lane);
        if (ok) {
            float wgt = norm ? __fdiv_rn(top, total) : top;
            weights[tok * k64 + lane] = rn(wgt);
            ids[tok * k64 + lane] = (i64)si[warp][lane];
        }
        __syncwarp();
    }
}

// DeepSeek-V3: logits [n, e] f32, correction [e] f32 -> weights [n, k] f32, ids [n, k] int64,
// as transformers' DeepseekV3TopkRouter: sigmoid scores; choice = score + correction; a
// group's score is the sum of its two best choices; the best `topk_group` groups stay, the
// rest are -inf; the top k of the choices in libtorch's unsorted order; weights the scores,
// renormalised (+1e-20) if `norm`, times `scale`.
extern "C" __global__ void grouped_topk(const float* logits, const float* corr, float* weights,
                                        i64* ids, u64 n, u64 e64, u64 k64, u64 groups,
                                        u64 topk_group, u64 norm, float scale) {
    __shared__ u32 keys[WARPS][MAXE];
    __shared__ u32 taken[WARPS][32];
    __shared__ u32 skey[WARPS][32];
    __shared__ int sidx[WARPS][32];
    __shared__ u32 gkey[WARPS][32];
    int e = (int)e64, k = (int)k64, g = (int)groups, per = e / g;
    u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    u32* key = keys[warp];
    for (u64 tok = (u64)blockIdx.x * WARPS + warp; tok < n; tok += (u64)gridDim.x * WARPS) {
        const float* row = logits + tok * e64;
        for (int i = lane; i < e; i += 32) {
            float s = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-row[i])));
            key[i] = key_of(__fadd_rn(s, corr[i]));
        }
        __syncwarp();
        if (lane < (u32)g) {
            u32 b0 = 0u, b1 = 0u;
            for (int i = lane * per; i < (int)(lane + 1) * per; ++i) {
                u32 kk = key[i];
                if (kk > b0) { b1 = b0; b0 = kk; } else if (kk > b1) { b1 = kk; }
            }
            float gs = __fadd_rn(__fadd_rn(0.0f, float_of(b0)), __fadd_rn(0.0f, float_of(b1)));
            gkey[warp][lane] = key_of(gs);
        }
        __syncwarp();
        u32 gkth = kth_key(gkey[warp], taken[warp], g, (int)topk_group, lane);
        // The chosen groups: above the k-th, then its ties by index.
        u32 above = __ballot_sync(FULL, lane < (u32)g && gkey[warp][lane] > gkth);
        u32 ties = __ballot_sync(FULL, lane < (u32)g && gkey[warp][lane] == gkth);
        int need = (int)topk_group - __popc(above);
        while (__popc(ties) > need) ties &= ~(1u << (31 - __clz(ties)));
        u32 chosen = above | ties;
        for (int i = lane; i < e; i += 32) {
            if (!((chosen >> (i / per)) & 1u)) key[i] = key_of(NEG_INF);
        }
        __syncwarp();
        u32 kth = kth_key(key, taken[warp], e, k, lane);
        gather_topk(key, e, k, kth, skey[warp], sidx[warp], lane);
        bool ok = lane < (u32)k;
        float s = 0.0f;
        if (ok) s = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-row[sidx[warp][lane]])));
        if (norm) s = __fdiv_rn(s, __fadd_rn(row_sum(ok ? s : 0.0f, k, lane), 1e-20f));
        if (ok) {
            weights[tok * k64 + lane] = __fmul_rn(s, scale);
            ids[tok * k64 + lane] = (i64)sidx[warp][lane];
        }
        __syncwarp();
    }
}
"#;

pub(super) static KERNELS: Family = Family::new(
    "MoE routing",
    SOURCE,
    c"hslake_moe_route.cu",
    &[c"softmax_topk", c"grouped_topk"],
);

/// Tokens (one warp each) per router block.
const ROUTER_THREADS: u32 = 256;
/// The widest router rows (the kernels' MAXE).
const MAX_EXPERTS: i64 = 1024;
/// The most experts per token (one warp's lanes).
const MAX_TOP_K: i64 = 32;

fn token_blocks(device: usize, n: i64) -> u64 {
    grid(device, n as u64 * 32, ROUTER_THREADS)
}

/// Qwen3-MoE's routing of bf16 `logits [n, E]`: (bf16 weights, int64 ids), each `[n, k]`.
pub(crate) fn softmax_topk(
    logits: &Tensor,
    k: i64,
    norm: bool,
) -> Result<Option<(Tensor, Tensor)>> {
    let Some(device) = cuda_of(logits, Kind::BFloat16) else {
        return Ok(None);
    };
    let [n, e] = logits.size()[..] else {
        return Ok(None);
    };
    if !logits.is_contiguous() || e > MAX_EXPERTS || !(1..=MAX_TOP_K.min(e)).contains(&k) {
        return Ok(None);
    }
    let Some(kernel) = KERNELS.kernel(device, 0) else {
        return Ok(None);
    };
    let weights = Tensor::f_empty([n, k], (Kind::BFloat16, logits.device()))?;
    let ids = Tensor::f_empty([n, k], (Kind::Int64, logits.device()))?;
    // SAFETY: (logits, weights, ids, n, e, k, norm) as the kernel takes them, contiguous on
    // `device`, held until the launch is queued.
    unsafe {
        Args::default()
            .ptr(logits)
            .ptr(&weights)
            .ptr(&ids)
            .int(n)
            .int(e)
            .int(k)
            .int(i64::from(norm))
            .launch(kernel, device, token_blocks(device, n), ROUTER_THREADS)?
    };
    Ok(Some((weights, ids)))
}

/// DeepSeek-V3's routing settings, as the kernel takes them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Grouped {
    /// Experts per token.
    pub top_k: i64,
    /// Expert groups.
    pub n_group: i64,
    /// Groups a token draws from.
    pub topk_group: i64,
    /// Renormalise the chosen scores.
    pub norm: bool,
    /// Multiplies the weights.
    pub scale: f64,
}

/// DeepSeek-V3's routing of f32 `logits [n, E]` with the f32 `correction [E]`: (f32 weights,
/// int64 ids), each `[n, top_k]`.
pub(crate) fn grouped_topk(
    logits: &Tensor,
    correction: &Tensor,
    p: Grouped,
) -> Result<Option<(Tensor, Tensor)>> {
    let Some(device) = cuda_of(logits, Kind::Float) else {
        return Ok(None);
    };
    let [n, e] = logits.size()[..] else {
        return Ok(None);
    };
    let fits = logits.is_contiguous()
        && cuda_of(correction, Kind::Float) == Some(device)
        && correction.is_contiguous()
        && correction.numel() as i64 == e
        && e <= MAX_EXPERTS
        && (1..=MAX_TOP_K).contains(&p.top_k)
        && (1..=32).contains(&p.n_group)
        && e % p.n_group == 0
        && e / p.n_group >= 2
        && (1..=p.n_group).contains(&p.topk_group)
        && p.top_k <= p.topk_group * (e / p.n_group);
    if !fits {
        return Ok(None);
    }
    let Some(kernel) = KERNELS.kernel(device, 1) else {
        return Ok(None);
    };
    let weights = Tensor::f_empty([n, p.top_k], (Kind::Float, logits.device()))?;
    let ids = Tensor::f_empty([n, p.top_k], (Kind::Int64, logits.device()))?;
    // SAFETY: the slots follow (logits, corr, weights, ids, n, e, k, groups, topk_group, norm,
    // scale); every tensor contiguous f32 or int64 on `device`, held until the launch is queued.
    unsafe {
        Args::default()
            .ptr(logits)
            .ptr(correction)
            .ptr(&weights)
            .ptr(&ids)
            .int(n)
            .int(e)
            .int(p.top_k)
            .int(p.n_group)
            .int(p.topk_group)
            .int(i64::from(p.norm))
            .f32(p.scale as f32)
            .launch(kernel, device, token_blocks(device, n), ROUTER_THREADS)?
    };
    Ok(Some((weights, ids)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    /// The kernel's `bitonic32`, step for step: 16 threads, each compare-exchange at the
    /// positions the kernel computes, invalid slots sorting to the end.
    fn bitonic32(k: &mut [f32; 32], v: &mut [i32; 32], ok: &mut [bool; 32]) {
        let gt = |a: f32, b: f32| (a.is_nan() && !b.is_nan()) || a > b;
        let mut swap = |a: usize, b: usize, dir: bool| {
            let s = (gt(k[a], k[b]) && ok[a]) || !ok[b];
            if s == dir {
                k.swap(a, b);
                v.swap(a, b);
                ok.swap(a, b);
            }
        };
        let mut size = 2;
        while size < 32 {
            let mut stride = size / 2;
            while stride > 0 {
                for lane in 0..16usize {
                    let flag = lane & (size / 2) != 0;
                    let pos = 2 * lane - (lane & (stride - 1));
                    swap(pos, pos + stride, flag);
                }
                stride /= 2;
            }
            size *= 2;
        }
        let mut stride = 16;
        while stride > 0 {
            for lane in 0..16usize {
                let pos = 2 * lane - (lane & (stride - 1));
                swap(pos, pos + stride, false);
            }
            stride /= 2;
        }
    }

    #[test]
    fn the_sorting_network_puts_the_top_k_in_descending_order_before_the_empty_slots() {
        for k in [1usize, 2, 6, 8, 13, 32] {
            for seed in 0..20u32 {
                let mut keys = [0f32; 32];
                let mut ids = [0i32; 32];
                let mut ok = [false; 32];
                for j in 0..k {
                    // Distinct values in a scrambled order, as the unsorted gather gives them.
                    let scrambled = (j as u32)
                        .wrapping_mul(2654435761)
                        .wrapping_add(seed * 40503);
                    keys[j] = (scrambled % 1000) as f32 + j as f32 / 64.0;
                    ids[j] = j as i32;
                    ok[j] = true;
                }
                let mut want: Vec<(f32, i32)> = (0..k).map(|j| (keys[j], ids[j])).collect();
                want.sort_by(|a, b| b.0.total_cmp(&a.0));
                bitonic32(&mut keys, &mut ids, &mut ok);
                let got: Vec<(f32, i32)> = (0..k).map(|j| (keys[j], ids[j])).collect();
                assert_eq!(got, want, "k {k}, seed {seed}");
                assert!(ok[..k].iter().all(|&o| o) && !ok[k..].iter().any(|&o| o));
            }
        }
    }

    #[test]
    fn cpu_tensors_are_left_to_libtorch() {
        let logits = Tensor::zeros([4, 8], (Kind::BFloat16, Device::Cpu));
        assert!(softmax_topk(&logits, 2, true).unwrap().is_none());
        let p = Grouped {
            top_k: 2,
            n_group: 2,
            topk_group: 1,
            norm: true,
            scale: 1.0,
        };
        let logits = Tensor::zeros([4, 8], (Kind::Float, Device::Cpu));
        let corr = Tensor::zeros([8], (Kind::Float, Device::Cpu));
        assert!(grouped_topk(&logits, &corr, p).unwrap().is_none());
    }
}
