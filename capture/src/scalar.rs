//! Scalar operands of libtorch operations as 0-dim CPU tensors.
//!
//! tch 0.24's `f_*` methods that take a `Scalar` (`f_add_scalar`, `f_masked_fill`, `f_arange`,
//! ...) drop it before they read the operation's error, and that drop reads the error itself
//! and panics on it: a failed operation in one of them, such as a CUDA out-of-memory in
//! `f_masked_fill`, panicked instead of returning the error. The same operations with a 0-dim
//! CPU tensor return it. ATen runs a Scalar operand as a 0-dim CPU tensor too (a "wrapped
//! number"), so the kernels and the values are the same; only type promotion differs, where a
//! 0-dim tensor of a higher category than the other operand sets the result's dtype. Hence
//! floats are f64 here and go beside floating tensors only, integers i64 beside integer ones.
//! `clippy.toml` refuses the Scalar-taking methods outside tests.
use tch::{Device, Kind, Tensor};

use crate::error::Result;

/// `v` as a 0-dim f64 CPU tensor, the operand of a floating-point operation.
pub(crate) fn float(v: f64) -> Result<Tensor> {
    Ok(Tensor::f_from_slice(&[v])?.f_reshape([0i64; 0])?)
}

/// `v` as a 0-dim i64 CPU tensor, the operand of an integer operation.
pub(crate) fn int(v: i64) -> Result<Tensor> {
    Ok(Tensor::f_from_slice(&[v])?.f_reshape([0i64; 0])?)
}

/// `0..end` in `kind` on `device` (libtorch's `arange(end)`): the running count of ones,
/// exact in every integer kind and in floating kinds up to 2^24.
pub(crate) fn arange(end: i64, kind: Kind, device: Device) -> Result<Tensor> {
    let ones = Tensor::f_ones([end], (Kind::Int64, device))?;
    Ok(ones
        .f_cumsum(0, Kind::Int64)?
        .f_sub(&ones)?
        .f_to_kind(kind)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::CaptureError;

    #[test]
    fn the_tensor_forms_give_the_scalar_forms_bits_and_dtypes() {
        let x = Tensor::randn([64, 33], (Kind::Float, Device::Cpu)).to_kind(Kind::BFloat16);
        let s = 1.0 / 3.0;
        let same = |a: Tensor, b: Tensor| a.kind() == b.kind() && a.equal(&b);
        assert!(same(
            x.f_mul(&float(s).unwrap()).unwrap(),
            x.g_mul_scalar(s)
        ));
        assert!(same(
            x.f_add(&float(s).unwrap()).unwrap(),
            x.g_add_scalar(s)
        ));
        assert!(same(
            x.f_div(&float(s).unwrap()).unwrap(),
            x.g_div_scalar(s)
        ));
        let mask = x.gt(0.0);
        let filled = x.f_masked_fill_tensor(&mask, &float(f64::NEG_INFINITY).unwrap());
        assert!(same(
            filled.unwrap(),
            x.masked_fill(&mask, f64::NEG_INFINITY)
        ));
        let ids = Tensor::arange(50, (Kind::Int64, Device::Cpu));
        assert!(same(ids.f_ge_tensor(&int(7).unwrap()).unwrap(), ids.ge(7)));
        assert!(same(
            ids.f_floor_divide(&int(3).unwrap()).unwrap(),
            ids.floor_divide_scalar(3)
        ));
        for kind in [Kind::Int64, Kind::Float] {
            let want = Tensor::arange(50, (kind, Device::Cpu));
            assert!(same(arange(50, kind, Device::Cpu).unwrap(), want));
        }
        assert_eq!(arange(0, Kind::Float, Device::Cpu).unwrap().numel(), 0);
    }

    #[test]
    fn a_failed_operation_is_an_error_where_the_scalar_form_panics() {
        // An 8 PiB result: libtorch's CPU allocator refuses it at once.
        let huge = Tensor::zeros([1], (Kind::Float, Device::Cpu)).expand([1 << 51], false);
        let err = CaptureError::from(huge.f_add(&float(1.0).unwrap()).unwrap_err());
        assert!(matches!(err, CaptureError::OutOfMemory { .. }), "{err}");
        let panicked = std::panic::catch_unwind(|| huge.f_add_scalar(1.0).map(|_| ()));
        assert!(
            panicked.is_err(),
            "tch's Scalar form returned instead of panicking"
        );
    }
}
