//! FP8-block and INT4-group weights dequantized on the GPU in one kernel each, compiled at
//! first use by NVRTC (the runtime compiler the torch wheel ships) and launched on libtorch's
//! stream.
//!
//! Why a kernel of our own: the exact PyTorch formulation in `dequant.rs` takes two or three
//! passes over memory with slow mixed-dtype kernels (0.97 ms for 117 M FP8 values on an H200,
//! where reading 1 byte and writing 2 per value at its bandwidth takes under 0.1 ms). A MoE
//! layer dequantizes billions of values per batch, so that pass decided FP8 and INT4
//! throughput. Each value is computed as the PyTorch path computes it (the code's exact value
//! times its f32 scale, one f32 multiply, rounded to nearest-even into the compute dtype), so
//! the two agree bit for bit; `hslake debug dequant` checks that on a GPU.
use std::ffi::{c_void, CString};
use std::sync::OnceLock;

use tch::{Device, Kind, Tensor};

use crate::error::{CaptureError, Result};
use crate::gpu::cuda::{self, Kernel};
use crate::gpu::nvrtc;

/// The kernels. No headers (NVRTC finds none without a CUDA toolkit): the e4m3 decoding is
/// written out from the format's definition; the rounding is PTX's `cvt.rn` (compute capability
/// 8.0 or later for bf16; older GPUs fail to compile and keep the PyTorch path). Each thread turns 16
/// consecutive values of a row into the output dtype with one 16-byte (FP8) or 8-byte (INT4)
/// load and 32 or 64 bytes of stores; rows are `cols` long, a multiple of 16, and every 16
/// values share one scale (the callers check both).
const SOURCE: &str = r#"
typedef unsigned int u32;
typedef unsigned long long u64;
struct alignas(16) U4 { u32 v[4]; };
struct alignas(8) U2 { u32 v[2]; };
struct alignas(16) F4 { float v[4]; };

// float8_e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, S.1111.111 NaN.
// The 7 magnitude bits placed at the top of an f32's exponent and mantissa read as the value
// times 2^-120 exactly (exponent-0 codes land on f32 subnormals with the same scaling; NVRTC
// keeps subnormals by default), so one multiply by 2^120 decodes every finite code.
__device__ __forceinline__ float e4m3(u32 c) {
    u32 mag = c & 0x7fu;
    float v = mag == 0x7fu ? __int_as_float(0x7fc00000) : __uint_as_float(mag << 20) * 0x1p120f;
    return __uint_as_float(__float_as_uint(v) | ((c & 0x80u) << 24));
}

// Codes 0..15 stand for code - 8: placed in the mantissa of 2^23 and the offset subtracted,
// exactly, without an int-to-float conversion.
__device__ __forceinline__ float int4(u32 code) {
    return __uint_as_float(0x4b000000u | code) - 8388616.0f;
}

// Two values rounded to nearest-even and packed, the first in the low half (lower address).
__device__ __forceinline__ u32 bf16x2(float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

__device__ __forceinline__ u32 f16x2(float lo, float hi) {
    u32 d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// Stores values 16 i .. 16 i + 15 of the output: K 0 bf16, 1 f16, 2 f32.
template <int K> __device__ __forceinline__ void store16(void* out, u64 i, const float* v) {
    if (K == 2) {
        F4* o = (F4*)out + 4 * i;
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            F4 f;
            #pragma unroll
            for (int k = 0; k < 4; ++k) f.v[k] = v[4 * j + k];
            o[j] = f;
        }
    } else {
        U4* o = (U4*)out + 2 * i;
        #pragma unroll
        for (int j = 0; j < 2; ++j) {
            U4 p;
            #pragma unroll
            for (int k = 0; k < 4; ++k) {
                float a = v[8 * j + 2 * k], b = v[8 * j + 2 * k + 1];
                p.v[k] = K == 0 ? bf16x2(a, b) : f16x2(a, b);
            }
            o[j] = p;
        }
    }
}

// weight [rows, cols] e4m3 bytes, scale [ceil(rows / bo), scols] f32. I, the index type, is
// 32-bit where the matrix allows: 64-bit division is many times slower on a GPU.
template <int K, typename I> __device__ void fp8_block(const U4* w, const float* s, void* out,
                                                       I rows, I cols, I bo, I bi, I scols) {
    I per_row = cols >> 4, n = rows * per_row;
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (I)gridDim.x * blockDim.x) {
        I r = i / per_row, c = (i - r * per_row) << 4;
        float sc = s[(r / bo) * scols + c / bi];
        U4 q = w[i];
        float v[16];
        #pragma unroll
        for (int k = 0; k < 16; ++k) v[k] = e4m3((q.v[k >> 2] >> ((k & 3) * 8)) & 0xffu) * sc;
        store16<K>(out, i, v);
    }
}

