use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::SchemaError;

/// Element type of a stored tensor. Values are little-endian; bf16 is kept as its raw 16 bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DType {
    /// bfloat16, stored as its 16 bits.
    Bf16,
    /// IEEE half precision.
    F16,
    /// IEEE single precision.
    F32,
    /// OCP fp8 e4m3fn, with one f32 scale per token (value = fp8 × scale).
    Fp8E4m3,
}

impl DType {
    /// Every dtype, in a fixed order.
    pub const ALL: [DType; 4] = [DType::Bf16, DType::F16, DType::F32, DType::Fp8E4m3];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::Bf16 | DType::F16 => 2,
            DType::F32 => 4,
            DType::Fp8E4m3 => 1,
        }
    }

    /// The name used in metadata, CLI flags and manifests.
    pub fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
            DType::Fp8E4m3 => "fp8_e4m3",
        }
    }

    /// Whether each token row carries an f32 scale.
    pub fn has_scales(self) -> bool {
        self == DType::Fp8E4m3
    }

    /// Decode element `i` of a little-endian buffer to f32 (scales not applied).
    #[inline]
    pub fn to_f32(self, bytes: &[u8], i: usize) -> f32 {
        match self {
            DType::Bf16 => bf16_bits_to_f32(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])),
            DType::F16 => {
                half::f16::from_bits(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])).to_f32()
            }
            DType::F32 => f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().expect("4 bytes")),
            DType::Fp8E4m3 => fp8_e4m3_to_f32(bytes[i]),
        }
    }

    /// Decode the little-endian elements of `bytes` into `out`, as many as both hold (scales
    /// not applied). A plain function, so that it runs at this crate's opt-level wherever it
    /// is called from.
    pub fn widen_into(self, bytes: &[u8], out: &mut [f32]) {
        match self {
            DType::Bf16 => {
                for (o, c) in out.iter_mut().zip(bytes.as_chunks::<2>().0) {
                    *o = bf16_bits_to_f32(u16::from_le_bytes(*c));
                }
            }
            DType::F16 => {
                for (o, c) in out.iter_mut().zip(bytes.as_chunks::<2>().0) {
                    *o = half::f16::from_bits(u16::from_le_bytes(*c)).to_f32();
                }
            }
            DType::F32 => {
                for (o, c) in out.iter_mut().zip(bytes.as_chunks::<4>().0) {
                    *o = f32::from_le_bytes(*c);
                }
            }
            DType::Fp8E4m3 => {
                for (o, &b) in out.iter_mut().zip(bytes) {
                    *o = fp8_e4m3_to_f32(b);
                }
            }
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = SchemaError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" | "bfloat16" => Ok(DType::Bf16),
            "f16" | "fp16" | "float16" => Ok(DType::F16),
            "f32" | "fp32" | "float32" => Ok(DType::F32),
            "fp8_e4m3" | "fp8" | "float8_e4m3fn" | "e4m3" => Ok(DType::Fp8E4m3),
            _ => Err(SchemaError::UnknownDType {
                name: s.to_string(),
            }),
        }
    }
}

/// Widen bf16 bits to f32 (exact).
#[inline]
pub fn bf16_bits_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Round f32 to the nearest bf16 (ties to even), keeping NaN a NaN.
#[inline]
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

/// Decode one OCP fp8 e4m3fn byte (no infinities; 0x7f/0xff are NaN).
#[inline]
pub fn fp8_e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = ((b >> 3) & 0x0f) as i32;
    let man = (b & 0x07) as f32;
    if exp == 0x0f && (b & 0x07) == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    }
}

/// Encode f32 as OCP fp8 e4m3fn, rounding to nearest (ties to even), saturating at ±448.
pub fn f32_to_fp8_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a >= 448.0 {
        return sign | 0x7e;
    }
    let min_normal = 2f32.powi(-6);
    if a < min_normal {
        // Subnormals are multiples of 2^-9.
        let m = (a / 2f32.powi(-9)).round_ties_even() as u8;
        return sign | m.min(8);
    }
    let mut e = a.log2().floor() as i32;
    let mut m = (a / 2f32.powi(e) - 1.0) * 8.0;
    m = m.round_ties_even();
    if m >= 8.0 {
        e += 1;
        m = 0.0;
    }
    let code = (((e + 7) as u8) << 3) | m as u8;
    sign | code.min(0x7e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_dtype_name_back() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
        }
    }

    #[test]
    fn rejects_unknown_dtype_with_the_list_of_known_ones() {
        let err = "int4".parse::<DType>().unwrap_err().to_string();
        assert!(
            err.contains("\"int4\"") && err.contains("bf16, f16, f32, fp8_e4m3"),
            "{err}"
        );
    }

    #[test]
    fn fp8_e4m3_decodes_reference_values() {
        assert_eq!(fp8_e4m3_to_f32(0x00), 0.0);
        assert_eq!(fp8_e4m3_to_f32(0x38), 1.0);
        assert_eq!(fp8_e4m3_to_f32(0x7e), 448.0);
        assert_eq!(fp8_e4m3_to_f32(0xb8), -1.0);
        assert_eq!(fp8_e4m3_to_f32(0x01), 2f32.powi(-9));
        assert!(fp8_e4m3_to_f32(0x7f).is_nan());
    }

    #[test]
    fn fp8_e4m3_encoding_inverts_decoding_for_every_code() {
        for b in 0u8..=255 {
            if b & 0x7f == 0x7f {
                continue;
            }
            let v = fp8_e4m3_to_f32(b);
            let back = f32_to_fp8_e4m3(v);
            assert_eq!(fp8_e4m3_to_f32(back), v, "code {b:#x}");
        }
        assert_eq!(f32_to_fp8_e4m3(1000.0), 0x7e);
    }

    #[test]
    fn bf16_round_trips_through_f32() {
        for bits in [0u16, 0x3f80, 0xc2f7, 0x7f7f, 0x0001] {
            assert_eq!(f32_to_bf16_bits(bf16_bits_to_f32(bits)), bits);
        }
    }

    #[test]
    fn widen_into_gives_each_element_as_to_f32_does_and_stops_at_the_shorter() {
        let bytes: Vec<u8> = (0u8..=255).cycle().step_by(7).take(64).collect();
        for dtype in DType::ALL {
            let n = bytes.len() / dtype.size();
            let mut out = vec![f32::MAX; n + 2];
            dtype.widen_into(&bytes, &mut out);
            for (i, v) in out[..n].iter().enumerate() {
                let want = dtype.to_f32(&bytes, i);
                assert!(
                    v.to_bits() == want.to_bits(),
                    "{dtype} element {i}: {v} vs {want}"
                );
            }
            assert_eq!(&out[n..], &[f32::MAX; 2], "{dtype}: wrote past the bytes");
        }
    }
}
