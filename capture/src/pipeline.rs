//! The capture run: inputs and checkpoint checked first, then one thread per rank running
//! the forward, rank 0 handing captured states (copied to host off the compute stream)
//! through a bounded queue to a splitter and several store writers, which commit every
//! N samples or T seconds so a crash loses at most that window.
use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hslake_schemas::{CapturePoint, DType, DatasetSchema, Sample, TensorData, LAYER_CONVENTION};
use hslake_store::{Appended, Dataset, DatasetReader, DatasetWriter, Provenance, WriterOptions};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tch::{Device, Kind, Tensor};

use crate::batch::plan_batches;
use crate::comm::{Communicator, LocalComm, SingleRank};
use crate::config::ModelConfig;
use crate::cuda::{CopyStream, PendingCopy, PinnedBuffer};
use crate::error::{CaptureError, Result};
use crate::input::{read_inputs, InputLimits, InputSample, Overlong};
use crate::layers::NormKernel;
use crate::models;
use crate::nccl::{self, NcclComm};
use crate::weights::Weights;

/// Where the forward runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// CPU; tensor parallelism through the in-process back end.
    Cpu,
    /// CUDA GPUs `0..tp`; tensor parallelism through NCCL.
    Cuda,
}

impl std::str::FromStr for DeviceKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(DeviceKind::Cpu),
            "cuda" | "gpu" => Ok(DeviceKind::Cuda),
            _ => Err(format!("unknown device {s:?}; expected cpu or cuda")),
        }
    }
}

/// Everything a capture run needs.
#[derive(Debug, Clone)]
pub struct CaptureOptions {
    /// Hugging Face checkpoint directory (config.json + safetensors).
    pub model_dir: PathBuf,
    /// Tokenized samples (JSONL or Parquet).
    pub input: PathBuf,
    /// Dataset URL (file://, s3://, memory://).
    pub output: String,
    /// Capture points, in column order.
    pub points: Vec<CapturePoint>,
    /// Tensor-parallel size.
    pub tp: usize,
    /// CPU or CUDA.
    pub device: DeviceKind,
    /// Compute (and stored) dtype: bf16, f16 or f32.
    pub dtype: DType,
    /// How RMS norms are computed on CUDA.
    pub norm: NormKernel,
    /// Token budget of one padded batch (`batch * longest`).
    pub max_tokens_per_batch: usize,
    /// Longest sample kept whole.
    pub max_seq_len: Option<usize>,
    /// What to do with longer samples.
    pub overlong: Overlong,
    /// Continue a dataset that already holds samples, skipping those.
    pub resume: bool,
    /// Each writer commits after this many samples...
    pub commit_every: u64,
    /// ...or after this long, whichever comes first.
    pub commit_interval: Duration,
    /// Parallel store writers (compression runs on these threads).
    pub writers: usize,
    /// Captured batches that may wait for the writers before the forward blocks.
    pub queue_depth: usize,
    /// Shard layout and compression.
    pub writer_options: WriterOptions,
    /// Draw a progress bar (else log progress lines).
    pub progress: bool,
}

impl CaptureOptions {
    /// Defaults for everything but the four required inputs.
    pub fn new(
        model_dir: PathBuf,
        input: PathBuf,
        output: String,
        points: Vec<CapturePoint>,
    ) -> Self {
        CaptureOptions {
            model_dir,
            input,
            output,
            points,
            tp: 1,
            device: DeviceKind::Cpu,
            dtype: DType::Bf16,
            norm: NormKernel::Fast,
            max_tokens_per_batch: 16384,
            max_seq_len: None,
            overlong: Overlong::Truncate,
            resume: false,
            commit_every: 1000,
            commit_interval: Duration::from_secs(60),
            writers: 1,
            queue_depth: 4,
            writer_options: WriterOptions::default(),
            progress: true,
        }
    }
}

