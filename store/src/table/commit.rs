//! The commit protocol, in one place. Every manifest hslake writes lands through
//! [`put_manifest`], a put-if-absent; every new version through [`Committer::commit`]: read the
//! head, check the change against it, build the next manifest, put it if absent, and after a
//! conflict back off (jittered) and try again on top of the new head.
use std::collections::BTreeMap;
use std::time::Duration;

use hslake_schemas::{DatasetSchema, FORMAT_VERSION};
use object_store::{PutMode, PutOptions, PutPayload};

use crate::io::location::Location;
use crate::table::manifest::{manifest_path, Manifest, Provenance, ShardEntry};
use crate::table::versions;
use crate::{Result, StoreError};

/// Attempts a commit makes before it gives up on contention.
pub const ATTEMPTS: u32 = 64;

/// Why a put-if-absent did not land: the two cases a retry loop tells apart.
#[derive(Debug)]
pub enum CommitError {
    /// The version exists already (another writer committed it first): retry on the new head.
    Conflict,
    /// Anything else; retrying the same put would not help.
    Other(StoreError),
}

/// Write `m` as its version's manifest at `loc`, only if that version does not exist yet
/// (`If-None-Match: *` on S3, an exclusive create on local disk).
pub async fn put_manifest(loc: &Location, m: &Manifest) -> Result<(), CommitError> {
    let rel = manifest_path(m.version);
    let opts = PutOptions {
        mode: PutMode::Create,
        ..Default::default()
    };
    match loc
        .store
        .put_opts(&loc.path(&rel), PutPayload::from(m.to_json()), opts)
        .await
    {
        Ok(_) => Ok(()),
        Err(object_store::Error::AlreadyExists { .. })
        | Err(object_store::Error::Precondition { .. }) => Err(CommitError::Conflict),
        Err(e) => Err(CommitError::Other(StoreError::os(
            format!("{}/{rel}", loc.url),
            e,
        ))),
    }
}

/// Version 0 of a dataset: its schema and provenance, no shards.
pub fn initial_manifest(schema: DatasetSchema, provenance: Provenance) -> Manifest {
    Manifest {
        format_version: FORMAT_VERSION,
        version: 0,
        parent: None,
        committed_at: now(),
        schema,
        provenance,
        shards: vec![],
        properties: Default::default(),
    }
}

/// What one commit adds on top of whatever the head is when it lands.
#[derive(Debug, Clone, Copy)]
pub struct Change<'a> {
    /// The schema the shards were written with; the head must have the same.
    pub schema: &'a DatasetSchema,
    /// Shard files to add, already uploaded under `data/`.
    pub shards: &'a [ShardEntry],
    /// Manifest properties to set (e.g. capture progress).
    pub properties: &'a BTreeMap<String, String>,
}

/// Commits changes to the dataset at one location.
#[derive(Debug, Clone, Copy)]
pub struct Committer<'a> {
    loc: &'a Location,
}

impl<'a> Committer<'a> {
    /// A committer for the dataset at `loc`.
    pub fn new(loc: &'a Location) -> Self {
        Committer { loc }
    }

    /// Commit `change` as the version after the head it lands on, and return that version.
    ///
    /// Two writers can never both commit N+1: the loser's put meets a conflict, and it retries
    /// on top of the new head, up to [`ATTEMPTS`] times.
    pub async fn commit(&self, change: Change<'_>) -> Result<u64> {
        for attempt in 0..ATTEMPTS {
            let head = versions::read_or_latest(self.loc, None).await?;
            self.check_head(&head, &change)?;
            let next = next_manifest(&head, &change, now());
            match put_manifest(self.loc, &next).await {
                Ok(()) => {
                    tracing::debug!(url = %self.loc.url, version = next.version, shards = change.shards.len(), "committed");
                    return Ok(next.version);
                }
                Err(CommitError::Conflict) => {
                    tracing::debug!(url = %self.loc.url, attempt, "commit conflict, retrying on the new head");
                    tokio::time::sleep(backoff(attempt)).await;
                }
                Err(CommitError::Other(e)) => return Err(e),
            }
        }
        Err(StoreError::CommitContention {
            url: self.loc.url.clone(),
            attempts: ATTEMPTS,
        })
    }

