//! One thread per tensor-parallel rank, alive as long as its engine: it joins the group,
//! loads its slice of the model once, then runs the batches of each job it is given. Rank 0
//! alone keeps results (every rank holds the complete residual stream): it copies them to
//! pinned host memory on a side stream and hands them to the job's splitter.
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, SyncSender};
use std::sync::Arc;
use std::time::Instant;

use hslake_schemas::CapturePoint;
use tch::{Device, Kind, Tensor};

use super::host::{BufferPool, HostBatch};
use super::progress::RankTimes;
use crate::batch::PaddedBatch;
use crate::checkpoint::Checkpoint;
use crate::error::{CaptureError, Result};
use crate::gpu::comm::{sync, Communicator};
use crate::gpu::cuda::{CopyStream, PendingCopy, PinnedBuffer};
use crate::gpu::group::CommInit;
use crate::gpu::plane_split;
use crate::kernels::Kernels;
use crate::load::LoadCtx;
use crate::models::{DecoderModel, ModelConfig};

/// Everything a rank thread needs to load its slice of the model.
pub(super) struct RankSetup {
    /// This rank.
    pub rank: usize,
    /// The model's config (its loader).
    pub config: Arc<dyn ModelConfig>,
    /// The weights, shared by every rank until each has loaded.
    pub checkpoint: Arc<Checkpoint>,
    /// Where the weights go.
    pub device: Device,
    /// The compute dtype.
    pub kind: Kind,
    /// How the layers compute.
    pub kernels: Kernels,
    /// Rank 0 splits the states into the store's planes before the copy
    /// (`crate::gpu::plane_split`).
    pub split: bool,
    /// A forward pass to run once loaded, before reporting so.
    pub warm_up: Option<WarmUp>,
}

/// A forward pass each rank runs once after loading, so that the first job's first batch does
/// not pay for what CUDA and libtorch do only once: cuBLAS handles, kernels loaded at their
/// first launch, the caching allocator growing to a batch's activations, the first collective.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct WarmUp {
    /// Batch rows.
    pub rows: usize,
    /// Tokens per row.
    pub cols: usize,
    /// What the pass captures (as the job will).
    pub points: Vec<CapturePoint>,
}

/// One job's work for one rank.
pub(super) struct RankJob {
    /// What to capture.
    pub points: Vec<CapturePoint>,
    /// The batches, in the same order on every rank; closed when the job has no more.
    pub batches: Receiver<Arc<PaddedBatch>>,
    /// Rank 0's way to the writers; `None` on the other ranks.
    pub output: Option<RankOutput>,
}

/// Where rank 0 puts captured states.
pub(super) struct RankOutput {
    /// The splitter's queue.
    pub host: SyncSender<HostBatch>,
    /// Pinned buffers to copy into (CUDA runs), handed back when the job is done.
    pub pool: Option<BufferPool>,
}

/// What a rank tells its engine.
pub(super) enum RankEvent {
    /// Its slice of the model is loaded.
    Loaded,
    /// It ran every batch of the current job; rank 0 hands back its host buffers.
    JobDone(RankTimes, Option<BufferPool>),
    /// It failed and has stopped; its communicator is aborted.
    Failed(CaptureError),
}

/// A [`RankEvent`] and the rank it comes from.
pub(super) struct RankReport {
    /// The rank.
    pub rank: usize,
    /// What happened.
    pub event: RankEvent,
}

/// Starts the rank's thread: it joins its group through `comm`, loads, reports, then runs
/// jobs from `jobs` until that closes.
/// `failed` is raised as soon as any rank fails, before its report.
pub(super) fn spawn(
    setup: RankSetup,
    comm: CommInit,
    jobs: Receiver<RankJob>,
    reports: Sender<RankReport>,
    failed: Arc<AtomicBool>,
) -> Result<std::thread::JoinHandle<()>> {
    let rank = setup.rank;
    std::thread::Builder::new()
        .name(format!("hslake-rank-{rank}"))
        .spawn(move || {
            let report = |event: RankEvent| {
                if matches!(event, RankEvent::Failed(_)) {
                    failed.store(true, Ordering::Release);
                }
                // The engine may be gone; then nobody needs to hear it.
                let _ = reports.send(RankReport { rank, event });
            };
            let body = std::panic::AssertUnwindSafe(|| serve(setup, comm, jobs, &report));
            if std::panic::catch_unwind(body).is_err() {
                report(RankEvent::Failed(CaptureError::Pipeline(format!(
                    "rank {rank} thread panicked"
                ))));
            }
        })
        .map_err(|e| CaptureError::Pipeline(format!("cannot start rank thread {rank}: {e}")))
}

/// The rank thread's life: join, load, serve jobs.
fn serve(setup: RankSetup, comm: CommInit, jobs: Receiver<RankJob>, report: &dyn Fn(RankEvent)) {
    let _no_grad = tch::no_grad_guard();
    let comm = match comm() {
        Ok(c) => c,
        Err(e) => return report(RankEvent::Failed(e)),
    };
    let device = setup.device;
    let loaded = load(&setup, comm.clone());
    // The mapped checkpoint is released as soon as every rank holds its slice.
    drop(setup.checkpoint);
    let (model, copier) = match loaded {
        Ok(m) => m,
        Err(e) => {
            comm.abort();
            return report(RankEvent::Failed(e));
        }
    };
    if let Some(w) = &setup.warm_up {
        match warm_up(&*model, device, w, setup.config.info().vocab_size) {
            Ok(secs) if setup.rank == 0 => tracing::info!(
                "warmed up on a [{}, {}] batch in {secs:.2}s",
                w.rows,
                w.cols
            ),
            Ok(_) => {}
            Err(e) => {
                comm.abort();
                return report(RankEvent::Failed(e));
            }
        }
    }
    report(RankEvent::Loaded);
    for job in jobs {
        match run_job(&*model, copier.as_ref(), device, setup.split, job) {
            Ok((times, pool)) => report(RankEvent::JobDone(times, pool)),
            Err(e) => {
                // No other rank may wait forever in a collective with this one.
                comm.abort();
                return report(RankEvent::Failed(e));
            }
        }
    }
}