/// What a capture run did.
#[derive(Debug, Clone, Default)]
pub struct CaptureSummary {
    /// The dataset.
    pub dataset: String,
    /// Samples written by this run.
    pub samples: u64,
    /// Tokens written by this run.
    pub tokens: u64,
    /// Samples skipped because an earlier run had committed them (`--resume`).
    pub skipped_committed: u64,
    /// Samples cut to `--max-seq-len`.
    pub truncated: u64,
    /// Samples left out for exceeding `--max-seq-len`.
    pub skipped_overlong: u64,
    /// Samples left out for NaN/Inf (writer finite policy skip).
    pub skipped_nonfinite: u64,
    /// Forward batches run.
    pub batches: u64,
    /// Padding tokens computed and discarded.
    pub padding_tokens: u64,
    /// Uncompressed tensor bytes written.
    pub raw_bytes: u64,
    /// Shard bytes written.
    pub written_bytes: u64,
    /// Newest committed version after the run.
    pub version: u64,
    /// Seconds spent loading the model.
    pub load_secs: f64,
    /// Seconds rank 0 spent computing (forward and device-to-host copies).
    pub compute_secs: f64,
    /// Seconds rank 0 was blocked because the writers' queue was full.
    pub storage_wait_secs: f64,
    /// Seconds from the first batch to the last commit.
    pub run_secs: f64,
}

impl CaptureSummary {
    /// Raw tensor bytes per stored byte.
    pub fn compression_ratio(&self) -> f64 {
        if self.written_bytes == 0 {
            return 0.0;
        }
        self.raw_bytes as f64 / self.written_bytes as f64
    }
}

impl std::fmt::Display for CaptureSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tps = if self.run_secs > 0.0 {
            self.tokens as f64 / self.run_secs
        } else {
            0.0
        };
        let busy = self.compute_secs + self.storage_wait_secs;
        let wait_pct = if busy > 0.0 {
            100.0 * self.storage_wait_secs / busy
        } else {
            0.0
        };
        writeln!(
            f,
            "capture summary for {} (now at version {})",
            self.dataset, self.version
        )?;
        writeln!(
            f,
            "  samples written   {} ({} tokens, {:.0} tokens/s over {:.1}s)",
            self.samples, self.tokens, tps, self.run_secs
        )?;
        writeln!(
            f,
            "  skipped           {} already committed, {} longer than --max-seq-len, {} non-finite; {} truncated",
            self.skipped_committed, self.skipped_overlong, self.skipped_nonfinite, self.truncated
        )?;
        writeln!(
            f,
            "  bytes             {} raw -> {} stored (compression {:.2}x)",
            self.raw_bytes,
            self.written_bytes,
            self.compression_ratio()
        )?;
        writeln!(
            f,
            "  batches           {} ({} padding tokens)",
            self.batches, self.padding_tokens
        )?;
        write!(
            f,
            "  time              load {:.1}s, compute {:.1}s, waiting on storage {:.1}s ({:.1}% of the forward loop)",
            self.load_secs, self.compute_secs, self.storage_wait_secs, wait_pct
        )
    }
}

/// The padded ids of one batch and the samples it carries.
struct BatchInput {
    ids: Vec<i64>,
    rows: i64,
    cols: i64,
    samples: Vec<InputSample>,
}

/// Rank 0's captured states for one batch, in host memory: one `[b, t, hidden]` per point.
struct HostBatch {
    input: Arc<BatchInput>,
    states: Vec<Tensor>,
    /// The pinned buffers `states` live in (GPU runs), handed back to rank 0 once split.
    buffers: Option<Vec<PinnedBuffer>>,
}

/// Pinned host buffers rank 0 copies into, recycled by the splitter. A full set in use means
/// the writers are behind: waiting for one is waiting on storage.
struct BufferPool {
    free: Vec<Vec<PinnedBuffer>>,
    returned: Receiver<Vec<PinnedBuffer>>,
    made: usize,
    max_sets: usize,
    bytes_each: usize,
    per_set: usize,
}

impl BufferPool {
    fn take(&mut self, times: &mut RankTimes) -> Result<Vec<PinnedBuffer>> {
        while let Ok(set) = self.returned.try_recv() {
            self.free.push(set);
        }
        if let Some(set) = self.free.pop() {
            return Ok(set);
        }
        if self.made < self.max_sets {
            self.made += 1;
            return (0..self.per_set)
                .map(|_| PinnedBuffer::new(self.bytes_each))
                .collect();
        }
        let t = Instant::now();
        let set = self.returned.recv().map_err(|_| stopped("the splitter"))?;
        times.storage_wait += t.elapsed();
        Ok(set)
    }
}

enum CommInit {
    Single,
    Local(LocalComm),
    Nccl(nccl::UniqueId, usize, usize),
}

#[derive(Default)]
struct RankTimes {
    load: Duration,
    compute: Duration,
    storage_wait: Duration,
}

struct RankJob {
    cfg: ModelConfig,
    weights: Arc<Weights>,
    device: Device,
    kind: Kind,
    norm: NormKernel,
    points: Vec<CapturePoint>,
    batches: Receiver<Arc<BatchInput>>,
    out: Option<SyncSender<HostBatch>>,
    /// Recycled pinned buffers (rank 0 on CUDA).
    pool: Option<BufferPool>,
}

