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
    capture_with, CancelToken, CaptureJob, CaptureOptions, CommitPolicy, DeviceKind, EngineOptions,
    InputShard, Kernels, Overlong, PlacementOptions, PlaneSplit, ProgressSink,
};
use hslake_schemas::units::DurationRange;
use hslake_schemas::{CapturePoint, DType};
use hslake_store::WriterOptions;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::{Deserialize, Serialize};

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

/// One capture job: the flags of `hslake capture` that say what to capture and where, and the
/// JSON body of `POST /v1/jobs` (the same names, in snake case) of `hslake serve-capture`.
#[derive(clap::Args, Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobArgs {
    /// Tokenized samples: JSONL or Parquet with input_ids, optional loss_mask and id; a local
    /// path or an object-store URL (s3://bucket/samples.jsonl).
    #[arg(long)]
    pub input: PathBuf,
    /// Dataset URL (file:///abs/path, s3://bucket/prefix, memory://name).
    #[arg(long)]
    pub output: String,
    /// Decoder layer outputs to capture, 0-based (layer i = HF hidden_states[i + 1]).
    #[arg(long, value_delimiter = ',')]
    #[serde(default)]
    pub layers: Vec<CapturePoint>,
    /// Also capture the last layer's output after the final RMS norm.
    #[arg(long)]
    #[serde(default)]
    pub final_norm: bool,
    /// Token budget of one padded batch (batch size x longest sample).
    #[arg(long, default_value_t = DEFAULT_MAX_TOKENS_PER_BATCH)]
    #[serde(default = "default_max_tokens_per_batch")]
    pub max_tokens_per_batch: usize,
    /// Longest sample kept whole; see --overlong for the rest.
    #[arg(long)]
    #[serde(default)]
    pub max_seq_len: Option<usize>,
    /// What to do with samples over --max-seq-len: truncate or skip.
    #[arg(long, default_value = "truncate")]
    #[serde(default, with = "overlong_name")]
    pub overlong: Overlong,
    /// Continue an interrupted capture: samples already committed are skipped.
    #[arg(long)]
    #[serde(default)]
    pub resume: bool,
    /// Each writer commits after this many samples...
    #[arg(long, default_value_t = DEFAULT_COMMIT_EVERY)]
    #[serde(default = "default_commit_every")]
    pub commit_every: u64,
    /// ...or after this long, whichever comes first, e.g. 30s or 5m (a bare number is seconds;
    /// in JSON a number of seconds or such a string).
    #[arg(long, default_value = "60s", value_parser = COMMIT_INTERVAL.parser())]
    #[serde(
        default = "default_commit_interval",
        deserialize_with = "commit_interval_json",
        serialize_with = "hslake_schemas::units::serialize_secs"
    )]
    pub commit_interval: Duration,
    /// zstd level of the shards, 1 to 22: at 1 the near-random mantissa planes are stored raw
    /// without trying to entropy code them (fastest); from 2 every plane is coded (smaller,
    /// more CPU).
    #[arg(long, default_value_t = DEFAULT_ZSTD_LEVEL, value_parser = parse_zstd_level)]
    #[serde(default = "default_zstd_level", deserialize_with = "zstd_level_json")]
    pub zstd_level: i32,
    /// Capture only part I of N of the input (the samples whose id is I modulo N), so that N
    /// processes, e.g. a Slurm array or a Kubernetes indexed Job, fill one dataset together.
    #[arg(long)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<InputShard>,
}

const DEFAULT_MAX_TOKENS_PER_BATCH: usize = 16384;
const DEFAULT_COMMIT_EVERY: u64 = 1000;
const DEFAULT_COMMIT_INTERVAL: Duration = Duration::from_secs(60);
const DEFAULT_ZSTD_LEVEL: i32 = 1;
/// `--commit-interval`: a millisecond up to a year.
const COMMIT_INTERVAL: DurationRange =
    DurationRange::seconds("--commit-interval", Duration::from_millis(1), super::YEAR);
