//! Conversations in the common shapes — OpenAI `messages` (`role`/`content`), ShareGPT
//! `conversations` (`from`/`value`), plain `prompt`/`response` — read into one form.
use serde_json::Value;

use crate::error::RecordError;

/// Who wrote a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Instructions before the conversation.
    System,
    /// The human side.
    User,
    /// The model's side: the tokens the loss applies to.
    Assistant,
}

impl Role {
    /// The name chat templates compare against.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }

    /// Reads OpenAI names and ShareGPT's `human` / `gpt`.
    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "system" => Some(Role::System),
            "user" | "human" => Some(Role::User),
            "assistant" | "gpt" => Some(Role::Assistant),
            _ => None,
        }
    }
}

/// One turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Its author.
    pub role: Role,
    /// Its text (may be empty).
    pub content: String,
    /// The assistant's separate reasoning, as servers return it (`reasoning_content`).
    pub reasoning: Option<String>,
}

impl Message {
    /// A message without reasoning.
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Message {
            role,
            content: content.into(),
            reasoning: None,
        }
    }
}

/// A conversation and the integer id the input gave it, if any.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Conversation {
    /// The record's integer `id`, when it has one.
    pub id: Option<u64>,
    /// The turns, in order.
    pub messages: Vec<Message>,
}

impl Conversation {
    /// Whether any turn is the assistant's.
    pub fn has_assistant(&self) -> bool {
        self.messages.iter().any(|m| m.role == Role::Assistant)
    }

    /// Bytes of text in all messages, reasoning included.
    pub fn text_bytes(&self) -> usize {
        self.messages
            .iter()
            .map(|m| m.content.len() + m.reasoning.as_ref().map_or(0, String::len))
            .sum()
    }

    /// The record form the progress file and `--regenerate` output use (OpenAI `messages`).
    pub fn to_json(&self) -> Value {
        let messages: Vec<Value> = self
            .messages
            .iter()
            .map(|m| {
                let mut o = serde_json::Map::new();
                o.insert("role".into(), m.role.as_str().into());
                o.insert("content".into(), m.content.clone().into());
                if let Some(r) = &m.reasoning {
                    o.insert("reasoning_content".into(), r.clone().into());
                }
                Value::Object(o)
            })
            .collect();
        let mut o = serde_json::Map::new();
        if let Some(id) = self.id {
            o.insert("id".into(), id.into());
        }
        o.insert("messages".into(), Value::Array(messages));
        Value::Object(o)
    }
}

fn malformed(m: impl Into<String>) -> RecordError {
    RecordError::Malformed(m.into())
}

// `content` as a string, null (empty), or OpenAI content parts whose text parts are joined.
fn text_of(v: Option<&Value>, what: &str) -> Result<String, RecordError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for p in parts {
                match p.get("text") {
                    Some(Value::String(t)) => out.push_str(t),
                    _ => return Err(malformed(format!("{what}: content parts must be {{\"type\": \"text\", \"text\": ...}}; only text is supported"))),
                }
            }
            Ok(out)
        }
        Some(other) => Err(malformed(format!(
            "{what}: expected a string, got {}",
            kind_of(other)
        ))),
    }
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

fn messages_of(
    list: &[Value],
    role_key: &str,
    text_key: &str,
) -> Result<Vec<Message>, RecordError> {
    let mut out = Vec::with_capacity(list.len());
    for (index, m) in list.iter().enumerate() {
        let Some(obj) = m.as_object() else {
            return Err(malformed(format!(
                "message {index}: expected an object, got {}",
                kind_of(m)
            )));
        };
        // ShareGPT files often use role/content inside `conversations`; accept either pair.
        let role_v = obj.get(role_key).or_else(|| obj.get("role"));
        let role_s = match role_v {
            Some(Value::String(s)) => s.as_str(),
            Some(other) => {
                return Err(malformed(format!(
                    "message {index}: \"{role_key}\" must be a string, got {}",
                    kind_of(other)
                )))
            }
            None => {
                return Err(malformed(format!(
                    "message {index}: no \"{role_key}\" field"
                )))
            }
        };
        let role = Role::parse(role_s).ok_or_else(|| RecordError::UnknownRole {
            index,
            role: role_s.to_string(),
        })?;
        let text = obj.get(text_key).or_else(|| obj.get("content"));
        let content = text_of(text, &format!("message {index}"))?;
        let reasoning = match obj
            .get("reasoning_content")
            .or_else(|| obj.get("reasoning"))
        {
            Some(Value::String(s)) => Some(s.clone()),
            _ => None,
        };
        out.push(Message {
            role,
            content,
            reasoning,
        });
    }
    Ok(out)
}

