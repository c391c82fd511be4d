//! A dataset handle: open, create, list versions, read manifests, commit.
use std::sync::Arc;

use hslake_schemas::DatasetSchema;
use object_store::path::Path;
use object_store::ObjectStore;

use crate::io::location::{self, Location};
use crate::table::commit::{self, Change, CommitError, Committer};
use crate::table::manifest::{Manifest, Provenance, ShardEntry};
use crate::table::versions;
use crate::{Result, StoreError};

/// A dataset at a URL: a prefix in an object store holding manifests and shards.
#[derive(Debug, Clone)]
pub struct Dataset {
    loc: Location,
}

impl Dataset {
    /// Open an existing dataset.
    pub async fn open(url: &str) -> Result<Dataset> {
        let ds = Dataset {
            loc: location::parse_dataset(url)?,
        };
        if ds.versions().await?.is_empty() {
            return Err(StoreError::NotADataset {
                url: ds.loc.url.clone(),
            });
        }
        Ok(ds)
    }

    /// Create a dataset: commit version 0 with no shards. Fails if one exists.
    pub async fn create(
        url: &str,
        schema: DatasetSchema,
        provenance: Provenance,
    ) -> Result<Dataset> {
        schema.check()?;
        let ds = Dataset {
            loc: location::parse_dataset(url)?,
        };
        let first = commit::initial_manifest(schema, provenance);
        let mut failures = 0;
        loop {
            // A put-if-absent that failed without landing (read back) is safe to repeat.
            match commit::put_manifest_checked(&ds.loc, &first).await {
                Ok(()) => {
                    tracing::info!(url = %ds.loc.url, "created dataset");
                    return Ok(ds);
                }
                Err(CommitError::Conflict) => {
                    return Err(StoreError::AlreadyExists {
                        url: ds.loc.url.clone(),
                    })
                }
                Err(CommitError::Other(e)) if failures < commit::UNKNOWN_OUTCOME_RETRIES => {
                    failures += 1;
                    tracing::warn!(url = %ds.loc.url, error = %e, "creating the dataset failed; retrying");
                }
                Err(CommitError::Other(e)) => return Err(e),
            }
        }
    }

    /// Open a dataset, creating it if absent; an existing one must have the same schema.
    pub async fn open_or_create(
        url: &str,
        schema: DatasetSchema,
        provenance: Provenance,
    ) -> Result<Dataset> {
        match Dataset::create(url, schema.clone(), provenance).await {
            Ok(ds) => Ok(ds),
            Err(StoreError::AlreadyExists { .. }) => {
                let ds = Dataset::open(url).await?;
                let m = ds.manifest(None).await?;
                commit::check_schema(ds.url(), &m.schema, &schema)?;
                Ok(ds)
            }
            Err(e) => Err(e),
        }
    }

    /// The canonical URL.
    pub fn url(&self) -> &str {
        &self.loc.url
    }

    /// The location (store and prefix).
    pub fn location(&self) -> &Location {
        &self.loc
    }

    /// The object store holding the dataset.
    pub fn object_store(&self) -> Arc<dyn ObjectStore> {
        self.loc.store.clone()
    }

    /// Full object path of a dataset-relative path.
    pub fn object_path(&self, rel: &str) -> Path {
        self.loc.path(rel)
    }

    /// Every committed version, ascending.
    pub async fn versions(&self) -> Result<Vec<u64>> {
        versions::list(&self.loc).await
    }

    /// The newest committed version.
    pub async fn latest_version(&self) -> Result<u64> {
        versions::latest(&self.loc).await
    }

    /// The manifest of a version (`None`: the newest), for reading its data: one that names a
    /// shard more than once is refused ([`StoreError::RepeatedShard`]).
    pub async fn manifest(&self, version: Option<u64>) -> Result<Manifest> {
        versions::read_or_latest(&self.loc, version).await
    }

    /// The manifest of a version (`None`: the newest) as stored, a shard named more than once
    /// kept once and recorded in [`Manifest::repeated`]: for reports and repairs (`verify`).
    pub async fn manifest_as_stored(&self, version: Option<u64>) -> Result<Manifest> {
        versions::read_or_latest_as_stored(&self.loc, version).await
    }

    /// Commit `shards` on top of the newest version as version N+1 (see [`Committer`]).
    pub async fn commit(
        &self,
        schema: &DatasetSchema,
        shards: &[ShardEntry],
        properties: &std::collections::BTreeMap<String, String>,
    ) -> Result<u64> {
        Committer::new(&self.loc)
            .commit(Change {
                schema,
                shards,
                properties,
                removed: &[],
                drop_repeats: false,
            })
            .await
    }
}
