//! `hslake serve-capture`: the capture daemon. It checks the model, loads it once on its ranks,
//! and runs the jobs submitted over HTTP one at a time in submission order. Jobs live under
//! `--state` (see [`state`]); after a crash or a stop signal a restart re-queues what was
//! queued and resumes the job that was running from its dataset's manifest (the capture's own
//! `--resume`), so every sample is captured exactly once.
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use hslake_capture::{CancelToken, CheckedModel, Engine, EngineOptions, ModelInfo, ProgressSink};
use hslake_schemas::units::{show_size, DurationRange, SizeRange};
use tokio::sync::Notify;
use tracing::Instrument;

use crate::capture::{EngineArgs, JobArgs};
use admission::{AllowedOutputs, SpoolBudget};
use hslake_cli::cmd::listen::http::HttpArgs;
use metrics::Metrics;
use state::{JobState, StateStore, StatusRecord, SummaryRecord};

mod admission;
mod api;
mod metrics;
pub mod state;

/// `--shutdown-timeout`: a millisecond up to a day.
const SHUTDOWN_TIMEOUT: DurationRange = DurationRange::seconds(
    "--shutdown-timeout",
    Duration::from_millis(1),
    Duration::from_secs(86_400),
);
/// `--max-job-bytes`: a byte up to a PiB.
const MAX_JOB_BYTES: SizeRange = SizeRange::bytes("--max-job-bytes", 1, 1 << 50);
/// `--max-spool-bytes`: a byte up to a PiB.
const MAX_SPOOL_BYTES: SizeRange = SizeRange::bytes("--max-spool-bytes", 1, 1 << 50);

/// Arguments of `hslake serve-capture`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The model, loaded once, and how it runs.
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Address the job API listens on.
    #[arg(long, default_value = "127.0.0.1:8470")]
    pub bind: SocketAddr,
    /// Where the job list is kept: a local directory or an object-store URL (s3://bucket/prefix).
    #[arg(long)]
    pub state: String,
    /// File holding the bearer token every route but /healthz and /readyz requires (first line).
    #[arg(long)]
    pub token_file: PathBuf,
    /// How long a stop signal waits for the job in flight to commit before the daemon gives
    /// up and exits non-zero, e.g. 60s (a bare number is seconds).
    #[arg(long, default_value = "60s", value_parser = SHUTDOWN_TIMEOUT.parser())]
    pub shutdown_timeout: Duration,
    /// Connection caps and deadlines of the job API.
    #[command(flatten)]
    pub http: HttpArgs,
    /// Largest job input taken, e.g. 20GiB, in bytes of its file and of its samples once read
    /// (5 bytes a token, 192 a sample: what the job holds while it runs); a larger one is
    /// refused with 413.
    #[arg(long, default_value = "4GiB", value_parser = MAX_JOB_BYTES.parser())]
    pub max_job_bytes: u64,
    /// Memory the checks of job inputs in progress may take together, across submissions (a
    /// check reads its input record by record: at most 1.25 times a JSONL input's size plus
    /// 1 MiB, and a Parquet input is counted as --max-job-bytes); a submission past it is
    /// refused with 503, to retry later. At least what the largest input's check takes.
    #[arg(long, default_value = "8GiB", value_parser = MAX_SPOOL_BYTES.parser())]
    pub max_spool_bytes: u64,
    /// A dataset URL prefix jobs may write under (repeatable), e.g. file:///data/captures or
    /// s3://bucket/captures; default: the directory holding --state (the current directory
    /// when --state is not local). Other outputs are refused with 403.
    #[arg(long = "allowed-output")]
    pub allowed_outputs: Vec<String>,
}

/// The daemon's shared state: the engine's identity, the jobs and their progress.
pub struct Daemon {
    token: String,
    engine_options: EngineOptions,
    model: ModelInfo,
    state: StateStore,
    inner: Mutex<Inner>,
    /// Wakes the worker when a job is queued or a stop is requested.
    wake: Notify,
    /// Serialises submissions, so ids follow submission order.
    submit: tokio::sync::Mutex<()>,
    metrics: Arc<Metrics>,
    ready: AtomicBool,
    /// Where jobs may write.
    allowed: AllowedOutputs,
    /// `--max-job-bytes`.
    max_job_bytes: u64,
    /// Inputs being checked now, against `--max-spool-bytes`.
    spool: Arc<SpoolBudget>,
}

