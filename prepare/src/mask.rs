//! Which characters the assistant wrote, and which tokens that makes.
//!
//! Two methods, chosen per template ([`MaskMethod`]):
//! - **generation markers**: the template's `{% generation %}` blocks, as transformers'
//!   `return_assistant_tokens_mask=True` uses them;
//! - **turn by turn**, for templates without markers (the method of the EAGLE-3 trainers'
//!   preprocessors): the assistant's text at message `i` starts where the rendering of the first
//!   `i` messages with the generation prompt ends, and runs through its first end-of-turn token.
//!   Some templates render the generation prompt differently from an assistant turn that is
//!   followed by more turns (Qwen3 with `enable_thinking=false` prompts with an empty
//!   `<think></think>` block that earlier turns lack); then the text starts after the part of the
//!   prompt the whole rendering shares. The first `i` messages themselves must render as a prefix
//!   of the whole conversation, or the template rewrites earlier turns and the record is refused
//!   ([`RecordError::NotPrefixStable`]) rather than masked wrongly.
use crate::conversation::Role;
use crate::error::RecordError;

/// How a template's assistant text is found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaskMethod {
    /// From `{% generation %}` blocks.
    GenerationMarkers,
    /// By rendering the conversation turn by turn.
    TurnByTurn,
}

impl std::fmt::Display for MaskMethod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            MaskMethod::GenerationMarkers => "{% generation %} markers",
            MaskMethod::TurnByTurn => "turn-by-turn rendering",
        })
    }
}

/// A rendering of a conversation's first messages: the first `shared` bytes of the rendering of
/// the whole conversation, then `tail`. Skeletons know how much of each prefix's rendering the
/// whole rendering repeats, so a prefix costs only its tail (usually the generation prompt), and
/// the mask of a conversation stays linear in its length however many turns it has.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixText {
    /// Bytes shared with the whole conversation's rendering, from its start.
    pub shared: usize,
    /// What follows them.
    pub tail: String,
}

impl From<String> for PrefixText {
    fn from(tail: String) -> Self {
        PrefixText { shared: 0, tail }
    }
}

impl From<&str> for PrefixText {
    fn from(tail: &str) -> Self {
        tail.to_string().into()
    }
}

impl PrefixText {
    /// Length of the rendering in bytes.
    pub fn len(&self) -> usize {
        self.shared + self.tail.len()
    }

    /// Whether the rendering is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    // Whether the rendering is a prefix of `full`, whose first `shared` bytes it repeats.
    fn is_prefix_of(&self, full: &str) -> bool {
        full.get(self.shared..)
            .is_some_and(|rest| rest.starts_with(&self.tail))
    }
}

/// Byte spans `[start, end)` of the assistant's turns in `full`, by the turn-by-turn method.
/// `render_prefix(i, with_prompt)` renders the first `i` messages, with or without the
/// generation prompt. Apart from those renderings, the work is linear in `full`'s length.
pub fn turn_spans(
    full: &str,
    roles: &[Role],
    end_of_turn: &[String],
    mut render_prefix: impl FnMut(usize, bool) -> Result<PrefixText, RecordError>,
) -> Result<Vec<(usize, usize)>, RecordError> {
    let mut spans = vec![];
    let mut ends = EndsOfTurn::new(end_of_turn);
    for (index, role) in roles.iter().enumerate() {
        if *role != Role::Assistant {
            continue;
        }
        let prompted = render_prefix(index, true)?;
        let start = if prompted.is_prefix_of(full) {
            prompted.len()
        } else {
            let history = render_prefix(index, false)?;
            let shared = if history.is_prefix_of(full) {
                prompt_shared(full, history.len(), &prompted)
            } else {
                None
            };
            match shared {
                Some(n) if n > 0 => history.len() + n,
                _ => return Err(RecordError::NotPrefixStable { index }),
            }
        };
        let end = ends
            .first_end(full, start)
            .ok_or_else(|| RecordError::NoEndOfTurn {
                index,
                eot: end_of_turn.join(" or "),
            })?;
        spans.push((start, end));
    }
    Ok(spans)
}

