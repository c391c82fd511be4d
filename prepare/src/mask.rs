//! Which characters the assistant wrote, and which tokens that makes.
//!
//! Two methods, chosen per template ([`MaskMethod`]):
//! - **generation markers**: the template's `{% generation %}` blocks, as transformers'
//!   `return_assistant_tokens_mask=True` uses them;
//! - **turn by turn**, for templates without markers (the method of the EAGLE-3 trainers'
//!   preprocessors): the assistant's text at message `i` starts where the rendering of the first
//!   `i` messages with the generation prompt ends, and runs through its first end-of-turn token.
//!   That prefix must be a prefix of the whole rendering, or the template rewrites earlier turns
//!   and the record is refused ([`RecordError::NotPrefixStable`]) rather than masked wrongly.
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

/// Byte spans `[start, end)` of the assistant's turns in `full`, by the turn-by-turn method.
/// `prefix_with_prompt(i)` renders the first `i` messages with the generation prompt.
pub fn turn_spans(
    full: &str,
    roles: &[Role],
    end_of_turn: &[String],
    mut prefix_with_prompt: impl FnMut(usize) -> Result<String, RecordError>,
) -> Result<Vec<(usize, usize)>, RecordError> {
    let mut spans = vec![];
    for (index, role) in roles.iter().enumerate() {
        if *role != Role::Assistant {
            continue;
        }
        let prefix = prefix_with_prompt(index)?;
        if !full.starts_with(&prefix) {
            return Err(RecordError::NotPrefixStable { index });
        }
        let start = prefix.len();
        let rest = &full[start..];
        let end = end_of_turn
            .iter()
            .filter_map(|eot| rest.find(eot.as_str()).map(|p| p + eot.len()))
            .min()
            .ok_or_else(|| RecordError::NoEndOfTurn {
                index,
                eot: end_of_turn.join(" or "),
            })?;
        spans.push((start, start + end));
    }
    Ok(spans)
}

/// Byte spans of `text` as character spans (what token offsets are measured in).
pub fn char_spans(text: &str, byte_spans: &[(usize, usize)]) -> Vec<(usize, usize)> {
    let mut marks: Vec<usize> = byte_spans.iter().flat_map(|&(s, e)| [s, e]).collect();
    marks.sort_unstable();
    marks.dedup();
    let mut at = std::collections::HashMap::with_capacity(marks.len());
    let (mut bytes_seen, mut chars_seen) = (0usize, 0usize);
    for m in marks {
        chars_seen += text[bytes_seen..m].chars().count();
        bytes_seen = m;
        at.insert(m, chars_seen);
    }
    byte_spans.iter().map(|(s, e)| (at[s], at[e])).collect()
}

/// 1 on every token whose `[start, end)` character offsets overlap a span — transformers' rule,
/// so a token straddling a span edge counts as the assistant's.
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
        let spans = turn_spans(full, &roles, &eot(), |i| Ok(CHATML[i / 2 + 1].to_string())).unwrap();
        let texts: Vec<&str> = spans.iter().map(|&(s, e)| &full[s..e]).collect();
        assert_eq!(texts, ["a1</e>", "a2</e>"]);
    }

    #[test]
    fn refuses_templates_that_rewrite_earlier_turns() {
        let roles = [Role::User, Role::Assistant];
        let e = turn_spans("<u>q</e><a>x</e>", &roles, &eot(), |_| Ok("<u>q</e><a><think>".into())).unwrap_err();
        assert_eq!(e, RecordError::NotPrefixStable { index: 1 });
    }

    #[test]
    fn names_a_turn_without_end_of_turn_token() {
        let roles = [Role::User, Role::Assistant];
        let e = turn_spans("<u>q<a>x", &roles, &eot(), |_| Ok("<u>q<a>".into())).unwrap_err();
        assert!(matches!(e, RecordError::NoEndOfTurn { index: 1, .. }), "{e}");
    }

    #[test]
    fn converts_byte_spans_to_character_spans() {
        let text = "ééxü";
        assert_eq!(char_spans(text, &[(4, 7), (0, 2)]), vec![(2, 4), (0, 1)]);
    }

    #[test]
    fn masks_tokens_overlapping_spans() {
        let offsets = [(0, 2), (2, 4), (4, 6), (5, 6), (6, 9), (9, 10)];
        assert_eq!(token_mask(&offsets, &[(3, 6), (9, 10)]), vec![0, 1, 1, 1, 0, 1]);
        assert_eq!(token_mask(&offsets, &[]), vec![0; 6]);
    }
}
