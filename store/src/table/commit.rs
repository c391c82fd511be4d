//! The commit protocol, in one place. Every manifest hslake writes lands through
//! [`put_manifest`], a put-if-absent; every new version through [`Committer::commit`]: read the
//! head, check the change against it (schema, shard paths, shards present in storage, no
//! sample id twice), build the next manifest, put it if absent, and after a conflict back off
//! (jittered) and try again on top of the new head.
//!
//! Every manifest a commit writes carries the commit's id. A put whose outcome is unknown
//! (timeout, reset, or a 412 on a retry of a put that did land) is resolved by reading the
//! manifest at that version back: if it carries our id, the commit landed.
//!
//! Vacuum takes part in the same order (`crate::vacuum`): before it deletes anything it puts a
//! version of its own ([`vacuum_manifest`]) whose mark says which files it may delete (those
//! last modified at or before its cutoff), and every later manifest carries the mark forward.
//! The shard-presence check refuses a new shard that old, so a commit either lands before the
//! vacuum's version (and the vacuum, conflicting, starts over and sees the shard as live) or
//! after it (and refuses the shard by name): no commit can name a file a vacuum deletes.
use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use hslake_schemas::{DatasetSchema, FORMAT_VERSION};
use object_store::{ObjectStoreExt, PutMode, PutOptions, PutPayload};

use crate::io::location::Location;
use crate::table::manifest::{
    canonical_shard_path, manifest_path, Manifest, Provenance, ShardEntry, VacuumMark,
};
use crate::table::sample_ids::{self, SHOWN_DUPLICATES};
use crate::table::versions;
use crate::{Result, StoreError};

/// Attempts a commit makes before it gives up on contention.
pub const ATTEMPTS: u32 = 64;

/// Puts that failed with an unknown outcome and, read back, had not landed, that a commit
/// retries before it reports the failure.
pub const UNKNOWN_OUTCOME_RETRIES: u32 = 3;

/// Shard HEAD requests a commit runs at once.
const PARALLEL_HEADS: usize = 16;

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
        commit_id: Some(new_commit_id()),
        vacuum: None,
        noncanonical_paths: vec![],
        repeated: vec![],
    }
}

/// A fresh id for one commit, written into each manifest it tries to put.
pub fn new_commit_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// What is at a version after a put whose outcome is unknown.
#[derive(Debug, PartialEq)]
pub enum Outcome {
    /// Exactly the manifest we put: the put landed.
    Ours,
    /// Another manifest is there.
    Theirs,
    /// Nothing is there: the put did not land.
    Absent,
}

/// Read back version `version` and tell whether `json` (the bytes we put) is what landed there.
/// Every commit writes its own commit id into its manifest, so two writers' manifests never
/// have the same bytes.
pub async fn outcome(loc: &Location, version: u64, json: &[u8]) -> Result<Outcome> {
    let rel = manifest_path(version);
    let shown = format!("{}/{rel}", loc.url);
    let bytes = match loc.store.get(&loc.path(&rel)).await {
        Ok(r) => r.bytes().await.map_err(|e| StoreError::os(&shown, e))?,
        Err(object_store::Error::NotFound { .. }) => return Ok(Outcome::Absent),
        Err(e) => return Err(StoreError::os(&shown, e)),
    };
    Ok(if bytes.as_ref() == json {
        Outcome::Ours
    } else {
        Outcome::Theirs
    })
}

/// [`put_manifest`], with a failure whose outcome is unknown resolved by reading the version
/// back: a timeout or reset may hide a put that landed, and a 412 may answer object_store's
/// retry of a put whose first response was lost. Where our own manifest is there, the put
/// succeeded; where another is, it is a conflict; otherwise the failure stands.
pub async fn put_manifest_checked(loc: &Location, m: &Manifest) -> Result<(), CommitError> {
    let failure = match put_manifest(loc, m).await {
        Ok(()) => return Ok(()),
        Err(f) => f,
    };
    match outcome(loc, m.version, &m.to_json()).await {
        Ok(Outcome::Ours) => {
            tracing::info!(url = %loc.url, version = m.version, failure = %describe(&failure),
                "manifest put reported failure but our manifest is there (response lost): it landed");
            Ok(())
        }
        Ok(Outcome::Theirs) => Err(CommitError::Conflict),
        Ok(Outcome::Absent) => Err(failure),
        Err(e) => {
            tracing::warn!(url = %loc.url, version = m.version, error = %e, "could not read back a manifest put of unknown outcome");
            Err(failure)
        }
    }
}