/// This rank's slice of the model, and rank 0's side stream for host copies on CUDA.
fn load(
    setup: &RankSetup,
    comm: Rc<dyn Communicator>,
) -> Result<(Box<dyn DecoderModel>, Option<CopyStream>)> {
    let ctx = LoadCtx {
        source: &*setup.checkpoint,
        comm,
        device: setup.device,
        kind: setup.kind,
        kernels: setup.kernels,
        hold_dequantized: false,
    };
    let model = setup.config.load(&ctx)?;
    let copier = match setup.device {
        Device::Cuda(d) if setup.rank == 0 => Some(CopyStream::new(d)?),
        _ => None,
    };
    sync(setup.device)?;
    Ok((model, copier))
}

/// Runs `w` on token ids spread over the vocabulary (`vocab` ids), so that an MoE layer
/// routes them as it would real text, not all to the experts of one token; waits for the
/// device; returns the seconds it took.
fn warm_up(model: &dyn DecoderModel, device: Device, w: &WarmUp, vocab: usize) -> Result<f64> {
    let t = Instant::now();
    let n = w.rows * w.cols;
    // A multiplicative hash of the position: every id below `vocab`, no two neighbours alike.
    let ids: Vec<i64> = (0..n as u64)
        .map(|i| (i.wrapping_mul(2_654_435_761) % vocab.max(1) as u64) as i64)
        .collect();
    let ids = token_ids(&ids, w.rows as i64, w.cols as i64, device)?;
    drop(model.forward(&ids, &w.points)?);
    sync(device)?;
    Ok(t.elapsed().as_secs_f64())
}

/// Row-major token `ids` as a `[rows, cols]` tensor on `device`.
pub(super) fn token_ids(ids: &[i64], rows: i64, cols: i64, device: Device) -> Result<Tensor> {
    Ok(Tensor::f_from_slice(ids)?
        .f_view([rows, cols])?
        .f_to_device(device)?)
}

/// A batch whose host copy is in flight.
type InFlight = (PendingCopy, Arc<PaddedBatch>, Option<Vec<PinnedBuffer>>);

/// Runs every batch of one job; returns rank 0's time and its host buffers, for the next job.
/// Rank 0 keeps going when the writers have stopped (a job error they report themselves): the
/// other ranks' collectives need it, it just keeps nothing.
fn run_job(
    model: &dyn DecoderModel,
    copier: Option<&CopyStream>,
    device: Device,
    split: bool,
    job: RankJob,
) -> Result<(RankTimes, Option<BufferPool>)> {
    let mut times = RankTimes::default();
    // What the batches handed over so far have reported of `times`.
    let mut reported = RankTimes::default();
    let (mut host, mut pool) = match job.output {
        Some(o) => (Some(o.host), o.pool),
        None => (None, None),
    };
    let mut pending: Option<InFlight> = None;
    for batch in job.batches.iter() {
        let t = Instant::now();
        let ids = token_ids(&batch.ids, batch.rows, batch.cols, device)?;
        let states = model.forward(&ids, &job.points)?;
        if host.is_none() {
            continue;
        }
        let states = if split {
            let lens: Vec<usize> = batch.samples.iter().map(|s| s.input_ids.len()).collect();
            states
                .iter()
                .map(|s| plane_split::split(s, &lens))
                .collect::<Result<_>>()?
        } else {
            states
        };
        let (copy, buffers) = match (copier, pool.as_mut()) {
            (Some(c), Some(p)) => match p.take(&mut times.storage_wait)? {
                Some(set) => (c.start(states, &set)?, Some(set)),
                None => {
                    host = None;
                    continue;
                }
            },
            _ => (PendingCopy::ready(states), None),
        };
        times.compute += t.elapsed();
        // Wait for the previous batch's copy only now, so it overlapped with this forward.
        if let Some(prev) = pending.replace((copy, batch, buffers)) {
            hand_off(prev, split, &mut host, &mut times, &mut reported)?;
        }
    }
    if let Some(prev) = pending.take() {
        hand_off(prev, split, &mut host, &mut times, &mut reported)?;
    }
    Ok((times, pool))
}

/// Waits for a batch's host copy and queues it for the splitter (unless the writers are gone),
/// with the time spent since the last batch handed over; `split`: the states are split.
fn hand_off(
    (copy, input, buffers): InFlight,
    split: bool,
    host: &mut Option<SyncSender<HostBatch>>,
    times: &mut RankTimes,
    reported: &mut RankTimes,
) -> Result<()> {
    let t = Instant::now();
    let states = copy.wait()?;
    times.compute += t.elapsed();
    let t = Instant::now();
    if let Some(h) = host.as_ref() {
        let batch = HostBatch {
            input,
            states,
            split,
            buffers,
            times: times.since(reported),
        };
        *reported = *times;
        if h.send(batch).is_err() {
            *host = None;
        }
    }
    times.storage_wait += t.elapsed();
    Ok(())
}
