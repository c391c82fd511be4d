//! Deleting files that no manifest names: debris of crashed or aborted writers.
//!
//! What vacuum may delete is narrow on purpose, because a wrong delete loses data for good:
//! only direct children of the dataset's `data/` and non-manifest files directly in its
//! `_hslake/versions/`, of a dataset with at least one manifest, never at the root of a store,
//! never through a symbolic link, and never a file that any manifest names (compared as object
//! paths, so a manifest's spelling of a path cannot hide a live file).
//!
//! # Racing writers
//!
//! A writer's shards are in storage before the commit that names them, so "no manifest names
//! it" is true of a shard about to be committed. A vacuum that checked, then deleted, could
//! delete a shard that a commit named in between. Vacuum therefore takes part in the version
//! chain, whose put-if-absent already orders every commit:
//!
//! 1. It reads the head H and every manifest, lists `data/` and `_hslake/versions/`, and dooms
//!    the files no manifest names that were last modified before `now - grace`.
//! 2. If it dooms a shard file, it puts version H+1: H's shards and properties, with a mark
//!    ([`crate::table::manifest::VacuumMark`]) whose cutoff is the newest modification time
//!    among the doomed files, or an earlier vacuum's later cutoff. Every commit carries the mark
//!    forward. If H+1 exists already, a commit got there first and may name a doomed file: it
//!    starts over at step 1.
//! 3. Only once its version has landed does it delete, and only the files it doomed.
//!
//! A commit checks each new shard against its head's mark and refuses one last modified at or
//! before the cutoff ([`StoreError::ShardPredatesVacuum`]). A commit and a vacuum contend for
//! the same version numbers, so a commit lands either before the vacuum's version (the vacuum
//! then conflicts and sees the shard as live when it starts over) or after it (on a head that
//! carries the mark, so it refuses the shard by name). No commit names a file a vacuum deletes,
//! whatever the timing: a writer stalled past the grace is refused, never left naming a
//! deleted file.
//!
//! The cutoff is a time of the store's own clock (files' modification times), so skew between
//! the vacuum's clock and the store's does not weaken this: skew only moves which files are old
//! enough to doom. With the minimum grace ([`MIN_GRACE`]) a few minutes of skew cannot doom a
//! live writer's shard; with `no_writers` and a grace of zero, a vacuum whose clock runs ahead
//! may doom a shard a writer has just written, and that writer is refused, never loses data.
//! The argument holds as long as a shard file is not rewritten after a vacuum listed it:
//! writers name shards with fresh UUIDs, and object_store's retries of one upload end within
//! seconds, far inside the minimum grace.
use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{ObjectMeta, ObjectStoreExt};

use crate::io::location::Location;
use crate::table::commit::{self, put_manifest_checked, CommitError};
use crate::table::manifest::{parse_manifest_name, VacuumMark, DATA_DIR, VERSIONS_DIR};
use crate::table::versions;
use crate::{Dataset, Result, StoreError};

/// The shortest grace a vacuum accepts while writers may be running: a writer must commit
/// within the grace, or its commit is refused (and its shards deleted).
pub const MIN_GRACE: Duration = Duration::from_secs(3600);

/// Deletes a vacuum runs at once.
const PARALLEL_DELETES: usize = 16;

/// How a vacuum runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VacuumOptions {
    /// Unreferenced files younger than this are left alone (a writer may be about to commit
    /// them); at least [`MIN_GRACE`] unless `no_writers`.
    pub grace: Duration,
    /// The caller's word that no writer is running, which allows a grace below [`MIN_GRACE`].
    /// Even then no commit can name a deleted file; a writer that runs after all is refused.
    pub no_writers: bool,
    /// Only report what would be deleted; commit nothing.
    pub dry_run: bool,
}

impl Default for VacuumOptions {
    fn default() -> Self {
        VacuumOptions {
            grace: MIN_GRACE,
            no_writers: false,
            dry_run: false,
        }
    }
}

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
    /// The version the vacuum committed before deleting shard files (none: it deleted none).
    pub version: Option<u64>,
    /// The cutoff that version records: every shard file deleted was last modified at or
    /// before it.
    pub cutoff: Option<DateTime<Utc>>,
    /// Times the vacuum started over because a commit landed first.
    pub restarts: u32,
}

