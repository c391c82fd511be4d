//! New assistant answers from the target model itself, through an OpenAI-compatible
//! chat-completions endpoint (vLLM, SGLang, `transformers serve`, …): each user turn is sent with
//! the model's own earlier answers, requests that fail for the server's sake are retried with
//! backoff, and every answered conversation is appended to a progress file at once, so a
//! restarted run asks nothing twice.
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::StreamExt;
use serde_json::{json, Value};

use crate::conversation::{parse_conversation, Conversation, Message, Role};
use crate::error::{io_err, PrepareError, RecordError, Result};
use crate::source::ConversationRecord;

/// How to reach the server and what to ask for.
#[derive(Debug, Clone)]
pub struct RegenOptions {
    /// API base, e.g. `http://127.0.0.1:8000/v1` (`/v1` is added to a URL without a path).
    pub endpoint: String,
    /// The served model's name; `None` asks `GET /models` and takes the first.
    pub model: Option<String>,
    /// Conversations in flight at once.
    pub concurrency: usize,
    /// `max_tokens` of each answer.
    pub max_tokens: Option<u32>,
    /// Sampling temperature.
    pub temperature: Option<f32>,
    /// Retries of a request after the first attempt.
    pub retries: u32,
    /// Wait before the first retry; doubles each time, at most 30 s.
    pub backoff: Duration,
    /// Limit of one request.
    pub timeout: Duration,
}

/// Live counts, for a progress display.
#[derive(Debug, Default)]
pub struct RegenCounters {
    /// HTTP requests sent (retries included).
    pub requests: AtomicU64,
    /// Conversations answered in this run.
    pub answered: AtomicU64,
    /// Conversations given up on.
    pub failed: AtomicU64,
}

/// What a regeneration run did.
#[derive(Debug, Default)]
pub struct RegenReport {
    /// Conversations answered by this run.
    pub answered: u64,
    /// Conversations the progress file already held.
    pub resumed: u64,
    /// Answers the server cut at `max_tokens` (`finish_reason: length`).
    pub cut_at_max_tokens: u64,
    /// Conversations given up on: record index, location and reason.
    pub failed: Vec<(u64, String, String)>,
}

/// The answered conversations of earlier runs, and the file new ones are appended to.
pub struct ProgressFile {
    path: PathBuf,
    file: std::fs::File,
    done: HashMap<u64, Conversation>,
}

impl ProgressFile {
    /// Opens (or creates) a progress file. A last line cut short by a killed run is dropped.
    pub fn open(path: &Path) -> Result<Self> {
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => vec![],
            Err(e) => return Err(io_err(path)(e)),
        };
        let mut done = HashMap::new();
        let mut good_len = 0usize;
        for (n, line) in bytes.split_inclusive(|&b| b == b'\n').enumerate() {
            let complete = line.ends_with(b"\n");
            let parsed = serde_json::from_slice::<Value>(line).ok().and_then(|v| {
                let index = v.get("index")?.as_u64()?;
                Some((index, parse_conversation(&v).ok()?))
            });
            match (parsed, complete) {
                (Some((index, conv)), true) => {
                    done.insert(index, conv);
                    good_len += line.len();
                }
                (_, false) => break,
                (None, true) => {
                    return Err(PrepareError::Input {
                        path: path.to_path_buf(),
                        message: format!("line {}: not a progress record (expected {{\"index\": N, \"messages\": [...]}}); remove the file to start over", n + 1),
                    })
                }
            }
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(io_err(path))?;
        // Drop a torn last line so the next append starts on a line of its own.
        file.set_len(good_len as u64).map_err(io_err(path))?;
        let mut pf = ProgressFile {
            path: path.to_path_buf(),
            file,
            done,
        };
        std::io::Seek::seek(&mut pf.file, std::io::SeekFrom::End(0)).map_err(io_err(path))?;
        Ok(pf)
    }

