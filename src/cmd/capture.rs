//! `hslake capture`: run a checkpoint over tokenized samples and write hidden states.
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use hslake_capture::layers::NormKernel;
use hslake_capture::{capture, CaptureOptions, DeviceKind, Overlong};
use hslake_schemas::{CapturePoint, DType};
use hslake_store::WriterOptions;

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
    /// Token budget of one padded batch (batch size x longest sample).
    #[arg(long, default_value_t = 16384)]
    pub max_tokens_per_batch: usize,
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

/// Runs the capture and prints its summary.
pub async fn run(a: Args) -> anyhow::Result<ExitCode> {
    let mut points = a.layers.clone();
    if a.final_norm {
        points.push(CapturePoint::FinalNorm);
    }
    if points.is_empty() {
        bail!("nothing to capture: give --layers (e.g. --layers 2,30,58,60) and/or --final-norm");
    }
    if !a.commit_interval.is_finite() || a.commit_interval <= 0.0 {
        bail!(
            "--commit-interval must be a positive number of seconds, got {}",
            a.commit_interval
        );
    }
    let mut opts = CaptureOptions::new(a.model.clone(), a.input.clone(), a.output.clone(), points);
    opts.tp = a.tp;
    opts.device = a.device;
    opts.dtype = a.dtype;
    opts.norm = a.norm;
    opts.max_tokens_per_batch = a.max_tokens_per_batch;
    opts.max_seq_len = a.max_seq_len;
    opts.overlong = a.overlong;
    opts.resume = a.resume;
    opts.commit_every = a.commit_every;
    opts.commit_interval = Duration::from_secs_f64(a.commit_interval);
    // On GPUs compression must keep up with the forward: every core but the ones running the
    // ranks and the splitter writes.
    let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
    opts.writers = a.writers.unwrap_or(match a.device {
        DeviceKind::Cpu => 1,
        DeviceKind::Cuda => cores.saturating_sub(a.tp + 1).max(1),
    });
    opts.queue_depth = a.queue_depth;
    opts.writer_options = WriterOptions {
        zstd_level: a.zstd_level,
        ..WriterOptions::default()
    };
    opts.progress = !a.no_progress && std::io::IsTerminal::is_terminal(&std::io::stderr());
    let summary = capture(opts)
        .await
        .with_context(|| format!("capture into {}", a.output))?;
    println!("{summary}");
    Ok(ExitCode::SUCCESS)
}
