//! Skeleton renderings split at their sentinels ([`Pattern`]) and filled with a conversation's
//! texts, and the renderings of a conversation's prefixes kept as cuts of the whole rendering
//! ([`PrefixPattern`]).
use std::ops::Range;

use super::{FIELD_BASE, SENTINEL};
use crate::conversation::Message;
use crate::mask::common_prefix_len;

/// The sentinel of a message's text (`reasoning`: its reasoning).
pub(super) fn sentinel(message: usize, reasoning: bool) -> String {
    let code = FIELD_BASE + 2 * message as u32 + reasoning as u32;
    [SENTINEL, char::from_u32(code).expect("below U+FFFFE")]
        .into_iter()
        .collect()
}

// A skeleton rendering split at its sentinels.
#[derive(Debug)]
pub(super) struct Pattern {
    pub(super) text: String,
    pub(super) parts: Vec<Part>,
}

#[derive(Debug)]
pub(super) enum Part {
    Text(Range<usize>),
    Field { message: usize, reasoning: bool },
}

impl Pattern {
    pub(super) fn parse(text: String, messages: usize) -> Option<Pattern> {
        let mut parts = vec![];
        let mut at = 0;
        while let Some(p) = text[at..].find(SENTINEL) {
            let start = at + p;
            if start > at {
                parts.push(Part::Text(at..start));
            }
            let after = start + SENTINEL.len_utf8();
            let c = text[after..].chars().next()?;
            let code = (c as u32).checked_sub(FIELD_BASE)? as usize;
            let (message, reasoning) = (code / 2, code % 2 == 1);
            if message >= messages {
                return None;
            }
            parts.push(Part::Field { message, reasoning });
            at = after + c.len_utf8();
        }
        if at < text.len() {
            parts.push(Part::Text(at..text.len()));
        }
        Some(Pattern { text, parts })
    }

    fn field(messages: &[Message], message: usize, reasoning: bool) -> &str {
        let m = &messages[message];
        if reasoning {
            m.reasoning.as_deref().unwrap_or_default()
        } else {
            &m.content
        }
    }

    pub(super) fn piece<'a>(&'a self, part: &Part, messages: &'a [Message]) -> &'a str {
        match part {
            Part::Text(r) => &self.text[r.clone()],
            Part::Field { message, reasoning } => Self::field(messages, *message, *reasoning),
        }
    }

    /// Bytes it holds.
    pub(super) fn size(&self) -> usize {
        self.text.len() + self.parts.len() * std::mem::size_of::<Part>()
    }

    pub(super) fn fill(&self, messages: &[Message]) -> String {
        let mut out = String::new();
        for part in &self.parts {
            out.push_str(self.piece(part, messages));
        }
        out
    }

    // The parts from `part` on, the first `skip` bytes of that part (a text) left out.
    fn tail_from(&self, part: usize, skip: usize) -> Pattern {
        let mut text = String::new();
        let mut parts = vec![];
        for (k, p) in self.parts.iter().enumerate().skip(part) {
            match p {
                Part::Text(r) => {
                    let piece = &self.text[r.clone()][if k == part { skip } else { 0 }..];
                    if !piece.is_empty() {
                        parts.push(Part::Text(text.len()..text.len() + piece.len()));
                        text.push_str(piece);
                    }
                }
                Part::Field { message, reasoning } => parts.push(Part::Field {
                    message: *message,
                    reasoning: *reasoning,
                }),
            }
        }
        Pattern { text, parts }
    }

    // Whether filling the pattern gives exactly `rendered`, without building it.
    pub(super) fn reproduces(&self, messages: &[Message], rendered: &str) -> bool {
        let mut rest = rendered.as_bytes();
        for part in &self.parts {
            let piece = match part {
                Part::Text(r) => &self.text[r.clone()],
                Part::Field { message, reasoning } => Self::field(messages, *message, *reasoning),
            };
            match rest.strip_prefix(piece.as_bytes()) {
                Some(r) => rest = r,
                None => return false,
            }
        }
        rest.is_empty()
    }
}

