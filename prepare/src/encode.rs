//! Rendered text to token ids with each token's byte range, exactly as `tokenizers` encodes it
//! with `add_special_tokens=false`.
//!
//! Two paths, chosen once per tokenizer ([`EncodePath`]):
//! - **byte-level BPE** (GPT-2, Llama 3, Qwen, DeepSeek-V3, SmolLM2 …): the same steps as
//!   `tokenizers` — split off added tokens (two leftmost-longest passes, tokens matched on the raw
//!   text first, then those marked `normalized`), split each remaining segment with the
//!   pre-tokenizer's regex, map each piece to byte-level characters and hand it to the
//!   tokenizer's own BPE model — but without `tokenizers`' per-character alignment bookkeeping,
//!   which cost most of an encode. A token's byte range follows from the bytes it stands for
//!   (byte-level BPE tokens cover their piece's bytes in order, one byte per character), widened
//!   to character boundaries as `tokenizers`' offsets are. Pieces are cached per thread, so a
//!   word or a template's recurring text is split into tokens once.
//! - **full**: `Tokenizer::encode`, for every other tokenizer (a normalizer, a prefix space,
//!   offsets trimmed by the post-processor, added tokens that strip spaces or match whole words,
//!   a model other than BPE, BPE dropout), each a named reason. A byte-level encode whose tokens
//!   do not cover their piece exactly also falls back to it, for that text.
use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};

use daachorse::{DoubleArrayAhoCorasick, DoubleArrayAhoCorasickBuilder, MatchKind};
use rustc_hash::FxHashMap;
use tokenizers::models::ModelWrapper;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::utils::SysRegex;
use tokenizers::{Model, SplitDelimiterBehavior, Tokenizer};

use crate::error::RecordError;

/// The regex `tokenizers`' `ByteLevel` pre-tokenizer splits with when `use_regex` is set (GPT-2's).
const GPT2_SPLIT: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Pieces longer than this are tokenized without the cache (long runs of one character, code).
const CACHED_PIECE_BYTES: usize = 256;
/// Bytes a thread's piece cache may hold (keys, tokens and a per-entry estimate) before it starts
/// over: bounded per thread, so a many-core host does not multiply an unbounded cache.
const CACHE_BYTES: usize = if cfg!(test) { 4 << 10 } else { 16 << 20 };
// What one entry costs beyond its key and tokens: the two boxes' headers and the table slot.
const CACHE_ENTRY_OVERHEAD: usize = 64;

/// Which way text is encoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EncodePath {
    /// The direct byte-level BPE path.
    ByteLevelBpe,
    /// `Tokenizer::encode`, and why the direct path does not apply.
    Full {
        /// What in the tokenizer rules the direct path out.
        reason: String,
    },
}

impl std::fmt::Display for EncodePath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EncodePath::ByteLevelBpe => f.write_str("byte-level BPE, direct"),
            EncodePath::Full { reason } => write!(f, "tokenizers' full encode ({reason})"),
        }
    }
}

/// Token ids and each token's `[start, end)` byte range in the text, on character boundaries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Encoded {
    /// Token ids.
    pub ids: Vec<u32>,
    /// Byte ranges, one per token.
    pub offsets: Vec<(usize, usize)>,
}

/// Encodes text the way a loaded `tokenizer.json` does.
pub struct Encoder {
    direct: Result<ByteLevelBpe, String>,
}

struct ByteLevelBpe {
    // Added tokens matched on the raw text, then those matched on normalized text (identical
    // here: the direct path has no normalizer).
    raw_added: Option<DoubleArrayAhoCorasick<u32>>,
    normalized_added: Option<DoubleArrayAhoCorasick<u32>>,
    // Each splits the pieces of the one before.
    splits: Vec<SysRegex>,
    // The only split regex is GPT-2's, which ASCII text may skip (`gpt2_ascii_split`).
    gpt2: bool,
    byte_char: [char; 256],
    // Tells this encoder's entries in a thread's cache from another encoder's.
    cache_owner: u64,
}

