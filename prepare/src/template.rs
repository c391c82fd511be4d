//! A model's chat template rendered the way transformers renders it: Jinja with `trim_blocks` and
//! `lstrip_blocks`, loop controls, Python string methods, transformers' `tojson`,
//! `raise_exception` and `strftime_now`, and the special tokens as variables. `{% generation %}`
//! blocks come back as byte spans of the rendered text.
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use minijinja::value::{Enumerator, Object, Value};
use minijinja::{Environment, Error, ErrorKind};
use regex::Regex;

use crate::conversation::Message;
use crate::error::{io_err, PrepareError, RecordError, Result};
use crate::limits::Limits;
use crate::template_functions::{raise_exception, strftime_now, tojson};

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
    // Fuel of one rendering (set on `env`) and the most bytes it may output.
    fuel: u64,
    max_output: usize,
    // The variables the template reads that no rendering gives it (comma-separated), to name
    // in the error of a rendering that reads one.
    not_given: String,
}

/// The variables hslake itself passes to every rendering; `--chat-template-kwargs` may not set
/// them (transformers refuses them the same way, as duplicate keyword arguments).
pub const RESERVED_VARIABLES: [&str; 2] = ["messages", "add_generation_prompt"];

/// Refuses template variables that would replace the conversation, the generation prompt or
/// the guard's functions.
pub fn check_kwargs(extra: &serde_json::Map<String, serde_json::Value>) -> Result<()> {
    if let Some(k) = extra.keys().find(|k| k.starts_with(crate::guard::RESERVED)) {
        return Err(PrepareError::Argument {
            option: "--chat-template-kwargs",
            message: format!(
                "sets {k:?}; names starting with {} are hslake's own",
                crate::guard::RESERVED
            ),
        });
    }
    match RESERVED_VARIABLES.iter().find(|k| extra.contains_key(**k)) {
        Some(k) => Err(PrepareError::Argument {
            option: "--chat-template-kwargs",
            message: format!(
                "sets {k:?}, which hslake passes to the template itself (the conversation and \
                 the generation prompt); expected other variables, e.g. {{\"enable_thinking\": false}}"
            ),
        }),
        None => Ok(()),
    }
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
    /// transformers' `apply_chat_template(**kwargs)`; every rendering gets `limits`' fuel and
    /// may output at most `limits.max_record_bytes`.
    pub fn new(
        source: &TemplateSource,
        extra: &serde_json::Map<String, serde_json::Value>,
        limits: &Limits,
    ) -> Result<Self> {
        check_kwargs(extra)?;
        limits.validate()?;
        let has_generation = generation_tag().is_match(&source.text);
        let text = if has_generation {
            rewrite_generation_tags(&source.text)
        } else {
            source.text.clone()
        };
        let mut env = Environment::new();
        env.set_fuel(Some(limits.template_fuel));
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| PrepareError::TemplateSyntax {
                path: source.path.clone(),
                message: e.to_string(),
            })?;
        env.set_syntax(syntax.clone());
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_test("hslake_skeleton_message", |v: Value| {
            crate::skeleton::is_skeleton_message(&v)
        });
        crate::guard::install(&mut env);
        let syntax_err = |message: String| PrepareError::TemplateSyntax {
            path: source.path.clone(),
            message,
        };
        // The template as written first, so that a syntax error is reported as one.
        env.add_template_owned("chat_template", text.clone())
            .map_err(|e| syntax_err(format!("{e:#}")))?;
        // Only the turn-by-turn mask renders prefixes; generation markers need none.
        let skeleton = if has_generation {
            Err("the template has {% generation %} markers".to_string())
        } else {
            crate::skeleton::analyze(&text, syntax.clone()).and_then(|copy| {
                let copy = crate::guard::guarded_copy(&copy, syntax.clone())?;
                env.add_template_owned(SKELETON, copy)
                    .map_err(|e| format!("the skeleton copy does not compile: {e:#}"))
            })
        };
        let not_given = {
            let tmpl =
                env.get_template("chat_template")
                    .map_err(|e| PrepareError::TemplateSyntax {
                        path: source.path.clone(),
                        message: format!("{e:#}"),
                    })?;
            let given: Vec<&str> = RESERVED_VARIABLES
                .into_iter()
                .chain(source.special_tokens.iter().map(|(k, _)| k.as_str()))
                .chain(extra.keys().map(String::as_str))
                .chain(env.globals().map(|(k, _)| k))
                .collect();
            let mut names: Vec<String> = tmpl
                .undeclared_variables(false)
                .into_iter()
                .filter(|n| !given.contains(&n.as_str()))
                .collect();
            names.sort();
            names.join(", ")
        };
        // Rendered from its guarded copy ([`crate::guard`]), under the same name and lines.
        let guarded = crate::guard::guarded_copy(&text, syntax).map_err(syntax_err)?;
        env.add_template_owned("chat_template", guarded)
            .map_err(|e| syntax_err(format!("the guarded copy does not compile: {e:#}")))?;
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
            fuel: limits.template_fuel,
            max_output: limits.max_record_bytes,
            not_given,
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
        let mut out = CappedOutput {
            bytes: vec![],
            max: self.max_output,
            over: false,
        };
        let rendered = tmpl.render_captured_to(Value::from_object(vars), &mut out);
        if out.over {
            return Err(crate::limits::rendered_over(self.max_output));
        }
        match rendered {
            Ok(_) => String::from_utf8(out.bytes)
                .map_err(|e| RecordError::Template(format!("output is not UTF-8: {e}"))),
            Err(e) if e.kind() == ErrorKind::OutOfFuel => {
                Err(RecordError::OutOfFuel { fuel: self.fuel })
            }
            Err(e) => Err(RecordError::Template(template_error_text(
                &e,
                &self.not_given,
            ))),
        }
    }
}

