//! Prefill-only forward of Hugging Face checkpoints in tch, tensor-parallel over NCCL (or
//! in-process threads on CPU), writing chosen layers' hidden states into an hslake dataset.
//!
//! ```no_run
//! # async fn run() -> Result<(), hslake_capture::CaptureError> {
//! use hslake_capture::{capture, CaptureOptions, DeviceKind};
//! use hslake_schemas::{CapturePoint, DType};
//!
//! let mut opts = CaptureOptions::new(
//!     "models/SmolLM2-135M-Instruct".into(),
//!     "samples.jsonl".into(),
//!     "file:///data/smollm2-states".into(),
//!     vec![CapturePoint::LayerOutput(2), CapturePoint::LayerOutput(15), CapturePoint::FinalNorm],
//! );
//! opts.device = DeviceKind::Cpu;
//! opts.dtype = DType::F32;
//! let summary = capture(opts).await?;
//! println!("{summary}");
//! # Ok(()) }
//! ```
//!
//! Layer `i` is the output of decoder layer `i` (0-based), i.e. Hugging Face
//! `output_hidden_states[i + 1]`; `final_norm` is the last layer's output after the final
//! RMS norm (see `hslake_schemas::LAYER_CONVENTION`).
#![deny(missing_docs)]

pub mod batch;
pub mod comm;
pub mod config;
pub mod cuda;
mod error;
pub mod input;
pub mod layers;
pub mod models;
pub mod nccl;
mod pipeline;
pub mod tp;
pub mod weights;

pub use comm::{Communicator, LocalComm, SingleRank};
pub use config::{Architecture, ModelConfig, RawConfig};
pub use error::{CaptureError, Result};
pub use input::Overlong;
pub use pipeline::{capture, CaptureOptions, CaptureSummary, DeviceKind};
