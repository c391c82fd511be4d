//! Everything about a model that can be checked before it loads: its config, the
//! tensor-parallel split, the devices, where states are split into planes, and every tensor
//! the model's own load reads (names, shapes, dtypes), from the checkpoint's headers alone.
use std::sync::Arc;

use tch::Kind;

use super::memory::MemoryNeed;
use super::options::EngineOptions;
use crate::checkpoint::Checkpoint;
use crate::error::{CaptureError, Result};
use crate::gpu::DeviceKind;
use crate::kernels::MoeKernel;
use crate::models::{registry, ModelConfig, ModelInfo};
use crate::tools::dry_run::ModelReads;

/// A checkpoint whose config, tensor-parallel split and every tensor (name, shape, dtype, as
/// the model's own load reads them) have been checked, reading no tensor data.
/// [`Engine::load`] loads it.
pub struct CheckedModel {
    pub(super) options: EngineOptions,
    pub(super) config: Arc<dyn ModelConfig>,
    pub(super) info: ModelInfo,
    pub(super) checkpoint: Arc<Checkpoint>,
    pub(super) kind: Kind,
    /// Rank 0 splits the states into planes before the host copy.
    pub(super) split: bool,
    /// What rank 0 reads, as the dry run listed it (for the memory pre-flight).
    reads: ModelReads,
}

impl CheckedModel {
    /// Reads the config, checks the TP size and the devices, decides the plane split, and runs
    /// the model's load against the checkpoint's headers; every tensor problem is reported at
    /// once.
    pub fn check(options: EngineOptions) -> Result<Self> {
        let kind = options.compute_kind()?;
        let (config, quant) = registry::read_model(&options.model_dir)?;
        let config: Arc<dyn ModelConfig> = config.into();
        config.check_tp(options.tp)?;
        let mut info = config.info();
        info.quantization = quant.describe();
        let checkpoint = Checkpoint::open(&options.model_dir)?.with_quantization(quant);
        let reads =
            crate::tools::dry_run::check_checkpoint(&*config, &checkpoint, options.tp, kind)?;
        if options.device == DeviceKind::Cuda {
            let have = tch::Cuda::device_count() as usize;
            if !tch::Cuda::is_available() || have < options.tp {
                return Err(CaptureError::Option(format!(
                    "--device cuda --tp {} needs {} GPUs; {have} visible",
                    options.tp, options.tp
                )));
            }
        }
        let split = options.split_on_rank0(info.hidden_size)?;
        Ok(CheckedModel {
            info,
            options,
            config,
            checkpoint: Arc::new(checkpoint),
            kind,
            split,
            reads,
        })
    }

    /// The memory pre-flight for batches of `max_tokens_per_batch` tokens capturing
    /// `captured` points: refuses, before anything loads, a model whose per-rank weights and
    /// activations exceed the free memory of the GPUs it would use (or `gpu_memory_gib`, if
    /// set, on any device); logs the estimate either way. Without an override a CPU run is
    /// not checked.
    pub fn check_memory(&self, max_tokens_per_batch: usize, captured: usize) -> Result<()> {
        let need = MemoryNeed::estimate(
            &self.reads.all().cloned().collect::<Vec<_>>(),
            max_tokens_per_batch,
            captured,
            self.info.hidden_size,
            self.kind,
            self.options.kernels.moe == MoeKernel::Grouped,
        );
        let free = match (self.options.gpu_memory_gib, self.options.device) {
            (Some(gib), _) => Some((gib * (1u64 << 30) as f64) as u64),
            (None, DeviceKind::Cuda) => Some(
                (0..self.options.tp)
                    .map(crate::gpu::cuda::free_memory)
                    .collect::<Result<Vec<u64>>>()?
                    .into_iter()
                    .min()
                    .unwrap_or(0),
            ),
            (None, DeviceKind::Cpu) => None,
        };
        tracing::info!(
            "memory per rank: weights {:.2} GiB, activations {:.2} GiB at {} tokens per batch, scratch {:.2} GiB; {}",
            need.weights as f64 / (1u64 << 30) as f64,
            (need.per_token * need.tokens) as f64 / (1u64 << 30) as f64,
            max_tokens_per_batch,
            need.fixed as f64 / (1u64 << 30) as f64,
            match free {
                Some(f) => format!("{:.2} GiB free", f as f64 / (1u64 << 30) as f64),
                None => "not checked on the CPU".into(),
            }
        );
        match free {
            Some(f) => need.check(f, self.options.tp, self.info.quantization.is_some()),
            None => Ok(()),
        }
    }

    /// The model's architecture and sizes.
    pub fn model(&self) -> &ModelInfo {
        &self.info
    }

    /// The options it was checked under.
    pub fn options(&self) -> &EngineOptions {
        &self.options
    }
}
