//! Captured bf16 states split into the store's planes (docs/FORMAT.md) by rank 0 before they
//! are copied to the host, with each token row's statistics, in one pass over the states.
//!
//! Why: on a GPU run the store writers are the bound. Splitting on the host read and wrote
//! every captured byte once more before zstd saw it, and the statistics read them again; on the
//! GPU the same work is one kernel at memory speed (a fraction of a percent of a prefill), and
//! the writers only compress ([`hslake_store::encode_split_sample`]). The bytes copied to the
//! host are as many as before plus 32 per token.
//!
//! Layout of one split batch of `rows` samples padded to `cols` tokens of `hidden` values, in
//! one byte tensor: slot `i` (`2 · cols · hidden` bytes from `i · 2 · cols · hidden`) begins
//! with the planes of its sample's `len · hidden` values, exactly as the store's `to_planes`
//! writes them (top bytes, high nibbles, low nibbles); the rest of the slot is unused. Then,
//! from [`SplitLayout::stats_offset`], four f64 per token row: the sum of squares and the
//! largest absolute value of its finite values, and its NaN and ±Inf counts.
use std::ffi::{c_void, CString};
use std::ops::Range;
use std::sync::OnceLock;

use hslake_schemas::{RowSums, TensorStats};
use tch::{Device, Kind, Tensor};

use crate::error::{CaptureError, Result};
use crate::gpu::cuda::Kernel;
use crate::gpu::nvrtc;

/// Bytes of statistics per token row: four f64.
pub(crate) const ROW_STATS: usize = 32;

/// Where a split batch keeps each sample's planes and each token row's statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SplitLayout {
    /// Samples (slots).
    pub rows: usize,
    /// Tokens per slot (the longest sample's length).
    pub cols: usize,
    /// Values per token.
    pub hidden: usize,
}

impl SplitLayout {
    /// Bytes of one slot's planes.
    fn slot(&self) -> usize {
        2 * self.cols * self.hidden
    }

    /// Where the row statistics begin (8-byte aligned, as f64 loads want).
    pub fn stats_offset(&self) -> usize {
        (self.rows * self.slot()).next_multiple_of(16)
    }

    /// Bytes of the whole split batch.
    pub fn bytes(&self) -> usize {
        self.stats_offset() + self.rows * self.cols * ROW_STATS
    }

    /// Bytes a split batch of at most `tokens` padded tokens of `hidden` values takes.
    pub fn bytes_for(tokens: usize, hidden: usize) -> usize {
        SplitLayout {
            rows: 1,
            cols: tokens,
            hidden,
        }
        .bytes()
    }

    /// The planes of slot `i`'s sample of `len` tokens.
    pub fn planes(&self, i: usize, len: usize) -> Range<usize> {
        let start = i * self.slot();
        start..start + 2 * len * self.hidden
    }

    /// The statistics of slot `i`'s first `len` token rows.
    pub fn stats(&self, i: usize, len: usize) -> Range<usize> {
        let start = self.stats_offset() + i * self.cols * ROW_STATS;
        start..start + len * ROW_STATS
    }
}

/// Field `k` of a token row's statistics (`ROW_STATS` bytes: sum of squares, largest absolute
/// value, NaN count, ±Inf count).
pub(crate) fn row_field(row: &[u8], k: usize) -> f64 {
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&row[8 * k..8 * k + 8]);
    f64::from_le_bytes(bytes)
}

/// A sample's tensor statistics from its token rows' (`ROW_STATS` bytes each, as the split
/// writes them), combined as the store combines the rows it reduces itself. The store sums
/// squares in f32 lanes where these are f64: mean norms agree to f32 rounding.
pub(crate) fn sample_stats(rows: &[u8]) -> TensorStats {
    let mut sums = RowSums::default();
    for row in rows.chunks_exact(ROW_STATS) {
        let f = |k| row_field(row, k);
        sums.add(f(0), f(1) as f32, f(2) as u64, f(3) as u64);
    }
    sums.finish()
}

