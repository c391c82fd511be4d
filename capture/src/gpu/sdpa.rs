//! Attention through libtorch's `scaled_dot_product_attention`, with the kernel it may pick
//! fixed by `--attention` ([`AttentionKernel`]).
//!
//! libtorch chooses among its kernels (flash, memory-efficient, cuDNN, math) by a process-wide
//! set of switches; tch exposes neither the switches nor the kernels' own entry points (their
//! forward signatures carry symbolic integers tch's generator skips), so the switches are set
//! through libtorch's exported `at::Context` methods. They are process-wide: every rank of an
//! engine uses the same choice, and `hslake debug kernels` runs its choices one after another.
use std::ffi::c_void;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

use tch::Tensor;

use crate::error::{CaptureError, Result};
use crate::kernels::AttentionKernel;

extern "C" {
    #[link_name = "_ZN2at13globalContextEv"]
    fn at_global_context() -> *mut c_void;
    #[link_name = "_ZN2at7Context14setSDPUseFlashEb"]
    fn at_set_flash(ctx: *mut c_void, on: bool);
    #[link_name = "_ZN2at7Context21setSDPUseMemEfficientEb"]
    fn at_set_mem_efficient(ctx: *mut c_void, on: bool);
    #[link_name = "_ZN2at7Context13setSDPUseMathEb"]
    fn at_set_math(ctx: *mut c_void, on: bool);
    #[link_name = "_ZN2at7Context14setSDPUseCuDNNEb"]
    fn at_set_cudnn(ctx: *mut c_void, on: bool);
    #[link_name = "_ZNK2at7Context19userEnabledFlashSDPEv"]
    fn at_flash(ctx: *const c_void) -> bool;
    #[link_name = "_ZNK2at7Context26userEnabledMemEfficientSDPEv"]
    fn at_mem_efficient(ctx: *const c_void) -> bool;
    #[link_name = "_ZNK2at7Context18userEnabledMathSDPEv"]
    fn at_math(ctx: *const c_void) -> bool;
    #[link_name = "_ZNK2at7Context19userEnabledCuDNNSDPEv"]
    fn at_cudnn(ctx: *const c_void) -> bool;
}

/// Which of libtorch's attention kernels are allowed: flash, memory-efficient, math, cuDNN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Switches([bool; 4]);

impl Switches {
    fn read() -> Self {
        // SAFETY: at::globalContext() returns the process's context, alive for its whole life;
        // the getters are const methods taking it as `this`.
        unsafe {
            let ctx = at_global_context();
            Switches([
                at_flash(ctx),
                at_mem_efficient(ctx),
                at_math(ctx),
                at_cudnn(ctx),
            ])
        }
    }

    fn apply(self) {
        let [flash, efficient, math, cudnn] = self.0;
        // SAFETY: as in `read`; the setters store one flag each.
        unsafe {
            let ctx = at_global_context();
            at_set_flash(ctx, flash);
            at_set_mem_efficient(ctx, efficient);
            at_set_math(ctx, math);
            at_set_cudnn(ctx, cudnn);
        }
    }

    /// The switches a choice sets; `defaults` for libtorch's own pick.
    fn of(kernel: AttentionKernel, defaults: Switches) -> Self {
        match kernel {
            AttentionKernel::Sdpa => defaults,
            AttentionKernel::Cudnn => Switches([false, false, false, true]),
            AttentionKernel::Flash => Switches([true, false, false, false]),
        }
    }
}

/// The choice the switches hold now (`u8::MAX`: never set by us, libtorch's defaults).
static APPLIED: AtomicU8 = AtomicU8::new(u8::MAX);
/// libtorch's switches before we first set them.
static DEFAULTS: OnceLock<Switches> = OnceLock::new();

/// Sets libtorch's switches for `kernel`, unless they already are.
fn select(kernel: AttentionKernel) {
    let code = kernel as u8;
    let applied = APPLIED.load(Ordering::Acquire);
    if applied == code || (applied == u8::MAX && kernel == AttentionKernel::Sdpa) {
        return;
    }
    let defaults = *DEFAULTS.get_or_init(Switches::read);
    Switches::of(kernel, defaults).apply();
    APPLIED.store(code, Ordering::Release);
}

/// Attention of `q [b, heads, t, d_qk]` over `k` and `v` (`[b, kv_heads, t, d]`, any strides
/// with a unit one over `d`): causal when `mask` is `None`, else `mask` (boolean, true =
/// attend); `gqa` when key/value heads are fewer. On CUDA through the kernel `kernel` names
/// (a masked attention, a sliding window, always through libtorch's pick); `flash` pads values
/// narrower than the keys with zeros and cuts the padding off the output.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: Option<f64>,
    gqa: bool,
    kernel: AttentionKernel,
) -> Result<Tensor> {
    let kernel = match q.device().is_cuda() && mask.is_none() {
        true => kernel,
        false => AttentionKernel::Sdpa,
    };
    select(kernel);
    let (d_qk, d_v) = (q.size()[3], v.size()[3]);
    let pad = kernel == AttentionKernel::Flash && d_v < d_qk;
    let padded;
    let value = match pad {
        true => {
            padded = v.f_constant_pad_nd([0, d_qk - d_v])?;
            &padded
        }
        false => v,
    };
    let y =
        Tensor::f_scaled_dot_product_attention(q, k, value, mask, 0.0, mask.is_none(), scale, gqa)
            .map_err(|e| match kernel {
                AttentionKernel::Sdpa => CaptureError::from(e),
                _ => CaptureError::Unsupported(format!(
            "--attention {kernel}: libtorch's {kernel} attention refused queries {:?}, keys {:?} \
             and values {:?} ({:?}); --attention sdpa lets libtorch pick a kernel that takes \
             them: {e}",
            q.size(),
            k.size(),
            value.size(),
            q.kind()
        )),
            })?;
    Ok(match pad {
        true => y.f_narrow(3, 0, d_v)?,
        false => y,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn cpu_attention_is_libtorchs_whatever_the_choice() {
        tch::manual_seed(3);
        let q = Tensor::randn([1, 4, 5, 8], (Kind::Float, Device::Cpu));
        let k = Tensor::randn([1, 2, 5, 8], (Kind::Float, Device::Cpu));
        let v = Tensor::randn([1, 2, 5, 6], (Kind::Float, Device::Cpu));
        let want = Tensor::scaled_dot_product_attention(
            &q,
            &k,
            &v,
            None::<&Tensor>,
            0.0,
            true,
            None,
            true,
        );
        for kernel in [
            AttentionKernel::Sdpa,
            AttentionKernel::Cudnn,
            AttentionKernel::Flash,
        ] {
            let got = attention(&q, &k, &v, None, None, true, kernel).unwrap();
            assert!(got.equal(&want), "{kernel}");
        }
        assert_eq!(APPLIED.load(Ordering::Acquire), u8::MAX);
    }

    #[test]
    fn switches_of_each_choice_allow_only_its_kernel() {
        let defaults = Switches([true, true, true, false]);
        assert_eq!(Switches::of(AttentionKernel::Sdpa, defaults), defaults);
        assert_eq!(
            Switches::of(AttentionKernel::Cudnn, defaults),
            Switches([false, false, false, true])
        );
        assert_eq!(
            Switches::of(AttentionKernel::Flash, defaults),
            Switches([true, false, false, false])
        );
        // libtorch's own switches are readable through the exported methods.
        let now = Switches::read();
        assert!(now.0[2], "math attention is on by default: {now:?}");
    }
}
