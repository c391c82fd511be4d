//! One value's bytes: a header of frame lengths, one zstd frame per plane, and the trailing
//! checksum; encoding a value, and the checked decoding that `format::decode` is built on.
use std::cell::RefCell;

use zstd::zstd_safe;

use super::checksum::{Checksums, ValueChecksum, CHECKSUM_FLAG, CHECKSUM_META_KEY, TRAILER};
use super::compress::append_frame;
use super::error::PlaneError;
use super::transform::{from_planes, plane_count, plane_lens, to_planes};

thread_local! {
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    static DCTX: RefCell<Option<zstd::bulk::Decompressor<'static>>> = const { RefCell::new(None) };
}

/// Encode `data` (little-endian elements of `size` bytes) at zstd `level`: a little-endian u32
/// compressed length per plane, then the planes' zstd frames in order, then the checksum of
/// `checksum`'s kind where it is a trailer (with [`ValueChecksum::ZstdXxh64`] each frame carries
/// zstd's content checksum instead; with `None`, nothing).
pub fn encode(
    data: &[u8],
    size: usize,
    level: i32,
    checksum: Option<ValueChecksum>,
) -> Result<Vec<u8>, PlaneError> {
    SCRATCH.with_borrow_mut(|planes| {
        to_planes(data, size, planes);
        encode_planes(planes, size, level, checksum)
    })
}

/// [`encode`] for elements already split: `planes` is what [`to_planes`] makes of
/// `planes.len() / size` elements of `size` bytes (a capture splits them on the GPU).
pub fn encode_planes(
    planes: &[u8],
    size: usize,
    level: i32,
    checksum: Option<ValueChecksum>,
) -> Result<Vec<u8>, PlaneError> {
    let zstd_sums = checksum == Some(ValueChecksum::ZstdXxh64);
    let n = planes.len() / size;
    let lens: Vec<usize> = plane_lens(size, n).collect();
    let expected: usize = lens.iter().sum();
    if planes.len() != expected {
        return Err(PlaneError::SplitLength {
            found: planes.len(),
            expected,
            elements: n,
        });
    }
    let header = 4 * lens.len();
    let bound: usize = lens.iter().map(|&l| zstd_safe::compress_bound(l)).sum();
    // Room for the worst case, but not zeroed: the frames are written into the spare
    // capacity, so only the ~70 % they fill is ever touched (and faulted in).
    let mut out = Vec::with_capacity(header + bound + TRAILER);
    out.resize(header, 0);
    let mut start = 0;
    for (i, &len) in lens.iter().enumerate() {
        let written = append_frame(&planes[start..start + len], level, zstd_sums, &mut out)?;
        out[4 * i..4 * i + 4].copy_from_slice(&(written as u32).to_le_bytes());
        start += len;
    }
    if let Some(sum) = checksum.and_then(|k| k.checksum(&out)) {
        out.extend_from_slice(&sum.to_le_bytes());
    }
    Ok(out)
}

/// Number of elements in an encoded value (from the first frame's content size). Its trailing
/// checksum is not computed (the header alone is read): [`check_trailer`] does that.
pub(crate) fn element_count(
    value: &[u8],
    size: usize,
    checks: Checksums,
) -> Result<usize, PlaneError> {
    content_size(frames(value, size, checks)?.0[0])
}

/// Check a value's trailing checksum, where `checks` requires one or the value has one,
/// without decoding anything.
pub(crate) fn check_trailer(
    value: &[u8],
    size: usize,
    checks: Checksums,
) -> Result<(), PlaneError> {
    let (body, kind) = split_trailer(value, size, checks)?;
    check_sum(value, body, kind)
}

/// The content size a frame records. A zstd block holds at most 128 KiB and takes at least
/// 4 bytes (an RLE block), so a claim beyond 32 Ki times the frame's length is corrupt, and is
/// refused before anything is allocated for it.
fn content_size(frame: &[u8]) -> Result<usize, PlaneError> {
    let bad = |detail: String| PlaneError::BadPlane { plane: 0, detail };
    match zstd_safe::get_frame_content_size(frame) {
        Ok(Some(n)) if n <= frame.len() as u64 * 32768 => Ok(n as usize),
        Ok(Some(n)) => Err(bad(format!(
            "a frame of {} bytes claims {n} bytes of content",
            frame.len()
        ))),
        Ok(None) => Err(bad("zstd frame does not record its content size".into())),
        Err(_) => Err(bad("not a zstd frame".into())),
    }
}

