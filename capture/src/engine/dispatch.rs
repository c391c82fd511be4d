//! How the engine hands a job to its rank threads and gathers what they report: the reports
//! by rank, every error, and the one error worth reporting.
use std::sync::mpsc::{self, RecvTimeoutError, SyncSender};
use std::sync::Arc;
use std::time::Instant;

use super::host::{BufferPool, HostBatch};
use super::rank::{RankEvent, RankJob, RankOutput};
use super::{CancelToken, Engine, PreparedJob, RANK_GRACE};
use crate::batch::PaddedBatch;
use crate::error::{CaptureError, Result};

impl Engine {
    /// Gives every rank the job; returns the batch queues and how many ranks took the job
    /// (fewer than all only when a rank thread is gone).
    pub(super) fn dispatch(
        &self,
        job: &PreparedJob,
        host: SyncSender<HostBatch>,
        mut pool: Option<BufferPool>,
    ) -> (Vec<SyncSender<Arc<PaddedBatch>>>, usize) {
        let mut host = Some(host);
        let mut feeds = vec![];
        for (rank, jobs) in self.jobs.iter().enumerate() {
            let (tx, rx) = mpsc::sync_channel(2);
            let output = match (rank, host.take()) {
                (0, Some(host)) => Some(RankOutput {
                    host,
                    pool: pool.take(),
                }),
                _ => None,
            };
            let work = RankJob {
                points: job.job.points.clone(),
                batches: rx,
                output,
            };
            if jobs.send(work).is_err() {
                break;
            }
            feeds.push(tx);
        }
        let dispatched = feeds.len();
        if dispatched < self.jobs.len() {
            // A batch no rank can join in would hang the others' collectives.
            feeds.clear();
        }
        (feeds, dispatched)
    }

    /// Waits for one report from each of `n` ranks and maps it with `accept`; once a rank has
    /// failed, the others get [`RANK_GRACE`] to answer. Returns what was accepted, by rank,
    /// and every error.
    pub(super) fn await_ranks<T>(
        &self,
        n: usize,
        accept: impl Fn(RankEvent) -> Result<T>,
    ) -> (Vec<Option<T>>, Vec<CaptureError>) {
        let mut by_rank: Vec<Option<T>> = (0..self.workers()).map(|_| None).collect();
        let mut errors = vec![];
        let mut deadline: Option<Instant> = None;
        for _ in 0..n {
            let report = match deadline {
                None => self
                    .reports
                    .recv()
                    .map_err(|_| RecvTimeoutError::Disconnected),
                Some(d) => self
                    .reports
                    .recv_timeout(d.saturating_duration_since(Instant::now())),
            };
            let report = match report {
                Ok(r) => r,
                Err(RecvTimeoutError::Timeout) => {
                    errors.push(CaptureError::Pipeline(format!(
                        "ranks did not answer within {}s of a rank's failure",
                        RANK_GRACE.as_secs()
                    )));
                    break;
                }
                Err(RecvTimeoutError::Disconnected) => {
                    errors.push(CaptureError::Pipeline("every rank thread is gone".into()));
                    break;
                }
            };
            match report.event {
                RankEvent::Failed(e) => {
                    errors.push(e);
                    deadline.get_or_insert_with(|| Instant::now() + RANK_GRACE);
                }
                event => match (accept(event), by_rank.get_mut(report.rank)) {
                    (Ok(t), Some(slot)) => *slot = Some(t),
                    (Ok(_), None) => errors.push(CaptureError::Pipeline(format!(
                        "a report from unknown rank {}",
                        report.rank
                    ))),
                    (Err(e), _) => errors.push(e),
                },
            }
        }
        (by_rank, errors)
    }
}

/// Raises `flag` when `r` is an error, so the feeder stops; passes `r` on.
pub(super) fn flag_error<T>(flag: &CancelToken, r: Result<T>) -> Result<T> {
    if r.is_err() {
        flag.cancel();
    }
    r
}

/// A joined thread's value, its error (or panic) added to `errors`.
pub(super) fn collect<T>(
    r: std::thread::Result<Result<T>>,
    what: &str,
    errors: &mut Vec<CaptureError>,
) -> Option<T> {
    match r {
        Ok(Ok(v)) => Some(v),
        Ok(Err(e)) => {
            errors.push(e);
            None
        }
        Err(_) => {
            errors.push(CaptureError::Pipeline(format!("{what} thread panicked")));
            None
        }
    }
}

/// The error worth reporting: the first that is not another stage's "stopped early" echo.
pub(crate) fn root_cause(mut errors: Vec<CaptureError>) -> Option<CaptureError> {
    if errors.is_empty() {
        return None;
    }
    let root = errors
        .iter()
        .position(|e| !matches!(e, CaptureError::Pipeline(_)))
        .unwrap_or(0);
    Some(errors.swap_remove(root))
}
