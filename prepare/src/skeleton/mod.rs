//! The turn-by-turn mask's prefix renderings without rendering each prefix: one *skeleton* per
//! sequence of roles, rendered once with a sentinel in place of every message's text, then
//! filled with each conversation's texts.
//!
//! This is exact only for a template whose output depends on the messages' texts solely by
//! printing them as they are, so that the texts cannot steer what the template does. Two checks
//! establish that, and a template failing either keeps rendering every prefix (the reason is
//! logged):
//! - **statically** ([`analyze`]): in the template's syntax tree, every read of a message's
//!   `content`, `reasoning_content` or `thinking` by a constant name is printed directly
//!   (`{{ … }}`, possibly joined by `+` or `~` or chosen by an `if` that does not read a text),
//!   never tested (beyond `is defined`, `undefined`, `none`, `string`), filtered, compared,
//!   assigned, passed to a call or captured by a block, macro or filter. In the skeleton's copy
//!   of the template each such read becomes a read of the sentinel when its object is a skeleton
//!   message, and stays as written otherwise (a namespace's or a literal map's field of that name
//!   is the template's own data); a read from a computed object (a call, a filter) is refused.
//! - **while rendering skeletons**: the skeleton's messages answer the renamed reads with the
//!   sentinel, and any other read of a text (by a computed name, `attr`, `map(attribute=…)`,
//!   `items()`, `tojson`, comparing or iterating a message) marks the template as unsuited.
//!
//! Given both, a real rendering takes the same path through the template as the skeleton
//! rendering of the same roles and prints the same text with each sentinel replaced by the
//! message's text. As a check on that reasoning, the first conversations of each skeleton are
//! also rendered for real; a skeleton that does not reproduce one byte for byte turns skeletons
//! off for the run (warned), and one that reproduces them all stands for the real rendering of
//! the conversations after them.
mod analyze;
mod pattern;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use minijinja::value::{DynObject, Enumerator, Object, ObjectRepr, Value};
use rustc_hash::FxHashMap;

use crate::conversation::{Message, Role};
use crate::error::RecordError;
use crate::mask::PrefixText;
pub use analyze::analyze;
use pattern::{sentinel, Pattern, PrefixPattern};

/// The message fields that carry text, and the names the skeleton's template reads them by.
const TEXT_KEYS: [(&str, &str); 3] = [
    ("content", "hslake_skeleton_content"),
    ("reasoning_content", "hslake_skeleton_reasoning_content"),
    ("thinking", "hslake_skeleton_thinking"),
];

/// Starts a sentinel; the next character says which message and field. Conversations holding it
/// take the per-prefix path.
pub(crate) const SENTINEL: char = '\u{10FFFB}';
/// The character after [`SENTINEL`] is `FIELD_BASE + 2 * message + (1 if reasoning)`.
const FIELD_BASE: u32 = 0xF0000;
/// Messages a skeleton can name (the private-use plane after `FIELD_BASE`).
pub const MAX_MESSAGES: usize = 32_000;
/// Conversations per skeleton whose real rendering is compared with the filled skeleton before
/// the filled skeleton stands for the rendering: a check on the reasoning above, not part of it.
const CHECKED_CONVERSATIONS: u32 = 16;
/// Role sequences whose skeletons are kept; conversations of further ones render every prefix.
const MAX_SKELETONS: usize = 4096;

