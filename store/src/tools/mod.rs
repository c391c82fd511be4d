//! Tools built on the store rather than part of its dataset API: synthetic activation-like
//! data ([`synth`]), the store benchmarks ([`bench`]), `.npy` files ([`npy`]), the local files
//! hslake writes for the user, never through links nor into datasets ([`files`]) and, for
//! tests, a flipped byte inside a stored value or a rewritten shard ([`corrupt`]) and a bucket
//! on the loopback S3 server ([`s3_bucket`]).
pub mod bench;
pub mod corrupt;
pub mod files;
pub mod npy;
pub mod s3_bucket;
pub mod synth;
