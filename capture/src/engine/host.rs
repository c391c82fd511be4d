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
/// New sets are pinned by a helper thread, one ahead of need: pinned on demand, a
/// DeepSeek-V3-wide job's sets took ~2.5 s of rank 0's forward loop, pinned up front as long
/// before its first batch, and every set pinned ahead at once still slowed the first batches
/// (docs/PERFORMANCE.md). So the helper starts with two sets, and is asked for one more each
/// time rank 0 takes the last free one while sets are left to make: as many sets are pinned as
/// the writers hold at once, plus one.
pub(super) struct BufferPool {
    free: Vec<Vec<PinnedBuffer>>,
    returned: Receiver<Vec<PinnedBuffer>>,
    /// Sets the helper pinned (or why it could not).
    pinned: Receiver<Result<Vec<PinnedBuffer>>>,
    /// Asks the helper for one more set; `None` where it could not be started.
    ask: Option<Sender<()>>,
    /// Sets asked of the helper and not yet received.
    asked: usize,
    /// Sets made, asked for or being made.
    made: usize,
    max_sets: usize,
    bytes_each: usize,
    per_set: usize,
}

fn pin_set(per_set: usize, bytes_each: usize) -> Result<Vec<PinnedBuffer>> {
    (0..per_set)
        .map(|_| PinnedBuffer::new(bytes_each))
        .collect()
}

impl BufferPool {
    /// Up to `max_sets` sets of `per_set` buffers of `bytes_each` bytes for rank 0 on GPU
    /// `device`; sets come back through `returned`.
    pub fn new(
        returned: Receiver<Vec<PinnedBuffer>>,
        device: usize,
        max_sets: usize,
        per_set: usize,
        bytes_each: usize,
    ) -> Self {
        let (ask, asks) = std::sync::mpsc::channel::<()>();
        let (pinned_tx, pinned) = std::sync::mpsc::channel();
        let helper = move || {
            if let Err(e) = cuda::set_device(device) {
                let _ = pinned_tx.send(Err(e));
                return;
            }
            // Ends when the pool is dropped (the job is over) or nobody takes its sets.
            for () in asks {
                if pinned_tx.send(pin_set(per_set, bytes_each)).is_err() {
                    return;
                }
            }
        };
        let ask = match std::thread::Builder::new()
            .name("hslake-pin-ahead".into())
            .spawn(helper)
        {
            Ok(_) => Some(ask),
            Err(e) => {
                tracing::warn!("cannot start the thread that pins host buffers ahead: {e}");
                None
            }
        };
        let mut pool = BufferPool {
            free: vec![],
            returned,
            pinned,
            ask,
            asked: 0,
            made: 0,
            max_sets,
            bytes_each,
            per_set,
        };
        for _ in 0..2 {
            pool.ask_helper();
        }
        pool
    }

    /// Asks the helper for one more set, while sets are left to make.
    fn ask_helper(&mut self) {
        if self.made < self.max_sets {
            if let Some(ask) = &self.ask {
                if ask.send(()).is_ok() {
                    self.made += 1;
                    self.asked += 1;
                }
            }
        }
    }

    /// A set the helper pinned, as it arrives.
    fn receive(&mut self, set: Result<Vec<PinnedBuffer>>) -> Result<Vec<PinnedBuffer>> {
        self.asked -= 1;
        set
    }

    /// A free set, waiting (and adding the wait to `storage_wait`) when all are in use;
    /// `None` once nothing can return one (the writers have stopped).
    pub fn take(&mut self, storage_wait: &mut Duration) -> Result<Option<Vec<PinnedBuffer>>> {
        while let Ok(set) = self.returned.try_recv() {
            self.free.push(set);
        }
        while let Ok(set) = self.pinned.try_recv() {
            let set = self.receive(set)?;
            self.free.push(set);
        }
        let set = if let Some(set) = self.free.pop() {
            set
        } else if self.asked > 0 {
            // Being pinned: waiting for it is not waiting on storage.
            match self.pinned.recv() {
                Ok(set) => self.receive(set)?,
                Err(_) => {
                    self.asked = 0;
                    self.made += 1;
                    pin_set(self.per_set, self.bytes_each)?
                }
            }
        } else if self.made < self.max_sets {
            self.made += 1;
            pin_set(self.per_set, self.bytes_each)?
        } else {
            let t = Instant::now();
            let set = self.returned.recv().ok();
            *storage_wait += t.elapsed();
            return Ok(set);
        };
        if self.free.is_empty() && self.asked == 0 {
            self.ask_helper();
        }
        Ok(Some(set))
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
