//! Tools built on the store rather than part of its dataset API: synthetic activation-like
//! data ([`synth`]), the store benchmarks ([`bench`]), `.npy` files ([`npy`]) and, for tests,
//! a flipped byte inside a stored value ([`corrupt`]).
pub mod bench;
pub mod corrupt;
pub mod npy;
pub mod synth;
