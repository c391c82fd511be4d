//! What a worker reads: the shard files of datasets under its `--allowed-root`s, nothing else,
//! and it writes nothing.
//!
//! A plan reaches a worker as protobuf over gRPC. The coordinator's bearer token says who sent
//! it, but on a plain-text connection a plan rewritten in transit still carries the token; so a
//! worker trusts no location a plan names. Every object store a task of a plan resolves, while
//! the plan is decoded and while it runs, comes from [`DatasetStores`]: it opens only the
//! `hslake://` store names of [`crate::table::store_name`], only where the dataset URL inside,
//! brought to its canonical form (the one its store is then opened from: `..` and
//! percent-escaped dots resolved, `s3a://` as `s3://`), lies under an allowed root (bucket names
//! compared exactly, folders part by part); and the store it gives ([`ShardsOnly`]) reads only
//! objects under that dataset's `data/` and refuses every write and listing. Anything else a
//! plan names (a `file://` scan, another dataset, a manifest, a file outside the dataset) fails
//! the task with an error naming it.
use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};

use async_trait::async_trait;
use bytes::Bytes;
use datafusion::error::DataFusionError;
use datafusion::execution::object_store::ObjectStoreRegistry;
use futures::stream::{self, BoxStream};
use futures::StreamExt;
use hslake_store::io::location;
use hslake_store::table::manifest::DATA_DIR;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult,
};

use crate::table::dataset_of_store;
use crate::{QueryError, Result};

/// The locations a worker reads datasets under (`--allowed-root`), in canonical form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowedRoots {
    roots: Vec<String>,
}

impl AllowedRoots {
    /// The comma-separated locations of `list`: folders (`/data`, `file:///data`), buckets
    /// (`s3://bucket`) or prefixes in them (`s3://bucket/runs`). At least one; a folder must
    /// exist, and is kept with its links resolved; the root of the filesystem is refused (it
    /// would let plans read every file of the machine).
    pub fn parse(list: &str) -> Result<Self> {
        let refuse = |reason: String| QueryError::BadRoot {
            root: list.to_string(),
            reason,
        };
        let mut roots = Vec::new();
        for item in list.split(',').map(str::trim) {
            if item.is_empty() {
                return Err(refuse(
                    "an empty entry; expected dataset locations separated by commas, e.g. \
                     /data,s3://bucket/runs"
                        .into(),
                ));
            }
            let mut url = location::canonical_url(item).map_err(|e| refuse(e.to_string()))?;
            if let Some(dir) = url.strip_prefix("file://") {
                let real = std::fs::canonicalize(dir)
                    .ok()
                    .filter(|d| d.is_dir())
                    .ok_or_else(|| {
                        refuse(format!(
                            "{item} is not an existing folder; expected the folders that hold \
                             the datasets"
                        ))
                    })?;
                url = format!("file://{}", real.display());
            }
            if url == "file:///" {
                return Err(refuse(format!(
                    "{item} is the root of the filesystem: plans could read every file of this \
                     machine; expected the folders that hold the datasets"
                )));
            }
            roots.push(url);
        }
        Ok(AllowedRoots { roots })
    }

    /// The roots, canonical.
    pub fn urls(&self) -> &[String] {
        &self.roots
    }

    /// The canonical URL of the dataset at `url`, where it lies under one of the roots: for a
    /// local folder, the folder with its links resolved must (so a link under a root cannot
    /// lead out of it).
    pub fn dataset(&self, url: &str) -> Result<String> {
        let canonical = location::dataset_url(url)?;
        let real = resolve_links(&canonical);
        if self.roots.iter().any(|root| within(&real, root)) {
            return Ok(canonical);
        }
        let what = match real == url {
            true => format!("dataset {url}"),
            false => format!("dataset {url} ({real})"),
        };
        Err(self.outside(what))
    }

    /// Whether the local file `real` (its links resolved) lies under one of the roots.
    fn holds_file(&self, real: &std::path::Path) -> bool {
        self.roots.iter().any(|root| {
            root.strip_prefix("file://")
                .is_some_and(|dir| real.starts_with(dir))
        })
    }

