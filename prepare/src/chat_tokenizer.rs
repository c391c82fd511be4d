//! One model's chat template and tokenizer, turning a conversation into `input_ids` and a loss
//! mask equal to transformers' `apply_chat_template(..., tokenize=True)`.
use std::path::Path;
use std::sync::Arc;

use minijinja::value::Value;
use tokenizers::Tokenizer;

use crate::conversation::{Conversation, Role};
use crate::encode::{EncodePath, Encoder};
use crate::error::{PrepareError, RecordError, Result};
use crate::limits::Limits;
use crate::mask::{token_mask, turn_spans, MaskMethod, PrefixText};
use crate::skeleton::{Skeleton, Skeletons};
use crate::template::{read_template_source, ChatTemplate};

/// Which tokens the loss applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LossOn {
    /// The tokens the assistant wrote, its end-of-turn token included.
    #[default]
    Assistant,
    /// Every token.
    All,
}

impl std::str::FromStr for LossOn {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "assistant" => Ok(LossOn::Assistant),
            "all" => Ok(LossOn::All),
            _ => Err(format!(
                "unknown loss scope {s:?}; expected assistant or all"
            )),
        }
    }
}

/// A tokenized conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tokenized {
    /// Token ids.
    pub input_ids: Vec<u32>,
    /// 1 where the loss applies, per token.
    pub loss_mask: Vec<u8>,
}

/// A model's chat template and tokenizer, loaded once and shared by every thread.
pub struct ChatTokenizer {
    template: ChatTemplate,
    tokenizer: Tokenizer,
    encoder: Encoder,
    end_of_turn: Vec<String>,
    loss_on: LossOn,
    skeletons: Skeletons,
    limits: Limits,
}

/// The variables a template gets beyond the conversation (e.g. `enable_thinking`).
pub type TemplateKwargs = serde_json::Map<String, serde_json::Value>;