/// Splits `states` (`[rows, cols, hidden]` bf16, `hidden` even) whose slot `i` holds a sample
/// of `lens[i]` tokens, into a byte tensor on the same device laid out as [`SplitLayout`]
/// says. On a GPU one kernel does it; on the CPU (tests, and the reference the kernel is
/// checked against) the store's own split and a loop.
pub(crate) fn split(states: &Tensor, lens: &[usize]) -> Result<Tensor> {
    let layout = check_shape(states, lens)?;
    match states.device() {
        Device::Cuda(d) => split_on_gpu(states, lens, layout, d),
        _ => split_on_cpu(states, lens, layout),
    }
}

fn check_shape(states: &Tensor, lens: &[usize]) -> Result<SplitLayout> {
    let size = states.size();
    let bad = |why: &str| {
        Err(CaptureError::Pipeline(format!(
            "cannot split states of shape {size:?} ({:?}) for samples of {lens:?} tokens: {why}",
            states.kind()
        )))
    };
    let [rows, cols, hidden] = size[..] else {
        return bad("expected [samples, tokens, hidden]");
    };
    let layout = SplitLayout {
        rows: rows as usize,
        cols: cols as usize,
        hidden: hidden as usize,
    };
    if states.kind() != Kind::BFloat16 {
        return bad("only bf16 states are split before the copy");
    }
    if !layout.hidden.is_multiple_of(2) {
        return bad("hidden size must be even");
    }
    if lens.len() != layout.rows || lens.iter().any(|&l| l > layout.cols) {
        return bad("one length per sample, none longer than the batch");
    }
    Ok(layout)
}

fn split_on_cpu(states: &Tensor, lens: &[usize], layout: SplitLayout) -> Result<Tensor> {
    let states = states.f_contiguous()?;
    let mut bytes = vec![0u8; states.numel() * 2];
    states.f_copy_data_u8(&mut bytes, states.numel())?;
    let mut out = vec![0u8; layout.bytes()];
    let mut planes = Vec::new();
    let row = 2 * layout.hidden;
    for (i, &len) in lens.iter().enumerate() {
        let slot = &bytes[i * layout.slot()..][..len * row];
        hslake_store::format::planes::to_planes(slot, 2, &mut planes);
        out[layout.planes(i, len)].copy_from_slice(&planes);
        for (r, values) in slot.chunks_exact(row).enumerate() {
            let st = row_stats(values);
            let at = layout.stats(i, len).start + r * ROW_STATS;
            for (k, v) in st.iter().enumerate() {
                out[at + 8 * k..at + 8 * k + 8].copy_from_slice(&v.to_le_bytes());
            }
        }
    }
    Ok(Tensor::f_from_slice(&out)?)
}

/// One row's sum of squares and largest absolute value of its finite values, its NaN and ±Inf
/// counts: what the kernel computes per row, here from the widened values.
fn row_stats(values: &[u8]) -> [f64; 4] {
    let mut s = [0f64; 4];
    for c in values.as_chunks::<2>().0 {
        let v = hslake_schemas::bf16_bits_to_f32(u16::from_le_bytes(*c));
        if v.is_nan() {
            s[2] += 1.0;
        } else if v.is_infinite() {
            s[3] += 1.0;
        } else {
            let v = f64::from(v.abs());
            s[0] += v * v;
            s[1] = s[1].max(v);
        }
    }
    s
}

/// The kernel: one block of [`THREADS`] per token row; rows past their sample's length are
/// padding and left alone. Each thread takes two values (one 4-byte load) at a time, writes
/// their top bytes as one 2-byte store and one byte to each nibble plane, and keeps the row's
/// statistics, reduced across the block at the end. No headers (NVRTC has none without a CUDA
/// toolkit).
const SOURCE: &str = r#"
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned long long u64;

struct Stats { double sq; double mx; double nan; double inf; };

__device__ __forceinline__ void add(Stats& s, u32 x) {
    u32 m = x & 0x7fffu;
    if (m > 0x7f80u) s.nan += 1.0;
    else if (m == 0x7f80u) s.inf += 1.0;
    else {
        double v = (double)__uint_as_float(m << 16);
        s.sq += v * v;
        s.mx = fmax(s.mx, v);
    }
}

__device__ __forceinline__ void merge(Stats& s, const Stats& o) {
    s.sq += o.sq; s.mx = fmax(s.mx, o.mx); s.nan += o.nan; s.inf += o.inf;
}

