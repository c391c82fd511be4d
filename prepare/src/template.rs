//! A model's chat template rendered the way transformers renders it: Jinja with `trim_blocks` and
//! `lstrip_blocks`, loop controls, Python string methods, transformers' `tojson`,
//! `raise_exception` and `strftime_now`, and the special tokens as variables. `{% generation %}`
//! blocks come back as byte spans of the rendered text.
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use minijinja::value::{Enumerator, Kwargs, Object, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};
use regex::Regex;

use crate::conversation::Message;
use crate::error::{io_err, PrepareError, RecordError, Result};

// Private-use code points mark where `{% generation %}` blocks start and end in the rendered
// text; a message containing them is refused so a marker can never come from the data.
const GEN_START: char = '\u{10FFFD}';
const GEN_END: char = '\u{10FFFC}';

/// A compiled chat template plus the variables transformers passes to every render.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Where the template came from (for messages).
    pub source_path: PathBuf,
    has_generation: bool,
    globals: Arc<[(String, Value)]>,
    // Whether the skeleton copy (`SKELETON`) was compiled, or why the template does not qualify.
    skeleton: Result<(), String>,
}

const SKELETON: &str = "chat_template_skeleton";

// The variables of one rendering, looked up by name: the turn-by-turn mask renders several
// times per conversation, and building a map of every variable each time was a measurable part.
#[derive(Debug)]
struct RenderVars {
    globals: Arc<[(String, Value)]>,
    messages: Value,
    add_generation_prompt: bool,
}

impl Object for RenderVars {
    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        match key.as_str()? {
            "messages" => Some(self.messages.clone()),
            "add_generation_prompt" => Some(Value::from(self.add_generation_prompt)),
            k => self
                .globals
                .iter()
                .find(|(g, _)| g == k)
                .map(|(_, v)| v.clone()),
        }
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        let mut keys: Vec<Value> = vec!["messages".into(), "add_generation_prompt".into()];
        keys.extend(
            self.globals
                .iter()
                .filter(|(k, _)| k != "messages" && k != "add_generation_prompt")
                .map(|(k, _)| Value::from(k.as_str())),
        );
        Enumerator::Values(keys)
    }
}

/// Text rendered from a conversation, with the `{% generation %}` spans in bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    /// The rendered text, markers removed.
    pub text: String,
    /// `[start, end)` byte ranges that `{% generation %}` blocks produced.
    pub generation_spans: Vec<(usize, usize)>,
}

fn generation_tag() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    // transformers' own test for whether a template supports assistant masks.
    RE.get_or_init(|| Regex::new(r"\{%-?\s*generation\s*-?%\}").expect("valid regex"))
}

// Replaces the `generation` tag pair by block tags that print a marker, so the template keeps its
// whitespace control: `trim_blocks` / `lstrip_blocks` and `-` act on block tags, not on `{{ }}`.
fn rewrite_generation_tags(src: &str) -> String {
    static OPEN: OnceLock<Regex> = OnceLock::new();
    static CLOSE: OnceLock<Regex> = OnceLock::new();
    let open = OPEN
        .get_or_init(|| Regex::new(r"\{%([-+]?)\s*generation\s*([-+]?)%\}").expect("valid regex"));
    let close = CLOSE.get_or_init(|| {
        Regex::new(r"\{%([-+]?)\s*endgeneration\s*([-+]?)%\}").expect("valid regex")
    });
    let s = open.replace_all(
        src,
        format!("{{%${{1}} if true %}}{{{{ '{GEN_START}' }}}}{{% endif ${{2}}%}}"),
    );
    close
        .replace_all(
            &s,
            format!("{{%${{1}} if true %}}{{{{ '{GEN_END}' }}}}{{% endif ${{2}}%}}"),
        )
        .into_owned()
}

// Python's json.dumps(x, ensure_ascii=False, indent=indent, sort_keys=sort_keys), which
// transformers installs as `tojson` in place of Jinja's HTML-escaping one.
fn py_json(
    v: &Value,
    indent: Option<usize>,
    sort_keys: bool,
    level: usize,
    out: &mut String,
) -> Result<(), Error> {
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * level));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        // minijinja prints numbers as Python does (2.0 stays 2.0).
        ValueKind::Number => out.push_str(&v.to_string()),
        ValueKind::String => out.push_str(
            &serde_json::to_string(v.as_str().unwrap_or_default())
                .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?,
        ),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                py_json(item, indent, sort_keys, level + 1, out)?;
            }
            newline(out, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if sort_keys {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                let key = k
                    .as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| k.to_string());
                out.push_str(
                    &serde_json::to_string(&key)
                        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?,
                );
                out.push_str(": ");
                py_json(&v.get_item(k)?, indent, sort_keys, level + 1, out)?;
            }
            newline(out, level);
            out.push('}');
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot serialise a value of kind {}", v.kind()),
            ))
        }
    }
    Ok(())
}