/// `--zstd-level`: the levels Parquet's zstd codec takes.
const ZSTD_LEVELS: std::ops::RangeInclusive<i64> = 1..=22;

fn default_max_tokens_per_batch() -> usize {
    DEFAULT_MAX_TOKENS_PER_BATCH
}
fn default_commit_every() -> u64 {
    DEFAULT_COMMIT_EVERY
}
fn default_commit_interval() -> Duration {
    DEFAULT_COMMIT_INTERVAL
}
fn default_zstd_level() -> i32 {
    DEFAULT_ZSTD_LEVEL
}
fn commit_interval_json<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    COMMIT_INTERVAL.deserialize(d)
}

/// The one check of a zstd level, for the flag and the JSON field alike.
fn zstd_level(n: i64) -> Result<i32, String> {
    match i32::try_from(n) {
        Ok(level) if ZSTD_LEVELS.contains(&n) => Ok(level),
        _ => Err(format!(
            "--zstd-level {n}: out of range; expected a whole number from {} to {} \
             (the zstd levels Parquet takes)",
            ZSTD_LEVELS.start(),
            ZSTD_LEVELS.end()
        )),
    }
}
fn parse_zstd_level(s: &str) -> Result<i32, String> {
    let n = s.trim().parse::<i64>().map_err(|_| {
        format!(
            "--zstd-level {s:?}: not a whole number; expected one from {} to {}",
            ZSTD_LEVELS.start(),
            ZSTD_LEVELS.end()
        )
    })?;
    zstd_level(n)
}
fn zstd_level_json<'de, D: serde::Deserializer<'de>>(d: D) -> Result<i32, D::Error> {
    zstd_level(i64::deserialize(d)?).map_err(serde::de::Error::custom)
}

/// Refuses an output no dataset can live at: the root of a filesystem.
fn check_output(output: &str) -> anyhow::Result<()> {
    let loc =
        hslake_store::location::parse(output).with_context(|| format!("--output {output}"))?;
    // The root's URL comes back without its slash, so it is told by its empty object path.
    if loc.url.starts_with("file:") && loc.prefix.as_ref().is_empty() {
        bail!(
            "--output {output}: the filesystem root is not a dataset location; expected a \
             directory below it, e.g. file:///data/ds"
        );
    }
    Ok(())
}

/// The overlong policy in JSON as on the command line: "truncate" or "skip".
mod overlong_name {
    use hslake_capture::Overlong;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(o: &Overlong, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(match o {
            Overlong::Truncate => "truncate",
            Overlong::Skip => "skip",
        })
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Overlong, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

impl JobArgs {
    /// The library's job for these arguments.
    pub fn job(&self) -> anyhow::Result<CaptureJob> {
        let mut points = self.layers.clone();
        if self.final_norm {
            points.push(CapturePoint::FinalNorm);
        }
        if points.is_empty() {
            bail!(
                "nothing to capture: give --layers (e.g. --layers 2,30,58,60) and/or --final-norm"
            );
        }
        // A JobArgs built in code rather than parsed still gets the parsers' checks.
        COMMIT_INTERVAL.check(self.commit_interval)?;
        zstd_level(self.zstd_level.into()).map_err(anyhow::Error::msg)?;
        check_output(&self.output)?;
        let mut job = CaptureJob::new(self.input.clone(), self.output.clone(), points);
        job.max_tokens_per_batch = self.max_tokens_per_batch;
        job.max_seq_len = self.max_seq_len;
        job.overlong = self.overlong;
        job.resume = self.resume;
        job.shard = self.shard;
        job.commit = CommitPolicy {
            every: self.commit_every,
            interval: self.commit_interval,
        };
        job.writer_options = WriterOptions {
            zstd_level: self.zstd_level,
            ..WriterOptions::default()
        };
        Ok(job)
    }
}

impl Args {
    /// The library's options for these arguments.
    fn options(&self) -> anyhow::Result<CaptureOptions> {
        Ok(CaptureOptions {
            engine: self.engine.options(),
            job: self.job.job()?,
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