fn describe(f: &CommitError) -> String {
    match f {
        CommitError::Conflict => "conflict".into(),
        CommitError::Other(e) => e.to_string(),
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
    /// Shard paths to leave out of the new version (`hslake repair` drops missing shards).
    pub removed: &'a [String],
    /// Commit on a head that names a shard more than once, keeping each shard once (`hslake
    /// repair --drop-repeats`); otherwise such a head is refused.
    pub drop_repeats: bool,
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
    /// on top of the new head, up to [`ATTEMPTS`] times. A put whose response was lost is
    /// recognised by its commit id, so a commit lands once or not at all.
    pub async fn commit(&self, change: Change<'_>) -> Result<u64> {
        let url = &self.loc.url;
        check_change_paths(url, change.shards)?;
        let ids = sample_ids::change_ids(self.loc, change.shards).await?;
        let twice = sample_ids::repeated(&ids);
        if !twice.is_empty() {
            return Err(duplicates(url, None, &twice));
        }
        let commit_id = new_commit_id();
        // Versions whose put failed with an unknown outcome that the read-back could not settle.
        let mut unsettled: Vec<u64> = vec![];
        for attempt in 0..ATTEMPTS {
            let head = versions::read_or_latest_as_stored(self.loc, None).await?;
            if let Some(v) = self.own_among(&mut unsettled, &head, &commit_id).await? {
                return Ok(v);
            }
            self.check_head(&head, &change, &ids).await?;
            let next = next_manifest(url, &head, &change, now(), &commit_id)?;
            match put_manifest_checked(self.loc, &next).await {
                Ok(()) => {
                    tracing::debug!(%url, version = next.version, shards = change.shards.len(), "committed");
                    return Ok(next.version);
                }
                Err(CommitError::Conflict) => {
                    tracing::debug!(%url, attempt, "commit conflict, retrying on the new head");
                }
                Err(CommitError::Other(e)) => {
                    if unsettled.len() as u32 >= UNKNOWN_OUTCOME_RETRIES {
                        return Err(e);
                    }
                    tracing::warn!(%url, version = next.version, error = %e, "manifest put failed; retrying on the head");
                    unsettled.push(next.version);
                }
            }
            tokio::time::sleep(backoff(attempt)).await;
        }
        Err(StoreError::CommitContention {
            url: self.loc.url.clone(),
            attempts: ATTEMPTS,
        })
    }

    /// The version among `unsettled` (puts of unknown outcome) that now holds our manifest, if
    /// any; those at or below `head` are settled by reading them and leave the list.
    async fn own_among(
        &self,
        unsettled: &mut Vec<u64>,
        head: &Manifest,
        commit_id: &str,
    ) -> Result<Option<u64>> {
        let (due, later): (Vec<u64>, Vec<u64>) =
            unsettled.iter().partition(|&&v| v <= head.version);
        *unsettled = later;
        for v in due {
            let m = if v == head.version {
                head.clone()
            } else {
                versions::read(self.loc, v).await?
            };
            if m.commit_id.as_deref() == Some(commit_id) {
                tracing::info!(url = %self.loc.url, version = v, "an earlier put of this commit landed (response lost); not committing again");
                return Ok(Some(v));
            }
        }
        Ok(None)
    }

    /// The pre-commit check, run on every head an attempt builds on, so that a retry on a new
    /// head checks again: the head must name each shard once (unless the change drops the
    /// repeats), its schema must be the one the shards were written with, it must not name the
    /// change's shards already, the shards must be in storage as their
    /// entries say, and no sample id of the change (`ids`, sorted) may be in the head.
    async fn check_head(&self, head: &Manifest, change: &Change<'_>, ids: &[u64]) -> Result<()> {
        let url = &self.loc.url;
        if !change.drop_repeats {
            head.refuse_repeats(url, &format!("{url}/{}", manifest_path(head.version)))?;
        }
        check_schema(url, &head.schema, change.schema)?;
        let named: HashSet<&str> = head.shards.iter().map(|h| h.path.as_str()).collect();
        if let Some(s) = change
            .shards
            .iter()
            .find(|s| named.contains(s.path.as_str()))
        {
            return Err(StoreError::DuplicateShard {
                url: url.clone(),
                path: s.path.clone(),
                version: Some(head.version),
            });
        }
        // Futures made up front: a stream mapping borrowed entries through a closure trips
        // rustc's higher-ranked `Send` check in spawned callers.
        let heads: Vec<_> = change
            .shards
            .iter()
            .map(|s| check_present(self.loc, s, head.vacuum))
            .collect();
        futures::stream::iter(heads)
            .buffer_unordered(PARALLEL_HEADS)
            .try_collect::<()>()
            .await?;
        let held = sample_ids::held_by(self.loc, &head.shards, ids).await?;
        if !held.is_empty() {
            return Err(duplicates(url, Some(head.version), &held));
        }
        Ok(())
    }
}

/// Refuse shard paths that are not canonical (`data/<name>`) or that repeat within a change.
fn check_change_paths(url: &str, shards: &[ShardEntry]) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    for s in shards {
        match canonical_shard_path(&s.path) {
            Ok(c) if c == s.path => {}
            Ok(c) => {
                return Err(StoreError::Usage(format!(
                    "{url}: commit refused: shard path {:?} is not canonical (expected {c:?})",
                    s.path
                )))
            }
            Err(why) => {
                return Err(StoreError::Usage(format!(
                    "{url}: commit refused: shard path {:?} {why}",
                    s.path
                )))
            }
        }
        if !seen.insert(s.path.as_str()) {
            return Err(StoreError::DuplicateShard {
                url: url.to_string(),
                path: s.path.clone(),
                version: None,
            });
        }
    }
    Ok(())
}

