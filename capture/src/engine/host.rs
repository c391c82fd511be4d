//! Rank 0's captured states in host memory on their way to the writers: the batch message,
//! the pinned buffers rank 0 copies into (sized here for each job, recycled once the writers
//! have encoded each sample from them, and kept by the engine from job to job), and the lease
//! that hands a batch's buffers back when its last sample is done.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hslake_schemas::DType;
use tch::Tensor;

use super::progress::RankTimes;
use crate::batch::PaddedBatch;
use crate::error::{CaptureError, Result};
use crate::gpu::cuda::PinnedBuffer;
use crate::gpu::plane_split::SplitLayout;

/// Rank 0's captured states for one batch, in host memory: one `[b, t, hidden]` per point, or
/// one byte tensor per point laid out as [`crate::gpu::plane_split::SplitLayout`] says.
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

/// Host memory rank 0 copies captured states into: pinned buffers on CUDA.
pub(super) trait HostBuffer: Sized {
    /// A buffer of `bytes` bytes.
    fn alloc(bytes: usize) -> Result<Self>;
    /// Its capacity in bytes.
    fn capacity(&self) -> usize;
}

impl HostBuffer for PinnedBuffer {
    fn alloc(bytes: usize) -> Result<Self> {
        PinnedBuffer::new(bytes)
    }

    fn capacity(&self) -> usize {
        self.len()
    }
}

/// The buffer sets one job copies into: at most `sets` of them, each `per_set` buffers (one
/// per capture point) of at least `bytes_each` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct SetShape {
    /// Sets that can be in use at once.
    pub sets: usize,
    /// Buffers per set.
    pub per_set: usize,
    /// Bytes each buffer needs.
    pub bytes_each: usize,
}

/// Rank 0's host buffers as an engine keeps them between jobs, and how large each job needs
/// them: pinned buffers on CUDA; none on the CPU, where rank 0 hands over the tensors its
/// forward made.
pub(super) struct HostBuffers {
    /// The buffers between jobs (CUDA); `None` on the CPU, and while a job holds them.
    pool: Option<BufferPool>,
    cuda: bool,
    /// Rank 0 splits states into planes before the copy.
    split: bool,
    /// Width of one token's state.
    hidden: usize,
    /// The states' dtype.
    dtype: DType,
    /// Batches that may wait for the writers.
    queue_depth: usize,
}

impl HostBuffers {
    /// No buffers yet, for rank 0 of an engine on CUDA (`cuda`) whose states are `hidden` wide
    /// in `dtype` (split into planes where `split`), with `queue_depth` batches that may queue
    /// for the writers.
    pub fn new(cuda: bool, split: bool, hidden: usize, dtype: DType, queue_depth: usize) -> Self {
        HostBuffers {
            pool: cuda.then(BufferPool::default),
            cuda,
            split,
            hidden,
            dtype,
            queue_depth,
        }
    }

    /// The sets a job copies into, whose largest batch is `[rows, cols]` and which captures
    /// `points` points: one per batch that can be queued, in flight or being split, plus `held`
    /// that streams hold while their passes run, each buffer large enough for that batch (split
    /// into planes, with its row statistics, where the engine splits).
    fn shape(&self, (rows, cols): (usize, usize), points: usize, held: usize) -> SetShape {
        let largest_batch = rows * cols;
        SetShape {
            sets: self.queue_depth + 3 + held,
            per_set: points,
            bytes_each: if self.split {
                SplitLayout::bytes_for(largest_batch, self.hidden)
            } else {
                largest_batch * self.hidden * self.dtype.size()
            },
        }
    }

    /// Pins the sets of a job like [`HostBuffers::shape`]'s ahead of it (CUDA), logging the
    /// time; a failure is only a warning, since the job pins what it lacks as it goes and
    /// reports its own errors.
    pub fn pin_ahead(&mut self, largest_batch: (usize, usize), points: usize, held: usize) {
        let shape = self.shape(largest_batch, points, held);
        let Some(pool) = self.pool.as_mut() else {
            return;
        };
        let t = Instant::now();
        match pool.fill(shape) {
            Ok(made) => tracing::info!(
                "pinned {made} host buffers ({:.2} GB) for the first job in {:.2}s while the model loads",
                (made * shape.bytes_each) as f64 / 1e9,
                t.elapsed().as_secs_f64()
            ),
            Err(e) => tracing::warn!("host buffers are pinned as the job goes: {e}"),
        }
    }

