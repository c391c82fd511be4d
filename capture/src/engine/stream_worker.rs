//! One thread per stream of a layer-streamed engine, alive as long as its engine: it loads the
//! model's resident parts (embeddings, final norm) on its device and two layer slots, then runs
//! the passes of each job that it takes from the job's shared queue ([`crate::stream::pass`]).
//! Streams share no collective, so each pass runs on exactly one; every stream hands its
//! captured states to the job's splitter, as rank 0 of a resident engine does.
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use hslake_schemas::CapturePoint;
use tch::{Device, Kind, Tensor};

use super::host::{BufferPool, HostBatch};
use super::progress::{PassReport, RankTimes};
use super::rank::{token_ids, RankEvent, RankReport};
use crate::batch::PaddedBatch;
use crate::checkpoint::Checkpoint;
use crate::error::{CaptureError, Result};
use crate::gpu::comm::SingleRank;
use crate::gpu::cuda::{synchronize, CopyStream, PendingCopy, PinnedBuffer};
use crate::gpu::plane_split;
use crate::kernels::Kernels;
use crate::load::LoadCtx;
use crate::models::{LayeredModel, ModelConfig};
use crate::stream::layout::LayerLayout;
use crate::stream::pass::{run_pass, Discard, LayerLoad, PassSink, PassStats};
use crate::stream::slots::Slots;

/// Host copies of captured states a stream keeps in flight before it waits for the oldest:
/// each holds one batch's state at one point on the device until its copy is done.
const MAX_COPIES_IN_FLIGHT: usize = 4;

/// Everything a stream's thread needs to load.
pub(super) struct StreamSetup {
    /// This stream (index into the engine's devices).
    pub index: usize,
    /// The model's config (its loader).
    pub config: Arc<dyn ModelConfig>,
    /// The weights, mapped; the slots copy from them for the engine's life.
    pub checkpoint: Arc<Checkpoint>,
    /// Each layer's slot layout.
    pub layouts: Arc<Vec<LayerLayout>>,
    /// Where the stream computes.
    pub device: Device,
    /// The compute dtype.
    pub kind: Kind,
    /// How the layers compute.
    pub kernels: Kernels,
    /// Split the states into the store's planes before the host copy.
    pub split: bool,
}

/// One job's work for one stream.
pub(super) struct StreamJob {
    /// What to capture.
    pub points: Vec<CapturePoint>,
    /// The job's passes, shared by every stream; closed when the job has no more.
    pub passes: Arc<Mutex<Receiver<Vec<Arc<PaddedBatch>>>>>,
    /// The splitter's queue.
    pub host: SyncSender<HostBatch>,
    /// Pinned buffers to copy into (CUDA runs), shared by every stream.
    pub pool: Option<Arc<Mutex<BufferPool>>>,
    /// Where each pass's report goes.
    pub reports: Sender<PassReport>,
}

/// Starts stream `setup.index`'s thread: it loads, reports, then runs jobs from `jobs` until
/// that closes. `failed` is raised as soon as any stream fails, before its report.
pub(super) fn spawn(
    setup: StreamSetup,
    jobs: Receiver<StreamJob>,
    reports: Sender<RankReport>,
    failed: Arc<AtomicBool>,
) -> Result<std::thread::JoinHandle<()>> {
    let index = setup.index;
    std::thread::Builder::new()
        .name(format!("hslake-stream-{index}"))
        .spawn(move || {
            let report = |event: RankEvent| {
                if matches!(event, RankEvent::Failed(_)) {
                    failed.store(true, Ordering::Release);
                }
                let _ = reports.send(RankReport { rank: index, event });
            };
            let body = std::panic::AssertUnwindSafe(|| serve(setup, jobs, &report));
            if std::panic::catch_unwind(body).is_err() {
                report(RankEvent::Failed(CaptureError::Pipeline(format!(
                    "stream {index} thread panicked"
                ))));
            }
        })
        .map_err(|e| CaptureError::Pipeline(format!("cannot start stream thread {index}: {e}")))
}

/// What a stream holds for its engine's life.
struct Loaded {
    stack: Box<dyn LayeredModel>,
    slots: Slots,
    load: LayerLoad,
    /// The side stream captured states are copied to the host on (CUDA).
    copier: Option<CopyStream>,
}

