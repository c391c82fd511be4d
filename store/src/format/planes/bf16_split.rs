//! The bf16 plane split of [`super::transform::to_planes`] sixteen bytes at a time.
//!
//! Why: element by element the split ran at ~1.7 GB/s, a third of a capture writer's encoding
//! time; these SSE2 instructions (part of every x86-64 CPU, so no runtime check) do the same
//! work on 32 elements per step. The scalar loop in `to_planes` stays the definition and
//! handles the elements left over; a test holds both to docs/FORMAT.md's definition.

/// Split the leading multiple of 32 elements of `data` (little-endian bf16) into `top`, `hi`
/// and `lo` (the exponent plane and the two nibble planes); returns how many elements it did.
#[cfg(target_arch = "x86_64")]
pub(super) fn split_leading(data: &[u8], top: &mut [u8], hi: &mut [u8], lo: &mut [u8]) -> usize {
    use std::arch::x86_64::*;
    let steps = (data.len() / 64)
        .min(top.len() / 32)
        .min(hi.len() / 16)
        .min(lo.len() / 16);
    // SAFETY: SSE2 is part of the x86-64 baseline. Every load reads 16 bytes inside
    // `data[64 * s..64 * (s + 1)]` and every store writes 16 bytes inside `top[32 * s..]`,
    // `hi[16 * s..]` or `lo[16 * s..]`, all in bounds for `s < steps` by the minimum above;
    // the unaligned forms are used throughout.
    unsafe {
        let low_nibble = _mm_set1_epi32(0x0f);
        let high_nibble = _mm_set1_epi32(0xf0);
        for s in 0..steps {
            let src = data.as_ptr().add(64 * s) as *const __m128i;
            // Each u16 lane rotated left by one bit: the sign moves to bit 0.
            let r: [__m128i; 4] = std::array::from_fn(|k| {
                let x = _mm_loadu_si128(src.add(k));
                _mm_or_si128(_mm_slli_epi16(x, 1), _mm_srli_epi16(x, 15))
            });
            // Top bytes, in element order.
            let t0 = _mm_packus_epi16(_mm_srli_epi16(r[0], 8), _mm_srli_epi16(r[1], 8));
            let t1 = _mm_packus_epi16(_mm_srli_epi16(r[2], 8), _mm_srli_epi16(r[3], 8));
            _mm_storeu_si128(top.as_mut_ptr().add(32 * s) as *mut __m128i, t0);
            _mm_storeu_si128(top.as_mut_ptr().add(32 * s + 16) as *mut __m128i, t1);
            // Seen as u32 lanes, each holds a pair: v = a | b << 16 (a the even element).
            // hi = a >> 4 | b & 0xf0, lo = a & 0x0f | (b & 0x0f) << 4, each below 256.
            let h: [__m128i; 4] = std::array::from_fn(|k| {
                _mm_or_si128(
                    _mm_and_si128(_mm_srli_epi32(r[k], 4), low_nibble),
                    _mm_and_si128(_mm_srli_epi32(r[k], 16), high_nibble),
                )
            });
            let l: [__m128i; 4] = std::array::from_fn(|k| {
                _mm_or_si128(
                    _mm_and_si128(r[k], low_nibble),
                    _mm_and_si128(_mm_srli_epi32(r[k], 12), high_nibble),
                )
            });
            let pack = |v: &[__m128i; 4]| {
                _mm_packus_epi16(_mm_packs_epi32(v[0], v[1]), _mm_packs_epi32(v[2], v[3]))
            };
            _mm_storeu_si128(hi.as_mut_ptr().add(16 * s) as *mut __m128i, pack(&h));
            _mm_storeu_si128(lo.as_mut_ptr().add(16 * s) as *mut __m128i, pack(&l));
        }
    }
    32 * steps
}

/// Elsewhere the scalar loop does all of it.
#[cfg(not(target_arch = "x86_64"))]
pub(super) fn split_leading(_: &[u8], _: &mut [u8], _: &mut [u8], _: &mut [u8]) -> usize {
    0
}
