//! Handing batches to the ranks: every batch to every rank in the same order, padded as it
//! goes out, with the checks between batches that stop a job (cancel, a failed writer, a
//! failed rank).
use std::ops::Range;
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

/// Consecutive batches grouped into passes of at most `pass_tokens` padded tokens (a batch
/// larger than that is a pass of its own), from each batch's padded tokens.
pub(super) fn group_passes(tokens: &[u64], pass_tokens: u64) -> Vec<Range<usize>> {
    let mut passes = vec![];
    let (mut start, mut sum) = (0, 0u64);
    for (i, &t) in tokens.iter().enumerate() {
        if i > start && sum + t > pass_tokens {
            passes.push(start..i);
            (start, sum) = (i, 0);
        }
        sum += t;
    }
    if start < tokens.len() {
        passes.push(start..tokens.len());
    }
    passes
}

/// Hands each pass (its batches, padded) to whichever stream takes it first, checking between
/// passes whether to stop. Streams share no collective, so a pass goes to exactly one.
pub(super) fn feed_passes(
    job: &PreparedJob,
    pass_tokens: u64,
    passes: &SyncSender<Vec<Arc<PaddedBatch>>>,
    summary: &mut CaptureSummary,
    cancel: &CancelToken,
    writers_failed: &CancelToken,
    stream_failed: &AtomicBool,
) -> Feed {
    for range in group_passes(&job.padded_tokens(), pass_tokens) {
        if cancel.is_cancelled() {
            tracing::info!("cancelled: finishing the passes in flight and committing");
            return Feed::Cancelled;
        }
        if writers_failed.is_cancelled() {
            return Feed::Stopped;
        }
        let pass: Vec<Arc<PaddedBatch>> = job.batches[range]
            .iter()
            .map(|idx| {
                Arc::new(PaddedBatch::new(
                    idx.iter().map(|&i| job.todo[i].clone()).collect(),
                ))
            })
            .collect();
        for b in &pass {
            summary.padding_tokens += b.padding_tokens();
            summary.batches += 1;
        }
        if !send_unless_failed(passes, pass, stream_failed) {
            return Feed::Stopped;
        }
    }
    Feed::Done
}

/// Queues `batch` for one rank, waiting while its queue is full unless some rank has failed
/// (a failed rank's peers may never take another batch).
fn send_unless_failed<T>(tx: &SyncSender<T>, mut batch: T, rank_failed: &AtomicBool) -> bool {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passes_hold_consecutive_batches_up_to_the_token_budget() {
        assert_eq!(group_passes(&[4, 4, 4, 4, 4], 8), [0..2, 2..4, 4..5]);
        // A batch over the budget is a pass of its own; nothing is dropped or repeated.
        assert_eq!(group_passes(&[3, 20, 3, 3], 8), [0..1, 1..2, 2..4]);
        assert_eq!(group_passes(&[], 8), Vec::<Range<usize>>::new());
        assert_eq!(
            group_passes(&[5, 5], 1_000),
            std::iter::once(0..2).collect::<Vec<_>>()
        );
    }
}
