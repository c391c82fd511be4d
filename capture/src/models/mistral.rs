//! `MistralForCausalLM`: the Llama computation (see `llama.rs`, whose model it wraps) with
//! sliding-window attention: token i attends to j only when `i - window < j <= i`.
//! Sequences no longer than the window are plain causal and take the fused causal path.
use hslake_schemas::CapturePoint;
use tch::{Device, Kind, Tensor};

use super::hf_config::ConfigFile;
use super::llama::{self, LlamaConfig};
use super::{DecoderModel, ModelConfig};
use crate::error::Result;

/// `MistralForCausalLM`: `sliding_window` from the config; no biases.
pub(crate) fn parse(file: &ConfigFile) -> Result<Box<dyn ModelConfig>> {
    let raw = file.decoder()?;
    Ok(Box::new(LlamaConfig {
        sliding_window: raw.sliding_window,
        model: |ctx, cfg| {
            Ok(Box::new(Model {
                inner: llama::Model::load(ctx, cfg)?,
                window: cfg.sliding_window,
                device: ctx.device,
            }))
        },
        ..LlamaConfig::from_raw("MistralForCausalLM", &raw)?
    }))
}

/// The Llama stack plus the window.
struct Model {
    inner: llama::Model,
    window: Option<usize>,
    device: Device,
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
