//! The contract every part of hslake shares: tensor dtypes, shape schemas,
//! capture points and their layer convention, the dataset schema, its Arrow
//! form, validation of one sample with errors that name what is wrong, and the bounded line
//! reader of the JSONL files capture and prepare take as input.
//!
//! ```
//! use hslake_schemas::{CapturePoint, DType, DatasetSchema, Sample, TensorData};
//!
//! let schema = DatasetSchema::new("tiny", "LlamaForCausalLM", 4, 3, 100, DType::F32,
//!     vec![CapturePoint::LayerOutput(1)]).unwrap();
//! let sample = Sample {
//!     sample_id: 0,
//!     input_ids: vec![1, 2],
//!     loss_mask: vec![0, 1],
//!     tensors: vec![TensorData::from_f32(&[0.5; 8], vec![2, 4])],
//! };
//! schema.validate(&sample).unwrap();
//! let arrow = schema.to_arrow();
//! assert_eq!(DatasetSchema::from_arrow(&arrow).unwrap(), schema);
//! ```
#![deny(missing_docs)]

mod arrow_schema_conv;
mod build_info;
mod dataset;
mod dtype;
mod error;
mod jsonl;
mod point;
mod sample;
mod stats;
pub mod units;

pub use arrow_schema_conv::{
    column_names, stat_column, StatKind, TensorFieldMeta, TENSOR_ENCODING, TENSOR_META_KEY,
};
pub use build_info::{CrateBuild, BUILD};
pub use dataset::{DatasetSchema, FORMAT_VERSION, OLDEST_FORMAT_VERSION};
pub use dtype::{bf16_bits_to_f32, f32_to_bf16_bits, f32_to_fp8_e4m3, fp8_e4m3_to_f32, DType};
pub use error::SchemaError;
pub use jsonl::{JsonLine, JsonLines, MAX_LINE_BYTES};
pub use point::{CapturePoint, LAYER_CONVENTION};
pub use sample::{FinitePolicy, InputShard, Overlong, Sample, TensorData};
pub use stats::{stats_of, tensor_stats, RowSums, TensorStats};
