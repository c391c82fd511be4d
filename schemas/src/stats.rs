use crate::{DType, TensorData};

/// Cheap per-tensor statistics stored beside each tensor so SQL never reads the tensor.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TensorStats {
    /// Mean over tokens of the token vector's L2 norm (finite values only).
    pub mean_norm: f32,
    /// Largest finite absolute value.
    pub max_abs: f32,
    /// NaN values.
    pub nan_count: u64,
    /// ±Inf values.
    pub inf_count: u64,
}

/// Compute the statistics of a `[tokens, hidden]` tensor in one pass.
pub fn tensor_stats(t: &TensorData) -> TensorStats {
    let (tokens, hidden) = match t.shape.as_slice() {
        [a, b] => (*a, *b),
        _ => (1, t.numel()),
    };
    // Dispatch once on the dtype so each inner loop is monomorphic and unrolls.
    match t.dtype {
        DType::Bf16 => stats_with(t, tokens, hidden, |d, i| {
            crate::bf16_bits_to_f32(u16::from_le_bytes([d[2 * i], d[2 * i + 1]]))
        }),
        DType::F16 => stats_with(t, tokens, hidden, |d, i| {
            half::f16::from_bits(u16::from_le_bytes([d[2 * i], d[2 * i + 1]])).to_f32()
        }),
        DType::F32 => stats_with(t, tokens, hidden, |d, i| {
            f32::from_le_bytes([d[4 * i], d[4 * i + 1], d[4 * i + 2], d[4 * i + 3]])
        }),
        DType::Fp8E4m3 => stats_with(t, tokens, hidden, |d, i| crate::fp8_e4m3_to_f32(d[i])),
    }
}

#[inline(always)]
fn stats_with(
    t: &TensorData,
    tokens: usize,
    hidden: usize,
    get: impl Fn(&[u8], usize) -> f32,
) -> TensorStats {
    let mut st = TensorStats::default();
    let mut norm_sum = 0f64;
    let d = &t.data;
    for r in 0..tokens {
        let scale = t.scales.as_ref().map_or(1.0, |s| s[r]);
        let base = r * hidden;
        // Fast path: eight independent accumulators; a non-finite row sum sends the row to
        // the careful path, which counts NaN/Inf and skips them.
        let mut acc = [0f32; 8];
        let mut mx = [0f32; 8];
        let chunks = hidden / 8;
        for c in 0..chunks {
            for k in 0..8 {
                let v = get(d, base + c * 8 + k) * scale;
                acc[k] += v * v;
                mx[k] = mx[k].max(v.abs());
            }
        }
        for c in chunks * 8..hidden {
            let v = get(d, base + c) * scale;
            acc[0] += v * v;
            mx[0] = mx[0].max(v.abs());
        }
        let sq: f32 = acc.iter().sum();
        if sq.is_finite() {
            norm_sum += (sq as f64).sqrt();
            st.max_abs = mx.iter().fold(st.max_abs, |a, &b| a.max(b));
            continue;
        }
        let mut sq = 0f64;
        for c in 0..hidden {
            let v = get(d, base + c) * scale;
            if v.is_nan() {
                st.nan_count += 1;
            } else if v.is_infinite() {
                st.inf_count += 1;
            } else {
                st.max_abs = st.max_abs.max(v.abs());
                sq += (v as f64) * (v as f64);
            }
        }
        norm_sum += sq.sqrt();
    }
    st.mean_norm = if tokens > 0 {
        (norm_sum / tokens as f64) as f32
    } else {
        0.0
    };
    st
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_nan_inf_and_mean_token_norm() {
        let t = TensorData::from_f32(&[3.0, 4.0, f32::NAN, f32::INFINITY, 0.0, -2.0], vec![3, 2]);
        let s = tensor_stats(&t);
        assert_eq!((s.nan_count, s.inf_count), (1, 1));
        assert_eq!(s.max_abs, 4.0);
        assert!((s.mean_norm - (5.0 + 0.0 + 2.0) / 3.0).abs() < 1e-6);
    }

    #[test]
    fn huge_finite_values_take_the_careful_path() {
        let t = TensorData::from_f32(&[3e30, 4e30], vec![1, 2]);
        let s = tensor_stats(&t);
        assert_eq!((s.nan_count, s.inf_count), (0, 0));
        assert!((s.mean_norm / 5e30 - 1.0).abs() < 1e-6);
    }

    #[test]
    fn applies_fp8_scales() {
        let mut t = TensorData::zeros(DType::Fp8E4m3, vec![2, 1]);
        t.data = vec![0x38, 0x38];
        t.scales = Some(vec![2.0, 4.0]);
        assert_eq!(tensor_stats(&t).max_abs, 4.0);
    }
}
