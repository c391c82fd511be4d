//! Repairing a dataset whose newest version names shards that are no longer in storage (deleted
//! by hand, or by a vacuum of an hslake that predates vacuum versions): a new version without
//! them, committed like any other. Their samples are lost; the dataset reads and verifies again.
use std::collections::BTreeMap;

use futures::{StreamExt, TryStreamExt};
use object_store::ObjectStoreExt;

use crate::io::location::Location;
use crate::table::commit::{Change, Committer};
use crate::table::manifest::ShardEntry;
use crate::{Dataset, Result, StoreError};

/// Shard HEAD requests a repair runs at once.
const PARALLEL_HEADS: usize = 16;

/// What `drop_missing` found and did.
#[derive(Debug, Clone, Default)]
pub struct RepairReport {
    /// The version whose shards were checked.
    pub checked: u64,
    /// Its shards that are not in storage: what is lost with them.
    pub dropped: Vec<ShardEntry>,
    /// The version committed without them (`None`: nothing missing, or a dry run).
    pub version: Option<u64>,
}

/// The samples a dropped shard took with it, as far as its manifest entry tells:
/// `20 samples, ids 100..=119` (the ids exactly where the range holds no more than the rows),
/// else `20 samples with ids between 100 and 500`.
pub fn lost_samples(s: &ShardEntry) -> String {
    let span = s
        .max_sample_id
        .saturating_sub(s.min_sample_id)
        .saturating_add(1);
    if s.rows == 0 {
        "no samples".into()
    } else if s.rows == 1 {
        format!("1 sample, id {}", s.min_sample_id)
    } else if span == s.rows {
        format!(
            "{} samples, ids {}..={}",
            s.rows, s.min_sample_id, s.max_sample_id
        )
    } else {
        format!(
            "{} samples with ids between {} and {}",
            s.rows, s.min_sample_id, s.max_sample_id
        )
    }
}

/// Check every shard of the newest version with a HEAD and, unless `dry_run`, commit a version
/// without those that are not in storage. A shard that is there but damaged is not dropped
/// (`verify` names it); a storage error other than "not found" stops the repair.
pub async fn drop_missing(ds: &Dataset, dry_run: bool) -> Result<RepairReport> {
    let loc = ds.location();
    let head = ds.manifest(None).await?;
    // Futures made up front: a stream mapping borrowed entries through a closure trips rustc's
    // higher-ranked `Send` check in spawned callers.
    let heads: Vec<_> = head.shards.iter().map(|s| missing(loc, s)).collect();
    let found: Vec<Option<ShardEntry>> = futures::stream::iter(heads)
        .buffered(PARALLEL_HEADS)
        .try_collect()
        .await?;
    let dropped: Vec<ShardEntry> = found.into_iter().flatten().collect();
    let mut report = RepairReport {
        checked: head.version,
        dropped,
        version: None,
    };
    if report.dropped.is_empty() || dry_run {
        return Ok(report);
    }
    let removed: Vec<String> = report.dropped.iter().map(|s| s.path.clone()).collect();
    let version = Committer::new(loc)
        .commit(Change {
            schema: &head.schema,
            shards: &[],
            properties: &BTreeMap::new(),
            removed: &removed,
        })
        .await?;
    for s in &report.dropped {
        tracing::warn!(url = %loc.url, shard = %s.path, lost = %lost_samples(s), version, "repair: dropped a missing shard");
    }
    report.version = Some(version);
    Ok(report)
}

/// `s` where storage does not hold its file.
async fn missing(loc: &Location, s: &ShardEntry) -> Result<Option<ShardEntry>> {
    match loc.store.head(&loc.path(&s.path)).await {
        Ok(_) => Ok(None),
        Err(object_store::Error::NotFound { .. }) => Ok(Some(s.clone())),
        Err(e) => Err(StoreError::os(format!("{}/{}", loc.url, s.path), e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(rows: u64, min: u64, max: u64) -> ShardEntry {
        ShardEntry {
            path: "data/a.parquet".into(),
            bytes: 100,
            rows,
            tokens: 0,
            raw_bytes: 0,
            min_sample_id: min,
            max_sample_id: max,
            crc32c: 0,
            row_groups: vec![rows],
        }
    }

    #[test]
    fn names_lost_ids_exactly_only_where_the_range_is_full() {
        assert_eq!(
            lost_samples(&entry(20, 100, 119)),
            "20 samples, ids 100..=119"
        );
        assert_eq!(
            lost_samples(&entry(3, 100, 500)),
            "3 samples with ids between 100 and 500"
        );
        assert_eq!(lost_samples(&entry(1, 7, 7)), "1 sample, id 7");
        assert_eq!(lost_samples(&entry(0, 0, 0)), "no samples");
    }
}
