//! The long-lived capture engine: a checked model loaded once on one thread per rank, which
//! then runs any number of jobs. A job error (bad input, a dataset that does not match, a
//! store failure) fails that job and leaves the engine usable; a rank error (a failed
//! collective, out of memory) is reported and marks the engine broken, and nothing waits on
//! a lost rank for longer than [`RANK_GRACE`].
//!
//! One job, stage by stage: the engine feeds each padded batch to every rank (bounded
//! queues), rank 0 hands captured states to a splitter through a queue of `queue_depth`
//! batches, the splitter spreads samples over `writers` store writers, and each writer
//! compresses, appends and commits under the job's commit policy.
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::batch::PaddedBatch;
use crate::error::{CaptureError, Result};
use crate::gpu::cuda::{HostRegistration, PinnedBuffer};
use crate::gpu::group::{self, CommInit};
use crate::gpu::DeviceKind;
use crate::models::ModelInfo;

mod check;
mod commit;
mod dispatch;
mod feed;
mod host;
mod job;
mod memory;
mod options;
mod placement;
mod progress;
mod rank;
mod splitter;
mod stream_worker;
mod streamed;
mod summary;
mod writer;

pub use check::CheckedModel;
pub(crate) use check::StreamPlan;
pub use commit::CommitPolicy;
pub use job::{input_size, PreparedJob};
pub use options::{CaptureJob, EngineOptions, PlaneSplit};
pub use placement::{Placement, PlacementOptions};
pub use progress::{CancelToken, NoProgress, PassReport, ProgressSink};
pub(crate) use streamed::register;
pub use summary::CaptureSummary;

use check::Plan;
pub(crate) use dispatch::root_cause;
use dispatch::{collect, flag_error};
use feed::{feed, feed_passes, group_passes, Feed};
use host::{BufferPool, HostBatch, HostBuffers};
use progress::RankTimes;
use rank::{RankEvent, RankJob, RankReport, RankSetup, WarmUp};
use splitter::{split_batches, SampleRows};
use stream_worker::{StreamJob, StreamSetup};
use writer::{run_writer, WriterDone, WriterSetup};

/// Tokens of the batch a CUDA engine warms up on when no first job says what batches to expect.
pub const WARM_UP_TOKENS: usize = 256;

/// How long the engine waits for the other ranks once one has failed.
pub const RANK_GRACE: Duration = Duration::from_secs(30);

/// A model loaded on its rank threads, ready to run capture jobs one at a time.
pub struct Engine {
    options: EngineOptions,
    info: ModelInfo,
    load_secs: f64,
    /// One job queue per rank; dropping them ends the rank threads.
    jobs: Vec<Sender<RankJob>>,
    /// One job queue per stream of a streamed engine (no ranks then).
    streams: Vec<Sender<StreamJob>>,
    /// A streamed engine's plan.
    stream_plan: Option<StreamPlan>,
    threads: Vec<std::thread::JoinHandle<()>>,
    reports: Receiver<RankReport>,
    /// Raised by the first rank that fails.
    rank_failed: Arc<AtomicBool>,
    /// Why the engine cannot run jobs any more.
    broken: Option<String>,
    /// Rank 0's host buffers between jobs.
    host: HostBuffers,
    /// A streamed engine's checkpoint files, page-locked in place (CUDA), held only to be
    /// released after the streams that copy from them (fields drop after `Drop::drop` has
    /// joined the threads).
    _registered: Vec<HostRegistration>,
}

/// Tokens per batch and capture points the memory plan assumes for an engine started without
/// a first job (the daemon's): `hslake capture`'s default batch and EAGLE-3's four points.
pub const PLANNED_BATCH_TOKENS: usize = 16384;
/// See [`PLANNED_BATCH_TOKENS`].
pub const PLANNED_POINTS: usize = 4;

impl Engine {
    /// Checks the model ([`CheckedModel::check`]) and loads it ([`Engine::load`]).
    pub fn start(options: EngineOptions) -> Result<Engine> {
        Engine::load(CheckedModel::check(options)?)
    }

    /// Starts one thread per rank, each joining the group and loading its slice; returns once
    /// every rank has loaded (or with the first failure).
    /// On CUDA each rank then warms up on a small batch ([`WARM_UP_TOKENS`] tokens).
    pub fn load(mut checked: CheckedModel) -> Result<Engine> {
        if checked.plan.is_none() {
            checked.plan(PLANNED_BATCH_TOKENS, PLANNED_POINTS)?;
        }
        if matches!(checked.plan, Some(Plan::Stream(_))) {
            return Engine::spawn_streams(checked, None);
        }
        let comms = group::join_group(checked.options.device, checked.options.tp)?;
        let warm_up = (checked.options.device == DeviceKind::Cuda).then(|| WarmUp {
            rows: 1,
            cols: WARM_UP_TOKENS,
            points: vec![],
        });
        Engine::spawn(checked, comms, None, warm_up)
    }