/// The stream thread's life: load, warm up, serve jobs.
fn serve(setup: StreamSetup, jobs: Receiver<StreamJob>, report: &dyn Fn(RankEvent)) {
    let _no_grad = tch::no_grad_guard();
    let mut loaded = match load(&setup) {
        Ok(l) => l,
        Err(e) => return report(RankEvent::Failed(e)),
    };
    if setup.device.is_cuda() {
        // Layer 0 over one small batch: cuBLAS handles and first-use kernels, outside any job.
        let t = Instant::now();
        let warm = token_ids(&[0; 64], 1, 64, setup.device).and_then(|ids| {
            run_pass(
                &*loaded.stack,
                &mut loaded.slots,
                &loaded.load,
                &[ids],
                &[],
                &mut Discard,
            )
        });
        match warm {
            Ok(_) if setup.index == 0 => {
                tracing::info!("stream warmed up in {:.2}s", t.elapsed().as_secs_f64())
            }
            Ok(_) => {}
            Err(e) => return report(RankEvent::Failed(e)),
        }
    }
    report(RankEvent::Loaded);
    for job in jobs {
        match run_job(&mut loaded, &setup, job) {
            Ok(times) => report(RankEvent::JobDone(times, None)),
            Err(e) => return report(RankEvent::Failed(e)),
        }
    }
}

/// The resident parts on the stream's device, its slots and copy streams.
fn load(setup: &StreamSetup) -> Result<Loaded> {
    let comm = Rc::new(SingleRank);
    let ctx = LoadCtx {
        source: &*setup.checkpoint,
        comm: comm.clone(),
        device: setup.device,
        kind: setup.kind,
        kernels: setup.kernels,
        hold_dequantized: false,
    };
    let stack = setup.config.load_stack(&ctx)?;
    let slots = Slots::new(
        setup.checkpoint.clone(),
        setup.layouts.clone(),
        setup.device,
    )?;
    let copier = match setup.device {
        Device::Cuda(d) => {
            let c = CopyStream::new(d)?;
            synchronize(d)?;
            Some(c)
        }
        _ => None,
    };
    Ok(Loaded {
        stack,
        slots,
        load: LayerLoad {
            comm,
            device: setup.device,
            kind: setup.kind,
            kernels: setup.kernels,
        },
        copier,
    })
}

/// Runs passes from the job's queue until it closes; returns this stream's time.
fn run_job(loaded: &mut Loaded, setup: &StreamSetup, job: StreamJob) -> Result<RankTimes> {
    let mut times = RankTimes::default();
    let mut reported = RankTimes::default();
    let mut host = Some(job.host);
    loop {
        let pass = {
            let queue = job
                .passes
                .lock()
                .map_err(|_| CaptureError::Pipeline("the pass queue is poisoned".into()))?;
            match queue.recv() {
                Ok(p) => p,
                Err(_) => break,
            }
        };
        if host.is_none() {
            // The writers have stopped (a job error they report): nothing to capture for.
            continue;
        }
        let t = Instant::now();
        let waited_before = times.storage_wait;
        let ids = pass
            .iter()
            .map(|b| token_ids(&b.ids, b.rows, b.cols, setup.device))
            .collect::<Result<Vec<Tensor>>>()?;
        let mut outbox = Outbox {
            batches: &pass,
            points: job.points.len(),
            split: setup.split,
            copier: loaded.copier.as_ref(),
            pool: job.pool.as_deref(),
            host: &mut host,
            times: &mut times,
            reported: &mut reported,
            out: pass
                .iter()
                .map(|_| Outgoing::new(job.points.len()))
                .collect(),
            in_flight: VecDeque::new(),
            handed: 0,
            first_at: None,
        };
        let stats = run_pass(
            &*loaded.stack,
            &mut loaded.slots,
            &loaded.load,
            &ids,
            &job.points,
            &mut outbox,
        )?;
        outbox.finish()?;
        let first = outbox.first_at.map_or(0.0, |f| (f - t).as_secs_f64());
        let waited = times.storage_wait.saturating_sub(waited_before);
        times.compute += t.elapsed().saturating_sub(waited);
        let report = pass_report(setup.index, &stats, first);
        log_pass(&report);
        let _ = job.reports.send(report);
    }
    Ok(times)
}

fn pass_report(stream: usize, s: &PassStats, first_sample_secs: f64) -> PassReport {
    PassReport {
        stream,
        batches: s.batches,
        tokens: s.tokens,
        layers: s.layers,
        copy_bytes: s.copies.bytes,
        copy_gb_per_sec: s.copy_gb_per_sec(),
        compute_secs: s.compute_secs(),
        hidden_share: s.hidden_share(),
        first_sample_secs,
        secs: s.secs,
    }
}

