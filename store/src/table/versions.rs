//! A dataset's committed versions: listing them and reading one's manifest.
use futures::TryStreamExt;
use object_store::ObjectStoreExt;

use crate::io::location::Location;
use crate::table::manifest::{manifest_path, parse_manifest_name, Manifest, VERSIONS_DIR};
use crate::{Result, StoreError};

/// Listings retried after a failure, on top of the store's own retries.
const LIST_RETRIES: u32 = 4;

/// Every committed version at `loc`, ascending (empty where no dataset is).
///
/// object_store retries a listing request that fails, but not a listing response whose body is
/// cut short (a reset or truncated connection after the headers): that error reaches the caller,
/// and a writer about to commit or a capture starting up would fail over one lost connection.
/// Listing is idempotent, so the whole listing is retried here with a short backoff.
pub async fn list(loc: &Location) -> Result<Vec<u64>> {
    let dir = loc.path(VERSIONS_DIR);
    let mut attempt = 0;
    let mut metas: object_store::Result<Vec<_>> = loc.store.list(Some(&dir)).try_collect().await;
    while let Err(e) = &metas {
        if attempt >= LIST_RETRIES || matches!(e, object_store::Error::NotFound { .. }) {
            break;
        }
        attempt += 1;
        tracing::warn!(
            "listing {}/{VERSIONS_DIR} failed ({e}); retrying ({attempt} of {LIST_RETRIES})",
            loc.url
        );
        tokio::time::sleep(std::time::Duration::from_millis(50 << attempt)).await;
        metas = loc.store.list(Some(&dir)).try_collect().await;
    }
    let metas: Vec<object_store::ObjectMeta> =
        metas.map_err(|e| StoreError::os(format!("{}/{VERSIONS_DIR}", loc.url), e))?;
    let mut v: Vec<u64> = metas
        .iter()
        .filter_map(|m| m.location.filename().and_then(parse_manifest_name))
        .collect();
    v.sort_unstable();
    Ok(v)
}

/// The newest committed version; [`StoreError::NotADataset`] where there is none.
pub async fn latest(loc: &Location) -> Result<u64> {
    list(loc)
        .await?
        .last()
        .copied()
        .ok_or_else(|| StoreError::NotADataset {
            url: loc.url.clone(),
        })
}

/// The manifest of version `v`, checked to name that version.
pub async fn read(loc: &Location, v: u64) -> Result<Manifest> {
    let rel = manifest_path(v);
    let shown = format!("{}/{rel}", loc.url);
    let bytes = match loc.store.get(&loc.path(&rel)).await {
        Ok(r) => r.bytes().await.map_err(|e| StoreError::os(&shown, e))?,
        Err(object_store::Error::NotFound { .. }) => {
            return Err(StoreError::VersionNotFound {
                url: loc.url.clone(),
                version: v,
                latest: latest(loc).await?,
            });
        }
        Err(e) => return Err(StoreError::os(&shown, e)),
    };
    let m = Manifest::from_json(&shown, &bytes)?;
    if m.version != v {
        return Err(StoreError::corrupt(
            &shown,
            format!("names version {}, expected {v}", m.version),
        ));
    }
    Ok(m)
}

/// The manifest of a version (`None`: the newest).
pub async fn read_or_latest(loc: &Location, version: Option<u64>) -> Result<Manifest> {
    let v = match version {
        Some(v) => v,
        None => latest(loc).await?,
    };
    read(loc, v).await
}
