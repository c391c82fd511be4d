//! Work in progress: see the crate description in Cargo.toml.
