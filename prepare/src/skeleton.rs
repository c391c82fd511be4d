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
use std::ops::Range;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use minijinja::machinery::ast::{self, BinOpKind, CallArg, Expr, Stmt};
use minijinja::syntax::SyntaxConfig;
use minijinja::value::{DynObject, Enumerator, Object, ObjectRepr, Value};
use rustc_hash::FxHashMap;

use crate::conversation::{Message, Role};
use crate::error::RecordError;

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

/// The skeleton's copy of a template source, or why the template does not qualify.
pub fn analyze(source: &str, syntax: SyntaxConfig) -> Result<String, String> {
    if source.contains(SENTINEL) {
        return Err("the template contains hslake's sentinel character U+10FFFB".into());
    }
    let tree = minijinja::machinery::parse(source, "chat_template", syntax)
        .map_err(|e| format!("cannot parse the template: {e}"))?;
    let mut walk = Walk {
        src: source,
        edits: vec![],
        refused: None,
    };
    walk.stmt(&tree, false);
    if let Some(reason) = walk.refused {
        return Err(reason);
    }
    if walk.edits.is_empty() {
        return Err("the template never prints a message's text".into());
    }
    walk.edits.sort_by_key(|(r, _)| r.start);
    let mut out = String::with_capacity(source.len() + 32 * walk.edits.len());
    let mut at = 0;
    for (range, text) in &walk.edits {
        out.push_str(&source[at..range.start]);
        out.push_str(text);
        at = range.end;
    }
    out.push_str(&source[at..]);
    Ok(out)
}

// The template's reads of message texts: where each printed one sits in the source, or the first
// that is used otherwise.
struct Walk<'s> {
    src: &'s str,
    edits: Vec<(Range<usize>, String)>,
    refused: Option<String>,
}

// A read of a text field by a constant name: the field and the object it is read from.
fn text_read<'e, 's>(e: &'e Expr<'s>) -> Option<(&'static str, &'e Expr<'s>)> {
    let key = |name: &str| TEXT_KEYS.iter().find(|(k, _)| *k == name).map(|&(k, _)| k);
    match e {
        Expr::GetAttr(g) => Some((key(g.name)?, &g.expr)),
        Expr::GetItem(g) => match &g.subscript_expr {
            Expr::Const(c) => Some((key(c.value.as_str()?)?, &g.expr)),
            _ => None,
        },
        _ => None,
    }
}

// Whether evaluating an expression twice gives the same value: variables, constants and
// attributes or items of those (no calls, filters or operators).
fn plain(e: &Expr<'_>) -> bool {
    match e {
        Expr::Var(_) | Expr::Const(_) => true,
        Expr::GetAttr(g) => plain(&g.expr),
        Expr::GetItem(g) => plain(&g.expr) && plain(&g.subscript_expr),
        _ => false,
    }
}

fn source_of<'s>(src: &'s str, e: &Expr<'_>) -> &'s str {
    let span = e.span();
    &src[span.start_offset as usize..span.end_offset as usize]
}