/// Where the frames of a value end, by its header of frame lengths (`None`: the header does
/// not fit, or its lengths overflow).
fn frames_end(value: &[u8], count: usize) -> Option<usize> {
    let header = value.get(..4 * count)?;
    header.chunks_exact(4).try_fold(4 * count, |end, l| {
        end.checked_add(u32::from_le_bytes(l.try_into().expect("4 bytes")) as usize)
    })
}

/// A value's header and frames, and the kind of checksum stored after them, if any. A value of
/// a declaring file must have room for its trailer; elsewhere a value has one when its frames
/// end exactly [`TRAILER`] bytes before it does (a corrupt header that lands there is caught by
/// the checksum itself).
fn split_trailer(
    value: &[u8],
    size: usize,
    checks: Checksums,
) -> Result<(&[u8], Option<ValueChecksum>), PlaneError> {
    match checks {
        Checksums::Declared(kind) if kind.has_trailer() => match value.len().checked_sub(TRAILER) {
            Some(end) => Ok((&value[..end], Some(kind))),
            None => Err(PlaneError::Truncated {
                len: value.len(),
                detail: format!("no room for its {TRAILER}-byte {kind} checksum"),
            }),
        },
        Checksums::Declared(_) => Ok((value, None)),
        Checksums::IfPresent => match frames_end(value, plane_count(size)) {
            Some(end) if end.checked_add(TRAILER) == Some(value.len()) => {
                Ok((&value[..end], Some(ValueChecksum::DEFAULT)))
            }
            _ => Ok((value, None)),
        },
    }
}

/// Compare the checksum stored after `body` in `value` with the one computed over `body`.
fn check_sum(value: &[u8], body: &[u8], kind: Option<ValueChecksum>) -> Result<(), PlaneError> {
    match (kind, kind.and_then(|k| k.running())) {
        (Some(kind), Some(mut sum)) => {
            sum.update(body);
            compare(value, kind, sum.finalize())
        }
        _ => Ok(()),
    }
}

/// Compare a value's trailing checksum of `kind` with `found`, computed over the bytes before it.
fn compare(value: &[u8], kind: ValueChecksum, found: u32) -> Result<(), PlaneError> {
    let tail = &value[value.len() - TRAILER..];
    let stored = u32::from_le_bytes(tail.try_into().expect("4-byte trailer"));
    if found != stored {
        return Err(PlaneError::Trailer {
            kind,
            found,
            stored,
        });
    }
    Ok(())
}

/// `decode` run on `value`, with any error it fails with replaced by the value's trailing
/// checksum error where that fails too: a corrupt value is reported as corrupt, whichever check
/// met the corruption first. The checksum is computed again only on failure.
fn checked<T>(
    value: &[u8],
    size: usize,
    checks: Checksums,
    decode: impl FnOnce() -> Result<T, PlaneError>,
) -> Result<T, PlaneError> {
    decode().map_err(|e| match e {
        e @ PlaneError::Trailer { .. } => e,
        e => match check_trailer(value, size, checks) {
            Err(corrupt @ PlaneError::Trailer { .. }) => corrupt,
            _ => e,
        },
    })
}

/// The frames of a value, checked against its header and, where `checks` requires it, each
/// carrying a content checksum, and the kind of its trailing checksum, if it has one (not yet
/// computed: [`decode_frames`] does that while it decompresses).
fn frames(
    value: &[u8],
    size: usize,
    checks: Checksums,
) -> Result<(Vec<&[u8]>, Option<ValueChecksum>), PlaneError> {
    let (body, trailer) = split_trailer(value, size, checks)?;
    let count = plane_count(size);
    let header = 4 * count;
    let short = |detail: String| PlaneError::Truncated {
        len: value.len(),
        detail,
    };
    if body.len() < header {
        return Err(short(format!(
            "a header of {count} frame lengths needs {header} bytes"
        )));
    }
    let mut out = Vec::with_capacity(count);
    let mut pos = header;
    for i in 0..count {
        let len = u32::from_le_bytes(body[4 * i..4 * i + 4].try_into().expect("4 bytes")) as usize;
        let end = pos
            .checked_add(len)
            .filter(|&e| e <= body.len())
            .ok_or_else(|| short(format!("frame {i} of {len} bytes at offset {pos}")))?;
        let frame = &body[pos..end];
        // Byte 4 is the frame header descriptor, after the 4-byte magic number (a frame too
        // short to have one is refused by `content_size` or zstd).
        if checks == Checksums::Declared(ValueChecksum::ZstdXxh64)
            && frame.get(4).is_some_and(|d| d & CHECKSUM_FLAG == 0)
        {
            return Err(PlaneError::Checksum {
                plane: i,
                detail: format!(
                    "frame has no content checksum, but its file declares {CHECKSUM_META_KEY} = \
                     {} (a cleared checksum flag is corruption)",
                    ValueChecksum::ZstdXxh64
                ),
            });
        }
        out.push(frame);
        pos = end;
    }
    if pos != body.len() {
        return Err(PlaneError::BadPlane {
            plane: count - 1,
            detail: format!("{} bytes after the last frame", body.len() - pos),
        });
    }
    Ok((out, trailer))
}

