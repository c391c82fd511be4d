//! Turning a dataset URL into an object store and a prefix inside it.
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use object_store::aws::AmazonS3Builder;
use object_store::local::LocalFileSystem;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{ObjectStore, RetryConfig};
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

impl Location {
    /// Path of an object relative to the dataset root (`data/x.parquet`).
    pub fn path(&self, rel: &str) -> Path {
        rel.split('/')
            .filter(|p| !p.is_empty())
            .fold(self.prefix.clone(), |p, part| p.join(part))
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
            // Bounded retries: an unreachable endpoint fails within seconds instead of hanging.
            let retry = RetryConfig {
                max_retries: 3,
                retry_timeout: Duration::from_secs(15),
                ..Default::default()
            };
            let store = AmazonS3Builder::from_env()
                .with_bucket_name(bucket)
                .with_retry(retry)
                .build()
                .map_err(|e| invalid(e.to_string()))?;
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