    /// The pool a job like [`HostBuffers::shape`]'s copies into on CUDA, whose sets come back
    /// through `recycle`: the buffers kept from earlier jobs or pinned ahead, with more pinned
    /// as the job needs them. Hand it back with [`HostBuffers::keep`].
    pub fn lend(
        &mut self,
        largest_batch: (usize, usize),
        points: usize,
        held: usize,
        recycle: Receiver<Vec<PinnedBuffer>>,
    ) -> Option<BufferPool> {
        if !self.cuda {
            return None;
        }
        let shape = self.shape(largest_batch, points, held);
        let mut pool = self.pool.take().unwrap_or_default();
        pool.start_job(shape, recycle);
        Some(pool)
    }

    /// Takes back a job's pool once nothing can return a set any more (the splitter and the
    /// writers are gone): the sets that came back are kept for the next job.
    pub fn keep(&mut self, mut pool: BufferPool) {
        pool.end_job();
        self.pool = Some(pool);
    }
}

/// Rank 0's host buffers, kept by the engine from job to job: pinning costs about 0.1 s per
/// GB (filling the pages, then registering them), which a job that pins as it goes pays in its
/// forward loop. Within a job, a set in use by every slot means the writers are behind:
/// waiting for one is waiting on storage.
pub(super) struct BufferPool<B = PinnedBuffer> {
    /// Buffers not in use: made ahead, or kept from earlier jobs.
    free: Vec<B>,
    /// Where the current job's sets come back; `None` between jobs.
    returned: Option<Receiver<Vec<B>>>,
    /// Buffers the current job holds, free or in use.
    owned: usize,
    shape: SetShape,
}

impl<B: HostBuffer> Default for BufferPool<B> {
    fn default() -> Self {
        BufferPool {
            free: vec![],
            returned: None,
            owned: 0,
            shape: SetShape::default(),
        }
    }
}

impl<B: HostBuffer> BufferPool<B> {
    /// Makes buffers until the pool holds every set of `shape` (before a job, e.g. while the
    /// model loads); returns how many it made.
    pub fn fill(&mut self, shape: SetShape) -> Result<usize> {
        self.keep_fitting(shape);
        let want = shape.sets * shape.per_set;
        let made = want.saturating_sub(self.free.len());
        for _ in 0..made {
            self.free.push(B::alloc(shape.bytes_each)?);
        }
        Ok(made)
    }

    /// Starts a job whose sets have `shape` and come back through `returned`; buffers kept
    /// from before that are too small for it are freed.
    pub fn start_job(&mut self, shape: SetShape, returned: Receiver<Vec<B>>) {
        self.keep_fitting(shape);
        self.owned = self.free.len();
        self.shape = shape;
        self.returned = Some(returned);
    }

    /// Ends the job: the sets that came back are kept for the next one. Call it once nothing
    /// can return a set any more; a set still out then is freed by whoever holds it.
    pub fn end_job(&mut self) {
        if let Some(returned) = self.returned.take() {
            self.free.extend(returned.try_iter().flatten());
        }
        self.owned = 0;
    }

    /// A free set for the current job, made if the job holds fewer than its `sets`, else
    /// waited for (adding the wait to `storage_wait`); `None` once nothing can return one
    /// (the writers have stopped).
    pub fn take(&mut self, storage_wait: &mut Duration) -> Result<Option<Vec<B>>> {
        let Some(returned) = &self.returned else {
            return Err(CaptureError::Pipeline(
                "a host buffer set was asked for outside a job".into(),
            ));
        };
        self.free.extend(returned.try_iter().flatten());
        let SetShape {
            sets,
            per_set,
            bytes_each,
        } = self.shape;
        if self.free.len() < per_set && self.owned < sets * per_set {
            let missing = per_set - self.free.len();
            for _ in 0..missing {
                self.free.push(B::alloc(bytes_each)?);
            }
            self.owned += missing;
        }
        if self.free.len() < per_set {
            let t = Instant::now();
            let set = returned.recv().ok();
            *storage_wait += t.elapsed();
            return Ok(set);
        }
        let rest = self.free.len() - per_set;
        Ok(Some(self.free.split_off(rest)))
    }