/// Reads one record. Checks the shape and the roles; whether it has an assistant turn is left to
/// the caller (regeneration takes conversations without one).
pub fn parse_conversation(v: &Value) -> Result<Conversation, RecordError> {
    let Some(obj) = v.as_object() else {
        return Err(malformed(format!(
            "expected a JSON object with \"messages\", \"conversations\" or \"prompt\"/\"response\", got {}",
            kind_of(v)
        )));
    };
    let id = match obj.get("id") {
        // Capture reads ids as i64: keep them in 0..2^63.
        Some(Value::Number(n)) => Some(
            n.as_i64()
                .filter(|&i| i >= 0)
                .map(|i| i as u64)
                .ok_or_else(|| malformed(format!("\"id\" {n} is not an integer in 0..2^63")))?,
        ),
        _ => None,
    };
    let messages = if let Some(m) = obj.get("messages") {
        let list = m
            .as_array()
            .ok_or_else(|| malformed(format!("\"messages\" must be a list, got {}", kind_of(m))))?;
        messages_of(list, "role", "content")?
    } else if let Some(c) = obj.get("conversations") {
        let list = c.as_array().ok_or_else(|| {
            malformed(format!(
                "\"conversations\" must be a list, got {}",
                kind_of(c)
            ))
        })?;
        messages_of(list, "from", "value")?
    } else if obj.contains_key("prompt") {
        let mut out = vec![];
        if let Some(s) = obj.get("system").filter(|s| !s.is_null()) {
            out.push(Message::new(Role::System, text_of(Some(s), "\"system\"")?));
        }
        out.push(Message::new(
            Role::User,
            text_of(obj.get("prompt"), "\"prompt\"")?,
        ));
        if let Some(r) = obj
            .get("response")
            .or_else(|| obj.get("completion"))
            .filter(|r| !r.is_null())
        {
            out.push(Message::new(
                Role::Assistant,
                text_of(Some(r), "\"response\"")?,
            ));
        }
        out
    } else {
        return Err(malformed(
            "no \"messages\", \"conversations\" or \"prompt\" field; expected OpenAI messages, ShareGPT conversations or a prompt/response pair",
        ));
    };
    if messages.is_empty() {
        return Err(RecordError::Empty);
    }
    Ok(Conversation { id, messages })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn roles(c: &Conversation) -> Vec<Role> {
        c.messages.iter().map(|m| m.role).collect()
    }

    #[test]
    fn reads_openai_messages() {
        let c = parse_conversation(&json!({"id": 7, "messages": [
            {"role": "system", "content": "s"}, {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a", "reasoning_content": "r"}]}))
        .unwrap();
        assert_eq!(c.id, Some(7));
        assert_eq!(roles(&c), [Role::System, Role::User, Role::Assistant]);
        assert_eq!(c.messages[2].reasoning.as_deref(), Some("r"));
    }

    #[test]
    fn reads_sharegpt_conversations() {
        let c = parse_conversation(&json!({"id": "abc", "conversations": [
            {"from": "system", "value": "s"}, {"from": "human", "value": "u"}, {"from": "gpt", "value": "a"}]}))
        .unwrap();
        assert_eq!(c.id, None);
        assert_eq!(roles(&c), [Role::System, Role::User, Role::Assistant]);
        assert_eq!(c.messages[1].content, "u");
    }

    #[test]
    fn reads_prompt_response_pairs() {
        let c =
            parse_conversation(&json!({"prompt": "p", "response": "r", "system": "s"})).unwrap();
        assert_eq!(roles(&c), [Role::System, Role::User, Role::Assistant]);
        let c = parse_conversation(&json!({"prompt": "p"})).unwrap();
        assert_eq!(roles(&c), [Role::User]);
    }

    #[test]
    fn joins_text_content_parts() {
        let c = parse_conversation(&json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}))
        .unwrap();
        assert_eq!(c.messages[0].content, "ab");
    }

    #[test]
    fn names_unknown_roles_with_their_index() {
        let e = parse_conversation(&json!({"messages": [
            {"role": "user", "content": "u"}, {"role": "tool", "content": "t"}]}))
        .unwrap_err();
        assert_eq!(
            e,
            RecordError::UnknownRole {
                index: 1,
                role: "tool".into()
            }
        );
    }

    #[test]
    fn rejects_empty_and_shapeless_records() {
        assert_eq!(
            parse_conversation(&json!({"messages": []})).unwrap_err(),
            RecordError::Empty
        );
        let e = parse_conversation(&json!({"text": "x"})).unwrap_err();
        assert!(e.to_string().contains("no \"messages\""), "{e}");
        let e = parse_conversation(&json!([1])).unwrap_err();
        assert!(e.to_string().contains("got a list"), "{e}");
        let e =
            parse_conversation(&json!({"messages": [{"role": "user", "content": 3}]})).unwrap_err();
        assert!(
            e.to_string()
                .contains("message 0: expected a string, got a number"),
            "{e}"
        );
    }

    #[test]
    fn round_trips_through_its_json_form() {
        let c = parse_conversation(&json!({"id": 3, "conversations": [
            {"from": "human", "value": "u"}, {"from": "gpt", "value": "a"}]}))
        .unwrap();
        assert_eq!(parse_conversation(&c.to_json()).unwrap(), c);
    }
}
