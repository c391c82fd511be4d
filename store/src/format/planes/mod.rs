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
//!
//! Its parts, one job each: `transform` (the rotation and the planes), `compress` (one plane
//! into one zstd frame, with the probe that spots random planes), `checksum` (the kinds of
//! value checksum and the shard's declaration of them) and `framing` (a value's header of
//! frame lengths, its frames and its trailer: encoding, and the checked decoding that
//! [`crate::format::decode`], the one decoder, is built on and alone calls).
mod bf16_split;
mod checksum;
mod compress;
mod error;
mod framing;
#[cfg(test)]
mod testdata;
mod transform;

pub use checksum::{Checksums, ValueChecksum, CHECKSUM_META_KEY};
pub use error::PlaneError;
pub(crate) use framing::{check_trailer, decode, decode_into, decode_to_vec, element_count};
pub use framing::{encode, encode_planes};
pub use transform::{plane_count, to_planes};

/// The encoding name stored in a tensor field's metadata.
pub const ENCODING: &str = hslake_schemas::TENSOR_ENCODING;