#[derive(Default)]
struct Inner {
    jobs: BTreeMap<u64, Job>,
    /// A stop signal arrived: start nothing new.
    stopping: bool,
}

/// One job as the daemon tracks it.
struct Job {
    spec: JobArgs,
    state: JobState,
    error: Option<String>,
    summary: Option<SummaryRecord>,
    /// Status records written so far.
    records: u32,
    /// An earlier run started it: the next run resumes its dataset.
    started_before: bool,
    progress: Option<Arc<JobProgress>>,
    cancel: CancelToken,
    /// `DELETE` asked for it (a stop signal also cancels, but leaves the job resumable).
    cancel_requested: bool,
}

impl Job {
    fn new(spec: JobArgs) -> Self {
        Job {
            spec,
            state: JobState::Queued,
            error: None,
            summary: None,
            records: 0,
            started_before: false,
            progress: None,
            cancel: CancelToken::new(),
            cancel_requested: false,
        }
    }

    /// The job as the API serves it.
    fn view(&self, id: u64) -> serde_json::Value {
        let p = self.progress.as_deref();
        let load = |a: Option<&AtomicU64>| a.map_or(0, |a| a.load(Ordering::Relaxed));
        let s = self.summary.as_ref();
        // A job finished before this daemon started has no live progress, only its summary.
        let (done, total, tokens, raw, stored) = match (p, s) {
            (None, Some(s)) => (s.samples, s.samples, s.tokens, s.raw_bytes, s.written_bytes),
            _ => (
                load(p.map(|p| &p.samples)),
                load(p.map(|p| &p.total_samples)),
                load(p.map(|p| &p.tokens)),
                load(p.map(|p| &p.raw_bytes)),
                load(p.map(|p| &p.stored_bytes)),
            ),
        };
        let secs = p.map_or(0.0, |p| p.start.elapsed().as_secs_f64());
        let secs = s
            .filter(|_| self.state.is_final())
            .map_or(secs, |s| s.run_secs);
        let rate = if secs > 0.0 {
            tokens as f64 / secs
        } else {
            0.0
        };
        let eta = (self.state == JobState::Running && done > 0)
            .then(|| (total.saturating_sub(done)) as f64 * secs / done as f64);
        serde_json::json!({
            "id": id,
            "state": self.state.name(),
            "input": self.spec.input,
            "output": self.spec.output,
            "samples_done": done,
            "samples_total": total,
            "tokens_done": tokens,
            "tokens_per_s": rate,
            "eta_secs": eta,
            "commits": load(p.map(|p| &p.commits)),
            "raw_bytes": raw,
            "written_bytes": stored,
            "compression_ratio": if stored > 0 { raw as f64 / stored as f64 } else { 0.0 },
            "error": self.error,
            "summary": self.summary,
            "spec": self.spec,
        })
    }
}

/// A running job's progress, fed by the engine's writer threads; also feeds the metrics.
struct JobProgress {
    /// The job's id, for the log lines of the engine's writer threads (outside the job's span).
    id: u64,
    metrics: Arc<Metrics>,
    start: Instant,
    total_samples: AtomicU64,
    samples: AtomicU64,
    tokens: AtomicU64,
    commits: AtomicU64,
    raw_bytes: AtomicU64,
    stored_bytes: AtomicU64,
}

impl ProgressSink for JobProgress {
    fn started(&self, samples: u64, _tokens: u64) {
        self.total_samples.store(samples, Ordering::Relaxed);
    }

    fn sample_done(&self, tokens: u64) {
        self.samples.fetch_add(1, Ordering::Relaxed);
        self.tokens.fetch_add(tokens, Ordering::Relaxed);
        self.metrics.samples.inc();
        self.metrics.tokens.inc_by(tokens);
    }