impl Walk<'_> {
    fn refuse(&mut self, line: u16, what: String) {
        if self.refused.is_none() {
            self.refused = Some(format!("line {line}: {what}"));
        }
    }

    fn stmts(&mut self, body: &[Stmt<'_>], captured: bool) {
        for s in body {
            self.stmt(s, captured);
        }
    }

    // `captured`: output of this statement does not go straight to the rendering (a `set`
    // block, a macro, a filter or autoescape block).
    fn stmt(&mut self, s: &Stmt<'_>, captured: bool) {
        match s {
            Stmt::Template(t) => self.stmts(&t.children, captured),
            Stmt::EmitExpr(e) if captured => self.expr(&e.expr),
            Stmt::EmitExpr(e) => self.printed(&e.expr),
            Stmt::EmitRaw(_) | Stmt::Continue(_) | Stmt::Break(_) => {}
            Stmt::ForLoop(f) => {
                self.expr(&f.target);
                self.expr(&f.iter);
                if let Some(x) = &f.filter_expr {
                    self.expr(x);
                }
                self.stmts(&f.body, captured);
                self.stmts(&f.else_body, captured);
            }
            Stmt::IfCond(c) => {
                self.expr(&c.expr);
                self.stmts(&c.true_body, captured);
                self.stmts(&c.false_body, captured);
            }
            Stmt::WithBlock(w) => {
                for (target, value) in &w.assignments {
                    self.expr(target);
                    self.expr(value);
                }
                self.stmts(&w.body, captured);
            }
            Stmt::Set(x) => {
                self.expr(&x.target);
                self.expr(&x.expr);
            }
            Stmt::SetBlock(x) => {
                self.expr(&x.target);
                if let Some(f) = &x.filter {
                    self.expr(f);
                }
                self.stmts(&x.body, true);
            }
            Stmt::AutoEscape(x) => {
                self.expr(&x.enabled);
                self.stmts(&x.body, true);
            }
            Stmt::FilterBlock(x) => {
                self.expr(&x.filter);
                self.stmts(&x.body, true);
            }
            Stmt::Macro(m) => self.macro_decl(m),
            Stmt::CallBlock(c) => {
                self.call(&c.call);
                self.macro_decl(&c.macro_decl);
            }
            Stmt::Do(d) => self.call(&d.call),
            Stmt::Block(b) => self.refuse(b.span().start_line, "uses template blocks".into()),
            Stmt::Import(x) => self.refuse(x.span().start_line, "imports a template".into()),
            Stmt::FromImport(x) => self.refuse(x.span().start_line, "imports a template".into()),
            Stmt::Extends(x) => self.refuse(x.span().start_line, "extends a template".into()),
            Stmt::Include(x) => self.refuse(x.span().start_line, "includes a template".into()),
        }
    }

    fn macro_decl(&mut self, m: &ast::Macro<'_>) {
        for e in m.args.iter().chain(&m.defaults) {
            self.expr(e);
        }
        self.stmts(&m.body, true);
    }

    fn call(&mut self, c: &ast::Call<'_>) {
        self.expr(&c.expr);
        self.args(&c.args);
    }

    fn args(&mut self, args: &[CallArg<'_>]) {
        for a in args {
            match a {
                CallArg::Pos(e)
                | CallArg::Kwarg(_, e)
                | CallArg::PosSplat(e)
                | CallArg::KwargSplat(e) => self.expr(e),
            }
        }
    }

    // Renames a text read in the skeleton's copy: a skeleton message answers with its sentinel,
    // any other object (a namespace, a literal map: data of the template, not of a message)
    // with its own field as before.
    fn rename(&mut self, read: &Expr<'_>, key: &str, object: &Expr<'_>) {
        if !plain(object) {
            self.refuse(
                read.span().start_line,
                format!("a message's {key} is read from a computed object"),
            );
            return;
        }
        self.expr(object);
        let x = source_of(self.src, object);
        let renamed = TEXT_KEYS
            .iter()
            .find(|(k, _)| *k == key)
            .map_or(key, |&(_, r)| r);
        let span = read.span();
        self.edits.push((
            span.start_offset as usize..span.end_offset as usize,
            format!(
                "({x}.{renamed} if {x} is hslake_skeleton_message else {})",
                source_of(self.src, read)
            ),
        ));
    }

    // An expression whose value is printed as it is.
    fn printed(&mut self, e: &Expr<'_>) {
        if let Some((key, object)) = text_read(e) {
            self.rename(e, key, object);
            return;
        }
        match e {
            Expr::BinOp(b) if matches!(b.op, BinOpKind::Add | BinOpKind::Concat) => {
                self.printed(&b.left);
                self.printed(&b.right);
            }
            Expr::IfExpr(i) => {
                self.expr(&i.test_expr);
                self.printed(&i.true_expr);
                if let Some(f) = &i.false_expr {
                    self.printed(f);
                }
            }
            _ => self.expr(e),
        }
    }

    // An expression whose value may steer the template or be changed before it is printed.
    fn expr(&mut self, e: &Expr<'_>) {
        // Whether a text is there: the same for every text, and part of a skeleton's key.
        if let Expr::Test(t) = e {
            if t.args.is_empty() && ["defined", "undefined", "none", "string"].contains(&t.name) {
                if let Some((key, object)) = text_read(&t.expr) {
                    self.rename(&t.expr, key, object);
                    return;
                }
            }
        }
        if let Some((key, _)) = text_read(e) {
            self.refuse(
                e.span().start_line,
                format!("a message's {key} is used other than printed as it is"),
            );
            return;
        }
        match e {
            Expr::Const(c) if c.value.as_str().is_some_and(|t| t.contains(SENTINEL)) => self
                .refuse(
                    c.span().start_line,
                    "a string holds hslake's sentinel character U+10FFFB".into(),
                ),
            Expr::Var(_) | Expr::Const(_) => {}
            Expr::Slice(s) => {
                self.expr(&s.expr);
                for x in [&s.start, &s.stop, &s.step].into_iter().flatten() {
                    self.expr(x);
                }
            }
            Expr::UnaryOp(u) => self.expr(&u.expr),
            Expr::BinOp(b) => {
                self.expr(&b.left);
                self.expr(&b.right);
            }
            Expr::Compare(c) => {
                self.expr(&c.expr);
                for op in &c.ops {
                    self.expr(&op.expr);
                }
            }
            Expr::IfExpr(i) => {
                self.expr(&i.test_expr);
                self.expr(&i.true_expr);
                if let Some(f) = &i.false_expr {
                    self.expr(f);
                }
            }
            Expr::Filter(f) => {
                if let Some(x) = &f.expr {
                    self.expr(x);
                }
                self.args(&f.args);
            }
            Expr::Test(t) => {
                self.expr(&t.expr);
                self.args(&t.args);
            }
            Expr::GetAttr(g) => self.expr(&g.expr),
            Expr::GetItem(g) => {
                self.expr(&g.expr);
                self.expr(&g.subscript_expr);
            }
            Expr::Call(c) => {
                self.expr(&c.expr);
                self.args(&c.args);
            }
            Expr::List(l) => l.items.iter().for_each(|x| self.expr(x)),
            Expr::Tuple(t) => t.items.iter().for_each(|x| self.expr(x)),
            Expr::Map(m) => m.keys.iter().chain(&m.values).for_each(|x| self.expr(x)),
        }
    }
}

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

fn sentinel(message: usize, reasoning: bool) -> String {
    let code = FIELD_BASE + 2 * message as u32 + reasoning as u32;
    [SENTINEL, char::from_u32(code).expect("below U+FFFFE")]
        .into_iter()
        .collect()
}

// A skeleton rendering split at its sentinels.
#[derive(Debug)]
struct Pattern {
    text: String,
    parts: Vec<Part>,
}

#[derive(Debug)]
enum Part {
    Text(Range<usize>),
    Field { message: usize, reasoning: bool },
}

impl Pattern {
    fn parse(text: String, messages: usize) -> Option<Pattern> {
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

    fn fill(&self, messages: &[Message]) -> String {
        let mut out = String::new();
        for part in &self.parts {
            out.push_str(match part {
                Part::Text(r) => &self.text[r.clone()],
                Part::Field { message, reasoning } => Self::field(messages, *message, *reasoning),
            });
        }
        out
    }

    // Whether filling the pattern gives exactly `rendered`, without building it.
    fn reproduces(&self, messages: &[Message], rendered: &str) -> bool {
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

/// The renderings one role sequence needs, with sentinels for the texts.
#[derive(Debug)]
pub struct Skeleton {
    full: Pattern,
    // Conversations whose real rendering this skeleton reproduced.
    checked: AtomicU32,
    // By message index, for assistant messages: the first `i` messages with and without the
    // generation prompt.
    prefixes: Vec<Option<(Pattern, Pattern)>>,
}

impl Skeleton {
    /// Conversations whose real rendering this skeleton reproduced (at most the number checked).
    pub fn checked(&self) -> u32 {
        self.checked.load(Ordering::Relaxed)
    }

    /// The first `i` messages of `messages` rendered, with or without the generation prompt;
    /// `None` where the skeleton has no such rendering (not an assistant message).
    pub fn prefix(&self, messages: &[Message], i: usize, prompt: bool) -> Option<String> {
        let (prompted, history) = self.prefixes.get(i)?.as_ref()?;
        Some(if prompt { prompted } else { history }.fill(messages))
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
            let mut prefixes = Vec::with_capacity(n);
            for (i, m) in messages.iter().enumerate() {
                prefixes.push(if m.role == Role::Assistant {
                    let history = if i == 0 {
                        Pattern::parse(String::new(), n)?
                    } else {
                        render(i, false)?
                    };
                    Some((render(i, true)?, history))
                } else {
                    None
                });
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

    fn syntax() -> SyntaxConfig {
        SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .unwrap()
    }

    fn refusal(src: &str) -> String {
        analyze(src, syntax()).unwrap_err()
    }

    #[test]
    fn renames_printed_reads_of_message_texts() {
        let src = "{% for m in messages %}{{ '<' + m['role'] + '>' + m['content'] }}{{ m . content ~ (m.thinking if m.thinking is defined else '') }}{% endfor %}";
        assert_eq!(
            analyze(src, syntax()).unwrap(),
            "{% for m in messages %}{{ '<' + m['role'] + '>' + (m.hslake_skeleton_content if m is hslake_skeleton_message else m['content']) }}{{ (m.hslake_skeleton_content if m is hslake_skeleton_message else m . content) ~ ((m.hslake_skeleton_thinking if m is hslake_skeleton_message else m.thinking) if (m.hslake_skeleton_thinking if m is hslake_skeleton_message else m.thinking) is defined else '') }}{% endfor %}"
        );
    }

    #[test]
    fn refuses_templates_that_inspect_or_transform_texts() {
        for (src, what) in [
            (
                "{{ messages[0]['content'] | trim }}",
                "line 1: a message's content is used other than printed",
            ),
            (
                "{% if m.content %}x{% endif %}",
                "content is used other than printed",
            ),
            (
                "{% set c = m.content %}{{ c }}",
                "content is used other than printed",
            ),
            (
                "{{ m.content.split('</think>')[-1] }}",
                "content is used other than printed",
            ),
            (
                "{% filter upper %}{{ m.content }}{% endfilter %}",
                "content is used other than printed",
            ),
            (
                "{% macro f(m) %}{{ m.content }}{% endmacro %}{{ f(x) }}",
                "content is used other than printed",
            ),
            (
                "{{ 'a' if m.reasoning_content else m.content }}",
                "reasoning_content is used other than printed",
            ),
            (
                "{{ m.content if m.content is startingwith('<') }}",
                "content is used other than printed",
            ),
            ("{% include 'x' %}", "includes a template"),
            (
                "{{ (messages | last).content }}",
                "content is read from a computed object",
            ),
            ("{{ m.role }}", "never prints a message's text"),
        ] {
            let e = refusal(src);
            assert!(e.contains(what), "{src}: {e}");
        }
    }

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
        assert_eq!(
            skeleton.prefix(&messages, 1, true).unwrap(),
            "<user>q</e><assistant>"
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