    /// [`Engine::load`] for a first job known beforehand: on CUDA, the host buffers it will
    /// copy into are pinned while the ranks load, and each rank warms up on its largest batch,
    /// so that its forward loop pays for neither.
    pub fn load_for(mut checked: CheckedModel, first: &PreparedJob) -> Result<Engine> {
        if checked.plan.is_none() {
            checked.plan(first.largest_batch_tokens(), first.job.points.len())?;
        }
        if matches!(checked.plan, Some(Plan::Stream(_))) {
            return Engine::spawn_streams(checked, Some(first));
        }
        let comms = group::join_group(checked.options.device, checked.options.tp)?;
        let warm_up = (checked.options.device == DeviceKind::Cuda).then(|| first.warm_up());
        Engine::spawn(checked, comms, Some(first), warm_up)
    }

    /// [`Engine::load`] with the given way for each rank to join its group, pinning `first`'s
    /// host buffers meanwhile, each rank running `warm_up` once loaded.
    fn spawn(
        checked: CheckedModel,
        comms: Vec<CommInit>,
        first: Option<&PreparedJob>,
        warm_up: Option<WarmUp>,
    ) -> Result<Engine> {
        let t = Instant::now();
        let (report_tx, reports) = mpsc::channel();
        let rank_failed = Arc::new(AtomicBool::new(false));
        let o = &checked.options;
        let host = HostBuffers::new(
            o.device == DeviceKind::Cuda,
            checked.split,
            checked.info.hidden_size,
            o.dtype,
            o.queue_depth,
        );
        let mut engine = Engine {
            options: checked.options.clone(),
            info: checked.info.clone(),
            load_secs: 0.0,
            jobs: vec![],
            streams: vec![],
            stream_plan: None,
            threads: vec![],
            reports,
            rank_failed: rank_failed.clone(),
            broken: None,
            host,
            _registered: vec![],
        };
        for (rank, comm) in comms.into_iter().enumerate() {
            let setup = RankSetup {
                rank,
                config: checked.config.clone(),
                checkpoint: checked.checkpoint.clone(),
                device: checked.options.device.device(rank),
                kind: checked.kind,
                kernels: checked.options.kernels,
                split: checked.split,
                warm_up: warm_up.clone(),
            };
            let (jobs_tx, jobs_rx) = mpsc::channel();
            match rank::spawn(setup, comm, jobs_rx, report_tx.clone(), rank_failed.clone()) {
                Ok(thread) => {
                    engine.jobs.push(jobs_tx);
                    engine.threads.push(thread);
                }
                Err(e) => return Err(engine.fail(e)),
            }
        }
        drop((report_tx, checked));
        engine.await_loaded(first, t, "rank")?;
        tracing::info!(
            "loaded {} on {:?} x{} in {:.1}s",
            engine.info.architecture,
            engine.options.device,
            engine.options.tp,
            engine.load_secs
        );
        Ok(engine)
    }

    /// The loaded model's architecture and sizes.
    pub fn model(&self) -> &ModelInfo {
        &self.info
    }

    /// The options the engine was started with.
    pub fn options(&self) -> &EngineOptions {
        &self.options
    }

    /// Seconds the model took to load.
    pub fn load_secs(&self) -> f64 {
        self.load_secs
    }

    /// Why the engine cannot run jobs any more, if a rank has failed.
    pub fn broken(&self) -> Option<&str> {
        self.broken.as_deref()
    }

    /// [`CaptureJob::prepare`] for this engine's model.
    pub fn prepare(&self, job: &CaptureJob) -> Result<PreparedJob> {
        job.prepare(&self.info, &self.options)
    }

    /// Prepares and runs one job; see [`Engine::run_prepared`].
    pub fn run(
        &mut self,
        job: &CaptureJob,
        progress: &dyn ProgressSink,
        cancel: &CancelToken,
    ) -> Result<CaptureSummary> {
        self.usable()?;
        let prepared = self.prepare(job)?;
        self.run_prepared(prepared, progress, cancel)
    }