fn kind_of(dtype: DType) -> Result<Kind> {
    match dtype {
        DType::Bf16 => Ok(Kind::BFloat16),
        DType::F16 => Ok(Kind::Half),
        DType::F32 => Ok(Kind::Float),
        other => Err(CaptureError::Option(format!(
            "compute dtype {} is not supported; use bf16, f16 or f32",
            other.name()
        ))),
    }
}

fn stopped(what: &str) -> CaptureError {
    CaptureError::Pipeline(format!("{what} stopped early"))
}

fn run_rank(init: CommInit, job: RankJob) -> Result<RankTimes> {
    let _no_grad = tch::no_grad_guard();
    let comm: Rc<dyn Communicator> = match init {
        CommInit::Single => Rc::new(SingleRank),
        CommInit::Local(c) => Rc::new(c),
        CommInit::Nccl(id, rank, world) => Rc::new(NcclComm::init(id, rank, world)?),
    };
    let result = rank_loop(comm.clone(), job);
    if result.is_err() {
        comm.abort();
    }
    result
}

fn rank_loop(comm: Rc<dyn Communicator>, job: RankJob) -> Result<RankTimes> {
    let mut times = RankTimes::default();
    let t = Instant::now();
    let model = models::load(
        &job.cfg,
        &job.weights,
        comm.clone(),
        job.device,
        job.kind,
        job.norm,
    )?;
    let copier = match (job.device, &job.out) {
        (Device::Cuda(d), Some(_)) => Some(CopyStream::new(d)?),
        _ => None,
    };
    if let Device::Cuda(d) = job.device {
        tch::Cuda::synchronize(d as i64);
    }
    times.load = t.elapsed();
    let mut pool = job.pool;
    type InFlight = (PendingCopy, Arc<BatchInput>, Option<Vec<PinnedBuffer>>);
    let mut pending: Option<InFlight> = None;
    let hand_off = |pending: InFlight, times: &mut RankTimes| -> Result<()> {
        let (copy, input, buffers) = pending;
        let t = Instant::now();
        let states = copy.wait()?;
        times.compute += t.elapsed();
        let t = Instant::now();
        if let Some(out) = &job.out {
            out.send(HostBatch {
                input,
                states,
                buffers,
            })
            .map_err(|_| stopped("the writer pipeline"))?;
        }
        times.storage_wait += t.elapsed();
        Ok(())
    };
    while let Ok(batch) = job.batches.recv() {
        let t = Instant::now();
        let ids = Tensor::f_from_slice(&batch.ids)?
            .f_view([batch.rows, batch.cols])?
            .f_to_device(job.device)?;
        let states = model.forward(&ids, &job.points)?;
        if job.out.is_none() {
            // Only rank 0 keeps results: every rank holds the complete residual stream.
            continue;
        }
        let (copy, buffers) = match (&copier, pool.as_mut()) {
            (Some(c), Some(p)) => {
                let set = p.take(&mut times)?;
                (c.start(states, &set)?, Some(set))
            }
            _ => (PendingCopy::ready(states), None),
        };
        times.compute += t.elapsed();
        // Wait for the previous batch's copy only now, so it overlapped with this forward.
        if let Some(prev) = pending.replace((copy, batch, buffers)) {
            hand_off(prev, &mut times)?;
        }
    }
    if let Some(prev) = pending.take() {
        hand_off(prev, &mut times)?;
    }
    Ok(times)
}

/// The pinned buffers of one batch, handed back to rank 0 when the last of its samples has
/// been copied out by a writer.
struct BatchLease {
    remaining: AtomicU64,
    buffers: std::sync::Mutex<Option<Vec<PinnedBuffer>>>,
    recycle: std::sync::mpsc::Sender<Vec<PinnedBuffer>>,
}

impl BatchLease {
    fn release(&self) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            if let Some(b) = self.buffers.lock().ok().and_then(|mut g| g.take()) {
                // Rank 0 may already be gone; then the buffers are simply freed.
                let _ = self.recycle.send(b);
            }
        }
    }
}

/// One sample on its way to a writer: views of its real tokens in the batch's host tensors.
/// The writer copies them out, so that copy runs on all writer threads in parallel.
struct SampleRows {
    input: InputSample,
    rows: Vec<Tensor>,
    lease: Option<Arc<BatchLease>>,
}

