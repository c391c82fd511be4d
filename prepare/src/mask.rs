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

/// Byte spans `[start, end)` of the assistant's turns in `full`, by the turn-by-turn method.
/// `render_prefix(i, with_prompt)` renders the first `i` messages, with or without the
/// generation prompt.
pub fn turn_spans(
    full: &str,
    roles: &[Role],
    end_of_turn: &[String],
    mut render_prefix: impl FnMut(usize, bool) -> Result<String, RecordError>,
) -> Result<Vec<(usize, usize)>, RecordError> {
    let mut spans = vec![];
    for (index, role) in roles.iter().enumerate() {
        if *role != Role::Assistant {
            continue;
        }
        let prompted = render_prefix(index, true)?;
        let start = if full.starts_with(&prompted) {
            prompted.len()
        } else {
            let history = render_prefix(index, false)?;
            let prompt = prompted
                .strip_prefix(history.as_str())
                .filter(|_| full.starts_with(&history));
            let shared = prompt.map_or(0, |p| common_prefix_len(p, &full[history.len()..]));
            if shared == 0 {
                return Err(RecordError::NotPrefixStable { index });
            }
            history.len() + shared
        };
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

// Bytes of the longest common prefix, ending on a character boundary.
fn common_prefix_len(a: &str, b: &str) -> usize {
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
            Ok(CHATML[i / 2 + 1].to_string())
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