// GPT-2's byte-to-character table, as `tokenizers`' ByteLevel builds it: printable Latin-1
// bytes stand for themselves, the others for U+0100 onwards in byte order.
fn byte_chars() -> [char; 256] {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        table[b as usize] = if printable(b) {
            char::from(b)
        } else {
            next += 1;
            char::from_u32(next - 1).expect("U+0100..U+0143 are characters")
        };
    }
    table
}

// The regexes, applied in turn, of a pre-tokenizer the direct path reproduces: ByteLevel with
// its own (GPT-2's) regex, or Splits that isolate their matches (Llama 3, Qwen, DeepSeek-V3)
// followed by a ByteLevel, with or without its regex. No prefix space.
fn split_regexes(pre: Option<&PreTokenizerWrapper>) -> Result<Vec<String>, String> {
    let steps: &[PreTokenizerWrapper] = match pre {
        Some(PreTokenizerWrapper::Sequence(seq)) => seq.as_ref(),
        Some(p) => std::slice::from_ref(p),
        None => &[],
    };
    let Some((PreTokenizerWrapper::ByteLevel(bl), splits)) = steps.split_last() else {
        return Err("the pre-tokenizer does not end in ByteLevel".into());
    };
    if bl.add_prefix_space {
        return Err("the ByteLevel pre-tokenizer adds a prefix space".into());
    }
    let mut out = vec![];
    for step in splits {
        let PreTokenizerWrapper::Split(split) = step else {
            return Err("the pre-tokenizer has steps other than Split before ByteLevel".into());
        };
        if split.invert || split.behavior != SplitDelimiterBehavior::Isolated {
            return Err("a Split pre-tokenizer does not isolate its matches".into());
        }
        // The pattern as tokenizers compiles it: a string matches literally.
        let json = serde_json::to_value(&split.pattern).map_err(|e| e.to_string())?;
        out.push(match (json.get("Regex"), json.get("String")) {
            (Some(serde_json::Value::String(re)), _) => re.clone(),
            (_, Some(serde_json::Value::String(s))) => regex::escape(s),
            _ => return Err(format!("unknown Split pattern {json}")),
        });
    }
    if bl.use_regex {
        out.push(GPT2_SPLIT.to_string());
    }
    Ok(out)
}

// Whether the post-processor leaves ids and offsets alone without special tokens added.
fn post_processor_ok(pp: &PostProcessorWrapper) -> Result<(), String> {
    match pp {
        PostProcessorWrapper::ByteLevel(bl) if bl.trim_offsets => {
            Err("the ByteLevel post-processor trims offsets".into())
        }
        PostProcessorWrapper::Roberta(r) if r.trim_offsets => {
            Err("the Roberta post-processor trims offsets".into())
        }
        PostProcessorWrapper::Sequence(seq) => (0..)
            .map_while(|i| seq.get(i))
            .try_for_each(post_processor_ok),
        _ => Ok(()),
    }
}

fn added_matcher(pairs: Vec<(&str, u32)>) -> Result<Option<DoubleArrayAhoCorasick<u32>>, String> {
    if pairs.is_empty() {
        return Ok(None);
    }
    DoubleArrayAhoCorasickBuilder::new()
        .match_kind(MatchKind::LeftmostLongest)
        .build_with_values(pairs)
        .map(Some)
        .map_err(|e| format!("cannot build the added-token matcher: {e}"))
}

