//! Chat conversations to tokenized samples with assistant-only loss masks, rendered by the
//! model's own chat template and tokenized by its `tokenizer.json` — equal to transformers'
//! `apply_chat_template(..., tokenize=True)` — plus regeneration of the answers by the target
//! model through an OpenAI-compatible server.
//!
//! ```no_run
//! use std::path::Path;
//! use hslake_prepare::{prepare_file, ChatTokenizer, Limits, LossOn, PrepareOptions};
//!
//! let tok = ChatTokenizer::from_model_dir(Path::new("SmolLM2-135M-Instruct"), LossOn::Assistant, &Default::default(), Limits::default())?;
//! let (samples, summary) = prepare_file(Path::new("chats.jsonl"), &tok, &PrepareOptions::default())?;
//! println!("{} samples, {:.1} % of tokens with loss ({})", samples.len(), 100.0 * summary.loss_fraction(), summary.mask_method);
//! # Ok::<(), hslake_prepare::PrepareError>(())
//! ```
#![deny(missing_docs)]

pub mod bench;
pub mod chat_tokenizer;
pub mod conversation;
pub mod encode;
pub mod error;
mod guard;
pub mod limits;
pub mod mask;
pub mod output;
pub mod pipeline;
pub mod regenerate;
pub mod skeleton;
pub mod source;
mod syntax;
pub mod template;
mod template_functions;

pub use chat_tokenizer::{ChatTokenizer, LossOn, TemplateKwargs, Tokenized};
pub use conversation::{parse_conversation, Conversation, Message, Role};
pub use encode::EncodePath;
pub use error::{PrepareError, RecordError, Result};
pub use hslake_schemas::Overlong;
pub use limits::Limits;
pub use mask::MaskMethod;
pub use output::{Sample, SampleWriter};
pub use pipeline::{prepare, prepare_file, PrepareOptions, Summary};
pub use regenerate::{
    regenerate, regenerated_records, ProgressFile, RegenCounters, RegenOptions, RegenReport,
};
pub use source::{
    fetch_input, local_input_path, open_records, read_conversations, ConversationRecord,
    Conversations, FileFormat, RawRecord,
};

/// How this crate was compiled (`hslake --version` lists it with the other crates of the read
/// and write path).
pub const BUILD: hslake_schemas::CrateBuild = hslake_schemas::crate_build!();