    /// The pre-commit check, run on every head an attempt builds on: the head's schema must be
    /// the one the shards were written with. Checks that need the head belong here (sample ids
    /// it already holds, shards that must exist), and so does recognising this change's own
    /// manifest as the head after a put whose response was lost (its retry sees a conflict).
    fn check_head(&self, head: &Manifest, change: &Change<'_>) -> Result<()> {
        check_schema(&self.loc.url, &head.schema, change.schema)
    }
}

/// The manifest that adds `change` on top of `head`.
fn next_manifest(head: &Manifest, change: &Change<'_>, committed_at: String) -> Manifest {
    let mut next = head.clone();
    next.version = head.version + 1;
    next.parent = Some(head.version);
    next.committed_at = committed_at;
    next.shards.extend_from_slice(change.shards);
    next.properties.extend(
        change
            .properties
            .iter()
            .map(|(k, v)| (k.clone(), v.clone())),
    );
    next
}

/// Wait before the attempt after `attempt`: random up to 5 ms, doubling to 320 ms, so that
/// racing writers do not collide in lockstep.
fn backoff(attempt: u32) -> Duration {
    Duration::from_millis(rand::random_range(1..(5u64 << attempt.min(6))))
}

/// [`StoreError::SchemaMismatch`] naming each field where the dataset's schema `have` differs
/// from the requested `want`.
pub(crate) fn check_schema(url: &str, have: &DatasetSchema, want: &DatasetSchema) -> Result<()> {
    if have == want {
        return Ok(());
    }
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
    Err(StoreError::SchemaMismatch {
        url: url.to_string(),
        detail: diffs.join("; "),
    })
}

/// The commit time as written in manifests: RFC 3339 UTC, milliseconds.
pub(crate) fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

#[cfg(test)]
mod tests {
    use hslake_schemas::{CapturePoint, DType};

    use super::*;

    fn schema(dtype: DType) -> DatasetSchema {
        DatasetSchema::new(
            "m",
            "LlamaForCausalLM",
            8,
            4,
            100,
            dtype,
            vec![CapturePoint::LayerOutput(1)],
        )
        .unwrap()
    }

    fn shard(path: &str) -> ShardEntry {
        ShardEntry {
            path: path.into(),
            bytes: 10,
            rows: 2,
            tokens: 7,
            raw_bytes: 40,
            min_sample_id: 0,
            max_sample_id: 1,
            crc32c: 5,
            row_groups: vec![2],
        }
    }

    #[test]
    fn next_manifest_appends_shards_and_properties_to_the_head() {
        let s = schema(DType::Bf16);
        let mut head = initial_manifest(s.clone(), Provenance::default());
        head.version = 4;
        head.shards = vec![shard("data/a.parquet")];
        head.properties = [("kept".to_string(), "1".to_string())].into();
        let props = [("step".to_string(), "9".to_string())].into();
        let change = Change {
            schema: &s,
            shards: &[shard("data/b.parquet")],
            properties: &props,
        };
        let next = next_manifest(&head, &change, "t".into());
        assert_eq!((next.version, next.parent), (5, Some(4)));
        assert_eq!(next.committed_at, "t");
        let paths: Vec<&str> = next.shards.iter().map(|s| s.path.as_str()).collect();
        assert_eq!(paths, ["data/a.parquet", "data/b.parquet"]);
        assert_eq!(next.properties.len(), 2);
    }

    #[test]
    fn backoff_grows_and_stays_bounded() {
        for attempt in 0..100 {
            let ms = backoff(attempt).as_millis() as u64;
            assert!((1..5 << attempt.min(6)).contains(&ms), "{attempt}: {ms}");
        }
    }

    #[test]
    fn schema_mismatch_names_the_differing_field() {
        let err = check_schema("memory://x", &schema(DType::Bf16), &schema(DType::F16))
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "memory://x: dataset schema differs from the one requested: \
             dtype: dataset has \"bf16\", requested \"f16\""
        );
        assert!(check_schema("memory://x", &schema(DType::F16), &schema(DType::F16)).is_ok());
    }

    #[tokio::test]
    async fn put_manifest_lands_once_and_then_conflicts() {
        let loc = crate::io::location::parse("memory://commit-put-once").unwrap();
        let m = initial_manifest(schema(DType::Bf16), Provenance::default());
        assert!(put_manifest(&loc, &m).await.is_ok());
        assert!(matches!(
            put_manifest(&loc, &m).await,
            Err(CommitError::Conflict)
        ));
    }
}
