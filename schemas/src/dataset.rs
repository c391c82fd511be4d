use serde::{Deserialize, Serialize};

use crate::{CapturePoint, DType, FinitePolicy, Sample, SchemaError, LAYER_CONVENTION};

/// Version of the on-disk format this build writes and the newest it reads (docs/FORMAT.md,
/// "Format version rules"). Version 3 stores each value's checksum as a CRC-32 after its last
/// frame, where version 2 had zstd's checksum in every frame.
pub const FORMAT_VERSION: u32 = 3;

/// The oldest format version this build reads: version 2 (`plane_zstd` with zstd frame
/// checksums or none) reads as before. Version 1 was never released.
pub const OLDEST_FORMAT_VERSION: u32 = 2;

/// What a dataset holds: the model it came from and which hidden states, of which dtype.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DatasetSchema {
    /// Model name or path, as given at capture.
    pub model: String,
    /// Hugging Face architecture, e.g. `LlamaForCausalLM`.
    pub architecture: String,
    /// Width of the residual stream: every tensor is `[seq_len, hidden_size]`.
    pub hidden_size: usize,
    /// Decoder layers in the model.
    pub num_layers: usize,
    /// Vocabulary size; every token id is below it.
    pub vocab_size: usize,
    /// Element type of every tensor.
    pub dtype: DType,
    /// Captured points, in column order.
    pub points: Vec<CapturePoint>,
    /// Meaning of the capture points.
    #[serde(default = "default_convention")]
    pub layer_convention: String,
    /// Optional fingerprint (e.g. sha256 of tokenizer.json).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer_fingerprint: Option<String>,
}

fn default_convention() -> String {
    LAYER_CONVENTION.to_string()
}

impl DatasetSchema {
    /// A validated schema.
    pub fn new(
        model: impl Into<String>,
        architecture: impl Into<String>,
        hidden_size: usize,
        num_layers: usize,
        vocab_size: usize,
        dtype: DType,
        points: Vec<CapturePoint>,
    ) -> Result<Self, SchemaError> {
        let s = DatasetSchema {
            model: model.into(),
            architecture: architecture.into(),
            hidden_size,
            num_layers,
            vocab_size,
            dtype,
            points,
            layer_convention: default_convention(),
            tokenizer_fingerprint: None,
        };
        s.check()?;
        Ok(s)
    }

    /// Check that the schema is self-consistent.
    pub fn check(&self) -> Result<(), SchemaError> {
        let bad = |m: String| Err(SchemaError::InvalidSchema(m));
        if self.hidden_size == 0 {
            return bad("hidden_size must be > 0".into());
        }
        if self.vocab_size == 0 {
            return bad("vocab_size must be > 0".into());
        }
        if self.points.is_empty() {
            return bad("at least one capture point is required".into());
        }
        for (i, p) in self.points.iter().enumerate() {
            if let Some(l) = p.layer() {
                if l as usize >= self.num_layers {
                    return bad(format!(
                        "{} is out of range: the model has {} decoder layers (0..={})",
                        p.label(),
                        self.num_layers,
                        self.num_layers.saturating_sub(1)
                    ));
                }
            }
            if self.points[..i].contains(p) {
                return bad(format!("{} is listed twice", p.label()));
            }
        }
        Ok(())
    }

    /// Index of a capture point's column among the tensors.
    pub fn point_index(&self, p: CapturePoint) -> Option<usize> {
        self.points.iter().position(|q| *q == p)
    }

    /// Validate one sample: lengths agree, each tensor is `[seq_len, hidden]` of the schema's
    /// dtype, scales present exactly for fp8, token ids inside the vocabulary.
    /// Finiteness is checked separately (it needs the statistics).
    pub fn validate<D: AsRef<[u8]>>(&self, s: &Sample<D>) -> Result<(), SchemaError> {
        let n = s.input_ids.len();
        if n == 0 {
            return Err(SchemaError::Empty {
                sample_id: s.sample_id,
            });
        }
        if s.loss_mask.len() != n {
            return Err(SchemaError::Length {
                sample_id: s.sample_id,
                field: "loss_mask".into(),
                expected: n,
                got: s.loss_mask.len(),
            });
        }
        if let Some((position, &token)) = s
            .input_ids
            .iter()
            .enumerate()
            .find(|(_, &t)| t < 0 || t as usize >= self.vocab_size)
        {
            return Err(SchemaError::TokenOutOfRange {
                sample_id: s.sample_id,
                token: token as i64,
                position,
                vocab_size: self.vocab_size,
            });
        }
        if s.tensors.len() != self.points.len() {
            return Err(SchemaError::TensorCount {
                sample_id: s.sample_id,
                expected: self.points.len(),
                names: self
                    .points
                    .iter()
                    .map(|p| p.column())
                    .collect::<Vec<_>>()
                    .join(", "),
                got: s.tensors.len(),
            });
        }
        for (p, t) in self.points.iter().zip(&s.tensors) {
            let expected = vec![n, self.hidden_size];
            if t.shape != expected {
                return Err(SchemaError::Shape {
                    point: p.label(),
                    hint: shape_hint(&t.shape, n, self.hidden_size),
                    expected,
                    got: t.shape.clone(),
                });
            }
            if t.dtype != self.dtype {
                return Err(SchemaError::DType {
                    point: p.label(),
                    expected: self.dtype,
                    got: t.dtype,
                });
            }
            t.check_bytes(&p.label())?;
        }
        Ok(())
    }

