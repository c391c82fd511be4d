use thiserror::Error;

/// Everything that can be wrong with a schema or a sample, each naming the thing.
#[derive(Debug, Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum SchemaError {
    /// A dtype name that hslake does not know.
    #[error("unknown dtype {name:?}; expected one of bf16, f16, f32, fp8_e4m3")]
    UnknownDType {
        /// The name that was given.
        name: String,
    },
    /// A capture point that cannot be parsed.
    #[error("unknown capture point {name:?}; expected layer_<i> (0-based decoder layer output) or final_norm")]
    UnknownCapturePoint {
        /// The name that was given.
        name: String,
    },
    /// A schema that contradicts itself (e.g. a layer beyond the model's depth).
    #[error("invalid dataset schema: {0}")]
    InvalidSchema(String),
    /// A tensor whose shape is not `[seq_len, hidden]`.
    #[error("{point}: expected shape {expected:?}, got {got:?}{hint}")]
    Shape {
        /// The capture point, e.g. `layer 30`.
        point: String,
        /// The shape the schema requires for this sample.
        expected: Vec<usize>,
        /// The shape that was given.
        got: Vec<usize>,
        /// An explanation of the likely cause, or empty.
        hint: String,
    },
    /// A tensor of another dtype than the schema's.
    #[error("{point}: expected dtype {expected}, got {got}")]
    DType {
        /// The capture point.
        point: String,
        /// The schema's dtype.
        expected: super::DType,
        /// The tensor's dtype.
        got: super::DType,
    },
    /// A field whose length disagrees with the sample's sequence length.
    #[error("sample {sample_id}: {field} has length {got}, expected {expected} (the length of input_ids)")]
    Length {
        /// The sample.
        sample_id: u64,
        /// The field, e.g. `loss_mask`.
        field: String,
        /// The expected length.
        expected: usize,
        /// The length found.
        got: usize,
    },
    /// A sample with the wrong number of tensors.
    #[error("sample {sample_id}: expected {expected} tensors ({names}), got {got}")]
    TensorCount {
        /// The sample.
        sample_id: u64,
        /// Number of capture points in the schema.
        expected: usize,
        /// Their names.
        names: String,
        /// Number of tensors given.
        got: usize,
    },
    /// A tensor whose byte buffer does not hold shape × element size bytes.
    #[error("{point}: data has {got} bytes, expected {expected} for shape {shape:?} of {dtype}")]
    ByteLength {
        /// The capture point.
        point: String,
        /// Bytes required.
        expected: usize,
        /// Bytes present.
        got: usize,
        /// The tensor's shape.
        shape: Vec<usize>,
        /// The tensor's dtype.
        dtype: super::DType,
    },
    /// fp8 tensors need one f32 scale per token; other dtypes take none.
    #[error("{point}: {reason}")]
    Scales {
        /// The capture point.
        point: String,
        /// What is wrong.
        reason: ScaleReason,
    },
    /// NaN or Inf values under the `error` finiteness policy.
    #[error(
        "sample {sample_id} {point}: {nan} NaN and {inf} Inf values (finiteness policy is `error`)"
    )]
    NonFinite {
        /// The sample.
        sample_id: u64,
        /// The capture point.
        point: String,
        /// NaN count.
        nan: u64,
        /// Inf count.
        inf: u64,
    },
    /// An empty sample.
    #[error("sample {sample_id}: empty sequence (input_ids has no tokens)")]
    Empty {
        /// The sample.
        sample_id: u64,
    },
    /// A token id outside the vocabulary.
    #[error("sample {sample_id}: token id {token} at position {position} is outside the vocabulary of {vocab_size}")]
    TokenOutOfRange {
        /// The sample.
        sample_id: u64,
        /// The offending id.
        token: i64,
        /// Its position.
        position: usize,
        /// The schema's vocabulary size.
        vocab_size: usize,
    },
    /// Arrow field metadata that cannot be read back into a schema.
    #[error("arrow schema is not an hslake dataset schema: {0}")]
    Arrow(String),
    /// A duration, byte size or count that does not parse or lies outside its named range.
    #[error("{name} {value:?}: {problem}; expected {expected}")]
    Quantity {
        /// The flag, field or variable, e.g. `--commit-interval`.
        name: String,
        /// The value as given.
        value: String,
        /// What is wrong: not a number, an unknown unit, out of range.
        problem: String,
        /// The range and spellings taken.
        expected: String,
    },
}

/// Why a tensor's scales are wrong.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum ScaleReason {
    /// fp8 without scales.
    #[error("fp8_e4m3 needs one f32 scale per token, got none")]
    Missing,
    /// Scales on a dtype that takes none.
    #[error("only fp8_e4m3 tensors carry scales")]
    Unexpected,
    /// Wrong number of scales.
    #[error("expected {expected} scales (one per token), got {got}")]
    Count {
        /// Tokens.
        expected: usize,
        /// Scales.
        got: usize,
    },
}
