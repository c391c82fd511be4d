//! Collectives between tensor-parallel ranks: the [`Communicator`] trait and its in-process
//! back end (one thread per rank, CPU tensors), used to test TP without GPUs. The NCCL back
//! end lives in [`super::nccl`]; how each rank joins its group, in [`super::group`].
use std::cell::Cell;
use std::rc::Rc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use tch::{Device, Tensor};

use crate::error::{CaptureError, Result};

/// A group of ranks that can sum a tensor across all of them.
pub trait Communicator {
    /// This rank, `0..world_size()`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// Replaces `t` on every rank by the element-wise sum of every rank's `t`.
    fn all_reduce_sum(&self, t: &mut Tensor) -> Result<()>;
    /// Tells the other ranks this one has failed, so none waits forever in a collective.
    fn abort(&self);
}

/// A group of one: every collective is the identity.
pub struct SingleRank;

impl Communicator for SingleRank {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, _t: &mut Tensor) -> Result<()> {
        Ok(())
    }
    fn abort(&self) {}
}

struct BarrierState {
    arrived: usize,
    generation: u64,
    aborted: bool,
}

struct Shared {
    world: usize,
    state: Mutex<BarrierState>,
    cv: Condvar,
    // One deposited CPU tensor per rank; `Tensor` is `Send`, so the mutex makes sharing sound.
    slots: Mutex<Vec<Option<Tensor>>>,
}

/// In-process back end: ranks are threads of one process that meet at a barrier and
/// sum each other's CPU copies in rank order, so every rank gets bit-identical results.
pub struct LocalComm {
    rank: usize,
    shared: Arc<Shared>,
}

