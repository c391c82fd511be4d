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
use crate::error::{CaptureError, Result};

/// Rank 0's captured states for one batch, in host memory: one `[b, t, hidden]` per point.
pub(super) struct HostBatch {
    /// The batch they were computed from.
    pub input: Arc<PaddedBatch>,
    /// One tensor per capture point.
    pub states: Vec<Tensor>,
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
}

impl BufferPool {
    /// `sets` sets of `per_set` buffers of `bytes_each` bytes, all pinned now, one thread per
    /// set; sets come back through `returned`.
    ///
    /// Why up front and in parallel: pinning is page faults and page-table work the kernel does
    /// at a few GB/s per thread. Made on demand inside the forward loop, the sets stalled the
    /// GPU while they were made: a DeepSeek-V3-wide set of 5 × 235 MB took about 0.4 s, seven
    /// of them about 3 s of a 10 s run.
    pub fn new(
        returned: Receiver<Vec<PinnedBuffer>>,
        sets: usize,
        per_set: usize,
        bytes_each: usize,
    ) -> Result<Self> {
        let t = Instant::now();
        let free = std::thread::scope(|s| {
            let makers: Vec<_> = (0..sets)
                .map(|_| {
                    s.spawn(move || {
                        (0..per_set)
                            .map(|_| PinnedBuffer::new(bytes_each))
                            .collect::<Result<Vec<_>>>()
                    })
                })
                .collect();
            makers
                .into_iter()
                .map(|m| {
                    m.join().unwrap_or_else(|_| {
                        Err(CaptureError::Pipeline(
                            "pinning host memory panicked".into(),
                        ))
                    })
                })
                .collect::<Result<Vec<_>>>()
        })?;
        tracing::info!(
            "pinned {sets} sets of {per_set} × {:.0} MB of host memory in {:.2}s",
            bytes_each as f64 / 1e6,
            t.elapsed().as_secs_f64()
        );
        Ok(BufferPool { free, returned })
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
