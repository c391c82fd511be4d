//! `MistralForCausalLM`: the Llama computation (see `llama.rs`, whose layers it loads) with
//! sliding-window attention: token i attends to j only when `i - window < j <= i`.
//! Sequences no longer than the window are plain causal and take the fused causal path.
use hslake_schemas::CapturePoint;
use tch::{Device, Kind, Tensor};

use super::{llama, DecoderModel};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::tp::LoadCtx;

/// Same checkpoint layout as Llama (Mistral has no biases).
pub fn tensor_shapes(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    llama::tensor_shapes(cfg)
}

/// The Llama stack plus the window.
pub struct Model {
    inner: llama::Model,
    window: Option<usize>,
    device: Device,
}

impl Model {
    /// Loads this rank's slice of every weight.
    pub fn load(ctx: &LoadCtx, cfg: &ModelConfig) -> Result<Self> {
        Ok(Model {
            inner: llama::Model::load(ctx, cfg)?,
            window: cfg.sliding_window,
            device: ctx.device,
        })
    }
}

/// `[t, t]` boolean: true where query i may attend key j.
fn sliding_mask(t: i64, window: i64, device: Device) -> Result<Tensor> {
    let i = Tensor::f_arange(t, (Kind::Int64, device))?.f_unsqueeze(1)?; // [t, 1]
    let j = Tensor::f_arange(t, (Kind::Int64, device))?.f_unsqueeze(0)?; // [1, t]
    let causal = j.f_le_tensor(&i)?;
    let in_window = j.f_gt_tensor(&i.f_sub_scalar(window)?)?;
    Ok(causal.f_logical_and(&in_window)?)
}

impl DecoderModel for Model {
    fn forward(&self, input_ids: &Tensor, points: &[CapturePoint]) -> Result<Vec<Tensor>> {
        let t = input_ids.size()[1];
        match self.window {
            Some(w) if (w as i64) < t => {
                let mask = sliding_mask(t, w as i64, self.device)?;
                self.inner.forward_masked(input_ids, points, Some(&mask))
            }
            _ => self.inner.forward_masked(input_ids, points, None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_mask_keeps_the_last_w_positions_up_to_the_diagonal() {
        let m = sliding_mask(4, 2, Device::Cpu)
            .unwrap()
            .to_kind(Kind::Int64);
        let rows: Vec<Vec<i64>> = (0..4)
            .map(|r| Vec::<i64>::try_from(m.get(r)).unwrap())
            .collect();
        assert_eq!(
            rows,
            vec![
                vec![1, 0, 0, 0],
                vec![1, 1, 0, 0],
                vec![0, 1, 1, 0],
                vec![0, 0, 1, 1]
            ]
        );
    }
}