/// A prefix's rendering as the whole rendering's first `parts` parts and `bytes` more of the
/// next (a text), then a pattern of its own: usually just the generation prompt, so a skeleton
/// holds memory linear in its conversation's length, not its square.
#[derive(Debug)]
pub(super) struct PrefixPattern {
    pub(super) parts: usize,
    pub(super) bytes: usize,
    pub(super) tail: Pattern,
}

impl PrefixPattern {
    // `prefix` cut where it leaves the whole rendering `full`, part by part: a message's field
    // matches only the same field, so the cut holds for every conversation's texts.
    pub(super) fn cut(full: &Pattern, prefix: &Pattern) -> PrefixPattern {
        let mut k = 0;
        while let Some(p) = prefix.parts.get(k) {
            match (p, full.parts.get(k)) {
                (Part::Field { .. }, Some(f)) if same_field(p, f) => {}
                (Part::Text(a), Some(Part::Text(b))) => {
                    let (a, b) = (&prefix.text[a.clone()], &full.text[b.clone()]);
                    if a != b {
                        let bytes = common_prefix_len(a, b);
                        return PrefixPattern {
                            parts: k,
                            bytes,
                            tail: prefix.tail_from(k, bytes),
                        };
                    }
                }
                _ => break,
            }
            k += 1;
        }
        PrefixPattern {
            parts: k,
            bytes: 0,
            tail: prefix.tail_from(k, 0),
        }
    }

    // Bytes this holds beyond the whole rendering.
    pub(super) fn size(&self) -> usize {
        self.tail.size()
    }
}

fn same_field(a: &Part, b: &Part) -> bool {
    matches!((a, b), (
        Part::Field { message: m, reasoning: r },
        Part::Field { message: n, reasoning: q },
    ) if m == n && r == q)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conversation::Role;

    #[test]
    fn holds_only_the_tails_of_prefixes_that_leave_the_whole_rendering() {
        let messages = [
            Message::new(Role::User, "q"),
            Message::new(Role::Assistant, "a"),
        ];
        let full = Pattern::parse(
            format!("<u>{}</e><a>{}</e>", sentinel(0, false), sentinel(1, false)),
            2,
        )
        .unwrap();
        // A prompt with an empty think block the turn lacks: cut inside the text after `<a>`.
        let prompted =
            Pattern::parse(format!("<u>{}</e><a><t></t>", sentinel(0, false)), 2).unwrap();
        let cut = PrefixPattern::cut(&full, &prompted);
        assert_eq!(
            (cut.parts, cut.bytes, cut.tail.text.as_str()),
            (2, 7, "<t></t>")
        );
        // A history that renders the user's text elsewhere: cut before the field.
        let moved = Pattern::parse(
            format!("<s>{}</s><u>{}</e>", sentinel(0, false), sentinel(0, false)),
            2,
        )
        .unwrap();
        let cut = PrefixPattern::cut(&full, &moved);
        assert_eq!((cut.parts, cut.bytes), (0, 1));
        assert_eq!(cut.tail.fill(&messages), "s>q</s><u>q</e>");
    }

    #[test]
    fn sentinels_round_trip_through_patterns() {
        let messages = [
            Message::new(Role::User, "q"),
            Message {
                role: Role::Assistant,
                content: "a".into(),
                reasoning: Some("r".into()),
            },
        ];
        let text = format!(
            "<u>{}<a>{}|{}",
            sentinel(0, false),
            sentinel(1, true),
            sentinel(1, false)
        );
        let p = Pattern::parse(text, 2).unwrap();
        assert_eq!(p.fill(&messages), "<u>q<a>r|a");
        assert!(p.reproduces(&messages, "<u>q<a>r|a"));
        assert!(!p.reproduces(&messages, "<u>q<a>r|a!"));
        assert!(!p.reproduces(&messages, "<u>q<a>r|b"));
        // A sentinel naming a message the conversation lacks is not a pattern.
        assert!(Pattern::parse(sentinel(2, false), 2).is_none());
    }
}