/// Delete every file of the dataset that no manifest of any version names and that is older
/// than the grace, after committing a vacuum version that makes later commits refuse such
/// files (see the module documentation; what is never deleted is listed there too).
pub async fn vacuum(ds: &Dataset, opts: VacuumOptions) -> Result<VacuumReport> {
    let mut manifests = ManifestCache::default();
    for attempt in 0..commit::ATTEMPTS {
        let plan = VacuumPlan::build(ds, opts, &mut manifests).await?;
        if opts.dry_run {
            return Ok(plan.report);
        }
        match plan.mark().await? {
            Marked::Landed(marked) => {
                let mut report = marked.delete().await?;
                report.restarts = attempt;
                return Ok(report);
            }
            Marked::Conflict => {
                tracing::info!(url = %ds.url(), attempt, "vacuum: a commit landed first; starting over");
                tokio::time::sleep(commit::backoff(attempt)).await;
            }
        }
    }
    Err(StoreError::CommitContention {
        url: ds.url().to_string(),
        attempts: commit::ATTEMPTS,
    })
}

/// Manifests' shard paths by version: manifests never change, so a vacuum that starts over
/// reads only those committed since.
#[derive(Default)]
struct ManifestCache(HashMap<u64, Vec<String>>);

impl ManifestCache {
    /// Every version's shard paths, as object paths, and the head's version.
    async fn live(&mut self, loc: &Location) -> Result<(HashSet<Path>, u64)> {
        let listed = versions::list(loc).await?;
        let Some(&head) = listed.last() else {
            return Err(StoreError::NotADataset {
                url: loc.url.clone(),
            });
        };
        let new: Vec<u64> = listed
            .into_iter()
            .filter(|v| !self.0.contains_key(v))
            .collect();
        for m in versions::read_many(loc, &new).await? {
            self.0
                .insert(m.version, m.shards.into_iter().map(|s| s.path).collect());
        }
        let live = self.0.values().flatten().map(|p| loc.path(p)).collect();
        Ok((live, head))
    }
}

/// A vacuum's first step: the files it would delete, and the head it read.
pub struct VacuumPlan {
    ds: Dataset,
    head: u64,
    doomed: Vec<ObjectMeta>,
    report: VacuumReport,
}

/// What became of a plan's vacuum version.
pub enum Marked {
    /// It landed (or no shard file is doomed, so none was needed): the plan may delete.
    Landed(MarkedPlan),
    /// A commit took the version first; the plan may miss a live file and must be made again.
    Conflict,
}

/// A plan whose vacuum version is in place: later commits refuse the files it deletes.
pub struct MarkedPlan(Box<VacuumPlan>);

impl VacuumPlan {
    /// Read the head and every manifest, list the dataset's files and doom the unreferenced
    /// ones older than the grace. Refuses a grace below [`MIN_GRACE`] without `no_writers`.
    pub async fn new(ds: &Dataset, opts: VacuumOptions) -> Result<VacuumPlan> {
        VacuumPlan::build(ds, opts, &mut ManifestCache::default()).await
    }