// Where the history (`full[..history]`, the first messages without the prompt) is followed by the
// generation prompt in `prompted`: the bytes of that prompt the whole rendering shares, or `None`
// when `prompted` does not start with the history.
fn prompt_shared(full: &str, history: usize, prompted: &PrefixText) -> Option<usize> {
    let (shared, tail) = (prompted.shared, prompted.tail.as_str());
    if history <= shared {
        // The prompt starts inside the shared bytes, which match the whole rendering.
        Some(shared - history + common_prefix_len(tail, full.get(shared..)?))
    } else {
        let prompt = tail.strip_prefix(full.get(shared..history)?)?;
        Some(common_prefix_len(prompt, full.get(history..)?))
    }
}

// The end of the first end-of-turn string at or after a position. Each string's next match is
// kept, so that for turns asked in order the text is searched once per string, not once per turn
// (a string that never occurs, such as Llama 3's `<|end_of_text|>` in a chat, would otherwise be
// searched for to the end of the text at every turn).
struct EndsOfTurn<'a> {
    strings: &'a [String],
    // Per string: the position searched from, and the first match at or after it.
    next: Vec<Option<(usize, Option<usize>)>>,
}

impl<'a> EndsOfTurn<'a> {
    fn new(strings: &'a [String]) -> Self {
        EndsOfTurn {
            strings,
            next: vec![None; strings.len()],
        }
    }

    fn first_end(&mut self, full: &str, from: usize) -> Option<usize> {
        let mut first: Option<usize> = None;
        for (eot, next) in self.strings.iter().zip(&mut self.next) {
            let found = match *next {
                Some((searched, found)) if searched <= from && found.is_none_or(|p| p >= from) => {
                    found
                }
                _ => {
                    let found = full.get(from..)?.find(eot.as_str()).map(|p| p + from);
                    *next = Some((from, found));
                    found
                }
            };
            if let Some(p) = found {
                first = Some(first.map_or(p + eot.len(), |e| e.min(p + eot.len())));
            }
        }
        first
    }
}

/// Bytes of the longest common prefix, ending on a character boundary.
pub(crate) fn common_prefix_len(a: &str, b: &str) -> usize {
    a.char_indices()
        .zip(b.chars())
        .find(|((_, x), y)| x != y)
        .map_or(a.len().min(b.len()), |((i, _), _)| i)
}

