//! Everything about a model that can be checked before it loads: its config, the
//! tensor-parallel split, the devices, and every tensor the model's own load reads (names,
//! shapes, dtypes), from the checkpoint's headers alone.
use std::sync::Arc;

use tch::Kind;

use super::options::{DeviceKind, EngineOptions};
use crate::checkpoint::Checkpoint;
use crate::error::{CaptureError, Result};
use crate::models::{registry, ModelConfig, ModelInfo};

/// A checkpoint whose config, tensor-parallel split and every tensor (name, shape, dtype, as
/// the model's own load reads them) have been checked, reading no tensor data.
/// [`Engine::load`] loads it.
pub struct CheckedModel {
    pub(super) options: EngineOptions,
    pub(super) config: Arc<dyn ModelConfig>,
    pub(super) info: ModelInfo,
    pub(super) checkpoint: Arc<Checkpoint>,
    pub(super) kind: Kind,
}

impl CheckedModel {
    /// Reads the config, checks the TP size and the devices, and runs the model's load
    /// against the checkpoint's headers; every tensor problem is reported at once.
    pub fn check(options: EngineOptions) -> Result<Self> {
        let kind = options.compute_kind()?;
        let config: Arc<dyn ModelConfig> = registry::read_config(&options.model_dir)?.into();
        config.check_tp(options.tp)?;
        let checkpoint = Checkpoint::open(&options.model_dir)?;
        crate::dry_run::check_checkpoint(&*config, &checkpoint, options.tp, kind)?;
        if options.device == DeviceKind::Cuda {
            let have = tch::Cuda::device_count() as usize;
            if !tch::Cuda::is_available() || have < options.tp {
                return Err(CaptureError::Option(format!(
                    "--device cuda --tp {} needs {} GPUs; {have} visible",
                    options.tp, options.tp
                )));
            }
        }
        Ok(CheckedModel {
            info: config.info(),
            options,
            config,
            checkpoint: Arc::new(checkpoint),
            kind,
        })
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
