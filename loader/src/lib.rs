//! Streaming, shuffled, rank-sharded, exactly resumable reads of hslake datasets, yielding
//! EAGLE-3 training batches.
//!
//! ```
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! use hslake_loader::{Loader, LoaderConfig};
//! use hslake_schemas::{CapturePoint, DType, DatasetSchema, Sample, TensorData};
//! use hslake_store::{Dataset, DatasetWriter, Provenance, WriterOptions};
//!
//! let points = vec![CapturePoint::LayerOutput(0), CapturePoint::LayerOutput(1)];
//! let schema = DatasetSchema::new("tiny", "LlamaForCausalLM", 4, 2, 100, DType::Bf16, points).unwrap();
//! let ds = Dataset::create("memory://loader-doc", schema, Provenance::default()).await.unwrap();
//! let mut w = DatasetWriter::new(&ds, WriterOptions::default()).await.unwrap();
//! for id in 0..10u64 {
//!     let t = TensorData::from_bf16_bits(&[0x3f80; 12], vec![3, 4]);
//!     let s = Sample { sample_id: id, input_ids: vec![1, 2, 3], loss_mask: vec![0, 1, 1],
//!         tensors: vec![t.clone(), t] };
//!     w.append(&s).await.unwrap();
//! }
//! w.commit().await.unwrap();
//!
//! let config = LoaderConfig { batch_size: Some(4), seed: 1, ..Default::default() };
//! let loader = Loader::open("memory://loader-doc", config).await.unwrap();
//! let mut stream = loader.stream(&loader.initial_state()).unwrap();
//! let mut seen = 0;
//! while let Some(batch) = stream.next().await {
//!     let batch = batch.unwrap();
//!     assert_eq!(batch.field("aux_hidden_states").unwrap().shape[2], 4); // k·H = 1 × 4
//!     seen += batch.sample_ids.len();
//! }
//! assert_eq!(seen, 10);
//! assert_eq!(stream.state().epoch, 1); // the next pass is epoch 1
//! # });
//! ```
//!
//! See `plan` for the order of an epoch and the rank partition, and [`LoaderState`] for
//! resuming.
#![deny(missing_docs)]

mod batch;
mod config;
mod declare;
mod error;
pub mod export;
mod loader;
mod plan;
mod points;
mod prefetch;
mod preset;
mod rng;
mod rowgroup;
mod schedule;
mod state;
mod stats;
mod stream;

pub use batch::{Batch, ElemType, HostTensor};
pub use config::{
    Batching, CorruptPolicy, Follow, Layout, LoaderConfig, Remainder, Resolved, ShuffleMode,
    DECODE_THREADS, IO_TIMEOUT,
};
pub use declare::{InRange, OptionDoc, OptionRange};
pub use error::LoaderError;
pub use loader::Loader;
pub use preset::{Preset, PresetPoints};
pub use state::{LoaderState, STATE_FORMAT};
pub use stats::LoaderStats;
pub use stream::BatchStream;

/// How this crate was compiled (`hslake --version` lists it with the other crates of the read
/// and write path).
pub const BUILD: hslake_schemas::CrateBuild = hslake_schemas::crate_build!();
