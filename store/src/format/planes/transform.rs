//! The plane transform: every element rotated left by one bit, its bytes split into planes
//! (the top byte whole, each lower byte as two nibble planes), and back.
/// Number of planes (and zstd frames) for elements of `size` bytes.
pub fn plane_count(size: usize) -> usize {
    if size <= 1 {
        1
    } else {
        1 + 2 * (size - 1)
    }
}

/// Byte lengths of the planes of `n` elements of `size` bytes.
pub(super) fn plane_lens(size: usize, n: usize) -> impl Iterator<Item = usize> {
    std::iter::once(n).chain(std::iter::repeat_n(n.div_ceil(2), plane_count(size) - 1))
}

/// Rotate each element left by one bit and write the planes, concatenated, into `planes`
/// (resized to fit). `data` holds little-endian elements of `size` bytes.
pub fn to_planes(data: &[u8], size: usize, planes: &mut Vec<u8>) {
    let n = data.len() / size;
    let half = n.div_ceil(2);
    // Every byte is overwritten below, so a reused buffer is not cleared first (on a capture
    // writer that memset was a tenth of the split's time).
    let len = plane_lens(size, n).sum();
    planes.truncate(len);
    planes.resize(len, 0);
    if n == 0 {
        return;
    }
    match size {
        1 => planes.copy_from_slice(data),
        2 => {
            let (top, rest) = planes.split_at_mut(n);
            let (hi_nib, lo_nib) = rest.split_at_mut(half);
            let done = super::bf16_split::split_leading(data, top, hi_nib, lo_nib);
            let (pairs, tail) = data.split_at(n / 2 * 4);
            for (((p, t), h), l) in pairs[2 * done..]
                .chunks_exact(4)
                .zip(top[done..].chunks_exact_mut(2))
                .zip(hi_nib[done / 2..].iter_mut())
                .zip(lo_nib[done / 2..].iter_mut())
            {
                let a = u16::from_le_bytes([p[0], p[1]]).rotate_left(1);
                let b = u16::from_le_bytes([p[2], p[3]]).rotate_left(1);
                t[0] = (a >> 8) as u8;
                t[1] = (b >> 8) as u8;
                *h = nibbles_high(a as u8, b as u8);
                *l = nibbles_low(a as u8, b as u8);
            }
            if let [x, y] = *tail {
                let a = u16::from_le_bytes([x, y]).rotate_left(1);
                top[n - 1] = (a >> 8) as u8;
                hi_nib[half - 1] = nibbles_high(a as u8, 0);
                lo_nib[half - 1] = nibbles_low(a as u8, 0);
            }
        }
        _ => {
            // Generic path (f32): top byte, then each lower byte from high to low as two
            // nibble planes.
            let rotated: Vec<u64> = data
                .chunks_exact(size)
                .map(|c| rotl1(le_value(c), size))
                .collect();
            let (top, rest) = planes.split_at_mut(n);
            for (t, &v) in top.iter_mut().zip(&rotated) {
                *t = (v >> (8 * (size - 1))) as u8;
            }
            for (k, pair) in rest.chunks_exact_mut(2 * half).enumerate() {
                let shift = 8 * (size - 2 - k);
                let (hi_nib, lo_nib) = pair.split_at_mut(half);
                for (j, (h, l)) in hi_nib.iter_mut().zip(lo_nib.iter_mut()).enumerate() {
                    let a = (rotated[2 * j] >> shift) as u8;
                    let b = rotated.get(2 * j + 1).map_or(0, |v| (v >> shift) as u8);
                    *h = nibbles_high(a, b);
                    *l = nibbles_low(a, b);
                }
            }
        }
    }
}