// The first way a skeleton rendering read a text other than through a renamed read.
#[derive(Debug, Default)]
struct Leak(Mutex<Option<&'static str>>);

impl Leak {
    fn record(&self, how: &'static str) {
        let mut first = self.0.lock().unwrap_or_else(|e| e.into_inner());
        first.get_or_insert(how);
    }

    fn first(&self) -> Option<&'static str> {
        *self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

// A message of a skeleton rendering: its role, and sentinels for its texts.
#[derive(Debug)]
struct SkeletonMessage {
    role: Value,
    content: Value,
    reasoning: Option<Value>,
    leak: Arc<Leak>,
}

impl Object for SkeletonMessage {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        match key.as_str()? {
            "role" => Some(self.role.clone()),
            "hslake_skeleton_content" => Some(self.content.clone()),
            "hslake_skeleton_reasoning_content" | "hslake_skeleton_thinking" => {
                self.reasoning.clone()
            }
            "content" => {
                self.leak
                    .record("a message's content is read by a computed name");
                Some(self.content.clone())
            }
            "reasoning_content" | "thinking" => {
                self.leak
                    .record("a message's reasoning is read by a computed name");
                self.reasoning.clone()
            }
            _ => None,
        }
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        self.leak
            .record("a message's fields are listed (items(), tojson, iteration)");
        let mut keys = vec![Value::from("role"), Value::from("content")];
        if self.reasoning.is_some() {
            keys.extend([Value::from("reasoning_content"), Value::from("thinking")]);
        }
        Enumerator::Values(keys)
    }

    // A real message is a map with at least two keys.
    fn is_true(self: &Arc<Self>) -> bool {
        true
    }

    fn custom_cmp(self: &Arc<Self>, _other: &DynObject) -> Option<std::cmp::Ordering> {
        self.leak.record("messages are compared");
        None
    }
}

/// The renderings one role sequence needs, with sentinels for the texts.
#[derive(Debug)]
pub struct Skeleton {
    full: Pattern,
    // Conversations whose real rendering this skeleton reproduced.
    checked: AtomicU32,
    // By message index, for assistant messages: the first `i` messages with the generation
    // prompt and, where that is not a prefix of the whole rendering, without it.
    prefixes: Vec<Option<(PrefixPattern, Option<PrefixPattern>)>>,
}

impl Skeleton {
    /// Conversations whose real rendering this skeleton reproduced (at most the number checked).
    pub fn checked(&self) -> u32 {
        self.checked.load(Ordering::Relaxed)
    }

    /// Bytes the skeleton holds: its whole rendering and the tails of its prefixes.
    pub fn size(&self) -> usize {
        let prefixes: usize = self
            .prefixes
            .iter()
            .flatten()
            .map(|(p, h)| p.size() + h.as_ref().map_or(0, PrefixPattern::size))
            .sum();
        self.full.size() + prefixes
    }

    /// The skeleton with `messages`' texts: the byte where each part of the whole rendering
    /// starts, computed once so that every prefix costs only its tail.
    pub fn filled<'a>(&'a self, messages: &'a [Message]) -> Filled<'a> {
        let mut starts = Vec::with_capacity(self.full.parts.len() + 1);
        let mut at = 0;
        for part in &self.full.parts {
            starts.push(at);
            at += self.full.piece(part, messages).len();
        }
        starts.push(at);
        Filled {
            skeleton: self,
            messages,
            starts,
        }
    }
}

/// A skeleton filled with one conversation's texts.
pub struct Filled<'a> {
    skeleton: &'a Skeleton,
    messages: &'a [Message],
    starts: Vec<usize>,
}

impl Filled<'_> {
    /// The first `i` messages rendered, with or without the generation prompt; `None` where the
    /// skeleton has no such rendering (not an assistant message, or a history not kept because
    /// the prompted rendering is a prefix of the whole one for every conversation).
    pub fn prefix(&self, i: usize, prompt: bool) -> Option<PrefixText> {
        let (prompted, history) = self.skeleton.prefixes.get(i)?.as_ref()?;
        let p = if prompt { prompted } else { history.as_ref()? };
        Some(PrefixText {
            shared: self.starts[p.parts] + p.bytes,
            tail: p.tail.fill(self.messages),
        })
    }
}

// What identifies a skeleton: each message's role and whether it has reasoning.
fn shape(messages: &[Message]) -> Vec<u8> {
    messages
        .iter()
        .map(|m| {
            let role = match m.role {
                Role::System => 0,
                Role::User => 1,
                Role::Assistant => 2,
            };
            role * 2 + m.reasoning.is_some() as u8
        })
        .collect()
}

/// The test the skeleton's copy tells skeleton messages from other objects by.
pub fn is_skeleton_message(v: &Value) -> bool {
    v.downcast_object_ref::<SkeletonMessage>().is_some()
}

/// Renders a template's skeleton copy: `messages` and the generation prompt flag.
pub trait SkeletonRenderer {
    /// The skeleton template rendered for `messages`.
    fn render_skeleton(&self, messages: &[Value], prompt: bool) -> Result<String, RecordError>;
}

/// Skeletons by role sequence, built on first use and shared by all threads.
#[derive(Debug, Default)]
pub struct Skeletons {
    by_shape: RwLock<FxHashMap<Vec<u8>, Option<Arc<Skeleton>>>>,
    // Why skeletons are no longer used for this template, once a rendering showed it unsuited.
    disabled: OnceLock<&'static str>,
}

