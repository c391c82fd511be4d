//! How a running job reports progress and is told to stop: a callback the caller implements
//! (the CLI draws a bar, the daemon records job state), a cancel token, and the times rank 0
//! reports as it goes. The library itself draws nothing.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Receives a job's progress; called from the engine's writer threads, so it must be `Sync`.
/// Every method has a default that ignores the event.
pub trait ProgressSink: Sync {
    /// The job is about to capture `samples` samples of `tokens` tokens in all (what is left
    /// after resume and length limits).
    fn started(&self, samples: u64, tokens: u64) {
        let _ = (samples, tokens);
    }

    /// One sample of `tokens` tokens was handed to the store (written or, under the finite
    /// policy, skipped).
    fn sample_done(&self, tokens: u64) {
        let _ = tokens;
    }

    /// A writer committed `version`, which holds everything it wrote so far.
    fn committed(&self, version: u64) {
        let _ = version;
    }

    /// A writer's commit (put-if-absent of the manifest, with its retries) took `secs`.
    fn commit_took(&self, secs: f64) {
        let _ = secs;
    }

    /// Rank 0 spent `compute_secs` more on forwards and host copies and `storage_wait_secs`
    /// more blocked on the writers since its last report. Reported with each batch it hands
    /// over, so that a live view of the GPU's wait needs no end of job, and once more at the
    /// end of the job: the reports of a job add up to its summary's times.
    fn forward_progress(&self, compute_secs: f64, storage_wait_secs: f64) {
        let _ = (compute_secs, storage_wait_secs);
    }

    /// A writer stored `raw` more uncompressed tensor bytes and `stored` more shard bytes
    /// since its last report; the reports of a job add up to its summary's byte counts.
    fn bytes_written(&self, raw: u64, stored: u64) {
        let _ = (raw, stored);
    }

    /// A streamed pass ended (layer-streamed placement only).
    fn pass_done(&self, pass: &PassReport) {
        let _ = pass;
    }
}

/// What one streamed pass did, as it is logged and exported.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PassReport {
    /// The stream (index into `--devices`).
    pub stream: usize,
    /// Batches in the pass.
    pub batches: usize,
    /// Padded tokens in the pass.
    pub tokens: u64,
    /// Layers streamed.
    pub layers: usize,
    /// Weight bytes copied to the device.
    pub copy_bytes: u64,
    /// Copy rate, GB/s.
    pub copy_gb_per_sec: f64,
    /// Seconds the device computed.
    pub compute_secs: f64,
    /// Share of the copy time hidden behind compute (1 = all).
    pub hidden_share: f64,
    /// Seconds from the pass's start to its first sample handed to the writers.
    pub first_sample_secs: f64,
    /// Seconds of the whole pass on the device.
    pub secs: f64,
}

/// A sink that ignores every event.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoProgress;

impl ProgressSink for NoProgress {}

/// Asks a running job to stop: the batches already handed to the ranks finish, every writer
/// commits, and the job returns its summary marked cancelled. Clones share one flag.
#[derive(Debug, Clone, Default)]
pub struct CancelToken(Arc<AtomicBool>);

impl CancelToken {
    /// A token nobody has cancelled yet.
    pub fn new() -> Self {
        CancelToken::default()
    }

    /// Requests the stop; idempotent, callable from any thread (e.g. a Ctrl-C handler).
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    /// Whether a stop was requested.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// Time rank 0 spent on one job.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct RankTimes {
    /// Forward and device-to-host copies.
    pub compute: Duration,
    /// Blocked because the writers' queue (or every pinned buffer) was full.
    pub storage_wait: Duration,
}

impl RankTimes {
    /// The larger of each time (the slowest of several streams).
    pub(super) fn max(&self, other: &RankTimes) -> RankTimes {
        RankTimes {
            compute: self.compute.max(other.compute),
            storage_wait: self.storage_wait.max(other.storage_wait),
        }
    }

    /// The time spent since `earlier` (a copy of these times taken before).
    pub(super) fn since(&self, earlier: &RankTimes) -> RankTimes {
        RankTimes {
            compute: self.compute.saturating_sub(earlier.compute),
            storage_wait: self.storage_wait.saturating_sub(earlier.storage_wait),
        }
    }
}
