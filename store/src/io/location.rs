//! Turning a dataset URL into an object store and a prefix inside it.
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use futures::TryStreamExt;
use hslake_schemas::units::DurationRange;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::local::LocalFileSystem;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{ClientConfigKey, ObjectMeta, ObjectStore, RetryConfig};
use url::Url;

use crate::{Result, StoreError};

/// Where a dataset lives: a store and the prefix of the dataset inside it.
#[derive(Debug, Clone)]
pub struct Location {
    /// The canonical URL (`file:///abs/dir`, `s3://bucket/prefix`, `memory://name`).
    pub url: String,
    /// The object store.
    pub store: Arc<dyn ObjectStore>,
    /// The dataset's root inside the store.
    pub prefix: Path,
}

/// Listings retried after a failure, on top of the store's own retries.
const LIST_RETRIES: u32 = 4;

impl Location {
    /// Path of an object relative to the dataset root (`data/x.parquet`).
    pub fn path(&self, rel: &str) -> Path {
        rel.split('/')
            .filter(|p| !p.is_empty())
            .fold(self.prefix.clone(), |p, part| p.join(part))
    }

    /// The dataset's folder, for a dataset on local disk.
    pub fn local_dir(&self) -> Option<std::path::PathBuf> {
        self.url
            .strip_prefix("file://")
            .map(std::path::PathBuf::from)
    }

    /// Every object under the dataset-relative folder `dir`.
    ///
    /// object_store retries a listing request that fails, but not a listing response whose body
    /// is cut short (a reset or truncated connection after the headers): that error reaches the
    /// caller, and a writer about to commit, a capture starting up or a vacuum would fail over
    /// one lost connection. Listing is idempotent, so the whole listing is retried here with a
    /// short backoff.
    pub async fn list_dir(&self, dir: &str) -> Result<Vec<ObjectMeta>> {
        let prefix = self.path(dir);
        let mut attempt = 0;
        let mut listed = self.store.list(Some(&prefix)).try_collect().await;
        while let Err(e) = &listed {
            if attempt >= LIST_RETRIES || matches!(e, object_store::Error::NotFound { .. }) {
                break;
            }
            attempt += 1;
            tracing::warn!(
                "listing {}/{dir} failed ({e}); retrying ({attempt} of {LIST_RETRIES})",
                self.url
            );
            tokio::time::sleep(Duration::from_millis(50 << attempt)).await;
            listed = self.store.list(Some(&prefix)).try_collect().await;
        }
        listed.map_err(|e| StoreError::os(format!("{}/{dir}", self.url), e))
    }

    /// The dataset-relative name of a full object path, if it lies under the root.
    pub fn relative(&self, full: &Path) -> Option<String> {
        let parts: Vec<_> = full
            .prefix_match(&self.prefix)?
            .map(|p| p.as_ref().to_string())
            .collect();
        Some(parts.join("/"))
    }
}

// memory:// datasets live for the process, shared by name so that open-after-create works.
fn memory_stores() -> &'static Mutex<HashMap<String, Arc<InMemory>>> {
    static STORES: OnceLock<Mutex<HashMap<String, Arc<InMemory>>>> = OnceLock::new();
    STORES.get_or_init(Default::default)
}

/// What a location string names, before any store is made for it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    /// A local directory: absolute, without `.` or `..` parts.
    File(std::path::PathBuf),
    /// A named in-memory store.
    Memory(String),
    /// A prefix (possibly empty) in a bucket.
    S3 { bucket: String, prefix: String },
}

impl Target {
    /// The canonical URL: the same for every spelling of the same location.
    fn url(&self) -> String {
        match self {
            Target::File(dir) if dir.as_os_str() == "/" => "file:///".into(),
            Target::File(dir) => format!("file://{}", dir.display()),
            Target::Memory(name) => format!("memory://{name}"),
            Target::S3 { bucket, prefix } if prefix.is_empty() => format!("s3://{bucket}"),
            Target::S3 { bucket, prefix } => format!("s3://{bucket}/{prefix}"),
        }
    }

    /// Whether this is the root of a filesystem or a bucket, which cannot hold a dataset:
    /// vacuum and the writer would share it with everything else there.
    fn is_root(&self) -> bool {
        match self {
            Target::File(dir) => dir.parent().is_none(),
            Target::Memory(_) => false,
            Target::S3 { prefix, .. } => prefix.is_empty(),
        }
    }
}