    /// Answered conversations by record index.
    pub fn answered(&self) -> &HashMap<u64, Conversation> {
        &self.done
    }

    /// Records one answered conversation (one line, flushed before returning).
    pub fn append(&mut self, index: u64, conv: Conversation) -> Result<()> {
        let mut v = conv.to_json();
        v.as_object_mut()
            .expect("to_json gives an object")
            .insert("index".into(), index.into());
        let mut line = serde_json::to_vec(&v).map_err(|e| io_err(&self.path)(e.into()))?;
        line.push(b'\n');
        self.file
            .write_all(&line)
            .and_then(|_| self.file.flush())
            .map_err(io_err(&self.path))?;
        self.done.insert(index, conv);
        Ok(())
    }
}

fn user_texts(c: &Conversation) -> Vec<&str> {
    c.messages
        .iter()
        .filter(|m| m.role == Role::User)
        .map(|m| m.content.as_str())
        .collect()
}

/// The API base with `/v1` added when the URL has no path.
pub fn api_base(endpoint: &str) -> String {
    let trimmed = endpoint.trim_end_matches('/');
    match trimmed.split_once("://") {
        Some((_, rest)) if !rest.contains('/') => format!("{trimmed}/v1"),
        _ => trimmed.to_string(),
    }
}

enum Failure {
    // Worth another attempt: transport errors, 429, 5xx.
    Retry(String),
    Fatal(String),
}

struct Answer {
    content: String,
    reasoning: Option<String>,
    cut: bool,
}

struct Client {
    http: reqwest::Client,
    base: String,
    model: String,
    opts: RegenOptions,
}

impl Client {
    async fn attempt(&self, body: &Value) -> Result<Answer, Failure> {
        let resp = self
            .http
            .post(format!("{}/chat/completions", self.base))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .map_err(|e| Failure::Retry(format!("request failed: {e}")))?;
        let status = resp.status();
        let text = resp
            .text()
            .await
            .map_err(|e| Failure::Retry(format!("reading the response failed: {e}")))?;
        if !status.is_success() {
            let snippet: String = text.chars().take(300).collect();
            let msg = format!("HTTP {status}: {snippet}");
            return Err(if status.as_u16() == 429 || status.is_server_error() {
                Failure::Retry(msg)
            } else {
                Failure::Fatal(msg)
            });
        }
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| Failure::Retry(format!("response is not JSON: {e}")))?;
        let choice = v.get("choices").and_then(|c| c.get(0)).ok_or_else(|| {
            Failure::Fatal(format!(
                "response has no choices: {}",
                text.chars().take(300).collect::<String>()
            ))
        })?;
        let msg = choice
            .get("message")
            .ok_or_else(|| Failure::Fatal("choice has no message".into()))?;
        let content = msg
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let reasoning = msg
            .get("reasoning_content")
            .or_else(|| msg.get("reasoning"))
            .and_then(Value::as_str)
            .map(str::to_string);
        let cut = choice.get("finish_reason").and_then(Value::as_str) == Some("length");
        Ok(Answer {
            content,
            reasoning,
            cut,
        })
    }

    async fn ask(
        &self,
        messages: &[Message],
        counters: &RegenCounters,
    ) -> Result<Answer, RecordError> {
        let msgs: Vec<Value> = messages
            .iter()
            .map(|m| json!({"role": m.role.as_str(), "content": m.content}))
            .collect();
        let mut body = json!({"model": self.model, "messages": msgs, "stream": false});
        if let Some(n) = self.opts.max_tokens {
            body["max_tokens"] = n.into();
        }
        if let Some(t) = self.opts.temperature {
            body["temperature"] = t.into();
        }
        let mut delay = self.opts.backoff;
        let mut attempt = 0u32;
        loop {
            counters.requests.fetch_add(1, Ordering::Relaxed);
            match self.attempt(&body).await {
                Ok(a) => return Ok(a),
                Err(Failure::Fatal(m)) => return Err(RecordError::Regeneration(m)),
                Err(Failure::Retry(m)) if attempt >= self.opts.retries => {
                    return Err(RecordError::Regeneration(format!(
                        "{m} (gave up after {} attempts)",
                        attempt + 1
                    )))
                }
                Err(Failure::Retry(m)) => {
                    tracing::debug!(error = %m, attempt, "request failed; retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(30));
                    attempt += 1;
                }
            }
        }
    }

    // System and user turns are kept; every assistant turn is the model's own answer to what
    // precedes it, asked after the last of consecutive user turns.
    async fn answer(
        &self,
        conv: &Conversation,
        counters: &RegenCounters,
    ) -> Result<(Conversation, u64), RecordError> {
        if !conv.messages.iter().any(|m| m.role == Role::User) {
            return Err(RecordError::Regeneration("no user turn to answer".into()));
        }
        let mut out: Vec<Message> = vec![];
        let mut cut = 0;
        for (i, m) in conv.messages.iter().enumerate() {
            if m.role == Role::Assistant {
                continue;
            }
            out.push(m.clone());
            let next_is_user = conv
                .messages
                .get(i + 1)
                .is_some_and(|n| n.role == Role::User);
            if m.role == Role::User && !next_is_user {
                let a = self.ask(&out, counters).await?;
                cut += a.cut as u64;
                out.push(Message {
                    role: Role::Assistant,
                    content: a.content,
                    reasoning: a.reasoning,
                });
            }
        }
        Ok((
            Conversation {
                id: conv.id,
                messages: out,
            },
            cut,
        ))
    }
}

