//! Decoder families, one file each, read top-down: config, attention, decoder layer, model.
//! Each family owns its validated config (parsed from `config.json` by the entry the
//! [`registry`] holds for it) and its loading; every model runs prefill only (no KV cache, no
//! LM head) and returns the residual stream at the requested capture points. The families are
//! built from the blocks beside them: [`layers`] (norms, rotary embeddings, the MLP), [`tp`]
//! (tensor-parallel linears) and [`moe`] (mixture-of-experts feed-forwards).
use hslake_schemas::CapturePoint;
use tch::Tensor;

use crate::error::{CaptureError, Result};
use crate::load::LoadCtx;
use layers::RopeTables;

mod deepseek_v3;
mod hf_config;
pub(crate) mod layers;
mod llama;
mod mistral;
pub(crate) mod moe;
mod qwen2;
mod qwen3;
mod qwen3_moe;
pub(crate) mod registry;
pub(crate) mod tp;

/// What the rest of the capture needs to know of a checkpoint's model: its architecture's
/// name and the sizes the dataset schema and the input checks depend on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelInfo {
    /// The Hugging Face class name recorded in the manifest (e.g. `LlamaForCausalLM`).
    pub architecture: &'static str,
    /// Width of the residual stream (of every captured tensor's rows).
    pub hidden_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Vocabulary size (token ids must be below it).
    pub vocab_size: usize,
    /// How the checkpoint's linear weights are quantized (as the manifest records it);
    /// `None` when they are plain floats. Families leave it `None`: the checked model fills it
    /// in from `quantization_config`, which no family reads.
    pub quantization: Option<String>,
}

/// An architecture's validated runtime config: what the engine asks of it, and its loader.
pub(crate) trait ModelConfig: Send + Sync + std::fmt::Debug {
    /// Name and sizes.
    fn info(&self) -> ModelInfo;

    /// Refuses a tensor-parallel size the model's heads and widths cannot be split into.
    fn check_tp(&self, tp: usize) -> Result<()>;

    /// The parts of this rank's slice that every layer shares (embeddings, final norm, rotary
    /// tables), every weight read through `ctx`; the layers load one at a time from it.
    fn load_stack(&self, ctx: &LoadCtx) -> Result<Box<dyn LayeredModel>>;

    /// This rank's slice of the whole model, every weight read through `ctx` (a checkpoint, or
    /// a dry run that only checks what would be read).
    fn load(&self, ctx: &LoadCtx) -> Result<Box<dyn DecoderModel>> {
        Ok(Box::new(Resident::load(self.load_stack(ctx)?, ctx)?))
    }
}

/// A loaded decoder (this rank's slice of it).
pub(crate) trait DecoderModel {
    /// Prefill over right-padded `[b, t]` int64 ids; one `[b, t, hidden]` tensor per point, in order.
    fn forward(&self, input_ids: &Tensor, points: &[CapturePoint]) -> Result<Vec<Tensor>>;
}

/// A decoder as a stack of layers that load one at a time: resident capture loads them all
/// once, streamed capture loads each as its turn comes and drops it after. Both run every
/// batch through the same [`Layer::forward`], so they compute the same bits.
pub(crate) trait LayeredModel {
    /// Decoder layers.
    fn num_layers(&self) -> usize;

    /// The residual stream entering layer 0 for right-padded `[b, t]` ids, and what every
    /// layer needs to run that batch.
    fn embed(&self, input_ids: &Tensor) -> Result<(Tensor, BatchContext)>;

    /// Decoder layer `layer`, every weight read through `ctx`.
    fn load_layer(&self, ctx: &LoadCtx, layer: usize) -> Result<Box<dyn Layer>>;

    /// The final RMS norm of the last layer's output.
    fn final_norm(&self, x: &Tensor) -> Result<Tensor>;
}

/// What every layer needs to run one batch: rotary tables for its width and, where the model
/// attends through a window, the boolean `[t, t]` mask (true = attend) that replaces the
/// causal one.
pub(crate) struct BatchContext {
    /// cos/sin for the batch's positions.
    pub rope: RopeTables,
    /// The attention mask, if not plainly causal.
    pub mask: Option<Tensor>,
}

/// One decoder layer.
pub(crate) trait Layer {
    /// `[b, t, hidden] -> [b, t, hidden]`: a new tensor; `x` is never written (a capture may
    /// hold it).
    fn forward(&self, x: &Tensor, batch: &BatchContext) -> Result<Tensor>;
}

/// Every layer loaded once: the resident model.
pub(crate) struct Resident {
    stack: Box<dyn LayeredModel>,
    layers: Vec<Box<dyn Layer>>,
}

impl Resident {
    /// `stack` with all its layers, read through `ctx`.
    pub fn load(stack: Box<dyn LayeredModel>, ctx: &LoadCtx) -> Result<Self> {
        let layers = (0..stack.num_layers())
            .map(|i| stack.load_layer(ctx, i))
            .collect::<Result<_>>()?;
        Ok(Resident { stack, layers })
    }
}

impl DecoderModel for Resident {
    fn forward(&self, input_ids: &Tensor, points: &[CapturePoint]) -> Result<Vec<Tensor>> {
        let mut captures = Captures::new(points, self.layers.len())?;
        let last = captures.last_layer(self.layers.len());
        let (mut x, batch) = self.stack.embed(input_ids)?; // [b, t, hidden]
        for (i, layer) in self.layers.iter().enumerate().take(last + 1) {
            x = layer.forward(&x, &batch)?;
            captures.after_layer(i, &x);
        }
        captures.final_norm(|| self.stack.final_norm(&x))?;
        captures.finish()
    }
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
