//! Repairing a dataset whose newest version names shards that are no longer in storage (deleted
//! by hand, or by a vacuum of an hslake that predates vacuum versions), or names one shard more
//! than once (a hand edit or a foreign writer): a new version without them, committed like any
//! other. The samples of missing shards are lost; repeats lose nothing. The dataset reads and
//! verifies again.
use std::collections::BTreeMap;

use futures::{StreamExt, TryStreamExt};
use object_store::ObjectStoreExt;

use crate::io::location::Location;
use crate::table::commit::{Change, Committer};
use crate::table::manifest::{RepeatedShard, ShardEntry};
use crate::table::versions;
use crate::{Dataset, Result, StoreError};

/// Shard HEAD requests a repair runs at once.
const PARALLEL_HEADS: usize = 16;

/// What a repair looks for besides repeated entries, which it always drops (each shard is
/// kept once; nothing is lost).
#[derive(Debug, Clone, Copy, Default)]
pub struct RepairOptions {
    /// Also drop the shards that are not in storage (a HEAD each; their samples are lost).
    pub drop_missing: bool,
    /// Only report what would be dropped; commit nothing.
    pub dry_run: bool,
}

/// What `repair` found and did.
#[derive(Debug, Clone, Default)]
pub struct RepairReport {
    /// The version whose shards were checked.
    pub checked: u64,
    /// Its shards that are not in storage (looked for only with `drop_missing`): what is lost
    /// with them.
    pub dropped: Vec<ShardEntry>,
    /// Its shards named more than once, with how often: each is kept once.
    pub repeated: Vec<RepeatedShard>,
    /// The version committed without what was dropped (`None`: nothing to drop, or a dry run).
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

/// Read the newest version as stored, find its repeated entries and, with `drop_missing`, its
/// shards that are not in storage (a HEAD each); unless `dry_run`, commit a version without
/// them. A shard that is there but damaged is not dropped (`verify` names it); a storage error
/// other than "not found" stops the repair.
pub async fn repair(ds: &Dataset, opts: RepairOptions) -> Result<RepairReport> {
    let loc = ds.location();
    let head = versions::read_or_latest_as_stored(loc, None).await?;
    let dropped = match opts.drop_missing {
        true => missing_shards(loc, &head.shards).await?,
        false => vec![],
    };
    let mut report = RepairReport {
        checked: head.version,
        dropped,
        repeated: head.repeated.clone(),
        version: None,
    };
    if (report.dropped.is_empty() && report.repeated.is_empty()) || opts.dry_run {
        return Ok(report);
    }
    let removed: Vec<String> = report.dropped.iter().map(|s| s.path.clone()).collect();
    let version = Committer::new(loc)
        .commit(Change {
            schema: &head.schema,
            shards: &[],
            properties: &BTreeMap::new(),
            removed: &removed,
            drop_repeats: true,
        })
        .await?;
    for s in &report.dropped {
        tracing::warn!(url = %loc.url, shard = %s.path, lost = %lost_samples(s), version, "repair: dropped a missing shard");
    }
    for r in &report.repeated {
        tracing::info!(url = %loc.url, shard = %r.path, times = r.times, version, "repair: kept a repeated shard once");
    }
    report.version = Some(version);
    Ok(report)
}

/// The entries of `shards` whose files storage does not hold.
async fn missing_shards(loc: &Location, shards: &[ShardEntry]) -> Result<Vec<ShardEntry>> {
    // Futures made up front: a stream mapping borrowed entries through a closure trips rustc's
    // higher-ranked `Send` check in spawned callers.
    let heads: Vec<_> = shards.iter().map(|s| missing(loc, s)).collect();
    let found: Vec<Option<ShardEntry>> = futures::stream::iter(heads)
        .buffered(PARALLEL_HEADS)
        .try_collect()
        .await?;
    Ok(found.into_iter().flatten().collect())
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