/// A HEAD of one new shard: it must exist with the size its entry records, and be younger than
/// the cutoff of every vacuum up to the head (`mark`), which may be deleting older files that
/// no manifest names.
async fn check_present(loc: &Location, s: &ShardEntry, mark: Option<VacuumMark>) -> Result<()> {
    let missing = |reason: String| StoreError::ShardMissing {
        url: loc.url.clone(),
        path: s.path.clone(),
        reason,
    };
    match loc.store.head(&loc.path(&s.path)).await {
        Ok(meta) if meta.size == s.bytes => match mark {
            Some(v) if v.may_have_deleted(meta.last_modified) => {
                Err(StoreError::ShardPredatesVacuum {
                    url: loc.url.clone(),
                    path: s.path.clone(),
                    modified: meta.last_modified,
                    cutoff: v.cutoff,
                    vacuum_version: v.version,
                })
            }
            _ => Ok(()),
        },
        Ok(meta) => Err(missing(format!(
            "file is {} bytes, its entry says {}",
            meta.size, s.bytes
        ))),
        Err(object_store::Error::NotFound { .. }) => Err(missing(
            "not in storage (deleted since it was written, e.g. by a vacuum with a short grace period?)"
                .into(),
        )),
        Err(e) => Err(StoreError::os(format!("{}/{}", loc.url, s.path), e)),
    }
}

fn duplicates(url: &str, version: Option<u64>, ids: &[u64]) -> StoreError {
    StoreError::DuplicateSamples {
        url: url.to_string(),
        version,
        count: ids.len(),
        examples: ids.iter().take(SHOWN_DUPLICATES).copied().collect(),
    }
}

