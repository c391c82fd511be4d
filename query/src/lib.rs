//! SQL over hslake datasets, on DataFusion.
//!
//! A [`QuerySession`] registers pinned dataset versions as tables (`samples`, `shards`,
//! `versions`) and the tensor functions of [`udf`] (`tensor_norm`, `cosine_similarity`, ...).
//! Queries that touch no tensor column read no tensor bytes: the `samples` table hands
//! projection and filters to DataFusion's Parquet scan. [`flight`] serves the same over Arrow
//! Flight SQL. [`limits`] bounds what one query may take (memory, time, the size of one value),
//! [`capped`] makes DataFusion's own functions that can build large values keep to those
//! bounds, [`planning`] bounds the size and nesting of a statement and plans it on a thread
//! whose stack holds it, and [`executor`] bounds how many queries run at once in a server, so one client
//! cannot take the process down. [`distributed`] runs queries over gRPC workers.
//!
//! ```no_run
//! # async fn example() -> Result<(), hslake_query::QueryError> {
//! let session = hslake_query::QuerySession::open("file:///data/kimi", None).await?;
//! let batches = session
//!     .query("SELECT sample_id, tensor_norm(layer_30) FROM samples WHERE layer_30_nan_count > 0")
//!     .await?;
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

pub mod batching;
pub mod budget;
pub mod capped;
pub mod distributed;
mod error;
pub mod executor;
pub mod flight;
pub mod limits;
pub mod output;
pub mod planning;
mod session;
pub mod table;
pub mod tensor;
pub mod udf;

pub use datafusion::execution::{RecordBatchStream, SendableRecordBatchStream};
pub use error::{BadTensorValue, QueryError, Result};
pub use limits::{Cancel, QueryLimits};
pub use output::{write_batches, OutputFormat};
pub use session::{check_read_only, QuerySession, RegisteredDataset};

#[cfg(test)]
mod slt;
#[cfg(test)]
mod testdata;