    fn outside(&self, what: String) -> QueryError {
        QueryError::OutsideRoots {
            what,
            roots: self.roots.join(","),
        }
    }
}

/// The canonical URL `url` with the links of a local folder resolved, where it exists (one
/// that does not has no links to follow, and no dataset to read).
fn resolve_links(url: &str) -> String {
    match url.strip_prefix("file://").map(std::fs::canonicalize) {
        Some(Ok(real)) => format!("file://{}", real.display()),
        _ => url.to_string(),
    }
}

/// Whether the canonical location `url` is `root` or lies below it. Canonical URLs end in no
/// `/` (but `file:///`, never a root here) and hold no `.`, `..` or empty parts, so comparing
/// whole parts is comparing strings up to a `/`.
fn within(url: &str, root: &str) -> bool {
    url.strip_prefix(root)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

/// A worker task's stores: only datasets under the roots, each as a [`ShardsOnly`] view. A
/// task gets a registry of its own, so what one coordinator's plan names never serves another.
#[derive(Debug)]
pub(crate) struct DatasetStores {
    roots: Arc<AllowedRoots>,
    opened: Mutex<HashMap<String, Arc<dyn ObjectStore>>>,
}

impl DatasetStores {
    /// A registry that opens the datasets under `roots`.
    pub(crate) fn new(roots: Arc<AllowedRoots>) -> Self {
        DatasetStores {
            roots,
            opened: Mutex::default(),
        }
    }

    fn open(&self, url: &url::Url) -> Result<Arc<dyn ObjectStore>> {
        let Some(dataset) = dataset_of_store(url) else {
            return Err(self
                .roots
                .outside(format!("store {url} (not a dataset a coordinator names)")));
        };
        let canonical = self.roots.dataset(&dataset)?;
        let location = location::parse_dataset(&canonical)?;
        let shards = location.path(DATA_DIR);
        let files = canonical
            .starts_with("file://")
            .then(|| (LocalFileSystem::new(), Arc::clone(&self.roots)));
        Ok(Arc::new(ShardsOnly {
            inner: location.store,
            dataset: canonical,
            shards,
            files,
        }))
    }
}

// Stores are kept by scheme and host, as DataFusion's own registry keeps them.
fn key(url: &url::Url) -> String {
    url[..url::Position::BeforePath].to_string()
}

impl ObjectStoreRegistry for DatasetStores {
    fn register_store(
        &self,
        url: &url::Url,
        store: Arc<dyn ObjectStore>,
    ) -> Option<Arc<dyn ObjectStore>> {
        let mut opened = self.opened.lock().unwrap_or_else(PoisonError::into_inner);
        opened.insert(key(url), store)
    }

    fn get_store(&self, url: &url::Url) -> datafusion::error::Result<Arc<dyn ObjectStore>> {
        let mut opened = self.opened.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(s) = opened.get(&key(url)) {
            return Ok(Arc::clone(s));
        }
        let store = self.open(url).map_err(|e| {
            tracing::warn!("refused a plan: {e}");
            DataFusionError::External(Box::new(e))
        })?;
        opened.insert(key(url), Arc::clone(&store));
        Ok(store)
    }
}

/// A dataset's store as a worker sees it: reads of objects under the dataset's `data/` only;
/// every other read, every listing and every write is refused, naming the object.
#[derive(Debug)]
pub(crate) struct ShardsOnly {
    inner: Arc<dyn ObjectStore>,
    /// The dataset's canonical URL.
    dataset: String,
    /// The dataset's `data/` folder in `inner`.
    shards: Path,
    /// For a dataset on local disk: the files objects are, and the roots their real paths
    /// must lie under.
    files: Option<(LocalFileSystem, Arc<AllowedRoots>)>,
}

impl fmt::Display for ShardsOnly {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ShardsOnly({}/{DATA_DIR})", self.dataset)
    }
}

impl ShardsOnly {
    fn refuse(&self, path: &Path, what: &str) -> object_store::Error {
        denied(
            path,
            format!(
                "{what} {path} refused: this worker only reads shard files, objects under \
                 {}/{DATA_DIR}/",
                self.dataset
            ),
        )
    }