__device__ __forceinline__ Stats shfl_down(const Stats& s, int k) {
    Stats o;
    o.sq = __shfl_down_sync(0xffffffffu, s.sq, k);
    o.mx = __shfl_down_sync(0xffffffffu, s.mx, k);
    o.nan = __shfl_down_sync(0xffffffffu, s.nan, k);
    o.inf = __shfl_down_sync(0xffffffffu, s.inf, k);
    return o;
}

// states [rows, cols, hidden] bf16 as u32 pairs; lens[rows]; out as SplitLayout says.
extern "C" __global__ void split_bf16(const u32* states, const int* lens, u8* out,
                                      u64 cols, u64 hidden, u64 stats_offset) {
    u64 row = blockIdx.x, i = row / cols, r = row - i * cols, len = (u64)lens[i];
    if (r >= len) return;
    u64 pairs = hidden / 2;
    const u32* in = states + row * pairs;
    u8* slot = out + i * 2 * cols * hidden;
    u16* top = (u16*)(slot + r * hidden);
    u8* hi = slot + len * hidden + r * pairs;
    u8* lo = slot + len * hidden + len * pairs + r * pairs;
    Stats s = {0.0, 0.0, 0.0, 0.0};
    for (u64 j = threadIdx.x; j < pairs; j += blockDim.x) {
        u32 v = in[j], a = v & 0xffffu, b = v >> 16;
        u32 ra = ((a << 1) | (a >> 15)) & 0xffffu, rb = ((b << 1) | (b >> 15)) & 0xffffu;
        top[j] = (u16)((ra >> 8) | (rb & 0xff00u));
        hi[j] = (u8)(((ra & 0xffu) >> 4) | (rb & 0xf0u));
        lo[j] = (u8)((ra & 0x0fu) | ((rb & 0x0fu) << 4));
        add(s, a);
        add(s, b);
    }
    for (int k = 16; k > 0; k >>= 1) merge(s, shfl_down(s, k));
    __shared__ Stats warps[32];
    u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    if (lane == 0) warps[warp] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (u32 w = 1; w < (blockDim.x + 31u) / 32u; ++w) merge(s, warps[w]);
        double* o = (double*)(out + stats_offset) + 4 * row;
        o[0] = s.sq; o[1] = s.mx; o[2] = s.nan; o[3] = s.inf;
    }
}
"#;

const THREADS: u32 = 256;

/// The kernel compiled to PTX for compute capability `major.minor` (no GPU needed).
fn compile_ptx(cc: (i32, i32)) -> Result<CString> {
    nvrtc::compile_ptx(SOURCE, c"hslake_plane_split.cu", cc)
}

