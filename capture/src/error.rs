use std::path::PathBuf;

/// Everything that can go wrong while loading a model, reading inputs or capturing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CaptureError {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// `config.json` is not valid JSON or misses a required field.
    #[error("{path}: not a usable Hugging Face config: {message}")]
    Config {
        /// The config file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The checkpoint's architecture is not one this crate implements.
    #[error(
        "unknown architecture {name:?}; supported: LlamaForCausalLM, MistralForCausalLM, \
         Qwen2ForCausalLM, Qwen3ForCausalLM"
    )]
    UnknownArchitecture {
        /// The `architectures[0]` entry of config.json.
        name: String,
    },
    /// A config feature this crate does not implement (e.g. an unknown RoPE type).
    #[error("unsupported model config: {0}")]
    Unsupported(String),
    /// The tensor-parallel size does not divide the model's head or channel counts.
    #[error(
        "tensor-parallel size {tp} is impossible for this model: num_attention_heads = {heads}, \
         num_key_value_heads = {kv_heads}, intermediate_size = {intermediate}; \
         the TP size must divide all three (valid here: {valid})"
    )]
    TensorParallelSize {
        /// Requested TP size.
        tp: usize,
        /// Query heads.
        heads: usize,
        /// Key/value heads.
        kv_heads: usize,
        /// MLP width.
        intermediate: usize,
        /// The TP sizes that would work, comma separated.
        valid: String,
    },
    /// A safetensors file is malformed.
    #[error("{path}: not a readable safetensors file: {message}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        message: String,
    },
    /// The checkpoint has no tensor of this name.
    #[error("missing tensor {name:?} in the checkpoint at {dir} (looked in: {files})")]
    MissingTensor {
        /// The tensor name.
        name: String,
        /// The checkpoint directory.
        dir: PathBuf,
        /// The safetensors files searched.
        files: String,
    },
    /// A checkpoint tensor has a shape the config does not imply.
    #[error("tensor {name:?} has shape {got:?}, expected {expected:?} from config.json")]
    WrongShape {
        /// The tensor name.
        name: String,
        /// Shape implied by the config.
        expected: Vec<usize>,
        /// Shape in the file.
        got: Vec<usize>,
    },
    /// A checkpoint tensor has a dtype this crate cannot load.
    #[error("tensor {name:?} has dtype {dtype}, expected one of BF16, F16, F32")]
    WrongDtype {
        /// The tensor name.
        name: String,
        /// The dtype in the file.
        dtype: String,
    },
    /// One input record is unusable.
    #[error("{path}: {location}: {message}")]
    Input {
        /// The input file.
        path: PathBuf,
        /// "line N" (JSONL, 1-based) or "row N" (Parquet, 0-based).
        location: String,
        /// What is wrong with it.
        message: String,
    },
    /// A command-line or API option is invalid.
    #[error("invalid option: {0}")]
    Option(String),
    /// A libtorch call failed.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    /// A collective between tensor-parallel ranks failed.
    #[error("communicator (rank {rank}): {message}")]
    Comm {
        /// The rank that saw the failure.
        rank: usize,
        /// What went wrong.
        message: String,
    },
    /// A CUDA runtime call failed.
    #[error("CUDA: {0}")]
    Cuda(String),
    /// The dataset store refused an operation.
    #[error(transparent)]
    Store(#[from] hslake_store::StoreError),
    /// The dataset schema could not be built.
    #[error(transparent)]
    Schema(#[from] hslake_schemas::SchemaError),
    /// A worker thread stopped unexpectedly.
    #[error("{0}")]
    Pipeline(String),
}

/// Result alias for this crate.
pub type Result<T, E = CaptureError> = std::result::Result<T, E>;
