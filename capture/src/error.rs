//! Everything that can go wrong while checking or loading a model, reading inputs or capturing.
use std::path::PathBuf;

/// Everything that can go wrong while checking or loading a model, reading inputs or capturing.
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
    #[error("unknown architecture {name:?}; supported: {supported}")]
    UnknownArchitecture {
        /// The `architectures[0]` entry of config.json (or its `model_type`).
        name: String,
        /// The implemented architectures, comma separated.
        supported: String,
    },
    /// A config feature this crate does not implement (e.g. an unknown RoPE type).
    #[error("unsupported model config: {0}")]
    Unsupported(String),
    /// The tensor-parallel size does not divide the model's head or channel counts.
    #[error(
        "tensor-parallel size {tp} is impossible for this model: {counts}; \
         the TP size must divide each of them (valid here: {valid})"
    )]
    TensorParallelSize {
        /// Requested TP size.
        tp: usize,
        /// The counts that must split evenly, e.g. `num_attention_heads = 9, num_key_value_heads = 3`.
        counts: String,
        /// The TP sizes that would work, comma separated.
        valid: String,
    },
    /// A safetensors file (or its index) is malformed.
    #[error("{path}: not a readable safetensors file: {message}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        message: String,
    },
    /// Checkpoint tensors do not fit what the model reads: every problem the check found.
    #[error("{}", checkpoint_message(dir, files, problems))]
    Checkpoint {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The safetensors files it holds, comma separated.
        files: String,
        /// Each tensor that is missing or does not fit, in the order the model reads them.
        problems: Vec<TensorProblem>,
    },
    /// A quantized weight cannot be read as its format requires (a tile cut by the TP split,
    /// a group size that does not divide, a `weight_shape` that disagrees with the config).
    #[error("quantized weight {name:?}: {message}")]
    Quantization {
        /// The linear module (`model.layers.3.mlp.experts.7.gate_proj`).
        name: String,
        /// What is wrong and what was expected.
        message: String,
    },
    /// The model and one batch's activations do not fit the GPUs' memory.
    #[error("not enough GPU memory: {0}")]
    Memory(String),
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
    /// An input larger than the job's `max_input_bytes`.
    #[error("{path}: the input holds {size} bytes or more; at most {limit} are taken")]
    InputTooLarge {
        /// The input as given.
        path: PathBuf,
        /// Its size, or the bytes downloaded when the download was stopped.
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// An input whose samples take more memory, once read, than the job's `max_input_bytes`.
    #[error(
        "{path}: the input's samples take more than {limit} bytes in memory once read \
         ({samples} samples of {tokens} tokens so far, {} bytes a token and {} a sample); \
         at most {limit} are taken",
        crate::input::TOKEN_BYTES,
        crate::input::SAMPLE_BYTES
    )]
    SamplesTooLarge {
        /// The input as given.
        path: PathBuf,
        /// Samples read when the bound was passed.
        samples: u64,
        /// Their tokens.
        tokens: u64,
        /// The limit.
        limit: u64,
    },
    /// A command-line or API option is invalid.
    #[error("invalid option: {0}")]
    Option(String),
    /// A device (or, on the CPU, the host) ran out of memory while the model ran: libtorch's
    /// allocator or the CUDA runtime refused an allocation. The plan before the load did not
    /// foresee it; the message names the flags that make each pass smaller.
    #[error("out of memory: {message}; {OUT_OF_MEMORY_HINT}")]
    OutOfMemory {
        /// What refused, in its own words (libtorch's first line, without its C++ backtrace).
        message: String,
    },
    /// A libtorch call failed.
    #[error("libtorch: {0}")]
    Torch(tch::TchError),
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
    /// An earlier rank failure left the engine unable to run jobs; start a new one.
    #[error("the capture engine is broken by an earlier failure ({0}); start a new engine")]
    EngineBroken(String),
    /// A worker thread stopped unexpectedly.
    #[error("{0}")]
    Pipeline(String),
}

/// What to lower after an out-of-memory error, for each command that runs the model.
pub const OUT_OF_MEMORY_HINT: &str = "lower the tokens per batch (--max-tokens-per-batch; \
    `hslake debug prefill`: --batch or --seq) or per streamed pass (--pass-tokens, or a \
    smaller --gpu-memory, from which the plan sizes the passes), or keep the weights off the \
    GPU with --placement stream";

impl From<tch::TchError> for CaptureError {
    /// libtorch's out-of-memory errors become [`CaptureError::OutOfMemory`], the rest
    /// [`CaptureError::Torch`].
    fn from(e: tch::TchError) -> Self {
        match &e {
            tch::TchError::Torch(text) if is_out_of_memory(text) => CaptureError::OutOfMemory {
                message: first_line(text),
            },
            _ => CaptureError::Torch(e),
        }
    }
}

/// libtorch's words for a refused allocation: the CUDA caching allocator's "CUDA out of
/// memory", a CUDA call's "out of memory", cuBLAS's workspace, the CPU allocator's "not enough
/// memory" (older releases: "can't allocate memory").
fn is_out_of_memory(text: &str) -> bool {
    let text = text.to_ascii_lowercase();
    [
        "out of memory",
        "not enough memory",
        "can't allocate memory",
        "cublas_status_alloc_failed",
    ]
    .iter()
    .any(|words| text.contains(words))
}

