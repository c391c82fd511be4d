use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::ScaleReason;
use crate::{DType, SchemaError};

/// What capture and prepare do with a sample longer than the longest allowed
/// (`--max-seq-len`): one policy, spelled the same on every command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Overlong {
    /// Keep its first `max_seq_len` tokens.
    #[default]
    Truncate,
    /// Leave it out.
    Skip,
}

impl FromStr for Overlong {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "truncate" => Ok(Overlong::Truncate),
            "skip" => Ok(Overlong::Skip),
            _ => Err(format!(
                "unknown overlong policy {s:?}; expected truncate or skip"
            )),
        }
    }
}

/// Part `index` of `count` of an input: the samples whose id is `index` modulo `count`. A split
/// by sample id rather than by position, so it does not depend on the input's order and
/// resume can tell which committed samples are this part's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub struct InputShard {
    /// This part, `0..count`.
    pub index: u64,
    /// How many parts.
    pub count: u64,
}

impl InputShard {
    /// Whether sample `id` belongs to this part.
    pub fn contains(&self, id: u64) -> bool {
        id % self.count == self.index
    }
}

impl FromStr for InputShard {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let bad = || format!("shard {s:?}: expected I/N with 0 <= I < N, e.g. 0/4");
        let (i, n) = s.split_once('/').ok_or_else(bad)?;
        let (index, count) = (
            i.trim().parse::<u64>().map_err(|_| bad())?,
            n.trim().parse::<u64>().map_err(|_| bad())?,
        );
        if index >= count {
            return Err(bad());
        }
        Ok(InputShard { index, count })
    }
}

impl std::fmt::Display for InputShard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

impl From<InputShard> for String {
    fn from(s: InputShard) -> String {
        s.to_string()
    }
}

impl TryFrom<String> for InputShard {
    type Error = String;
    fn try_from(s: String) -> std::result::Result<Self, String> {
        s.parse()
    }
}

/// One tensor's values: little-endian element bytes in row-major order. The bytes are owned
/// (`Vec<u8>`) unless a producer lends them from its own buffer (`D`: capture encodes straight
/// from the pinned host buffer the GPU copied into, instead of copying each sample out first).
#[derive(Debug, Clone, PartialEq)]
pub struct TensorData<D = Vec<u8>> {
    /// Element type.
    pub dtype: DType,
    /// Shape, row-major; a stored tensor is `[seq_len, hidden]`.
    pub shape: Vec<usize>,
    /// `product(shape) * dtype.size()` bytes.
    pub data: D,
    /// One f32 scale per token, for fp8 only.
    pub scales: Option<Vec<f32>>,
}

impl TensorData {
    /// A tensor of zeros (fp8 gets unit scales).
    pub fn zeros(dtype: DType, shape: Vec<usize>) -> Self {
        let n: usize = shape.iter().product();
        let scales = dtype
            .has_scales()
            .then(|| vec![1.0; shape.first().copied().unwrap_or(0)]);
        TensorData {
            dtype,
            data: vec![0; n * dtype.size()],
            shape,
            scales,
        }
    }

    /// An f32 tensor from values.
    pub fn from_f32(values: &[f32], shape: Vec<usize>) -> Self {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        TensorData {
            dtype: DType::F32,
            shape,
            data,
            scales: None,
        }
    }

    /// A bf16 tensor from raw bits.
    pub fn from_bf16_bits(bits: &[u16], shape: Vec<usize>) -> Self {
        let data = bits.iter().flat_map(|v| v.to_le_bytes()).collect();
        TensorData {
            dtype: DType::Bf16,
            shape,
            data,
            scales: None,
        }
    }
}

impl<D: AsRef<[u8]>> TensorData<D> {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Element `i` as f32, with the fp8 scale of its token applied.
    pub fn value(&self, i: usize) -> f32 {
        let v = self.dtype.to_f32(self.data.as_ref(), i);
        match (&self.scales, self.shape.get(1)) {
            (Some(s), Some(&h)) if h > 0 => v * s[i / h],
            _ => v,
        }
    }

    /// All values as f32 (scales applied).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        (0..self.numel()).map(|i| self.value(i)).collect()
    }

    /// Check the byte length and scales against shape and dtype.
    pub fn check_bytes(&self, point: &str) -> Result<(), SchemaError> {
        let expected = self.numel() * self.dtype.size();
        let got = self.data.as_ref().len();
        if got != expected {
            return Err(SchemaError::ByteLength {
                point: point.to_string(),
                expected,
                got,
                shape: self.shape.clone(),
                dtype: self.dtype,
            });
        }
        let tokens = self.shape.first().copied().unwrap_or(0);
        let reason = match (&self.scales, self.dtype.has_scales()) {
            (None, true) => Some(ScaleReason::Missing),
            (Some(_), false) => Some(ScaleReason::Unexpected),
            (Some(s), true) if s.len() != tokens => Some(ScaleReason::Count {
                expected: tokens,
                got: s.len(),
            }),
            _ => None,
        };
        match reason {
            Some(reason) => Err(SchemaError::Scales {
                point: point.to_string(),
                reason,
            }),
            None => Ok(()),
        }
    }
}

/// One logical row of a dataset: a tokenized sample and its captured hidden states (their
/// bytes owned, or lent as `D`: see [`TensorData`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<D = Vec<u8>> {
    /// Unique id within the dataset.
    pub sample_id: u64,
    /// Token ids, `[seq_len]`.
    pub input_ids: Vec<i32>,
    /// 1 where the token counts for the loss, `[seq_len]`.
    pub loss_mask: Vec<u8>,
    /// One tensor per capture point, in schema order, each `[seq_len, hidden]`.
    pub tensors: Vec<TensorData<D>>,
}

impl<D> Sample<D> {
    /// Tokens in the sample.
    pub fn seq_len(&self) -> usize {
        self.input_ids.len()
    }
}

/// What to do with a sample whose tensors hold NaN or Inf.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinitePolicy {
    /// Refuse the sample with an error naming sample and layer.
    #[default]
    Error,
    /// Leave the sample out and count it.
    Skip,
    /// Keep it; the NaN/Inf counts are in its statistics columns.
    Record,
}

impl FromStr for FinitePolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "error" => Ok(FinitePolicy::Error),
            "skip" => Ok(FinitePolicy::Skip),
            "record" => Ok(FinitePolicy::Record),
            _ => Err(format!(
                "unknown finiteness policy {s:?}; expected error, skip or record"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_parses_i_of_n_and_splits_by_sample_id() {
        let s: InputShard = "1/3".parse().unwrap();
        assert_eq!((s.index, s.count), (1, 3));
        assert_eq!(s.to_string(), "1/3");
        let mine: Vec<u64> = (0..10).filter(|id| s.contains(*id)).collect();
        assert_eq!(mine, [1, 4, 7]);
        for bad in ["3/3", "1", "a/2", "0/0", "-1/2"] {
            let e = bad.parse::<InputShard>().unwrap_err();
            assert!(e.contains("expected I/N with 0 <= I < N"), "{bad}: {e}");
        }
    }
}
