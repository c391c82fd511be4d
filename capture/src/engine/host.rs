//! Rank 0's captured states in host memory on their way to the writers: the batch message,
//! the pinned buffers rank 0 copies into (recycled once the writers have encoded each sample
//! from them), and the lease that hands a batch's buffers back when its last sample is done.
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tch::Tensor;

use super::rank::RankTimes;
use crate::batch::PaddedBatch;
use crate::cuda::{self, PinnedBuffer};
use crate::error::Result;

/// Rank 0's captured states for one batch, in host memory: one `[b, t, hidden]` per point, or
/// one byte tensor per point laid out as [`crate::plane_split::SplitLayout`] says.
pub(super) struct HostBatch {
    /// The batch they were computed from.
    pub input: Arc<PaddedBatch>,
    /// One tensor per capture point.
    pub states: Vec<Tensor>,
    /// The states are split into planes, with their row statistics.
    pub split: bool,
    /// The pinned buffers `states` live in (GPU runs), handed back to rank 0 once split.
    pub buffers: Option<Vec<PinnedBuffer>>,
    /// Rank 0's time since the batch before this one was handed over.
    pub times: RankTimes,
}

/// Pinned host buffers rank 0 copies into, recycled by the writers. A full set in use means
/// the writers are behind: waiting for one is waiting on storage.
///
/// Sets are pinned ahead by a helper thread while the first batches run, and handed over
/// through the writers' recycling channel as if returned: pinned on demand, a DeepSeek-V3-wide
/// job's sets took ~3 s of rank 0's forward loop, and pinned before it, as long again before
/// the first batch (docs/PERFORMANCE.md). Rank 0 still pins a set itself when it needs one
/// that the helper has not made yet.
pub(super) struct BufferPool {
    free: Vec<Vec<PinnedBuffer>>,
    returned: Receiver<Vec<PinnedBuffer>>,
    /// Sets made or claimed by the helper or rank 0 so far.
    made: Arc<AtomicUsize>,
    /// Tells the helper to stop pinning (the job is over).
    done: Arc<AtomicBool>,
    max_sets: usize,
    bytes_each: usize,
    per_set: usize,
}

/// Claims one of `max` sets to make; `false` once all are made or claimed.
fn claim(made: &AtomicUsize, max: usize) -> bool {
    made.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
        (n < max).then_some(n + 1)
    })
    .is_ok()
}

fn pin_set(per_set: usize, bytes_each: usize) -> Result<Vec<PinnedBuffer>> {
    (0..per_set)
        .map(|_| PinnedBuffer::new(bytes_each))
        .collect()
}

impl BufferPool {
    /// Up to `max_sets` sets of `per_set` buffers of `bytes_each` bytes for rank 0 on GPU
    /// `device`; sets come back through `returned`, to which `recycle` sends (the helper
    /// thread's sets arrive that way too).
    pub fn new(
        returned: Receiver<Vec<PinnedBuffer>>,
        recycle: Sender<Vec<PinnedBuffer>>,
        device: usize,
        max_sets: usize,
        per_set: usize,
        bytes_each: usize,
    ) -> Self {
        let made = Arc::new(AtomicUsize::new(0));
        let done = Arc::new(AtomicBool::new(false));
        let (m, d) = (made.clone(), done.clone());
        let ahead = move || {
            if cuda::set_device(device).is_err() {
                return;
            }
            while !d.load(Ordering::Acquire) && claim(&m, max_sets) {
                match pin_set(per_set, bytes_each) {
                    Ok(set) => {
                        if recycle.send(set).is_err() {
                            return;
                        }
                    }
                    Err(e) => {
                        // Rank 0 pins the rest on demand, and reports the error if it recurs.
                        m.fetch_sub(1, Ordering::AcqRel);
                        tracing::warn!("pinning host buffers ahead failed: {e}");
                        return;
                    }
                }
            }
        };
        if let Err(e) = std::thread::Builder::new()
            .name("hslake-pin-ahead".into())
            .spawn(ahead)
        {
            tracing::warn!("cannot start the thread that pins host buffers ahead: {e}");
        }
        BufferPool {
            free: vec![],
            returned,
            made,
            done,
            max_sets,
            bytes_each,
            per_set,
        }
    }

    /// A free set, waiting (and adding the wait to `storage_wait`) when all are in use;
    /// `None` once nothing can return one (the writers have stopped).
    pub fn take(&mut self, storage_wait: &mut Duration) -> Result<Option<Vec<PinnedBuffer>>> {
        while let Ok(set) = self.returned.try_recv() {
            self.free.push(set);
        }
        if let Some(set) = self.free.pop() {
            return Ok(Some(set));
        }
        if claim(&self.made, self.max_sets) {
            return pin_set(self.per_set, self.bytes_each).map(Some);
        }
        let t = Instant::now();
        let set = self.returned.recv().ok();
        *storage_wait += t.elapsed();
        Ok(set)
    }
}

impl Drop for BufferPool {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Release);
    }
}

/// The pinned buffers of one batch, handed back to rank 0 when the last of its samples has
/// been encoded by a writer.
pub(super) struct BatchLease {
    remaining: AtomicU64,
    buffers: Mutex<Option<Vec<PinnedBuffer>>>,
    recycle: Sender<Vec<PinnedBuffer>>,
}

impl BatchLease {
    /// A lease over `buffers`, released once per sample of the batch (`samples` times).
    pub fn new(
        samples: usize,
        buffers: Vec<PinnedBuffer>,
        recycle: Sender<Vec<PinnedBuffer>>,
    ) -> Self {
        BatchLease {
            remaining: AtomicU64::new(samples as u64),
            buffers: Mutex::new(Some(buffers)),
            recycle,
        }
    }

    /// One sample is done with the buffers; the last one sends them back.
    pub fn release(&self) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            if let Some(b) = self.buffers.lock().ok().and_then(|mut g| g.take()) {
                // Rank 0 may have finished the job already; then the buffers are simply freed.
                let _ = self.recycle.send(b);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_helper_and_rank_0_together_make_no_more_sets_than_allowed() {
        let made = Arc::new(AtomicUsize::new(0));
        let claimed: usize = std::thread::scope(|s| {
            let workers: Vec<_> = (0..4)
                .map(|_| s.spawn(|| (0..10).filter(|_| claim(&made, 7)).count()))
                .collect();
            workers.into_iter().map(|w| w.join().unwrap()).sum()
        });
        assert_eq!(claimed, 7);
        assert_eq!(made.load(Ordering::Acquire), 7);
        assert!(!claim(&made, 7));
    }
}