    fn check_read(&self, path: &Path) -> object_store::Result<()> {
        let shard = path.prefix_match(&self.shards).is_some_and(|rest| {
            let rest: Vec<_> = rest.collect();
            !rest.is_empty() && rest.iter().all(|p| plain(p.as_ref()))
        });
        if !shard {
            return Err(self.refuse(path, "reading"));
        }
        self.check_links(path)
    }

    /// A local shard's file, its links resolved (the shard's, its folders', the dataset's),
    /// must lie under a root: a link in a dataset cannot lead a read out of the roots.
    fn check_links(&self, path: &Path) -> object_store::Result<()> {
        let Some((fs, roots)) = &self.files else {
            return Ok(());
        };
        let file = fs.path_to_filesystem(path)?;
        match std::fs::canonicalize(&file) {
            Ok(real) if roots.holds_file(&real) => Ok(()),
            Ok(real) => {
                let reason = format!(
                    "reading {path} refused: its links lead to {}, outside this worker's \
                     --allowed-root ({})",
                    real.display(),
                    roots.urls().join(",")
                );
                Err(denied(path, reason))
            }
            // Nothing there to follow: the read itself reports the file missing.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => {
                let reason = format!("reading {path} refused: its links cannot be resolved: {e}");
                Err(denied(path, reason))
            }
        }
    }
}

/// The error of a refused request, logged: a plan asked for it.
fn denied(path: &Path, reason: String) -> object_store::Error {
    tracing::warn!("refused a plan: {reason}");
    object_store::Error::PermissionDenied {
        path: path.to_string(),
        source: reason.into(),
    }
}

/// A path part that names an entry of its folder: object_store already keeps `.`, `..` and `/`
/// out of parts (escaping them), and this keeps their escaped forms out too, so that no layer
/// below that decodes escapes once can climb out of the folder.
fn plain(part: &str) -> bool {
    let decoded = part.to_ascii_lowercase().replace("%2e", ".");
    !matches!(decoded.as_str(), "." | "..") && !decoded.contains("%2f") && !decoded.contains('/')
}

#[async_trait]
impl ObjectStore for ShardsOnly {
    async fn put_opts(
        &self,
        location: &Path,
        _payload: PutPayload,
        _opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        Err(self.refuse(location, "writing"))
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        _opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        Err(self.refuse(location, "writing"))
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        self.check_read(location)?;
        self.inner.get_opts(location, options).await
    }

    async fn get_ranges(
        &self,
        location: &Path,
        ranges: &[Range<u64>],
    ) -> object_store::Result<Vec<Bytes>> {
        self.check_read(location)?;
        self.inner.get_ranges(location, ranges).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        let dataset = self.dataset.clone();
        locations
            .map(move |path| {
                let path = path?;
                let reason =
                    format!("deleting {path} refused: this worker writes nothing to {dataset}");
                Err(denied(&path, reason))
            })
            .boxed()
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        let refused = self.refuse(prefix.unwrap_or(&Path::default()), "listing");
        stream::once(async move { Err(refused) }).boxed()
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        Err(self.refuse(prefix.unwrap_or(&Path::default()), "listing"))
    }