fn tojson(v: Value, kwargs: Kwargs) -> Result<String, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    if ensure_ascii == Some(true) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: ensure_ascii=True is not supported",
        ));
    }
    kwargs.assert_all_used()?;
    let mut out = String::new();
    py_json(&v, indent, sort_keys.unwrap_or(false), 0, &mut out)?;
    Ok(out)
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

fn strftime_now(format: String) -> Result<String, Error> {
    use std::fmt::Write;
    let mut out = String::new();
    // chrono reports an unknown specifier as a formatting error; write! surfaces it instead of
    // the panic `to_string` would raise.
    write!(out, "{}", chrono::Local::now().format(&format)).map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: invalid format {format:?}"),
        )
    })?;
    Ok(out)
}

// A special token in tokenizer_config.json: a string or an AddedToken object with `content`.
fn token_text(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// Where a model directory's chat template lives and the special tokens it sees.
#[derive(Debug, Clone)]
pub struct TemplateSource {
    /// The template text.
    pub text: String,
    /// The file it came from.
    pub path: PathBuf,
    /// `bos_token`, `eos_token`, … as strings.
    pub special_tokens: Vec<(String, String)>,
}

/// Reads `chat_template.jinja` (what transformers 5 saves) or else `tokenizer_config.json`'s
/// `chat_template` (a string, or a list of named templates whose `default` is taken).
pub fn read_template_source(model_dir: &Path) -> Result<TemplateSource> {
    let config_path = model_dir.join("tokenizer_config.json");
    let config: serde_json::Value = match std::fs::read(&config_path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| PrepareError::Model {
            path: config_path.clone(),
            message: format!("not valid JSON: {e}"),
        })?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Value::Null,
        Err(e) => return Err(io_err(&config_path)(e)),
    };
    let mut special_tokens = vec![];
    for key in [
        "bos_token",
        "eos_token",
        "unk_token",
        "pad_token",
        "sep_token",
        "cls_token",
        "mask_token",
    ] {
        if let Some(t) = config.get(key).and_then(token_text) {
            special_tokens.push((key.to_string(), t));
        }
    }
    let jinja_path = model_dir.join("chat_template.jinja");
    if jinja_path.exists() {
        let text = std::fs::read_to_string(&jinja_path).map_err(io_err(&jinja_path))?;
        return Ok(TemplateSource {
            text,
            path: jinja_path,
            special_tokens,
        });
    }
    let text = match config.get("chat_template") {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Array(named)) => named
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template")?.as_str().map(str::to_string))
            .ok_or_else(|| PrepareError::Model {
                path: config_path.clone(),
                message: "chat_template is a list without a template named \"default\"".into(),
            })?,
        _ => {
            return Err(PrepareError::Model {
                path: model_dir.to_path_buf(),
                message: "no chat template: expected chat_template.jinja or a \"chat_template\" in tokenizer_config.json".into(),
            })
        }
    };
    Ok(TemplateSource {
        text,
        path: config_path,
        special_tokens,
    })
}

