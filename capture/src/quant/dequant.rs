//! Dequantization: a quantized weight's values times its scales, into the compute-dtype
//! matrix a GEMM takes, as the published dequantization computes it (each value times its f32
//! scale in f32, rounded once). One fused GPU kernel where it applies ([`super::fused`]),
//! PyTorch operations otherwise; both give the same bits.
use tch::{Kind, Tensor};

use super::fused;
use crate::error::Result;
use crate::kernels::DequantKernel;
use crate::scalar;

/// How a quantized weight's scales apply to its values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scheme {
    /// float8_e4m3fn values, one f32 scale per `[bo, bi]` tile.
    Fp8 {
        /// `[bo, bi]`.
        block: [i64; 2],
    },
    /// Eight 4-bit codes per int32, one f32 scale per `group` inputs.
    Int4 {
        /// Inputs per scale.
        group: i64,
    },
}

/// Values dequantized at once when a stack is: 128 Mi, so that a chunk's temporaries stay
/// within about 1 GiB.
pub(crate) const DEQUANTIZE_CHUNK: i64 = 1 << 27;

/// The matrix of `values` and their `scales` stored as `scheme` says, of shape `shape` (`[out,
/// in]`, or `[count, out, in]` for a stack) in `kind`, made by `kernel`; a stack that the
/// PyTorch operations dequantize goes about `chunk` values at a time. The result lives until
/// the caller's GEMM is done; libtorch's caching allocator hands its block to the next layer's
/// matrix of the same size, so the scratch is reused without a buffer of our own, and only
/// one layer's matrix exists at a time.
pub(crate) fn matrix(
    scheme: Scheme,
    kernel: DequantKernel,
    [values, scales]: [&Tensor; 2],
    shape: &[i64],
    kind: Kind,
    chunk: i64,
) -> Result<Tensor> {
    let product = Tensor::f_empty(shape, (kind, values.device()))?;
    // The fused kernel has no temporaries: a stack goes in one launch, as one matrix of
    // its stacked rows (whole FP8 tiles, checked when the stack was made, keep each value's
    // scale in place).
    let as_matrix = |t: &Tensor| {
        if shape.len() == 3 {
            t.f_flatten(0, 1)
        } else {
            Ok(t.shallow_clone())
        }
    };
    let whole = [as_matrix(values)?, as_matrix(scales)?];
    if kernel == DequantKernel::Fused && fused_into(scheme, &whole, &as_matrix(&product)?)? {
        return Ok(product);
    }
    if shape.len() == 2 {
        torch_into(scheme, values, scales, &product)?;
        return Ok(product);
    }
    // A stack is dequantized a few matrices at a time: the temporaries (an INT4 chunk's
    // unpacked int32 codes are 4 bytes a value) then exist for one chunk, not the stack.
    let (count, each) = (shape[0], shape[1] * shape[2]);
    let per_chunk = (chunk / each).max(1);
    let mut start = 0;
    while start < count {
        let n = per_chunk.min(count - start);
        // Leading `n` entries of a stacked tensor as one 2-D matrix: whole FP8 tiles
        // (checked when the stack was made) keep each value's scale in place.
        let part = |t: &Tensor| t.f_narrow(0, start, n)?.f_flatten(0, 1);
        torch_into(scheme, &part(values)?, &part(scales)?, &part(&product)?)?;
        start += n;
    }
    Ok(product)
}

/// [`torch_into`] in one fused GPU kernel where the kernel applies; `false`, nothing
/// written, otherwise.
fn fused_into(scheme: Scheme, [values, scales]: &[Tensor; 2], product: &Tensor) -> Result<bool> {
    match scheme {
        Scheme::Fp8 { block } => fused::fp8(values, scales, block, product),
        Scheme::Int4 { group } => fused::int4(values, scales, group, product),
    }
}

/// Dequantizes 2-D `values` and `scales` into the 2-D `product` with PyTorch operations.
fn torch_into(scheme: Scheme, values: &Tensor, scales: &Tensor, product: &Tensor) -> Result<()> {
    match scheme {
        Scheme::Fp8 { block } => dequantize_fp8(values, scales, block, product),
        Scheme::Int4 { group } => dequantize_int4(values, scales, group, product),
    }
}