/// The message without the C++ backtrace libtorch appends after its first line, nor its last
/// full stop (the hint follows).
fn first_line(text: &str) -> String {
    let line = text.lines().next().unwrap_or_default().trim();
    line.strip_suffix('.').unwrap_or(line).to_string()
}

/// One way a checkpoint tensor fails what the model reads.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum TensorProblem {
    /// The checkpoint has no tensor of this name.
    Missing {
        /// The tensor name.
        name: String,
    },
    /// The tensor's shape is not the one the config implies.
    WrongShape {
        /// The tensor name.
        name: String,
        /// Shape implied by config.json.
        expected: Vec<usize>,
        /// Shape in the file.
        got: Vec<usize>,
    },
    /// The tensor's dtype is not one the model can load.
    WrongDtype {
        /// The tensor name.
        name: String,
        /// The dtype in the file.
        dtype: String,
        /// The dtypes this tensor may have.
        expected: String,
    },
    /// A dimension that tensor parallelism splits is not a multiple of the TP size.
    Unsplittable {
        /// The tensor name.
        name: String,
        /// The dimension split across ranks.
        dim: usize,
        /// Its size.
        size: usize,
        /// The number of ranks.
        parts: usize,
    },
}

impl std::fmt::Display for TensorProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TensorProblem::Missing { name } => write!(f, "missing tensor {name:?}"),
            TensorProblem::WrongShape {
                name,
                expected,
                got,
            } => write!(
                f,
                "tensor {name:?} has shape {got:?}, expected {expected:?} from config.json"
            ),
            TensorProblem::WrongDtype {
                name,
                dtype,
                expected,
            } => write!(f, "tensor {name:?} has dtype {dtype}, expected {expected}"),
            TensorProblem::Unsplittable {
                name,
                dim,
                size,
                parts,
            } => write!(
                f,
                "tensor {name:?}: dimension {dim} of size {size} does not split into {parts} equal parts"
            ),
        }
    }
}

/// One problem on one line; several as an indented list under a count.
fn checkpoint_message(dir: &std::path::Path, files: &str, problems: &[TensorProblem]) -> String {
    let head = format!("checkpoint {} ({files})", dir.display());
    match problems {
        [one] => format!("{head}: {one}"),
        many => {
            let list: Vec<String> = many.iter().map(|p| format!("\n  {p}")).collect();
            format!(
                "{head} does not fit config.json: {} tensor problems:{}",
                many.len(),
                list.concat()
            )
        }
    }
}

/// Result alias for this crate.
pub type Result<T, E = CaptureError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    fn checkpoint(problems: Vec<TensorProblem>) -> String {
        CaptureError::Checkpoint {
            dir: "/m".into(),
            files: "model.safetensors".into(),
            problems,
        }
        .to_string()
    }

    #[test]
    fn libtorchs_out_of_memory_texts_are_the_named_error_without_the_backtrace() {
        let torch = |text: &str| CaptureError::from(tch::TchError::Torch(text.into()));
        let cuda = "CUDA out of memory. Tried to allocate 7.00 GiB. GPU 0 has a total capacity \
                    of 79.19 GiB of which 3.06 GiB is free.\nException raised from malloc at \
                    CUDACachingAllocator.cpp:1338 (most recent call first):\nframe #0: c10::Error";
        assert_eq!(
            torch(cuda).to_string(),
            "out of memory: CUDA out of memory. Tried to allocate 7.00 GiB. GPU 0 has a total \
             capacity of 79.19 GiB of which 3.06 GiB is free; lower the tokens per batch \
             (--max-tokens-per-batch; `hslake debug prefill`: --batch or --seq) or per streamed \
             pass (--pass-tokens, or a smaller --gpu-memory, from which the plan sizes the \
             passes), or keep the weights off the GPU with --placement stream"
        );
        for text in [
            "DefaultCPUAllocator: not enough memory: you tried to allocate 8 bytes.",
            "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory",
            "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
            "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        ] {
            assert!(
                matches!(torch(text), CaptureError::OutOfMemory { .. }),
                "{text}"
            );
        }
        let shape = torch("shape '[2, 3]' is invalid for input of size 5");
        assert!(matches!(shape, CaptureError::Torch(_)), "{shape}");
    }

    #[test]
    fn one_checkpoint_problem_is_one_line_and_several_are_listed_under_a_count() {
        let missing = TensorProblem::Missing { name: "a".into() };
        let shape = TensorProblem::WrongShape {
            name: "b".into(),
            expected: vec![2, 3],
            got: vec![2],
        };
        assert_eq!(
            checkpoint(vec![missing.clone()]),
            "checkpoint /m (model.safetensors): missing tensor \"a\""
        );
        assert_eq!(
            checkpoint(vec![missing, shape]),
            "checkpoint /m (model.safetensors) does not fit config.json: 2 tensor problems:\n  \
             missing tensor \"a\"\n  tensor \"b\" has shape [2], expected [2, 3] from config.json"
        );
    }
}