impl ChatTemplate {
    /// Compiles a template. `extra` are further variables (e.g. `enable_thinking`), as
    /// transformers' `apply_chat_template(**kwargs)`.
    pub fn new(
        source: &TemplateSource,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Self> {
        let has_generation = generation_tag().is_match(&source.text);
        let text = if has_generation {
            rewrite_generation_tags(&source.text)
        } else {
            source.text.clone()
        };
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| PrepareError::TemplateSyntax {
                path: source.path.clone(),
                message: e.to_string(),
            })?;
        env.set_syntax(syntax.clone());
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_test("hslake_skeleton_message", |v: Value| {
            crate::skeleton::is_skeleton_message(&v)
        });
        // Only the turn-by-turn mask renders prefixes; generation markers need none.
        let skeleton = if has_generation {
            Err("the template has {% generation %} markers".to_string())
        } else {
            crate::skeleton::analyze(&text, syntax.clone()).and_then(|copy| {
                env.add_template_owned(SKELETON, copy)
                    .map_err(|e| format!("the skeleton copy does not compile: {e:#}"))
            })
        };
        env.add_template_owned("chat_template", text).map_err(|e| {
            PrepareError::TemplateSyntax {
                path: source.path.clone(),
                message: format!("{e:#}"),
            }
        })?;
        let mut globals: Vec<(String, Value)> = source
            .special_tokens
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        for (k, v) in extra {
            globals.retain(|(g, _)| g != k);
            globals.push((k.clone(), json_value(v)));
        }
        // A sentinel printed by the template itself would be taken for a message's text.
        let skeleton = skeleton.and_then(|()| {
            match globals
                .iter()
                .find(|(_, v)| v.to_string().contains(crate::skeleton::SENTINEL))
            {
                Some((k, _)) => Err(format!(
                    "the template variable {k} contains hslake's sentinel character U+10FFFB"
                )),
                None => Ok(()),
            }
        });
        Ok(ChatTemplate {
            env,
            source_path: source.path.clone(),
            has_generation,
            globals: globals.into(),
            skeleton,
        })
    }

    /// Whether the turn-by-turn mask may fill skeletons instead of rendering every prefix
    /// ([`crate::skeleton`]), or why not.
    pub fn skeleton_support(&self) -> Result<(), &str> {
        self.skeleton.as_ref().map(|_| ()).map_err(String::as_str)
    }

    /// Whether the template marks the assistant's text with `{% generation %}`.
    pub fn has_generation_markers(&self) -> bool {
        self.has_generation
    }

    /// Refuses messages holding the characters that mark `{% generation %}` blocks.
    pub fn check_messages(messages: &[Message]) -> Result<(), RecordError> {
        let marked = |t: &str| t.contains([GEN_START, GEN_END]);
        if messages
            .iter()
            .any(|m| marked(&m.content) || m.reasoning.as_deref().is_some_and(marked))
        {
            return Err(RecordError::Malformed(
                "message contains U+10FFFC/U+10FFFD, which hslake reserves for generation markers"
                    .into(),
            ));
        }
        Ok(())
    }

    /// The messages as the template sees them (reasoning under both names transformers uses).
    pub fn message_values(messages: &[Message]) -> Result<Vec<Value>, RecordError> {
        Self::check_messages(messages)?;
        messages
            .iter()
            .map(|m| {
                let mut pairs = vec![
                    ("role", Value::from(m.role.as_str())),
                    ("content", Value::from(m.content.as_str())),
                ];
                if let Some(r) = &m.reasoning {
                    pairs.push(("reasoning_content", Value::from(r.as_str())));
                    pairs.push(("thinking", Value::from(r.as_str())));
                }
                Ok(Value::from_pairs(pairs))
            })
            .collect()
    }

    /// Renders `messages` (from [`ChatTemplate::message_values`]).
    pub fn render(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
    ) -> Result<Rendered, RecordError> {
        let raw = self.render_named("chat_template", messages, add_generation_prompt)?;
        if self.has_generation {
            split_markers(&raw)
        } else {
            Ok(Rendered {
                text: raw,
                generation_spans: vec![],
            })
        }
    }
}

impl ChatTemplate {
    fn render_named(
        &self,
        name: &str,
        messages: &[Value],
        add_generation_prompt: bool,
    ) -> Result<String, RecordError> {
        let tmpl = self
            .env
            .get_template(name)
            .map_err(|e| RecordError::Template(e.to_string()))?;
        let vars = RenderVars {
            globals: self.globals.clone(),
            messages: Value::from(messages),
            add_generation_prompt,
        };
        tmpl.render(Value::from_object(vars))
            .map_err(|e| RecordError::Template(template_error_text(&e)))
    }
}

impl crate::skeleton::SkeletonRenderer for ChatTemplate {
    fn render_skeleton(&self, messages: &[Value], prompt: bool) -> Result<String, RecordError> {
        self.render_named(SKELETON, messages, prompt)
    }
}

// A JSON value (a --chat-template-kwargs entry) as a template value.
fn json_value(v: &serde_json::Value) -> Value {
    match v {
        serde_json::Value::Null => Value::from(()),
        serde_json::Value::Bool(b) => Value::from(*b),
        serde_json::Value::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Value::from(i),
            (None, Some(u)) => Value::from(u),
            _ => Value::from(n.as_f64().unwrap_or(f64::NAN)),
        },
        serde_json::Value::String(s) => Value::from(s.as_str()),
        serde_json::Value::Array(a) => a.iter().map(json_value).collect(),
        serde_json::Value::Object(o) => {
            Value::from_pairs(o.iter().map(|(k, v)| (k.as_str(), json_value(v))))
        }
    }
}

