//! Handing batches to the ranks: every batch to every rank in the same order, padded as it
//! goes out, with the checks between batches that stop a job (cancel, a failed writer, a
//! failed rank).
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Duration;

use super::job::PreparedJob;
use super::progress::CancelToken;
use super::summary::CaptureSummary;
use crate::batch::PaddedBatch;

/// Why feeding stopped.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Feed {
    /// Every batch went out.
    Done,
    /// The caller cancelled.
    Cancelled,
    /// A writer or a rank failed.
    Stopped,
}

/// Hands every batch to every rank, in the same order, checking between batches whether to
/// stop; a batch is never given to some ranks and not others unless a rank has failed.
pub(super) fn feed(
    job: &PreparedJob,
    feeds: &[SyncSender<Arc<PaddedBatch>>],
    summary: &mut CaptureSummary,
    cancel: &CancelToken,
    writers_failed: &CancelToken,
    rank_failed: &AtomicBool,
) -> Feed {
    if feeds.is_empty() {
        return Feed::Stopped;
    }
    for idx in &job.batches {
        if cancel.is_cancelled() {
            tracing::info!("cancelled: finishing the batches in flight and committing");
            return Feed::Cancelled;
        }
        if writers_failed.is_cancelled() {
            return Feed::Stopped;
        }
        let batch = Arc::new(PaddedBatch::new(
            idx.iter().map(|&i| job.todo[i].clone()).collect(),
        ));
        summary.padding_tokens += batch.padding_tokens();
        summary.batches += 1;
        for tx in feeds {
            if !send_unless_failed(tx, batch.clone(), rank_failed) {
                return Feed::Stopped;
            }
        }
    }
    Feed::Done
}

/// Queues `batch` for one rank, waiting while its queue is full unless some rank has failed
/// (a failed rank's peers may never take another batch).
fn send_unless_failed(
    tx: &SyncSender<Arc<PaddedBatch>>,
    mut batch: Arc<PaddedBatch>,
    rank_failed: &AtomicBool,
) -> bool {
    loop {
        match tx.try_send(batch) {
            Ok(()) => return true,
            Err(TrySendError::Disconnected(_)) => return false,
            Err(TrySendError::Full(b)) => {
                if rank_failed.load(Ordering::Acquire) {
                    return false;
                }
                batch = b;
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}