/// 1 on every token whose `[start, end)` offsets overlap a span — transformers' rule, so a token
/// straddling a span edge counts as the assistant's. Offsets and spans in bytes on character
/// boundaries overlap exactly when their character ranges do.
pub fn token_mask(offsets: &[(usize, usize)], spans: &[(usize, usize)]) -> Vec<u8> {
    let mut mask = vec![0u8; offsets.len()];
    let mut span = 0;
    for (i, &(start, end)) in offsets.iter().enumerate() {
        while span < spans.len() && start >= spans[span].1 {
            span += 1;
        }
        if span == spans.len() {
            break;
        }
        if end > spans[span].0 {
            mask[i] = 1;
        }
    }
    mask
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: [&str; 4] = [
        "<s>",
        "<s><u>q1</e>\n<a>",
        "<s><u>q1</e>\n<a>a1</e>\n<u>q2</e>\n<a>",
        "<s><u>q1</e>\n<a>a1</e>\n<u>q2</e>\n<a>a2</e>\n",
    ];

    fn eot() -> Vec<String> {
        vec!["</e>".to_string()]
    }

    #[test]
    fn assistant_spans_run_from_the_prompt_through_the_end_of_turn_token() {
        let roles = [Role::User, Role::Assistant, Role::User, Role::Assistant];
        let full = CHATML[3];
        let spans = turn_spans(full, &roles, &eot(), |i, prompt| {
            assert!(prompt, "the prompted prefix is a prefix here");
            Ok(CHATML[i / 2 + 1].into())
        })
        .unwrap();
        let texts: Vec<&str> = spans.iter().map(|&(s, e)| &full[s..e]).collect();
        assert_eq!(texts, ["a1</e>", "a2</e>"]);
    }

    #[test]
    fn starts_after_the_shared_part_of_a_prompt_earlier_turns_lack() {
        // Qwen3 with enable_thinking=false: the prompt ends in an empty think block, the
        // rendered turn has none.
        let roles = [Role::User, Role::Assistant];
        let full = "<u>q</e><a>x</e>";
        let spans = turn_spans(full, &roles, &eot(), |_, prompt| {
            Ok(if prompt {
                "<u>q</e><a><t></t>"
            } else {
                "<u>q</e>"
            }
            .into())
        })
        .unwrap();
        assert_eq!(&full[spans[0].0..spans[0].1], "x</e>");
    }

    #[test]
    fn refuses_templates_that_rewrite_earlier_turns() {
        let roles = [Role::User, Role::Assistant];
        // The history itself renders differently (e.g. a system prompt moved to the last turn).
        let e = turn_spans("<s><u>q</e><a>x</e>", &roles, &eot(), |_, prompt| {
            Ok(if prompt {
                "<u>s q</e><a>"
            } else {
                "<u>s q</e>"
            }
            .into())
        })
        .unwrap_err();
        assert_eq!(e, RecordError::NotPrefixStable { index: 1 });
        // Or the prompt shares nothing with the turn.
        let e = turn_spans("<u>q</e>[x</e>", &roles, &eot(), |_, prompt| {
            Ok(if prompt { "<u>q</e><a>" } else { "<u>q</e>" }.into())
        })
        .unwrap_err();
        assert_eq!(e, RecordError::NotPrefixStable { index: 1 });
    }

    #[test]
    fn prefixes_sharing_the_whole_rendering_give_the_spans_of_rendered_ones() {
        let roles = [Role::User, Role::Assistant, Role::User, Role::Assistant];
        let full = CHATML[3];
        // Each prompted prefix as the whole rendering's bytes up to its prompt, then the prompt.
        let shared = turn_spans(full, &roles, &eot(), |i, _| {
            let text = CHATML[i / 2 + 1];
            Ok(PrefixText {
                shared: text.len() - 3,
                tail: "<a>".into(),
            })
        })
        .unwrap();
        let rendered = turn_spans(full, &roles, &eot(), |i, _| Ok(CHATML[i / 2 + 1].into()));
        assert_eq!(shared, rendered.unwrap());
        // A prompt the turn lacks (Qwen3's empty think block), after a history the whole shares:
        // the history may end inside the shared bytes or inside the tail.
        let (roles, full) = ([Role::User, Role::Assistant], "<u>q</e><a>x</e>");
        for (shared, tail) in [
            (11, "<t></t>"),
            (3, "q</e><a><t></t>"),
            (0, "<u>q</e><a><t></t>"),
        ] {
            let spans = turn_spans(full, &roles, &eot(), |_, prompt| {
                Ok(if prompt {
                    PrefixText {
                        shared,
                        tail: tail.into(),
                    }
                } else {
                    PrefixText {
                        shared: 8,
                        tail: String::new(),
                    }
                })
            })
            .unwrap();
            assert_eq!(&full[spans[0].0..spans[0].1], "x</e>", "{shared} {tail}");
        }
    }

    #[test]
    fn searches_for_each_end_of_turn_string_once_for_turns_in_order() {
        let strings = vec!["</e>".to_string(), "<never>".to_string()];
        let full = "a</e>b</e>c</e>";
        let mut ends = EndsOfTurn::new(&strings);
        assert_eq!(ends.first_end(full, 0), Some(5));
        assert_eq!(ends.first_end(full, 5), Some(10));
        assert_eq!(ends.first_end(full, 6), Some(10));
        assert_eq!(ends.first_end(full, 11), Some(15));
        // The string that never occurs was searched for once, from the first turn on.
        assert_eq!(ends.next[1], Some((0, None)));
        assert_eq!(ends.first_end(full, 15), None);
        // Turns asked out of order are searched again.
        assert_eq!(ends.first_end(full, 1), Some(5));
    }

    #[test]
    fn common_prefixes_end_on_character_boundaries() {
        assert_eq!(common_prefix_len("aéb", "aéc"), 3);
        assert_eq!(common_prefix_len("aé", "aè"), 1);
        assert_eq!(common_prefix_len("ab", "abc"), 2);
    }

    #[test]
    fn names_a_turn_without_end_of_turn_token() {
        let roles = [Role::User, Role::Assistant];
        let e = turn_spans("<u>q<a>x", &roles, &eot(), |_, _| Ok("<u>q<a>".into())).unwrap_err();
        assert!(
            matches!(e, RecordError::NoEndOfTurn { index: 1, .. }),
            "{e}"
        );
    }

    #[test]
    fn masks_tokens_overlapping_spans() {
        let offsets = [(0, 2), (2, 4), (4, 6), (5, 6), (6, 9), (9, 10)];
        assert_eq!(
            token_mask(&offsets, &[(3, 6), (9, 10)]),
            vec![0, 1, 1, 1, 0, 1]
        );
        assert_eq!(token_mask(&offsets, &[]), vec![0; 6]);
    }
}