// A rendering's output, refused before it grows past `max` bytes.
struct CappedOutput {
    bytes: Vec<u8>,
    max: usize,
    over: bool,
}

impl std::io::Write for CappedOutput {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if buf.len() > self.max - self.bytes.len() {
            self.over = true;
            return Err(std::io::Error::other("output bound reached"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
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

// raise_exception's message alone; other errors with minijinja's kind and line. `not_given`:
// the variables the template reads that it is not given.
fn template_error_text(e: &Error, not_given: &str) -> String {
    match (e.kind(), e.detail()) {
        (ErrorKind::InvalidOperation, Some(d)) => d.to_string(),
        // The environment has no loader: the only templates are the chat template itself.
        (ErrorKind::TemplateNotFound, _) => format!(
            "{e}; a chat template cannot include, import or extend files or other templates"
        ),
        (ErrorKind::UndefinedError, _) if !not_given.is_empty() => format!(
            "{e}; the template reads {not_given}, which it is not given: a chat template sees \
             the conversation, add_generation_prompt, the special tokens and \
             --chat-template-kwargs, nothing of the environment or of files"
        ),
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

/// A template of `text` with an end-of-sequence token, for tests.
#[cfg(test)]
pub(crate) fn test_template(text: &str, limits: Limits) -> ChatTemplate {
    let src = TemplateSource {
        text: text.into(),
        path: "t.jinja".into(),
        special_tokens: vec![("eos_token".into(), "</s>".into())],
    };
    ChatTemplate::new(&src, &Default::default(), &limits).unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conversation::Role;

    fn template(text: &str) -> ChatTemplate {
        test_template(text, Limits::default())
    }

    // A small fuel, so that refusals come quickly and allocate little.
    const FUEL: u64 = 100_000;

    fn fueled(text: &str) -> ChatTemplate {
        test_template(
            text,
            Limits {
                template_fuel: FUEL,
                ..Default::default()
            },
        )
    }

    fn render_err(t: &ChatTemplate) -> RecordError {
        render(t, &[Message::new(Role::User, "x")], false).unwrap_err()
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
    fn leaves_out_renderings_that_double_strings_past_their_fuel() {
        // 2^40 bytes: before fuel, the failed allocation aborted the process.
        for doubling in [
            "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
            "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s | length }}",
            "{% macro d(s, n) %}{% if n > 0 %}{{ d(s ~ s, n - 1) }}{% else %}{{ s | length }}{% endif %}{% endmacro %}{{ d('x', 40) }}",
            "{% set ns = namespace(s='xy') %}{% for i in range(40) %}{% set ns.s = ns.s.replace('x', ns.s) %}{% endfor %}{{ ns.s | length }}",
            "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = [ns.s, ns.s] | join %}{% endfor %}{{ ns.s | length }}",
            "{{ [1, 2] | tojson(indent=1000000000000) }}",
            "{{ 'x' * 10000000000 }}",
        ] {
            assert_eq!(
                render_err(&fueled(doubling)),
                RecordError::OutOfFuel { fuel: FUEL },
                "{doubling}"
            );
        }
    }

    #[test]
    fn leaves_out_renderings_that_loop_past_their_fuel() {
        // 10^12 iterations ran until killed.
        let loops = "{% for i in range(10000) %}{% for j in range(10000) %}{% for k in range(10000) %}{% endfor %}{% endfor %}{% endfor %}";
        assert_eq!(
            render_err(&fueled(loops)),
            RecordError::OutOfFuel { fuel: FUEL }
        );
        assert_eq!(
            RecordError::OutOfFuel { fuel: FUEL }.to_string(),
            "chat template ran out of fuel: one rendering may take 100000 (one per instruction, one per 64 bytes it builds); loops or string growth past that are refused (--template-fuel)"
        );
    }

    #[test]
    fn stops_an_output_at_the_record_byte_bound() {
        let bounded = |text| {
            let limits = Limits {
                max_record_bytes: 5000,
                ..Default::default()
            };
            render(
                &test_template(text, limits),
                &[Message::new(Role::User, "x")],
                false,
            )
        };
        assert_eq!(
            bounded("{% for i in range(100) %}{{ 'x' * 100 }}{% endfor %}")
                .unwrap_err()
                .to_string(),
            "the rendered text is over --max-record-bytes 5000"
        );
        let exactly = bounded("{% for i in range(50) %}{{ 'x' * 100 }}{% endfor %}");
        assert_eq!(exactly.unwrap().text.len(), 5000);
    }

    #[test]
    fn refuses_templates_that_read_files_or_the_environment_by_name() {
        for (src, named) in [
            ("{% include '/etc/passwd' %}", "/etc/passwd"),
            ("{% import '/etc/hosts' as h %}", "/etc/hosts"),
            ("{% extends '/etc/hostname' %}", "/etc/hostname"),
            ("{% from 'x.jinja' import m %}", "x.jinja"),
        ] {
            let e = render_err(&template(src)).to_string();
            assert!(e.contains(named), "{src}: {e}");
            assert!(
                e.contains("a chat template cannot include, import or extend files"),
                "{src}: {e}"
            );
        }
        for (src, named) in [
            (
                "{{ getenv('HOME') }}",
                "unknown function: getenv is unknown",
            ),
            (
                "{{ open('/etc/passwd').read() }}",
                "unknown function: open is unknown",
            ),
            (
                "{{ os.environ['HOME'] }}",
                "the template reads os, which it is not given",
            ),
            (
                "{{ environ.HOME }}",
                "the template reads environ, which it is not given",
            ),
        ] {
            let e = render_err(&template(src)).to_string();
            assert!(e.contains(named), "{src}: {e}");
        }
    }

    #[test]
    fn refuses_kwargs_that_replace_the_conversation() {
        let src = TemplateSource {
            text: "{{ messages | length }}".into(),
            path: "t.jinja".into(),
            special_tokens: vec![],
        };
        for key in ["messages", "add_generation_prompt"] {
            let extra: serde_json::Map<String, serde_json::Value> =
                serde_json::from_str(&format!(r#"{{"{key}": []}}"#)).unwrap();
            let e = ChatTemplate::new(&src, &extra, &Limits::default())
                .err()
                .unwrap()
                .to_string();
            assert!(
                e.starts_with(&format!("--chat-template-kwargs: sets \"{key}\"")),
                "{e}"
            );
        }
    }

    #[test]
    fn refuses_messages_holding_the_marker_characters() {
        let e =
            ChatTemplate::message_values(&[Message::new(Role::User, "\u{10FFFD}")]).unwrap_err();
        assert!(e.to_string().contains("reserves"), "{e}");
    }
}