/// Decode a value into `out`, which must hold exactly the expected elements of `size` bytes.
pub(crate) fn decode_into(
    value: &[u8],
    size: usize,
    checks: Checksums,
    out: &mut [u8],
) -> Result<(), PlaneError> {
    checked(value, size, checks, || {
        let (frames, trailer) = frames(value, size, checks)?;
        let n = out.len() / size;
        let found = content_size(frames[0])?;
        if found != n {
            return Err(PlaneError::WrongLength { found, expected: n });
        }
        decode_frames(value, &frames, trailer, size, out)
    })
}

/// Decode a value that must hold `n` elements into `out`, resized to fit only once the
/// value's own header agrees: a corrupt claim is refused before anything is allocated for it.
pub(crate) fn decode_to_vec(
    value: &[u8],
    size: usize,
    n: usize,
    checks: Checksums,
    out: &mut Vec<u8>,
) -> Result<(), PlaneError> {
    checked(value, size, checks, || {
        let (frames, trailer) = frames(value, size, checks)?;
        let found = content_size(frames[0])?;
        if found != n {
            return Err(PlaneError::WrongLength { found, expected: n });
        }
        out.clear();
        out.resize(n * size, 0);
        decode_frames(value, &frames, trailer, size, out)
    })
}

/// Decode a value whose element count is not known beforehand: its header is trusted as far
/// as a frame of its length can hold it. Readers that know the row's length use
/// [`decode_to_vec`].
pub(crate) fn decode(value: &[u8], size: usize, checks: Checksums) -> Result<Vec<u8>, PlaneError> {
    checked(value, size, checks, || {
        let (frames, trailer) = frames(value, size, checks)?;
        let mut out = vec![0u8; content_size(frames[0])? * size];
        decode_frames(value, &frames, trailer, size, &mut out)?;
        Ok(out)
    })
}