    async fn copy_opts(
        &self,
        _from: &Path,
        to: &Path,
        _options: CopyOptions,
    ) -> object_store::Result<()> {
        Err(self.refuse(to, "writing"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::distributed::WorkerSessions;
    use crate::table::{store_name, ScanSource, ShardFile, ShardTable};
    use crate::QueryLimits;
    use datafusion::arrow::array::{RecordBatch, StringArray};
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::datasource::object_store::ObjectStoreUrl;
    use datafusion::datasource::TableProvider;
    use datafusion::execution::SessionStateBuilder;
    use datafusion::physical_plan::ExecutionPlan;
    use datafusion::prelude::SessionContext;
    use datafusion_distributed::{DistributedCodec, WorkerQueryContext, WorkerSessionBuilder};
    use datafusion_proto::bytes::{
        physical_plan_from_bytes_with_proto_converter, physical_plan_to_bytes_with_proto_converter,
    };
    use datafusion_proto::physical_plan::DeduplicatingProtoConverter;
    use object_store::memory::InMemory;
    use object_store::ObjectStoreExt;

    #[test]
    fn a_dataset_is_allowed_only_under_a_root_after_normalisation() {
        let tmp = tempfile::tempdir().unwrap();
        let top = tmp.path().canonicalize().unwrap();
        let top = top.display();
        std::fs::create_dir(tmp.path().join("data")).unwrap();
        let list = format!("{top}/data, s3://bucket/runs");
        let roots = AllowedRoots::parse(&list).unwrap();
        let want = format!("file://{top}/data");
        assert_eq!(roots.urls(), [want.as_str(), "s3://bucket/runs"]);
        for ok in [
            format!("file://{top}/data/ds"),
            format!("{top}/data/ds"),
            format!("{top}/data/x/../ds"),
            format!("file://{top}/data"),
            "s3://bucket/runs/ds".into(),
            "s3a://bucket/runs/ds".into(),
            "s3://bucket/runs/a/b".into(),
        ] {
            assert!(roots.dataset(&ok).is_ok(), "{ok}");
        }
        for refused in [
            format!("file://{top}/data2/ds"),
            format!("file://{top}/data/../etc/ds"),
            format!("file://{top}/data/%2e%2e/etc/ds"),
            format!("file://{top}/data/%2E%2E/etc/ds"),
            "/etc/ds".into(),
            "s3://bucket/runs2/ds".into(),
            "s3://bucket/runs/../other".into(),
            "s3://bucket/runs/%2e%2e/other".into(),
            "s3://bucket-evil/runs/ds".into(),
            "s3://bucke/runs/ds".into(),
            "s3://BUCKET/runs/ds".into(),
            "s3://other/data/ds".into(),
            "memory://data/ds".into(),
        ] {
            let e = roots.dataset(&refused).unwrap_err().to_string();
            let named = format!("outside this worker's --allowed-root ({want},s3://bucket/runs)");
            assert!(
                e.contains(&format!("dataset {refused}")) && e.contains(&named),
                "{refused}: {e}"
            );
        }
        let missing = format!("{top}/missing");
        for bad in [
            "",
            "/data,",
            "/",
            "file:///",
            "/tmp/..",
            "ftp://x/y",
            &missing,
        ] {
            let e = AllowedRoots::parse(bad).unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("--allowed-root {bad}: ")),
                "{bad}: {e}"
            );
        }
        // A bucket as a whole may be a root; its name is matched exactly.
        let bucket = AllowedRoots::parse("s3://bucket").unwrap();
        assert!(bucket.dataset("s3://bucket/any/ds").is_ok());
        assert!(bucket.dataset("s3://bucket2/ds").is_err());
    }

    #[test]
    fn links_are_resolved_before_a_folder_is_compared_with_the_roots() {
        let tmp = tempfile::tempdir().unwrap();
        let top = tmp.path().canonicalize().unwrap();
        for d in ["data/ds", "elsewhere/ds"] {
            std::fs::create_dir_all(top.join(d)).unwrap();
        }
        // A link under the root that leads out of it, and a root given through a link.
        std::os::unix::fs::symlink(top.join("elsewhere"), top.join("data/out")).unwrap();
        std::os::unix::fs::symlink(top.join("data"), top.join("via")).unwrap();
        let roots = AllowedRoots::parse(top.join("via").to_str().unwrap()).unwrap();
        let root = format!("file://{}", top.join("data").display());
        assert_eq!(roots.urls(), [root.as_str()]);
        let escaping = format!("file://{}/data/out/ds", top.display());
        let e = roots.dataset(&escaping).unwrap_err().to_string();
        let want = format!(
            "dataset {escaping} (file://{}/elsewhere/ds) is outside this worker's \
             --allowed-root ({root})",
            top.display()
        );
        assert!(e.contains(&want), "{e}");
        // Through the root's link, or not, the dataset itself is under the root.
        for ok in ["via/ds", "data/ds"] {
            let url = format!("file://{}/{ok}", top.display());
            assert_eq!(roots.dataset(&url).unwrap(), url);
        }
    }

    #[tokio::test]
    async fn a_dataset_store_reads_only_its_shards_and_writes_nothing() {
        let inner = Arc::new(InMemory::new());
        for p in [
            "ds/data/a.parquet",
            "ds/_hslake/versions/1.json",
            "other/x.parquet",
        ] {
            inner
                .put(&Path::from(p), vec![1u8; 4].into())
                .await
                .unwrap();
        }
        let store = ShardsOnly {
            inner,
            dataset: "memory://ds".into(),
            shards: Path::from("ds/data"),
            files: None,
        };
        assert!(store.get(&Path::from("ds/data/a.parquet")).await.is_ok());
        for p in [
            Path::from("ds/_hslake/versions/1.json"),
            Path::from("other/x.parquet"),
            Path::from("ds/data"),
            Path::from_iter(["ds", "data", "..", "..", "other", "x.parquet"]),
            Path::parse("ds/data/%2E%2E/%2e%2E/other/x.parquet").unwrap(),
            Path::parse("ds/data/a%2Fb").unwrap(),
        ] {
            let e = store.get(&p).await.unwrap_err().to_string();
            assert!(
                e.contains(&format!("reading {p} refused: this worker only reads shard files, objects under memory://ds/data/")),
                "{p}: {e}"
            );
        }
        let shard = Path::from("ds/data/a.parquet");
        assert!(store.put(&shard, vec![0u8].into()).await.is_err());
        assert!(store.delete(&shard).await.is_err());
        assert!(store.copy(&shard, &Path::from("ds/data/b")).await.is_err());
        assert!(store.list_with_delimiter(None).await.is_err());
        assert_eq!(
            store
                .get(&shard)
                .await
                .unwrap()
                .bytes()
                .await
                .unwrap()
                .len(),
            4
        );
    }

    /// A Parquet file of one text column at `path`: what an attacker would like a worker to read.
    fn write_secret(path: &std::path::Path) -> (Arc<Schema>, u64) {
        let schema = Arc::new(Schema::new(vec![Field::new(
            "secret",
            DataType::Utf8,
            false,
        )]));
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![Arc::new(StringArray::from(vec!["the password"]))],
        )
        .unwrap();
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let file = std::fs::File::create(path).unwrap();
        let mut w = parquet::arrow::ArrowWriter::try_new(file, schema.clone(), None).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
        (schema, std::fs::metadata(path).unwrap().len())
    }

