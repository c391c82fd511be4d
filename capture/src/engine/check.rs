//! Everything about a model that can be checked before it loads: its config, the
//! tensor-parallel split, the devices, where states are split into planes, and every tensor
//! the model's own load reads (names, shapes, dtypes), from the checkpoint's headers alone.
use std::sync::Arc;

use tch::Kind;

use super::memory::MemoryNeed;
use super::options::EngineOptions;
use super::placement::{decide, Decided, Placement, StreamNeed};
use crate::checkpoint::Checkpoint;
use crate::error::{CaptureError, Result};
use crate::gpu::DeviceKind;
use crate::kernels::MoeKernel;
use crate::models::{registry, ModelConfig, ModelInfo};
use crate::stream::layout::LayerLayout;
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
    /// How the model will be held, once [`CheckedModel::plan`] has decided.
    pub(super) plan: Option<Plan>,
}

/// How a checked model will be held.
#[derive(Debug, Clone)]
pub(super) enum Plan {
    /// Resident on `tp` ranks.
    Resident,
    /// Streamed through `devices`, one stream each.
    Stream(StreamPlan),
}

/// A streamed model's plan.
#[derive(Debug, Clone)]
pub(crate) struct StreamPlan {
    /// One stream per entry: the GPU index on CUDA (a GPU named twice runs two), 0 on the CPU.
    pub devices: Vec<usize>,
    /// Tokens per pass.
    pub pass_tokens: u64,
    /// The largest batch the memory plan holds, in tokens (jobs with larger batches are
    /// refused: they would not fit beside the pass).
    pub batch_tokens: usize,
    /// Each layer's slot layout.
    pub layouts: Arc<Vec<LayerLayout>>,
}