impl Skeletons {
    /// Role sequences whose skeletons are kept.
    pub fn len(&self) -> usize {
        self.by_shape
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    /// Whether no skeleton is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Why the template turned out unsuited while rendering skeletons, if it did.
    pub fn disabled(&self) -> Option<&'static str> {
        self.disabled.get().copied()
    }

    /// The skeleton for `messages`, if one applies and reproduces `rendered`, the real rendering
    /// of all of them without the generation prompt.
    pub fn for_conversation(
        &self,
        renderer: &impl SkeletonRenderer,
        messages: &[Message],
        rendered: &str,
    ) -> Option<Arc<Skeleton>> {
        let skeleton = self.get(renderer, messages)?;
        if skeleton.full.reproduces(messages, rendered) {
            Some(skeleton)
        } else {
            self.disable("a skeleton did not reproduce a conversation's rendering");
            None
        }
    }

    /// The rendering of all of `messages` without the generation prompt, by `skeleton` once it
    /// has reproduced the real rendering (`render`) of its first conversations, and whether
    /// the skeleton may stand for the conversation's prefixes (not when it failed to reproduce a
    /// rendering; skeletons are then no longer used).
    pub fn full_text(
        &self,
        skeleton: &Skeleton,
        messages: &[Message],
        render: impl FnOnce() -> Result<String, RecordError>,
    ) -> Result<(String, bool), RecordError> {
        if skeleton.checked.load(Ordering::Relaxed) >= CHECKED_CONVERSATIONS {
            return Ok((skeleton.full.fill(messages), true));
        }
        let real = render()?;
        if skeleton.full.reproduces(messages, &real) {
            skeleton.checked.fetch_add(1, Ordering::Relaxed);
            Ok((real, true))
        } else {
            self.disable("a skeleton did not reproduce a conversation's rendering");
            Ok((real, false))
        }
    }

    fn disable(&self, how: &'static str) {
        if self.disabled.set(how).is_ok() {
            tracing::warn!(
                reason = how,
                "turn-by-turn mask: rendering every prefix from now on"
            );
        }
    }

    /// The skeleton for `messages`' role sequence, if one applies.
    pub fn get(
        &self,
        renderer: &impl SkeletonRenderer,
        messages: &[Message],
    ) -> Option<Arc<Skeleton>> {
        if self.disabled.get().is_some()
            || messages.len() > MAX_MESSAGES
            || messages.iter().any(|m| {
                m.content.contains(SENTINEL)
                    || m.reasoning.as_deref().is_some_and(|r| r.contains(SENTINEL))
            })
        {
            return None;
        }
        let key = shape(messages);
        let cached = self
            .by_shape
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
            .cloned();
        match cached {
            Some(s) => s,
            // A skeleton used once costs more than the renderings it replaces.
            None if self.len() >= MAX_SKELETONS => None,
            None => {
                let built = self.build(renderer, messages)?;
                self.by_shape
                    .write()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(key, built.clone());
                built
            }
        }
    }

