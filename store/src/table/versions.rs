//! A dataset's committed versions: listing them and reading one's manifest.
use futures::{StreamExt, TryStreamExt};
use object_store::ObjectStoreExt;

use crate::io::location::Location;
use crate::table::manifest::{
    check_manifest_size, manifest_path, parse_manifest_name, Manifest, VERSIONS_DIR,
};
use crate::{Result, StoreError};

/// Every committed version at `loc`, ascending (empty where no dataset is).
pub async fn list(loc: &Location) -> Result<Vec<u64>> {
    let metas = loc.list_dir(VERSIONS_DIR).await?;
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

/// The manifest of version `v`, checked to name that version, for reading its data or
/// committing on it: a manifest that names a shard more than once is refused
/// ([`Manifest::refuse_repeats`]).
pub async fn read(loc: &Location, v: u64) -> Result<Manifest> {
    let m = read_as_stored(loc, v).await?;
    m.refuse_repeats(&loc.url, &format!("{}/{}", loc.url, manifest_path(v)))?;
    Ok(m)
}

/// The manifest of version `v`, checked to name that version, with a shard named more than
/// once kept once and recorded in [`Manifest::repeated`]: for those that report or fix a
/// version (`verify`, `repair`) or need only which files it names (vacuum, `cp`).
pub async fn read_as_stored(loc: &Location, v: u64) -> Result<Manifest> {
    let rel = manifest_path(v);
    let shown = format!("{}/{rel}", loc.url);
    let bytes = match loc.store.get(&loc.path(&rel)).await {
        Ok(r) => {
            // Refused by its size before its body is read.
            check_manifest_size(&shown, r.meta.size)?;
            r.bytes().await.map_err(|e| StoreError::os(&shown, e))?
        }
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

/// Manifests read at once by [`read_each`].
const PARALLEL_READS: usize = 16;

/// The manifests of `versions` as stored ([`read_as_stored`]), in the same order, read several
/// at a time (vacuum, verify and copy read a dataset's whole history, where a version before a
/// repair may name a shard twice); each read succeeds or fails on its own.
pub fn read_each<'a>(
    loc: &'a Location,
    versions: &[u64],
) -> impl futures::Stream<Item = Result<Manifest>> + 'a {
    // Futures made up front: a stream mapping through a closure trips rustc's higher-ranked
    // `Send` check in spawned callers.
    let reads: Vec<_> = versions.iter().map(|&v| read_as_stored(loc, v)).collect();
    futures::stream::iter(reads).buffered(PARALLEL_READS)
}

/// [`read_each`], failing on the first manifest that cannot be read.
pub async fn read_many(loc: &Location, versions: &[u64]) -> Result<Vec<Manifest>> {
    read_each(loc, versions).try_collect().await
}

/// The manifest of a version (`None`: the newest), as [`read`] reads it.
pub async fn read_or_latest(loc: &Location, version: Option<u64>) -> Result<Manifest> {
    read(loc, version_or_latest(loc, version).await?).await
}

/// The manifest of a version (`None`: the newest), as [`read_as_stored`] reads it.
pub async fn read_or_latest_as_stored(loc: &Location, version: Option<u64>) -> Result<Manifest> {
    read_as_stored(loc, version_or_latest(loc, version).await?).await
}

async fn version_or_latest(loc: &Location, version: Option<u64>) -> Result<u64> {
    match version {
        Some(v) => Ok(v),
        None => latest(loc).await,
    }
}
