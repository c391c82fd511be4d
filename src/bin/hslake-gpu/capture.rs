//! `hslake capture`: run a checkpoint over tokenized samples and write hidden states, with a
//! progress bar (or a log line every 10 s without a terminal); Ctrl-C stops after the batches
//! in flight and commits what they captured.
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::Context;
use hslake_capture::{
    capture_with, CancelToken, CaptureJob, CaptureOptions, CommitPolicy, DeviceKind, EngineOptions,
    Kernels, PlacementOptions, PlaneSplit, ProgressSink,
};
pub use hslake_cli::cmd::capture_job::JobArgs;
use hslake_schemas::DType;
use hslake_store::WriterOptions;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Capture hidden states of a Hugging Face checkpoint into a dataset.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The model and how it runs.
    #[command(flatten)]
    pub engine: EngineArgs,
    /// What to capture and where.
    #[command(flatten)]
    pub job: JobArgs,
    /// Do not draw a progress bar (progress is then logged every 10 s).
    #[arg(long)]
    pub no_progress: bool,
}

/// The model and how it runs: fixed for an engine's life (`hslake capture` and
/// `hslake serve-capture` take the same flags).
#[derive(clap::Args, Debug, Clone)]
pub struct EngineArgs {
    /// The model and how its forward computes.
    #[command(flatten)]
    pub forward: ForwardArgs,
    /// Where the forward runs: cpu or cuda.
    #[arg(long, default_value = "cpu")]
    pub device: DeviceKind,
    /// Parallel store writers (compression threads); default 1 on cpu, all spare cores on cuda.
    #[arg(long)]
    pub writers: Option<usize>,
    /// Captured batches that may queue for the writers before the forward waits.
    #[arg(long, default_value_t = 4)]
    pub queue_depth: usize,
    /// Where captured states are split into the store's byte planes: auto (on the GPU, by one
    /// kernel before the host copy, for bf16 runs on cuda; by the writers otherwise), writers
    /// (each writer splits its samples and computes their statistics) or rank0 (rank 0 before
    /// the copy; on cpu the reference split, for checks).
    #[arg(long, default_value = "auto")]
    pub plane_split: PlaneSplit,
}

/// The model and how its forward computes: the flags `hslake capture`, `hslake serve-capture`
/// and `hslake debug prefill` share.
#[derive(clap::Args, Debug, Clone)]
pub struct ForwardArgs {
    /// Checkpoint directory: config.json plus model.safetensors or a sharded index.
    #[arg(long)]
    pub model: PathBuf,
    /// Tensor-parallel size (GPUs 0..N on cuda; threads on cpu).
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Compute and stored dtype: bf16, f16 or f32.
    #[arg(long, default_value = "bf16")]
    pub dtype: DType,
    /// How the forward computes.
    #[command(flatten)]
    pub kernels: Kernels,
    /// Where the weights live, the GPU memory to plan for, and how to stream.
    #[command(flatten)]
    pub placement: PlacementOptions,
}

impl ForwardArgs {
    /// The library's engine options for a forward on `device`.
    pub fn options(&self, device: DeviceKind) -> EngineOptions {
        let mut o = EngineOptions::new(self.model.clone());
        o.tp = self.tp;
        o.device = device;
        o.dtype = self.dtype;
        o.kernels = self.kernels;
        o.placement = self.placement.clone();
        o
    }
}

impl EngineArgs {
    /// The library's engine options.
    pub fn options(&self) -> EngineOptions {
        let mut o = self.forward.options(self.device);
        // On GPUs compression must keep up with the forward: every core but the ones running
        // the ranks and the splitter writes.
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        o.writers = self.writers.unwrap_or(match self.device {
            DeviceKind::Cpu => 1,
            DeviceKind::Cuda => cores.saturating_sub(self.forward.tp + 1).max(1),
        });
        o.queue_depth = self.queue_depth;
        o.plane_split = self.plane_split;
        o
    }
}

