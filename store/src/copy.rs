//! Copying a dataset, with its whole history, to another store; checksums checked both ways.
use std::collections::BTreeMap;

use futures::{StreamExt, TryStreamExt};
use object_store::{ObjectStoreExt, PutMode, PutOptions, PutPayload};

use crate::manifest::{manifest_path, ShardEntry};
use crate::{location, Dataset, Result, StoreError};

/// What `copy_dataset` copied.
#[derive(Debug, Clone, Default)]
pub struct CopyReport {
    /// Manifests copied.
    pub versions: usize,
    /// Shards copied.
    pub shards: usize,
    /// Shard bytes copied.
    pub bytes: u64,
}

/// Copy every version of `src` to `dst_url`, which must not hold a dataset yet.
/// Each shard's CRC-32C is checked on the bytes read from the source and again on the bytes
/// read back from the destination; manifests are written last, so the copy becomes visible
/// only once all its data is in place.
pub async fn copy_dataset(
    src: &Dataset,
    dst_url: &str,
    on_shard: impl Fn(u64) + Send + Sync,
) -> Result<CopyReport> {
    let dst = location::parse(dst_url)?;
    let dst_ds_versions = Dataset::open(dst_url).await.map(|_| ()).ok();
    if dst_ds_versions.is_some() {
        return Err(StoreError::AlreadyExists {
            url: dst.url.clone(),
        });
    }
    let versions = src.versions().await?;
    let mut manifests = vec![];
    let mut shards: BTreeMap<String, ShardEntry> = BTreeMap::new();
    for v in &versions {
        let m = src.manifest(Some(*v)).await?;
        for s in &m.shards {
            shards.insert(s.path.clone(), s.clone());
        }
        manifests.push(m);
    }
    let on_shard = &on_shard;
    let dst_ref = &dst;
    let copied: Vec<u64> = futures::stream::iter(shards.into_values())
        .map(|s| async move {
            let from = format!("{}/{}", src.url(), s.path);
            let to = format!("{}/{}", dst_ref.url, s.path);
            let bytes = src
                .object_store()
                .get(&src.object_path(&s.path))
                .await
                .map_err(|e| StoreError::os(&from, e))?
                .bytes()
                .await
                .map_err(|e| StoreError::os(&from, e))?;
            check(&from, &s, &bytes)?;
            let path = dst_ref.path(&s.path);
            dst_ref
                .store
                .put(&path, PutPayload::from(bytes))
                .await
                .map_err(|e| StoreError::os(&to, e))?;
            let back = dst_ref
                .store
                .get(&path)
                .await
                .map_err(|e| StoreError::os(&to, e))?
                .bytes()
                .await
                .map_err(|e| StoreError::os(&to, e))?;
            check(&to, &s, &back)?;
            on_shard(s.bytes);
            Ok::<u64, StoreError>(s.bytes)
        })
        .buffer_unordered(4)
        .try_collect()
        .await?;
    for m in &manifests {
        let rel = manifest_path(m.version);
        let opts = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        dst.store
            .put_opts(&dst.path(&rel), PutPayload::from(m.to_json()), opts)
            .await
            .map_err(|e| StoreError::os(format!("{}/{rel}", dst.url), e))?;
    }
    Ok(CopyReport {
        versions: manifests.len(),
        shards: copied.len(),
        bytes: copied.iter().sum(),
    })
}

fn check(shown: &str, s: &ShardEntry, bytes: &[u8]) -> Result<()> {
    if bytes.len() as u64 != s.bytes {
        return Err(StoreError::corrupt(
            shown,
            format!("{} bytes, the manifest says {}", bytes.len(), s.bytes),
        ));
    }
    let crc = crc32c::crc32c(bytes);
    if crc != s.crc32c {
        return Err(StoreError::corrupt(
            shown,
            format!(
                "checksum mismatch: crc32c {crc:08x}, the manifest says {:08x}",
                s.crc32c
            ),
        ));
    }
    Ok(())
}
