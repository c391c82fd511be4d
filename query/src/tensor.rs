//! Decoding of stored tensor values (byte-split little-endian, `[tokens, hidden]`) and the
//! reductions behind the SQL tensor functions.
//!
//! Every reduction skips NaN and ±Inf elements, like the statistics columns written at capture
//! time (`<point>_norm`, `<point>_max_abs`), so that `tensor_norm(layer_30)` equals
//! `layer_30_norm` up to float rounding; `nan_count` / `inf_count` report what was skipped.
use hslake_schemas::{bf16_bits_to_f32, fp8_e4m3_to_f32, DType, TensorFieldMeta};

/// What a tensor column holds, taken from its field's `hslake.tensor` metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorKind {
    /// Element type.
    pub dtype: DType,
    /// Width of one token row (1 for a scale column, whose shape is `[tokens]`).
    pub hidden: usize,
}

impl TensorKind {
    /// The kind described by a field's tensor metadata, if its encoding is one this build reads.
    pub fn from_meta(meta: &TensorFieldMeta) -> Result<TensorKind, String> {
        if meta.encoding != "byte_split" {
            return Err(format!(
                "encoding {:?} is not supported (expected \"byte_split\")",
                meta.encoding
            ));
        }
        if meta.byte_order != "little" {
            return Err(format!(
                "byte order {:?} is not supported (expected \"little\")",
                meta.byte_order
            ));
        }
        let hidden = match meta.shape.as_slice() {
            [None, Some(h)] => *h,
            [None] => 1,
            other => return Err(format!("shape {other:?} is not [null, hidden] or [null]")),
        };
        if hidden == 0 {
            return Err("hidden size 0".into());
        }
        Ok(TensorKind {
            dtype: meta.dtype,
            hidden,
        })
    }

    /// Number of token rows in a stored value of `len` bytes, or an error naming the mismatch.
    pub fn tokens(&self, len: usize) -> Result<usize, String> {
        let row = self.dtype.size() * self.hidden;
        if !len.is_multiple_of(row) {
            return Err(format!(
                "a value of {len} bytes is not a whole number of {} rows of {} bytes ({} x {})",
                self.dtype,
                row,
                self.hidden,
                self.dtype.size()
            ));
        }
        Ok(len / row)
    }

    /// Decode a byte-split value into f32, row-major `[tokens, hidden]`, into `out`.
    pub fn decode_into(&self, split: &[u8], out: &mut Vec<f32>) {
        let n = split.len() / self.dtype.size();
        out.clear();
        out.reserve(n);
        match self.dtype {
            DType::Bf16 => {
                let (lo, hi) = split.split_at(n);
                out.extend(
                    lo.iter()
                        .zip(hi)
                        .map(|(&l, &h)| bf16_bits_to_f32(u16::from_le_bytes([l, h]))),
                );
            }
            DType::F16 => {
                let (lo, hi) = split.split_at(n);
                out.extend(
                    lo.iter()
                        .zip(hi)
                        .map(|(&l, &h)| half::f16::from_bits(u16::from_le_bytes([l, h])).to_f32()),
                );
            }
            DType::F32 => {
                let (b0, rest) = split.split_at(n);
                let (b1, rest) = rest.split_at(n);
                let (b2, b3) = rest.split_at(n);
                out.extend((0..n).map(|i| f32::from_le_bytes([b0[i], b1[i], b2[i], b3[i]])));
            }
            DType::Fp8E4m3 => out.extend(split.iter().map(|&b| fp8_e4m3_to_f32(b))),
        }
    }
}

/// Byte-split little-endian f32 values (the inverse of [`TensorKind::decode_into`] for f32).
pub fn encode_f32_split(values: &[f32]) -> Vec<u8> {
    let n = values.len();
    let mut out = vec![0u8; 4 * n];
    for (i, v) in values.iter().enumerate() {
        for (k, b) in v.to_le_bytes().into_iter().enumerate() {
            out[k * n + i] = b;
        }
    }
    out
}

/// L2 norm of one token row over its finite elements.
pub fn row_norm(row: &[f32]) -> f64 {
    row.iter()
        .filter(|v| v.is_finite())
        .map(|&v| (v as f64) * (v as f64))
        .sum::<f64>()
        .sqrt()
}

/// Mean over rows of the per-row L2 norm; `None` for a tensor with no rows.
pub fn mean_norm(values: &[f32], hidden: usize) -> Option<f64> {
    let rows = values.len() / hidden;
    (rows > 0).then(|| values.chunks_exact(hidden).map(row_norm).sum::<f64>() / rows as f64)
}

/// Largest finite |x|; `None` when no element is finite.
pub fn max_abs(values: &[f32]) -> Option<f64> {
    values
        .iter()
        .filter(|v| v.is_finite())
        .map(|v| v.abs() as f64)
        .reduce(f64::max)
}

