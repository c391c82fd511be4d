//! Copying a dataset, with its whole history, to another store; checksums checked both ways.
use std::collections::BTreeMap;

use futures::{StreamExt, TryStreamExt};
use object_store::{ObjectStoreExt, PutPayload};

use crate::io::location;
use crate::io::whole::{check, read_whole};
use crate::table::commit::{put_manifest_checked, CommitError};
use crate::table::manifest::ShardEntry;
use crate::table::versions;
use crate::{Dataset, Result, StoreError};

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
    let dst = location::parse_dataset(dst_url)?;
    match Dataset::open(dst_url).await {
        Err(StoreError::NotADataset { .. }) => {}
        Ok(_) => {
            return Err(StoreError::AlreadyExists {
                url: dst.url.clone(),
            })
        }
        // Anything else (unreachable store, no permission) is not evidence that the
        // destination is free: copying into it blind could interleave with a dataset there.
        Err(e) => return Err(e),
    }
    let versions = src.versions().await?;
    let manifests = versions::read_many(src.location(), &versions).await?;
    let mut shards: BTreeMap<String, ShardEntry> = BTreeMap::new();
    for s in manifests.iter().flat_map(|m| &m.shards) {
        shards.insert(s.path.clone(), s.clone());
    }
    let on_shard = &on_shard;
    let dst_ref = &dst;
    let copied: Vec<u64> = futures::stream::iter(shards.into_values())
        .map(|s| async move {
            let from = format!("{}/{}", src.url(), s.path);
            let to = format!("{}/{}", dst_ref.url, s.path);
            let bytes = read_whole(src.location(), &s.path).await?;
            check(&from, &s, &bytes)?;
            let put = dst_ref
                .store
                .put(&dst_ref.path(&s.path), PutPayload::from(bytes))
                .await;
            // Reading the copy back settles a put whose response was lost: the bytes are
            // there and right, or the put's failure stands.
            let back = read_whole(dst_ref, &s.path).await.and_then(|b| check(&to, &s, &b));
            match (put, back) {
                (Ok(_), back) => back?,
                (Err(e), Ok(())) => {
                    tracing::info!(file = %to, error = %e, "shard put reported failure but the copy is there and intact (response lost)")
                }
                (Err(e), Err(_)) => return Err(StoreError::os(&to, e)),
            }
            on_shard(s.bytes);
            Ok::<u64, StoreError>(s.bytes)
        })
        .buffer_unordered(4)
        .try_collect()
        .await?;
    for m in &manifests {
        match put_manifest_checked(&dst, m).await {
            Ok(()) => {}
            // Another writer created a dataset at the destination while the shards were copied.
            Err(CommitError::Conflict) => {
                return Err(StoreError::AlreadyExists {
                    url: dst.url.clone(),
                })
            }
            Err(CommitError::Other(e)) => return Err(e),
        }
    }
    Ok(CopyReport {
        versions: manifests.len(),
        shards: copied.len(),
        bytes: copied.iter().sum(),
    })
}

#[cfg(test)]
mod tests {
    use hslake_schemas::DType;

    use super::*;
    use crate::tools::synth::{write_dataset, SynthSpec};
    use crate::WriterOptions;

    #[tokio::test]
    async fn refuses_a_destination_it_cannot_inspect_before_copying_anything() {
        let spec = SynthSpec {
            samples: 4,
            seq_len: (2, 5),
            hidden: 8,
            layers: vec![1],
            final_norm: false,
            num_layers: None,
            vocab_size: 100,
            dtype: DType::Bf16,
            seed: 1,
            first_id: 0,
            writer: WriterOptions::default(),
            commit_every: 0,
        };
        let src = write_dataset("memory://copy-src-uninspectable", &spec, || {})
            .await
            .unwrap()
            .dataset;
        let tmp = tempfile::tempdir().unwrap();
        let dst = tmp.path().join("dst");
        // `_hslake` is a file, so listing `_hslake/versions` fails: that is not "no dataset".
        std::fs::create_dir_all(&dst).unwrap();
        std::fs::write(dst.join("_hslake"), b"not a folder").unwrap();
        let url = format!("file://{}", dst.display());
        let err = copy_dataset(&src, &url, |_| {}).await.unwrap_err();
        assert!(matches!(err, StoreError::ObjectStore { .. }), "{err}");
        assert!(!dst.join("data").exists(), "no shard copied");
    }
}
