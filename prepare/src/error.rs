//! The errors of preparing conversations: per-record reasons a record is dropped, and what stops
//! a run.
use std::path::PathBuf;

use thiserror::Error;

/// Why one conversation cannot become a sample. The run counts these by kind and names each
/// record's line (JSONL) or row (Parquet); only `--strict` makes one fatal.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordError {
    /// The line is not UTF-8.
    #[error("invalid UTF-8 at byte {offset}")]
    InvalidUtf8 {
        /// Offset of the first bad byte in the line.
        offset: usize,
    },
    /// The line is not JSON, or the record has no conversation shape.
    #[error("{0}")]
    Malformed(String),
    /// The conversation has no messages.
    #[error("empty conversation: no messages")]
    Empty,
    /// A message whose role is none of system/user/assistant (or their ShareGPT names).
    #[error("message {index}: unknown role {role:?}; expected system, user or assistant (ShareGPT: system, human, gpt)")]
    UnknownRole {
        /// 0-based message index.
        index: usize,
        /// The role found.
        role: String,
    },
    /// Nothing to train on.
    #[error("no assistant turn: nothing to put loss on")]
    NoAssistant,
    /// The chat template failed (e.g. `raise_exception` on roles that do not alternate).
    #[error("chat template error: {0}")]
    Template(String),
    /// The template renders earlier turns differently once later turns follow, so turn-by-turn
    /// rendering cannot tell which text the assistant wrote.
    #[error("chat template is not prefix-stable at message {index}: the first {index} messages do not render as a prefix of the whole conversation, so the assistant's text cannot be located; add {{% generation %}} markers to the template")]
    NotPrefixStable {
        /// 0-based index of the assistant message.
        index: usize,
    },
    /// The assistant's turn has no end-of-turn token in the rendered text.
    #[error("message {index}: no end-of-turn token ({eot}) after the assistant's text")]
    NoEndOfTurn {
        /// 0-based index of the assistant message.
        index: usize,
        /// The end-of-turn strings looked for.
        eot: String,
    },
    /// The tokenizer failed on the rendered text.
    #[error("tokenizer error: {0}")]
    Tokenize(String),
    /// Longer than `--max-seq-len` with `--overlong skip`.
    #[error("{len} tokens, longer than --max-seq-len {max}")]
    TooLong {
        /// Tokens after tokenization.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Two records with the same sample id.
    #[error("duplicate id {id} (first at {first})")]
    DuplicateId {
        /// The id.
        id: u64,
        /// Where it was first seen.
        first: String,
    },
    /// The regeneration server did not answer this conversation.
    #[error("regeneration failed: {0}")]
    Regeneration(String),
    /// More text than `--max-record-bytes`, in the record's messages or as the template renders
    /// them: tokenizing a long run of text without spaces takes ~100 bytes of memory per byte.
    #[error("{what} is over --max-record-bytes {max}{}", bytes.map(|b| format!(" ({b} bytes)")).unwrap_or_default())]
    TooLarge {
        /// `the messages' text` or `the rendered text`.
        what: &'static str,
        /// Its size, where known (a rendering is stopped at the bound).
        bytes: Option<usize>,
        /// The bound.
        max: usize,
    },
    /// More messages than `--max-turns`: the turn-by-turn mask renders one prefix per assistant
    /// turn, so its cost grows with the square of the turns.
    #[error("{turns} messages, more than --max-turns {max}")]
    TooManyTurns {
        /// Messages in the conversation.
        turns: usize,
        /// The bound.
        max: usize,
    },
    /// One rendering of the chat template used up its budget of steps and bytes.
    #[error("chat template ran out of fuel: one rendering may take {fuel} (one per instruction, one per 64 bytes it builds); loops or string growth past that are refused (--template-fuel)")]
    OutOfFuel {
        /// The budget of one rendering.
        fuel: u64,
    },
}

impl RecordError {
    /// A short stable name of the kind, for the summary's counts.
    pub fn kind(&self) -> &'static str {
        match self {
            RecordError::InvalidUtf8 { .. } => "invalid UTF-8",
            RecordError::Malformed(_) => "malformed record",
            RecordError::Empty => "empty conversation",
            RecordError::UnknownRole { .. } => "unknown role",
            RecordError::NoAssistant => "no assistant turn",
            RecordError::Template(_) => "template error",
            RecordError::NotPrefixStable { .. } => "template not prefix-stable",
            RecordError::NoEndOfTurn { .. } => "no end-of-turn token",
            RecordError::Tokenize(_) => "tokenizer error",
            RecordError::TooLong { .. } => "longer than --max-seq-len",
            RecordError::DuplicateId { .. } => "duplicate id",
            RecordError::Regeneration(_) => "regeneration failed",
            RecordError::TooLarge { .. } => "over --max-record-bytes",
            RecordError::TooManyTurns { .. } => "over --max-turns",
            RecordError::OutOfFuel { .. } => "template out of fuel",
        }
    }
}

/// Everything that stops a prepare run; each names the file, model or option it concerns.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum PrepareError {
    /// An option out of its range, or options that contradict each other; checked before any
    /// work starts.
    #[error("{option}: {message}")]
    Argument {
        /// The option, e.g. `--max-seq-len`.
        option: &'static str,
        /// What is wrong and what was expected.
        message: String,
    },
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The model directory lacks what preparing needs, or holds something unusable.
    #[error("{path}: {message}")]
    Model {
        /// The file or directory.
        path: PathBuf,
        /// What is wrong and what was expected.
        message: String,
    },
    /// The chat template does not compile.
    #[error("{path}: chat template does not compile: {message}")]
    TemplateSyntax {
        /// Where the template came from.
        path: PathBuf,
        /// The compiler's message.
        message: String,
    },
    /// The input as a whole is unreadable (not a record: e.g. a Parquet file that is not one).
    #[error("{path}: {message}")]
    Input {
        /// The input.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A bad record under `--strict`.
    #[error("{path}: {location}: {source}")]
    Record {
        /// The input.
        path: PathBuf,
        /// `line N` (JSONL, 1-based) or `row N` (Parquet, 0-based).
        location: String,
        /// Why it was refused.
        source: RecordError,
    },
    /// Writing the output failed.
    #[error("{path}: cannot write output: {message}")]
    Output {
        /// The output file.
        path: PathBuf,
        /// What failed.
        message: String,
    },
    /// The regeneration endpoint is unusable as a whole (bad URL, no model list).
    #[error("{endpoint}: {message}")]
    Endpoint {
        /// The endpoint URL.
        endpoint: String,
        /// What failed.
        message: String,
    },
    /// An input URL that the object store cannot read.
    #[error("{url}: {message}")]
    Url {
        /// The URL.
        url: String,
        /// What failed.
        message: String,
    },
}

/// Results of this crate.
pub type Result<T, E = PrepareError> = std::result::Result<T, E>;

/// `PrepareError::Io` for a path.
pub(crate) fn io_err(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> PrepareError + '_ {
    move |source| PrepareError::Io {
        path: path.to_path_buf(),
        source,
    }
}