impl LocalComm {
    /// One communicator per rank of a new group of `world` ranks; move each into its rank's thread.
    pub fn group(world: usize) -> Vec<LocalComm> {
        let shared = Arc::new(Shared {
            world,
            state: Mutex::new(BarrierState {
                arrived: 0,
                generation: 0,
                aborted: false,
            }),
            cv: Condvar::new(),
            slots: Mutex::new((0..world).map(|_| None).collect()),
        });
        (0..world)
            .map(|rank| LocalComm {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }

    fn err(&self, message: impl Into<String>) -> CaptureError {
        CaptureError::Comm {
            rank: self.rank,
            message: message.into(),
        }
    }

    fn barrier(&self) -> Result<()> {
        // A Pipeline error, so that the failing rank's own error is the one reported.
        let aborted = || {
            CaptureError::Pipeline(format!(
                "rank {}: another rank failed; collective abandoned",
                self.rank
            ))
        };
        let mut s = self
            .shared
            .state
            .lock()
            .map_err(|_| self.err("barrier lock poisoned"))?;
        if s.aborted {
            return Err(aborted());
        }
        let generation = s.generation;
        s.arrived += 1;
        if s.arrived == self.shared.world {
            s.arrived = 0;
            s.generation += 1;
            self.shared.cv.notify_all();
            return Ok(());
        }
        while s.generation == generation && !s.aborted {
            s = self
                .shared
                .cv
                .wait(s)
                .map_err(|_| self.err("barrier lock poisoned"))?;
        }
        if s.generation == generation {
            return Err(aborted());
        }
        Ok(())
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn all_reduce_sum(&self, t: &mut Tensor) -> Result<()> {
        if self.shared.world == 1 {
            return Ok(());
        }
        let mine = deep_copy(&t.f_to_device(Device::Cpu)?)?;
        {
            let mut slots = self
                .shared
                .slots
                .lock()
                .map_err(|_| self.err("slot lock poisoned"))?;
            slots[self.rank] = Some(mine);
        }
        self.barrier()?;
        let sum = {
            let slots = self
                .shared
                .slots
                .lock()
                .map_err(|_| self.err("slot lock poisoned"))?;
            let mut acc: Option<Tensor> = None;
            for (r, slot) in slots.iter().enumerate() {
                let x = slot
                    .as_ref()
                    .ok_or_else(|| self.err(format!("rank {r} deposited nothing")))?;
                acc = Some(match acc {
                    None => deep_copy(x)?,
                    Some(a) => a.f_add(x)?,
                });
            }
            acc.ok_or_else(|| self.err("empty group"))?
        };
        // Nobody may overwrite a slot for the next collective until everyone has summed this one.
        self.barrier()?;
        t.f_copy_(&sum)?;
        Ok(())
    }

    fn abort(&self) {
        if let Ok(mut s) = self.shared.state.lock() {
            s.aborted = true;
            self.shared.cv.notify_all();
        }
    }
}

/// Where a profiled rank's time went since [`TimedComm::reset`].
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct CommTimes {
    /// Device work between collectives.
    pub compute: Duration,
    /// Inside all-reduces, waiting for slower ranks included.
    pub all_reduce: Duration,
    /// All-reduces run.
    pub calls: usize,
}

/// A rank's communicator that splits its time between compute and all-reduces: it waits for
/// the device before each all-reduce (so the time since the previous one is compute) and after
/// it (so the all-reduce is timed alone). The waits remove every overlap of host and device,
/// so a profiled run is slower than a plain one; it says where the time goes, not how much.
pub(crate) struct TimedComm {
    inner: Rc<dyn Communicator>,
    device: Device,
    mark: Cell<Instant>,
    times: Cell<CommTimes>,
}

impl TimedComm {
    /// Times `inner`'s collectives on `device`.
    pub fn new(inner: Rc<dyn Communicator>, device: Device) -> Self {
        TimedComm {
            inner,
            device,
            mark: Cell::new(Instant::now()),
            times: Cell::new(CommTimes::default()),
        }
    }

    /// Waits for the device and starts measuring from zero.
    pub fn reset(&self) -> Result<()> {
        sync(self.device)?;
        self.times.set(CommTimes::default());
        self.mark.set(Instant::now());
        Ok(())
    }

    /// Waits for the device and counts the time since the last mark as compute.
    pub fn lap(&self) -> Result<()> {
        sync(self.device)?;
        let mut t = self.times.get();
        t.compute += self.mark.replace(Instant::now()).elapsed();
        self.times.set(t);
        Ok(())
    }

    /// Leaves the time since the last mark uncounted (the caller timed it as something else).
    pub fn skip(&self) {
        self.mark.set(Instant::now());
    }

    /// The times since [`TimedComm::reset`], compute up to now included.
    pub fn times(&self) -> Result<CommTimes> {
        self.lap()?;
        Ok(self.times.get())
    }
}

impl Communicator for TimedComm {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce_sum(&self, t: &mut Tensor) -> Result<()> {
        self.lap()?;
        self.inner.all_reduce_sum(t)?;
        sync(self.device)?;
        let mut times = self.times.get();
        times.all_reduce += self.mark.replace(Instant::now()).elapsed();
        times.calls += 1;
        self.times.set(times);
        Ok(())
    }
    fn abort(&self) {
        self.inner.abort()
    }
}

/// Blocks until `device` has finished the work queued on it (nothing to wait for on the CPU);
/// an error the device met meanwhile is returned here.
pub(crate) fn sync(device: Device) -> Result<()> {
    match device {
        Device::Cuda(d) => crate::gpu::cuda::synchronize(d),
        _ => Ok(()),
    }
}

fn deep_copy(x: &Tensor) -> Result<Tensor> {
    let mut y = x.f_empty_like()?;
    y.f_copy_(x)?;
    Ok(y)
}

#[cfg(test)]
mod tests {
    use super::*;

    use tch::Kind;

    #[test]
    fn four_ranks_sum_to_the_same_values() {
        let handles: Vec<_> = LocalComm::group(4)
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let mut t = Tensor::from_slice(&[c.rank() as f32, 1.0, 10.0 * c.rank() as f32]);
                    for _ in 0..3 {
                        c.all_reduce_sum(&mut t).unwrap();
                    }
                    Vec::<f32>::try_from(t).unwrap()
                })
            })
            .collect();
        // Three rounds of summing over 4 ranks multiply the rank-independent part by 4^3.
        let expected = vec![6.0 * 16.0, 64.0, 60.0 * 16.0];
        for h in handles {
            assert_eq!(h.join().unwrap(), expected);
        }
    }

    #[test]
    fn timed_ranks_count_every_all_reduce_and_keep_its_result() {
        let handles: Vec<_> = LocalComm::group(2)
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let timed = TimedComm::new(Rc::new(c), Device::Cpu);
                    timed.reset().unwrap();
                    let mut t = Tensor::from_slice(&[1.0f32 + timed.rank() as f32]);
                    timed.all_reduce_sum(&mut t).unwrap();
                    timed.all_reduce_sum(&mut t).unwrap();
                    (
                        timed.times().unwrap().calls,
                        Vec::<f32>::try_from(t).unwrap(),
                    )
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), (2, vec![6.0]));
        }
    }

    #[test]
    fn an_aborting_rank_releases_the_others_with_an_error() {
        let mut group = LocalComm::group(2);
        let second = group.pop().unwrap();
        let first = group.pop().unwrap();
        let waiter = std::thread::spawn(move || {
            let mut t = Tensor::zeros([2], (Kind::Float, Device::Cpu));
            first.all_reduce_sum(&mut t)
        });
        std::thread::sleep(std::time::Duration::from_millis(50));
        second.abort();
        let e = waiter.join().unwrap().unwrap_err().to_string();
        assert!(e.contains("another rank failed"), "{e}");
    }
}