// raise_exception's message alone; other errors with minijinja's kind and line.
fn template_error_text(e: &Error) -> String {
    match (e.kind(), e.detail()) {
        (ErrorKind::InvalidOperation, Some(d)) => d.to_string(),
        _ => e.to_string(),
    }
}

fn split_markers(raw: &str) -> Result<Rendered, RecordError> {
    let mut text = String::with_capacity(raw.len());
    let mut spans = vec![];
    let mut open: Option<usize> = None;
    for c in raw.chars() {
        match c {
            GEN_START if open.is_none() => open = Some(text.len()),
            GEN_END => match open.take() {
                Some(s) => spans.push((s, text.len())),
                None => {
                    return Err(RecordError::Template(
                        "{% endgeneration %} without {% generation %}".into(),
                    ))
                }
            },
            GEN_START => {
                return Err(RecordError::Template(
                    "nested {% generation %} blocks".into(),
                ))
            }
            _ => text.push(c),
        }
    }
    if open.is_some() {
        return Err(RecordError::Template(
            "{% generation %} block never closed".into(),
        ));
    }
    Ok(Rendered {
        text,
        generation_spans: spans,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conversation::Role;

    fn template(text: &str) -> ChatTemplate {
        let src = TemplateSource {
            text: text.into(),
            path: "t.jinja".into(),
            special_tokens: vec![("eos_token".into(), "</s>".into())],
        };
        ChatTemplate::new(&src, &Default::default()).unwrap()
    }

    fn render(t: &ChatTemplate, msgs: &[Message], gen: bool) -> Result<Rendered, RecordError> {
        t.render(&ChatTemplate::message_values(msgs).unwrap(), gen)
    }

    #[test]
    fn trims_blocks_like_transformers() {
        let t = template("{% for m in messages %}\n  {% if m.role == 'user' %}\n[{{ m.content }}]\n  {% endif %}\n{% endfor %}\n");
        let r = render(&t, &[Message::new(Role::User, "hi")], false).unwrap();
        assert_eq!(r.text, "[hi]\n");
    }

    #[test]
    fn offers_python_string_methods_and_special_tokens() {
        let t = template(
            "{{ messages[0].content.split('</think>')[-1].lstrip('\\n').upper() }}{{ eos_token }}",
        );
        let r = render(&t, &[Message::new(Role::User, "a</think>\n\nb")], false).unwrap();
        assert_eq!(r.text, "B</s>");
    }

    #[test]
    fn reports_raise_exception_by_its_message() {
        let t = template("{{ raise_exception('roles must alternate') }}");
        let e = render(&t, &[Message::new(Role::User, "x")], false).unwrap_err();
        assert_eq!(e, RecordError::Template("roles must alternate".into()));
    }

    #[test]
    fn returns_generation_spans_in_bytes() {
        let t = template("{% for m in messages %}{% if m.role == 'assistant' %}A:\n{% generation %}\n{{ m.content }}!{% endgeneration %}\n\n{% else %}U:{{ m.content }}\n{% endif %}{% endfor %}");
        let r = render(
            &t,
            &[
                Message::new(Role::User, "é"),
                Message::new(Role::Assistant, "ü"),
            ],
            false,
        )
        .unwrap();
        // trim_blocks drops the newline after each block tag, as around the original tags.
        assert_eq!(r.text, "U:é\nA:\nü!\n");
        assert_eq!(r.generation_spans, vec![(8, 11)]);
    }

    #[test]
    fn formats_tojson_like_python_json_dumps() {
        let t =
            template("{{ {'a': [1, 2.0, 'ü'], 'b': none} | tojson }}|{{ [1] | tojson(indent=2) }}");
        let r = render(&t, &[Message::new(Role::User, "x")], false).unwrap();
        assert_eq!(r.text, "{\"a\": [1, 2.0, \"ü\"], \"b\": null}|[\n  1\n]");
    }

    #[test]
    fn refuses_messages_holding_the_marker_characters() {
        let e =
            ChatTemplate::message_values(&[Message::new(Role::User, "\u{10FFFD}")]).unwrap_err();
        assert!(e.to_string().contains("reserves"), "{e}");
    }
}