    /// Runs one prepared job to its end, or until `cancel` (then the batches already handed
    /// to the ranks finish, every writer commits, and the summary says `cancelled`). Blocks;
    /// needs a tokio runtime (call it from `spawn_blocking`).
    pub fn run_prepared(
        &mut self,
        job: PreparedJob,
        progress: &dyn ProgressSink,
        cancel: &CancelToken,
    ) -> Result<CaptureSummary> {
        self.usable()?;
        if job.engine != self.options {
            return Err(CaptureError::Option(format!(
                "this job was prepared for {:?}, not for this engine ({:?})",
                job.engine, self.options
            )));
        }
        if let Some(plan) = &self.stream_plan {
            let largest = job.largest_batch_tokens();
            if largest > plan.batch_tokens {
                return Err(CaptureError::Option(format!(
                    "this engine streams with memory planned for batches of at most {} tokens, \
                     but the job's largest batch holds {largest} padded tokens (a sample longer \
                     than max_tokens_per_batch is a batch of its own); lower max_tokens_per_batch \
                     to {} or leave out samples longer than that",
                    plan.batch_tokens, plan.batch_tokens
                )));
            }
        }
        let io = job::runtime()?;
        progress.started(job.samples(), job.tokens());
        let mut summary = self.run_stages(&io, &job, progress, cancel)?;
        summary.version = io.block_on(job.dataset.latest_version())?;
        Ok(summary)
    }

    /// The job's threads (writers, splitter) around the ranks' work, and the summary.
    fn run_stages(
        &mut self,
        io: &tokio::runtime::Handle,
        job: &PreparedJob,
        progress: &dyn ProgressSink,
        cancel: &CancelToken,
    ) -> Result<CaptureSummary> {
        let opts = &job.job;
        let (hidden, dtype) = (self.info.hidden_size, self.options.dtype);
        // Raised when a writer or the splitter fails (the job's own error), or when the ranks
        // are lost and the splitter must stop waiting for them.
        let (writers_failed, ranks_lost) = (CancelToken::new(), CancelToken::new());
        let mut summary = job.summary.clone();
        summary.load_secs = self.load_secs;
        let mut errors = vec![];
        let mut rank0 = RankTimes::default();
        let mut returned_pool = None;
        let mut reported = None;
        let start = Instant::now();
        std::thread::scope(|s| -> Result<()> {
            let mut writer_txs = vec![];
            let mut writer_threads = vec![];
            for i in 0..self.options.writers {
                // Two samples per writer: the bounded batch queue ahead of the splitter is the
                // buffer that absorbs bursts; more here only hides a writer that cannot keep up.
                let (tx, rx) = mpsc::sync_channel::<SampleRows>(2);
                writer_txs.push(tx);
                let setup = WriterSetup {
                    io,
                    dataset: &job.dataset,
                    options: opts.writer_options,
                    policy: opts.commit,
                    dtype,
                    hidden,
                };
                let failed = &writers_failed;
                let thread = std::thread::Builder::new()
                    .name(format!("hslake-writer-{i}"))
                    .spawn_scoped(s, move || {
                        flag_error(failed, run_writer(setup, rx, progress))
                    })
                    .map_err(|e| CaptureError::Pipeline(format!("cannot start a writer: {e}")))?;
                writer_threads.push(thread);
            }
            let (host_tx, host_rx) = mpsc::sync_channel::<HostBatch>(self.options.queue_depth);
            let (recycle_tx, recycle_rx) = mpsc::channel::<Vec<PinnedBuffer>>();
            let (failed, lost) = (&writers_failed, &ranks_lost);
            let splitter = std::thread::Builder::new()
                .name("hslake-splitter".into())
                .spawn_scoped(s, move || {
                    flag_error(
                        failed,
                        split_batches(host_rx, hidden, lost, writer_txs, recycle_tx, progress),
                    )
                })
                .map_err(|e| CaptureError::Pipeline(format!("cannot start the splitter: {e}")))?;

            let held = self.held_sets(job);
            let pool = self
                .host
                .lend(job.largest_batch(), opts.points.len(), held, recycle_rx);
            let stop = Stop {
                cancel,
                writers_failed: &writers_failed,
            };
            let ran = match self.stream_plan.is_some() {
                true => self.run_streams(s, job, host_tx, pool, &mut summary, stop, progress),
                false => self.run_ranks(job, host_tx, pool, &mut summary, stop),
            };
            let Ran {
                dispatched,
                outcome,
                errors: rank_errors,
                times,
                pool: returned,
            } = ran;
            (rank0, returned_pool) = (times, returned);
            summary.cancelled = outcome == Feed::Cancelled;
            if let Some(e) = root_cause(rank_errors) {
                self.broken = Some(e.to_string());
                ranks_lost.cancel();
                errors.push(e);
            } else if dispatched < self.workers() {
                let e = CaptureError::Pipeline("a rank thread is gone".into());
                self.broken = Some(e.to_string());
                ranks_lost.cancel();
                errors.push(e);
            }
            reported = collect(splitter.join(), "splitter", &mut errors);
            for t in writer_threads {
                if let Some(w) = collect(t.join(), "writer", &mut errors) {
                    add_writer(&mut summary, w);
                }
            }
            Ok(())
        })?;
        // Every set that can come back has: the splitter and the writers are gone.
        if let Some(pool) = returned_pool {
            self.host.keep(pool);
        }
        if let Some(e) = root_cause(errors) {
            return Err(e);
        }
        let t = rank0;
        // The batches reported their time as they came; the rest (handing over the last one)
        // now, so that a job's reports add up to its summary.
        let rest = t.since(&reported.unwrap_or_default());
        progress.forward_progress(rest.compute.as_secs_f64(), rest.storage_wait.as_secs_f64());
        summary.compute_secs = t.compute.as_secs_f64();
        summary.storage_wait_secs = t.storage_wait.as_secs_f64();
        summary.run_secs = start.elapsed().as_secs_f64();
        Ok(summary)
    }

