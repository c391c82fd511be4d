//! A dataset handle: open, create, list versions, read manifests, commit.
use std::sync::Arc;
use std::time::Duration;

use futures::TryStreamExt;
use hslake_schemas::{DatasetSchema, FORMAT_VERSION};
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};

use crate::location::{self, Location};
use crate::manifest::{
    manifest_path, parse_manifest_name, Manifest, Provenance, ShardEntry, VERSIONS_DIR,
};
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
            loc: location::parse(url)?,
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
            loc: location::parse(url)?,
        };
        let m = Manifest {
            format_version: FORMAT_VERSION,
            version: 0,
            parent: None,
            committed_at: now(),
            schema,
            provenance,
            shards: vec![],
            properties: Default::default(),
        };
        match ds.put_manifest(&m).await? {
            true => {
                tracing::info!(url = %ds.loc.url, "created dataset");
                Ok(ds)
            }
            false => Err(StoreError::AlreadyExists {
                url: ds.loc.url.clone(),
            }),
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
                if m.schema != schema {
                    return Err(StoreError::SchemaMismatch {
                        url: ds.loc.url.clone(),
                        detail: schema_diff(&m.schema, &schema),
                    });
                }
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
        let dir = self.loc.path(VERSIONS_DIR);
        let metas: Vec<_> = self
            .loc
            .store
            .list(Some(&dir))
            .try_collect()
            .await
            .map_err(|e| StoreError::os(format!("{}/{VERSIONS_DIR}", self.loc.url), e))?;
        let mut v: Vec<u64> = metas
            .iter()
            .filter_map(|m| m.location.filename().and_then(parse_manifest_name))
            .collect();
        v.sort_unstable();
        Ok(v)
    }

    /// The newest committed version.
    pub async fn latest_version(&self) -> Result<u64> {
        self.versions()
            .await?
            .last()
            .copied()
            .ok_or_else(|| StoreError::NotADataset {
                url: self.loc.url.clone(),
            })
    }

    /// The manifest of a version (`None`: the newest).
    pub async fn manifest(&self, version: Option<u64>) -> Result<Manifest> {
        let v = match version {
            Some(v) => v,
            None => self.latest_version().await?,
        };
        let rel = manifest_path(v);
        let path = self.loc.path(&rel);
        let shown = format!("{}/{rel}", self.loc.url);
        let bytes = match self.loc.store.get(&path).await {
            Ok(r) => r.bytes().await.map_err(|e| StoreError::os(&shown, e))?,
            Err(object_store::Error::NotFound { .. }) => {
                let latest = self.latest_version().await?;
                return Err(StoreError::VersionNotFound {
                    url: self.loc.url.clone(),
                    version: v,
                    latest,
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

    /// Write a manifest put-if-absent; `false` when that version already exists.
    async fn put_manifest(&self, m: &Manifest) -> Result<bool> {
        let rel = manifest_path(m.version);
        let opts = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        match self
            .loc
            .store
            .put_opts(&self.loc.path(&rel), PutPayload::from(m.to_json()), opts)
            .await
        {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. })
            | Err(object_store::Error::Precondition { .. }) => Ok(false),
            Err(e) => Err(StoreError::os(format!("{}/{rel}", self.loc.url), e)),
        }
    }

    /// Commit `shards` on top of the newest version as version N+1.
    ///
    /// The manifest is written put-if-absent, so two writers can never both commit N+1;
    /// the loser re-reads the new head and retries on top of it.
    pub async fn commit(
        &self,
        schema: &DatasetSchema,
        shards: &[ShardEntry],
        properties: &std::collections::BTreeMap<String, String>,
    ) -> Result<u64> {
        const ATTEMPTS: u32 = 64;
        for attempt in 0..ATTEMPTS {
            let head = self.manifest(None).await?;
            if &head.schema != schema {
                return Err(StoreError::SchemaMismatch {
                    url: self.loc.url.clone(),
                    detail: schema_diff(&head.schema, schema),
                });
            }
            let mut next = head.clone();
            next.version = head.version + 1;
            next.parent = Some(head.version);
            next.committed_at = now();
            next.shards.extend_from_slice(shards);
            next.properties
                .extend(properties.iter().map(|(k, v)| (k.clone(), v.clone())));
            if self.put_manifest(&next).await? {
                tracing::debug!(url = %self.loc.url, version = next.version, shards = shards.len(), "committed");
                return Ok(next.version);
            }
            tracing::debug!(url = %self.loc.url, attempt, "commit conflict, retrying on the new head");
            // Jittered backoff keeps many racing writers from colliding in lockstep.
            let ms = rand::random_range(1..(5u64 << attempt.min(6)));
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        Err(StoreError::CommitContention {
            url: self.loc.url.clone(),
            attempts: ATTEMPTS,
        })
    }
}

fn schema_diff(have: &DatasetSchema, want: &DatasetSchema) -> String {
    let a = serde_json::to_value(have).unwrap_or_default();
    let b = serde_json::to_value(want).unwrap_or_default();
    let mut diffs = vec![];
    if let (Some(a), Some(b)) = (a.as_object(), b.as_object()) {
        for (k, va) in a {
            let vb = b.get(k).cloned().unwrap_or_default();
            if *va != vb {
                diffs.push(format!("{k}: dataset has {va}, requested {vb}"));
            }
        }
    }
    diffs.join("; ")
}

pub(crate) fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}
