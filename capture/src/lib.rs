//! Prefill-only forward of Hugging Face checkpoints in tch, tensor-parallel over NCCL (or
//! in-process threads on CPU), writing chosen layers' hidden states into an hslake dataset.
//!
//! An [`Engine`] loads the model once and runs any number of jobs; [`capture`] is one
//! engine and one job, as `hslake capture` runs it.
//!
//! ```no_run
//! # fn run() -> Result<(), hslake_capture::CaptureError> {
//! use hslake_capture::{CancelToken, CaptureJob, DeviceKind, Engine, EngineOptions, NoProgress};
//! use hslake_schemas::{CapturePoint, DType};
//!
//! // Blocking calls: run this on a blocking thread of a tokio runtime (spawn_blocking).
//! let mut options = EngineOptions::new("models/SmolLM2-135M-Instruct".into());
//! options.device = DeviceKind::Cpu;
//! options.dtype = DType::F32;
//! let mut engine = Engine::start(options)?; // every tensor checked, then loaded once
//! for (input, output) in [("a.jsonl", "file:///data/a"), ("b.jsonl", "file:///data/b")] {
//!     let points = vec![CapturePoint::LayerOutput(2), CapturePoint::FinalNorm];
//!     let job = CaptureJob::new(input.into(), output.into(), points);
//!     let summary = engine.run(&job, &NoProgress, &CancelToken::new())?;
//!     println!("{summary}");
//! }
//! # Ok(()) }
//! ```
//!
//! Layer `i` is the output of decoder layer `i` (0-based), i.e. Hugging Face
//! `output_hidden_states[i + 1]`; `final_norm` is the last layer's output after the final
//! RMS norm (see `hslake_schemas::LAYER_CONVENTION`).
#![deny(missing_docs)]
// Tests compare against libtorch's panicking forms freely; the library itself may not use them
// (clippy.toml, scripts/clippy_tch.py): on a GPU any of them can meet an out-of-memory error.
#![cfg_attr(test, allow(clippy::disallowed_methods))]
// Nor may it unwrap: a libtorch or CUDA result is an error to return (clippy.toml lets tests).
#![warn(clippy::unwrap_used, clippy::expect_used)]

mod batch;
mod capture;
mod checkpoint;
mod engine;
mod error;
#[cfg(test)]
mod fixtures;
mod gpu;
mod input;
mod kernels;
mod load;
mod models;
mod quant;
mod scalar;
mod stream;
mod tools;

pub use capture::{capture, capture_with, CaptureOptions};
pub use engine::{
    input_size, CancelToken, CaptureJob, CaptureSummary, CheckedModel, CommitPolicy, Engine,
    EngineOptions, NoProgress, PassReport, Placement, PlacementOptions, PlaneSplit, PreparedJob,
    ProgressSink, RANK_GRACE,
};
pub use error::{CaptureError, Result, TensorProblem};
pub use gpu::DeviceKind;
pub use hslake_schemas::{InputShard, Overlong};
pub use input::{
    check_memory, is_parquet, read_inputs, scan_inputs, InputLimits, InputSample, Inputs,
    KeptSamples,
};
pub use kernels::{
    AttentionKernel, DequantKernel, Fusion, Kernels, MoeKernel, NormKernel, TpReduce,
};
pub use models::ModelInfo;
pub use tools::debug;

/// Whether this build reads the test fault-injection variable (the `fault-injection` feature,
/// which `cargo test` turns on and builds for users never do).
pub const FAULT_INJECTION: bool = cfg!(feature = "fault-injection");