fn log_pass(r: &PassReport) {
    tracing::info!(
        "stream {} pass: {} batches, {} tokens, {} layers in {:.2}s ({:.0} tokens/s); copied {:.2} GB at {:.1} GB/s, {:.0}% of it hidden behind compute ({:.2}s); first sample after {:.2}s",
        r.stream,
        r.batches,
        r.tokens,
        r.layers,
        r.secs,
        r.tokens as f64 / r.secs.max(1e-9),
        r.copy_bytes as f64 / 1e9,
        r.copy_gb_per_sec,
        100.0 * r.hidden_share,
        r.compute_secs,
        r.first_sample_secs
    );
}

/// A sink that drops what it is given (the warm-up pass captures nothing).
/// One batch of a pass on its way out.
struct Outgoing {
    /// The pinned buffers its states are copied into (CUDA), one per point.
    buffers: Option<Vec<PinnedBuffer>>,
    /// Its states in host memory, by point, as their copies complete.
    states: Vec<Option<Tensor>>,
    /// Points captured so far.
    captured: usize,
}

impl Outgoing {
    fn new(points: usize) -> Self {
        Outgoing {
            buffers: None,
            states: (0..points).map(|_| None).collect(),
            captured: 0,
        }
    }
}

/// Where a pass's captured states go: copied to pinned host memory as they are produced
/// (CUDA) and handed to the splitter batch by batch once each batch's last point has arrived.
/// Batches complete in order (their last point comes from the same layer); each is handed
/// over once the next has completed, so that its copies overlap that batch's compute.
struct Outbox<'a> {
    batches: &'a [Arc<PaddedBatch>],
    points: usize,
    split: bool,
    copier: Option<&'a CopyStream>,
    pool: Option<&'a Mutex<BufferPool>>,
    /// The splitter's queue; `None` once the writers have stopped.
    host: &'a mut Option<SyncSender<HostBatch>>,
    times: &'a mut RankTimes,
    /// What the batches handed over so far have reported of `times`.
    reported: &'a mut RankTimes,
    out: Vec<Outgoing>,
    /// Host copies in flight, oldest first: batch, point, copy.
    in_flight: VecDeque<(usize, usize, PendingCopy)>,
    /// Batches handed over (or dropped) so far.
    handed: usize,
    /// When the pass's first batch was handed over.
    first_at: Option<Instant>,
}

impl PassSink for Outbox<'_> {
    fn captured(&mut self, batch: usize, point: usize, state: Tensor) -> Result<()> {
        if self.host.is_none() {
            return Ok(());
        }
        let state = match self.split {
            true => {
                let lens: Vec<usize> = self.batches[batch]
                    .samples
                    .iter()
                    .map(|s| s.input_ids.len())
                    .collect();
                plane_split::split(&state, &lens)?
            }
            false => state,
        };
        match (self.copier, self.pool) {
            (Some(copier), Some(pool)) => {
                if self.out[batch].buffers.is_none() {
                    let set = pool
                        .lock()
                        .map_err(|_| CaptureError::Pipeline("the buffer pool is poisoned".into()))?
                        .take(&mut self.times.storage_wait)?;
                    match set {
                        Some(set) => self.out[batch].buffers = Some(set),
                        None => {
                            *self.host = None;
                            return Ok(());
                        }
                    }
                }
                let buffers = self.out[batch].buffers.as_deref().unwrap_or_default();
                let copy = copier.start(vec![state], std::slice::from_ref(&buffers[point]))?;
                self.in_flight.push_back((batch, point, copy));
                while self.in_flight.len() > MAX_COPIES_IN_FLIGHT {
                    self.settle_oldest()?;
                }
            }
            _ => self.out[batch].states[point] = Some(state),
        }
        self.out[batch].captured += 1;
        if self.out[batch].captured == self.points {
            while self.handed < batch {
                self.hand_off()?;
            }
        }
        Ok(())
    }
}