impl CheckedModel {
    /// Reads the config, checks the TP size and the devices, decides the plane split, and runs
    /// the model's load against the checkpoint's headers; every tensor problem is reported at
    /// once.
    pub fn check(options: EngineOptions) -> Result<Self> {
        let kind = options.compute_kind()?;
        let (config, quant) = registry::read_model(&options.model_dir)?;
        let config: Arc<dyn ModelConfig> = config.into();
        if options.placement.placement != Placement::Stream {
            config.check_tp(options.tp)?;
        }
        let mut info = config.info();
        info.quantization = quant.describe();
        let checkpoint = Checkpoint::open(&options.model_dir)?.with_quantization(quant);
        let tp = match options.placement.placement {
            Placement::Stream => 1,
            _ => options.tp,
        };
        let reads = crate::tools::dry_run::check_checkpoint(&*config, &checkpoint, tp, kind)?;
        if options.device == DeviceKind::Cuda {
            let have = tch::Cuda::device_count() as usize;
            let needed = stream_devices(&options)
                .iter()
                .map(|d| d + 1)
                .chain([options.tp])
                .max()
                .unwrap_or(1);
            if !tch::Cuda::is_available() || have < needed {
                return Err(CaptureError::Option(format!(
                    "--device cuda with --tp {} and --devices {:?} needs {needed} GPUs; {have} visible",
                    options.tp, options.placement.devices
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
            plan: None,
        })
    }

    /// The memory pre-flight for batches of `max_tokens_per_batch` tokens capturing
    /// `captured` points, and the placement it decides (`--placement`; for `auto`, resident
    /// where the model fits and streamed otherwise), logged with the numbers behind it. Refuses,
    /// before anything loads, a model that fits neither way in the memory of the GPUs it would
    /// use (or `--gpu-memory`, if set, on any device). Without `--gpu-memory` a CPU run is not
    /// checked, and stays resident unless streaming is asked for.
    pub fn plan(&mut self, max_tokens_per_batch: usize, captured: usize) -> Result<()> {
        let grouped = self.options.kernels.moe == MoeKernel::Grouped;
        let (hidden, kind) = (self.info.hidden_size, self.kind);
        let asked = self.options.placement.placement;
        let resident = MemoryNeed::estimate(
            &self.reads.all().cloned().collect::<Vec<_>>(),
            max_tokens_per_batch,
            captured,
            hidden,
            kind,
            grouped,
        );
        let devices = stream_devices(&self.options);
        let budget = match (self.options.placement.gpu_memory, self.options.device) {
            (Some(bytes), _) => Some(bytes),
            (None, DeviceKind::Cuda) => {
                let gpus: Vec<usize> = match asked {
                    Placement::Resident => (0..self.options.tp).collect(),
                    _ => (0..self.options.tp)
                        .chain(devices.iter().copied())
                        .collect(),
                };
                Some(
                    gpus.into_iter()
                        .map(crate::gpu::cuda::free_memory)
                        .collect::<Result<Vec<u64>>>()?
                        .into_iter()
                        .min()
                        .unwrap_or(0),
                )
            }
            (None, DeviceKind::Cpu) => None,
        };
        if asked == Placement::Resident || (asked == Placement::Auto && budget.is_none()) {
            log_resident(&resident, max_tokens_per_batch, budget);
            if let Some(b) = budget {
                resident.check(b, self.options.tp, self.info.quantization.is_some())?;
            }
            self.plan = Some(Plan::Resident);
            return Ok(());
        }
        // Streams sharing a GPU share its memory.
        let shared = devices
            .iter()
            .map(|d| devices.iter().filter(|e| *e == d).count())
            .max()
            .unwrap_or(1) as u64;
        let stream_reads = match self.options.tp {
            1 => self.reads.clone(),
            _ => crate::tools::dry_run::check_checkpoint(&*self.config, &self.checkpoint, 1, kind)?,
        };
        let layouts = crate::stream::layouts(&stream_reads, &self.checkpoint)?;
        let need = StreamNeed::estimate(
            &stream_reads,
            &layouts,
            max_tokens_per_batch,
            captured,
            hidden,
            kind,
            grouped,
        );
        let decided = decide(
            asked,
            &resident,
            &need,
            budget.map(|b| b / shared),
            self.options.placement.pass_tokens,
        )
        .map_err(|e| match (asked, budget) {
            // Neither fits: say what resident would need too.
            (Placement::Auto, Some(b)) => match resident.check(b, self.options.tp, true) {
                Err(CaptureError::Memory(m)) => {
                    CaptureError::Memory(format!("{m}; streamed one layer at a time instead, {e}"))
                }
                _ => e,
            },
            _ => e,
        })?;
        self.plan = Some(match decided {
            Decided::Resident => Plan::Resident,
            Decided::Stream { pass_tokens } => {
                tracing::info!(
                    "streaming through {} device(s) {:?} in passes of {pass_tokens} tokens",
                    devices.len(),
                    devices
                );
                Plan::Stream(StreamPlan {
                    devices,
                    pass_tokens,
                    batch_tokens: max_tokens_per_batch,
                    layouts: Arc::new(layouts),
                })
            }
        });
        Ok(())
    }

    /// For tools that run the model themselves (`hslake debug prefill`): the checked config,
    /// the weights, the compute dtype, and the stream plan where [`Self::plan`] chose to stream.
    pub(crate) fn parts(
        &self,
    ) -> (
        &dyn ModelConfig,
        &Arc<Checkpoint>,
        Kind,
        Option<&StreamPlan>,
    ) {
        let plan = match &self.plan {
            Some(Plan::Stream(p)) => Some(p),
            _ => None,
        };
        (&*self.config, &self.checkpoint, self.kind, plan)
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

/// The streams `options` asks for: `--devices`, else one per `--tp` (GPUs `0..tp` on CUDA).
pub(super) fn stream_devices(options: &EngineOptions) -> Vec<usize> {
    match (&options.placement.devices[..], options.device) {
        ([], DeviceKind::Cuda) => (0..options.tp).collect(),
        ([], DeviceKind::Cpu) => vec![0; options.tp],
        (given, _) => given.to_vec(),
    }
}

/// Logs the resident estimate against the budget.
fn log_resident(need: &MemoryNeed, max_tokens_per_batch: usize, budget: Option<u64>) {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    tracing::info!(
        "placement resident; memory per rank: weights {:.2} GiB, activations {:.2} GiB at {} tokens per batch, scratch {:.2} GiB; {}",
        gib(need.weights),
        gib(need.per_token * need.tokens),
        max_tokens_per_batch,
        gib(need.fixed),
        match budget {
            Some(f) => format!("{:.2} GiB available", gib(f)),
            None => "not checked on the CPU".into(),
        }
    );
}
