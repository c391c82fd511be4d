//! Parquet I/O on object storage: ranged reads of a shard of known size.
use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::FutureExt;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};
use parquet::arrow::arrow_reader::ArrowReaderOptions;
use parquet::arrow::async_reader::AsyncFileReader;
use parquet::errors::{ParquetError, Result};
use parquet::file::metadata::{ParquetMetaData, ParquetMetaDataReader};

/// An `AsyncFileReader` over one shard whose size the manifest already knows, so reading
/// the footer takes one request and no HEAD. Reads are counted by the store it is given (a
/// [`crate::io::counting::CountingStore`] in `DatasetReader`).
#[derive(Clone)]
pub struct ShardFile {
    store: Arc<dyn ObjectStore>,
    path: Path,
    size: u64,
}

impl ShardFile {
    /// A reader of `path`, `size` bytes long.
    pub fn new(store: Arc<dyn ObjectStore>, path: Path, size: u64) -> Self {
        ShardFile { store, path, size }
    }
}

fn external(e: object_store::Error) -> ParquetError {
    ParquetError::External(Box::new(e))
}

impl AsyncFileReader for ShardFile {
    fn get_bytes(&mut self, range: Range<u64>) -> BoxFuture<'_, Result<Bytes>> {
        async move {
            self.store
                .get_range(&self.path, range)
                .await
                .map_err(external)
        }
        .boxed()
    }

    fn get_byte_ranges(&mut self, ranges: Vec<Range<u64>>) -> BoxFuture<'_, Result<Vec<Bytes>>> {
        async move {
            // object_store coalesces nearby ranges: one row group is one request.
            self.store
                .get_ranges(&self.path, &ranges)
                .await
                .map_err(external)
        }
        .boxed()
    }

    fn get_metadata<'a>(
        &'a mut self,
        options: Option<&'a ArrowReaderOptions>,
    ) -> BoxFuture<'a, Result<Arc<ParquetMetaData>>> {
        async move {
            let size = self.size;
            let m = ParquetMetaDataReader::new()
                .with_arrow_reader_options(options)
                .with_prefetch_hint(Some(64 << 10))
                .load_and_finish(self, size)
                .await?;
            Ok(Arc::new(m))
        }
        .boxed()
    }
}
