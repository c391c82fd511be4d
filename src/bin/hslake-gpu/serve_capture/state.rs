//! The daemon's durable job list under `--state URL` (a local directory or an object store),
//! written only with put-if-absent, like manifests: nothing is ever overwritten, so a daemon
//! killed at any moment leaves either the old or the new record, never half of one.
//!
//! ```text
//! jobs/00000001/spec.json          the job as submitted (JobArgs), written once
//! jobs/00000001/status-000001.json each change of state, numbered; the highest is current
//! ```
use std::collections::BTreeMap;

use anyhow::{bail, Context, Result};
use futures::TryStreamExt;
use hslake_store::location::{self, Location};
use object_store::{ObjectStoreExt, PutMode, PutOptions, PutPayload};
use serde::{Deserialize, Serialize};

use crate::capture::JobArgs;

/// Where a job is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// Waiting for the engine.
    Queued,
    /// On the engine now (or, read back after a crash, interrupted: it resumes).
    Running,
    /// Every sample captured and committed.
    Done,
    /// Stopped by an error; `error` says why.
    Failed,
    /// Stopped by `DELETE /v1/jobs/{id}`: what was captured is committed.
    Cancelled,
}

impl JobState {
    /// Whether the job will never run again.
    pub fn is_final(self) -> bool {
        matches!(
            self,
            JobState::Done | JobState::Failed | JobState::Cancelled
        )
    }

    /// The name used in JSON and metrics labels.
    pub fn name(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Running => "running",
            JobState::Done => "done",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
        }
    }

    /// Every state, for metrics that report each.
    pub const ALL: [JobState; 5] = [
        JobState::Queued,
        JobState::Running,
        JobState::Done,
        JobState::Failed,
        JobState::Cancelled,
    ];
}

/// What a finished job did, as recorded and served (the capture summary's numbers).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SummaryRecord {
    /// Samples written by the last run.
    pub samples: u64,
    /// Tokens written by the last run.
    pub tokens: u64,
    /// Samples an earlier run had committed (skipped by resume).
    pub skipped_committed: u64,
    /// Uncompressed tensor bytes written.
    pub raw_bytes: u64,
    /// Shard bytes written.
    pub written_bytes: u64,
    /// Newest committed version of the dataset after the run.
    pub version: u64,
    /// Seconds rank 0 spent in the forward and device-to-host copies.
    pub compute_secs: f64,
    /// Seconds rank 0 waited for storage.
    pub storage_wait_secs: f64,
    /// Seconds from the first batch to the last commit.
    pub run_secs: f64,
}

impl From<&hslake_capture::CaptureSummary> for SummaryRecord {
    fn from(s: &hslake_capture::CaptureSummary) -> Self {
        SummaryRecord {
            samples: s.samples,
            tokens: s.tokens,
            skipped_committed: s.skipped_committed,
            raw_bytes: s.raw_bytes,
            written_bytes: s.written_bytes,
            version: s.version,
            compute_secs: s.compute_secs,
            storage_wait_secs: s.storage_wait_secs,
            run_secs: s.run_secs,
        }
    }
}

/// One change of a job's state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusRecord {
    /// The new state.
    pub state: JobState,
    /// When (RFC 3339, UTC).
    pub at: String,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// What the run did, once it ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<SummaryRecord>,
}

impl StatusRecord {
    /// A record of `state` now.
    pub fn now(state: JobState) -> Self {
        StatusRecord {
            state,
            at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            error: None,
            summary: None,
        }
    }
}

/// A job read back from the state store.
#[derive(Debug, Clone)]
pub struct StoredJob {
    /// Its id (submission order).
    pub id: u64,
    /// As submitted.
    pub spec: JobArgs,
    /// Its state changes, oldest first (empty: queued, never started).
    pub history: Vec<StatusRecord>,
}

/// The job list under one `--state` URL.
pub struct StateStore {
    loc: Location,
}

impl StateStore {
    /// Opens (or, on local disk, creates) the state store at `url`.
    pub fn open(url: &str) -> Result<Self> {
        let loc = location::parse(url).with_context(|| format!("--state {url}"))?;
        if let Some(dir) = loc.local_dir() {
            std::fs::create_dir_all(&dir)
                .with_context(|| format!("creating the state directory {}", dir.display()))?;
        }
        Ok(StateStore { loc })
    }

    /// The store's URL.
    pub fn url(&self) -> &str {
        &self.loc.url
    }

    /// Every job, in id order, with its history.
    pub async fn load(&self) -> Result<Vec<StoredJob>> {
        let prefix = self.loc.path("jobs");
        let objects: Vec<_> = self
            .loc
            .store
            .list(Some(&prefix))
            .try_collect()
            .await
            .with_context(|| format!("listing jobs under {}", self.loc.url))?;
        // id -> (spec path, status numbers and paths)
        let mut found: BTreeMap<u64, (bool, BTreeMap<u32, object_store::path::Path>)> =
            BTreeMap::new();
        for o in objects {
            let Some(rel) = self.loc.relative(&o.location) else {
                continue;
            };
            let parts: Vec<&str> = rel.split('/').collect();
            let [_, id, name] = parts[..] else { continue };
            let Ok(id) = id.parse::<u64>() else { continue };
            let entry = found.entry(id).or_default();
            if name == "spec.json" {
                entry.0 = true;
            } else if let Some(n) = name
                .strip_prefix("status-")
                .and_then(|n| n.strip_suffix(".json"))
                .and_then(|n| n.parse::<u32>().ok())
            {
                entry.1.insert(n, o.location.clone());
            }
        }
        let mut jobs = vec![];
        for (id, (has_spec, statuses)) in found {
            if !has_spec {
                // A status without a spec cannot be written by this daemon; refuse to guess.
                bail!(
                    "{}: job {id} has status records but no spec.json",
                    self.loc.url
                );
            }
            let rel = self.spec_rel(id);
            let spec: JobArgs = match serde_json::from_slice(&self.read(&rel).await?) {
                Ok(spec) => spec,
                Err(e) => {
                    // Written before the job checks refused such values (a zstd level of 1000,
                    // say): it can never run, and one old record must not keep the daemon from
                    // starting. Its records stay where they are.
                    tracing::warn!("{}/{rel}: left out of the job list: {e}", self.loc.url);
                    continue;
                }
            };
            let mut history = vec![];
            for (n, path) in statuses {
                let rel = self.loc.relative(&path).unwrap_or_default();
                let r: StatusRecord = self
                    .read_json(&rel)
                    .await
                    .with_context(|| format!("job {id} status {n}"))?;
                history.push(r);
            }
            jobs.push(StoredJob { id, spec, history });
        }
        Ok(jobs)
    }