impl ByteLevelBpe {
    fn new(tokenizer: &Tokenizer) -> Result<Self, String> {
        if tokenizer.get_normalizer().is_some() {
            return Err("the tokenizer has a normalizer".into());
        }
        let patterns = split_regexes(tokenizer.get_pre_tokenizer())?;
        if let Some(pp) = tokenizer.get_post_processor() {
            post_processor_ok(pp)?;
        }
        match tokenizer.get_model() {
            ModelWrapper::BPE(bpe) if bpe.dropout.is_none_or(|p| p == 0.0) => {}
            ModelWrapper::BPE(_) => return Err("the BPE model uses dropout".into()),
            _ => return Err("the model is not BPE".into()),
        }
        if tokenizer.get_encode_special_tokens() {
            return Err("special tokens are encoded as text".into());
        }
        let decoder = tokenizer.get_added_tokens_decoder();
        let (mut raw, mut normalized) = (vec![], vec![]);
        for (id, t) in &decoder {
            if t.lstrip || t.rstrip || t.single_word {
                return Err(format!(
                    "added token {:?} strips spaces or matches whole words only",
                    t.content
                ));
            }
            if !t.content.is_empty() {
                if t.normalized {
                    normalized.push((t.content.as_str(), *id));
                } else {
                    raw.push((t.content.as_str(), *id));
                }
            }
        }
        static OWNERS: AtomicU64 = AtomicU64::new(0);
        Ok(ByteLevelBpe {
            raw_added: added_matcher(raw)?,
            normalized_added: added_matcher(normalized)?,
            splits: patterns
                .iter()
                .map(|p| {
                    SysRegex::new(p)
                        .map_err(|e| format!("cannot compile the split regex {p:?}: {e}"))
                })
                .collect::<Result<_, _>>()?,
            gpt2: patterns == [GPT2_SPLIT],
            byte_char: byte_chars(),
            cache_owner: OWNERS.fetch_add(1, Ordering::Relaxed),
        })
    }

    // Appends the added-token and text segments of `text`, which starts at byte `base` of the
    // whole, to `out`, as tokenizers' `find_matches` splits them.
    fn split_added(
        matcher: Option<&DoubleArrayAhoCorasick<u32>>,
        text: &str,
        base: usize,
        out: &mut Vec<(usize, usize, Option<u32>)>,
    ) {
        let Some(m) = matcher else {
            out.push((base, base + text.len(), None));
            return;
        };
        let mut at = 0;
        for hit in m.leftmost_find_iter(text) {
            if at < hit.start() {
                out.push((base + at, base + hit.start(), None));
            }
            out.push((base + hit.start(), base + hit.end(), Some(hit.value())));
            at = hit.end();
        }
        if at < text.len() {
            out.push((base + at, base + text.len(), None));
        }
    }

    // Ids and byte lengths of one piece, as the BPE model splits it; None when the model's
    // tokens do not cover the piece's bytes in order.
    fn encode_piece(
        &self,
        tokenizer: &Tokenizer,
        piece: &str,
    ) -> Result<Option<Vec<(u32, u32)>>, RecordError> {
        let mut mapped = String::with_capacity(piece.len() * 2);
        // Byte k of the piece is the character starting at mapped byte `starts[k]`.
        let mut starts = Vec::with_capacity(piece.len() + 1);
        for &b in piece.as_bytes() {
            starts.push(mapped.len());
            mapped.push(self.byte_char[b as usize]);
        }
        starts.push(mapped.len());
        let tokens = tokenizer
            .get_model()
            .tokenize(&mapped)
            .map_err(|e| RecordError::Tokenize(e.to_string()))?;
        let mut out = Vec::with_capacity(tokens.len());
        let mut at = 0usize;
        for t in tokens {
            let (s, e) = t.offsets;
            let (Ok(start), Ok(end)) = (starts.binary_search(&s), starts.binary_search(&e)) else {
                return Ok(None);
            };
            if start != at || end <= start {
                return Ok(None);
            }
            out.push((t.id, (end - start) as u32));
            at = end;
        }
        Ok((at == piece.len()).then_some(out))
    }

