//! Storage I/O: dataset URLs to object stores ([`location`]), ranged reads of shards
//! ([`ranged`]), the store wrapper that counts what reads fetch ([`counting`]) and shard
//! files on their way out ([`shard_upload`]).
pub mod counting;
pub mod location;
pub mod ranged;
pub mod shard_upload;

pub use counting::{CountingStore, ReadLog};
pub mod whole;