/// `weight [out, in]` (float8_e4m3fn) times its block scales `[ceil(out/bo), ceil(in/bi)]`,
/// written into `product [out, in]` (the compute dtype).
///
/// Two kernels and 7 bytes of traffic per weight (bf16) instead of three and 19: every e4m3
/// value is exact in bf16, f16 and f32, so the codes go straight to the compute dtype; the
/// multiply by the f32 scale is computed in f32 (type promotion) and rounded as it is stored,
/// the same bits as an f32 product rounded afterwards.
fn dequantize_fp8(
    weight: &Tensor,
    scale_inv: &Tensor,
    block: [i64; 2],
    product: &Tensor,
) -> Result<()> {
    let (out, inp) = (weight.size()[0], weight.size()[1]);
    let [bo, bi] = block;
    let w = weight.f_to_kind(product.kind())?;
    if out % bo == 0 && inp % bi == 0 {
        // Whole tiles: one broadcast multiply, no expanded copy of the scales.
        let tiles = w.f_view([out / bo, bo, inp / bi, bi])?;
        let s = scale_inv.f_view([out / bo, 1, inp / bi, 1])?;
        let _ = tiles.f_mul_out(&product.f_view([out / bo, bo, inp / bi, bi])?, &s)?;
        return Ok(());
    }
    // A partial last tile (e.g. DeepSeek's 576-row kv_a_proj_with_mqa over 128-row blocks).
    let s = scale_inv
        .f_repeat_interleave_self_int(bo, 0, None)?
        .f_narrow(0, 0, out)?
        .f_repeat_interleave_self_int(bi, 1, None)?
        .f_narrow(1, 0, inp)?;
    let _ = w.f_mul_out(product, &s)?;
    Ok(())
}