    /// The plan an attacker sends: our scan of `file` in the store named `store_url`, the
    /// node saying it belongs to dataset `dataset`.
    async fn crafted_scan(
        dataset: &str,
        store_url: &str,
        file: &std::path::Path,
    ) -> Arc<dyn ExecutionPlan> {
        let (schema, bytes) = write_secret(file);
        let source = ScanSource {
            dataset_url: dataset.to_string(),
            store_url: ObjectStoreUrl::parse(store_url).unwrap(),
        };
        let shard = ShardFile {
            path: Path::from_absolute_path(file).unwrap(),
            bytes,
            rows: 1,
            tokens: 1,
            min_sample_id: 0,
            max_sample_id: 0,
        };
        let table = ShardTable::new(schema, source, vec![shard]);
        // The coordinator's session has the store; the worker's opens its own.
        let ctx = SessionContext::new();
        let url = url::Url::parse(store_url).unwrap();
        ctx.register_object_store(&url, Arc::new(LocalFileSystem::new()));
        let state = ctx.state();
        table.scan(&state, None, &[], None).await.unwrap()
    }

    /// Runs `plan` as a worker reading under `roots` runs a task: encoded as plans travel,
    /// decoded in the worker's task session with its codecs, executed there. Rows, or the error.
    async fn run_as_worker(
        plan: Arc<dyn ExecutionPlan>,
        roots: &AllowedRoots,
    ) -> std::result::Result<usize, String> {
        let sessions = WorkerSessions::new("t", QueryLimits::default(), roots.clone());
        let builder = SessionStateBuilder::new().with_default_features();
        let state = sessions
            .build_session_state(WorkerQueryContext {
                builder,
                headers: Default::default(),
            })
            .await
            .unwrap();
        let codec = DistributedCodec::new_combined_with_user(state.config());
        let bytes = physical_plan_to_bytes_with_proto_converter(
            plan,
            &codec,
            &DeduplicatingProtoConverter::default(),
        )
        .unwrap();
        let task = state.task_ctx();
        let run = async {
            let plan = physical_plan_from_bytes_with_proto_converter(
                &bytes,
                &task,
                &codec,
                &DeduplicatingProtoConverter::default(),
            )?;
            let batches = datafusion::physical_plan::collect(plan, task.clone()).await?;
            Ok::<_, DataFusionError>(batches.iter().map(|b| b.num_rows()).sum())
        };
        run.await.map_err(|e| e.to_string())
    }

