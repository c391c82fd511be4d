//! Decoder families, one file each, read top-down: attention, decoder layer, model.
//! Every model runs prefill only (no KV cache, no LM head) and returns the residual
//! stream at the requested capture points.
use std::rc::Rc;

use hslake_schemas::CapturePoint;
use tch::{Device, Kind, Tensor};

use crate::comm::Communicator;
use crate::config::{Architecture, ModelConfig};
use crate::error::{CaptureError, Result};
use crate::layers::NormKernel;
use crate::tp::LoadCtx;
use crate::weights::Weights;

pub mod llama;
pub mod mistral;
pub mod qwen2;
pub mod qwen3;

/// A loaded decoder (this rank's slice of it).
pub trait DecoderModel {
    /// Prefill over right-padded `[b, t]` int64 ids; one `[b, t, hidden]` tensor per point, in order.
    fn forward(&self, input_ids: &Tensor, points: &[CapturePoint]) -> Result<Vec<Tensor>>;
}

/// Every tensor the architecture reads, with its full (unsharded) shape.
pub fn tensor_shapes(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    match cfg.architecture {
        Architecture::Llama => llama::tensor_shapes(cfg),
        Architecture::Mistral => mistral::tensor_shapes(cfg),
        Architecture::Qwen2 => qwen2::tensor_shapes(cfg),
        Architecture::Qwen3 => qwen3::tensor_shapes(cfg),
    }
}

/// Checks names and shapes of every tensor the model needs against the checkpoint's headers,
/// before anything is loaded or computed.
pub fn check_checkpoint(cfg: &ModelConfig, weights: &Weights) -> Result<()> {
    for (name, shape) in tensor_shapes(cfg) {
        weights.check(&name, &shape)?;
    }
    Ok(())
}

/// Loads this rank's slice of the model.
pub fn load(
    cfg: &ModelConfig,
    weights: &Weights,
    comm: Rc<dyn Communicator>,
    device: Device,
    kind: Kind,
    norm: NormKernel,
) -> Result<Box<dyn DecoderModel>> {
    cfg.check_tp(comm.world_size())?;
    check_checkpoint(cfg, weights)?;
    let ctx = LoadCtx {
        weights,
        comm,
        device,
        kind,
        norm,
    };
    Ok(match cfg.architecture {
        Architecture::Llama => Box::new(llama::Model::load(&ctx, cfg)?),
        Architecture::Mistral => Box::new(mistral::Model::load(&ctx, cfg)?),
        Architecture::Qwen2 => Box::new(qwen2::Model::load(&ctx, cfg)?),
        Architecture::Qwen3 => Box::new(qwen3::Model::load(&ctx, cfg)?),
    })
}

/// Which layer outputs to keep during one forward, and where each goes in the result.
pub(crate) struct Captures<'a> {
    points: &'a [CapturePoint],
    out: Vec<Option<Tensor>>,
}

impl<'a> Captures<'a> {
    pub(crate) fn new(points: &'a [CapturePoint], num_layers: usize) -> Result<Self> {
        if let Some(p) = points
            .iter()
            .find(|p| p.layer().is_some_and(|l| l as usize >= num_layers))
        {
            return Err(CaptureError::Option(format!(
                "{} does not exist: the model has {num_layers} decoder layers (0..={})",
                p.label(),
                num_layers - 1
            )));
        }
        Ok(Captures {
            points,
            out: points.iter().map(|_| None).collect(),
        })
    }

    /// Layers after this one need not run (nothing later is captured).
    pub(crate) fn last_layer(&self, num_layers: usize) -> usize {
        if self.points.contains(&CapturePoint::FinalNorm) {
            return num_layers - 1;
        }
        self.points
            .iter()
            .filter_map(|p| p.layer())
            .max()
            .map_or(0, |l| l as usize)
    }

    pub(crate) fn after_layer(&mut self, i: usize, x: &Tensor) {
        for (p, o) in self.points.iter().zip(&mut self.out) {
            if *p == CapturePoint::LayerOutput(i as u32) {
                // Each layer returns a fresh tensor and never writes its input (residual sums
                // go into its own sublayer outputs), so sharing storage with `x` is safe.
                *o = Some(x.shallow_clone());
            }
        }
    }

    pub(crate) fn final_norm(&mut self, normed: impl FnOnce() -> Result<Tensor>) -> Result<()> {
        if let Some(i) = self
            .points
            .iter()
            .position(|p| *p == CapturePoint::FinalNorm)
        {
            self.out[i] = Some(normed()?);
        }
        Ok(())
    }

    pub(crate) fn finish(self) -> Result<Vec<Tensor>> {
        self.points
            .iter()
            .zip(self.out)
            .map(|(p, o)| {
                o.ok_or_else(|| {
                    CaptureError::Pipeline(format!("{} was not produced by the forward", p.label()))
                })
            })
            .collect()
    }
}
