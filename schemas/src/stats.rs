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

/// Token rows' reductions summed into a tensor's [`TensorStats`]: how [`tensor_stats`] combines
/// its rows, and how a capture combines rows reduced on the GPU.
#[derive(Debug, Clone, Copy, Default)]
pub struct RowSums {
    stats: TensorStats,
    norm_sum: f64,
    rows: u64,
}

impl RowSums {
    /// Adds one row: the sum of squares and the largest absolute value of its finite values,
    /// and its NaN and ±Inf counts.
    pub fn add(&mut self, sum_sq: f64, max_abs: f32, nan: u64, inf: u64) {
        self.norm_sum += sum_sq.sqrt();
        self.stats.max_abs = self.stats.max_abs.max(max_abs);
        self.stats.nan_count += nan;
        self.stats.inf_count += inf;
        self.rows += 1;
    }

    /// The statistics of the rows added (a mean norm of 0 without rows).
    pub fn finish(self) -> TensorStats {
        let mut st = self.stats;
        if self.rows > 0 {
            st.mean_norm = (self.norm_sum / self.rows as f64) as f32;
        }
        st
    }
}

/// Compute the statistics of a `[tokens, hidden]` tensor in one pass (see [`stats_of`]).
pub fn tensor_stats<D: AsRef<[u8]>>(t: &TensorData<D>) -> TensorStats {
    stats_of(t.dtype, &t.shape, t.data.as_ref(), t.scales.as_deref())
}

/// [`tensor_stats`] of a tensor given by its parts: `data` holds `shape`'s elements of `dtype`,
/// little-endian, and `scales` one f32 per token for fp8.
///
/// Not generic, and never inlined, on purpose: a generic function is compiled in the crate that
/// calls it, at that crate's opt-level, and the capture writers and the CLI are built at
/// opt-level 0 in the setup's build, where this loop ran 5-7x slower than here (schemas is
/// raised to opt-level 3 in Cargo.toml). `tensor_stats` is only the wrapper that lends the bytes.
#[inline(never)]
pub fn stats_of(dtype: DType, shape: &[usize], data: &[u8], scales: Option<&[f32]>) -> TensorStats {
    let (tokens, hidden) = match shape {
        [a, b] => (*a, *b),
        _ => (1, shape.iter().product()),
    };
    let k = dtype.size();
    let mut sums = RowSums::default();
    // Each row is reduced with eight lanes, a loop simple enough for the compiler to vectorise.
    // bf16 rows without scales are read in place (on a capture writer, widening them into a
    // buffer first took 60 % of this function's time); other rows are widened to f32 into one
    // reused buffer first. Both give the same bits: the lanes and their order are the same.
    let mut row = vec![0f32; hidden];
    let in_place = dtype == DType::Bf16 && scales.is_none();
    let widen_row = |r: usize, bytes: &[u8], row: &mut [f32]| {
        dtype.widen_into(bytes, row);
        if let Some(s) = scales {
            row.iter_mut().for_each(|v| *v *= s[r]);
        }
    };
    for r in 0..tokens {
        let bytes = &data[r * hidden * k..(r + 1) * hidden * k];
        let (sq, mx) = if in_place {
            sum_sq_and_max_abs(bytes.as_chunks::<2>().0, |&c| {
                crate::bf16_bits_to_f32(u16::from_le_bytes(c))
            })
        } else {
            widen_row(r, bytes, &mut row);
            sum_sq_and_max_abs(&row, |&v| v)
        };
        if sq.is_finite() {
            sums.add(sq as f64, mx, 0, 0);
            continue;
        }
        // Careful path for rows holding NaN/Inf (or squares overflowing f32).
        if in_place {
            widen_row(r, bytes, &mut row);
        }
        let (mut sq, mut mx, mut nan, mut inf) = (0f64, 0f32, 0, 0);
        for &v in &row {
            if v.is_nan() {
                nan += 1;
            } else if v.is_infinite() {
                inf += 1;
            } else {
                mx = mx.max(v.abs());
                sq += (v as f64) * (v as f64);
            }
        }
        sums.add(sq, mx, nan, inf);
    }
    sums.finish()
}

/// Sum of squares and max |x| of a row whose elements `value` reads as f32; NaN makes the sum
/// NaN, which the caller checks.
fn sum_sq_and_max_abs<T>(row: &[T], value: impl Fn(&T) -> f32) -> (f32, f32) {
    let mut acc = [0f32; 8];
    let mut mx = [0f32; 8];
    let chunks = row.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for k in 0..8 {
            let x = value(&c[k]);
            acc[k] += x * x;
            let a = x.abs();
            mx[k] = if a > mx[k] { a } else { mx[k] };
        }
    }
    for v in tail.iter().map(value) {
        acc[0] += v * v;
        mx[0] = mx[0].max(v.abs());
    }
    (acc.iter().sum(), mx.iter().fold(0f32, |a, &b| a.max(b)))
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
    fn bf16_rows_read_in_place_give_the_bits_of_widened_rows() {
        // Rows of odd widths (a tail after the eight lanes), with NaN, Inf, huge and tiny values.
        let mut x = 0x9e37_79b9u32;
        let specials = [0x7fc0u16, 0xff80, 0x7f80, 0x7f7f, 0x0001, 0x8000];
        for hidden in [1usize, 7, 8, 9, 67, 1024] {
            let bits: Vec<u16> = (0..5 * hidden)
                .map(|i| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    if i % 97 == 3 {
                        specials[(x % 6) as usize]
                    } else {
                        (x >> 16) as u16 & 0xbfff
                    }
                })
                .collect();
            let t = TensorData::from_bf16_bits(&bits, vec![5, hidden]);
            let widened: Vec<f32> = bits.iter().map(|&b| crate::bf16_bits_to_f32(b)).collect();
            let f = TensorData::from_f32(&widened, vec![5, hidden]);
            let (a, b) = (tensor_stats(&t), tensor_stats(&f));
            assert_eq!(
                a.mean_norm.to_bits(),
                b.mean_norm.to_bits(),
                "hidden {hidden}"
            );
            assert_eq!(a.max_abs.to_bits(), b.max_abs.to_bits(), "hidden {hidden}");
            assert_eq!((a.nan_count, a.inf_count), (b.nan_count, b.inf_count));
        }
    }

    #[test]
    fn the_statistics_loop_is_a_plain_function_compiled_here() {
        // Generic, `stats_of` would be compiled in each crate that calls it, at that crate's
        // opt-level (0 for the capture writers and the CLI in the setup's build); it would then
        // not name itself without type arguments, or not compile here at all.
        assert_eq!(
            std::any::type_name_of_val(&stats_of),
            "hslake_schemas::stats::stats_of"
        );
    }

    #[test]
    fn applies_fp8_scales() {
        let mut t = TensorData::zeros(DType::Fp8E4m3, vec![2, 1]);
        t.data = vec![0x38, 0x38];
        t.scales = Some(vec![2.0, 4.0]);
        assert_eq!(tensor_stats(&t).max_abs, 4.0);
    }
}
