//! The sample ids each shard holds, read once per process, and the duplicate check a commit
//! runs against its head: a sample must be in a version at most once.
//!
//! Shards are immutable, so a shard's ids never change: they are cached by the shard's full
//! URL for the life of the process. A writer records the ids of the shards it wrote as it
//! closes them, so a long capture reads ids only of shards other processes wrote, each once.
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use arrow_array::cast::AsArray;
use arrow_array::types::UInt64Type;
use futures::{StreamExt, TryStreamExt};
use parquet::arrow::{ParquetRecordBatchStreamBuilder, ProjectionMask};

use crate::format::guard::{decoder_failure, guarded_async};
use crate::io::location::Location;
use crate::io::ranged::ShardFile;
use crate::table::manifest::ShardEntry;
use crate::{Result, StoreError};

/// Duplicate ids a refusal lists; the count says how many there are in all.
pub const SHOWN_DUPLICATES: usize = 8;

/// Shard reads the duplicate check runs at once.
const PARALLEL_READS: usize = 8;

type Cache = Mutex<HashMap<String, Arc<[u64]>>>;

fn cache() -> &'static Cache {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

fn key(loc: &Location, rel: &str) -> String {
    format!("{}/{rel}", loc.url)
}

/// Remember the ids of a shard this process wrote, so no commit has to read them back.
pub fn remember(loc: &Location, rel: &str, mut ids: Vec<u64>) {
    ids.sort_unstable();
    if let Ok(mut c) = cache().lock() {
        c.insert(key(loc, rel), ids.into());
    }
}

/// The sorted sample ids of one shard: from the cache, else read from its `sample_id` column.
pub async fn shard_ids(loc: &Location, entry: &ShardEntry) -> Result<Arc<[u64]>> {
    let k = key(loc, &entry.path);
    if let Some(ids) = cache().lock().ok().and_then(|c| c.get(&k).cloned()) {
        return Ok(ids);
    }
    let ids: Arc<[u64]> = read_ids(loc, entry, &k).await?.into();
    if let Ok(mut c) = cache().lock() {
        c.insert(k, ids.clone());
    }
    Ok(ids)
}

async fn read_ids(loc: &Location, entry: &ShardEntry, shown: &str) -> Result<Vec<u64>> {
    guarded_async(read_ids_unguarded(loc, entry, shown))
        .await
        .map_err(|e| StoreError::corrupt(shown, decoder_failure(&e)))?
}

async fn read_ids_unguarded(loc: &Location, entry: &ShardEntry, shown: &str) -> Result<Vec<u64>> {
    let file = ShardFile::new(loc.store.clone(), loc.path(&entry.path), entry.bytes);
    let builder = ParquetRecordBatchStreamBuilder::new(file)
        .await
        .map_err(|e| StoreError::pq(shown, e))?;
    let mask = ProjectionMask::columns(builder.parquet_schema(), ["sample_id"]);
    let mut stream = builder
        .with_projection(mask)
        .build()
        .map_err(|e| StoreError::pq(shown, e))?;
    let mut ids = vec![];
    while let Some(b) = stream
        .try_next()
        .await
        .map_err(|e| StoreError::pq(shown, e))?
    {
        let col = b
            .column_by_name("sample_id")
            .and_then(|c| c.as_primitive_opt::<UInt64Type>())
            .ok_or_else(|| StoreError::corrupt(shown, "no UInt64 sample_id column"))?;
        ids.extend_from_slice(col.values());
    }
    ids.sort_unstable();
    Ok(ids)
}

/// Ids that occur more than once in a sorted slice, each listed once.
pub fn repeated(sorted: &[u64]) -> Vec<u64> {
    let mut out: Vec<u64> = sorted
        .windows(2)
        .filter(|w| w[0] == w[1])
        .map(|w| w[0])
        .collect();
    out.dedup();
    out
}

/// Ids present in both sorted slices; only the part of `held` within `want`'s range is walked.
pub fn common(want: &[u64], held: &[u64]) -> Vec<u64> {
    let (Some(&lo), Some(&hi)) = (want.first(), want.last()) else {
        return vec![];
    };
    let start = held.partition_point(|&x| x < lo);
    let end = held.partition_point(|&x| x <= hi);
    let (mut i, mut out) = (0, vec![]);
    for &h in &held[start..end] {
        while i < want.len() && want[i] < h {
            i += 1;
        }
        if i < want.len() && want[i] == h {
            out.push(h);
        }
    }
    out
}

/// The sorted ids of the shards a commit adds.
pub async fn change_ids(loc: &Location, shards: &[ShardEntry]) -> Result<Vec<u64>> {
    let reads: Vec<_> = shards.iter().map(|s| shard_ids(loc, s)).collect();
    let parts: Vec<Arc<[u64]>> = futures::stream::iter(reads)
        .buffered(PARALLEL_READS)
        .try_collect()
        .await?;
    let mut ids: Vec<u64> = parts.iter().flat_map(|p| p.iter().copied()).collect();
    ids.sort_unstable();
    Ok(ids)
}

/// Ids of `want` (sorted) that the shards of `head` already hold, sorted and each once.
/// Shards whose manifest id range cannot meet `want`'s range are never read.
pub async fn held_by(loc: &Location, head: &[ShardEntry], want: &[u64]) -> Result<Vec<u64>> {
    let (Some(&lo), Some(&hi)) = (want.first(), want.last()) else {
        return Ok(vec![]);
    };
    let reads: Vec<_> = head
        .iter()
        .filter(|s| s.rows > 0 && s.min_sample_id <= hi && s.max_sample_id >= lo)
        .map(|s| shard_ids(loc, s))
        .collect();
    let found: Vec<Vec<u64>> = futures::stream::iter(reads)
        .buffer_unordered(PARALLEL_READS)
        .map_ok(|ids| common(want, &ids))
        .try_collect()
        .await?;
    let mut out: Vec<u64> = found.into_iter().flatten().collect();
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_lists_each_duplicate_once() {
        assert_eq!(repeated(&[1, 2, 2, 2, 3, 5, 5]), vec![2, 5]);
        assert!(repeated(&[1, 2, 3]).is_empty());
        assert!(repeated(&[]).is_empty());
    }

    #[test]
    fn common_finds_ids_in_both_and_ignores_the_rest() {
        assert_eq!(common(&[3, 5, 9], &[1, 2, 3, 4, 9, 10]), vec![3, 9]);
        assert!(common(&[3, 5], &[6, 7]).is_empty());
        assert!(common(&[], &[1]).is_empty());
        assert_eq!(common(&[0, u64::MAX], &[u64::MAX]), vec![u64::MAX]);
    }
}
