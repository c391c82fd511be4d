//! The table layer: which shards make up each version (the manifest), how versions are found,
//! and the commit protocol that adds one (docs/FORMAT.md, "Commit protocol").
pub mod commit;
pub mod manifest;
pub mod sample_ids;
pub mod versions;