/// Decompress checked frames of `value` into the planes and rebuild `out.len() / size`
/// elements. A `trailer` checksum is computed over the header and then each frame just before
/// zstd reads it, so that zstd finds the frame in cache (one pass over the value first and
/// another to decompress it cost more); it is compared before anything is rebuilt.
fn decode_frames(
    value: &[u8],
    frames: &[&[u8]],
    trailer: Option<ValueChecksum>,
    size: usize,
    out: &mut [u8],
) -> Result<(), PlaneError> {
    let n = out.len() / size;
    let mut sum = trailer.and_then(|k| Some((k, k.running()?)));
    if let Some((_, s)) = &mut sum {
        s.update(&value[..4 * frames.len()]);
    }
    SCRATCH.with_borrow_mut(|planes| {
        let lens: Vec<usize> = plane_lens(size, n).collect();
        planes.clear();
        planes.resize(lens.iter().sum(), 0);
        DCTX.with_borrow_mut(|slot| {
            if slot.is_none() {
                *slot = Some(
                    zstd::bulk::Decompressor::new().map_err(|e| PlaneError::Zstd(e.to_string()))?,
                );
            }
            let d = slot.as_mut().expect("decompressor just set");
            let mut start = 0;
            for (i, (frame, &len)) in frames.iter().zip(&lens).enumerate() {
                if let Some((_, s)) = &mut sum {
                    s.update(frame);
                }
                let bad = |detail: String| PlaneError::BadPlane { plane: i, detail };
                let got = d
                    .decompress_to_buffer(frame, &mut planes[start..start + len])
                    .map_err(|e| {
                        // zstd checks a frame's content checksum itself; its error is the one
                        // worth telling apart (the frame decoded, to the wrong bytes).
                        if e.to_string().contains("checksum") {
                            PlaneError::Checksum {
                                plane: i,
                                detail: format!("content differs from the frame's checksum ({e})"),
                            }
                        } else {
                            bad(format!("zstd: {e}"))
                        }
                    })?;
                if got != len {
                    return Err(bad(format!("decompressed to {got} bytes, expected {len}")));
                }
                start += len;
            }
            Ok(())
        })?;
        if let Some((kind, s)) = sum {
            compare(value, kind, s.finalize())?;
        }
        from_planes(planes, size, out);
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::super::testdata::random_bytes;
    use super::*;

    const XXH: Checksums = Checksums::Declared(ValueChecksum::ZstdXxh64);
    const CRC: Checksums = Checksums::Declared(ValueChecksum::Crc32);
    const SUMMED: Option<ValueChecksum> = Some(ValueChecksum::DEFAULT);

    fn sample_bytes(n: usize, size: usize) -> Vec<u8> {
        (0..n * size)
            .map(|i| (i.wrapping_mul(2654435761) >> 7) as u8)
            .collect()
    }

    #[test]
    fn round_trips_every_width_and_odd_lengths() {
        for size in [1usize, 2, 4] {
            for n in [0usize, 1, 2, 3, 7, 1000, 1001] {
                let data = sample_bytes(n, size);
                let enc = encode(&data, size, 1, SUMMED).unwrap();
                assert_eq!(element_count(&enc, size, CRC).unwrap(), n);
                let mut back = vec![0u8; data.len()];
                decode_into(&enc, size, CRC, &mut back).unwrap();
                assert_eq!(back, data, "size {size}, n {n}");
                assert_eq!(decode(&enc, size, CRC).unwrap(), data);
            }
        }
    }

    #[test]
    fn rejects_a_value_of_the_wrong_element_count() {
        let enc = encode(&sample_bytes(10, 2), 2, 1, SUMMED).unwrap();
        let mut out = vec![0u8; 22];
        assert_eq!(
            decode_into(&enc, 2, CRC, &mut out),
            Err(PlaneError::WrongLength {
                found: 10,
                expected: 11
            })
        );
    }

    #[test]
    fn rejects_truncated_and_garbled_values() {
        // Without a checksum the frames themselves give it away.
        let enc = encode(&sample_bytes(100, 2), 2, 1, None).unwrap();
        let mut out = vec![0u8; 200];
        let none = Checksums::IfPresent;
        assert!(matches!(
            decode_into(&enc[..enc.len() - 1], 2, none, &mut out),
            Err(PlaneError::Truncated { .. })
        ));
        assert!(matches!(
            decode_into(&enc[..5], 2, none, &mut out),
            Err(PlaneError::Truncated { .. })
        ));
        let mut garbled = enc.clone();
        garbled[12] ^= 0xff; // first byte of the first frame: the zstd magic number
        assert!(matches!(
            decode_into(&garbled, 2, none, &mut out),
            Err(PlaneError::BadPlane { plane: 0, .. })
        ));
        // With one, the checksum does, before any frame is parsed.
        let enc = encode(&sample_bytes(100, 2), 2, 1, SUMMED).unwrap();
        let mut garbled = enc.clone();
        garbled[12] ^= 0xff;
        for bad in [&enc[..enc.len() - 1], &enc[..5], &garbled] {
            assert!(matches!(
                decode_into(bad, 2, CRC, &mut out),
                Err(PlaneError::Trailer { .. })
            ));
        }
        assert!(matches!(
            decode_into(&enc[..3], 2, CRC, &mut out),
            Err(PlaneError::Truncated { .. })
        ));
    }

    #[test]
    fn decode_to_vec_refuses_a_claim_other_than_the_expected_count_before_allocating() {
        let enc = encode(&sample_bytes(10, 2), 2, 1, SUMMED).unwrap();
        let mut out = Vec::new();
        assert_eq!(
            decode_to_vec(&enc, 2, 11, CRC, &mut out),
            Err(PlaneError::WrongLength {
                found: 10,
                expected: 11
            })
        );
        assert_eq!(out.capacity(), 0, "nothing allocated for a refused value");
        decode_to_vec(&enc, 2, 10, CRC, &mut out).unwrap();
        assert_eq!(out, sample_bytes(10, 2));
    }

    #[test]
    fn activation_like_bf16_compresses_below_raw() {
        // Gaussian-ish values at a few scales: the exponent plane must shrink.
        let vals: Vec<u8> = (0..4096u32)
            .flat_map(|i| {
                let x = ((i.wrapping_mul(2654435761) >> 16) as f32 / 65536.0 - 0.5) * 4.0;
                let bits = (x.to_bits() >> 16) as u16;
                bits.to_le_bytes()
            })
            .collect();
        let enc = encode(&vals, 2, 1, SUMMED).unwrap();
        assert!(
            enc.len() < vals.len() * 9 / 10,
            "{} of {}",
            enc.len(),
            vals.len()
        );
    }

    #[test]
    fn refuses_a_content_size_no_frame_of_its_length_can_hold() {
        // A valid header over a 13-byte first frame that claims 2^40 bytes of content.
        let mut frame = vec![0x28, 0xb5, 0x2f, 0xfd, 0xc0];
        frame.extend_from_slice(&(1u64 << 40).to_le_bytes());
        frame.extend_from_slice(&[0x01, 0x00, 0x00]); // an empty last raw block
        let mut value = (frame.len() as u32).to_le_bytes().to_vec();
        value.extend_from_slice(&frame);
        let err = decode(&value, 1, Checksums::IfPresent).unwrap_err();
        assert!(
            matches!(&err, PlaneError::BadPlane { plane: 0, detail } if detail.contains("claims")),
            "{err}"
        );
    }

    /// Offsets of each frame in an encoded value (after its header of frame lengths).
    fn frame_starts(value: &[u8], size: usize) -> Vec<(usize, usize)> {
        let count = plane_count(size);
        let mut pos = 4 * count;
        (0..count)
            .map(|i| {
                let len = u32::from_le_bytes(value[4 * i..4 * i + 4].try_into().unwrap()) as usize;
                pos += len;
                (pos - len, len)
            })
            .collect()
    }

    #[test]
    fn a_flip_that_still_decodes_is_caught_by_either_checksum() {
        // Random bytes: zstd stores the low nibble plane as a raw block, so a flipped byte in
        // it decompresses without complaint; only the checksum tells.
        let data = random_bytes(8192);
        let mut plain = encode(&data, 2, 1, None).unwrap();
        let (start, len) = frame_starts(&plain, 2)[2];
        plain[start + len / 2] ^= 0x10;
        let silently_wrong = decode(&plain, 2, Checksums::IfPresent).unwrap();
        assert_ne!(
            silently_wrong, data,
            "without a checksum the flip goes unnoticed"
        );

        // Format 2: zstd's frame checksum, checked while decompressing.
        let mut summed = encode(&data, 2, 1, Some(ValueChecksum::ZstdXxh64)).unwrap();
        let (start, len) = frame_starts(&summed, 2)[2];
        summed[start + len / 2] ^= 0x10;
        for checks in [Checksums::IfPresent, XXH] {
            let err = decode(&summed, 2, checks).unwrap_err();
            assert!(
                matches!(&err, PlaneError::Checksum { plane: 2, detail } if detail.contains("checksum")),
                "{err}"
            );
        }

        // Format 3: the CRC-32 after the last frame, also where the value is seen apart from
        // its file.
        let mut summed = encode(&data, 2, 1, SUMMED).unwrap();
        let (start, len) = frame_starts(&summed, 2)[2];
        summed[start + len / 2] ^= 0x10;
        for checks in [Checksums::IfPresent, CRC] {
            let err = decode(&summed, 2, checks).unwrap_err();
            assert!(
                matches!(
                    err,
                    PlaneError::Trailer {
                        kind: ValueChecksum::Crc32,
                        ..
                    }
                ),
                "{err}"
            );
            assert!(check_trailer(&summed, 2, checks).is_err());
            // The header alone still reads: the element count does not compute the checksum.
            assert_eq!(element_count(&summed, 2, checks).unwrap(), 4096);
        }
    }

    #[test]
    fn every_flipped_bit_of_a_crc32_value_is_caught() {
        let data = sample_bytes(300, 2);
        let value = encode(&data, 2, 1, SUMMED).unwrap();
        assert_eq!(decode(&value, 2, CRC).unwrap(), data);
        for i in 0..value.len() {
            for bit in 0..8 {
                let mut bad = value.clone();
                bad[i] ^= 1 << bit;
                // In the header, the frames, or the trailer itself.
                assert!(decode(&bad, 2, CRC).is_err(), "byte {i} bit {bit}");
                assert!(check_trailer(&bad, 2, CRC).is_err(), "byte {i} bit {bit}");
            }
        }
    }

    #[test]
    fn a_cleared_checksum_flag_is_refused() {
        let data = sample_bytes(1000, 2);
        let mut value = encode(&data, 2, 1, Some(ValueChecksum::ZstdXxh64)).unwrap();
        let (start, _) = frame_starts(&value, 2)[1];
        assert_ne!(value[start + 4] & CHECKSUM_FLAG, 0);
        value[start + 4] &= !CHECKSUM_FLAG;
        // Where the file declares checksums, the missing flag itself is corruption.
        let err = decode(&value, 2, XXH).unwrap_err();
        assert!(
            matches!(&err, PlaneError::Checksum { plane: 1, detail } if detail.contains(CHECKSUM_META_KEY)),
            "{err}"
        );
        // Elsewhere the frame no longer ends where the value's header says (its four checksum
        // bytes are left over), which zstd refuses too.
        assert!(decode(&value, 2, Checksums::IfPresent).is_err());
    }

    #[test]
    fn values_without_checksums_still_read_unless_their_file_requires_them() {
        let data = sample_bytes(100, 4);
        let old = encode(&data, 4, 1, None).unwrap();
        assert_eq!(decode(&old, 4, Checksums::IfPresent).unwrap(), data);
        assert!(matches!(
            decode(&old, 4, XXH),
            Err(PlaneError::Checksum { plane: 0, .. })
        ));
        // A file declaring CRC-32 takes the last four bytes of the last frame for the
        // checksum, which they are not.
        assert!(matches!(
            decode(&old, 4, CRC),
            Err(PlaneError::Trailer { .. })
        ));
        // Format 2's values (zstd checksums) still read, in their files and in SQL.
        let xxh = encode(&data, 4, 1, Some(ValueChecksum::ZstdXxh64)).unwrap();
        assert_eq!(decode(&xxh, 4, XXH).unwrap(), data);
        assert_eq!(decode(&xxh, 4, Checksums::IfPresent).unwrap(), data);
        assert!(decode(&xxh, 4, CRC).is_err());
        // zstd's checksum costs four bytes per frame, the CRC four per value.
        assert_eq!(xxh.len(), old.len() + 4 * plane_count(4));
        let crc = encode(&data, 4, 1, SUMMED).unwrap();
        assert_eq!(crc.len(), old.len() + 4);
        assert_eq!(&crc[..old.len()], &old[..], "the same frames, then the CRC");
        assert_eq!(decode(&crc, 4, Checksums::IfPresent).unwrap(), data);
        assert!(matches!(
            decode(&crc, 4, XXH),
            Err(PlaneError::Checksum { plane: 0, .. })
        ));
    }

    #[test]
    fn the_trailer_is_the_crc32_of_the_bytes_before_it() {
        let value = encode(&sample_bytes(50, 2), 2, 1, SUMMED).unwrap();
        let (body, sum) = value.split_at(value.len() - 4);
        assert_eq!(
            u32::from_le_bytes(sum.try_into().unwrap()),
            crc32fast::hash(body)
        );
        // The standard check value of CRC-32/ISO-HDLC (zlib's `crc32(b"123456789")`).
        assert_eq!(
            ValueChecksum::Crc32.checksum(b"123456789"),
            Some(0xcbf4_3926)
        );
    }

    #[test]
    fn planes_split_elsewhere_encode_like_their_elements_and_a_wrong_length_is_named() {
        let data: Vec<u8> = random_bytes(2 * 1000);
        let mut planes = vec![];
        to_planes(&data, 2, &mut planes);
        assert_eq!(
            encode_planes(&planes, 2, 1, SUMMED).unwrap(),
            encode(&data, 2, 1, SUMMED).unwrap()
        );
        let err = encode_planes(&planes[..planes.len() - 2], 2, 1, SUMMED).unwrap_err();
        assert_eq!(
            err.to_string(),
            "split planes of 1998 bytes: 999 elements split into 1999 bytes"
        );
    }
}