/// `path` made absolute (against the current directory) with `.` and `..` parts resolved as
/// URLs resolve them: lexically, without following links.
fn absolute_dir(path: &std::path::Path) -> std::io::Result<std::path::PathBuf> {
    use std::path::Component;
    let joined = match path.is_absolute() {
        true => path.to_path_buf(),
        false => std::env::current_dir()?.join(path),
    };
    let mut out = std::path::PathBuf::from("/");
    for c in joined.components() {
        match c {
            Component::Normal(part) => out.push(part),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    Ok(out)
}

/// What `url` names: `file://`, `s3://` (or `s3a://`) and `memory://` URLs, or a bare path
/// (a local directory, relative to the current one).
fn resolve(url: &str) -> Result<Target> {
    let invalid = |reason: String| StoreError::InvalidUrl {
        url: url.to_string(),
        reason,
    };
    if !url.contains("://") {
        if url.is_empty() {
            return Err(invalid(
                "empty; expected a path or a file://, s3:// or memory:// URL".into(),
            ));
        }
        let dir = absolute_dir(std::path::Path::new(url))
            .map_err(|e| invalid(format!("no current directory: {e}")))?;
        return Ok(Target::File(dir));
    }
    let u = Url::parse(url).map_err(|e| invalid(e.to_string()))?;
    match u.scheme() {
        "file" => {
            let dir = u
                .to_file_path()
                .map_err(|_| invalid("file URLs need an absolute path".into()))?;
            let dir = absolute_dir(&dir).map_err(|e| invalid(e.to_string()))?;
            Ok(Target::File(dir))
        }
        "memory" => {
            let name = format!("{}{}", u.host_str().unwrap_or(""), u.path());
            let name = name.trim_end_matches('/');
            if name.is_empty() {
                return Err(invalid("no name; expected memory://<name>".into()));
            }
            Ok(Target::Memory(name.to_string()))
        }
        "s3" | "s3a" => {
            let bucket = u
                .host_str()
                .filter(|b| !b.is_empty())
                .ok_or_else(|| invalid("no bucket".into()))?;
            if bucket.len() < 3 {
                return Err(invalid(format!(
                    "bucket name {bucket:?} is shorter than 3 characters"
                )));
            }
            let prefix = Path::from(u.path().trim_matches('/'));
            Ok(Target::S3 {
                bucket: bucket.to_string(),
                prefix: prefix.as_ref().to_string(),
            })
        }
        other => Err(invalid(format!(
            "unsupported scheme {other:?}; expected file://, s3:// or memory://"
        ))),
    }
}

/// Parse a location URL (a dataset's, a state folder's or an input object's). A bare path is
/// taken as a local path, relative to the current directory.
pub fn parse(url: &str) -> Result<Location> {
    let target = resolve(url)?;
    let canon = target.url();
    let invalid = |reason: String| StoreError::InvalidUrl {
        url: url.to_string(),
        reason,
    };
    match target {
        Target::File(dir) => {
            let prefix = Path::from_absolute_path(&dir).map_err(|e| invalid(e.to_string()))?;
            Ok(Location {
                url: canon,
                store: Arc::new(LocalFileSystem::new()),
                prefix,
            })
        }
        Target::Memory(name) => {
            let store = memory_stores()
                .lock()
                .map_err(|_| invalid("memory store registry poisoned".into()))?
                .entry(name)
                .or_insert_with(|| Arc::new(InMemory::new()))
                .clone();
            Ok(Location {
                url: canon,
                store,
                prefix: Path::from("dataset"),
            })
        }
        Target::S3 { bucket, prefix } => {
            let policy = s3_policy(|k| std::env::var(k).ok()).map_err(invalid)?;
            log_policy_once(&policy);
            let mut builder = AmazonS3Builder::from_env()
                .with_bucket_name(bucket)
                .with_retry(policy.retry.clone());
            // Through `with_config`, so the client options from the environment (allow_http)
            // stay as they are.
            for (key, d) in [
                (ClientConfigKey::Timeout, policy.timeout),
                (ClientConfigKey::ConnectTimeout, policy.connect_timeout),
            ] {
                if let Some(d) = d {
                    builder = builder.with_config(
                        AmazonS3ConfigKey::Client(key),
                        format!("{}ms", d.as_millis()),
                    );
                }
            }
            let store = builder.build().map_err(|e| invalid(e.to_string()))?;
            Ok(Location {
                url: canon,
                store: Arc::new(store),
                prefix: Path::from(prefix),
            })
        }
    }
}

/// The canonical URL of the location `url` names (a bare path is a local folder), without
/// opening its store: the same for every spelling of the same location (`.`, `..` and
/// percent-escaped dots resolved, `s3a://` as `s3://`), which is the one a store for it is
/// opened from. Roots of a filesystem or bucket are allowed here, unlike [`dataset_url`].
pub fn canonical_url(url: &str) -> Result<String> {
    Ok(resolve(url)?.url())
}

/// The canonical URL of the dataset at `url`, without opening its store: what every command,
/// the capture daemon and its clients call the dataset. The root of a filesystem or bucket is
/// refused ([`StoreError::InvalidUrl`]).
pub fn dataset_url(url: &str) -> Result<String> {
    let target = resolve(url)?;
    if target.is_root() {
        let root = target.url();
        // file:/// ends in its slash, s3://bucket does not.
        let sep = if root.ends_with('/') { "" } else { "/" };
        return Err(StoreError::InvalidUrl {
            url: url.to_string(),
            reason: format!(
                "{root} is the root of a {}; a dataset needs a folder of its own (e.g. \
                 {root}{sep}my-dataset)",
                if matches!(target, Target::S3 { .. }) {
                    "bucket"
                } else {
                    "filesystem"
                },
            ),
        });
    }
    Ok(target.url())
}

/// [`parse`] for a dataset: the root of a filesystem or bucket is refused, as by
/// [`dataset_url`].
pub fn parse_dataset(url: &str) -> Result<Location> {
    dataset_url(url)?;
    parse(url)
}

/// How S3 requests are retried and timed out: object_store's retry settings, overridable by
/// `HSLAKE_S3_RETRIES` (retries per request, default 3), `HSLAKE_S3_RETRY_TIMEOUT` (seconds
/// spent retrying one request, default 15, so an unreachable endpoint fails within seconds),
/// `HSLAKE_S3_TIMEOUT` and `HSLAKE_S3_CONNECT_TIMEOUT` (per request and per connect;
/// object_store's defaults when unset). Durations are seconds or carry a unit (`2.5`, `500ms`)
/// and may be up to a day.
#[derive(Debug, Clone)]
pub struct S3Policy {
    /// Retries of one request.
    pub retry: RetryConfig,
    /// Timeout of one request.
    pub timeout: Option<Duration>,
    /// Timeout of connecting.
    pub connect_timeout: Option<Duration>,
}

const DAY: Duration = Duration::from_secs(86_400);
/// `HSLAKE_S3_RETRY_TIMEOUT`: no retrying at all up to a day.
const S3_RETRY_TIMEOUT: DurationRange =
    DurationRange::seconds("HSLAKE_S3_RETRY_TIMEOUT", Duration::ZERO, DAY);
/// `HSLAKE_S3_TIMEOUT`: a millisecond up to a day.
const S3_TIMEOUT: DurationRange =
    DurationRange::seconds("HSLAKE_S3_TIMEOUT", Duration::from_millis(1), DAY);
/// `HSLAKE_S3_CONNECT_TIMEOUT`: a millisecond up to a day.
const S3_CONNECT_TIMEOUT: DurationRange =
    DurationRange::seconds("HSLAKE_S3_CONNECT_TIMEOUT", Duration::from_millis(1), DAY);

/// The retry policy from environment variables read through `var`; an unparsable value is
/// named with what was expected.
pub fn s3_policy(var: impl Fn(&str) -> Option<String>) -> std::result::Result<S3Policy, String> {
    let secs = |range: DurationRange| -> std::result::Result<Option<Duration>, String> {
        var(range.name)
            .map(|v| range.parse(&v).map_err(|e| e.to_string()))
            .transpose()
    };
    let retries = var("HSLAKE_S3_RETRIES")
        .map(|v| {
            v.trim()
                .parse::<usize>()
                .map_err(|_| format!("HSLAKE_S3_RETRIES={v:?}: expected a whole number of retries"))
        })
        .transpose()?;
    Ok(S3Policy {
        retry: RetryConfig {
            max_retries: retries.unwrap_or(3),
            retry_timeout: secs(S3_RETRY_TIMEOUT)?.unwrap_or(Duration::from_secs(15)),
            ..Default::default()
        },
        timeout: secs(S3_TIMEOUT)?,
        connect_timeout: secs(S3_CONNECT_TIMEOUT)?,
    })
}

fn log_policy_once(p: &S3Policy) {
    static LOGGED: OnceLock<()> = OnceLock::new();
    LOGGED.get_or_init(|| {
        tracing::info!(
            retries = p.retry.max_retries,
            retry_timeout_s = p.retry.retry_timeout.as_secs_f64(),
            timeout_s = p.timeout.map(|d| d.as_secs_f64()),
            connect_timeout_s = p.connect_timeout.map(|d| d.as_secs_f64()),
            "S3 retry policy (HSLAKE_S3_RETRIES, HSLAKE_S3_RETRY_TIMEOUT, HSLAKE_S3_TIMEOUT, HSLAKE_S3_CONNECT_TIMEOUT)"
        );
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_path_becomes_file_url() {
        let l = parse("/tmp/some/ds").unwrap();
        assert_eq!(l.url, "file:///tmp/some/ds");
        assert_eq!(
            l.path("data/a.parquet").as_ref(),
            "tmp/some/ds/data/a.parquet"
        );
    }

    #[test]
    fn s3_policy_reads_the_environment_and_names_bad_values() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        let p = s3_policy(env(&[])).unwrap();
        assert_eq!(
            (p.retry.max_retries, p.retry.retry_timeout),
            (3, Duration::from_secs(15))
        );
        assert_eq!(p.timeout, None);
        let p = s3_policy(env(&[
            ("HSLAKE_S3_RETRIES", "0"),
            ("HSLAKE_S3_TIMEOUT", "2.5"),
        ]))
        .unwrap();
        assert_eq!(p.retry.max_retries, 0);
        assert_eq!(p.timeout, Some(Duration::from_millis(2500)));
        let err = s3_policy(env(&[("HSLAKE_S3_RETRIES", "many")])).unwrap_err();
        assert!(
            err.contains("HSLAKE_S3_RETRIES=\"many\": expected a whole number"),
            "{err}"
        );
        for bad in ["-1", "1e308", "inf"] {
            let vars = [("HSLAKE_S3_CONNECT_TIMEOUT", bad)];
            let err = s3_policy(|k: &str| {
                vars.iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            })
            .unwrap_err();
            assert!(
                err.starts_with("HSLAKE_S3_CONNECT_TIMEOUT") && err.contains("from 1ms to 1d"),
                "{err}"
            );
        }
    }

    #[test]
    fn the_same_location_gets_the_same_url_however_it_is_spelled() {
        let cwd = std::env::current_dir().unwrap();
        let here = format!("file://{}", cwd.join("ds").display());
        let cases = [
            ("/tmp/x", "file:///tmp/x"),
            ("/tmp/x/", "file:///tmp/x"),
            ("/tmp/./y/../x", "file:///tmp/x"),
            ("file:///tmp/x", "file:///tmp/x"),
            ("file:///tmp/x/", "file:///tmp/x"),
            ("file:///tmp/y/../x", "file:///tmp/x"),
            ("ds", here.as_str()),
            ("./ds/", here.as_str()),
            ("s3://bucket/p", "s3://bucket/p"),
            ("s3://bucket/p/", "s3://bucket/p"),
            ("s3a://bucket//p", "s3://bucket/p"),
            ("memory://n", "memory://n"),
            ("memory://n/", "memory://n"),
        ];
        for (given, want) in cases {
            assert_eq!(dataset_url(given).unwrap(), want, "{given}");
            assert_eq!(parse_dataset(given).unwrap().url, want, "{given}");
            assert_eq!(parse(given).unwrap().url, want, "{given}");
        }
        assert_eq!(
            parse("/tmp/x/").unwrap().prefix,
            parse("file:///tmp/x").unwrap().prefix
        );
    }

    #[test]
    fn the_root_of_a_filesystem_or_bucket_is_refused_as_a_dataset() {
        for (given, root) in [
            ("/", "file:/// is the root of a filesystem"),
            ("file:///", "file:/// is the root of a filesystem"),
            ("/tmp/..", "file:/// is the root of a filesystem"),
            ("s3://bucket", "s3://bucket is the root of a bucket"),
            ("s3://bucket/", "s3://bucket is the root of a bucket"),
        ] {
            let err = dataset_url(given).unwrap_err();
            assert!(
                matches!(err, StoreError::InvalidUrl { .. }),
                "{given}: {err}"
            );
            let text = err.to_string();
            assert!(
                text.contains(root) && text.contains("a folder of its own"),
                "{given}: {text}"
            );
            // The example is a real location under that root.
            let example = if given.starts_with("s3") {
                "(e.g. s3://bucket/my-dataset)"
            } else {
                "(e.g. file:///my-dataset)"
            };
            assert!(text.contains(example), "{given}: {text}");
            assert!(parse_dataset(given).is_err(), "{given}");
        }
        // As a plain location (a state folder, an input object), the root parses, as itself.
        assert_eq!(parse("/").unwrap().url, "file:///");
        assert!(parse("").is_err());
        assert!(parse("memory://").is_err());
    }

    #[test]
    fn rejects_unknown_scheme_and_short_bucket() {
        assert!(parse("ftp://x/y")
            .unwrap_err()
            .to_string()
            .contains("unsupported scheme"));
        assert!(parse("s3://ab/x")
            .unwrap_err()
            .to_string()
            .contains("shorter than 3"));
    }
}