/// `packed [out, in/8]` (int32, eight offset-by-8 codes each, lowest bits first) times its
/// group scales `[out, in/group]`, written into `product [out, in]`: the codes (-8..=7, exact
/// in every float dtype) are unpacked as bytes, and the multiply by the f32 scale is computed
/// in f32 and rounded to the compute dtype as it is stored.
///
/// About 7 bytes of memory traffic per value (unpacking two nibbles a byte, the -8 on bytes,
/// the multiply) where unpacking through int32 took about 26: the dequantization of a layer's
/// experts is bandwidth-bound, so this is most of its cost.
fn dequantize_int4(packed: &Tensor, scale: &Tensor, group: i64, product: &Tensor) -> Result<()> {
    let (out, words) = (packed.size()[0], packed.size()[1]);
    let inp = words * 8;
    // Little-endian int32 words as bytes [out, in/2]: byte b holds column 2b in its low nibble
    // and 2b + 1 in its high one (code k of a word is bits 4k..4k+4).
    let bytes = packed.f_contiguous()?.f_view_dtype(Kind::Uint8)?;
    let codes = Tensor::f_empty([out, inp / 2, 2], (Kind::Uint8, packed.device()))?;
    let _ = bytes.f_bitwise_and_tensor_out(&codes.f_select(-1, 0)?, &scalar::int(15)?)?;
    let _ = bytes.f_bitwise_right_shift_tensor_out(&codes.f_select(-1, 1)?, &scalar::int(4)?)?;
    // code - 8 wraps modulo 256 in uint8, which read as int8 is the signed value.
    let mut codes = codes.f_view([out, inp / group, group])?;
    let _ = codes.f_sub_(&scalar::int(8)?)?;
    let codes = codes.f_view_dtype(Kind::Int8)?;
    let _ = codes.f_mul_out(
        &product.f_view([out, inp / group, group])?,
        &scale.f_unsqueeze(-1)?,
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// e4m3fn decoded from its bit fields: sign, 4 exponent bits (bias 7), 3 mantissa bits;
    /// exponent 0 is subnormal, and S.1111.111 is NaN (no infinities).
    fn e4m3_reference(code: u8) -> f32 {
        let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
        let (exp, man) = ((code >> 3) & 0xF, code & 7);
        if exp == 0xF && man == 7 {
            return f32::NAN;
        }
        let magnitude = if exp == 0 {
            man as f32 / 8.0 * 2f32.powi(-6)
        } else {
            (1.0 + man as f32 / 8.0) * 2f32.powi(exp as i32 - 7)
        };
        sign * magnitude
    }

    #[test]
    fn every_e4m3_code_decodes_to_its_bit_field_value() {
        let codes: Vec<u8> = (0..=255).collect();
        let t = Tensor::from_slice(&codes)
            .f_view_dtype(Kind::Float8e4m3fn)
            .unwrap();
        let got = Vec::<f32>::try_from(t.to_kind(Kind::Float)).unwrap();
        for (code, v) in codes.iter().zip(got) {
            let want = e4m3_reference(*code);
            assert!(
                v == want || (v.is_nan() && want.is_nan()),
                "code {code:#04x}: {v} vs {want}"
            );
        }
        assert_eq!(e4m3_reference(0x7E), 448.0);
    }

    fn fp8(codes: &[u8], shape: [i64; 2]) -> Tensor {
        Tensor::from_slice(codes)
            .f_view_dtype(Kind::Float8e4m3fn)
            .unwrap()
            .view(shape)
    }

    fn fp8_matrix(weight: &Tensor, scale_inv: &Tensor, block: [i64; 2], kind: Kind) -> Tensor {
        let scheme = Scheme::Fp8 { block };
        let (parts, shape) = ([weight, scale_inv], weight.size());
        matrix(
            scheme,
            DequantKernel::Fused,
            parts,
            &shape,
            kind,
            DEQUANTIZE_CHUNK,
        )
        .unwrap()
    }

    fn int4_matrix(packed: &Tensor, scale: &Tensor, group: i64, kind: Kind) -> Tensor {
        let scheme = Scheme::Int4 { group };
        let shape = [packed.size()[0], packed.size()[1] * 8];
        matrix(
            scheme,
            DequantKernel::Fused,
            [packed, scale],
            &shape,
            kind,
            DEQUANTIZE_CHUNK,
        )
        .unwrap()
    }

    #[test]
    fn fp8_blocks_scale_their_own_tile_including_a_partial_last_one() {
        // [3, 5] over [2, 2] blocks: a 2 x 3 grid whose last row and column are partial.
        let codes: Vec<u8> = (0..15).map(|i| 0x30 + i as u8).collect();
        let scale: Vec<f32> = vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0];
        let s = Tensor::from_slice(&scale).view([2, 3]);
        let got = fp8_matrix(&fp8(&codes, [3, 5]), &s, [2, 2], Kind::Float);
        for r in 0..3 {
            for c in 0..5 {
                let want = e4m3_reference(codes[r * 5 + c]) * scale[(r / 2) * 3 + c / 2];
                assert_eq!(
                    got.double_value(&[r as i64, c as i64]) as f32,
                    want,
                    "({r}, {c})"
                );
            }
        }
        // Whole tiles take the broadcast path; each element still gets its own tile's scale.
        let codes: Vec<u8> = (0..16).map(|i| 0x28 + i as u8).collect();
        let scale = [0.5f32, 3.0, -1.0, 0.25];
        let s = Tensor::from_slice(&scale).view([2, 2]);
        let got = fp8_matrix(&fp8(&codes, [4, 4]), &s, [2, 2], Kind::Float);
        for r in 0..4 {
            for c in 0..4 {
                let want = e4m3_reference(codes[r * 4 + c]) * scale[(r / 2) * 2 + c / 2];
                assert_eq!(
                    got.double_value(&[r as i64, c as i64]) as f32,
                    want,
                    "({r}, {c})"
                );
            }
        }
    }

    #[test]
    fn int4_codes_unpack_lowest_bits_first_and_take_their_group_scale() {
        // One row of 16 values in groups of 8: codes 0..16 mod 16, i.e. values -8..7, -8..7.
        let values: Vec<i32> = (0..16).map(|i| (i % 16) - 8).collect();
        let word = |j: usize| -> i32 {
            (0..8).fold(0u32, |w, k| {
                w | (((values[8 * j + k] + 8) as u32) << (4 * k))
            }) as i32
        };
        let packed = Tensor::from_slice(&[word(0), word(1)]).view([1, 2]);
        let scale = Tensor::from_slice(&[0.5f32, 2.0]).view([1, 2]);
        let got = Vec::<f32>::try_from(int4_matrix(&packed, &scale, 8, Kind::Float).flatten(0, -1))
            .unwrap();
        let want: Vec<f32> = values
            .iter()
            .enumerate()
            .map(|(c, &v)| v as f32 * [0.5, 2.0][c / 8])
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn bf16_matrices_are_the_f32_dequantization_rounded_once() {
        // Every e4m3 code (NaNs aside) over [2, 2] tiles with scales that are not powers of
        // two, so that the products need rounding; and int4 codes with such scales.
        let codes: Vec<u8> = (0..=255u8).filter(|c| c & 0x7f != 0x7f).collect();
        let n = codes.len() as i64; // 254 = 2 * 127
        let scale = Tensor::from_slice(&[0.3f32, 1.7]).view([1, 2]);
        let w = fp8(&codes, [2, n / 2]);
        let grid = scale
            .repeat([1, n / 4])
            .f_narrow(1, 0, (n / 2 + 1) / 2)
            .unwrap();
        let f32_then_round = fp8_matrix(&w, &grid, [2, 2], Kind::Float).to_kind(Kind::BFloat16);
        let direct = fp8_matrix(&w, &grid, [2, 2], Kind::BFloat16);
        assert_eq!(direct.kind(), Kind::BFloat16);
        assert!(
            direct.equal(&f32_then_round),
            "fp8: bf16 result differs from f32 rounded once"
        );

        let packed =
            Tensor::from_slice(&[0x7654_3210u32 as i32, 0xfedc_ba98u32 as i32]).view([1, 2]);
        let scale = Tensor::from_slice(&[0.3f32, 1.7]).view([1, 2]);
        let f32_then_round = int4_matrix(&packed, &scale, 8, Kind::Float).to_kind(Kind::BFloat16);
        let direct = int4_matrix(&packed, &scale, 8, Kind::BFloat16);
        assert!(
            direct.equal(&f32_then_round),
            "int4: bf16 result differs from f32 rounded once"
        );
    }
}
