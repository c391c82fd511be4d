//! hslake datasets on object storage: immutable Parquet shards, versioned manifests
//! committed put-if-absent, pinned readers, verification, vacuum, repair and copy.
//!
//! ```
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! use hslake_schemas::{CapturePoint, DType, DatasetSchema, Sample, TensorData};
//! use hslake_store::{Dataset, DatasetReader, DatasetWriter, Provenance, WriterOptions};
//!
//! let schema = DatasetSchema::new("tiny", "LlamaForCausalLM", 4, 2, 100, DType::F32,
//!     vec![CapturePoint::LayerOutput(1)]).unwrap();
//! let ds = Dataset::create("memory://doc-example", schema, Provenance::default()).await.unwrap();
//! let mut w = DatasetWriter::new(&ds, WriterOptions::default()).await.unwrap();
//! let t = TensorData::from_f32(&[1.0; 8], vec![2, 4]);
//! w.append(&Sample { sample_id: 0, input_ids: vec![5, 6], loss_mask: vec![0, 1], tensors: vec![t] })
//!     .await.unwrap();
//! assert_eq!(w.commit().await.unwrap(), Some(1));
//! let r = DatasetReader::open(&ds, None).await.unwrap();
//! assert_eq!(r.get_sample(0).await.unwrap().input_ids, vec![5, 6]);
//! # });
//! ```
//!
//! The dataset API is at the crate root. Underneath, by concern (as Lance splits its file,
//! table and io crates):
//! - [`format`]: the shard format, the `plane_zstd` encoding and the one tensor decoder;
//! - [`table`]: manifests, finding versions, the commit protocol;
//! - [`io`]: dataset URLs to object stores, ranged reads, counting what reads fetch;
//! - [`tools`]: synthetic data, the store benchmarks and `.npy` files, built on the above.
#![deny(missing_docs)]

pub mod buffer;
pub mod build_info;
pub mod format;
pub mod io;
pub mod table;
pub mod tools;

mod copy;
mod dataset;
mod error;
mod reader;
mod repair;
mod vacuum;
mod verify;
mod writer;

pub use copy::{copy_dataset, CopyReport};
pub use dataset::Dataset;
pub use error::{Result, StoreError};
pub use io::location;
pub use reader::{DatasetReader, SampleSite};
pub use repair::{lost_samples, repair, RepairOptions, RepairReport};
pub use table::manifest::{
    manifest_path, Manifest, Provenance, RepeatedShard, ShardEntry, VacuumMark, DATA_DIR,
    MAX_MANIFEST_BYTES, MAX_MANIFEST_SHARDS, VERSIONS_DIR,
};
pub use vacuum::{vacuum, Marked, MarkedPlan, VacuumOptions, VacuumPlan, VacuumReport, MIN_GRACE};
pub use verify::{verify, MissingShard, Problem, VerifyReport};
pub use writer::{
    encode_sample, encode_split_sample, Appended, DatasetWriter, WriterOptions, WriterStats,
};