/// The kernel, compiled and loaded once per process; the error when it cannot be (the engine
/// then leaves the split to the writers).
pub(crate) fn kernel(device: usize) -> std::result::Result<&'static Kernel, String> {
    static KERNEL: OnceLock<std::result::Result<Kernel, String>> = OnceLock::new();
    KERNEL
        .get_or_init(|| {
            nvrtc::load_library(device, compile_ptx)
                .and_then(|library| library.kernel(c"split_bf16"))
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(Clone::clone)
}

fn split_on_gpu(states: &Tensor, lens: &[usize], layout: SplitLayout, d: usize) -> Result<Tensor> {
    let kernel = kernel(d).map_err(|e| CaptureError::Cuda(format!("plane split kernel: {e}")))?;
    let states = states.f_contiguous()?;
    let device = Device::Cuda(d);
    let lens: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
    let lens = Tensor::f_from_slice(&lens)?.f_to_device(device)?;
    let out = Tensor::f_empty([layout.bytes() as i64], (Kind::Uint8, device))?;
    let blocks = (layout.rows * layout.cols) as u32;
    if blocks == 0 {
        return Ok(out);
    }
    let mut pointers = [states.data_ptr(), lens.data_ptr(), out.data_ptr()];
    let mut sizes = [
        layout.cols as u64,
        layout.hidden as u64,
        layout.stats_offset() as u64,
    ];
    let mut args: Vec<*mut c_void> = pointers
        .iter_mut()
        .map(|p| (p as *mut *mut c_void).cast())
        .collect();
    args.extend(sizes.iter_mut().map(|s| (s as *mut u64).cast()));
    // SAFETY: the arguments match the kernel's (three pointers, three u64); `states` is
    // contiguous [rows, cols, hidden] bf16, `lens` rows i32 of at most `cols`, `out` the layout's
    // bytes, all on `d`. They are dropped only after the launch is queued on libtorch's stream,
    // which is the stream the caching allocator hands their memory out on again.
    unsafe { kernel.launch(d, blocks, THREADS, &mut args)? };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hslake_schemas::{f32_to_bf16_bits, tensor_stats, DType, TensorData};

    fn bf16_batch(values: &[f32], shape: [i64; 3]) -> Tensor {
        let bits: Vec<i16> = values.iter().map(|&v| f32_to_bf16_bits(v) as i16).collect();
        Tensor::from_slice(&bits)
            .view_dtype(Kind::BFloat16)
            .view(shape)
    }

    #[test]
    fn split_slots_hold_the_stores_planes_and_row_statistics_of_each_sample() {
        let (rows, cols, hidden) = (3usize, 5usize, 6usize);
        let mut values: Vec<f32> = (0..rows * cols * hidden)
            .map(|k| ((k * 37 % 101) as f32 - 50.0) * 0.37)
            .collect();
        // Non-finite values in the second sample, and one in padding that must not count.
        values[cols * hidden + 2] = f32::NAN;
        values[cols * hidden + hidden + 1] = f32::INFINITY;
        values[cols * hidden + hidden + 3] = -1e30;
        values[4 * hidden] = f32::NAN;
        let states = bf16_batch(&values, [rows as i64, cols as i64, hidden as i64]);
        let lens = [3usize, 5, 0];
        let out = split(&states, &lens).unwrap();
        let layout = SplitLayout { rows, cols, hidden };
        let mut bytes = vec![0u8; layout.bytes()];
        out.copy_data_u8(&mut bytes, layout.bytes());
        for (i, &len) in lens.iter().enumerate() {
            let raw: Vec<u8> = values[i * cols * hidden..][..len * hidden]
                .iter()
                .flat_map(|&v| f32_to_bf16_bits(v).to_le_bytes())
                .collect();
            let mut planes = vec![];
            hslake_store::format::planes::to_planes(&raw, 2, &mut planes);
            assert_eq!(&bytes[layout.planes(i, len)], &planes[..], "sample {i}");
            let got = sample_stats(&bytes[layout.stats(i, len)]);
            let want = tensor_stats(&TensorData {
                dtype: DType::Bf16,
                shape: vec![len, hidden],
                data: raw,
                scales: None,
            });
            assert_eq!(
                (got.max_abs, got.nan_count, got.inf_count),
                (want.max_abs, want.nan_count, want.inf_count),
                "sample {i}"
            );
            let tol = want.mean_norm.abs() * 1e-6;
            assert!(
                (got.mean_norm - want.mean_norm).abs() <= tol,
                "sample {i}: {} against {}",
                got.mean_norm,
                want.mean_norm
            );
        }
        assert_eq!(sample_stats(&bytes[layout.stats(1, 5)]).nan_count, 1);
        assert_eq!(sample_stats(&bytes[layout.stats(1, 5)]).inf_count, 1);
    }

    #[test]
    fn refuses_states_it_cannot_split_and_names_why() {
        let odd = Tensor::zeros([1, 2, 3], (Kind::BFloat16, Device::Cpu));
        let err = split(&odd, &[2]).unwrap_err().to_string();
        assert!(err.contains("hidden size must be even"), "{err}");
        let f32s = Tensor::zeros([1, 2, 4], (Kind::Float, Device::Cpu));
        let err = split(&f32s, &[2]).unwrap_err().to_string();
        assert!(err.contains("only bf16"), "{err}");
        let even = Tensor::zeros([1, 2, 4], (Kind::BFloat16, Device::Cpu));
        let err = split(&even, &[3]).unwrap_err().to_string();
        assert!(err.contains("none longer than the batch"), "{err}");
    }

    #[test]
    fn the_kernel_compiles_to_ptx_for_hopper_and_ampere() {
        for cc in [(9, 0), (8, 0)] {
            let ptx = compile_ptx(cc).unwrap();
            let text = ptx.to_str().unwrap();
            assert!(text.contains(".entry split_bf16("), "for {cc:?}");
        }
    }
}