// packed [rows, cols / 8] int32, code k of a word in bits 4k..4k+3 offset by 8;
// scale [rows, cols / group] f32.
template <int K, typename I> __device__ void int4_group(const U2* p, const float* s, void* out,
                                                        I rows, I cols, I group) {
    I per_row = cols >> 4, n = rows * per_row, groups = cols / group;
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (I)gridDim.x * blockDim.x) {
        I r = i / per_row, c = (i - r * per_row) << 4;
        float sc = s[r * groups + c / group];
        U2 q = p[i];
        float v[16];
        #pragma unroll
        for (int k = 0; k < 16; ++k) v[k] = int4((q.v[k >> 3] >> ((k & 7) * 4)) & 15u) * sc;
        store16<K>(out, i, v);
    }
}

// 32-bit indices while every unit index, plus a grid's stride past the last, fits.
#define NARROW(rows, cols) ((rows) * ((cols) >> 4) < 0x80000000ull)
#define FP8(NAME, K) extern "C" __global__ void NAME(const U4* w, const float* s, void* out, \
    u64 rows, u64 cols, u64 bo, u64 bi, u64 scols) { \
    if (NARROW(rows, cols)) fp8_block<K, u32>(w, s, out, rows, cols, bo, bi, scols); \
    else fp8_block<K, u64>(w, s, out, rows, cols, bo, bi, scols); }
#define INT4(NAME, K) extern "C" __global__ void NAME(const U2* p, const float* s, void* out, \
    u64 rows, u64 cols, u64 group) { \
    if (NARROW(rows, cols)) int4_group<K, u32>(p, s, out, rows, cols, group); \
    else int4_group<K, u64>(p, s, out, rows, cols, group); }
FP8(fp8_bf16, 0) FP8(fp8_f16, 1) FP8(fp8_f32, 2)
INT4(int4_bf16, 0) INT4(int4_f16, 1) INT4(int4_f32, 2)
"#;

/// The output dtypes the kernels write, in the order of their `_bf16`/`_f16`/`_f32` names.
const OUTPUTS: [(Kind, &str); 3] = [
    (Kind::BFloat16, "bf16"),
    (Kind::Half, "f16"),
    (Kind::Float, "f32"),
];

const THREADS: u32 = 256;

/// The kernels compiled to PTX for compute capability `major.minor` (no GPU needed).
pub(crate) fn compile_ptx(cc: (i32, i32)) -> Result<CString> {
    nvrtc::compile_ptx(SOURCE, c"hslake_dequant.cu", cc)
}

struct Kernels {
    fp8: Vec<Kernel>,
    int4: Vec<Kernel>,
    /// Blocks per launch: enough to fill every SM several times; the kernels loop over the rest.
    max_blocks: u32,
}

/// The kernels, compiled and loaded once per process (for the compute capability of the first
/// GPU that asks; the PTX is JIT-compiled for each GPU when it first runs it). Compilation
/// failing (an NVRTC too old for the GPU, say) is logged once and the PyTorch path is used.
fn kernels(device: usize) -> Option<&'static Kernels> {
    static KERNELS: OnceLock<Option<Kernels>> = OnceLock::new();
    KERNELS
        .get_or_init(|| match load(device) {
            Ok(k) => Some(k),
            Err(e) => {
                tracing::warn!(
                    "fused dequantization kernels unavailable, quantized weights are \
                     dequantized by PyTorch operations instead (exact, slower): {e}"
                );
                None
            }
        })
        .as_ref()
}

fn load(device: usize) -> Result<Kernels> {
    let library = nvrtc::load_library(device, compile_ptx)?;
    let named = |family: &str| -> Result<Vec<Kernel>> {
        OUTPUTS
            .iter()
            .map(|(_, out)| {
                let name = CString::new(format!("{family}_{out}"))
                    .map_err(|_| CaptureError::Cuda("a kernel name holds a NUL".into()))?;
                library.kernel(&name)
            })
            .collect()
    };
    Ok(Kernels {
        fp8: named("fp8")?,
        int4: named("int4")?,
        max_blocks: cuda::multiprocessors(device)? * 16,
    })
}

/// The GPU all of `tensors` are on, if they are all on one, contiguous and 16-byte aligned.
fn one_gpu(tensors: &[&Tensor]) -> Option<usize> {
    let Device::Cuda(d) = tensors[0].device() else {
        return None;
    };
    tensors
        .iter()
        .all(|t| {
            t.device() == Device::Cuda(d)
                && t.is_contiguous()
                && (t.data_ptr() as usize).is_multiple_of(16)
        })
        .then_some(d)
}

fn output_index(kind: Kind) -> Option<usize> {
    OUTPUTS.iter().position(|(k, _)| *k == kind)
}