    /// Keeps the free buffers big enough for `shape`, at most all of its sets' worth.
    fn keep_fitting(&mut self, shape: SetShape) {
        self.free.retain(|b| b.capacity() >= shape.bytes_each);
        self.free.truncate(shape.sets * shape.per_set);
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
    use std::cell::Cell;
    use std::sync::mpsc;

    thread_local! {
        /// Buffers made so far on this test's thread.
        static MADE: Cell<usize> = const { Cell::new(0) };
    }

    /// A plain host buffer that counts how often one is made.
    struct Counted(usize);

    impl HostBuffer for Counted {
        fn alloc(bytes: usize) -> Result<Self> {
            MADE.set(MADE.get() + 1);
            Ok(Counted(bytes))
        }

        fn capacity(&self) -> usize {
            self.0
        }
    }

    fn shape(sets: usize, per_set: usize, bytes_each: usize) -> SetShape {
        SetShape {
            sets,
            per_set,
            bytes_each,
        }
    }

    fn made() -> usize {
        MADE.get()
    }

    /// Takes `n` sets, returning each through `back` right away, and says how many buffers
    /// had to be made for them.
    fn run_job(pool: &mut BufferPool<Counted>, s: SetShape, n: usize) -> usize {
        let (back, returned) = mpsc::channel();
        pool.start_job(s, returned);
        let before = made();
        let mut wait = Duration::ZERO;
        for _ in 0..n {
            let set = pool.take(&mut wait).unwrap().unwrap();
            assert_eq!(set.len(), s.per_set);
            assert!(set.iter().all(|b| b.capacity() >= s.bytes_each));
            back.send(set).unwrap();
        }
        drop(back);
        pool.end_job();
        made() - before
    }

    #[test]
    fn a_job_sets_hold_its_largest_batch_raw_or_split_and_the_cpu_pins_none() {
        let raw = HostBuffers::new(true, false, 6, DType::Bf16, 4);
        // Queue depth 4, plus the batches in flight and being split; one buffer per point.
        assert_eq!(raw.shape((3, 10), 2, 0), shape(7, 2, 3 * 10 * 6 * 2));
        // Streams hold their passes' sets beside the queue's.
        assert_eq!(raw.shape((3, 10), 2, 8), shape(15, 2, 3 * 10 * 6 * 2));
        let split = HostBuffers::new(true, true, 6, DType::Bf16, 4);
        let planes = SplitLayout::bytes_for(30, 6);
        assert!(planes > 3 * 10 * 6 * 2, "planes carry row statistics too");
        assert_eq!(split.shape((3, 10), 2, 0), shape(7, 2, planes));
        let (_back, returned) = mpsc::channel();
        let mut cpu = HostBuffers::new(false, false, 6, DType::F32, 4);
        assert!(cpu.lend((3, 10), 2, 0, returned).is_none());
    }

    #[test]
    fn a_later_job_reuses_the_sets_an_earlier_one_made() {
        let mut pool = BufferPool::default();
        let (back, returned) = mpsc::channel();
        pool.start_job(shape(3, 2, 100), returned);
        let mut wait = Duration::ZERO;
        let sets: Vec<_> = (0..3)
            .map(|_| pool.take(&mut wait).unwrap().unwrap())
            .collect();
        for set in sets {
            back.send(set).unwrap();
        }
        drop(back);
        pool.end_job();
        // Same shape, then fewer points with smaller batches: nothing new is pinned.
        assert_eq!(run_job(&mut pool, shape(3, 2, 100), 10), 0);
        assert_eq!(run_job(&mut pool, shape(3, 1, 60), 10), 0);
    }

    #[test]
    fn buffers_too_small_for_a_job_are_replaced_not_kept() {
        let mut pool = BufferPool::default();
        assert_eq!(pool.fill(shape(2, 2, 100)).unwrap(), 4);
        // One set at a time is in use: one set is made, and the small ones are gone.
        assert_eq!(run_job(&mut pool, shape(2, 2, 200), 5), 2);
        assert_eq!(pool.free.len(), 2);
        assert!(pool.free.iter().all(|b| b.capacity() == 200));
    }

    #[test]
    fn sets_made_ahead_are_used_before_any_is_made() {
        let mut pool = BufferPool::default();
        assert_eq!(pool.fill(shape(4, 3, 10)).unwrap(), 12);
        assert_eq!(pool.fill(shape(4, 3, 10)).unwrap(), 0);
        assert_eq!(run_job(&mut pool, shape(4, 3, 10), 20), 0);
    }

    #[test]
    fn a_job_holding_every_set_waits_for_one_and_stops_when_none_can_return() {
        let mut pool = BufferPool::<Counted>::default();
        let (back, returned) = mpsc::channel();
        pool.start_job(shape(2, 1, 8), returned);
        let mut wait = Duration::ZERO;
        let first = pool.take(&mut wait).unwrap().unwrap();
        let second = pool.take(&mut wait).unwrap().unwrap();
        let giver = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            back.send(first).unwrap();
        });
        assert!(pool.take(&mut wait).unwrap().is_some());
        assert!(wait >= Duration::from_millis(40), "waited {wait:?}");
        giver.join().unwrap();
        // Every sender is gone: nothing can come back, so the job stops keeping states.
        assert!(pool.take(&mut wait).unwrap().is_none());
        drop(second);
        pool.end_job();
        assert!(pool.take(&mut wait).is_err());
    }
}