    fn encode(&self, tokenizer: &Tokenizer, text: &str) -> Result<Option<Encoded>, RecordError> {
        let mut segments = Vec::new();
        let mut raw = Vec::new();
        Self::split_added(self.raw_added.as_ref(), text, 0, &mut raw);
        for (s, e, id) in raw {
            match id {
                Some(_) => segments.push((s, e, id)),
                None => Self::split_added(
                    self.normalized_added.as_ref(),
                    &text[s..e],
                    s,
                    &mut segments,
                ),
            }
        }
        let mut enc = Encoded {
            ids: Vec::with_capacity(text.len() / 3),
            offsets: Vec::with_capacity(text.len() / 3),
        };
        let mut pieces = Vec::new();
        CACHE
            .with(|cache| -> Result<Option<()>, RecordError> {
                let mut cache = cache.borrow_mut();
                if cache.owner != Some(self.cache_owner) || cache.bytes >= CACHE_BYTES {
                    cache.owner = Some(self.cache_owner);
                    cache.pieces.clear();
                    cache.bytes = 0;
                }
                for (s, e, id) in segments {
                    if let Some(id) = id {
                        enc.ids.push(id);
                        enc.offsets.push((s, e));
                        continue;
                    }
                    let segment = &text[s..e];
                    pieces.clear();
                    if self.gpt2 && gpt2_ascii_applies(segment) {
                        gpt2_ascii_split(segment, &mut pieces);
                    } else {
                        pieces.push((0, segment.len()));
                        for re in &self.splits {
                            let whole = std::mem::take(&mut pieces);
                            for (ws, we) in whole {
                                let from = pieces.len();
                                regex_split(re, &segment[ws..we], &mut pieces);
                                for p in &mut pieces[from..] {
                                    *p = (p.0 + ws, p.1 + ws);
                                }
                            }
                        }
                    }
                    for &(ps, pe) in &pieces {
                        let piece = &segment[ps..pe];
                        let start = s + ps;
                        if let Some(tokens) = cache.pieces.get(piece) {
                            push_tokens(&mut enc, start, tokens);
                            continue;
                        }
                        let Some(tokens) = self.encode_piece(tokenizer, piece)? else {
                            return Ok(None);
                        };
                        push_tokens(&mut enc, start, &tokens);
                        if piece.len() <= CACHED_PIECE_BYTES {
                            cache.bytes += piece.len()
                                + std::mem::size_of_val(tokens.as_slice())
                                + CACHE_ENTRY_OVERHEAD;
                            cache.pieces.insert(piece.into(), tokens.into_boxed_slice());
                        }
                    }
                }
                Ok(Some(()))
            })
            .map(|done| {
                done.map(|()| {
                    widen_to_chars(text, &mut enc.offsets);
                    enc
                })
            })
    }
}

// GPT-2's split regex without the regex engine, for text of printable ASCII, tab, CR and LF
// only (where `\p{L}` is [A-Za-z], `\p{N}` is [0-9] and `\s` is space, tab, CR, LF): the
// alternatives tried in order at each position, as Oniguruma does. Other text goes to the
// engine; `ascii_split_equals_the_regex` checks the two agree.
#[derive(Clone, Copy, PartialEq, Eq)]
enum AsciiClass {
    Letter,
    Number,
    Space,
    Other,
}

fn ascii_class(b: u8) -> AsciiClass {
    match b {
        b'a'..=b'z' | b'A'..=b'Z' => AsciiClass::Letter,
        b'0'..=b'9' => AsciiClass::Number,
        b' ' | b'\t' | b'\n' | b'\r' => AsciiClass::Space,
        _ => AsciiClass::Other,
    }
}

fn gpt2_ascii_applies(text: &str) -> bool {
    text.bytes()
        .all(|b| (0x20..0x7f).contains(&b) || matches!(b, b'\t' | b'\n' | b'\r'))
}

// Bytes of the contraction (after the apostrophe) that `'s|'t|'re|'ve|'m|'ll|'d` match.
fn contraction(rest: &[u8]) -> Option<usize> {
    match rest {
        [b's' | b't' | b'm' | b'd', ..] => Some(1),
        [b'r', b'e', ..] | [b'v', b'e', ..] | [b'l', b'l', ..] => Some(2),
        _ => None,
    }
}

