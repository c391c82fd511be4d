//! `hslake capture`: run a checkpoint over tokenized samples and write hidden states, with a
//! progress bar (or a log line every 10 s without a terminal); Ctrl-C stops after the batches
//! in flight and commits what they captured.
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use hslake_capture::{
    capture_with, CancelToken, CaptureOptions, CommitPolicy, DeviceKind, NormKernel, Overlong,
    ProgressSink, TpReduce,
};
use hslake_schemas::{CapturePoint, DType};
use hslake_store::WriterOptions;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Capture hidden states of a Hugging Face checkpoint into a dataset.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Checkpoint directory: config.json plus model.safetensors or a sharded index.
    #[arg(long)]
    pub model: PathBuf,
    /// Tokenized samples: JSONL or Parquet with input_ids, optional loss_mask and id.
    #[arg(long)]
    pub input: PathBuf,
    /// Dataset URL (file:///abs/path, s3://bucket/prefix, memory://name).
    #[arg(long)]
    pub output: String,
    /// Decoder layer outputs to capture, 0-based (layer i = HF hidden_states[i + 1]).
    #[arg(long, value_delimiter = ',')]
    pub layers: Vec<CapturePoint>,
    /// Also capture the last layer's output after the final RMS norm.
    #[arg(long)]
    pub final_norm: bool,
    /// Tensor-parallel size (GPUs 0..N on cuda; threads on cpu).
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Where the forward runs: cpu or cuda.
    #[arg(long, default_value = "cpu")]
    pub device: DeviceKind,
    /// Compute and stored dtype: bf16, f16 or f32.
    #[arg(long, default_value = "bf16")]
    pub dtype: DType,
    /// RMS norm on cuda: fast (the mean square in one f32 pass, 40 % of the memory traffic;
    /// about one element in 10^5 one unit in the last place off transformers) or exact
    /// (transformers' own operations, bit-identical to it). CPU runs are always exact.
    #[arg(long, default_value = "fast")]
    pub norm: NormKernel,
    /// With --tp > 1, what the row-parallel layers sum across ranks: f32 (f32 partial products
    /// and sums, rounded to the dtype once, as at TP 1) or bf16 (partials rounded and summed in
    /// the compute dtype: half the all-reduce bytes, two more roundings per layer).
    #[arg(long, default_value = "f32")]
    pub tp_reduce: TpReduce,
    /// Token budget of one padded batch (batch size x longest sample).
    #[arg(long, default_value_t = 16384)]
    pub max_tokens_per_batch: usize,
    /// Memory per GPU, in GiB, that the pre-flight check assumes free instead of asking the
    /// driver (it then also checks a CPU run).
    #[arg(long)]
    pub gpu_memory_gib: Option<f64>,
    /// Longest sample kept whole; see --overlong for the rest.
    #[arg(long)]
    pub max_seq_len: Option<usize>,
    /// What to do with samples over --max-seq-len: truncate or skip.
    #[arg(long, default_value = "truncate")]
    pub overlong: Overlong,
    /// Continue an interrupted capture: samples already committed are skipped.
    #[arg(long)]
    pub resume: bool,
    /// Each writer commits after this many samples...
    #[arg(long, default_value_t = 1000)]
    pub commit_every: u64,
    /// ...or after this many seconds, whichever comes first.
    #[arg(long, default_value_t = 60.0)]
    pub commit_interval: f64,
    /// Parallel store writers (compression threads); default 1 on cpu, all spare cores on cuda.
    #[arg(long)]
    pub writers: Option<usize>,
    /// Captured batches that may queue for the writers before the forward waits.
    #[arg(long, default_value_t = 4)]
    pub queue_depth: usize,
    /// zstd level of the shards.
    #[arg(long, default_value_t = 1)]
    pub zstd_level: i32,
    /// Do not draw a progress bar (progress is then logged every 10 s).
    #[arg(long)]
    pub no_progress: bool,
}

impl Args {
    /// The library's options for these arguments.
    fn options(&self) -> anyhow::Result<CaptureOptions> {
        let mut points = self.layers.clone();
        if self.final_norm {
            points.push(CapturePoint::FinalNorm);
        }
        if points.is_empty() {
            bail!(
                "nothing to capture: give --layers (e.g. --layers 2,30,58,60) and/or --final-norm"
            );
        }
        if !self.commit_interval.is_finite() || self.commit_interval <= 0.0 {
            bail!(
                "--commit-interval must be a positive number of seconds, got {}",
                self.commit_interval
            );
        }
        let mut o = CaptureOptions::new(
            self.model.clone(),
            self.input.clone(),
            self.output.clone(),
            points,
        );
        o.engine.tp = self.tp;
        o.engine.device = self.device;
        o.engine.dtype = self.dtype;
        o.engine.norm = self.norm;
        o.engine.tp_reduce = self.tp_reduce;
        o.engine.gpu_memory_gib = self.gpu_memory_gib;
        let job = &mut o.job;
        job.max_tokens_per_batch = self.max_tokens_per_batch;
        job.max_seq_len = self.max_seq_len;
        job.overlong = self.overlong;
        job.resume = self.resume;
        job.commit = CommitPolicy {
            every: self.commit_every,
            interval: Duration::from_secs_f64(self.commit_interval),
        };
        // On GPUs compression must keep up with the forward: every core but the ones running
        // the ranks and the splitter writes.
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        job.writers = self.writers.unwrap_or(match self.device {
            DeviceKind::Cpu => 1,
            DeviceKind::Cuda => cores.saturating_sub(self.tp + 1).max(1),
        });
        job.queue_depth = self.queue_depth;
        job.writer_options = WriterOptions {
            zstd_level: self.zstd_level,
            ..WriterOptions::default()
        };
        Ok(o)
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
    let summary = result.with_context(|| format!("capture into {}", a.output))?;
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
