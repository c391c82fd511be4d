//! Storage I/O: dataset URLs to object stores ([`location`]), ranged reads of shards
//! ([`ranged`]) and the store wrapper that counts what reads fetch ([`counting`]).
pub mod counting;
pub mod location;
pub mod ranged;

pub use counting::{CountingStore, ReadLog};
pub mod whole;