/// The library's job for one job's flags.
pub fn capture_job(a: &JobArgs) -> anyhow::Result<CaptureJob> {
    let points = a.checked_points()?;
    let mut job = CaptureJob::new(a.input.clone(), a.output.clone(), points);
    job.max_tokens_per_batch = a.max_tokens_per_batch;
    job.max_seq_len = a.max_seq_len;
    job.overlong = a.overlong;
    job.resume = a.resume;
    job.shard = a.shard;
    job.commit = CommitPolicy {
        every: a.commit_every,
        interval: a.commit_interval,
    };
    job.writer_options = WriterOptions {
        zstd_level: a.zstd_level,
        ..WriterOptions::default()
    };
    Ok(job)
}

impl Args {
    /// The library's options for these arguments.
    fn options(&self) -> anyhow::Result<CaptureOptions> {
        Ok(CaptureOptions {
            engine: self.engine.options(),
            job: capture_job(&self.job)?,
        })
    }
}

/// Runs the capture and prints its summary; exit code 130 when stopped by Ctrl-C.
pub async fn run(a: Args) -> anyhow::Result<ExitCode> {
    let opts = a.options()?;
    let progress =
        Progress::new(!a.no_progress && std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let bar = progress.bar.clone();
    let cancel = CancelToken::new();
    let on_interrupt = cancel.clone();
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            tracing::warn!(
                "interrupted: finishing the batches in flight and committing (Ctrl-C again to quit at once)"
            );
            on_interrupt.cancel();
            if tokio::signal::ctrl_c().await.is_ok() {
                std::process::exit(130);
            }
        }
    });
    let result = capture_with(opts, progress, cancel).await;
    bar.finish_and_clear();
    let summary = result.with_context(|| format!("capture into {}", a.job.output))?;
    println!("{summary}");
    Ok(if summary.cancelled {
        ExitCode::from(130)
    } else {
        ExitCode::SUCCESS
    })
}

/// The capture's progress on stderr: a bar on a terminal, else a log line every 10 s.
struct Progress {
    bar: ProgressBar,
    total: AtomicU64,
    samples: AtomicU64,
    tokens: AtomicU64,
    start: Instant,
    last_log: Mutex<Instant>,
}

impl Progress {
    fn new(draw: bool) -> Self {
        let target = if draw {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        let bar = ProgressBar::with_draw_target(None, target);
        if let Ok(style) = ProgressStyle::with_template(
            "{bar:30} {pos}/{len} samples | {msg} | {elapsed_precise} elapsed, ETA {eta}",
        ) {
            bar.set_style(style);
        }
        Progress {
            bar,
            total: AtomicU64::new(0),
            samples: AtomicU64::new(0),
            tokens: AtomicU64::new(0),
            start: Instant::now(),
            last_log: Mutex::new(Instant::now()),
        }
    }
}

impl ProgressSink for Progress {
    fn started(&self, samples: u64, _tokens: u64) {
        self.total.store(samples, Ordering::Relaxed);
        self.bar.set_length(samples);
    }

    fn sample_done(&self, tokens: u64) {
        let all_tokens = self.tokens.fetch_add(tokens, Ordering::Relaxed) + tokens;
        let samples = self.samples.fetch_add(1, Ordering::Relaxed) + 1;
        let rate = all_tokens as f64 / self.start.elapsed().as_secs_f64().max(1e-9);
        self.bar
            .set_message(format!("{all_tokens} tokens, {rate:.0} tokens/s"));
        self.bar.inc(1);
        if self.bar.is_hidden() {
            if let Ok(mut last) = self.last_log.lock() {
                if last.elapsed() >= Duration::from_secs(10) {
                    *last = Instant::now();
                    tracing::info!(
                        "captured {samples}/{} samples, {all_tokens} tokens, {rate:.0} tokens/s",
                        self.total.load(Ordering::Relaxed)
                    );
                }
            }
        }
    }
}
