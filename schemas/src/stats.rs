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
    let mut st = TensorStats::default();
    let mut norm_sum = 0f64;
    for r in 0..tokens {
        let scale = t.scales.as_ref().map_or(1.0, |s| s[r]);
        let mut sq = 0f64;
        for c in 0..hidden {
            let v = element(t.dtype, &t.data, r * hidden + c) * scale;
            if v.is_nan() {
                st.nan_count += 1;
            } else if v.is_infinite() {
                st.inf_count += 1;
            } else {
                let a = v.abs();
                if a > st.max_abs {
                    st.max_abs = a;
                }
                sq += (v as f64) * (v as f64);
            }
        }
        norm_sum += sq.sqrt();
    }
    st.mean_norm = if tokens > 0 { (norm_sum / tokens as f64) as f32 } else { 0.0 };
    st
}

#[inline(always)]
fn element(dtype: DType, data: &[u8], i: usize) -> f32 {
    dtype.to_f32(data, i)
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
    fn applies_fp8_scales() {
        let mut t = TensorData::zeros(DType::Fp8E4m3, vec![2, 1]);
        t.data = vec![0x38, 0x38];
        t.scales = Some(vec![2.0, 4.0]);
        assert_eq!(tensor_stats(&t).max_abs, 4.0);
    }
}