    async fn build(
        ds: &Dataset,
        opts: VacuumOptions,
        manifests: &mut ManifestCache,
    ) -> Result<VacuumPlan> {
        let loc = ds.location();
        check_reach(loc, opts)?;
        let cutoff =
            Utc::now() - chrono::Duration::from_std(opts.grace).unwrap_or(chrono::Duration::MAX);
        let (live, head) = manifests.live(loc).await?;
        let mut objects = vec![];
        for dir in [DATA_DIR, VERSIONS_DIR] {
            objects.extend(loc.list_dir(dir).await?);
        }
        let mut report = VacuumReport {
            live: live.len(),
            ..Default::default()
        };
        let mut doomed = vec![];
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
            tracing::info!(file = %rel, bytes = o.size, dry_run = opts.dry_run, "vacuum: unreferenced file");
            report.bytes += o.size;
            report.deleted.push(rel);
            doomed.push(o);
        }
        Ok(VacuumPlan {
            ds: ds.clone(),
            head,
            doomed,
            report,
        })
    }

    /// Dataset-relative paths of the files the plan would delete.
    pub fn doomed(&self) -> &[String] {
        &self.report.deleted
    }

    /// The cutoff a vacuum version must record: the newest modification time among doomed
    /// shard files, to the end of its second where the store gave whole seconds (`None`: no
    /// shard file is doomed, only strays beside the manifests, which no commit can name).
    fn cutoff(&self) -> Option<DateTime<Utc>> {
        let loc = self.ds.location();
        self.doomed
            .iter()
            .filter(|o| {
                loc.relative(&o.location)
                    .is_some_and(|r| r.split('/').next() == Some(DATA_DIR))
            })
            .map(|o| o.last_modified)
            .max()
            .map(VacuumMark::cutoff_for)
    }

    /// Commit the vacuum version on top of the head the plan read.
    pub async fn mark(mut self) -> Result<Marked> {
        let Some(cutoff) = self.cutoff() else {
            return Ok(Marked::Landed(MarkedPlan(Box::new(self))));
        };
        let loc = self.ds.location();
        let head = versions::read(loc, self.head).await?;
        let next = commit::vacuum_manifest(&loc.url, &head, cutoff, &commit::new_commit_id())?;
        match put_manifest_checked(loc, &next).await {
            Ok(()) => {
                tracing::info!(url = %loc.url, version = next.version, %cutoff, files = self.doomed.len(),
                    "vacuum: committed its version; deleting");
                self.report.version = Some(next.version);
                self.report.cutoff = next.vacuum.map(|v| v.cutoff);
                Ok(Marked::Landed(MarkedPlan(Box::new(self))))
            }
            Err(CommitError::Conflict) => Ok(Marked::Conflict),
            Err(CommitError::Other(e)) => Err(e),
        }
    }
}

impl MarkedPlan {
    /// Delete the doomed files.
    pub async fn delete(self) -> Result<VacuumReport> {
        let VacuumPlan {
            ds, doomed, report, ..
        } = *self.0;
        let loc = ds.location();
        // Futures made up front: a stream mapping borrowed entries through a closure trips
        // rustc's higher-ranked `Send` check in spawned callers.
        let deletes: Vec<_> = doomed
            .into_iter()
            .map(|o| delete(loc, o.location))
            .collect();
        futures::stream::iter(deletes)
            .buffer_unordered(PARALLEL_DELETES)
            .try_collect::<()>()
            .await?;
        Ok(report)
    }
}

/// Delete one file; one already gone is no failure.
async fn delete(loc: &Location, path: Path) -> Result<()> {
    match loc.store.delete(&path).await {
        Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
        Err(e) => {
            let rel = loc.relative(&path).unwrap_or_default();
            Err(StoreError::os(format!("{}/{rel}", loc.url), e))
        }
    }
}

/// Refuse what could delete a writer's shards or reach beyond the dataset: a grace below the
/// minimum without the caller's word that no writer runs, the root of a store, or a folder
/// vacuum deletes in that is a symbolic link.
fn check_reach(loc: &Location, opts: VacuumOptions) -> Result<()> {
    let refuse = |reason: String| StoreError::VacuumRefused {
        url: loc.url.clone(),
        reason,
    };
    if opts.grace < MIN_GRACE && !opts.no_writers {
        return Err(refuse(format!(
            "a grace of {}s is below the minimum of {}s: a writer still running would have its \
             commit refused and its shards deleted; pass the no-writers option (`--no-writers`) \
             if no writer runs on this dataset",
            opts.grace.as_secs(),
            MIN_GRACE.as_secs()
        )));
    }
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
    Ok(())
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

    #[tokio::test]
    async fn refuses_grace_below_an_hour_unless_no_writer_runs() {
        let loc = crate::io::location::parse("memory://vacuum-grace/ds").unwrap();
        let short = VacuumOptions {
            grace: Duration::from_secs(3599),
            ..Default::default()
        };
        let err = check_reach(&loc, short).unwrap_err().to_string();
        assert!(
            err.contains("grace of 3599s is below the minimum of 3600s")
                && err.contains("--no-writers"),
            "{err}"
        );
        assert!(check_reach(&loc, VacuumOptions::default()).is_ok());
        let no_writers = VacuumOptions {
            grace: Duration::ZERO,
            no_writers: true,
            dry_run: false,
        };
        assert!(check_reach(&loc, no_writers).is_ok());
    }
}