    #[tokio::test]
    async fn a_worker_refuses_crafted_plans_that_name_files_outside_its_roots() {
        let tmp = tempfile::tempdir().unwrap();
        let top = tmp.path().canonicalize().unwrap();
        let allowed = top.join("allowed");
        std::fs::create_dir(&allowed).unwrap();
        let ds = format!("file://{}", allowed.join("ds").display());
        let other = top.join("other");
        let secret = other.join("secret.parquet");
        let roots = AllowedRoots::parse(allowed.to_str().unwrap()).unwrap();
        let ds_store = store_name(0, &ds);

        // The same kind of plan over a file under the allowed dataset's data/ runs.
        let shard = allowed.join("ds/data/shard.parquet");
        let plan = crafted_scan(&ds, &ds_store, &shard).await;
        assert_eq!(run_as_worker(plan, &roots).await, Ok(1));

        // The allowed dataset's store, a file outside its data/: outside the roots, or inside
        // the dataset but not a shard.
        let beside = allowed.join("ds/_hslake/versions/00000000000000000001.json");
        for file in [&secret, &beside] {
            let plan = crafted_scan(&ds, &ds_store, file).await;
            let e = run_as_worker(plan, &roots).await.unwrap_err();
            let want = format!(
                "reading {} refused: this worker only reads shard files, objects under {ds}/data/",
                Path::from_absolute_path(file).unwrap()
            );
            assert!(e.contains(&want), "{}: {e}", file.display());
        }

        // A shard of the allowed dataset that is a link to the file outside the roots.
        let link = allowed.join("ds/data/link.parquet");
        std::os::unix::fs::symlink(&secret, &link).unwrap();
        let plan = crafted_scan(&ds, &ds_store, &link).await;
        let e = run_as_worker(plan, &roots).await.unwrap_err();
        let want = format!(
            "reading {} refused: its links lead to {}, outside this worker's --allowed-root \
             (file://{})",
            Path::from_absolute_path(&link).unwrap(),
            secret.display(),
            allowed.display()
        );
        assert!(e.contains(&want), "{e}");

        // Another dataset's store, however its URL is spelled; the filesystem's own store.
        let outside = format!("file://{}", other.display());
        for (dataset, named) in [
            (outside.clone(), format!("dataset {outside} ")),
            (
                format!("file://{}/../other", allowed.display()),
                format!("({outside})"),
            ),
            (
                format!("file://{}/%2e%2e/other", allowed.display()),
                format!("({outside})"),
            ),
        ] {
            let plan = crafted_scan(&dataset, &store_name(0, &dataset), &secret).await;
            let e = run_as_worker(plan, &roots).await.unwrap_err();
            assert!(
                e.contains(&named) && e.contains("is outside this worker's --allowed-root"),
                "{dataset}: {e}"
            );
        }
        let plan = crafted_scan(&ds, "file:///", &secret).await;
        let e = run_as_worker(plan, &roots).await.unwrap_err();
        assert!(
            e.contains("store file:/// (not a dataset a coordinator names) is outside"),
            "{e}"
        );
    }
}