    /// Feeds every batch of `job` to every rank and waits for them: rank 0's times and pool.
    fn run_ranks(
        &self,
        job: &PreparedJob,
        host: SyncSender<HostBatch>,
        pool: Option<BufferPool>,
        summary: &mut CaptureSummary,
        stop: Stop<'_>,
    ) -> Ran {
        let (feeds, dispatched) = self.dispatch(job, host, pool);
        let outcome = feed(
            job,
            &feeds,
            summary,
            stop.cancel,
            stop.writers_failed,
            &self.rank_failed,
        );
        drop(feeds);
        let (by_rank, errors) = self.await_ranks(dispatched, |event| match event {
            RankEvent::JobDone(t, pool) => Ok((t, pool)),
            _ => Err(CaptureError::Pipeline("a rank answered out of turn".into())),
        });
        let (times, pool) = by_rank.into_iter().next().flatten().unwrap_or_default();
        Ran {
            dispatched,
            outcome,
            errors,
            times,
            pool,
        }
    }

    /// Pins `first`'s host buffers while the threads load, waits until every one has loaded
    /// (a `what`: rank or stream), and records the load time since `t`.
    fn await_loaded(&mut self, first: Option<&PreparedJob>, t: Instant, what: &str) -> Result<()> {
        if let Some(job) = first {
            self.pin_ahead(job);
        }
        let (_, errors) = self.await_ranks(self.workers(), |event| match event {
            RankEvent::Loaded => Ok(()),
            _ => Err(CaptureError::Pipeline(format!(
                "a {what} answered before loading"
            ))),
        });
        if let Some(e) = root_cause(errors) {
            return Err(self.fail(e));
        }
        self.load_secs = t.elapsed().as_secs_f64();
        Ok(())
    }

    /// Pins the host buffers `job` will copy into (CUDA), if it was prepared for this engine
    /// and has something to do.
    fn pin_ahead(&mut self, job: &PreparedJob) {
        if job.engine == self.options && !job.todo.is_empty() {
            let held = self.held_sets(job);
            self.host
                .pin_ahead(job.largest_batch(), job.job.points.len(), held);
        }
    }

    /// Rank or stream threads the engine runs.
    fn workers(&self) -> usize {
        self.jobs.len() + self.streams.len()
    }

    fn usable(&self) -> Result<()> {
        match &self.broken {
            Some(why) => Err(CaptureError::EngineBroken(why.clone())),
            None => Ok(()),
        }
    }

    /// Marks the engine broken by `e` and returns it.
    fn fail(&mut self, e: CaptureError) -> CaptureError {
        self.broken = Some(e.to_string());
        e
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Closing the job queues ends every healthy rank thread; a broken engine may have a
        // rank stuck in a collective, which nobody should wait for.
        self.jobs.clear();
        self.streams.clear();
        if self.broken.is_none() {
            for t in self.threads.drain(..) {
                let _ = t.join();
            }
        }
    }
}

/// What stops feeding a job early.
#[derive(Clone, Copy)]
struct Stop<'a> {
    cancel: &'a CancelToken,
    writers_failed: &'a CancelToken,
}

/// How the ranks' or streams' part of a job ended.
struct Ran {
    /// Ranks or streams that took the job.
    dispatched: usize,
    outcome: Feed,
    errors: Vec<CaptureError>,
    /// Rank 0's times, or the slowest stream's.
    times: RankTimes,
    /// The host buffers, back from the job.
    pool: Option<BufferPool>,
}

