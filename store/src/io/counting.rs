//! An object store that forwards to another and counts what every read fetches: the one
//! byte counter behind `DatasetReader::io` and the SQL layer's bytes-read figures.
use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::BoxStream;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, OBJECT_STORE_COALESCE_DEFAULT,
};

/// Object paths and byte ranges read, in order.
pub type ReadLog = Vec<(Path, Range<u64>)>;

/// An [`ObjectStore`] that forwards to another and counts the bytes and requests of every read.
///
/// Bytes are those asked for. Requests are counted as a store that merges nearby ranges makes
/// them (object_store's default, which the S3 back end uses): the ranges of one multi-range
/// read that lie at most [`OBJECT_STORE_COALESCE_DEFAULT`] apart count as one.
#[derive(Debug)]
pub struct CountingStore {
    inner: Arc<dyn ObjectStore>,
    bytes: AtomicU64,
    requests: AtomicU64,
    log: Mutex<Option<ReadLog>>,
}

impl CountingStore {
    /// Wrap `inner`.
    pub fn new(inner: Arc<dyn ObjectStore>) -> Self {
        CountingStore {
            inner,
            bytes: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            log: Mutex::new(None),
        }
    }

    /// Start (or restart) recording the byte range of every read, for tests and diagnostics.
    pub fn record_ranges(&self) {
        if let Ok(mut l) = self.log.lock() {
            *l = Some(Vec::new());
        }
    }

    /// The ranges read since [`CountingStore::record_ranges`].
    pub fn ranges(&self) -> ReadLog {
        self.log
            .lock()
            .ok()
            .and_then(|l| l.clone())
            .unwrap_or_default()
    }

    fn note(&self, path: &Path, ranges: &[Range<u64>], requests: u64) {
        let bytes: u64 = ranges.iter().map(|r| r.end - r.start).sum();
        self.requests.fetch_add(requests, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        if let Ok(mut l) = self.log.lock() {
            if let Some(v) = l.as_mut() {
                v.extend(ranges.iter().map(|r| (path.clone(), r.clone())));
            }
        }
    }

    /// Bytes returned by reads so far.
    pub fn bytes_read(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Read requests so far (see the type's documentation for how ranges are counted).
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// Set both counters back to zero.
    pub fn reset(&self) {
        self.bytes.store(0, Ordering::Relaxed);
        self.requests.store(0, Ordering::Relaxed);
    }
}

/// Requests that fetching `ranges` takes when ranges at most `gap` bytes apart are merged.
fn merged_requests(ranges: &[Range<u64>], gap: u64) -> u64 {
    let mut sorted = ranges.to_vec();
    sorted.sort_unstable_by_key(|r| r.start);
    let mut requests = 0;
    let mut end: Option<u64> = None;
    for r in sorted {
        match end {
            Some(e) if r.start <= e.saturating_add(gap) => end = Some(e.max(r.end)),
            _ => {
                requests += 1;
                end = Some(r.end);
            }
        }
    }
    requests
}

impl fmt::Display for CountingStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Counting({})", self.inner)
    }
}

#[async_trait]
impl ObjectStore for CountingStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        let head = options.head;
        let r = self.inner.get_opts(location, options).await?;
        if !head {
            self.note(location, std::slice::from_ref(&r.range), 1);
        }
        Ok(r)
    }

    async fn get_ranges(
        &self,
        location: &Path,
        ranges: &[Range<u64>],
    ) -> object_store::Result<Vec<Bytes>> {
        let r = self.inner.get_ranges(location, ranges).await?;
        let requests = merged_requests(ranges, OBJECT_STORE_COALESCE_DEFAULT);
        self.note(location, ranges, requests);
        Ok(r)
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &Path,
        to: &Path,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

#[cfg(test)]
mod tests {
    use object_store::memory::InMemory;
    use object_store::ObjectStoreExt;

    use super::*;

    #[test]
    fn nearby_ranges_merge_into_one_request() {
        let mib = 1 << 20;
        assert_eq!(merged_requests(&[], mib), 0);
        assert_eq!(merged_requests(&[0..10, 20..30, 15..25], mib), 1);
        assert_eq!(
            merged_requests(&[0..10, 10 + mib + 1..mib * 2 + 20], mib),
            2
        );
    }

    #[tokio::test]
    async fn counts_and_records_every_read() {
        let inner = Arc::new(InMemory::new());
        let path = Path::from("a");
        inner
            .put(&path, PutPayload::from(vec![7u8; 100]))
            .await
            .unwrap();
        let store = CountingStore::new(inner);
        store.record_ranges();
        store.get_range(&path, 10..20).await.unwrap();
        store.get_ranges(&path, &[0..5, 50..60]).await.unwrap();
        assert_eq!((store.bytes_read(), store.requests()), (25, 2));
        assert_eq!(
            store.ranges(),
            vec![
                (path.clone(), 10..20),
                (path.clone(), 0..5),
                (path.clone(), 50..60)
            ]
        );
        store.head(&path).await.unwrap();
        assert_eq!(store.requests(), 2, "a HEAD reads no bytes");
        store.reset();
        assert_eq!((store.bytes_read(), store.requests()), (0, 0));
    }
}