/// The manifest that adds `change` on top of `head`, carrying `commit_id`.
fn next_manifest(
    url: &str,
    head: &Manifest,
    change: &Change<'_>,
    committed_at: String,
    commit_id: &str,
) -> Result<Manifest> {
    let version = head.version.checked_add(1).ok_or_else(|| {
        StoreError::corrupt(
            format!("{url}/{}", manifest_path(head.version)),
            "the newest version is the largest possible number, so no version can follow it (a planted manifest?)",
        )
    })?;
    let mut next = head.clone();
    // Written by this build, so in its format, whatever the head's (an older one it reads).
    next.format_version = FORMAT_VERSION;
    next.version = version;
    next.parent = Some(head.version);
    next.committed_at = committed_at;
    next.commit_id = Some(commit_id.to_string());
    next.noncanonical_paths.clear();
    // The head as stored holds each shard once; its repeats are left behind.
    next.repeated.clear();
    let removed: HashSet<&String> = change.removed.iter().collect();
    next.shards.retain(|s| !removed.contains(&s.path));
    next.shards.extend_from_slice(change.shards);
    next.properties.extend(
        change
            .properties
            .iter()
            .map(|(k, v)| (k.clone(), v.clone())),
    );
    Ok(next)
}

/// The manifest of a vacuum's version on top of `head`: the same shards and properties, marked
/// as this vacuum's, with the later of `cutoff` (the newest modification time among the files
/// it is about to delete) and the head's cutoff.
pub fn vacuum_manifest(
    url: &str,
    head: &Manifest,
    cutoff: chrono::DateTime<chrono::Utc>,
    commit_id: &str,
) -> Result<Manifest> {
    let keep = Change {
        schema: &head.schema,
        shards: &[],
        properties: &BTreeMap::new(),
        removed: &[],
        drop_repeats: false,
    };
    let mut next = next_manifest(url, head, &keep, now(), commit_id)?;
    next.vacuum = Some(VacuumMark {
        version: next.version,
        cutoff: head.vacuum.map_or(cutoff, |v| v.cutoff.max(cutoff)),
    });
    Ok(next)
}

