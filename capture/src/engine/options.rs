//! What an engine is started with (the model, how it runs, and its pipeline: writers, queue,
//! plane split) and what one job asks of it (which samples, into which dataset, what to
//! capture, how to write), with their checks.
use std::path::PathBuf;

use hslake_schemas::{CapturePoint, DType};
use hslake_store::WriterOptions;
use tch::Kind;

use super::commit::CommitPolicy;
use super::placement::PlacementOptions;
use crate::error::{CaptureError, Result};
use crate::gpu::DeviceKind;
use crate::kernels::Kernels;
use hslake_schemas::{InputShard, Overlong};

/// Where captured states are split into the store's planes before compression.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PlaneSplit {
    /// On rank 0's GPU for bf16 CUDA runs (where the kernel loads), by the writers otherwise.
    #[default]
    Auto,
    /// By each store writer, from the values (the writers also compute the statistics).
    Writers,
    /// By rank 0 before the host copy: one kernel on a GPU; on the CPU the reference split
    /// the kernel is checked against. bf16 states of an even hidden size only.
    Rank0,
}

impl std::str::FromStr for PlaneSplit {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(PlaneSplit::Auto),
            "writers" => Ok(PlaneSplit::Writers),
            "rank0" => Ok(PlaneSplit::Rank0),
            _ => Err(format!(
                "unknown plane split {s:?}; expected auto, writers or rank0"
            )),
        }
    }
}

/// The model an engine loads and how it runs it; fixed for the engine's life.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineOptions {
    /// Hugging Face checkpoint directory (config.json + safetensors).
    pub model_dir: PathBuf,
    /// Tensor-parallel size.
    pub tp: usize,
    /// CPU or CUDA.
    pub device: DeviceKind,
    /// Compute (and stored) dtype: bf16, f16 or f32.
    pub dtype: DType,
    /// How the forward computes.
    pub kernels: Kernels,
    /// Where the weights live, the GPU memory to plan for, and how to stream.
    pub placement: PlacementOptions,
    /// Parallel store writers of every job (compression runs on these threads).
    pub writers: usize,
    /// Captured batches that may wait for the writers before the forward blocks.
    pub queue_depth: usize,
    /// Where states are split into planes.
    pub plane_split: PlaneSplit,
}

impl EngineOptions {
    /// Defaults (TP 1 on the CPU in bf16, the default [`Kernels`], one writer) for the model in
    /// `model_dir`.
    pub fn new(model_dir: PathBuf) -> Self {
        EngineOptions {
            model_dir,
            tp: 1,
            device: DeviceKind::Cpu,
            dtype: DType::Bf16,
            kernels: Kernels::default(),
            placement: PlacementOptions::default(),
            writers: 1,
            queue_depth: 4,
            plane_split: PlaneSplit::Auto,
        }
    }

    /// The libtorch dtype the model computes in; refuses sizes and dtypes it cannot run.
    pub(crate) fn compute_kind(&self) -> Result<Kind> {
        if self.tp == 0 {
            return Err(CaptureError::Option("--tp must be > 0".into()));
        }
        if self.writers == 0 || self.queue_depth == 0 {
            return Err(CaptureError::Option(
                "--writers and --queue-depth must be > 0".into(),
            ));
        }
        if let Some(bytes) = self.placement.gpu_memory {
            super::placement::GPU_MEMORY
                .check(bytes)
                .map_err(|e| CaptureError::Option(e.to_string()))?;
        }
        if self.placement.pass_tokens == Some(0) {
            return Err(CaptureError::Option("--pass-tokens must be > 0".into()));
        }
        match self.dtype {
            DType::Bf16 => Ok(Kind::BFloat16),
            DType::F16 => Ok(Kind::Half),
            DType::F32 => Ok(Kind::Float),
            other => Err(CaptureError::Option(format!(
                "compute dtype {} is not supported; use bf16, f16 or f32",
                other.name()
            ))),
        }
    }

    /// Whether rank 0 splits the states of a model `hidden` wide into planes
    /// ([`EngineOptions::plane_split`]'s choice for these options): a split asked for where
    /// it cannot run is refused with the reason, and one that `auto` passes over on CUDA is a
    /// warning. Decided once, before the load.
    pub(crate) fn split_on_rank0(&self, hidden: usize) -> Result<bool> {
        let dtype = self.dtype;
        let cuda = self.device == DeviceKind::Cuda;
        let cannot = if dtype != DType::Bf16 {
            Some(format!("the states are {dtype}, not bf16"))
        } else if !hidden.is_multiple_of(2) {
            Some(format!("the hidden size {hidden} is odd"))
        } else if cuda {
            crate::gpu::plane_split::kernel(0).err()
        } else {
            None
        };
        let on_rank = match (self.plane_split, cannot) {
            (PlaneSplit::Writers, _) => false,
            (PlaneSplit::Rank0, Some(why)) => {
                return Err(CaptureError::Option(format!(
                    "--plane-split rank0: rank 0 cannot split these states: {why}"
                )))
            }
            (PlaneSplit::Rank0, None) => true,
            (PlaneSplit::Auto, None) => cuda,
            (PlaneSplit::Auto, Some(why)) => {
                if cuda {
                    tracing::warn!("the writers split states into planes (slower): {why}");
                }
                false
            }
        };
        if on_rank {
            tracing::info!("rank 0 splits states into planes before the host copy");
        }
        Ok(on_rank)
    }
}

/// One capture job: which samples, into which dataset, what to capture and how to write it.
#[derive(Debug, Clone)]
pub struct CaptureJob {
    /// Tokenized samples (JSONL or Parquet): a local path or an object-store URL (s3://…).
    pub input: PathBuf,
    /// Dataset URL (file://, s3://, memory://).
    pub output: String,
    /// Capture points, in column order.
    pub points: Vec<CapturePoint>,
    /// Token budget of one padded batch (`batch * longest`).
    pub max_tokens_per_batch: usize,
    /// Longest sample kept whole.
    pub max_seq_len: Option<usize>,
    /// What to do with longer samples.
    pub overlong: Overlong,
    /// Continue a dataset that already holds samples, skipping those.
    pub resume: bool,
    /// When each writer commits.
    pub commit: CommitPolicy,
    /// Shard layout and compression.
    pub writer_options: WriterOptions,
    /// Only the samples of this part of the input (several processes, one dataset).
    pub shard: Option<InputShard>,
    /// An input of more bytes is refused before it is read (and a download stopped once it
    /// passes this): a server's bound on what one job may make it hold.
    pub max_input_bytes: Option<u64>,
}

impl CaptureJob {
    /// Defaults for everything but the three required inputs.
    pub fn new(input: PathBuf, output: String, points: Vec<CapturePoint>) -> Self {
        CaptureJob {
            input,
            output,
            points,
            max_tokens_per_batch: 16384,
            max_seq_len: None,
            overlong: Overlong::Truncate,
            resume: false,
            commit: CommitPolicy::default(),
            writer_options: WriterOptions::default(),
            shard: None,
            max_input_bytes: None,
        }
    }

    /// Refuses sizes that cannot work.
    pub(crate) fn check(&self) -> Result<()> {
        if self.max_tokens_per_batch == 0 {
            return Err(CaptureError::Option(
                "--max-tokens-per-batch must be > 0".into(),
            ));
        }
        if self.max_seq_len == Some(0) {
            return Err(CaptureError::Option("--max-seq-len must be > 0".into()));
        }
        if self.points.is_empty() {
            return Err(CaptureError::Option(
                "nothing to capture: give --layers and/or --final-norm".into(),
            ));
        }
        Ok(())
    }
}