    fn committed(&self, version: u64) {
        self.commits.fetch_add(1, Ordering::Relaxed);
        self.metrics.commits.inc();
        tracing::info!(job = self.id, version, "committed");
    }

    fn commit_took(&self, secs: f64) {
        self.metrics.commit_seconds.observe(secs);
    }

    fn forward_progress(&self, compute_secs: f64, storage_wait_secs: f64) {
        self.metrics.forward_seconds.inc_by(compute_secs);
        self.metrics.storage_wait_seconds.inc_by(storage_wait_secs);
    }

    fn bytes_written(&self, raw: u64, stored: u64) {
        self.raw_bytes.fetch_add(raw, Ordering::Relaxed);
        self.stored_bytes.fetch_add(stored, Ordering::Relaxed);
        self.metrics.raw_bytes.inc_by(raw);
        self.metrics.stored_bytes.inc_by(stored);
    }

    fn pass_done(&self, pass: &hslake_capture::PassReport) {
        self.metrics.pass_done(pass);
    }
}

impl Daemon {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves plain data behind; keep serving it.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn update_metrics(&self, inner: &Inner) {
        self.metrics.set_jobs(inner.jobs.values().map(|j| j.state));
    }

    /// Records `record` as job `id`'s next status and applies it in memory.
    async fn record(&self, id: u64, record: StatusRecord) -> Result<()> {
        let n = {
            let inner = self.lock();
            inner.jobs.get(&id).map_or(0, |j| j.records) + 1
        };
        self.state.record(id, n, &record).await?;
        let mut inner = self.lock();
        if let Some(j) = inner.jobs.get_mut(&id) {
            j.records = n;
            j.state = record.state;
            j.error = record.error;
            if record.summary.is_some() {
                j.summary = record.summary;
            }
        }
        self.update_metrics(&inner);
        Ok(())
    }

    /// The next queued job, marked running in memory; None when stopping or nothing is queued.
    fn take_next(&self) -> Option<(u64, JobArgs, bool, Arc<JobProgress>, CancelToken)> {
        let mut inner = self.lock();
        if inner.stopping {
            return None;
        }
        let (id, job) = inner
            .jobs
            .iter_mut()
            .find(|(_, j)| j.state == JobState::Queued)?;
        let progress = Arc::new(JobProgress {
            id: *id,
            metrics: self.metrics.clone(),
            start: Instant::now(),
            total_samples: AtomicU64::new(0),
            samples: AtomicU64::new(0),
            tokens: AtomicU64::new(0),
            commits: AtomicU64::new(0),
            raw_bytes: AtomicU64::new(0),
            stored_bytes: AtomicU64::new(0),
        });
        job.state = JobState::Running;
        job.progress = Some(progress.clone());
        let resume = job.started_before;
        job.started_before = true;
        let out = (*id, job.spec.clone(), resume, progress, job.cancel.clone());
        self.update_metrics(&inner);
        Some(out)
    }
}

