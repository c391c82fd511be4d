//! Our kernels of the forward's hot path, compiled at first use by NVRTC from the CUDA C++ in
//! each file and launched on libtorch's stream: SiLU-and-mul and RoPE ([`elementwise`]), RMS
//! norm with the residual add ([`norm`]), MoE routing ([`route`]), expert alignment and the
//! weighted un-permutation ([`align`]).
//!
//! Why kernels of our own: vLLM's lead over our capture on one GPU is its kernels, not graph
//! capture (docs/guide/capture.md#kernels); libtorch has no fused form of these steps, and the
//! capture process runs no Python (so no Triton). Each kernel writes what libtorch's operations
//! write, in their rounding order where it can be reproduced, so that the libtorch path stays
//! the reference: it is what runs on the CPU, what a kernel falls back to where it does not
//! apply (another dtype, a shape it does not take, a GPU NVRTC cannot compile for), and what
//! `hslake debug kernels` compares each kernel with on a GPU. Every wrapper returns `None`,
//! having launched nothing, where its kernel does not apply.
use std::ffi::{c_void, CStr};
use std::sync::OnceLock;

use tch::{Device, Kind, Tensor};

use crate::error::Result;
use crate::gpu::cuda::{self, Kernel};
use crate::gpu::nvrtc;

pub(crate) mod align;
pub(crate) mod elementwise;
pub(crate) mod norm;
pub(crate) mod route;

/// Helpers every kernel source starts with: bf16 <-> f32 (PTX's round-to-nearest-even, which
/// is libtorch's `__float2bfloat16` on compute capability 8.0 and later) and the index types.
const PRELUDE: &str = r#"
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
__device__ __forceinline__ float bf(u16 v) { return __uint_as_float(((u32)v) << 16); }
__device__ __forceinline__ u16 rn(float f) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}
// What libtorch's bf16 x bf16 -> bf16 multiply and add store: the f32 result rounded once.
__device__ __forceinline__ u16 mul_bf(u16 a, u16 b) { return rn(__fmul_rn(bf(a), bf(b))); }
__device__ __forceinline__ u16 add_bf(u16 a, u16 b) { return rn(__fadd_rn(bf(a), bf(b))); }
"#;

/// A family of kernels from one CUDA source, compiled and loaded once per process (for the
/// compute capability of the first GPU that asks; the PTX is JIT-compiled for each GPU as it
/// first runs it). A failure is logged once, and the family's callers keep libtorch's path.
pub(crate) struct Family {
    what: &'static str,
    source: &'static str,
    file: &'static CStr,
    names: &'static [&'static CStr],
    loaded: OnceLock<Option<Vec<Kernel>>>,
}

impl Family {
    /// `names` are the `extern "C"` kernels of `source` (which follows [`PRELUDE`]).
    pub const fn new(
        what: &'static str,
        source: &'static str,
        file: &'static CStr,
        names: &'static [&'static CStr],
    ) -> Self {
        Family {
            what,
            source,
            file,
            names,
            loaded: OnceLock::new(),
        }
    }

    /// The source compiled to PTX for compute capability `major.minor` (no GPU needed).
    pub fn compile_ptx(&self, cc: (i32, i32)) -> Result<std::ffi::CString> {
        nvrtc::compile_ptx(&format!("{PRELUDE}{}", self.source), self.file, cc)
    }

    /// Kernel `i` of `names`, loaded for GPU `device`; `None` where the family cannot load.
    pub fn kernel(&self, device: usize, i: usize) -> Option<&Kernel> {
        self.loaded
            .get_or_init(|| {
                let load = || -> Result<Vec<Kernel>> {
                    let library = nvrtc::load_library(device, |cc| self.compile_ptx(cc))?;
                    self.names.iter().map(|n| library.kernel(n)).collect()
                };
                load()
                    .map_err(|e| {
                        tracing::warn!(
                            "our {} kernels are unavailable, libtorch's operations run instead \
                             (same results, slower): {e}",
                            self.what
                        )
                    })
                    .ok()
            })
            .as_ref()
            .and_then(|k| k.get(i))
    }
}

/// A kernel's arguments, each in an 8-byte slot: device pointers and 64-bit integers whole, f32
/// in the slot's low 4 bytes (the launch copies each parameter's own size from its slot, and
/// the slots are little-endian).
#[derive(Default)]
pub(crate) struct Args(Vec<u64>);

impl Args {
    /// Appends `t`'s data pointer.
    pub fn ptr(mut self, t: &Tensor) -> Self {
        self.0.push(t.data_ptr() as u64);
        self
    }

    /// Appends a 64-bit integer.
    pub fn int(mut self, v: i64) -> Self {
        self.0.push(v as u64);
        self
    }

    /// Appends an f32.
    pub fn f32(mut self, v: f32) -> Self {
        self.0.push(u64::from(v.to_bits()));
        self
    }

    /// Queues `kernel` on GPU `device`'s libtorch stream with `blocks` blocks of `threads`.
    ///
    /// # Safety
    /// The slots must match the kernel's parameters in number, order and type, and every
    /// tensor whose pointer they hold must be on `device`, laid out as the kernel reads it, and
    /// owned by the caller until the launch is queued (the caching allocator hands memory out
    /// again only to later work on this same stream).
    pub unsafe fn launch(
        mut self,
        kernel: &Kernel,
        device: usize,
        blocks: u64,
        threads: u32,
    ) -> Result<()> {
        if blocks == 0 {
            return Ok(());
        }
        let mut slots: Vec<*mut c_void> =
            self.0.iter_mut().map(|s| (s as *mut u64).cast()).collect();
        kernel.launch(
            device,
            blocks.min(u32::MAX as u64) as u32,
            threads,
            &mut slots,
        )
    }
}

/// The GPU `t` is on, if it is a CUDA tensor of `kind`.
pub(crate) fn cuda_of(t: &Tensor, kind: Kind) -> Option<usize> {
    match t.device() {
        Device::Cuda(d) if t.kind() == kind => Some(d),
        _ => None,
    }
}

/// Blocks for a grid-stride loop over `units` with `threads` per block: enough to fill every
/// SM several times, the kernel looping over the rest.
pub(crate) fn grid(device: usize, units: u64, threads: u32) -> u64 {
    static SMS: OnceLock<u64> = OnceLock::new();
    let sms = *SMS.get_or_init(|| cuda::multiprocessors(device).map_or(64, u64::from));
    units.div_ceil(u64::from(threads)).clamp(1, sms * 16)
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_family_compiles_to_ptx_for_hopper_and_ampere_with_each_kernel_it_loads() {
        for family in [
            &super::elementwise::KERNELS,
            &super::norm::KERNELS,
            &super::route::KERNELS,
            &super::align::KERNELS,
        ] {
            for cc in [(9, 0), (8, 0)] {
                let ptx = family.compile_ptx(cc).unwrap();
                let text = ptx.to_str().unwrap();
                assert!(text.contains(&format!(".target sm_{}{}", cc.0, cc.1)));
                for name in family.names {
                    let entry = format!(".entry {}(", name.to_str().unwrap());
                    assert!(text.contains(&entry), "{}: {entry} for {cc:?}", family.what);
                }
            }
        }
    }
}