fn model_err(path: &Path, message: impl Into<String>) -> PrepareError {
    PrepareError::Model {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

// The strings that end an assistant turn: the tokenizer's eos_token and every eos_token_id of
// generation_config.json (Llama 3 lists several, <|eot_id|> among them).
fn end_of_turn_strings(
    model_dir: &Path,
    tokenizer: &Tokenizer,
    eos: Option<&str>,
) -> Result<Vec<String>> {
    let mut out: Vec<String> = eos.map(str::to_string).into_iter().collect();
    let gen_path = model_dir.join("generation_config.json");
    if let Ok(bytes) = std::fs::read(&gen_path) {
        let v: serde_json::Value = serde_json::from_slice(&bytes)
            .map_err(|e| model_err(&gen_path, format!("not valid JSON: {e}")))?;
        let ids: Vec<u64> = match v.get("eos_token_id") {
            Some(serde_json::Value::Number(n)) => n.as_u64().into_iter().collect(),
            Some(serde_json::Value::Array(a)) => a.iter().filter_map(|x| x.as_u64()).collect(),
            _ => vec![],
        };
        for id in ids {
            let tok = u32::try_from(id)
                .ok()
                .and_then(|id| tokenizer.id_to_token(id))
                .ok_or_else(|| {
                    model_err(
                        &gen_path,
                        format!("eos_token_id {id} is not in the tokenizer's vocabulary"),
                    )
                })?;
            if !out.contains(&tok) {
                out.push(tok);
            }
        }
    }
    Ok(out)
}

impl ChatTokenizer {
    /// Loads `tokenizer.json` and the chat template of a Hugging Face model directory; every
    /// conversation and rendering is held to `limits`.
    pub fn from_model_dir(
        model_dir: &Path,
        loss_on: LossOn,
        kwargs: &TemplateKwargs,
        limits: Limits,
    ) -> Result<Self> {
        let tok_path = model_dir.join("tokenizer.json");
        if !tok_path.exists() {
            return Err(model_err(
                model_dir,
                "no tokenizer.json (a fast tokenizer is needed)",
            ));
        }
        let mut tokenizer = Tokenizer::from_file(&tok_path)
            .map_err(|e| model_err(&tok_path, format!("cannot load tokenizer: {e}")))?;
        // transformers turns off the truncation and padding a tokenizer.json may carry unless
        // the call asks for them, and apply_chat_template does not.
        tokenizer
            .with_truncation(None)
            .map_err(|e| model_err(&tok_path, format!("cannot turn off truncation: {e}")))?;
        tokenizer.with_padding(None);
        let encoder = Encoder::new(&tokenizer);
        let source = read_template_source(model_dir)?;
        let template = ChatTemplate::new(&source, kwargs, &limits)?;
        let eos = source
            .special_tokens
            .iter()
            .find(|(k, _)| k == "eos_token")
            .map(|(_, v)| v.as_str());
        let end_of_turn = end_of_turn_strings(model_dir, &tokenizer, eos)?;
        if loss_on == LossOn::Assistant
            && !template.has_generation_markers()
            && end_of_turn.is_empty()
        {
            return Err(model_err(model_dir, "the chat template has no {% generation %} markers and the model names no end-of-turn token (eos_token in tokenizer_config.json or eos_token_id in generation_config.json), so the assistant's tokens cannot be told apart"));
        }
        Ok(ChatTokenizer {
            template,
            tokenizer,
            encoder,
            end_of_turn,
            loss_on,
            skeletons: Skeletons::default(),
            limits,
        })
    }

    /// The bounds every conversation and rendering is held to.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// How the turn-by-turn mask gets the renderings of each conversation's prefixes: from
    /// skeletons, or by rendering every prefix and why ([`crate::skeleton`]).
    pub fn prefix_renderings(&self) -> String {
        if self.mask_method() == MaskMethod::GenerationMarkers {
            return "none ({% generation %} markers)".into();
        }
        match (self.template.skeleton_support(), self.skeletons.disabled()) {
            (Ok(()), None) => "filled skeletons (one rendering per role sequence)".into(),
            (Err(why), _) => format!("every prefix rendered ({why})"),
            (Ok(()), Some(why)) => format!("every prefix rendered ({why})"),
        }
    }

    /// How the loss mask is found for this template.
    pub fn mask_method(&self) -> MaskMethod {
        if self.template.has_generation_markers() {
            MaskMethod::GenerationMarkers
        } else {
            MaskMethod::TurnByTurn
        }
    }

    /// How rendered text is encoded: directly for byte-level BPE, else by tokenizers' full encode.
    pub fn encode_path(&self) -> EncodePath {
        self.encoder.path()
    }

    /// Which tokens get loss.
    pub fn loss_on(&self) -> LossOn {
        self.loss_on
    }

    /// Size of the tokenizer's vocabulary, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// The end-of-turn strings the turn-by-turn method looks for.
    pub fn end_of_turn(&self) -> &[String] {
        &self.end_of_turn
    }

    /// The template text of the whole conversation (no generation prompt).
    pub fn render(&self, conv: &Conversation) -> Result<String, RecordError> {
        let values = ChatTemplate::message_values(&conv.messages)?;
        Ok(self.template.render(&values, false)?.text)
    }

    /// Renders and tokenizes a conversation; the mask follows [`ChatTokenizer::loss_on`].
    pub fn tokenize(&self, conv: &Conversation) -> Result<Tokenized, RecordError> {
        if conv.messages.is_empty() {
            return Err(RecordError::Empty);
        }
        self.limits.check(conv)?;
        if self.loss_on == LossOn::Assistant && !conv.has_assistant() {
            return Err(RecordError::NoAssistant);
        }
        if let Some(skeleton) = self.skeleton(conv, true) {
            // The template's values of the messages only where something is rendered for real.
            ChatTemplate::check_messages(&conv.messages)?;
            let (text, usable) = self.skeletons.full_text(&skeleton, &conv.messages, || {
                let values = ChatTemplate::message_values(&conv.messages)?;
                Ok(self.template.render(&values, false)?.text)
            })?;
            // A filled skeleton is refused where rendering it would have been.
            if text.len() > self.limits.max_record_bytes {
                return Err(crate::limits::rendered_over(self.limits.max_record_bytes));
            }
            let spans = self.spans_from(&text, conv, None, Some(&*skeleton).filter(|_| usable))?;
            return self.encode(&text, &spans);
        }
        let values = ChatTemplate::message_values(&conv.messages)?;
        let mut rendered = self.template.render(&values, false)?;
        let spans = match (self.loss_on, self.mask_method()) {
            (LossOn::All, _) => vec![],
            (LossOn::Assistant, MaskMethod::GenerationMarkers) => {
                std::mem::take(&mut rendered.generation_spans)
            }
            (LossOn::Assistant, MaskMethod::TurnByTurn) => {
                self.turn_spans(&rendered.text, conv, &values, true)?
            }
        };
        self.encode(&rendered.text, &spans)
    }

    // transformers: tokenizer(rendered, add_special_tokens=False). Offsets and spans are both in
    // bytes on character boundaries, so overlaps are those of transformers' character offsets.
    fn encode(&self, text: &str, spans: &[(usize, usize)]) -> Result<Tokenized, RecordError> {
        let enc = self.encoder.encode(&self.tokenizer, text)?;
        let loss_mask = match self.loss_on {
            LossOn::All => vec![1; enc.ids.len()],
            LossOn::Assistant => token_mask(&enc.offsets, spans),
        };
        Ok(Tokenized {
            input_ids: enc.ids,
            loss_mask,
        })
    }

    /// The tokenizer as loaded (truncation and padding off).
    pub(crate) fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Byte spans of the assistant's text in `full`, the rendering of `conv` (`values`);
    /// `skeletons`: whether the turn-by-turn method may fill skeletons.
    pub(crate) fn assistant_spans(
        &self,
        full: &str,
        conv: &Conversation,
        values: &[Value],
        skeletons: bool,
    ) -> Result<Vec<(usize, usize)>, RecordError> {
        match self.mask_method() {
            MaskMethod::GenerationMarkers => {
                Ok(self.template.render(values, false)?.generation_spans)
            }
            MaskMethod::TurnByTurn => self.turn_spans(full, conv, values, skeletons),
        }
    }

    fn turn_spans(
        &self,
        full: &str,
        conv: &Conversation,
        values: &[Value],
        skeletons: bool,
    ) -> Result<Vec<(usize, usize)>, RecordError> {
        let skeleton = self.skeleton(conv, skeletons).and_then(|_| {
            self.skeletons
                .for_conversation(&self.template, &conv.messages, full)
        });
        self.spans_from(full, conv, Some(values), skeleton.as_deref())
    }

    // The skeleton for the turn-by-turn mask of `conv`, if `wanted` and one applies.
    fn skeleton(&self, conv: &Conversation, wanted: bool) -> Option<Arc<Skeleton>> {
        if !wanted
            || self.loss_on != LossOn::Assistant
            || self.mask_method() != MaskMethod::TurnByTurn
            || self.template.skeleton_support().is_err()
        {
            return None;
        }
        self.skeletons.get(&self.template, &conv.messages)
    }

    // Turn-by-turn spans with the prefixes from `skeleton`, or rendered (from `values`, the
    // messages' template values, built here if not given).
    fn spans_from(
        &self,
        full: &str,
        conv: &Conversation,
        values: Option<&[Value]>,
        skeleton: Option<&Skeleton>,
    ) -> Result<Vec<(usize, usize)>, RecordError> {
        let roles: Vec<Role> = conv.messages.iter().map(|m| m.role).collect();
        let filled = skeleton.map(|s| s.filled(&conv.messages));
        let mut built = None;
        turn_spans(full, &roles, &self.end_of_turn, |i, prompt| {
            if let Some(text) = filled.as_ref().and_then(|f| f.prefix(i, prompt)) {
                return Ok(text);
            }
            match (i, prompt) {
                // No history: nothing rendered (transformers refuses to render an empty conversation).
                (0, false) => Ok(PrefixText::default()),
                _ => {
                    let values = match values {
                        Some(v) => v,
                        None => built.insert(ChatTemplate::message_values(&conv.messages)?),
                    };
                    Ok(self.template.render(&values[..i], prompt)?.text.into())
                }
            }
        })
    }
}

/// A tiny model directory for tests: a whitespace word-level tokenizer with ChatML specials.
#[cfg(test)]
pub(crate) mod test_model {
    use std::path::{Path, PathBuf};

    use super::{ChatTokenizer, Limits, LossOn};

    /// The words of the vocabulary; a word's id is its index.
    pub const WORDS: &[&str] = &[
        "[UNK]",
        "<|im_start|>",
        "<|im_end|>",
        "system",
        "user",
        "assistant",
        "hi",
        "hello",
        "there",
        "q",
        "a",
    ];

    /// ChatML without generation markers.
    pub const CHATML: &str = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

    /// The same text with the assistant's content and end-of-turn token in a generation block.
    pub const CHATML_MARKED: &str = "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

    /// Loads the model in `dir` for the assistant's mask, held to `limits`.
    pub fn load(dir: &Path, limits: Limits) -> crate::error::Result<ChatTokenizer> {
        ChatTokenizer::from_model_dir(dir, LossOn::Assistant, &Default::default(), limits)
    }

    /// Writes the model with `template` under `dir`.
    pub fn write(dir: &Path, template: &str) -> PathBuf {
        let vocab: serde_json::Map<String, serde_json::Value> = WORDS
            .iter()
            .enumerate()
            .map(|(i, w)| (w.to_string(), i.into()))
            .collect();
        let added: Vec<serde_json::Value> = (0..3)
            .map(|i| serde_json::json!({"id": i, "content": WORDS[i], "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
            .collect();
        let tok = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
        });
        std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"eos_token": "<|im_end|>"}"#,
        )
        .unwrap();
        std::fs::write(dir.join("chat_template.jinja"), template).unwrap();
        dir.to_path_buf()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conversation::Message;

    fn tokenizer(template: &str, loss_on: LossOn) -> (tempfile::TempDir, ChatTokenizer) {
        let dir = tempfile::tempdir().unwrap();
        let model = test_model::write(dir.path(), template);
        let tok =
            ChatTokenizer::from_model_dir(&model, loss_on, &Default::default(), Limits::default())
                .unwrap();
        (dir, tok)
    }

    fn conv(turns: &[(Role, &str)]) -> Conversation {
        Conversation {
            id: None,
            messages: turns.iter().map(|(r, c)| Message::new(*r, *c)).collect(),
        }
    }

    #[test]
    fn turn_by_turn_and_generation_markers_give_the_same_mask() {
        let (_d1, plain) = tokenizer(test_model::CHATML, LossOn::Assistant);
        let (_d2, marked) = tokenizer(test_model::CHATML_MARKED, LossOn::Assistant);
        assert_eq!(plain.mask_method(), MaskMethod::TurnByTurn);
        assert_eq!(marked.mask_method(), MaskMethod::GenerationMarkers);
        let c = conv(&[
            (Role::System, "hi"),
            (Role::User, "q"),
            (Role::Assistant, "hello there"),
            (Role::User, "q"),
            (Role::Assistant, ""),
        ]);
        let a = plain.tokenize(&c).unwrap();
        assert_eq!(a, marked.tokenize(&c).unwrap());
        // system hi | user q | assistant [hello there <|im_end|>] | user q | assistant [<|im_end|>]
        assert_eq!(
            a.input_ids,
            [1, 3, 6, 2, 1, 4, 9, 2, 1, 5, 7, 8, 2, 1, 4, 9, 2, 1, 5, 2]
        );
        assert_eq!(
            a.loss_mask,
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1]
        );
    }

    // Each conversation's assistant spans.
    type Spans = Vec<Vec<(usize, usize)>>;

    // The assistant spans of `convs`, with skeletons and with every prefix rendered.
    fn both_ways(tok: &ChatTokenizer, convs: &[Conversation]) -> (Spans, Spans) {
        let spans = |skeletons| {
            convs
                .iter()
                .map(|c| {
                    let values = ChatTemplate::message_values(&c.messages).unwrap();
                    let full = tok.template.render(&values, false).unwrap().text;
                    tok.assistant_spans(&full, c, &values, skeletons).unwrap()
                })
                .collect::<Vec<_>>()
        };
        let rendered = spans(false);
        (spans(true), rendered)
    }

    fn varied() -> Vec<Conversation> {
        let mut out = vec![];
        for (q, a) in [("q", "hello there"), ("hi", ""), ("q q", "a \u{10FFFB}")] {
            out.push(conv(&[(Role::User, q), (Role::Assistant, a)]));
            out.push(conv(&[
                (Role::System, "hi"),
                (Role::User, q),
                (Role::Assistant, a),
                (Role::User, a),
                (Role::Assistant, q),
            ]));
        }
        out
    }

    #[test]
    fn fills_one_skeleton_per_role_sequence_with_the_spans_of_rendering_every_prefix() {
        let (_d, tok) = tokenizer(test_model::CHATML, LossOn::Assistant);
        assert_eq!(
            tok.prefix_renderings(),
            "filled skeletons (one rendering per role sequence)"
        );
        let convs = varied();
        let (filled, rendered) = both_ways(&tok, &convs);
        assert_eq!(filled, rendered);
        // Two role sequences; the conversations holding the sentinel character rendered theirs.
        assert_eq!(tok.skeletons.len(), 2);
        assert!(filled[1].len() == 2 && filled[0].len() == 1);
    }

    #[test]
    fn fills_the_rendering_itself_once_a_skeleton_reproduced_its_first_conversations() {
        let (_d1, plain) = tokenizer(test_model::CHATML, LossOn::Assistant);
        let (_d2, marked) = tokenizer(test_model::CHATML_MARKED, LossOn::Assistant);
        let words = ["hi", "hello", "there", "q", "a", ""];
        for i in 0..40 {
            let (q, a) = (words[i % 6], words[(i / 6) % 6]);
            let c = conv(&[
                (Role::System, a),
                (Role::User, q),
                (Role::Assistant, a),
                (Role::User, a),
                (Role::Assistant, q),
            ]);
            assert_eq!(
                plain.tokenize(&c).unwrap(),
                marked.tokenize(&c).unwrap(),
                "conversation {i}"
            );
        }
        let c = conv(&[
            (Role::System, ""),
            (Role::User, ""),
            (Role::Assistant, ""),
            (Role::User, ""),
            (Role::Assistant, ""),
        ]);
        let skeleton = plain.skeleton(&c, true).unwrap();
        assert_eq!(skeleton.checked(), 16);
        assert_eq!(plain.skeletons.len(), 1);
    }

    #[test]
    fn renders_every_prefix_for_templates_that_inspect_texts() {
        // Qwen3-like: an earlier turn's reasoning is dropped, which depends on its text.
        let qwen_like = "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}{{ '<|im_start|>assistant\n' + m.content.split('</think>')[-1] + '<|im_end|>\n' }}{% else %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
        let (_d, tok) = tokenizer(qwen_like, LossOn::Assistant);
        assert!(
            tok.prefix_renderings().starts_with(
                "every prefix rendered (line 2: a message's content is used other than printed"
            ),
            "{}",
            tok.prefix_renderings()
        );
        let (filled, rendered) = both_ways(&tok, &varied());
        assert_eq!(filled, rendered);
        assert!(tok.skeletons.is_empty());
    }

    #[test]
    fn reads_fields_of_template_data_named_like_message_texts_as_they_are() {
        // `sys.content` is the template's own text, printed only after the generation prompt:
        // a skeleton that read it as a message's would get every prompted prefix wrong.
        let data = "{% set sys = {'content': 'hello'} %}{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' + sys['content'] }}{% endif %}";
        let (_d, tok) = tokenizer(data, LossOn::Assistant);
        assert_eq!(
            tok.prefix_renderings(),
            "filled skeletons (one rendering per role sequence)"
        );
        let (filled, rendered) = both_ways(&tok, &varied());
        assert_eq!(filled, rendered);
        assert_eq!(tok.skeletons.len(), 2);
    }

    #[test]
    fn stops_filling_skeletons_once_a_rendering_lists_a_message() {
        // The syntax tree cannot tell that `items` reaches the text; the skeleton's message can.
        let listing = "{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% if m | items | list | length > 9 %}!{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
        let (_d, tok) = tokenizer(listing, LossOn::Assistant);
        assert_eq!(
            tok.prefix_renderings(),
            "filled skeletons (one rendering per role sequence)"
        );
        let (filled, rendered) = both_ways(&tok, &varied());
        assert_eq!(filled, rendered);
        assert_eq!(
            tok.prefix_renderings(),
            "every prefix rendered (a message's fields are listed (items(), tojson, iteration))"
        );
        assert!(tok.skeletons.is_empty());
        // A computed name reaches the text too.
        let computed = listing.replace("m | items | list | length > 9", "m['con' ~ 'tent'] == 'x'");
        let (_d, tok) = tokenizer(&computed, LossOn::Assistant);
        assert_eq!(both_ways(&tok, &varied()).0, both_ways(&tok, &varied()).1);
        assert_eq!(
            tok.prefix_renderings(),
            "every prefix rendered (a message's content is read by a computed name)"
        );
    }

    #[test]
    fn ignores_truncation_and_padding_set_in_tokenizer_json() {
        // transformers' apply_chat_template turns both off; so must we.
        let dir = tempfile::tempdir().unwrap();
        let model = test_model::write(dir.path(), test_model::CHATML);
        let path = model.join("tokenizer.json");
        let mut json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        json["truncation"] = serde_json::json!({"direction": "Right", "max_length": 3, "strategy": "LongestFirst", "stride": 0});
        json["padding"] = serde_json::json!({"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0, "pad_token": "[UNK]"});
        std::fs::write(&path, json.to_string()).unwrap();
        let tok = test_model::load(&model, Limits::default()).unwrap();
        let t = tok
            .tokenize(&conv(&[
                (Role::User, "q"),
                (Role::Assistant, "hello there"),
            ]))
            .unwrap();
        assert_eq!(t.input_ids, [1, 4, 9, 2, 1, 5, 7, 8, 2]);
    }

    #[test]
    fn refuses_renderings_over_the_byte_bound_whether_rendered_or_filled() {
        let dir = tempfile::tempdir().unwrap();
        let model = test_model::write(dir.path(), test_model::CHATML);
        let limits = Limits {
            max_record_bytes: 100,
            ..Default::default()
        };
        let tok = test_model::load(&model, limits).unwrap();
        // 73 bytes of text, 134 rendered.
        let long = conv(&[(Role::User, "q"), (Role::Assistant, &"hello ".repeat(12))]);
        let over = crate::limits::rendered_over(100);
        assert_eq!(tok.tokenize(&long), Err(over.clone()));
        for _ in 0..20 {
            tok.tokenize(&conv(&[(Role::User, "q"), (Role::Assistant, "hi")]))
                .unwrap();
        }
        // Now the filled skeleton stands for the rendering, and is refused the same way.
        assert_eq!(tok.skeleton(&long, true).unwrap().checked(), 16);
        assert_eq!(tok.tokenize(&long), Err(over));
    }

    #[test]
    fn all_tokens_get_loss_with_loss_on_all() {
        let (_d, tok) = tokenizer(test_model::CHATML, LossOn::All);
        let t = tok.tokenize(&conv(&[(Role::User, "q")])).unwrap();
        assert_eq!(t.loss_mask, [1; 4]);
    }

    #[test]
    fn refuses_conversations_without_an_assistant_turn() {
        let (_d, tok) = tokenizer(test_model::CHATML, LossOn::Assistant);
        assert_eq!(
            tok.tokenize(&conv(&[(Role::User, "q")])).unwrap_err(),
            RecordError::NoAssistant
        );
        assert_eq!(tok.tokenize(&conv(&[])).unwrap_err(), RecordError::Empty);
    }

    #[test]
    fn takes_end_of_turn_tokens_from_generation_config() {
        let dir = tempfile::tempdir().unwrap();
        let model = test_model::write(dir.path(), test_model::CHATML);
        std::fs::write(
            model.join("generation_config.json"),
            r#"{"eos_token_id": [2, 0]}"#,
        )
        .unwrap();
        let tok = test_model::load(&model, Limits::default()).unwrap();
        assert_eq!(tok.end_of_turn(), ["<|im_end|>", "[UNK]"]);
        std::fs::write(
            model.join("generation_config.json"),
            r#"{"eos_token_id": 99}"#,
        )
        .unwrap();
        let e = test_model::load(&model, Limits::default()).err().unwrap();
        assert!(
            e.to_string()
                .contains("eos_token_id 99 is not in the tokenizer's vocabulary"),
            "{e}"
        );
    }

    #[test]
    fn names_a_model_without_tokenizer_json() {
        let dir = tempfile::tempdir().unwrap();
        let e = test_model::load(dir.path(), Limits::default())
            .err()
            .unwrap();
        assert!(e.to_string().contains("no tokenizer.json"), "{e}");
    }
}