/// Runs jobs on the loaded engine until a stop; an error means the engine cannot go on.
async fn worker(d: Arc<Daemon>, mut engine: Engine) -> Result<()> {
    loop {
        let Some((id, spec, resume, progress, cancel)) = d.take_next() else {
            if d.lock().stopping {
                return Ok(());
            }
            d.wake.notified().await;
            continue;
        };
        let span = tracing::info_span!("job", id);
        let recorded = d
            .record(id, StatusRecord::now(JobState::Running))
            .instrument(span.clone())
            .await;
        let admitted = recorded.and_then(|()| api::job_for(&d, &spec).map_err(anyhow::Error::msg));
        let mut job = match admitted {
            Ok(job) => job,
            Err(e) => {
                fail(&d, id, format!("{e:#}")).instrument(span).await;
                continue;
            }
        };
        job.resume |= resume;
        span.in_scope(|| {
            tracing::info!(
                input = %spec.input.display(),
                output = %spec.output,
                resume = job.resume,
                "job started"
            )
        });
        let sink = progress.clone();
        let run_span = span.clone();
        let (back, result) = tokio::task::spawn_blocking(move || {
            let _entered = run_span.enter();
            let r = engine.run(&job, &*sink, &cancel);
            (engine, r)
        })
        .await
        .map_err(|e| anyhow!("the engine thread panicked: {e}"))?;
        engine = back;
        let (stopping, cancel_requested) = {
            let inner = d.lock();
            let requested = inner.jobs.get(&id).is_some_and(|j| j.cancel_requested);
            (inner.stopping, requested)
        };
        let record = match result {
            Ok(s) => {
                span.in_scope(|| {
                    tracing::info!(
                        samples = s.samples,
                        skipped_committed = s.skipped_committed,
                        version = s.version,
                        cancelled = s.cancelled,
                        "job ended"
                    )
                });
                if s.cancelled && !cancel_requested {
                    // Stopped by a signal: it stays "running" in the state store, so the next
                    // start resumes it.
                    let mut inner = d.lock();
                    if let Some(j) = inner.jobs.get_mut(&id) {
                        j.summary = Some(SummaryRecord::from(&s));
                    }
                    return Ok(());
                }
                let mut r = StatusRecord::now(if s.cancelled {
                    JobState::Cancelled
                } else {
                    JobState::Done
                });
                r.summary = Some(SummaryRecord::from(&s));
                r
            }
            Err(e) => {
                span.in_scope(|| tracing::error!("job failed: {e}"));
                let mut r = StatusRecord::now(JobState::Failed);
                r.error = Some(e.to_string());
                r
            }
        };
        if let Err(e) = d.record(id, record).instrument(span.clone()).await {
            // The outcome could not be recorded: the job stays "running" in the state store
            // and the next start resumes it (its samples are committed, so nothing repeats).
            span.in_scope(|| tracing::error!("cannot record the job's end: {e:#}"));
        }
        if let Some(why) = engine.broken() {
            bail!("the capture engine cannot run more jobs: {why}");
        }
        if stopping {
            return Ok(());
        }
    }
}

/// Marks job `id` failed with `error`, in the state store if it can be written.
async fn fail(d: &Daemon, id: u64, error: String) {
    tracing::error!("job failed: {error}");
    let mut r = StatusRecord::now(JobState::Failed);
    r.error = Some(error.clone());
    if let Err(e) = d.record(id, r).await {
        tracing::error!("cannot record the failure: {e:#}");
        let mut inner = d.lock();
        if let Some(j) = inner.jobs.get_mut(&id) {
            (j.state, j.error) = (JobState::Failed, Some(error));
        }
    }
}

/// Resolves on SIGTERM or SIGINT.
async fn stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(e) => {
                tracing::warn!("cannot watch SIGTERM ({e}); only Ctrl-C stops the daemon");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
}