/// Wait before the attempt after `attempt`: random up to 5 ms, doubling to 320 ms, so that
/// racing writers do not collide in lockstep.
pub(crate) fn backoff(attempt: u32) -> Duration {
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
        head.format_version = 2;
        head.shards = vec![shard("data/a.parquet")];
        head.properties = [("kept".to_string(), "1".to_string())].into();
        let props = [("step".to_string(), "9".to_string())].into();
        let change = Change {
            schema: &s,
            shards: &[shard("data/b.parquet")],
            properties: &props,
            removed: &[],
            drop_repeats: false,
        };
        let next = next_manifest("memory://x", &head, &change, "t".into(), "c1").unwrap();
        assert_eq!((next.version, next.parent), (5, Some(4)));
        assert_eq!(next.format_version, FORMAT_VERSION);
        assert_eq!(next.committed_at, "t");
        assert_eq!(next.commit_id.as_deref(), Some("c1"));
        let paths: Vec<&str> = next.shards.iter().map(|s| s.path.as_str()).collect();
        assert_eq!(paths, ["data/a.parquet", "data/b.parquet"]);
        assert_eq!(next.properties.len(), 2);
    }

    fn at(secs: i64, millis: u32) -> chrono::DateTime<chrono::Utc> {
        chrono::DateTime::from_timestamp(secs, millis * 1_000_000).unwrap()
    }

    #[test]
    fn every_commit_carries_the_vacuum_mark_and_a_change_can_drop_shards() {
        let s = schema(DType::Bf16);
        let mut head = initial_manifest(s.clone(), Provenance::default());
        head.version = 7;
        head.shards = vec![shard("data/a.parquet"), shard("data/b.parquet")];
        let mark = VacuumMark {
            version: 6,
            cutoff: at(1000, 0),
        };
        head.vacuum = Some(mark);
        let props = BTreeMap::new();
        let change = Change {
            schema: &s,
            shards: &[shard("data/c.parquet")],
            properties: &props,
            removed: &["data/a.parquet".to_string()],
            drop_repeats: false,
        };
        let next = next_manifest("memory://x", &head, &change, "t".into(), "c").unwrap();
        assert_eq!(next.vacuum, Some(mark));
        assert!(!next.is_vacuum());
        let paths: Vec<&str> = next.shards.iter().map(|s| s.path.as_str()).collect();
        assert_eq!(paths, ["data/b.parquet", "data/c.parquet"]);
    }

    #[test]
    fn a_vacuum_version_keeps_the_head_and_the_latest_cutoff() {
        let s = schema(DType::Bf16);
        let mut head = initial_manifest(s, Provenance::default());
        head.version = 3;
        head.shards = vec![shard("data/a.parquet")];
        head.properties = [("progress".to_string(), "9".to_string())].into();
        let v = vacuum_manifest("memory://x", &head, at(500, 0), "c").unwrap();
        assert!(v.is_vacuum());
        assert_eq!(
            (v.version, v.shards.clone(), v.properties.clone()),
            (4, head.shards.clone(), head.properties.clone())
        );
        assert_eq!(v.vacuum.unwrap().cutoff, at(500, 0));
        // An earlier vacuum's later cutoff stands: its deletes may still be running.
        head.vacuum = Some(VacuumMark {
            version: 2,
            cutoff: at(900, 0),
        });
        let v = vacuum_manifest("memory://x", &head, at(500, 0), "c").unwrap();
        assert_eq!(
            v.vacuum,
            Some(VacuumMark {
                version: 4,
                cutoff: at(900, 0)
            })
        );
    }

    #[test]
    fn a_cutoff_in_whole_seconds_or_milliseconds_covers_that_whole_unit() {
        let ns = chrono::DateTime::from_timestamp(1000, 250_000_001).unwrap();
        let precise = VacuumMark {
            version: 1,
            cutoff: VacuumMark::cutoff_for(ns),
        };
        assert!(precise.may_have_deleted(ns));
        assert!(!precise.may_have_deleted(ns + chrono::Duration::nanoseconds(1)));
        // Milliseconds: the HEAD of the same file may give its microseconds.
        let ms = VacuumMark {
            version: 1,
            cutoff: VacuumMark::cutoff_for(at(1000, 250)),
        };
        assert!(ms.may_have_deleted(at(1000, 250) + chrono::Duration::microseconds(999)));
        assert!(!ms.may_have_deleted(at(1000, 251)));
        // A listing that gave whole seconds: a HEAD may give the same file's milliseconds.
        let coarse = VacuumMark {
            version: 1,
            cutoff: VacuumMark::cutoff_for(at(1000, 0)),
        };
        assert!(coarse.may_have_deleted(at(999, 0)));
        assert!(coarse.may_have_deleted(at(1000, 999)));
        assert!(!coarse.may_have_deleted(at(1001, 0)));
    }

    #[test]
    fn refuses_to_build_a_version_after_the_largest_number() {
        let s = schema(DType::Bf16);
        let mut head = initial_manifest(s.clone(), Provenance::default());
        head.version = u64::MAX;
        let props = BTreeMap::new();
        let change = Change {
            schema: &s,
            shards: &[],
            properties: &props,
            removed: &[],
            drop_repeats: false,
        };
        let err = next_manifest("memory://x", &head, &change, "t".into(), "c")
            .unwrap_err()
            .to_string();
        assert!(err.contains("no version can follow it"), "{err}");
    }

    #[test]
    fn refuses_non_canonical_or_repeated_shard_paths_in_a_change() {
        let err = check_change_paths("memory://x", &[shard("data//a.parquet")]).unwrap_err();
        assert!(err.to_string().contains("not canonical"), "{err}");
        let err = check_change_paths("memory://x", &[shard("../a.parquet")]).unwrap_err();
        assert!(err.to_string().contains("../a.parquet"), "{err}");
        let err = check_change_paths(
            "memory://x",
            &[shard("data/a.parquet"), shard("data/a.parquet")],
        )
        .unwrap_err();
        assert!(
            matches!(err, StoreError::DuplicateShard { version: None, .. }),
            "{err}"
        );
        assert!(check_change_paths("memory://x", &[shard("data/a.parquet")]).is_ok());
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
