//! Deleting files that no manifest names: debris of crashed or aborted writers.
use std::collections::HashSet;
use std::time::Duration;

use futures::TryStreamExt;
use object_store::ObjectStoreExt;

use crate::table::manifest::{parse_manifest_name, VERSIONS_DIR};
use crate::{Dataset, Result, StoreError};

/// What `vacuum` found and did.
#[derive(Debug, Clone, Default)]
pub struct VacuumReport {
    /// Dataset-relative paths deleted (or that would be, in a dry run).
    pub deleted: Vec<String>,
    /// Bytes of those files.
    pub bytes: u64,
    /// Unreferenced files left alone because they are younger than the grace period.
    pub too_recent: Vec<String>,
    /// Files named by some manifest.
    pub live: usize,
}

/// Delete every file under the dataset that no manifest of any version names and that is
/// older than `grace` (a writer may be about to commit a younger one).
pub async fn vacuum(ds: &Dataset, grace: Duration, dry_run: bool) -> Result<VacuumReport> {
    let mut live: HashSet<String> = HashSet::new();
    for v in ds.versions().await? {
        live.extend(
            ds.manifest(Some(v))
                .await?
                .shards
                .into_iter()
                .map(|s| s.path),
        );
    }
    let loc = ds.location();
    let objects: Vec<_> = loc
        .store
        .list(Some(&loc.prefix))
        .try_collect()
        .await
        .map_err(|e| StoreError::os(ds.url(), e))?;
    let cutoff =
        chrono::Utc::now() - chrono::Duration::from_std(grace).unwrap_or(chrono::Duration::MAX);
    let mut report = VacuumReport {
        live: live.len(),
        ..Default::default()
    };
    for o in objects {
        let Some(rel) = loc.relative(&o.location) else {
            continue;
        };
        let is_manifest = rel
            .strip_prefix(VERSIONS_DIR)
            .is_some_and(|r| r.starts_with('/'))
            && o.location
                .filename()
                .and_then(parse_manifest_name)
                .is_some();
        if is_manifest || live.contains(&rel) {
            continue;
        }
        if o.last_modified > cutoff {
            report.too_recent.push(rel);
            continue;
        }
        if !dry_run {
            match loc.store.delete(&o.location).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(StoreError::os(format!("{}/{rel}", ds.url()), e)),
            }
        }
        tracing::info!(file = %rel, bytes = o.size, dry_run, "vacuum: unreferenced file");
        report.bytes += o.size;
        report.deleted.push(rel);
    }
    Ok(report)
}
