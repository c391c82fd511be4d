//! Why a stored value cannot be encoded or decoded.
use thiserror::Error;

use super::checksum::ValueChecksum;

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
