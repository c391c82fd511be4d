//! The shard format (docs/FORMAT.md): how one sample becomes a Parquet row and back.
//!
//! - [`planes`]: the `plane_zstd` encoding of one tensor value;
//! - [`decode`]: the one decoder of stored values, checked against their row's length;
//! - [`lengths`]: a row's `seq_len` checked against its token lists, on every read;
//! - [`tokens`]: each row's checksum of its tokens, checked on every read;
//! - [`codec`]: samples to record batches and back;
//! - [`shard`]: how a shard's columns are written to Parquet;
//! - [`guard`]: Parquet's decoder run on bytes that may be corrupt.
pub mod codec;
pub mod decode;
pub mod guard;
pub mod lengths;
pub mod planes;
pub mod shard;
pub mod tokens;