fn gpt2_ascii_split(text: &str, out: &mut Vec<(usize, usize)>) {
    let s = text.as_bytes();
    let n = s.len();
    let run_end = |from: usize, class: AsciiClass| {
        s[from..]
            .iter()
            .position(|&b| ascii_class(b) != class)
            .map_or(n, |p| from + p)
    };
    let mut i = 0;
    while i < n {
        let next = s.get(i + 1).map(|&b| ascii_class(b));
        let end = match (s[i], ascii_class(s[i]), next) {
            // 's 't 're 've 'm 'll 'd
            (b'\'', _, _) if contraction(&s[i + 1..]).is_some() => {
                i + 1 + contraction(&s[i + 1..]).unwrap_or(0)
            }
            // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: an optional space, then a run.
            (b' ', _, Some(c)) if c != AsciiClass::Space => run_end(i + 1, c),
            (_, c, _) if c != AsciiClass::Space => run_end(i, c),
            // `\s+(?!\S)` gives back the last space of a run that a non-space follows; `\s+`
            // takes a lone one.
            _ => {
                let j = run_end(i, AsciiClass::Space);
                if j < n && j - i >= 2 {
                    j - 1
                } else {
                    j
                }
            }
        };
        out.push((i, end));
        i = end;
    }
}

// Isolated pieces of `text` by `re`: every match, and the text between matches.
fn regex_split(re: &SysRegex, text: &str, out: &mut Vec<(usize, usize)>) {
    let mut at = 0;
    for (start, end) in re.find_iter(text) {
        if at < start {
            out.push((at, start));
        }
        if start < end {
            out.push((start, end));
        }
        at = end;
    }
    if at < text.len() {
        out.push((at, text.len()));
    }
}

fn push_tokens(enc: &mut Encoded, mut pos: usize, tokens: &[(u32, u32)]) {
    for &(id, len) in tokens {
        enc.ids.push(id);
        enc.offsets.push((pos, pos + len as usize));
        pos += len as usize;
    }
}

// A token inside a multi-byte character covers the whole character in tokenizers' offsets.
fn widen_to_chars(text: &str, offsets: &mut [(usize, usize)]) {
    if text.is_ascii() {
        return;
    }
    for (s, e) in offsets.iter_mut() {
        while !text.is_char_boundary(*s) {
            *s -= 1;
        }
        while !text.is_char_boundary(*e) {
            *e += 1;
        }
    }
}

#[derive(Default)]
struct PieceCache {
    owner: Option<u64>,
    pieces: FxHashMap<Box<str>, Box<[(u32, u32)]>>,
    // Estimated size of `pieces`.
    bytes: usize,
}

thread_local! {
    static CACHE: RefCell<PieceCache> = RefCell::default();
}

impl Encoder {
    /// Chooses the path for `tokenizer`.
    pub fn new(tokenizer: &Tokenizer) -> Self {
        Encoder {
            direct: ByteLevelBpe::new(tokenizer),
        }
    }

    /// The path this encoder takes.
    pub fn path(&self) -> EncodePath {
        match &self.direct {
            Ok(_) => EncodePath::ByteLevelBpe,
            Err(reason) => EncodePath::Full {
                reason: reason.clone(),
            },
        }
    }