    // The skeleton of `messages`' roles: `Some(None)` when its renderings fail (those
    // conversations render every prefix, which reports the failure exactly as before); `None`
    // when it showed the template unsuited.
    fn build(
        &self,
        renderer: &impl SkeletonRenderer,
        messages: &[Message],
    ) -> Option<Option<Arc<Skeleton>>> {
        let leak = Arc::new(Leak::default());
        let values: Vec<Value> = messages
            .iter()
            .enumerate()
            .map(|(j, m)| {
                Value::from_object(SkeletonMessage {
                    role: Value::from(m.role.as_str()),
                    content: Value::from(sentinel(j, false)),
                    reasoning: m.reasoning.as_ref().map(|_| Value::from(sentinel(j, true))),
                    leak: leak.clone(),
                })
            })
            .collect();
        let n = messages.len();
        let render = |upto: usize, prompt: bool| -> Option<Pattern> {
            let text = renderer.render_skeleton(&values[..upto], prompt).ok()?;
            Pattern::parse(text, n)
        };
        let skeleton = (|| {
            let full = render(n, false)?;
            // Tails beyond this mean a template that renders earlier turns differently at each
            // prefix; its conversations render every prefix instead of holding all of them.
            let budget = 4 * full.text.len() + (64 << 10);
            let mut held = 0;
            let mut prefixes = Vec::with_capacity(n);
            for (i, m) in messages.iter().enumerate() {
                if m.role != Role::Assistant {
                    prefixes.push(None);
                    continue;
                }
                let prompted = PrefixPattern::cut(&full, &render(i, true)?);
                // The history is asked for only when the prompted rendering is not a prefix.
                let history = if prompted.tail.parts.is_empty() {
                    None
                } else if i == 0 {
                    Some(PrefixPattern::cut(
                        &full,
                        &Pattern::parse(String::new(), n)?,
                    ))
                } else {
                    Some(PrefixPattern::cut(&full, &render(i, false)?))
                };
                held += prompted.size() + history.as_ref().map_or(0, PrefixPattern::size);
                if held > budget {
                    return None;
                }
                prefixes.push(Some((prompted, history)));
            }
            Some(Arc::new(Skeleton {
                full,
                checked: AtomicU32::new(0),
                prefixes,
            }))
        })();
        if let Some(how) = leak.first() {
            self.disable(how);
            return None;
        }
        Some(skeleton)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Renders the skeleton of a fixed ChatML-like template by hand.
    struct FakeRenderer;

    impl SkeletonRenderer for FakeRenderer {
        fn render_skeleton(&self, messages: &[Value], prompt: bool) -> Result<String, RecordError> {
            let mut out = String::new();
            for m in messages {
                let role = m.get_attr("role").unwrap();
                let text = m.get_attr("hslake_skeleton_content").unwrap();
                out.push_str(&format!("<{role}>{text}</e>"));
            }
            if prompt {
                out.push_str("<assistant>");
            }
            Ok(out)
        }
    }

    #[test]
    fn stops_using_skeletons_when_one_does_not_reproduce_a_rendering() {
        let skeletons = Skeletons::default();
        let messages = [
            Message::new(Role::User, "q"),
            Message::new(Role::Assistant, "a"),
        ];
        let skeleton = skeletons.get(&FakeRenderer, &messages).unwrap();
        // The prompted prefix is the whole rendering's first bytes.
        assert_eq!(
            skeleton.filled(&messages).prefix(1, true).unwrap(),
            PrefixText {
                shared: "<user>q</e><assistant>".len(),
                tail: String::new()
            }
        );
        let (text, usable) = skeletons
            .full_text(&skeleton, &messages, || {
                Ok("<user>q</e><assistant>a</e>".into())
            })
            .unwrap();
        assert_eq!(
            (text.as_str(), usable),
            ("<user>q</e><assistant>a</e>", true)
        );
        assert_eq!(skeleton.checked(), 1);
        // The real rendering differs: it is used, and skeletons no longer are.
        let (text, usable) = skeletons
            .full_text(&skeleton, &messages, || Ok("<user>q</e>!".into()))
            .unwrap();
        assert_eq!((text.as_str(), usable), ("<user>q</e>!", false));
        assert_eq!(
            skeletons.disabled(),
            Some("a skeleton did not reproduce a conversation's rendering")
        );
        assert!(skeletons.get(&FakeRenderer, &messages).is_none());
    }

    #[test]
    fn holds_five_thousand_turns_in_memory_linear_in_their_length() {
        let n = 5000;
        let messages: Vec<Message> = (0..n)
            .map(|i| {
                let role = [Role::User, Role::Assistant][i % 2];
                Message::new(role, format!("m{i}"))
            })
            .collect();
        let skeletons = Skeletons::default();
        let skeleton = skeletons.get(&FakeRenderer, &messages).unwrap();
        // Every prompted prefix is the whole rendering's first bytes: nothing held beyond the
        // whole rendering (holding each prefix's rendering took ~170 MB here).
        let whole = skeleton.full.size();
        assert_eq!(skeleton.size(), whole);
        assert!(whole < 128 * n, "{whole} bytes for {n} messages");
        // The mask of a conversation materialises no prefix: every one is a length.
        let full = skeleton.full.fill(&messages);
        let roles: Vec<Role> = messages.iter().map(|m| m.role).collect();
        let filled = skeleton.filled(&messages);
        let mut tail_bytes = 0;
        let spans = crate::mask::turn_spans(&full, &roles, &["</e>".into()], |i, prompt| {
            let p = filled
                .prefix(i, prompt)
                .expect("assistant turns have prefixes");
            tail_bytes += p.tail.len();
            Ok(p)
        })
        .unwrap();
        assert_eq!(tail_bytes, 0);
        assert_eq!(spans.len(), n / 2);
        for (k, &(s, e)) in spans.iter().enumerate() {
            assert_eq!(&full[s..e], format!("m{}</e>", 2 * k + 1));
        }
    }
}
