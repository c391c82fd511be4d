//! Deleting files that no manifest names: debris of crashed or aborted writers.
//!
//! What vacuum may delete is narrow on purpose, because a wrong delete loses data for good:
//! only direct children of the dataset's `data/` and non-manifest files directly in its
//! `_hslake/versions/`, of a dataset with at least one manifest, never at the root of a store,
//! never through a symbolic link, and never a file that any manifest names (compared as object
//! paths, so a manifest's spelling of a path cannot hide a live file).
use std::collections::HashSet;
use std::time::Duration;

use object_store::path::Path;
use object_store::ObjectStoreExt;

use crate::io::location::Location;
use crate::table::manifest::{parse_manifest_name, DATA_DIR, VERSIONS_DIR};
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
    /// Files under `data/` or `_hslake/versions/` that vacuum never deletes (in sub-folders,
    /// e.g. reached through a link or belonging to a nested dataset).
    pub left_alone: Vec<String>,
    /// Files named by some manifest.
    pub live: usize,
}

/// Delete every file of the dataset that no manifest of any version names and that is
/// older than `grace` (a writer may be about to commit a younger one). See the module
/// documentation for what is never deleted.
pub async fn vacuum(ds: &Dataset, grace: Duration, dry_run: bool) -> Result<VacuumReport> {
    let loc = ds.location();
    let refuse = |reason: String| StoreError::VacuumRefused {
        url: loc.url.clone(),
        reason,
    };
    if loc.prefix.as_ref().is_empty() {
        return Err(refuse(
            "the dataset is the root of its store; vacuum only works on a dataset under a prefix, \
             so that it cannot reach anything else in the store"
                .into(),
        ));
    }
    if let Some(link) = linked_folder(loc) {
        return Err(refuse(format!(
            "{} is a symbolic link; vacuum never deletes through links",
            link.display()
        )));
    }
    let versions = ds.versions().await?;
    if versions.is_empty() {
        return Err(StoreError::NotADataset {
            url: loc.url.clone(),
        });
    }
    let mut live: HashSet<Path> = HashSet::new();
    for v in versions {
        live.extend(
            ds.manifest(Some(v))
                .await?
                .shards
                .iter()
                .map(|s| loc.path(&s.path)),
        );
    }
    let mut objects = vec![];
    for dir in [DATA_DIR, VERSIONS_DIR] {
        objects.extend(loc.list_dir(dir).await?);
    }
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
        if live.contains(&o.location) {
            continue;
        }
        if !deletable(&rel) {
            if !is_manifest(&rel) {
                tracing::info!(file = %rel, "vacuum: left alone (not a direct child of data/ or _hslake/versions/)");
                report.left_alone.push(rel);
            }
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

/// Whether vacuum may delete the dataset-relative file `rel` when no manifest names it: a
/// direct child of `data/`, or a file directly in `_hslake/versions/` that is not a manifest.
fn deletable(rel: &str) -> bool {
    let parts: Vec<&str> = rel.split('/').collect();
    match parts.as_slice() {
        [dir, _] => *dir == DATA_DIR,
        [a, b, name] => format!("{a}/{b}") == VERSIONS_DIR && parse_manifest_name(name).is_none(),
        _ => false,
    }
}

fn is_manifest(rel: &str) -> bool {
    rel.strip_prefix(VERSIONS_DIR)
        .and_then(|r| r.strip_prefix('/'))
        .is_some_and(|name| parse_manifest_name(name).is_some())
}

/// On local disk, the first of the folders vacuum deletes in (or their parents inside the
/// dataset) that is a symbolic link: listing would follow it out of the dataset.
fn linked_folder(loc: &Location) -> Option<std::path::PathBuf> {
    let root = loc.local_dir()?;
    let mut dirs = vec![root.join(DATA_DIR)];
    let mut p = root.clone();
    for part in VERSIONS_DIR.split('/') {
        p = p.join(part);
        dirs.push(p.clone());
    }
    dirs.into_iter()
        .find(|d| std::fs::symlink_metadata(d).is_ok_and(|m| m.file_type().is_symlink()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deletes_only_direct_children_of_data_and_stray_files_beside_manifests() {
        assert!(deletable("data/0b9e.parquet"));
        assert!(deletable("_hslake/versions/00000000000000000001.json#3"));
        for kept in [
            "_hslake/versions/00000000000000000001.json",
            "data/link/a",
            "data/nested/_hslake/versions/00000000000000000000.json",
            "other-team/precious.bin",
            "precious.bin",
            "_hslake/jobs/state.json",
            "data",
        ] {
            assert!(!deletable(kept), "{kept}");
        }
    }
}