    /// Stores a new job with the first free id from `next`; returns the id.
    pub async fn create(&self, next: u64, spec: &JobArgs) -> Result<u64> {
        let body = serde_json::to_vec_pretty(spec)?;
        let mut id = next;
        loop {
            if self.put_new(&self.spec_rel(id), body.clone()).await? {
                return Ok(id);
            }
            // Another daemon on the same state took this id: take the next one.
            id += 1;
        }
    }

    /// Records state change number `n` (1-based) of job `id`.
    pub async fn record(&self, id: u64, n: u32, record: &StatusRecord) -> Result<()> {
        let rel = format!("jobs/{id:08}/status-{n:06}.json");
        if !self
            .put_new(&rel, serde_json::to_vec_pretty(record)?)
            .await?
        {
            bail!(
                "{}/{rel} exists already: is another daemon using the same --state?",
                self.loc.url
            );
        }
        Ok(())
    }

    fn spec_rel(&self, id: u64) -> String {
        format!("jobs/{id:08}/spec.json")
    }

    /// Put-if-absent; false when the object exists already.
    async fn put_new(&self, rel: &str, body: Vec<u8>) -> Result<bool> {
        let opts = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        match self
            .loc
            .store
            .put_opts(&self.loc.path(rel), PutPayload::from(body), opts)
            .await
        {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. })
            | Err(object_store::Error::Precondition { .. }) => Ok(false),
            Err(e) => Err(e).with_context(|| format!("writing {}/{rel}", self.loc.url)),
        }
    }

    async fn read(&self, rel: &str) -> Result<bytes::Bytes> {
        self.loc
            .store
            .get(&self.loc.path(rel))
            .await
            .with_context(|| format!("reading {}/{rel}", self.loc.url))?
            .bytes()
            .await
            .with_context(|| format!("reading {}/{rel}", self.loc.url))
    }

    async fn read_json<T: serde::de::DeserializeOwned>(&self, rel: &str) -> Result<T> {
        let bytes = self.read(rel).await?;
        serde_json::from_slice(&bytes).with_context(|| format!("parsing {}/{rel}", self.loc.url))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(output: &str) -> JobArgs {
        serde_json::from_value(serde_json::json!({
            "input": "/in.jsonl", "output": output, "layers": ["0"]
        }))
        .unwrap()
    }

    #[tokio::test]
    async fn jobs_and_their_history_survive_a_reopen_and_no_record_is_overwritten() {
        let d = tempfile::tempdir().unwrap();
        let url = d.path().join("state").display().to_string();
        let s = StateStore::open(&url).unwrap();
        assert_eq!(s.create(1, &spec("file:///a")).await.unwrap(), 1);
        // Id 1 is taken: the next free one is used.
        assert_eq!(s.create(1, &spec("file:///b")).await.unwrap(), 2);
        s.record(1, 1, &StatusRecord::now(JobState::Running))
            .await
            .unwrap();
        let mut done = StatusRecord::now(JobState::Done);
        done.summary = Some(SummaryRecord {
            samples: 3,
            ..Default::default()
        });
        s.record(1, 2, &done).await.unwrap();
        let e = s
            .record(1, 2, &StatusRecord::now(JobState::Failed))
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("exists already"), "{e}");

        let jobs = StateStore::open(&url).unwrap().load().await.unwrap();
        assert_eq!(jobs.len(), 2);
        assert_eq!((jobs[0].id, jobs[0].spec.output.as_str()), (1, "file:///a"));
        let states: Vec<_> = jobs[0].history.iter().map(|r| r.state).collect();
        assert_eq!(states, [JobState::Running, JobState::Done]);
        assert_eq!(jobs[0].history[1].summary.as_ref().unwrap().samples, 3);
        assert!(jobs[1].history.is_empty());
    }

    #[tokio::test]
    async fn a_job_whose_spec_no_longer_passes_the_checks_is_left_out_not_fatal() {
        let d = tempfile::tempdir().unwrap();
        let url = d.path().join("state").display().to_string();
        let s = StateStore::open(&url).unwrap();
        s.create(1, &spec("file:///a")).await.unwrap();
        // As an older daemon wrote it, before levels past 22 were refused.
        let mut old = serde_json::to_value(spec("file:///b")).unwrap();
        old["zstd_level"] = 1000.into();
        s.put_new("jobs/00000002/spec.json", old.to_string().into_bytes())
            .await
            .unwrap();
        s.record(2, 1, &StatusRecord::now(JobState::Failed))
            .await
            .unwrap();
        let jobs = s.load().await.unwrap();
        assert_eq!(jobs.iter().map(|j| j.id).collect::<Vec<_>>(), [1]);
        // Its id stays taken.
        assert_eq!(s.create(2, &spec("file:///c")).await.unwrap(), 3);
    }
}