    /// Apply the finiteness policy to a sample's per-tensor NaN/Inf counts.
    /// Returns `false` when the sample is to be skipped.
    pub fn apply_finite_policy(
        &self,
        sample_id: u64,
        counts: impl IntoIterator<Item = (u64, u64)>,
        policy: FinitePolicy,
    ) -> Result<bool, SchemaError> {
        for (p, (nan, inf)) in self.points.iter().zip(counts) {
            if nan + inf > 0 {
                match policy {
                    FinitePolicy::Error => {
                        return Err(SchemaError::NonFinite {
                            sample_id,
                            point: p.label(),
                            nan,
                            inf,
                        })
                    }
                    FinitePolicy::Skip => return Ok(false),
                    FinitePolicy::Record => {}
                }
            }
        }
        Ok(true)
    }
}

/// Guess the cause of a wrong shape, for the common capture mistakes.
fn shape_hint(got: &[usize], seq_len: usize, hidden: usize) -> String {
    match got {
        [t] if *t == seq_len => {
            "; a 1-D tensor per token: was one column or a reduced value captured instead of the full residual?".into()
        }
        [_] => "; is the tensor-parallel shard being captured instead of the full residual?".into(),
        [t, h] if *t == seq_len && *h < hidden && hidden.is_multiple_of(*h) => format!(
            "; hidden is {h} = {hidden}/{}: is a tensor-parallel shard being captured instead of the full residual?",
            hidden / h
        ),
        [1, t, h] if *t == seq_len && *h == hidden => "; drop the batch dimension".into(),
        [b, _, h] if *h == hidden && *b > 1 => "; a padded batch: slice each sample to its own length".into(),
        [t, _] if *t != seq_len => "; the token dimension must equal len(input_ids) (no padding)".into(),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TensorData;

    fn schema(h: usize, points: &[u32]) -> DatasetSchema {
        DatasetSchema::new(
            "m",
            "LlamaForCausalLM",
            h,
            61,
            1000,
            DType::Bf16,
            points
                .iter()
                .map(|&i| CapturePoint::LayerOutput(i))
                .collect(),
        )
        .unwrap()
    }

    fn sample(n: usize, tensors: Vec<TensorData>) -> Sample {
        Sample {
            sample_id: 7,
            input_ids: vec![1; n],
            loss_mask: vec![1; n],
            tensors,
        }
    }

    #[test]
    fn names_the_seed_failure_layer_and_shapes() {
        // The seed deployment's bug: a [512] tensor where [512, 7168] was due.
        let s = schema(7168, &[2, 30]);
        let ok = TensorData::zeros(DType::Bf16, vec![512, 7168]);
        let bad = TensorData::zeros(DType::Bf16, vec![512]);
        let err = s
            .validate(&sample(512, vec![ok, bad]))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("layer 30: expected shape [512, 7168], got [512]"),
            "{err}"
        );
    }

    #[test]
    fn rejects_shape_without_hidden_dim_and_hints_at_tp_shard() {
        let s = schema(8, &[2]);
        let err = s
            .validate(&sample(3, vec![TensorData::zeros(DType::Bf16, vec![3, 4])]))
            .unwrap_err();
        assert!(err.to_string().contains("tensor-parallel shard"), "{err}");
    }

    #[test]
    fn rejects_mismatched_loss_mask_length() {
        let s = schema(4, &[2]);
        let mut x = sample(3, vec![TensorData::zeros(DType::Bf16, vec![3, 4])]);
        x.loss_mask.pop();
        let err = s.validate(&x).unwrap_err().to_string();
        assert_eq!(
            err,
            "sample 7: loss_mask has length 2, expected 3 (the length of input_ids)"
        );
    }

    #[test]
    fn rejects_wrong_dtype_and_token_out_of_vocab() {
        let s = schema(4, &[2]);
        let err = s
            .validate(&sample(3, vec![TensorData::zeros(DType::F32, vec![3, 4])]))
            .unwrap_err();
        assert_eq!(err.to_string(), "layer 2: expected dtype bf16, got f32");
        let mut x = sample(3, vec![TensorData::zeros(DType::Bf16, vec![3, 4])]);
        x.input_ids[1] = 1000;
        assert!(s
            .validate(&x)
            .unwrap_err()
            .to_string()
            .contains("token id 1000 at position 1"));
    }

    #[test]
    fn rejects_layer_beyond_model_depth() {
        let err = DatasetSchema::new(
            "m",
            "a",
            4,
            30,
            10,
            DType::Bf16,
            vec![CapturePoint::LayerOutput(30)],
        )
        .unwrap_err();
        assert!(err
            .to_string()
            .contains("layer 30 is out of range: the model has 30 decoder layers"));
    }

    #[test]
    fn fp8_requires_one_scale_per_token() {
        let s = DatasetSchema::new(
            "m",
            "a",
            4,
            3,
            10,
            DType::Fp8E4m3,
            vec![CapturePoint::FinalNorm],
        )
        .unwrap();
        let mut t = TensorData::zeros(DType::Fp8E4m3, vec![3, 4]);
        t.scales = Some(vec![1.0; 2]);
        let err = s.validate(&sample(3, vec![t])).unwrap_err().to_string();
        assert!(err.contains("expected 3 scales"), "{err}");
    }

    #[test]
    fn finite_policy_errors_skips_or_records() {
        let s = schema(4, &[2]);
        assert!(s
            .apply_finite_policy(1, [(1, 0)], FinitePolicy::Error)
            .is_err());
        assert!(!s
            .apply_finite_policy(1, [(1, 0)], FinitePolicy::Skip)
            .unwrap());
        assert!(s
            .apply_finite_policy(1, [(0, 2)], FinitePolicy::Record)
            .unwrap());
    }
}
