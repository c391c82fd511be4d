//! Stored tensor values (`plane_zstd`, `[tokens, hidden]`) as f32, through the store's one
//! decoder (`hslake_store::format::decode`), and the reductions behind the SQL tensor
//! functions.
//!
//! Every reduction skips NaN and ±Inf elements, like the statistics columns written at capture
//! time (`<point>_norm`, `<point>_max_abs`), so that `tensor_norm(layer_30)` equals
//! `layer_30_norm` up to float rounding; `nan_count` / `inf_count` report what was skipped.
use hslake_schemas::{DType, TensorFieldMeta, TENSOR_ENCODING};
use hslake_store::format::decode::{self, ValueKind};
use hslake_store::format::planes::{self, Checksums};

/// A value in SQL is seen apart from its file, so whether the file declares checksummed values
/// is not known: the checksum a value carries is checked (a CRC-32 trailer, or zstd's frame
/// checksums). Dropping either still fails: a value whose trailer is taken for frame bytes, or
/// whose frame lost its checksum flag, no longer ends where its header of frame lengths says.
const CHECKS: Checksums = Checksums::IfPresent;

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
        if meta.encoding != TENSOR_ENCODING {
            return Err(format!(
                "encoding {:?} is not supported (expected {TENSOR_ENCODING:?})",
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

    fn value_kind(&self) -> ValueKind {
        ValueKind::Tensor {
            dtype: self.dtype,
            hidden: self.hidden,
        }
    }

    /// Number of token rows in a stored value, from its own header, or an error naming the
    /// mismatch.
    pub fn tokens(&self, value: &[u8]) -> Result<usize, String> {
        decode::header_tokens(value, self.value_kind(), CHECKS).map_err(|e| e.reason)
    }

    /// Token rows of a stored value: `seq_len`, its row's token count where the query sees it,
    /// checked against the value's header (nothing is decoded); otherwise from the header.
    pub fn expect_tokens(&self, value: &[u8], seq_len: Option<usize>) -> Result<usize, String> {
        match seq_len {
            Some(n) => decode::check_tokens(value, self.value_kind(), n, CHECKS)
                .map(|()| n)
                .map_err(|e| e.reason),
            None => self.tokens(value),
        }
    }

    /// Decode a stored value into f32, row-major `[tokens, hidden]`, into `out`; returns the
    /// number of tokens, taken from the value's own header.
    pub fn decode_into(&self, value: &[u8], out: &mut Vec<f32>) -> Result<usize, String> {
        self.decode_tokens_into(value, None, &mut Vec::new(), out)
    }

    /// Decode a stored value into f32, row-major `[tokens, hidden]`, into `out`, using `raw`
    /// as scratch; returns the number of tokens. With `seq_len` (the row's token count, where
    /// the query sees it) a value whose frames claim any other length is refused before
    /// anything is allocated for it; without it the value's header is trusted as far as its
    /// frames can hold it.
    pub fn decode_tokens_into(
        &self,
        value: &[u8],
        seq_len: Option<usize>,
        raw: &mut Vec<u8>,
        out: &mut Vec<f32>,
    ) -> Result<usize, String> {
        let kind = self.value_kind();
        let tokens = match seq_len {
            Some(n) => n,
            None => self.tokens(value)?,
        };
        decode::decode_value(value, kind, tokens, CHECKS, raw).map_err(|e| e.reason)?;
        out.clear();
        out.resize(raw.len() / self.dtype.size(), 0.0);
        self.dtype.widen_into(raw, out);
        Ok(tokens)
    }
}

/// Encode f32 values as a stored f32 value (the inverse of [`TensorKind::decode_into`] for
/// f32). zstd's fastest level: these are intermediate results, not stored data.
pub fn encode_f32(values: &[f32]) -> Result<Vec<u8>, String> {
    let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    planes::encode(&raw, 4, -5, None).map_err(|e| e.to_string())
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

    fn encoded(size: usize, le: &[Vec<u8>]) -> Vec<u8> {
        planes::encode(&le.concat(), size, 1, Some(planes::ValueChecksum::DEFAULT)).unwrap()
    }

    #[test]
    fn decodes_stored_values_of_every_dtype() {
        let vals = [1.5f32, -2.0, 0.25, 3.0];
        let kind = |dtype| TensorKind { dtype, hidden: 2 };
        let mut out = Vec::new();

        let f32s: Vec<Vec<u8>> = vals.iter().map(|v| v.to_le_bytes().to_vec()).collect();
        assert_eq!(
            kind(DType::F32).decode_into(&encoded(4, &f32s), &mut out),
            Ok(2)
        );
        assert_eq!(out, vals);

        let bf: Vec<Vec<u8>> = vals
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_le_bytes().to_vec())
            .collect();
        kind(DType::Bf16)
            .decode_into(&encoded(2, &bf), &mut out)
            .unwrap();
        assert_eq!(out, vals);

        let h: Vec<Vec<u8>> = vals
            .iter()
            .map(|&v| half::f16::from_f32(v).to_le_bytes().to_vec())
            .collect();
        kind(DType::F16)
            .decode_into(&encoded(2, &h), &mut out)
            .unwrap();
        assert_eq!(out, vals);

        // e4m3: 1.0 = 0x38, -2.0 = 0xc0, 0.25 = 0x28, 3.0 = 0x44
        let fp8 = vec![vec![0x38], vec![0xc0], vec![0x28], vec![0x44]];
        kind(DType::Fp8E4m3)
            .decode_into(&encoded(1, &fp8), &mut out)
            .unwrap();
        assert_eq!(out, [1.0, -2.0, 0.25, 3.0]);
    }

    #[test]
    fn f32_values_round_trip_bit_exactly() {
        let vals = [1.0f32, f32::NAN, -0.0, 7.25e-3];
        let mut out = Vec::new();
        TensorKind {
            dtype: DType::F32,
            hidden: 1,
        }
        .decode_into(&encode_f32(&vals).unwrap(), &mut out)
        .unwrap();
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
        let twelve =
            planes::encode(&[0u8; 24], 2, 1, Some(planes::ValueChecksum::DEFAULT)).unwrap();
        assert_eq!(k.tokens(&twelve).unwrap(), 3);
        let five = planes::encode(&[0u8; 10], 2, 1, Some(planes::ValueChecksum::DEFAULT)).unwrap();
        let err = k.tokens(&five).unwrap_err();
        assert!(
            err.contains("5 bf16 elements") && err.contains("rows of 4"),
            "{err}"
        );
        assert!(k.tokens(&[1, 2, 3]).unwrap_err().contains("too short"));
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
