//! Parquet I/O on object storage: ranged reads of a shard of known size, counting bytes.
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
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

/// Bytes and requests a reader has fetched from storage.
#[derive(Debug, Default)]
pub struct IoCounter {
    /// Bytes fetched.
    pub bytes: AtomicU64,
    /// Ranged requests made.
    pub requests: AtomicU64,
}

impl IoCounter {
    /// (bytes, requests) so far.
    pub fn get(&self) -> (u64, u64) {
        (
            self.bytes.load(Ordering::Relaxed),
            self.requests.load(Ordering::Relaxed),
        )
    }
}

/// An `AsyncFileReader` over one shard whose size the manifest already knows, so reading
/// the footer takes one request and no HEAD.
#[derive(Clone)]
pub struct ShardFile {
    store: Arc<dyn ObjectStore>,
    path: Path,
    size: u64,
    counter: Arc<IoCounter>,
}

impl ShardFile {
    /// A reader of `path`, `size` bytes long, counting into `counter`.
    pub fn new(
        store: Arc<dyn ObjectStore>,
        path: Path,
        size: u64,
        counter: Arc<IoCounter>,
    ) -> Self {
        ShardFile {
            store,
            path,
            size,
            counter,
        }
    }

    fn count(&self, bytes: u64, requests: u64) {
        self.counter.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.counter.requests.fetch_add(requests, Ordering::Relaxed);
    }
}

fn external(e: object_store::Error) -> ParquetError {
    ParquetError::External(Box::new(e))
}

impl AsyncFileReader for ShardFile {
    fn get_bytes(&mut self, range: Range<u64>) -> BoxFuture<'_, Result<Bytes>> {
        async move {
            let b = self
                .store
                .get_range(&self.path, range)
                .await
                .map_err(external)?;
            self.count(b.len() as u64, 1);
            Ok(b)
        }
        .boxed()
    }

    fn get_byte_ranges(&mut self, ranges: Vec<Range<u64>>) -> BoxFuture<'_, Result<Vec<Bytes>>> {
        async move {
            // object_store coalesces nearby ranges: one row group is one request.
            let v = self
                .store
                .get_ranges(&self.path, &ranges)
                .await
                .map_err(external)?;
            self.count(v.iter().map(|b| b.len() as u64).sum(), 1);
            Ok(v)
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