    /// Encodes `text` as `tokenizer.encode(text, false)` does, byte offsets included.
    pub fn encode(&self, tokenizer: &Tokenizer, text: &str) -> Result<Encoded, RecordError> {
        if let Ok(direct) = &self.direct {
            if let Some(enc) = direct.encode(tokenizer, text)? {
                return Ok(enc);
            }
            tracing::debug!("byte-level tokens do not cover their text; full encode instead");
        }
        let enc = tokenizer
            .encode(text, false)
            .map_err(|e| RecordError::Tokenize(e.to_string()))?;
        Ok(Encoded {
            ids: enc.get_ids().to_vec(),
            offsets: enc.get_offsets().to_vec(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::str::FromStr;

    // Text as byte-level characters (what the BPE vocabulary is written in).
    fn bl(s: &str) -> String {
        let table = byte_chars();
        s.bytes().map(|b| table[b as usize]).collect()
    }

    // A small byte-level BPE tokenizer.json: every byte, a few merges (one inside "é", one
    // inside an emoji, so tokens end mid-character), ChatML specials and a `normalized` added
    // token; `edit` changes the JSON before it is loaded.
    fn tokenizer(edit: impl FnOnce(&mut serde_json::Value)) -> Tokenizer {
        let mut vocab: Vec<String> = byte_chars().iter().map(|c| c.to_string()).collect();
        let emoji = bl("🙂");
        let emoji: Vec<String> = emoji.chars().map(String::from).collect();
        let merges: Vec<(String, String)> = vec![
            ("h".into(), "e".into()),
            ("l".into(), "l".into()),
            ("he".into(), "ll".into()),
            ("hell".into(), "o".into()),
            (bl(" "), "w".into()),
            (bl(" w"), "o".into()),
            (bl("é")[..2].into(), bl("é")[2..].into()),
            (emoji[0].clone(), emoji[1].clone()),
        ];
        for (a, b) in &merges {
            vocab.push(format!("{a}{b}"));
        }
        let added = |id: usize, content: &str, normalized: bool| {
            serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": normalized, "special": !normalized})
        };
        let n = vocab.len();
        let vocab: serde_json::Map<String, serde_json::Value> = vocab
            .into_iter()
            .enumerate()
            .map(|(i, t)| (t, i.into()))
            .collect();
        let mut json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [added(n, "<|im_start|>", false), added(n + 1, "<|im_end|>", false), added(n + 2, "<x>", true)],
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "post_processor": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
            "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": merges}
        });
        edit(&mut json);
        Tokenizer::from_str(&json.to_string()).unwrap()
    }

    const TEXTS: &[&str] = &[
        "",
        "hello world",
        "<|im_start|>user\nhéllo 🙂🙂 wo<|im_end|>\n<|im_start|>assistant\n",
        "<|im_end|><|im_end|>x<|im_end|",
        "a<x>b <x><|im_start|><x>",
        "  lots   of\n\n spaces \t\r\n ",
        "it's they'll 42 3.14 -- !!",
        "e\u{301} 日本語 👩‍👩‍👧‍👦 🇫🇷 héhé",
        "\u{200b}zero\u{200d}width",
    ];

    fn assert_same_as_tokenizers(tok: &Tokenizer, enc: &Encoder) {
        for text in TEXTS {
            let want = tok.encode(*text, false).unwrap();
            let got = enc.encode(tok, text).unwrap();
            assert_eq!(got.ids, want.get_ids(), "ids of {text:?}");
            assert_eq!(got.offsets, want.get_offsets(), "offsets of {text:?}");
        }
    }

    #[test]
    fn ascii_split_equals_the_regex() {
        let re = SysRegex::new(GPT2_SPLIT).unwrap();
        let check = |text: &str| {
            assert!(gpt2_ascii_applies(text), "{text:?}");
            let (mut want, mut got) = (vec![], vec![]);
            regex_split(&re, text, &mut want);
            gpt2_ascii_split(text, &mut got);
            assert_eq!(got, want, "pieces of {text:?}");
        };
        for text in [
            "",
            " ",
            "  ",
            "it's",
            "'s'll'd'm're've't",
            "'S 'l 'r ''s",
            "x' '",
            "  a",
            "\n\n a",
            "a  \n",
            "a \t b",
            "\r\n\r\nx",
            "3.14 42abc",
            " !? ?! a",
            "  42  ",
            "don't  'll",
        ] {
            check(text);
        }
        // Random text over the characters the alternatives care about.
        let alphabet = b"aZst dmrevl'09 \t\n\r !?._-";
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for len in 0..48 {
            for _ in 0..300 {
                let text: String = (0..len)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        alphabet[(x % alphabet.len() as u64) as usize] as char
                    })
                    .collect();
                check(&text);
            }
        }
        // Text outside printable ASCII, tab, CR and LF goes to the regex engine.
        for text in ["é", "a\u{b}b", "a\u{c}", "\u{1c}", "\u{7f}", "\0"] {
            assert!(!gpt2_ascii_applies(text), "{text:?}");
        }
    }

    #[test]
    fn byte_level_bpe_encodes_as_tokenizers_does() {
        let tok = tokenizer(|_| {});
        let enc = Encoder::new(&tok);
        assert_eq!(enc.path(), EncodePath::ByteLevelBpe);
        // Twice: the second time every piece comes from the cache.
        assert_same_as_tokenizers(&tok, &enc);
        assert_same_as_tokenizers(&tok, &enc);
        // A token inside "é" covers the whole character, as tokenizers' offsets do.
        let e = enc.encode(&tok, "é🙂").unwrap();
        assert_eq!(e.offsets, [(0, 2), (2, 6), (2, 6), (2, 6)]);
    }

    #[test]
    fn the_piece_cache_stays_within_its_bound_and_starts_over() {
        let tok = tokenizer(|_| {});
        let enc = Encoder::new(&tok);
        let mut peak = 0;
        for i in 0..2000 {
            // Distinct pieces, each cached once.
            let text = format!("w{i} hello{i}");
            let want = tok.encode(text.as_str(), false).unwrap();
            assert_eq!(enc.encode(&tok, &text).unwrap().ids, want.get_ids());
            peak = peak.max(CACHE.with(|c| c.borrow().bytes));
        }
        assert!(peak > CACHE_BYTES / 2, "the cache was used: {peak}");
        assert!(
            peak < CACHE_BYTES + 2 * (CACHED_PIECE_BYTES + CACHE_ENTRY_OVERHEAD) * 8,
            "{peak}"
        );
        assert!(CACHE.with(|c| c.borrow().pieces.len()) < 2000);
    }

    #[test]
    fn a_split_then_byte_level_pre_tokenizer_takes_the_direct_path() {
        // Llama 3 and Qwen: the split regex is a Split pre-tokenizer, ByteLevel only maps bytes.
        let tok = tokenizer(|j| {
            j["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]});
        });
        let enc = Encoder::new(&tok);
        assert_eq!(enc.path(), EncodePath::ByteLevelBpe);
        assert_same_as_tokenizers(&tok, &enc);
        // DeepSeek-V3: several Splits in turn (digits, CJK runs, then the word regex), and a
        // ByteLevel that splits once more with its own regex.
        let tok = tokenizer(|j| {
            j["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": r"\p{N}{1,3}"}, "behavior": "Isolated", "invert": false},
                {"type": "Split", "pattern": {"Regex": "[一-龥぀-ゟ゠-ヿ]+"}, "behavior": "Isolated", "invert": false},
                {"type": "Split", "pattern": {"String": "o w"}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true}]});
        });
        let enc = Encoder::new(&tok);
        assert_eq!(enc.path(), EncodePath::ByteLevelBpe);
        assert_same_as_tokenizers(&tok, &enc);
    }

    #[test]
    fn other_tokenizers_fall_back_to_the_full_encode_with_the_reason() {
        type Edit = Box<dyn Fn(&mut serde_json::Value)>;
        let cases: [(&str, Edit); 7] = [
            (
                "does not isolate",
                Box::new(|j| {
                    j["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": " "}, "behavior": "MergedWithNext", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]})
                }),
            ),
            (
                "does not end in ByteLevel",
                Box::new(|j| j["pre_tokenizer"] = serde_json::json!({"type": "Whitespace"})),
            ),
            (
                "normalizer",
                Box::new(|j| j["normalizer"] = serde_json::json!({"type": "NFC"})),
            ),
            (
                "adds a prefix space",
                Box::new(|j| j["pre_tokenizer"]["add_prefix_space"] = true.into()),
            ),
            (
                "trims offsets",
                Box::new(|j| j["post_processor"]["trim_offsets"] = true.into()),
            ),
            (
                "strips spaces",
                Box::new(|j| j["added_tokens"][1]["lstrip"] = true.into()),
            ),
            ("dropout", Box::new(|j| j["model"]["dropout"] = 0.5.into())),
        ];
        for (reason, edit) in cases {
            let tok = tokenizer(edit);
            let enc = Encoder::new(&tok);
            match enc.path() {
                EncodePath::Full { reason: r } => assert!(r.contains(reason), "{r}"),
                p => panic!("{reason}: {p}"),
            }
            if reason != "dropout" {
                assert_same_as_tokenizers(&tok, &enc);
            }
        }
    }
}
