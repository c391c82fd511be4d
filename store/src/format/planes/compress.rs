//! One plane into one zstd frame: this thread's compressors, made with the parameters that suit
//! byte planes, and the probe that sends a plane with nothing to gain to the fast one.
use std::cell::RefCell;

use zstd::zstd_safe;

use super::error::PlaneError;

/// zstd's longest minimum match length (see the module comment).
const MIN_MATCH: u32 = 7;

/// Bits of zstd's match-finder hash table (level 1 uses 13 on large inputs). A table of 256
/// entries finds the few long matches byte planes have and stops chasing short ones, whose
/// literals Huffman codes better: on activation-like exponent planes the ratio rises from
/// 2.77 to 3.07 and compression and decompression both run faster (docs/PERFORMANCE.md).
const HASH_LOG: u32 = 8;

thread_local! {
    static CCTX: RefCell<Option<(CompressorKey, zstd::bulk::Compressor<'static>)>> = const { RefCell::new(None) };
    static FAST_CCTX: RefCell<Option<(CompressorKey, zstd::bulk::Compressor<'static>)>> = const { RefCell::new(None) };
}

/// What a cached compressor was made for: its level, whether frames carry zstd's checksum, and
/// whether literals are entropy coded whatever the level.
type CompressorKey = (i32, bool, bool);

/// Bytes of a plane compressed first, to judge whether the whole plane is worth entropy coding.
const PROBE: usize = 64 << 10;

/// A plane whose probe shrinks by less than this many 64ths is written at [`FAST_LEVEL`] (at
/// level 1 only). Random planes shrink by nothing; the nibble plane holding the
/// skewed lowest mantissa bit of real bf16 activations by ~1–2.5 %: at 1/64 a DeepSeek-V3-wide
/// capture on an H200 entropy coded it and lost 11 % of its throughput to save 0.4 % of its
/// bytes (docs/PERFORMANCE.md). Higher levels, asked for smaller files, code every plane.
const PROBE_GAIN: usize = 2;

/// The level for planes with nothing to gain: zstd's negative levels store literals raw and
/// skim for matches, ~3× the speed of level 1 on random bytes, which it also stores raw.
const FAST_LEVEL: i32 = -1;

/// Whether a probe of [`PROBE`] bytes that compressed to `compressed` bytes shrank enough to
/// entropy code its plane.
fn probe_gains(compressed: usize) -> bool {
    compressed + PROBE_GAIN * (PROBE / 64) <= PROBE
}

/// Run `f` with this thread's compressor in `slot`, made anew when `key` changed.
fn with_compressor<T>(
    slot: &'static std::thread::LocalKey<
        RefCell<Option<(CompressorKey, zstd::bulk::Compressor<'static>)>>,
    >,
    key: CompressorKey,
    f: impl FnOnce(&mut zstd::bulk::Compressor<'static>) -> Result<T, PlaneError>,
) -> Result<T, PlaneError> {
    let zerr = |e: std::io::Error| PlaneError::Zstd(e.to_string());
    slot.with_borrow_mut(|slot| {
        if slot.as_ref().is_none_or(|(k, _)| *k != key) {
            let mut c = zstd::bulk::Compressor::new(key.0).map_err(zerr)?;
            c.set_parameter(zstd::zstd_safe::CParameter::MinMatch(MIN_MATCH))
                .map_err(zerr)?;
            c.set_parameter(zstd::zstd_safe::CParameter::HashLog(HASH_LOG))
                .map_err(zerr)?;
            c.include_checksum(key.1).map_err(zerr)?;
            if key.2 {
                c.set_parameter(zstd::zstd_safe::CParameter::LiteralCompressionMode(
                    zstd::zstd_safe::ParamSwitch::Enable,
                ))
                .map_err(zerr)?;
            }
            *slot = Some((key, c));
        }
        f(&mut slot.as_mut().expect("compressor just set").1)
    })
}

/// Append `plane` to `out` as one zstd frame; returns the frame's length. At level 1 (the
/// default) planes of random bytes (the low mantissa nibbles of most activations) are spotted
/// by compressing their first [`PROBE`] bytes and then go through the fast compressor: zstd
/// spent its time building Huffman tables it then threw away. The other planes are coded at
/// [`FAST_LEVEL`] too, with Huffman-coded literals switched back on: on exponent planes level
/// 1's closer search for matches found nothing the literals do not code as well, and took a
/// fifth of the time (docs/PERFORMANCE.md).
pub(super) fn append_frame(
    plane: &[u8],
    level: i32,
    zstd_sums: bool,
    out: &mut Vec<u8>,
) -> Result<usize, PlaneError> {
    let zerr = |e: std::io::Error| PlaneError::Zstd(e.to_string());
    let mark = out.len();
    out.reserve(zstd_safe::compress_bound(plane.len()));
    let mut compress = |c: &mut zstd::bulk::Compressor<'static>, part: &[u8]| {
        out.truncate(mark);
        let mut end = std::io::Cursor::new(&mut *out);
        end.set_position(mark as u64);
        c.compress_to_buffer(part, &mut end).map_err(zerr)
    };
    let coded = if level == 1 {
        (FAST_LEVEL, zstd_sums, true)
    } else {
        (level, zstd_sums, false)
    };
    let worth_it = level != 1
        || plane.len() < 2 * PROBE
        || with_compressor(&CCTX, coded, |c| {
            Ok(probe_gains(compress(c, &plane[..PROBE])?))
        })?;
    if worth_it {
        with_compressor(&CCTX, coded, |c| compress(c, plane))
    } else {
        with_compressor(&FAST_CCTX, (FAST_LEVEL, zstd_sums, false), |c| {
            compress(c, plane)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::testdata::random_bytes;
    use super::*;

    /// The frame `append_frame` writes for `plane` at level 1, and the one level 1's entropy
    /// coding (`coded`) or its fast compressor writes for it directly.
    fn frame_and_direct(plane: &[u8], coded: bool) -> (Vec<u8>, Vec<u8>) {
        let mut framed = Vec::new();
        append_frame(plane, 1, false, &mut framed).unwrap();
        let slot = if coded { &CCTX } else { &FAST_CCTX };
        let direct = with_compressor(slot, (FAST_LEVEL, false, coded), |c| {
            Ok(c.compress(plane).unwrap())
        })
        .unwrap();
        (framed, direct)
    }

    /// Whether the probe of `plane` sends it to entropy coding at level 1.
    fn probed(plane: &[u8]) -> bool {
        let probe = with_compressor(&CCTX, (FAST_LEVEL, false, true), |c| {
            Ok(c.compress(&plane[..PROBE]).unwrap())
        });
        probe_gains(probe.unwrap().len())
    }

    #[test]
    fn random_planes_skip_entropy_coding_and_skewed_ones_keep_it() {
        let random = random_bytes(4 * PROBE);
        assert!(!probed(&random));
        let (framed, fast) = frame_and_direct(&random, false);
        assert_eq!(
            framed, fast,
            "a random plane goes through the fast compressor"
        );
        // Exponent-like bytes: a handful of values, most of them one of three.
        let skewed: Vec<u8> = random.iter().map(|&b| 120 + (b % 7).min(b % 3)).collect();
        // The probe decides: a plane random in its first PROBE bytes and skewed after them is
        // written fast, though entropy coding would have shrunk it.
        let mixed = [&random[..PROBE], &skewed[PROBE..]].concat();
        let (framed, fast) = frame_and_direct(&mixed, false);
        assert_eq!(framed, fast);
        let (_, normal) = frame_and_direct(&mixed, true);
        assert!(
            normal.len() < framed.len() * 3 / 4,
            "{} against {}",
            normal.len(),
            framed.len()
        );
        // Above level 1 no plane is probed: smaller files were asked for.
        let mut at_three = Vec::new();
        append_frame(&mixed, 3, false, &mut at_three).unwrap();
        assert!(at_three.len() < framed.len() * 3 / 4);
        assert!(probed(&skewed));
        let (framed, normal) = frame_and_direct(&skewed, true);
        assert_eq!(
            framed, normal,
            "a skewed plane is entropy coded at the given level"
        );
        assert!(
            framed.len() < skewed.len() / 2,
            "{} of {}",
            framed.len(),
            skewed.len()
        );
        let back = zstd::bulk::decompress(&framed, skewed.len()).unwrap();
        assert_eq!(back, skewed);
        // Like real bf16 activations' low nibble plane: random but for the lowest mantissa bit
        // of each of its two elements, here set two times in ten (~7 % to gain).
        let nibbles: Vec<u8> = random_bytes(8 * PROBE)
            .chunks_exact(2)
            .map(|p| (p[0] & 0xee) | u8::from(p[1] % 10 < 2) | u8::from(p[1] / 10 % 10 < 2) << 4)
            .collect();
        assert!(probed(&nibbles));
        let (framed, normal) = frame_and_direct(&nibbles, true);
        assert_eq!(
            framed, normal,
            "a plane with a skewed bit keeps its entropy coding"
        );
        assert!(
            framed.len() < nibbles.len() * 63 / 64,
            "{} of {}",
            framed.len(),
            nibbles.len()
        );
    }
}