impl SampleRows {
    fn into_sample(self, dtype: DType, hidden: usize) -> Result<Sample> {
        let len = self.input.input_ids.len();
        let tensors = self
            .rows
            .iter()
            .map(|rows| -> Result<TensorData> {
                let n = rows.numel();
                let mut data = vec![0u8; n * dtype.size()];
                rows.f_copy_data_u8(&mut data, n)?;
                Ok(TensorData {
                    dtype,
                    shape: vec![len, hidden],
                    data,
                    scales: None,
                })
            })
            .collect::<Result<Vec<_>>>();
        drop(self.rows);
        if let Some(lease) = &self.lease {
            lease.release();
        }
        let InputSample {
            sample_id,
            input_ids,
            loss_mask,
        } = self.input;
        Ok(Sample {
            sample_id,
            input_ids,
            loss_mask,
            tensors: tensors?,
        })
    }
}

fn split_batches(
    rx: Receiver<HostBatch>,
    writers: Vec<SyncSender<SampleRows>>,
    recycle: std::sync::mpsc::Sender<Vec<PinnedBuffer>>,
) -> Result<()> {
    let mut load = vec![0u64; writers.len()];
    for hb in rx {
        let HostBatch {
            input,
            states,
            buffers,
        } = hb;
        let lease = buffers.map(|b| {
            Arc::new(BatchLease {
                remaining: AtomicU64::new(input.samples.len() as u64),
                buffers: std::sync::Mutex::new(Some(b)),
                recycle: recycle.clone(),
            })
        });
        for (i, s) in input.samples.iter().enumerate() {
            let len = s.input_ids.len();
            // [b, t, hidden] -> this sample's real tokens [len, hidden] (contiguous rows).
            let rows = states
                .iter()
                .map(|st| Ok(st.f_select(0, i as i64)?.f_narrow(0, 0, len as i64)?))
                .collect::<Result<Vec<_>>>()?;
            // The least-loaded writer (by tokens) gets it, so compression spreads evenly.
            let w = (0..writers.len()).min_by_key(|&w| load[w]).unwrap_or(0);
            load[w] += len as u64;
            let item = SampleRows {
                input: s.clone(),
                rows,
                lease: lease.clone(),
            };
            writers[w]
                .send(item)
                .map_err(|_| stopped("a store writer"))?;
        }
    }
    Ok(())
}

struct WriterDone {
    samples: u64,
    tokens: u64,
    raw_bytes: u64,
    written_bytes: u64,
    skipped: u64,
    last_version: Option<u64>,
}

struct Progress {
    bar: ProgressBar,
    tokens: AtomicU64,
    samples: AtomicU64,
    start: Instant,
    last_log: std::sync::Mutex<Instant>,
    total: u64,
}

impl Progress {
    fn new(total: u64, draw: bool) -> Self {
        let bar = ProgressBar::with_draw_target(
            Some(total),
            if draw {
                ProgressDrawTarget::stderr()
            } else {
                ProgressDrawTarget::hidden()
            },
        );
        if let Ok(style) = ProgressStyle::with_template(
            "{bar:30} {pos}/{len} samples | {msg} | {elapsed_precise} elapsed, ETA {eta}",
        ) {
            bar.set_style(style);
        }
        Progress {
            bar,
            tokens: AtomicU64::new(0),
            samples: AtomicU64::new(0),
            start: Instant::now(),
            last_log: std::sync::Mutex::new(Instant::now()),
            total,
        }
    }