/// Runs `family`'s kernel for `product`'s dtype over `[input, scale, product]`, passing
/// `sizes` after the three pointers; `false`, nothing launched, where it does not apply: `fits`
/// false (the caller's shape conditions), an output dtype it does not write, a scale that is not
/// f32, tensors not all on one GPU, contiguous and 16-byte aligned, or kernels that did not
/// compile.
fn run(
    family: fn(&Kernels) -> &[Kernel],
    [input, scale, product]: [&Tensor; 3],
    fits: bool,
    sizes: &[i64],
) -> Result<bool> {
    let Some(out) = output_index(product.kind()) else {
        return Ok(false);
    };
    if !fits || scale.kind() != Kind::Float {
        return Ok(false);
    }
    let Some(device) = one_gpu(&[input, scale, product]) else {
        return Ok(false);
    };
    let Some(kernels) = kernels(device) else {
        return Ok(false);
    };
    let units = product.numel() as u64 / 16;
    let blocks = units
        .div_ceil(THREADS as u64)
        .clamp(1, kernels.max_blocks as u64) as u32;
    let mut pointers = [input.data_ptr(), scale.data_ptr(), product.data_ptr()];
    let mut sizes: Vec<u64> = sizes.iter().map(|&s| s as u64).collect();
    let mut args: Vec<*mut c_void> = pointers
        .iter_mut()
        .map(|p| (p as *mut *mut c_void).cast())
        .collect();
    args.extend(sizes.iter_mut().map(|s| (s as *mut u64).cast()));
    // SAFETY: the arguments match the kernels' parameters (three pointers, then the u64 sizes
    // the callers give in order); the tensors are contiguous, on `device`, of the sizes the
    // kernel is told, and are owned by the caller until libtorch's stream, which the kernel is
    // queued on, has moved past it.
    unsafe { family(kernels)[out].launch(device, blocks, THREADS, &mut args)? };
    Ok(true)
}

/// Writes `weight [rows, cols]` (float8_e4m3fn) times its `[ceil(rows/bo), ceil(cols/bi)]` f32
/// block scales into `product` in one kernel; `false` (nothing written) where the kernel does
/// not apply: not on a GPU, not contiguous, `cols` or `bi` not a multiple of 16.
pub(crate) fn fp8(
    weight: &Tensor,
    scale_inv: &Tensor,
    [bo, bi]: [i64; 2],
    product: &Tensor,
) -> Result<bool> {
    let (rows, cols) = (weight.size()[0], weight.size()[1]);
    run(
        |k| &k.fp8,
        [weight, scale_inv, product],
        cols % 16 == 0 && bi % 16 == 0,
        &[rows, cols, bo, bi, scale_inv.size()[1]],
    )
}

/// Writes `packed [rows, cols/8]` (int32, eight offset-by-8 codes each) times its
/// `[rows, cols/group]` f32 scales into `product` in one kernel; `false` (nothing written)
/// where the kernel does not apply: not on a GPU, not contiguous, `cols` or `group` not a
/// multiple of 16.
pub(crate) fn int4(packed: &Tensor, scale: &Tensor, group: i64, product: &Tensor) -> Result<bool> {
    let (rows, cols) = (packed.size()[0], packed.size()[1] * 8);
    run(
        |k| &k.int4,
        [packed, scale, product],
        cols % 16 == 0 && group % 16 == 0,
        &[rows, cols, group],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernels_compile_to_ptx_for_hopper_and_ampere() {
        for cc in [(9, 0), (8, 0)] {
            let ptx = compile_ptx(cc).unwrap();
            let text = ptx.to_str().unwrap();
            for (_, out) in OUTPUTS {
                for family in ["fp8", "int4"] {
                    let entry = format!(".entry {family}_{out}(");
                    assert!(
                        text.contains(&entry),
                        "{entry} missing from the PTX for {cc:?}"
                    );
                }
            }
            assert!(text.contains(&format!(".target sm_{}{}", cc.0, cc.1)));
        }
    }

    #[test]
    fn cpu_tensors_are_left_to_the_pytorch_path() {
        let w = Tensor::zeros([2, 16], (Kind::Float, Device::Cpu)).to_kind(Kind::Float8e4m3fn);
        let s = Tensor::ones([1, 1], (Kind::Float, Device::Cpu));
        let product = Tensor::zeros([2, 16], (Kind::BFloat16, Device::Cpu));
        assert!(!fp8(&w, &s, [128, 128], &product).unwrap());
        let packed = Tensor::zeros([2, 2], (Kind::Int, Device::Cpu));
        let s = Tensor::ones([2, 1], (Kind::Float, Device::Cpu));
        assert!(!int4(&packed, &s, 16, &product).unwrap());
    }
}