async fn served_model(http: &reqwest::Client, base: &str) -> Result<String> {
    let err = |message: String| PrepareError::Endpoint {
        endpoint: base.to_string(),
        message,
    };
    let resp = http
        .get(format!("{base}/models"))
        .send()
        .await
        .map_err(|e| err(format!("cannot list models: {e}")))?;
    let status = resp.status();
    let text = resp
        .text()
        .await
        .map_err(|e| err(format!("cannot list models: {e}")))?;
    if !status.is_success() {
        return Err(err(format!(
            "GET /models answered HTTP {status}; pass --served-model"
        )));
    }
    let v: Value =
        serde_json::from_str(&text).map_err(|e| err(format!("GET /models: not JSON: {e}")))?;
    v.get("data")
        .and_then(|d| d.get(0))
        .and_then(|m| m.get("id"))
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| err("GET /models lists no model; pass --served-model".into()))
}

/// Answers every conversation of `records` that `progress` does not hold yet. Records that are
/// not conversations are skipped (the tokenizing step names them). Each answer is appended to
/// `progress` as it lands.
pub async fn regenerate(
    records: &[ConversationRecord],
    progress: &mut ProgressFile,
    opts: &RegenOptions,
    counters: &RegenCounters,
) -> Result<RegenReport> {
    let base = api_base(&opts.endpoint);
    let http = reqwest::Client::builder()
        .timeout(opts.timeout)
        .build()
        .map_err(|e| PrepareError::Endpoint {
            endpoint: base.clone(),
            message: format!("cannot build an HTTP client: {e}"),
        })?;
    let mut report = RegenReport::default();
    for r in records {
        if let (Some(done), Ok(conv)) = (progress.answered().get(&r.index), &r.conversation) {
            if user_texts(done) != user_texts(conv) {
                return Err(PrepareError::Input {
                    path: progress.path.clone(),
                    message: format!("holds an answer for record {} ({}) whose user turns differ from the input's; it belongs to another input: remove it or pass another --progress-file", r.index, r.location),
                });
            }
            report.resumed += 1;
        }
    }
    let todo: Vec<&ConversationRecord> = records
        .iter()
        .filter(|r| r.conversation.is_ok() && !progress.answered().contains_key(&r.index))
        .collect();
    if todo.is_empty() {
        return Ok(report);
    }
    let model = match &opts.model {
        Some(m) => m.clone(),
        None => served_model(&http, &base).await?,
    };
    tracing::info!(endpoint = %base, %model, conversations = todo.len(), resumed = report.resumed, concurrency = opts.concurrency, "regenerating answers");
    let client = Client {
        http,
        base,
        model,
        opts: opts.clone(),
    };
    let client = &client;
    let mut answers = futures::stream::iter(todo)
        .map(|r| async move {
            let conv = r.conversation.as_ref().expect("filtered to conversations");
            (r, client.answer(conv, counters).await)
        })
        .buffer_unordered(opts.concurrency.max(1));
    while let Some((r, result)) = answers.next().await {
        match result {
            Ok((conv, cut)) => {
                progress.append(r.index, conv)?;
                report.answered += 1;
                report.cut_at_max_tokens += cut;
                counters.answered.fetch_add(1, Ordering::Relaxed);
            }
            Err(reason) => {
                tracing::warn!(location = %r.location, %reason, "conversation not regenerated");
                report
                    .failed
                    .push((r.index, r.location.clone(), reason.to_string()));
                counters.failed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    Ok(report)
}

/// The records to tokenize after regeneration: each answered conversation in place of its
/// original; a conversation left unanswered becomes a refused record with the server's reason.
pub fn regenerated_records(
    records: Vec<ConversationRecord>,
    progress: &ProgressFile,
    report: &RegenReport,
) -> Vec<ConversationRecord> {
    let failed: HashMap<u64, &str> = report
        .failed
        .iter()
        .map(|(i, _, m)| (*i, m.as_str()))
        .collect();
    records
        .into_iter()
        .map(|mut r| {
            if r.conversation.is_ok() {
                r.conversation = match progress.answered().get(&r.index) {
                    Some(c) => Ok(c.clone()),
                    None => Err(RecordError::Regeneration(
                        failed.get(&r.index).unwrap_or(&"not answered").to_string(),
                    )),
                };
            }
            r
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv(id: u64, text: &str) -> Conversation {
        Conversation {
            id: Some(id),
            messages: vec![
                Message::new(Role::User, text),
                Message::new(Role::Assistant, "a"),
            ],
        }
    }

    #[test]
    fn adds_v1_only_to_bare_endpoints() {
        assert_eq!(
            api_base("http://127.0.0.1:8000"),
            "http://127.0.0.1:8000/v1"
        );
        assert_eq!(
            api_base("http://127.0.0.1:8000/"),
            "http://127.0.0.1:8000/v1"
        );
        assert_eq!(api_base("http://h/openai/v1/"), "http://h/openai/v1");
    }

    #[test]
    fn progress_survives_reopening_and_drops_a_torn_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.jsonl");
        let mut p = ProgressFile::open(&path).unwrap();
        p.append(3, conv(30, "q3")).unwrap();
        p.append(1, conv(10, "q1")).unwrap();
        drop(p);
        // A run killed in the middle of a write.
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b"{\"index\": 5, \"mess")
            .unwrap();
        let mut p = ProgressFile::open(&path).unwrap();
        assert_eq!(p.answered().len(), 2);
        assert_eq!(p.answered()[&3], conv(30, "q3"));
        p.append(5, conv(50, "q5")).unwrap();
        drop(p);
        let p = ProgressFile::open(&path).unwrap();
        assert_eq!(p.answered().len(), 3);
        assert_eq!(std::fs::read_to_string(&path).unwrap().lines().count(), 3);
    }

    #[test]
    fn refuses_a_progress_file_with_a_broken_middle_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.jsonl");
        std::fs::write(
            &path,
            "garbage\n{\"index\": 1, \"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}\n",
        )
        .unwrap();
        let e = ProgressFile::open(&path).err().unwrap();
        assert!(
            e.to_string().contains("line 1: not a progress record"),
            "{e}"
        );
    }
}
