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

/// Parse a dataset URL. A bare path is taken as a local directory.
pub fn parse(url: &str) -> Result<Location> {
    let invalid = |reason: String| StoreError::InvalidUrl {
        url: url.to_string(),
        reason,
    };
    if !url.contains("://") {
        let p = std::path::Path::new(url);
        let abs = if p.is_absolute() {
            p.to_path_buf()
        } else {
            std::env::current_dir()
                .map_err(|e| invalid(format!("no current directory: {e}")))?
                .join(p)
        };
        let u = Url::from_directory_path(&abs).map_err(|_| invalid("not a usable path".into()))?;
        return parse(u.as_str().trim_end_matches('/'));
    }
    let u = Url::parse(url).map_err(|e| invalid(e.to_string()))?;
    match u.scheme() {
        "file" => {
            let dir = u
                .to_file_path()
                .map_err(|_| invalid("file URLs need an absolute path".into()))?;
            let prefix = Path::from_absolute_path(&dir).map_err(|e| invalid(e.to_string()))?;
            let canon = format!("file://{}", dir.display())
                .trim_end_matches('/')
                .to_string();
            Ok(Location {
                url: canon,
                store: Arc::new(LocalFileSystem::new()),
                prefix,
            })
        }
        "memory" => {
            let name = format!("{}{}", u.host_str().unwrap_or(""), u.path());
            let store = memory_stores()
                .lock()
                .map_err(|_| invalid("memory store registry poisoned".into()))?
                .entry(name.clone())
                .or_insert_with(|| Arc::new(InMemory::new()))
                .clone();
            Ok(Location {
                url: format!("memory://{name}"),
                store,
                prefix: Path::from("dataset"),
            })
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
            let prefix = Path::from(u.path().trim_matches('/'));
            let canon = format!("s3://{bucket}/{}", prefix.as_ref())
                .trim_end_matches('/')
                .to_string();
            Ok(Location {
                url: canon,
                store: Arc::new(store),
                prefix,
            })
        }
        other => Err(invalid(format!(
            "unsupported scheme {other:?}; expected file://, s3:// or memory://"
        ))),
    }
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
