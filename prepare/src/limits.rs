//! What one record may cost: bounds on a conversation's text, its number of messages and each
//! rendering of the chat template, so that a hostile record or template is left out with a
//! named reason instead of exhausting the machine's memory or running without end.
//!
//! Why each bound, and what it bounds:
//! - **text** (`--max-record-bytes`): tokenizing a long run of text without spaces costs ~100
//!   bytes of memory per byte (one BPE symbol and one merge candidate per character), so a 20 MB
//!   "word" took 2 GB. The bound applies to the messages' text as read and to the template's
//!   output, which is the text the tokenizer sees.
//! - **messages** (`--max-turns`): the turn-by-turn mask renders the conversation's prefix at
//!   every assistant turn, so its time grows with the square of the turns.
//! - **fuel** (`--template-fuel`): one rendering of the template may take this many steps, with
//!   every 64 bytes it builds counted as one step (minijinja's fuel). Loops without end and
//!   strings doubled until memory runs out stop there. Values minijinja builds lazily or shares
//!   (a list added to itself, `[x] * n`, `[x, x]`) and Python's string methods are held to the
//!   same fuel by the template's guard ([`crate::guard`]), so that the memory one rendering can
//!   allocate stays within about twice 64 bytes per unit of fuel; the stack it can need is
//!   bounded by 64 bytes per unit of fuel ([`Limits::render_stack`]).
use crate::conversation::Conversation;
use crate::error::{PrepareError, RecordError, Result};

/// Default of [`Limits::max_record_bytes`]: eight times a 256k-token conversation's text.
pub const DEFAULT_MAX_RECORD_BYTES: usize = 8 << 20;
/// Default of [`Limits::max_turns`].
pub const DEFAULT_MAX_TURNS: usize = 2048;
/// Default of [`Limits::template_fuel`]: five times what the tested templates (Llama 3, Qwen3,
/// DeepSeek-V3, Mistral, ChatML) take for a conversation at the other two default bounds (8 MiB
/// of text in 2048 messages: 0.4 to 0.7 million), and at most 256 MiB allocated per rendering.
pub const DEFAULT_TEMPLATE_FUEL: u64 = 4_000_000;

/// Bounds on one record and on each rendering of its template.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most bytes of text: the messages' texts together, and the rendered conversation.
    pub max_record_bytes: usize,
    /// Most messages in one conversation.
    pub max_turns: usize,
    /// minijinja fuel of one rendering (instructions, plus one per 64 bytes built).
    pub template_fuel: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_record_bytes: DEFAULT_MAX_RECORD_BYTES,
            max_turns: DEFAULT_MAX_TURNS,
            template_fuel: DEFAULT_TEMPLATE_FUEL,
        }
    }
}

impl Limits {
    /// Refuses a bound of zero, which would leave every record out.
    pub fn validate(&self) -> Result<()> {
        let zero = |option, what: &str| {
            Err(PrepareError::Argument {
                option,
                message: format!("must be at least 1; 0 {what} leaves every record out"),
            })
        };
        if self.max_record_bytes == 0 {
            return zero("--max-record-bytes", "bytes");
        }
        if self.max_turns == 0 {
            return zero("--max-turns", "messages");
        }
        if self.template_fuel == 0 {
            return zero("--template-fuel", "fuel");
        }
        Ok(())
    }

    /// Stack each thread that renders templates needs. minijinja frees a nested list by
    /// recursion, and a rendering can nest lists about one level deep per 1.85 fuel
    /// (`[[[…]]]` in a loop); a level takes up to ~64 bytes of stack (2 million levels fit in
    /// 128 MiB, not in 64 MiB). So 64 bytes per unit of fuel, twice what the deepest nesting
    /// needs, and at least 8 MiB.
    pub fn render_stack(&self) -> usize {
        usize::try_from(self.template_fuel.saturating_mul(64))
            .unwrap_or(usize::MAX)
            .max(8 << 20)
    }

    /// Refuses a conversation with more messages or more text than the bounds allow.
    pub fn check(&self, conv: &Conversation) -> Result<(), RecordError> {
        let turns = conv.messages.len();
        if turns > self.max_turns {
            return Err(RecordError::TooManyTurns {
                turns,
                max: self.max_turns,
            });
        }
        let bytes = conv.text_bytes();
        if bytes > self.max_record_bytes {
            return Err(RecordError::TooLarge {
                what: "the messages' text",
                bytes: Some(bytes),
                max: self.max_record_bytes,
            });
        }
        Ok(())
    }
}

/// Why a rendering longer than `max` bytes is refused: the same whether the template rendered
/// it (stopped at the bound) or a skeleton was filled.
pub(crate) fn rendered_over(max: usize) -> RecordError {
    RecordError::TooLarge {
        what: "the rendered text",
        bytes: None,
        max,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conversation::{Message, Role};

    fn conv(texts: &[&str]) -> Conversation {
        Conversation {
            id: None,
            messages: texts.iter().map(|t| Message::new(Role::User, *t)).collect(),
        }
    }

    #[test]
    fn counts_every_message_text_and_reasoning_against_the_byte_bound() {
        let limits = Limits {
            max_record_bytes: 6,
            ..Default::default()
        };
        assert_eq!(limits.check(&conv(&["abc", "def"])), Ok(()));
        let mut c = conv(&["abc", "def"]);
        c.messages[1].reasoning = Some("r".into());
        assert_eq!(
            limits.check(&c).unwrap_err().to_string(),
            "the messages' text is over --max-record-bytes 6 (7 bytes)"
        );
    }

    #[test]
    fn refuses_more_messages_than_the_turn_bound() {
        let limits = Limits {
            max_turns: 2,
            ..Default::default()
        };
        assert_eq!(limits.check(&conv(&["a", "b"])), Ok(()));
        let e = limits.check(&conv(&["a", "b", "c"])).unwrap_err();
        assert_eq!(e.to_string(), "3 messages, more than --max-turns 2");
        assert_eq!(e.kind(), "over --max-turns");
    }

    #[test]
    fn refuses_zero_bounds_by_their_option() {
        type Zero = fn(&mut Limits);
        let zeros: [(&str, Zero); 3] = [
            ("--max-record-bytes", |l| l.max_record_bytes = 0),
            ("--max-turns", |l| l.max_turns = 0),
            ("--template-fuel", |l| l.template_fuel = 0),
        ];
        for (option, set) in zeros {
            let mut limits = Limits::default();
            set(&mut limits);
            let e = limits.validate().unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("{option}: must be at least 1")),
                "{e}"
            );
        }
        assert!(Limits::default().validate().is_ok());
    }
}
