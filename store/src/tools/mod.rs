//! Tools built on the store rather than part of its dataset API: synthetic activation-like
//! data ([`synth`]), the store benchmarks ([`bench`]) and `.npy` files ([`npy`]).
pub mod bench;
pub mod npy;
pub mod synth;