fn add_writer(summary: &mut CaptureSummary, w: WriterDone) {
    summary.samples += w.samples;
    summary.tokens += w.tokens;
    summary.raw_bytes += w.raw_bytes;
    summary.written_bytes += w.written_bytes;
    summary.skipped_nonfinite += w.skipped;
    summary.version = summary.version.max(w.last_version.unwrap_or(0));
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::rc::Rc;
    use std::sync::atomic::{AtomicU64, Ordering};

    use hslake_schemas::{CapturePoint, DType, FinitePolicy};

    use super::*;
    use crate::fixtures::{assert_close, values, write_inputs, write_model, TINY_LLAMA};
    use crate::gpu::comm::{Communicator, LocalComm};
    use crate::gpu::fault::{FailingComm, Fault};

    fn engine_options(dir: &std::path::Path, tp: usize) -> EngineOptions {
        let mut o = EngineOptions::new(dir.join("m"));
        o.dtype = DType::F32;
        o.tp = tp;
        o
    }

    fn job(dir: &std::path::Path, input: &str, out: &str) -> CaptureJob {
        let url = format!("file://{}", dir.join(out).display());
        let points = vec![CapturePoint::LayerOutput(0), CapturePoint::FinalNorm];
        let mut j = CaptureJob::new(dir.join(input), url, points);
        j.max_tokens_per_batch = 40;
        j
    }

    /// Runs blocking engine calls as an engine's owner would: off the async workers.
    async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        tokio::task::spawn_blocking(f).await.unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_loaded_engine_runs_job_after_job() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().to_path_buf();
        write_model(&dir.join("m"), TINY_LLAMA, None);
        write_inputs(&dir.join("all.jsonl"), 10);
        write_inputs(&dir.join("first6.jsonl"), 6);
        let (a, b, c) = blocking(move || {
            let mut engine = Engine::start(engine_options(&dir, 2)).unwrap();
            let run = |engine: &mut Engine, input, out| {
                engine
                    .run(&job(&dir, input, out), &NoProgress, &CancelToken::new())
                    .unwrap()
            };
            let a = run(&mut engine, "all.jsonl", "a");
            let b = run(&mut engine, "first6.jsonl", "b");
            let c = run(&mut engine, "all.jsonl", "c");
            (a, b, c)
        })
        .await;
        assert_eq!((a.samples, b.samples, c.samples), (10, 6, 10));
        assert_eq!(a.load_secs, c.load_secs, "the model was loaded once");
        let url = |out: &str| format!("file://{}", d.path().join(out).display());
        let (va, vb, vc) = (
            values(&url("a")).await,
            values(&url("b")).await,
            values(&url("c")).await,
        );
        assert_close(&va, &vc);
        let first6 = va
            .iter()
            .filter(|(id, _)| **id < 6)
            .map(|(k, v)| (*k, v.clone()))
            .collect();
        assert_close(&first6, &vb);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_warmed_up_engine_stores_what_a_cold_one_stores() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().to_path_buf();
        write_model(&dir.join("m"), TINY_LLAMA, None);
        write_inputs(&dir.join("in.jsonl"), 10);
        blocking(move || {
            let checked = CheckedModel::check(engine_options(&dir, 2)).unwrap();
            let prepared = job(&dir, "in.jsonl", "warm")
                .prepare(checked.model(), checked.options())
                .unwrap();
            // The first job's warm-up is its largest batch: no batch has more slots, and the
            // job's token budget bounds it.
            let w = prepared.warm_up();
            for b in &prepared.batches {
                let cols = b.iter().map(|&i| prepared.todo[i].input_ids.len()).max();
                assert!(b.len() * cols.unwrap() <= w.rows * w.cols);
            }
            assert!(w.rows * w.cols <= 40 && w.points == prepared.job.points);
            let comms = group::join_group(DeviceKind::Cpu, 2).unwrap();
            let mut warm = Engine::spawn(checked, comms, Some(&prepared), Some(w)).unwrap();
            warm.run_prepared(prepared, &NoProgress, &CancelToken::new())
                .unwrap();
            let mut cold = Engine::start(engine_options(&dir, 2)).unwrap();
            cold.run(
                &job(&dir, "in.jsonl", "cold"),
                &NoProgress,
                &CancelToken::new(),
            )
            .unwrap();
        })
        .await;
        let url = |out: &str| format!("file://{}", d.path().join(out).display());
        let (warm, cold) = (values(&url("warm")).await, values(&url("cold")).await);
        assert_eq!(warm.len(), 10);
        assert_eq!(warm, cold);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_job_error_leaves_the_engine_usable() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().to_path_buf();
        write_model(&dir.join("m"), TINY_LLAMA, None);
        write_inputs(&dir.join("good.jsonl"), 4);
        std::fs::write(
            dir.join("bad.jsonl"),
            "{\"input_ids\": [1]}\n{\"input_ids\": [99]}\n",
        )
        .unwrap();
        let errors = blocking(move || {
            let mut engine = Engine::start(engine_options(&dir, 2)).unwrap();
            let mut errors = vec![];
            let mut run = |j: CaptureJob| engine.run(&j, &NoProgress, &CancelToken::new());
            errors.push(run(job(&dir, "bad.jsonl", "ds")).unwrap_err().to_string());
            run(job(&dir, "good.jsonl", "ds")).unwrap();
            // The same dataset asked to hold other capture points.
            let mut other = job(&dir, "good.jsonl", "ds");
            other.points = vec![CapturePoint::LayerOutput(1)];
            errors.push(run(other).unwrap_err().to_string());
            let again = run(job(&dir, "good.jsonl", "again")).unwrap();
            assert_eq!(again.samples, 4);
            errors
        })
        .await;
        assert!(errors[0].contains("line 2: token id 99"), "{}", errors[0]);
        assert!(errors[1].contains("schema"), "{}", errors[1]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_store_refusal_mid_run_fails_that_job_and_not_the_engine() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().to_path_buf();
        // NaN final norm weights: every final_norm state is NaN, which the writer refuses.
        write_model(&dir.join("m"), TINY_LLAMA, Some("model.norm.weight"));
        write_inputs(&dir.join("in.jsonl"), 30);
        let (refused, kept) = blocking(move || {
            let mut engine = Engine::start(engine_options(&dir, 2)).unwrap();
            let refused = engine
                .run(
                    &job(&dir, "in.jsonl", "refused"),
                    &NoProgress,
                    &CancelToken::new(),
                )
                .unwrap_err()
                .to_string();
            assert!(engine.broken().is_none());
            let mut record = job(&dir, "in.jsonl", "kept");
            record.writer_options.finite_policy = FinitePolicy::Record;
            let kept = engine
                .run(&record, &NoProgress, &CancelToken::new())
                .unwrap();
            (refused, kept)
        })
        .await;
        assert!(refused.contains("NaN"), "{refused}");
        assert_eq!(kept.samples, 30);
    }

    /// Every row of every shard of the dataset at `url`, by sample id: its statistics columns
    /// (f64) and its tensor values (f32).
    async fn stats_and_values(url: &str) -> BTreeMap<u64, (Vec<f64>, Vec<f32>)> {
        use arrow_array::cast::AsArray;
        use arrow_array::types::{Float32Type, UInt64Type};
        let ds = hslake_store::Dataset::open(url).await.unwrap();
        let r = hslake_store::DatasetReader::open(&ds, None).await.unwrap();
        let schema = ds.manifest(None).await.unwrap().schema;
        let mut stats: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
        for (i, shard) in r.manifest().shards.iter().enumerate() {
            for g in 0..shard.row_groups.len() {
                let b = r.read_row_group(i, g, None).await.unwrap();
                let ids = b
                    .column_by_name("sample_id")
                    .unwrap()
                    .as_primitive::<UInt64Type>();
                for &p in &schema.points {
                    for kind in hslake_schemas::StatKind::ALL {
                        let col = b
                            .column_by_name(&hslake_schemas::stat_column(p, kind))
                            .unwrap();
                        for (row, id) in ids.values().iter().enumerate() {
                            let v = match col.as_primitive_opt::<Float32Type>() {
                                Some(a) => f64::from(a.value(row)),
                                None => col.as_primitive::<UInt64Type>().value(row) as f64,
                            };
                            stats.entry(*id).or_default().push(v);
                        }
                    }
                }
            }
        }
        let values = values(url).await;
        stats
            .into_iter()
            .map(|(id, s)| (id, (s, values[&id].clone())))
            .collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn rank_0_splitting_states_stores_what_the_writers_store() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().to_path_buf();
        write_model(&dir.join("m"), TINY_LLAMA, None);
        write_model(&dir.join("nan"), TINY_LLAMA, Some("model.norm.weight"));
        // Mixed lengths, so that slots carry padding the split must leave out.
        write_inputs(&dir.join("in.jsonl"), 9);
        let errors = blocking(move || {
            let options = |model: &str, dtype, split| {
                let mut o = EngineOptions::new(dir.join(model));
                o.dtype = dtype;
                o.plane_split = split;
                o.writers = 2;
                o
            };
            for (split, out) in [
                (PlaneSplit::Writers, "writers"),
                (PlaneSplit::Rank0, "rank0"),
            ] {
                let mut engine = Engine::start(options("m", DType::Bf16, split)).unwrap();
                let j = job(&dir, "in.jsonl", out);
                engine.run(&j, &NoProgress, &CancelToken::new()).unwrap();
            }
            // The writers' finite policy reads the statistics rank 0 sends.
            let mut nan_engine =
                Engine::start(options("nan", DType::Bf16, PlaneSplit::Rank0)).unwrap();
            let refused = job(&dir, "in.jsonl", "refused");
            let nan = nan_engine
                .run(&refused, &NoProgress, &CancelToken::new())
                .unwrap_err();
            // A split rank 0 cannot run is refused before the model loads.
            let f32 = Engine::start(options("m", DType::F32, PlaneSplit::Rank0)).err();
            [Some(nan), f32]
        })
        .await;
        let url = |out: &str| format!("file://{}", d.path().join(out).display());
        let (by_writers, by_rank) = (
            stats_and_values(&url("writers")).await,
            stats_and_values(&url("rank0")).await,
        );
        assert_eq!(by_writers.len(), 9);
        assert_eq!(
            by_writers.keys().collect::<Vec<_>>(),
            by_rank.keys().collect::<Vec<_>>()
        );
        for (id, (stats, values)) in &by_writers {
            let (rank_stats, rank_values) = &by_rank[id];
            assert_eq!(values, rank_values, "sample {id}");
            for (a, b) in stats.iter().zip(rank_stats) {
                assert!(
                    (a - b).abs() <= a.abs() * 1e-6,
                    "sample {id}: {stats:?} against {rank_stats:?}"
                );
            }
        }
        let err = errors[0].as_ref().unwrap().to_string();
        assert!(err.contains("NaN"), "{err}");
        let err = errors[1]
            .as_ref()
            .expect("an f32 engine splitting on rank 0");
        let err = err.to_string();
        assert!(err.contains("rank0") && err.contains("not bf16"), "{err}");
    }

    /// A TP-2 engine whose rank 1 fails as `fault` says in the job's third batch (each batch
    /// all-reduces 5 times): the first run's error, and the second run's.
    async fn failing_rank(fault: Fault) -> (CaptureError, CaptureError) {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().to_path_buf();
        write_model(&dir.join("m"), TINY_LLAMA, None);
        write_inputs(&dir.join("in.jsonl"), 10);
        blocking(move || {
            let checked = CheckedModel::check(engine_options(&dir, 2)).unwrap();
            let comms = LocalComm::group(2)
                .into_iter()
                .map(|c| {
                    let fail_at = if c.rank() == 1 { 12 } else { 0 };
                    Box::new(move || {
                        Ok(Rc::new(FailingComm::new(c, fail_at, fault)) as Rc<dyn Communicator>)
                    }) as CommInit
                })
                .collect();
            let mut engine = Engine::spawn(checked, comms, None, None).unwrap();
            let mut j = job(&dir, "in.jsonl", "ds");
            j.max_tokens_per_batch = 1;
            let first = engine
                .run(&j, &NoProgress, &CancelToken::new())
                .unwrap_err();
            assert!(engine.broken().is_some());
            let second = engine
                .run(&j, &NoProgress, &CancelToken::new())
                .unwrap_err();
            (first, second)
        })
        .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failing_rank_breaks_the_engine_and_nothing_hangs() {
        let (first, second) = failing_rank(Fault::Comm).await;
        assert_eq!(first.to_string(), "communicator (rank 1): injected failure");
        let second = second.to_string();
        assert!(second.starts_with("the capture engine is broken by an earlier failure (communicator (rank 1): injected failure)"), "{second}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_refused_allocation_fails_the_job_as_out_of_memory_naming_the_knobs() {
        let (first, second) = failing_rank(Fault::OutOfMemory).await;
        assert!(matches!(first, CaptureError::OutOfMemory { .. }), "{first}");
        let first = first.to_string();
        assert!(first.starts_with("out of memory: "), "{first}");
        for knob in [
            "--max-tokens-per-batch",
            "--pass-tokens",
            "--batch",
            "--placement stream",
        ] {
            assert!(first.contains(knob), "{knob} missing: {first}");
        }
        assert!(second.to_string().contains("out of memory"), "{second}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn shards_fill_one_dataset_and_resume_is_per_shard() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().to_path_buf();
        write_model(&dir.join("m"), TINY_LLAMA, None);
        write_inputs(&dir.join("in.jsonl"), 11);
        let (whole, s0, refused, s1, again) = blocking(move || {
            let mut engine = Engine::start(engine_options(&dir, 1)).unwrap();
            let mut run = |out: &str, shard: Option<&str>, resume: bool| {
                let mut j = job(&dir, "in.jsonl", out);
                j.shard = shard.map(|s| s.parse().unwrap());
                j.resume = resume;
                engine.run(&j, &NoProgress, &CancelToken::new())
            };
            let whole = run("whole", None, false).unwrap();
            let s0 = run("split", Some("0/2"), false).unwrap();
            let refused = run("split", Some("0/2"), false).unwrap_err().to_string();
            // The other shard starts without --resume although the dataset holds samples.
            let s1 = run("split", Some("1/2"), false).unwrap();
            let again = run("split", Some("1/2"), true).unwrap();
            (whole, s0, refused, s1, again)
        })
        .await;
        assert_eq!((whole.samples, s0.samples, s1.samples), (11, 6, 5));
        assert!(
            refused.contains("already holds 6 samples of shard 0/2"),
            "{refused}"
        );
        assert_eq!((again.samples, again.skipped_committed), (0, 5));
        let url = |n: &str| format!("file://{}", d.path().join(n).display());
        assert_close(&values(&url("whole")).await, &values(&url("split")).await);
    }

    /// Adds up the byte and commit reports.
    #[derive(Default)]
    struct Totals {
        raw: AtomicU64,
        stored: AtomicU64,
        commits: AtomicU64,
        timed_commits: AtomicU64,
        forward_reports: AtomicU64,
        compute_nanos: AtomicU64,
    }

    impl ProgressSink for Totals {
        fn forward_progress(&self, compute_secs: f64, storage_wait_secs: f64) {
            assert!(compute_secs >= 0.0 && storage_wait_secs >= 0.0);
            self.forward_reports.fetch_add(1, Ordering::Relaxed);
            let nanos = (compute_secs * 1e9) as u64;
            self.compute_nanos.fetch_add(nanos, Ordering::Relaxed);
        }
        fn committed(&self, _version: u64) {
            self.commits.fetch_add(1, Ordering::Relaxed);
        }
        fn commit_took(&self, secs: f64) {
            assert!(secs >= 0.0);
            self.timed_commits.fetch_add(1, Ordering::Relaxed);
        }
        fn bytes_written(&self, raw: u64, stored: u64) {
            self.raw.fetch_add(raw, Ordering::Relaxed);
            self.stored.fetch_add(stored, Ordering::Relaxed);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn byte_and_forward_reports_add_up_to_the_summary_and_every_commit_is_timed() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().to_path_buf();
        write_model(&dir.join("m"), TINY_LLAMA, None);
        write_inputs(&dir.join("in.jsonl"), 30);
        let (summary, totals) = blocking(move || {
            let mut options = engine_options(&dir, 1);
            options.writers = 2;
            let mut engine = Engine::start(options).unwrap();
            let mut j = job(&dir, "in.jsonl", "ds");
            j.commit = CommitPolicy {
                every: 4,
                interval: Duration::from_secs(60),
            };
            let totals = Totals::default();
            let summary = engine.run(&j, &totals, &CancelToken::new()).unwrap();
            (summary, totals)
        })
        .await;
        assert!(summary.written_bytes > 0);
        assert_eq!(totals.raw.load(Ordering::Relaxed), summary.raw_bytes);
        assert_eq!(totals.stored.load(Ordering::Relaxed), summary.written_bytes);
        let commits = totals.commits.load(Ordering::Relaxed);
        assert!(commits >= 2, "{commits}");
        assert_eq!(totals.timed_commits.load(Ordering::Relaxed), commits);
        // One forward report per batch, live, and the rest at the end; together the summary's.
        assert_eq!(
            totals.forward_reports.load(Ordering::Relaxed),
            summary.batches + 1
        );
        let live = totals.compute_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        assert!(
            live > 0.0 && (live - summary.compute_secs).abs() < 1e-6,
            "{live} vs {summary:?}"
        );
    }

    /// Counts events, and cancels after the first sample.
    #[derive(Default)]
    struct CancelAfterFirst {
        cancel: CancelToken,
        started: AtomicU64,
        samples: AtomicU64,
        commits: AtomicU64,
    }

    impl ProgressSink for CancelAfterFirst {
        fn started(&self, samples: u64, _tokens: u64) {
            self.started.store(samples, Ordering::Relaxed);
        }
        fn sample_done(&self, _tokens: u64) {
            self.samples.fetch_add(1, Ordering::Relaxed);
            self.cancel.cancel();
        }
        fn committed(&self, _version: u64) {
            self.commits.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cancel_commits_the_batches_in_flight_and_resume_captures_the_rest() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().to_path_buf();
        write_model(&dir.join("m"), TINY_LLAMA, None);
        write_inputs(&dir.join("in.jsonl"), 200);
        let (cancelled, sink, rest) = blocking(move || {
            let mut engine = Engine::start(engine_options(&dir, 1)).unwrap();
            // One sample per batch: 200 batches, far more than the queues hold.
            let mut j = job(&dir, "in.jsonl", "ds");
            j.max_tokens_per_batch = 1;
            let sink = CancelAfterFirst::default();
            let cancelled = engine.run(&j, &sink, &sink.cancel.clone()).unwrap();
            j.resume = true;
            let rest = engine.run(&j, &NoProgress, &CancelToken::new()).unwrap();
            (cancelled, sink, rest)
        })
        .await;
        assert!(cancelled.cancelled);
        assert!(
            0 < cancelled.samples && cancelled.samples < 200,
            "{}",
            cancelled.samples
        );
        assert_eq!(sink.started.load(Ordering::Relaxed), 200);
        assert_eq!(sink.samples.load(Ordering::Relaxed), cancelled.samples);
        assert!(sink.commits.load(Ordering::Relaxed) >= 1);
        assert!(!rest.cancelled);
        assert_eq!(
            (rest.skipped_committed, rest.samples),
            (cancelled.samples, 200 - cancelled.samples)
        );
        let url = format!("file://{}", d.path().join("ds").display());
        assert_eq!(values(&url).await.len(), 200);
    }
}