/// Mean and population standard deviation of the finite elements; `None` when there are none.
pub fn mean_std(values: &[f32]) -> Option<(f64, f64)> {
    let (mut n, mut sum) = (0u64, 0f64);
    for &v in values.iter().filter(|v| v.is_finite()) {
        n += 1;
        sum += v as f64;
    }
    if n == 0 {
        return None;
    }
    let mean = sum / n as f64;
    // Two passes: the one-pass formula loses digits when |mean| >> std, common in activations.
    let var = values
        .iter()
        .filter(|v| v.is_finite())
        .map(|&v| (v as f64 - mean).powi(2))
        .sum::<f64>()
        / n as f64;
    Some((mean, var.sqrt()))
}

/// Mean over tokens of the cosine similarity of matching rows. Tokens where either row has
/// zero norm over the elements finite in both are skipped; `None` if every token is skipped.
pub fn mean_cosine(a: &[f32], b: &[f32], hidden: usize) -> Option<f64> {
    let (mut sum, mut n) = (0f64, 0u64);
    for (ra, rb) in a.chunks_exact(hidden).zip(b.chunks_exact(hidden)) {
        let (mut dot, mut na, mut nb) = (0f64, 0f64, 0f64);
        for (&x, &y) in ra.iter().zip(rb) {
            if x.is_finite() && y.is_finite() {
                let (x, y) = (x as f64, y as f64);
                dot += x * y;
                na += x * x;
                nb += y * y;
            }
        }
        if na > 0.0 && nb > 0.0 {
            sum += dot / (na.sqrt() * nb.sqrt());
            n += 1;
        }
    }
    (n > 0).then(|| sum / n as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(bytes_per: usize, le: &[Vec<u8>]) -> Vec<u8> {
        let n = le.len();
        let mut out = vec![0; n * bytes_per];
        for (i, e) in le.iter().enumerate() {
            for k in 0..bytes_per {
                out[k * n + i] = e[k];
            }
        }
        out
    }

    #[test]
    fn decodes_byte_split_values_of_every_dtype() {
        let vals = [1.5f32, -2.0, 0.25, 3.0];
        let kind = |dtype| TensorKind { dtype, hidden: 2 };
        let mut out = Vec::new();

        let f32s: Vec<Vec<u8>> = vals.iter().map(|v| v.to_le_bytes().to_vec()).collect();
        kind(DType::F32).decode_into(&split(4, &f32s), &mut out);
        assert_eq!(out, vals);

        let bf: Vec<Vec<u8>> = vals
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_le_bytes().to_vec())
            .collect();
        kind(DType::Bf16).decode_into(&split(2, &bf), &mut out);
        assert_eq!(out, vals);

        let h: Vec<Vec<u8>> = vals
            .iter()
            .map(|&v| half::f16::from_f32(v).to_le_bytes().to_vec())
            .collect();
        kind(DType::F16).decode_into(&split(2, &h), &mut out);
        assert_eq!(out, vals);

        // e4m3: 1.0 = 0x38, -2.0 = 0xc0, 0.25 = 0x28, 3.0 = 0x44
        kind(DType::Fp8E4m3).decode_into(&[0x38, 0xc0, 0x28, 0x44], &mut out);
        assert_eq!(out, [1.0, -2.0, 0.25, 3.0]);
    }

    #[test]
    fn f32_split_round_trips() {
        let vals = [1.0f32, f32::NAN, -0.0, 7.25e-3];
        let mut out = Vec::new();
        TensorKind {
            dtype: DType::F32,
            hidden: 1,
        }
        .decode_into(&encode_f32_split(&vals), &mut out);
        assert_eq!(
            out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            vals.map(f32::to_bits)
        );
    }

    #[test]
    fn token_count_rejects_partial_rows() {
        let k = TensorKind {
            dtype: DType::Bf16,
            hidden: 4,
        };
        assert_eq!(k.tokens(24).unwrap(), 3);
        let err = k.tokens(10).unwrap_err();
        assert!(err.contains("10 bytes") && err.contains("bf16"), "{err}");
    }

    #[test]
    fn reductions_skip_non_finite_values() {
        let v = [3.0f32, 4.0, f32::NAN, 0.0, f32::INFINITY, -1.0];
        assert_eq!(mean_norm(&v, 2), Some((5.0 + 0.0 + 1.0) / 3.0));
        assert_eq!(max_abs(&v), Some(4.0));
        let (m, s) = mean_std(&[1.0, 3.0, f32::NAN]).unwrap();
        assert_eq!((m, s), (2.0, 1.0));
        assert_eq!(mean_norm(&[], 2), None);
        assert_eq!(mean_std(&[f32::NAN]), None);
    }

    #[test]
    fn cosine_is_mean_over_tokens_and_skips_zero_rows() {
        let a = [1.0f32, 0.0, 0.0, 1.0, 0.0, 0.0];
        let b = [3.0f32, 0.0, 0.0, -2.0, 5.0, 5.0];
        // token 0: 1, token 1: -1, token 2: skipped (a is zero)
        assert_eq!(mean_cosine(&a, &b, 2), Some(0.0));
        assert_eq!(mean_cosine(&[0.0, 0.0], &[1.0, 1.0], 2), None);
    }
}