/// Runs the daemon until a stop signal (exit 0 once the job in flight has committed) or until
/// the engine fails (non-zero, with the cause).
pub async fn run(args: Args) -> Result<ExitCode> {
    let token = hslake_cli::cmd::read_token_file(&args.token_file)?;
    args.http.conn.check()?;
    let largest_check = hslake_capture::check_memory(args.max_job_bytes);
    if args.max_spool_bytes < largest_check {
        bail!(
            "--max-spool-bytes {} is below the {} that checking an input of --max-job-bytes {} \
             may take: a job of the largest size could never be checked",
            show_size(args.max_spool_bytes),
            show_size(largest_check),
            show_size(args.max_job_bytes)
        );
    }
    let state = StateStore::open(&args.state)?;
    let allowed = AllowedOutputs::new(&args.allowed_outputs, &args.state)?;
    let engine_options = args.engine.options();
    let check_options = engine_options.clone();
    let checked = tokio::task::spawn_blocking(move || CheckedModel::check(check_options))
        .await?
        .with_context(|| {
            format!(
                "checking the model in {}",
                args.engine.forward.model.display()
            )
        })?;
    let metrics = Arc::new(Metrics::new());
    let d = Arc::new(Daemon {
        token,
        engine_options,
        model: checked.model().clone(),
        state,
        inner: Mutex::new(Inner::default()),
        wake: Notify::new(),
        submit: tokio::sync::Mutex::new(()),
        metrics,
        ready: AtomicBool::new(false),
        allowed,
        max_job_bytes: args.max_job_bytes,
        spool: SpoolBudget::new(args.max_spool_bytes),
    });
    recover(&d).await?;

    let listener = hslake_cli::cmd::listen::bind(args.bind)?;
    let addr = listener.local_addr()?;
    tokio::spawn(hslake_cli::cmd::listen::http::serve(
        listener,
        api::router(d.clone()),
        args.http.clone(),
    ));
    tracing::info!(
        %addr,
        state = d.state.url(),
        allowed_outputs = d.allowed.describe(),
        max_job_bytes = show_size(args.max_job_bytes),
        max_spool_bytes = show_size(args.max_spool_bytes),
        max_connections = args.http.conn.max_connections,
        per_client = args.http.conn.max_connections_per_client,
        "capture daemon listening; loading the model"
    );

    let load = tokio::task::spawn_blocking(move || Engine::load(checked));
    let engine = tokio::select! {
        loaded = load => loaded.map_err(|e| anyhow!("the loading thread panicked: {e}"))?
            .context("loading the model")?,
        _ = stop_signal() => {
            tracing::info!("stopped while loading the model; no job had started");
            // The loading thread cannot be interrupted, and the runtime would wait for it.
            std::process::exit(0);
        }
    };
    d.ready.store(true, Ordering::Relaxed);
    d.metrics.ready.set(1);
    tracing::info!(
        load_secs = format!("{:.1}", engine.load_secs()),
        "model loaded; serving jobs"
    );
    let mut work = tokio::spawn(worker(d.clone(), engine));
    tokio::select! {
        r = &mut work => {
            d.ready.store(false, Ordering::Relaxed);
            d.metrics.ready.set(0);
            r.map_err(|e| anyhow!("the job worker panicked: {e}"))??;
            bail!("the job worker stopped unexpectedly");
        }
        _ = stop_signal() => {}
    }
    tracing::info!("stop requested: finishing the batches in flight and committing");
    {
        let mut inner = d.lock();
        inner.stopping = true;
        for j in inner.jobs.values().filter(|j| j.state == JobState::Running) {
            j.cancel.cancel();
        }
    }
    d.wake.notify_one();
    match tokio::time::timeout(args.shutdown_timeout, work).await {
        Ok(r) => {
            r.map_err(|e| anyhow!("the job worker panicked: {e}"))??;
            tracing::info!("stopped; a restart resumes any unfinished job");
            Ok(ExitCode::SUCCESS)
        }
        Err(_) => bail!(
            "the job in flight did not commit within --shutdown-timeout {}; \
             a restart resumes it from its last commit",
            hslake_schemas::units::show_duration(args.shutdown_timeout)
        ),
    }
}

/// Loads the job list: finished jobs stay finished; queued and interrupted (running) ones are
/// queued again, the interrupted ones to resume their dataset.
async fn recover(d: &Daemon) -> Result<()> {
    let stored = d.state.load().await?;
    let mut inner = d.lock();
    let (mut requeued, mut resumed) = (0, 0);
    for s in stored {
        let mut job = Job::new(s.spec);
        job.records = s.history.len() as u32;
        job.started_before = s.history.iter().any(|r| r.state == JobState::Running);
        if let Some(last) = s.history.last() {
            job.state = last.state;
            job.error = last.error.clone();
            job.summary = last.summary.clone();
        }
        if !job.state.is_final() {
            if job.state == JobState::Running {
                resumed += 1;
            } else {
                requeued += 1;
            }
            job.state = JobState::Queued;
        }
        inner.jobs.insert(s.id, job);
    }
    if !inner.jobs.is_empty() {
        tracing::info!(
            jobs = inner.jobs.len(),
            requeued,
            resumed,
            "recovered the job list"
        );
    }
    d.update_metrics(&inner);
    drop(inner);
    d.wake.notify_one();
    Ok(())
}
