//! The `plane_zstd` encoding of one tensor value: every element rotated left by one bit, its
//! bytes split into planes (top byte whole, lower bytes as two nibble planes), each plane one
//! zstd frame. See docs/FORMAT.md for the byte-level description.
//!
//! Why this shape: in activations the information sits in the exponent. The rotation moves the
//! sign out of the top byte, so that byte is the whole exponent for bf16 and f32 (about 2.8 bits
//! of entropy). Mantissa bytes are nearly random; as whole bytes zstd stores them raw, but split
//! into nibble planes one of them compresses (in real bf16 activations the lowest mantissa bit
//! is measurably skewed). Each plane gets its own frame and zstd runs with its longest minimum
//! match: on byte planes of activations short LZ matches cost more than the Huffman-coded
//! literals they replace.
//!
//! Every value written carries a checksum that every read checks, so a flipped bit that still
//! decodes is caught by every reader, not only by `verify`. Since format version 3 it is the
//! CRC-32 (zlib's) of the value's compressed bytes, stored after its last frame
//! ([`ValueChecksum::Crc32`]): the compressed bytes are 70 % of the plane bytes, and CRC-32 with
//! carry-less multiplication runs at two to four times the speed of zstd's own content checksum
//! (XXH64 over the decompressed planes, format 2's [`ValueChecksum::ZstdXxh64`], still read) and
//! about twice that of CRC-32C with the SSE4.2 instruction (measured side by side:
//! docs/PERFORMANCE.md). A file whose values all carry a checksum
//! says which ([`CHECKSUM_META_KEY`]); its readers then refuse a value without one
//! ([`Checksums::Declared`]), so a flip that clears a frame's checksum flag or drops the
//! trailer cannot turn the check off.
use std::cell::RefCell;

use thiserror::Error;
use zstd::zstd_safe;

/// The encoding name stored in a tensor field's metadata.
pub const ENCODING: &str = hslake_schemas::TENSOR_ENCODING;

/// zstd's longest minimum match length (see the module comment).
const MIN_MATCH: u32 = 7;

/// Bits of zstd's match-finder hash table (level 1 uses 13 on large inputs). A table of 256
/// entries finds the few long matches byte planes have and stops chasing short ones, whose
/// literals Huffman codes better: on activation-like exponent planes the ratio rises from
/// 2.77 to 3.07 and compression and decompression both run faster (docs/PERFORMANCE.md).
const HASH_LOG: u32 = 8;

/// Parquet key-value (and so Arrow schema) metadata key by which a shard declares that every
/// tensor and scale value in it carries a checksum, and which ([`ValueChecksum::name`]).
pub const CHECKSUM_META_KEY: &str = "hslake.value_checksum";

/// The Content_Checksum_flag of a zstd frame header descriptor (RFC 8878, 3.1.1.1.1).
const CHECKSUM_FLAG: u8 = 1 << 2;

/// Bytes of a trailing value checksum.
const TRAILER: usize = 4;

/// A kind of value checksum, as a shard declares it under [`CHECKSUM_META_KEY`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueChecksum {
    /// Format 2: every zstd frame carries zstd's content checksum (the low 32 bits of XXH64 of
    /// the decompressed plane), which zstd checks while decompressing.
    ZstdXxh64,
    /// Format 3: the value ends with the CRC-32 (ISO-HDLC, as zlib, gzip and PNG compute it) of
    /// all its bytes before it (the header of frame lengths and the frames), a little-endian u32.
    Crc32,
}

impl ValueChecksum {
    /// What hslake writes unless told otherwise.
    pub const DEFAULT: ValueChecksum = ValueChecksum::Crc32;

    /// Every kind, in the order benchmarks report them.
    pub const ALL: [ValueChecksum; 2] = [ValueChecksum::ZstdXxh64, ValueChecksum::Crc32];

    /// The name a shard declares it by.
    pub const fn name(self) -> &'static str {
        match self {
            ValueChecksum::ZstdXxh64 => "zstd_xxh64",
            ValueChecksum::Crc32 => "crc32",
        }
    }

    /// The kind declared as `name`, if this build reads it.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }

    /// This kind's checksum of `bytes` (what a value's trailer holds over the bytes before
    /// it), or `None` for the kind that lives inside zstd frames.
    pub fn checksum(self, bytes: &[u8]) -> Option<u32> {
        let mut sum = self.running()?;
        sum.update(bytes);
        Some(sum.finalize())
    }

    /// A trailing checksum to compute piece by piece, or `None` (zstd checksums).
    fn running(self) -> Option<crc32fast::Hasher> {
        match self {
            ValueChecksum::ZstdXxh64 => None,
            ValueChecksum::Crc32 => Some(crc32fast::Hasher::new()),
        }
    }

    fn has_trailer(self) -> bool {
        self != ValueChecksum::ZstdXxh64
    }
}

impl std::fmt::Display for ValueChecksum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What a reader holds a value's checksum to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Checksums {
    /// Whatever the value carries is checked, and it may carry nothing: values of files that do
    /// not declare [`CHECKSUM_META_KEY`] (written without checksums), or values seen apart from
    /// their file (SQL). A value whose frames end exactly [`TRAILER`] bytes before its end has a
    /// [`ValueChecksum::DEFAULT`] trailer; frames with zstd's checksum flag are checked by zstd.
    #[default]
    IfPresent,
    /// Every value must carry this kind of checksum: its file declares it.
    Declared(ValueChecksum),
}