/// Inverse of [`to_planes`]: rebuild `out.len() / size` elements from concatenated planes.
pub(super) fn from_planes(planes: &[u8], size: usize, out: &mut [u8]) {
    let n = out.len() / size;
    let half = n.div_ceil(2);
    if n == 0 {
        return;
    }
    match size {
        1 => out.copy_from_slice(&planes[..n]),
        2 => {
            let (top, rest) = planes.split_at(n);
            let (hi_nib, lo_nib) = rest.split_at(half);
            let (pairs, tail) = out.split_at_mut(n / 2 * 4);
            for (((o, t), &h), &l) in pairs
                .chunks_exact_mut(4)
                .zip(top.chunks_exact(2))
                .zip(hi_nib)
                .zip(lo_nib)
            {
                let a = (u16::from(t[0]) << 8 | u16::from((h << 4) | (l & 0x0f))).rotate_right(1);
                let b = (u16::from(t[1]) << 8 | u16::from((h & 0xf0) | (l >> 4))).rotate_right(1);
                o[..2].copy_from_slice(&a.to_le_bytes());
                o[2..].copy_from_slice(&b.to_le_bytes());
            }
            if tail.len() == 2 {
                let (h, l) = (hi_nib[half - 1], lo_nib[half - 1]);
                let a =
                    (u16::from(top[n - 1]) << 8 | u16::from((h << 4) | (l & 0x0f))).rotate_right(1);
                tail.copy_from_slice(&a.to_le_bytes());
            }
        }
        _ => {
            let (top, rest) = planes.split_at(n);
            let mut rotated: Vec<u64> = top
                .iter()
                .map(|&t| u64::from(t) << (8 * (size - 1)))
                .collect();
            for (k, pair) in rest.chunks_exact(2 * half).take(size - 1).enumerate() {
                let shift = 8 * (size - 2 - k);
                let (hi_nib, lo_nib) = pair.split_at(half);
                for (i, v) in rotated.iter_mut().enumerate() {
                    let (h, l) = (hi_nib[i / 2], lo_nib[i / 2]);
                    let byte = if i % 2 == 0 {
                        (h << 4) | (l & 0x0f)
                    } else {
                        (h & 0xf0) | (l >> 4)
                    };
                    *v |= u64::from(byte) << shift;
                }
            }
            for (o, &v) in out.chunks_exact_mut(size).zip(&rotated) {
                let v = rotr1(v, size);
                o.copy_from_slice(&v.to_le_bytes()[..size]);
            }
        }
    }
}

/// High nibbles of two bytes in one: the first element's in the low half.
fn nibbles_high(a: u8, b: u8) -> u8 {
    (a >> 4) | (b & 0xf0)
}

/// Low nibbles of two bytes in one: the first element's in the low half.
fn nibbles_low(a: u8, b: u8) -> u8 {
    (a & 0x0f) | (b << 4)
}

fn le_value(c: &[u8]) -> u64 {
    c.iter()
        .rev()
        .fold(0u64, |acc, &b| (acc << 8) | u64::from(b))
}

fn rotl1(v: u64, size: usize) -> u64 {
    let bits = 8 * size;
    let mask = if bits == 64 {
        u64::MAX
    } else {
        (1 << bits) - 1
    };
    ((v << 1) | (v >> (bits - 1))) & mask
}

fn rotr1(v: u64, size: usize) -> u64 {
    let bits = 8 * size;
    (v >> 1) | ((v & 1) << (bits - 1))
}

#[cfg(test)]
mod tests {
    use super::super::testdata::random_bytes;
    use super::*;

    /// The bf16 planes element by element, as docs/FORMAT.md defines them.
    fn bf16_planes_by_the_definition(data: &[u8]) -> Vec<u8> {
        let n = data.len() / 2;
        let half = n.div_ceil(2);
        let mut planes = vec![0u8; n + 2 * half];
        for (i, c) in data.chunks_exact(2).enumerate() {
            let r = u16::from_le_bytes([c[0], c[1]]).rotate_left(1);
            let low = r as u8;
            planes[i] = (r >> 8) as u8;
            let (hi, lo) = if i % 2 == 0 {
                (low >> 4, low & 0x0f)
            } else {
                (low & 0xf0, low << 4)
            };
            planes[n + i / 2] |= hi;
            planes[n + half + i / 2] |= lo;
        }
        planes
    }

    #[test]
    fn bf16_planes_match_the_element_by_element_definition() {
        for n in (0..40).chain([1000, 1001, 4099]) {
            let data = random_bytes(2 * n);
            let mut planes = Vec::new();
            to_planes(&data, 2, &mut planes);
            assert_eq!(planes, bf16_planes_by_the_definition(&data), "n {n}");
            let mut back = vec![0u8; data.len()];
            from_planes(&planes, 2, &mut back);
            assert_eq!(back, data, "n {n}");
        }
    }

    #[test]
    fn bf16_top_plane_is_the_exponent() {
        // 1.0 = 0x3f80 (exponent 127), -2.0 = 0xc000 (exponent 128, sign set).
        let mut planes = vec![];
        to_planes(&[0x80, 0x3f, 0x00, 0xc0], 2, &mut planes);
        assert_eq!(&planes[..2], &[127, 128]);
        // Low bytes after rotation: 0x00 for 1.0, 0x01 (the sign) for -2.0.
        assert_eq!(planes[2], 0x00);
        assert_eq!(planes[3], 0x10);
    }

    #[test]
    fn f32_top_plane_is_the_exponent() {
        let mut planes = vec![];
        let data: Vec<u8> = [1.0f32, -0.5]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        to_planes(&data, 4, &mut planes);
        assert_eq!(&planes[..2], &[127, 126]);
    }
}
