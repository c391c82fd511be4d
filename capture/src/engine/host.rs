//! Rank 0's captured states in host memory on their way to the writers: the batch message,
//! the pinned buffers rank 0 copies into (recycled once the writers have encoded each sample
//! from them), and the lease that hands a batch's buffers back when its last sample is done.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tch::Tensor;

use super::rank::RankTimes;
use crate::batch::PaddedBatch;
use crate::cuda::PinnedBuffer;
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
pub(super) struct BufferPool {
    free: Vec<Vec<PinnedBuffer>>,
    returned: Receiver<Vec<PinnedBuffer>>,
    made: usize,
    max_sets: usize,
    bytes_each: usize,
    per_set: usize,
}

impl BufferPool {
    /// Up to `max_sets` sets of `per_set` buffers of `bytes_each` bytes, made as needed;
    /// sets come back through `returned`.
    pub fn new(
        returned: Receiver<Vec<PinnedBuffer>>,
        max_sets: usize,
        per_set: usize,
        bytes_each: usize,
    ) -> Self {
        BufferPool {
            free: vec![],
            returned,
            made: 0,
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
        if self.made < self.max_sets {
            self.made += 1;
            return (0..self.per_set)
                .map(|_| PinnedBuffer::new(self.bytes_each))
                .collect::<Result<_>>()
                .map(Some);
        }
        let t = Instant::now();
        let set = self.returned.recv().ok();
        *storage_wait += t.elapsed();
        Ok(set)
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
