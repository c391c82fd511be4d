//! speculators 0.9 offline layout: a `datasets` directory (`input_ids`, `loss_mask`,
//! `seq_len`, plus `sample_id`) and `hidden_states/hs_{i}.safetensors` for row `i`, holding
//! `hidden_states` `[T, 4, H]` (the three aux layers, then the last layer's pre-norm output)
//! and `token_ids` `[T]` (int64) — what its `ArrowDataset` reads through `FileTransfer`.
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;
use safetensors::Dtype;

use super::hf_dataset::HfDatasetWriter;
use super::{create_dir, io_err, write_atomic, TrainerSample, TrainerSink};
use crate::{ElemType, LoaderError};

/// Writes the speculators layout into one directory.
pub struct SpeculatorsSink {
    states: PathBuf,
    rows: HfDatasetWriter,
}

impl SpeculatorsSink {
    /// Start an export into the (empty) directory `dir`.
    pub fn create(dir: &Path) -> Result<Self, LoaderError> {
        let states = dir.join("hidden_states");
        create_dir(&states)?;
        Ok(SpeculatorsSink {
            states,
            rows: HfDatasetWriter::create(dir)?,
        })
    }
}

fn st_dtype(d: ElemType) -> Dtype {
    match d {
        ElemType::Bf16 => Dtype::BF16,
        ElemType::F16 => Dtype::F16,
        ElemType::F32 => Dtype::F32,
        ElemType::I64 => Dtype::I64,
        ElemType::I32 => Dtype::I32,
    }
}

/// `[T, k·H]` and `[T, H]` rows interleaved per token into `[T, k + 1, H]`.
pub fn stack_per_token(aux: &[u8], target: &[u8], tokens: usize) -> Vec<u8> {
    let (a, t) = (aux.len() / tokens.max(1), target.len() / tokens.max(1));
    let mut out = Vec::with_capacity(aux.len() + target.len());
    for i in 0..tokens {
        out.extend_from_slice(&aux[i * a..(i + 1) * a]);
        out.extend_from_slice(&target[i * t..(i + 1) * t]);
    }
    out
}

impl TrainerSink for SpeculatorsSink {
    fn write(&mut self, s: &TrainerSample<'_>) -> Result<(), LoaderError> {
        let n = s.input_ids.len();
        let h = *s.target.shape.last().unwrap_or(&0);
        let kh = *s.aux.shape.last().unwrap_or(&0);
        let path = self.states.join(format!("hs_{}.safetensors", s.index));
        if h == 0 || kh != 3 * h {
            return Err(io_err(
                &path,
                format!(
                    "sample {}: speculators needs 3 aux layers of width {h} per token, got \
                     aux width {kh}",
                    s.sample_id
                ),
            ));
        }
        let hidden = stack_per_token(s.aux.bytes(), s.target.bytes(), n);
        let ids: Vec<u8> = s.input_ids.iter().flat_map(|v| v.to_le_bytes()).collect();
        let bytes = TensorView::new(st_dtype(s.target.dtype), vec![n, 4, h], &hidden)
            .and_then(|hs| {
                let tok = TensorView::new(Dtype::I64, vec![n], &ids)?;
                safetensors::serialize([("hidden_states", hs), ("token_ids", tok)], None)
            })
            .map_err(|e| io_err(&path, e))?;
        write_atomic(&path, &bytes)?;
        self.rows.append(s.sample_id, &s.input_ids, &s.loss_mask)
    }

    fn finish(self: Box<Self>) -> Result<(), LoaderError> {
        let rows = self.rows.finish()?;
        tracing::info!(
            rows,
            "wrote the datasets index (data-00000-of-00001.arrow, state.json)"
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stacks_aux_then_target_for_each_token() {
        // Two tokens, "H" of one byte: aux rows [1 2 3], [4 5 6]; target rows [9], [8].
        let out = stack_per_token(&[1, 2, 3, 4, 5, 6], &[9, 8], 2);
        assert_eq!(out, vec![1, 2, 3, 9, 4, 5, 6, 8]);
    }
}