impl Outbox<'_> {
    /// Waits for the oldest host copy in flight and keeps its host tensor.
    fn settle_oldest(&mut self) -> Result<()> {
        if let Some((batch, point, copy)) = self.in_flight.pop_front() {
            let mut host = copy.wait()?;
            self.out[batch].states[point] = host.pop();
        }
        Ok(())
    }

    /// Hands the next batch in order to the splitter, once its copies are done.
    fn hand_off(&mut self) -> Result<()> {
        let b = self.handed;
        self.handed += 1;
        while self.in_flight.iter().any(|(batch, _, _)| *batch == b) {
            self.settle_oldest()?;
        }
        let Some(host) = self.host.as_ref() else {
            return Ok(());
        };
        let o = std::mem::replace(&mut self.out[b], Outgoing::new(0));
        let states = o
            .states
            .into_iter()
            .collect::<Option<Vec<Tensor>>>()
            .ok_or_else(|| {
                CaptureError::Pipeline(format!("batch {b} of a pass lacks a captured point"))
            })?;
        let t = Instant::now();
        let batch = HostBatch {
            input: self.batches[b].clone(),
            states,
            split: self.split,
            buffers: o.buffers,
            times: self.times.since(self.reported),
        };
        *self.reported = *self.times;
        if host.send(batch).is_err() {
            *self.host = None;
        }
        self.times.storage_wait += t.elapsed();
        self.first_at.get_or_insert_with(Instant::now);
        Ok(())
    }

    /// Hands over every batch not handed over yet (the end of the pass).
    fn finish(&mut self) -> Result<()> {
        while self.handed < self.batches.len() {
            self.hand_off()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::path::Path;

    use hslake_schemas::DType;

    use super::*;
    use crate::engine::{
        CancelToken, CaptureJob, CheckedModel, Engine, EngineOptions, NoProgress, Placement,
        ProgressSink,
    };
    use crate::fixtures::{values, write_inputs, write_model, TINY_LLAMA};

    fn options(dir: &Path, placement: Placement, devices: &[usize]) -> EngineOptions {
        let mut o = EngineOptions::new(dir.join("m"));
        o.dtype = DType::F32;
        o.placement.placement = placement;
        o.placement.devices = devices.to_vec();
        o
    }

    /// A job over `in.jsonl` into `out`, in batches of at most 40 tokens; passes of 100 tokens
    /// hold several batches.
    fn job(dir: &Path, out: &str, points: Vec<CapturePoint>) -> CaptureJob {
        let url = format!("file://{}", dir.join(out).display());
        let mut j = CaptureJob::new(dir.join("in.jsonl"), url, points);
        j.max_tokens_per_batch = 40;
        j
    }

    fn url(dir: &Path, out: &str) -> String {
        format!("file://{}", dir.join(out).display())
    }

    /// Runs `job` on a freshly loaded engine.
    fn run(o: EngineOptions, j: &CaptureJob, sink: &dyn ProgressSink) -> crate::CaptureSummary {
        let mut checked = CheckedModel::check(o).unwrap();
        checked
            .plan(j.max_tokens_per_batch, j.points.len())
            .unwrap();
        let mut engine = Engine::load(checked).unwrap();
        engine.run(j, sink, &CancelToken::new()).unwrap()
    }

    /// Counts the passes reported.
    #[derive(Default)]
    struct Passes(Mutex<Vec<PassReport>>);

    impl ProgressSink for Passes {
        fn pass_done(&self, pass: &PassReport) {
            self.0.lock().unwrap().push(*pass);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_streamed_engine_stores_what_a_resident_one_stores() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().to_path_buf();
        write_model(&dir.join("m"), TINY_LLAMA, None);
        write_inputs(&dir.join("in.jsonl"), 23);
        let points = vec![
            CapturePoint::LayerOutput(0),
            CapturePoint::LayerOutput(1),
            CapturePoint::FinalNorm,
        ];
        let dir2 = dir.clone();
        let (resident, streamed, passes) = tokio::task::spawn_blocking(move || {
            let j = job(&dir2, "resident", points.clone());
            let resident = run(options(&dir2, Placement::Resident, &[]), &j, &NoProgress);
            let mut o = options(&dir2, Placement::Stream, &[]);
            o.placement.pass_tokens = Some(100);
            let sink = Passes::default();
            let streamed = run(o, &job(&dir2, "streamed", points), &sink);
            (resident, streamed, sink.0.into_inner().unwrap())
        })
        .await
        .unwrap();
        assert_eq!((resident.samples, streamed.samples), (23, 23));
        assert_eq!(resident.batches, streamed.batches);
        let (a, b) = (
            values(&url(&dir, "resident")).await,
            values(&url(&dir, "streamed")).await,
        );
        assert_eq!(a, b, "streamed values differ from resident ones");
        // Several passes, each of several batches, every batch in exactly one.
        assert!(passes.len() >= 2, "{passes:?}");
        assert!(passes.iter().any(|p| p.batches > 1), "{passes:?}");
        assert_eq!(
            passes.iter().map(|p| p.batches as u64).sum::<u64>(),
            streamed.batches
        );
        assert!(passes.iter().all(|p| p.layers == 2));
        // Both layers fit the two slots: after the first pass nothing is copied again.
        assert!(passes[0].copy_bytes > 0);
        assert!(passes[1..].iter().all(|p| p.copy_bytes == 0), "{passes:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_streams_on_one_device_partition_the_samples_exactly() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().to_path_buf();
        write_model(&dir.join("m"), TINY_LLAMA, None);
        write_inputs(&dir.join("in.jsonl"), 31);
        let points = vec![CapturePoint::LayerOutput(1)];
        let dir2 = dir.clone();
        let passes = tokio::task::spawn_blocking(move || {
            let j = job(&dir2, "one", points.clone());
            run(options(&dir2, Placement::Resident, &[]), &j, &NoProgress);
            let mut o = options(&dir2, Placement::Stream, &[0, 0]);
            o.placement.pass_tokens = Some(40);
            let sink = Passes::default();
            run(o, &job(&dir2, "two", points), &sink);
            sink.0.into_inner().unwrap()
        })
        .await
        .unwrap();
        let (one, two): (BTreeMap<u64, Vec<f32>>, _) = (
            values(&url(&dir, "one")).await,
            values(&url(&dir, "two")).await,
        );
        assert_eq!(one.len(), 31);
        assert_eq!(one, two);
        let streams: std::collections::BTreeSet<usize> = passes.iter().map(|p| p.stream).collect();
        assert_eq!(streams.len(), 2, "both streams ran passes: {passes:?}");
        // Every sample once: the dataset's rows are its sample ids, without repeats.
        let ds = hslake_store::Dataset::open(&url(&dir, "two"))
            .await
            .unwrap();
        let r = hslake_store::DatasetReader::open(&ds, None).await.unwrap();
        assert_eq!(r.manifest().num_samples(), 31);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cancel_mid_job_then_resume_streams_every_sample_once() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().to_path_buf();
        write_model(&dir.join("m"), TINY_LLAMA, None);
        write_inputs(&dir.join("in.jsonl"), 120);

        /// Cancels the job after its first sample.
        #[derive(Default)]
        struct CancelEarly(CancelToken);
        impl ProgressSink for CancelEarly {
            fn sample_done(&self, _tokens: u64) {
                self.0.cancel();
            }
        }

        let dir2 = dir.clone();
        let (first, rest) = tokio::task::spawn_blocking(move || {
            let mut o = options(&dir2, Placement::Stream, &[]);
            o.placement.pass_tokens = Some(40);
            let mut checked = CheckedModel::check(o).unwrap();
            checked.plan(40, 1).unwrap();
            let mut engine = Engine::load(checked).unwrap();
            let mut j = job(&dir2, "ds", vec![CapturePoint::LayerOutput(0)]);
            let sink = CancelEarly::default();
            let first = engine.run(&j, &sink, &sink.0.clone()).unwrap();
            j.resume = true;
            let rest = engine.run(&j, &NoProgress, &CancelToken::new()).unwrap();
            (first, rest)
        })
        .await
        .unwrap();
        assert!(first.cancelled && 0 < first.samples && first.samples < 120);
        assert_eq!(
            (rest.skipped_committed, rest.samples),
            (first.samples, 120 - first.samples)
        );
        assert_eq!(values(&url(&dir, "ds")).await.len(), 120);
    }

    #[test]
    fn a_job_with_batches_larger_than_the_plan_is_refused_by_name() {
        let d = tempfile::tempdir().unwrap();
        write_model(&d.path().join("m"), TINY_LLAMA, None);
        write_inputs(&d.path().join("in.jsonl"), 5);
        let mut checked = CheckedModel::check(options(d.path(), Placement::Stream, &[])).unwrap();
        checked.plan(8, 1).unwrap();
        let mut engine = Engine::load(checked).unwrap();
        let rt = tokio::runtime::Runtime::new().unwrap();
        let _guard = rt.enter();
        let e = engine
            .run(
                &job(d.path(), "ds", vec![CapturePoint::LayerOutput(0)]),
                &NoProgress,
                &CancelToken::new(),
            )
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("memory planned for batches of at most 8 tokens"),
            "{e}"
        );
    }
}
