//! A small, fixed pseudo-random generator so that shuffles are identical on every machine,
//! every platform and every build: SplitMix64 (Steele, Lea, Flood 2014) for the stream and
//! Lemire's multiply-shift rejection method for unbiased bounded draws.
//!
//! Nothing here depends on hashing state, the standard library's randomness or pointer width.

/// A deterministic stream of 64-bit values.
#[derive(Debug, Clone)]
pub(crate) struct SplitMix64 {
    state: u64,
}

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// The SplitMix64 output function: a strong 64-bit mixer.
#[inline]
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl SplitMix64 {
    /// A stream keyed by several words (seed, epoch, purpose, index...); each word is mixed
    /// in turn so that nearby keys give unrelated streams.
    pub(crate) fn keyed(words: &[u64]) -> Self {
        let mut s = 0x6873_6c61_6b65_u64; // "hslake"
        for &w in words {
            s = mix(s ^ mix(w.wrapping_add(GOLDEN)));
        }
        SplitMix64 { state: s }
    }

    /// The next value.
    #[inline]
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN);
        mix(self.state)
    }

    /// A uniform value in `0..n` (n > 0), without modulo bias.
    #[inline]
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        debug_assert!(n > 0);
        let threshold = n.wrapping_neg() % n;
        loop {
            let m = (self.next_u64() as u128) * (n as u128);
            if (m as u64) >= threshold {
                return (m >> 64) as u64;
            }
        }
    }

    /// Shuffle in place (Fisher-Yates, from the back).
    pub(crate) fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_is_fixed_across_builds() {
        // SplitMix64 seeded with 0 has published outputs; our keyed start differs, so pin the
        // raw generator against the reference sequence by setting the state directly.
        let mut r = SplitMix64 { state: 0 };
        assert_eq!(r.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(r.next_u64(), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(r.next_u64(), 0x06c4_5d18_8009_454f);
    }

    #[test]
    fn different_keys_give_different_shuffles() {
        let base: Vec<u32> = (0..50).collect();
        let mut a = base.clone();
        let mut b = base.clone();
        SplitMix64::keyed(&[1, 0]).shuffle(&mut a);
        SplitMix64::keyed(&[1, 1]).shuffle(&mut b);
        assert_ne!(a, b);
        assert_ne!(a, base);
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, base, "a shuffle is a permutation");
    }

    #[test]
    fn same_key_gives_the_same_shuffle() {
        let mut a: Vec<u32> = (0..1000).collect();
        let mut b = a.clone();
        SplitMix64::keyed(&[42, 3, 7]).shuffle(&mut a);
        SplitMix64::keyed(&[42, 3, 7]).shuffle(&mut b);
        assert_eq!(a, b);
    }

    #[test]
    fn bounded_draws_cover_the_range_evenly() {
        let mut r = SplitMix64::keyed(&[9]);
        let mut counts = [0u32; 6];
        for _ in 0..60_000 {
            counts[r.below(6) as usize] += 1;
        }
        for c in counts {
            assert!((9_000..11_000).contains(&c), "{counts:?}");
        }
    }
}