impl Checksums {
    /// The requirement a file's (Arrow schema or Parquet key-value) metadata declares; a
    /// declared kind this build does not know is refused, never read as no checksum.
    pub fn declared_by(
        metadata: &std::collections::HashMap<String, String>,
    ) -> Result<Self, String> {
        match metadata.get(CHECKSUM_META_KEY) {
            None => Ok(Checksums::IfPresent),
            Some(v) => ValueChecksum::from_name(v)
                .map(Checksums::Declared)
                .ok_or_else(|| {
                    let known: Vec<&str> = ValueChecksum::ALL.iter().map(|k| k.name()).collect();
                    format!(
                        "{CHECKSUM_META_KEY} = {v:?} is not a value checksum this build reads \
                         (expected one of {})",
                        known.join(", ")
                    )
                }),
        }
    }
}

/// Why a stored value cannot be decoded.
#[derive(Debug, Error, PartialEq)]
#[non_exhaustive]
pub enum PlaneError {
    /// The value is shorter than its own header or its frames.
    #[error("value of {len} bytes is too short: {detail}")]
    Truncated {
        /// Bytes in the value.
        len: usize,
        /// What was missing.
        detail: String,
    },
    /// A frame does not decompress to the plane length it must have.
    #[error("plane {plane}: {detail}")]
    BadPlane {
        /// Plane index (0 = top byte).
        plane: usize,
        /// What is wrong.
        detail: String,
    },
    /// The element count implied by the value differs from the one expected.
    #[error("value holds {found} elements, expected {expected}")]
    WrongLength {
        /// Elements found.
        found: usize,
        /// Elements expected.
        expected: usize,
    },
    /// A frame's content differs from its checksum, or a frame that must carry one does not.
    #[error("plane {plane}: {detail}")]
    Checksum {
        /// Plane index (0 = top byte).
        plane: usize,
        /// What is wrong.
        detail: String,
    },
    /// The value's trailing checksum differs from the one computed over its bytes.
    #[error("{kind} of the value is {found:08x}, its trailer records {stored:08x}")]
    Trailer {
        /// The kind of checksum.
        kind: ValueChecksum,
        /// Computed over the value's bytes.
        found: u32,
        /// Stored after its last frame.
        stored: u32,
    },
    /// Planes handed over already split do not have the length of any element count's planes.
    #[error("split planes of {found} bytes: {elements} elements split into {expected} bytes")]
    SplitLength {
        /// Bytes handed over.
        found: usize,
        /// Bytes the planes of `elements` elements take.
        expected: usize,
        /// Elements the bytes would hold.
        elements: usize,
    },
    /// zstd failed to compress (only on allocation failure in practice).
    #[error("zstd: {0}")]
    Zstd(String),
}

/// Number of planes (and zstd frames) for elements of `size` bytes.
pub fn plane_count(size: usize) -> usize {
    if size <= 1 {
        1
    } else {
        1 + 2 * (size - 1)
    }
}

/// Byte lengths of the planes of `n` elements of `size` bytes.
fn plane_lens(size: usize, n: usize) -> impl Iterator<Item = usize> {
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
pub fn from_planes(planes: &[u8], size: usize, out: &mut [u8]) {
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

thread_local! {
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    static CCTX: RefCell<Option<(CompressorKey, zstd::bulk::Compressor<'static>)>> = const { RefCell::new(None) };
    static FAST_CCTX: RefCell<Option<(CompressorKey, zstd::bulk::Compressor<'static>)>> = const { RefCell::new(None) };
    static DCTX: RefCell<Option<zstd::bulk::Decompressor<'static>>> = const { RefCell::new(None) };
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
fn append_frame(
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
pub fn element_count(value: &[u8], size: usize, checks: Checksums) -> Result<usize, PlaneError> {
    content_size(frames(value, size, checks)?.0[0])
}

/// Check a value's trailing checksum, where `checks` requires one or the value has one,
/// without decoding anything.
pub fn check_trailer(value: &[u8], size: usize, checks: Checksums) -> Result<(), PlaneError> {
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
pub fn decode_into(
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
pub fn decode_to_vec(
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
pub fn decode(value: &[u8], size: usize, checks: Checksums) -> Result<Vec<u8>, PlaneError> {
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
    use super::*;

    const XXH: Checksums = Checksums::Declared(ValueChecksum::ZstdXxh64);
    const CRC: Checksums = Checksums::Declared(ValueChecksum::Crc32);
    const SUMMED: Option<ValueChecksum> = Some(ValueChecksum::DEFAULT);

    fn sample_bytes(n: usize, size: usize) -> Vec<u8> {
        (0..n * size)
            .map(|i| (i.wrapping_mul(2654435761) >> 7) as u8)
            .collect()
    }

    /// Bytes with no structure zstd could use (SplitMix64).
    fn random_bytes(n: usize) -> Vec<u8> {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        (0..n)
            .map(|_| {
                x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
                let mut z = x;
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                (z ^ (z >> 31)) as u8
            })
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
    fn declared_by_reads_the_metadata_key_and_refuses_unknown_kinds() {
        let mut meta = std::collections::HashMap::new();
        assert_eq!(Checksums::declared_by(&meta), Ok(Checksums::IfPresent));
        for kind in ValueChecksum::ALL {
            meta.insert(CHECKSUM_META_KEY.to_string(), kind.name().to_string());
            assert_eq!(Checksums::declared_by(&meta), Ok(Checksums::Declared(kind)));
        }
        // A flipped byte in the declared kind is not read as "no checksums".
        meta.insert(CHECKSUM_META_KEY.to_string(), "crc33".to_string());
        let err = Checksums::declared_by(&meta).unwrap_err();
        assert!(err.contains("\"crc33\"") && err.contains("crc32"), "{err}");
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