    fn add(&self, tokens: u64) {
        let all_tokens = self.tokens.fetch_add(tokens, Ordering::Relaxed) + tokens;
        let samples = self.samples.fetch_add(1, Ordering::Relaxed) + 1;
        let rate = all_tokens as f64 / self.start.elapsed().as_secs_f64().max(1e-9);
        self.bar
            .set_message(format!("{all_tokens} tokens, {rate:.0} tokens/s"));
        self.bar.inc(1);
        if self.bar.is_hidden() {
            // Without a terminal, a line every 10 s keeps progress visible in logs.
            if let Ok(mut last) = self.last_log.lock() {
                if last.elapsed() >= Duration::from_secs(10) {
                    *last = Instant::now();
                    tracing::info!(
                        "captured {samples}/{} samples, {all_tokens} tokens, {rate:.0} tokens/s",
                        self.total
                    );
                }
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn run_writer(
    handle: tokio::runtime::Handle,
    ds: Dataset,
    opts: WriterOptions,
    rx: Receiver<SampleRows>,
    commit_every: u64,
    commit_interval: Duration,
    progress: Arc<Progress>,
    dtype: DType,
    hidden: usize,
) -> Result<WriterDone> {
    let mut w = handle.block_on(DatasetWriter::new(&ds, opts))?;
    let mut last_version = None;
    let mut since_commit = 0u64;
    let mut last_commit = Instant::now();
    loop {
        let wait = commit_interval
            .saturating_sub(last_commit.elapsed())
            .max(Duration::from_millis(1));
        match rx.recv_timeout(wait) {
            Ok(rows) => {
                let sample = rows.into_sample(dtype, hidden)?;
                let tokens = sample.input_ids.len() as u64;
                let enc = w.encode(&sample)?;
                if handle.block_on(w.append_encoded(enc))? == Appended::Written {
                    since_commit += 1;
                }
                progress.add(tokens);
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
        if since_commit > 0
            && (since_commit >= commit_every || last_commit.elapsed() >= commit_interval)
        {
            last_version = handle.block_on(w.commit())?.or(last_version);
            since_commit = 0;
            last_commit = Instant::now();
        } else if since_commit == 0 && last_commit.elapsed() >= commit_interval {
            last_commit = Instant::now();
        }
    }
    last_version = handle.block_on(w.commit())?.or(last_version);
    let s = w.stats();
    Ok(WriterDone {
        samples: s.samples,
        tokens: s.tokens,
        raw_bytes: s.raw_bytes,
        written_bytes: s.written_bytes,
        skipped: s.skipped,
        last_version,
    })
}

/// The model's name for the manifest: the checkpoint directory's name.
fn model_name(dir: &std::path::Path) -> String {
    std::fs::canonicalize(dir)
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| dir.display().to_string())
}

/// Runs a whole capture. Nothing is created or computed before the checkpoint, the options
/// and every input record have been checked.
pub async fn capture(opts: CaptureOptions) -> Result<CaptureSummary> {
    let kind = kind_of(opts.dtype)?;
    if opts.tp == 0 || opts.max_tokens_per_batch == 0 || opts.writers == 0 || opts.queue_depth == 0
    {
        return Err(CaptureError::Option(
            "--tp, --max-tokens-per-batch, writers and queue depth must be > 0".into(),
        ));
    }
    if opts.max_seq_len == Some(0) {
        return Err(CaptureError::Option("--max-seq-len must be > 0".into()));
    }
    if opts.points.is_empty() {
        return Err(CaptureError::Option(
            "nothing to capture: give --layers and/or --final-norm".into(),
        ));
    }
    // 1. Checkpoint: config, TP split, every tensor's name and shape.
    let cfg = ModelConfig::load(&opts.model_dir)?;
    cfg.check_tp(opts.tp)?;
    let weights = Arc::new(Weights::open(&opts.model_dir)?);
    models::check_checkpoint(&cfg, &weights)?;
    let schema = DatasetSchema::new(
        model_name(&opts.model_dir),
        cfg.architecture.hf_name(),
        cfg.hidden_size,
        cfg.num_layers,
        cfg.vocab_size,
        opts.dtype,
        opts.points.clone(),
    )?;
    if opts.device == DeviceKind::Cuda {
        let have = tch::Cuda::device_count() as usize;
        if !tch::Cuda::is_available() || have < opts.tp {
            return Err(CaptureError::Option(format!(
                "--device cuda --tp {} needs {} GPUs; {have} visible",
                opts.tp, opts.tp
            )));
        }
    }
    // 2. Inputs, every record checked.
    let limits = InputLimits {
        vocab_size: cfg.vocab_size,
        max_seq_len: opts.max_seq_len,
        overlong: opts.overlong,
    };
    let path = opts.input.clone();
    let inputs = tokio::task::spawn_blocking(move || read_inputs(&path, limits))
        .await
        .map_err(|e| CaptureError::Pipeline(format!("input reader: {e}")))??;
    // 3. The dataset, and what an earlier run already committed.
    let mut extra = BTreeMap::new();
    extra.insert(
        "model_dir".to_string(),
        serde_json::json!(opts.model_dir.display().to_string()),
    );
    extra.insert(
        "input".to_string(),
        serde_json::json!(opts.input.display().to_string()),
    );
    extra.insert(
        "sample_id".to_string(),
        serde_json::json!(if inputs.ids_from_input {
            "the input's integer id"
        } else {
            "0-based record index of the input"
        }),
    );
    let provenance = Provenance {
        model: schema.model.clone(),
        architecture: cfg.architecture.hf_name().to_string(),
        dtype: opts.dtype.name().to_string(),
        tp_size: Some(opts.tp),
        layers: opts.points.clone(),
        layer_convention: LAYER_CONVENTION.to_string(),
        software: format!(
            "hslake-capture {} (tch 0.24, libtorch 2.11)",
            env!("CARGO_PKG_VERSION")
        ),
        extra,
    };
    let ds = Dataset::open_or_create(&opts.output, schema, provenance).await?;
    let committed: HashSet<u64> = {
        let reader = DatasetReader::open(&ds, None).await?;
        if reader.manifest().num_samples() == 0 {
            HashSet::new()
        } else if !opts.resume {
            return Err(CaptureError::Option(format!(
                "{} already holds {} samples; pass --resume to continue it (committed samples are skipped)",
                opts.output,
                reader.manifest().num_samples()
            )));
        } else {
            reader.sample_ids().await?.into_iter().collect()
        }
    };
    let todo: Vec<InputSample> = inputs
        .samples
        .into_iter()
        .filter(|s| !committed.contains(&s.sample_id))
        .collect();
    let skipped_committed = committed.len() as u64;
    if skipped_committed > 0 {
        tracing::info!(
            "resuming: {skipped_committed} samples already committed, {} to go",
            todo.len()
        );
    }
    let batches = plan_batches(&todo, opts.max_tokens_per_batch);
    tracing::info!(
        "capturing {} samples in {} batches: {} {} on {:?} x{} ({})",
        todo.len(),
        batches.len(),
        cfg.architecture.hf_name(),
        opts.dtype.name(),
        opts.device,
        opts.tp,
        opts.points
            .iter()
            .map(|p| p.column())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let handle = tokio::runtime::Handle::current();
    let summary_base = CaptureSummary {
        dataset: opts.output.clone(),
        skipped_committed,
        truncated: inputs.truncated,
        skipped_overlong: inputs.skipped_overlong,
        ..Default::default()
    };
    let ds2 = ds.clone();
    let mut summary = tokio::task::spawn_blocking(move || {
        run_threads(
            handle,
            ds2,
            opts,
            cfg,
            weights,
            kind,
            todo,
            batches,
            summary_base,
        )
    })
    .await
    .map_err(|e| CaptureError::Pipeline(format!("capture threads: {e}")))??;
    summary.version = ds.latest_version().await?;
    Ok(summary)
}

fn join<T>(
    r: std::thread::Result<Result<T>>,
    what: &str,
    errors: &mut Vec<CaptureError>,
) -> Option<T> {
    match r {
        Ok(Ok(v)) => Some(v),
        Ok(Err(e)) => {
            errors.push(e);
            None
        }
        Err(_) => {
            errors.push(CaptureError::Pipeline(format!("{what} thread panicked")));
            None
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn run_threads(
    handle: tokio::runtime::Handle,
    ds: Dataset,
    opts: CaptureOptions,
    cfg: ModelConfig,
    weights: Arc<Weights>,
    kind: Kind,
    todo: Vec<InputSample>,
    batches: Vec<Vec<usize>>,
    mut summary: CaptureSummary,
) -> Result<CaptureSummary> {
    let progress = Arc::new(Progress::new(todo.len() as u64, opts.progress));
    let hidden = cfg.hidden_size;
    // Writers, then the splitter feeding them, then the ranks feeding the splitter.
    let mut writer_txs = vec![];
    let mut writer_handles = vec![];
    let dtype = opts.dtype;
    for i in 0..opts.writers {
        // Two samples per writer: the bounded batch queue ahead of the splitter is the buffer
        // that absorbs bursts; anything larger here only hides a writer that cannot keep up.
        let (tx, rx) = sync_channel::<SampleRows>(2);
        writer_txs.push(tx);
        let (handle, ds, progress) = (handle.clone(), ds.clone(), progress.clone());
        let (wo, every, interval) = (opts.writer_options, opts.commit_every, opts.commit_interval);
        writer_handles.push(
            std::thread::Builder::new()
                .name(format!("hslake-writer-{i}"))
                .spawn(move || {
                    run_writer(handle, ds, wo, rx, every, interval, progress, dtype, hidden)
                })
                .map_err(|e| {
                    CaptureError::Pipeline(format!("cannot start a writer thread: {e}"))
                })?,
        );
    }
    let (host_tx, host_rx) = sync_channel::<HostBatch>(opts.queue_depth);
    let (recycle_tx, recycle_rx) = std::sync::mpsc::channel::<Vec<PinnedBuffer>>();
    let splitter = std::thread::Builder::new()
        .name("hslake-splitter".into())
        .spawn(move || split_batches(host_rx, writer_txs, recycle_tx))
        .map_err(|e| CaptureError::Pipeline(format!("cannot start the splitter thread: {e}")))?;

    let inits: Vec<CommInit> = match (opts.device, opts.tp) {
        (_, 1) => vec![CommInit::Single],
        (DeviceKind::Cpu, n) => LocalComm::group(n)
            .into_iter()
            .map(CommInit::Local)
            .collect(),
        (DeviceKind::Cuda, n) => {
            let id = nccl::unique_id()?;
            (0..n).map(|r| CommInit::Nccl(id, r, n)).collect()
        }
    };
    let mut rank_txs = vec![];
    let mut rank_handles = vec![];
    let mut host_tx = Some(host_tx);
    // Rank 0's pinned buffers: one set per batch that can be queued, in flight or being split.
    let largest_batch = batches
        .iter()
        .map(|b| {
            b.len()
                * b.iter()
                    .map(|&i| todo[i].input_ids.len())
                    .max()
                    .unwrap_or(0)
        })
        .max()
        .unwrap_or(0);
    let mut pool = match opts.device {
        DeviceKind::Cuda => Some(BufferPool {
            free: vec![],
            returned: recycle_rx,
            made: 0,
            max_sets: opts.queue_depth + 3,
            bytes_each: largest_batch * hidden * opts.dtype.size(),
            per_set: opts.points.len(),
        }),
        DeviceKind::Cpu => None,
    };
    for (rank, init) in inits.into_iter().enumerate() {
        let (tx, rx) = sync_channel::<Arc<BatchInput>>(2);
        rank_txs.push(tx);
        let job = RankJob {
            cfg: cfg.clone(),
            weights: weights.clone(),
            device: match opts.device {
                DeviceKind::Cpu => Device::Cpu,
                DeviceKind::Cuda => Device::Cuda(rank),
            },
            kind,
            norm: opts.norm,
            points: opts.points.clone(),
            batches: rx,
            out: if rank == 0 { host_tx.take() } else { None },
            pool: if rank == 0 { pool.take() } else { None },
        };
        rank_handles.push(
            std::thread::Builder::new()
                .name(format!("hslake-rank-{rank}"))
                .spawn(move || run_rank(init, job))
                .map_err(|e| {
                    CaptureError::Pipeline(format!("cannot start rank thread {rank}: {e}"))
                })?,
        );
    }
    drop(weights);

    let start = Instant::now();
    'feed: for idx in &batches {
        let samples: Vec<InputSample> = idx.iter().map(|&i| todo[i].clone()).collect();
        let cols = samples.iter().map(|s| s.input_ids.len()).max().unwrap_or(0);
        let mut ids = vec![0i64; samples.len() * cols];
        for (r, s) in samples.iter().enumerate() {
            for (c, &t) in s.input_ids.iter().enumerate() {
                ids[r * cols + c] = t as i64;
            }
        }
        let real: usize = samples.iter().map(|s| s.input_ids.len()).sum();
        summary.padding_tokens += (samples.len() * cols - real) as u64;
        summary.batches += 1;
        let input = Arc::new(BatchInput {
            ids,
            rows: samples.len() as i64,
            cols: cols as i64,
            samples,
        });
        for tx in &rank_txs {
            if tx.send(input.clone()).is_err() {
                break 'feed;
            }
        }
    }
    drop(rank_txs);

    // Collect every thread's outcome; report the root cause, not the "stopped early" echoes.
    let mut errors: Vec<CaptureError> = vec![];
    let mut rank0 = None;
    for (rank, h) in rank_handles.into_iter().enumerate() {
        let t = join(h.join(), "rank", &mut errors);
        if rank == 0 {
            rank0 = t;
        }
    }
    join(splitter.join(), "splitter", &mut errors);
    for h in writer_handles {
        if let Some(w) = join(h.join(), "writer", &mut errors) {
            summary.samples += w.samples;
            summary.tokens += w.tokens;
            summary.raw_bytes += w.raw_bytes;
            summary.written_bytes += w.written_bytes;
            summary.skipped_nonfinite += w.skipped;
            summary.version = summary.version.max(w.last_version.unwrap_or(0));
        }
    }
    progress.bar.finish_and_clear();
    if !errors.is_empty() {
        let root = errors
            .iter()
            .position(|e| !matches!(e, CaptureError::Pipeline(_)))
            .unwrap_or(0);
        return Err(errors.swap_remove(root));
    }
    let t = rank0.unwrap_or_default();
    summary.load_secs = t.load.as_secs_f64();
    summary.compute_secs = t.compute.as_secs_f64();
    summary.storage_wait_secs = t.storage_wait.as_secs_f64();
    summary.run_secs = start.elapsed().saturating_sub(t.load).as_secs_f64();
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hslake_store::DatasetReader;
    use safetensors::tensor::TensorView;
    use std::io::Write;

    const CONFIG: &str = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 50,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0}"#;

    /// A random checkpoint with exactly the tensors the architecture reads.
    fn tiny_model(dir: &std::path::Path) {
        std::fs::write(dir.join("config.json"), CONFIG).unwrap();
        let cfg = ModelConfig::load(dir).unwrap();
        let mut seed = 12345u64;
        let shapes = models::tensor_shapes(&cfg);
        let bytes: Vec<Vec<u8>> = shapes
            .iter()
            .map(|(_, s)| {
                (0..s.iter().product::<usize>())
                    .flat_map(|_| {
                        seed = seed
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5).to_le_bytes()
                    })
                    .collect()
            })
            .collect();
        let views: Vec<(String, TensorView)> = shapes
            .iter()
            .zip(&bytes)
            .map(|((n, s), b)| {
                (
                    n.clone(),
                    TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    }

    fn inputs(path: &std::path::Path, n: usize) {
        let mut f = std::fs::File::create(path).unwrap();
        for i in 0..n {
            let ids: Vec<usize> = (0..(3 + i * 7 % 11)).map(|t| (t * 13 + i) % 50).collect();
            writeln!(f, "{}", serde_json::json!({ "input_ids": ids })).unwrap();
        }
    }

    fn options(dir: &std::path::Path, input: &str, out: &str) -> CaptureOptions {
        let url = format!("file://{}", dir.join(out).display());
        let points = vec![CapturePoint::LayerOutput(0), CapturePoint::FinalNorm];
        let mut o = CaptureOptions::new(dir.join("m"), dir.join(input), url, points);
        o.dtype = DType::F32;
        o.progress = false;
        o.max_tokens_per_batch = 40;
        o
    }

    async fn values(url: &str) -> BTreeMap<u64, Vec<f32>> {
        let ds = Dataset::open(url).await.unwrap();
        let r = DatasetReader::open(&ds, None).await.unwrap();
        let mut out = BTreeMap::new();
        for id in r.sample_ids().await.unwrap() {
            let s = r.get_sample(id).await.unwrap();
            out.insert(id, s.tensors.iter().flat_map(|t| t.to_f32_vec()).collect());
        }
        out
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tp_two_equals_tp_one_and_resume_writes_only_what_is_missing() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("m")).unwrap();
        tiny_model(&d.path().join("m"));
        inputs(&d.path().join("all.jsonl"), 10);
        inputs(&d.path().join("first6.jsonl"), 6);

        let one = capture(options(d.path(), "all.jsonl", "tp1"))
            .await
            .unwrap();
        assert_eq!((one.samples, one.skipped_committed), (10, 0));
        let mut o = options(d.path(), "all.jsonl", "tp2");
        o.tp = 2;
        capture(o).await.unwrap();
        let a = values(&options(d.path(), "", "tp1").output).await;
        close(&a, &values(&options(d.path(), "", "tp2").output).await);

        capture(options(d.path(), "first6.jsonl", "resumed"))
            .await
            .unwrap();
        let refused = capture(options(d.path(), "all.jsonl", "resumed"))
            .await
            .unwrap_err()
            .to_string();
        assert!(refused.contains("pass --resume"), "{refused}");
        let mut o = options(d.path(), "all.jsonl", "resumed");
        o.resume = true;
        let rest = capture(o).await.unwrap();
        assert_eq!((rest.samples, rest.skipped_committed), (4, 6));
        close(&a, &values(&options(d.path(), "", "resumed").output).await);
    }

    fn close(a: &BTreeMap<u64, Vec<f32>>, b: &BTreeMap<u64, Vec<f32>>) {
        assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
        for (id, va) in a {
            assert_eq!(va.len(), b[id].len());
            let worst = va
                .iter()
                .zip(&b[id])
                .map(|(x, y)| (x - y).abs())
                .fold(0.0f32, f32::max);
            assert!(worst <= 1e-5, "sample {id}: differs by {worst}");
        }
    }
}
