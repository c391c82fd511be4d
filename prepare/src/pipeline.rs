//! Conversations to samples: chunks of records tokenized in parallel (rayon), written in input
//! order, every refused record named and counted.
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use rayon::prelude::*;

use crate::chat_tokenizer::{ChatTokenizer, LossOn, Tokenized};
use crate::error::{PrepareError, RecordError, Result};
use crate::mask::MaskMethod;
use crate::output::Sample;
use crate::source::{read_conversations, ConversationRecord};
use hslake_schemas::Overlong;

/// Settings of a run.
#[derive(Debug, Clone)]
pub struct PrepareOptions {
    /// Longest sample kept as is.
    pub max_seq_len: Option<usize>,
    /// What to do with longer ones.
    pub overlong: Overlong,
    /// Stop at the first refused record instead of counting it.
    pub strict: bool,
    /// Records tokenized together (one parallel step).
    pub chunk_size: usize,
    /// Bytes of message text a chunk holds at most (a chunk ends early once it holds this
    /// much), so that chunks of long records do not hold gigabytes before they are tokenized.
    pub chunk_bytes: usize,
}

impl Default for PrepareOptions {
    fn default() -> Self {
        PrepareOptions {
            max_seq_len: None,
            overlong: Overlong::Truncate,
            strict: false,
            chunk_size: 1024,
            chunk_bytes: 64 << 20,
        }
    }
}

impl PrepareOptions {
    /// Refuses `max_seq_len` 0: every sample would be empty, and capture refuses those.
    pub fn validate(&self) -> Result<()> {
        if self.max_seq_len == Some(0) {
            return Err(PrepareError::Argument {
                option: "--max-seq-len",
                message: "must be at least 1; a sample of 0 tokens holds nothing to capture \
                          (hslake capture refuses --max-seq-len 0 too)"
                    .into(),
            });
        }
        Ok(())
    }
}

/// What a run did.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// Records read.
    pub conversations: u64,
    /// Samples written.
    pub samples: u64,
    /// Tokens written.
    pub tokens: u64,
    /// Tokens with loss.
    pub loss_tokens: u64,
    /// Samples cut to `max_seq_len`.
    pub truncated: u64,
    /// Refused records by reason.
    pub dropped: BTreeMap<&'static str, u64>,
    /// How the mask was found.
    pub mask_method: MaskMethod,
    /// Which tokens got loss.
    pub loss_on: LossOn,
}

impl Summary {
    fn new(tok: &ChatTokenizer) -> Self {
        Summary {
            conversations: 0,
            samples: 0,
            tokens: 0,
            loss_tokens: 0,
            truncated: 0,
            dropped: BTreeMap::new(),
            mask_method: tok.mask_method(),
            loss_on: tok.loss_on(),
        }
    }

    /// Records refused, all reasons together.
    pub fn dropped_total(&self) -> u64 {
        self.dropped.values().sum()
    }

    /// Loss tokens over all tokens (0 when nothing was written).
    pub fn loss_fraction(&self) -> f64 {
        if self.tokens == 0 {
            0.0
        } else {
            self.loss_tokens as f64 / self.tokens as f64
        }
    }
}

type TokenizeResult = Result<Tokenized, RecordError>;

/// The records [`prepare`] reads, in input order.
pub type Records<'a> = &'a mut (dyn Iterator<Item = Result<ConversationRecord>> + Send);
/// Takes each sample [`prepare`] makes, in input order.
pub type Emit<'a> = &'a mut (dyn FnMut(Sample) -> Result<()> + Send);
/// Takes each refused record's location and reason.
pub type OnDrop<'a> = &'a mut (dyn FnMut(&str, &RecordError) + Send);

// What turns a chunk's tokenized records into samples, in input order.
struct Finisher<'a> {
    input: &'a Path,
    opts: &'a PrepareOptions,
    summary: Summary,
    seen: HashMap<u64, String>,
    emit: Emit<'a>,
    on_drop: OnDrop<'a>,
}

impl Finisher<'_> {
    fn finish(&mut self, chunk: &[ConversationRecord], results: Vec<TokenizeResult>) -> Result<()> {
        let (opts, summary) = (self.opts, &mut self.summary);
        for (record, result) in chunk.iter().zip(results) {
            summary.conversations += 1;
            let id = record.sample_id();
            let outcome = result.and_then(|mut t| {
                if let Some(first) = self.seen.get(&id) {
                    return Err(RecordError::DuplicateId {
                        id,
                        first: first.clone(),
                    });
                }
                if let Some(max) = opts.max_seq_len.filter(|&m| t.input_ids.len() > m) {
                    match opts.overlong {
                        Overlong::Skip => {
                            return Err(RecordError::TooLong {
                                len: t.input_ids.len(),
                                max,
                            })
                        }
                        Overlong::Truncate => {
                            t.input_ids.truncate(max);
                            t.loss_mask.truncate(max);
                            summary.truncated += 1;
                        }
                    }
                }
                Ok(t)
            });
            match outcome {
                Ok(t) => {
                    self.seen.insert(id, record.location.clone());
                    summary.samples += 1;
                    summary.tokens += t.input_ids.len() as u64;
                    summary.loss_tokens += t.loss_mask.iter().map(|&m| m as u64).sum::<u64>();
                    (self.emit)(Sample {
                        id,
                        input_ids: t.input_ids,
                        loss_mask: t.loss_mask,
                    })?;
                }
                Err(reason) => {
                    if opts.strict {
                        return Err(PrepareError::Record {
                            path: self.input.to_path_buf(),
                            location: record.location.clone(),
                            source: reason,
                        });
                    }
                    *summary.dropped.entry(reason.kind()).or_default() += 1;
                    (self.on_drop)(&record.location, &reason);
                }
            }
        }
        Ok(())
    }
}

/// Tokenizes `records` in order, handing each sample to `emit` and each refused record (its
/// location and reason) to `on_drop`; `progress` gets the number of records done so far.
/// `input` names the input in errors.
///
/// Chunk by chunk, with the cores kept busy: while the pool tokenizes one chunk, one of its
/// threads first hands the previous chunk's samples to `emit` and then reads the next chunk,
/// and joins the tokenizing once done (so reading, parsing and writing are not a serial phase
/// between parallel ones).
///
/// Not generic, and never inlined, on purpose: a generic function is compiled in the crate that
/// calls it, at that crate's opt-level, and the CLI is built at opt-level 0 in the setup's
/// build, where this loop (the per-token sums, the rayon steps, the order keeping) ran ~15 %
/// slower than release; here it gets this crate's opt-level 3. The callbacks are trait objects,
/// called once per record or chunk, not per token.
#[inline(never)]
pub fn prepare<'a>(
    input: &'a Path,
    records: Records<'a>,
    tok: &ChatTokenizer,
    opts: &'a PrepareOptions,
    emit: Emit<'a>,
    on_drop: OnDrop<'a>,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Summary> {
    opts.validate()?;
    // Threads of their own: a template can nest values as deep as its fuel allows, and freeing
    // them takes that much stack, more than rayon's default threads have.
    let stack = tok.limits().render_stack();
    let pool = rayon::ThreadPoolBuilder::new()
        .stack_size(stack)
        .build()
        .map_err(|e| PrepareError::Argument {
            option: "--template-fuel",
            message: format!(
                "cannot start the tokenizing threads with {} MiB of stack each, which a rendering \
                 with this fuel may need: {e}",
                stack >> 20
            ),
        })?;
    pool.install(|| {
        let mut finisher = Finisher {
            input,
            opts,
            summary: Summary::new(tok),
            seen: HashMap::new(),
            emit,
            on_drop,
        };
        let mut records = records.fuse();
        let chunk_size = opts.chunk_size.max(1);
        // A record over the tokenizer's bounds is refused as it is read, so its text is not held.
        let read = |records: &mut std::iter::Fuse<Records<'a>>| -> Result<Vec<ConversationRecord>> {
            let (mut chunk, mut bytes) = (Vec::new(), 0usize);
            while chunk.len() < chunk_size && bytes < opts.chunk_bytes {
                let Some(mut record) = records.next().transpose()? else {
                    break;
                };
                if let Ok(c) = &record.conversation {
                    match tok.limits().check(c) {
                        Ok(()) => bytes += c.text_bytes(),
                        Err(e) => record.conversation = Err(e),
                    }
                }
                chunk.push(record);
            }
            Ok(chunk)
        };
        let mut next = read(&mut records)?;
        let mut pending: Option<(Vec<ConversationRecord>, Vec<TokenizeResult>)> = None;
        while !next.is_empty() || pending.is_some() {
            let chunk = std::mem::take(&mut next);
            let (side, results) = rayon::join(
                || -> Result<Vec<ConversationRecord>> {
                    if let Some((done, results)) = pending.take() {
                        finisher.finish(&done, results)?;
                        progress(finisher.summary.conversations);
                    }
                    read(&mut records)
                },
                || {
                    chunk
                        .par_iter()
                        .map(|r| {
                            r.conversation
                                .as_ref()
                                .map_err(Clone::clone)
                                .and_then(|c| tok.tokenize(c))
                        })
                        .collect::<Vec<_>>()
                },
            );
            next = side?;
            pending = (!chunk.is_empty()).then_some((chunk, results));
        }
        Ok(finisher.summary)
    })
}

/// Reads a conversations file whole into samples: the call `hslake capture` makes to take
/// conversations directly. Refused records are logged by location and counted in the summary.
pub fn prepare_file(
    path: &Path,
    tok: &ChatTokenizer,
    opts: &PrepareOptions,
) -> Result<(Vec<Sample>, Summary)> {
    let mut samples = vec![];
    let summary = prepare(
        path,
        &mut read_conversations(path)?,
        tok,
        opts,
        &mut |s| {
            samples.push(s);
            Ok(())
        },
        &mut |location, reason| tracing::warn!(input = %path.display(), %location, %reason, "conversation left out"),
        &|_| {},
    )?;
    Ok((samples, summary))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat_tokenizer::test_model;
    use crate::conversation::{Conversation, Message, Role};
    use crate::limits::Limits;

    fn record(index: u64, id: Option<u64>, answer: &str) -> Result<ConversationRecord> {
        let messages = vec![
            Message::new(Role::User, "q"),
            Message::new(Role::Assistant, answer),
        ];
        Ok(ConversationRecord {
            index,
            location: format!("line {}", index + 1),
            conversation: Ok(Conversation { id, messages }),
        })
    }

    fn run(
        records: Vec<Result<ConversationRecord>>,
        opts: PrepareOptions,
    ) -> (Result<Summary>, Vec<Sample>, Vec<String>) {
        let (summary, samples, dropped, _) = run_limited(records, opts, Limits::default());
        (summary, samples, dropped)
    }

    // Also the progress reported after each chunk.
    fn run_limited(
        records: Vec<Result<ConversationRecord>>,
        opts: PrepareOptions,
        limits: Limits,
    ) -> (Result<Summary>, Vec<Sample>, Vec<String>, Vec<u64>) {
        let dir = tempfile::tempdir().unwrap();
        let model = test_model::write(dir.path(), test_model::CHATML);
        let tok = test_model::load(&model, limits).unwrap();
        let (mut samples, mut dropped) = (vec![], vec![]);
        let progress = std::sync::Mutex::new(vec![]);
        let summary = prepare(
            Path::new("in.jsonl"),
            &mut records.into_iter(),
            &tok,
            &opts,
            &mut |s| {
                samples.push(s);
                Ok(())
            },
            &mut |loc, reason| dropped.push(format!("{loc}: {reason}")),
            &|n| progress.lock().unwrap().push(n),
        );
        (summary, samples, dropped, progress.into_inner().unwrap())
    }

    #[test]
    fn refuses_records_over_the_bounds_by_name_and_goes_on() {
        let mut long = record(1, None, "hello there").unwrap();
        if let Ok(c) = &mut long.conversation {
            c.messages.push(Message::new(Role::User, "q"));
        }
        let records = vec![
            record(0, None, "a"),
            Ok(long),
            record(2, None, &"hello ".repeat(12)),
            record(3, None, "a"),
        ];
        // 63 bytes rendered for the two short records.
        let limits = Limits {
            max_record_bytes: 70,
            max_turns: 2,
            ..Default::default()
        };
        let (summary, samples, dropped, _) =
            run_limited(records, PrepareOptions::default(), limits);
        assert_eq!(
            dropped,
            [
                "line 2: 3 messages, more than --max-turns 2",
                "line 3: the messages' text is over --max-record-bytes 70 (73 bytes)"
            ]
        );
        assert_eq!(samples.iter().map(|s| s.id).collect::<Vec<_>>(), [0, 3]);
        let summary = summary.unwrap();
        assert_eq!(summary.dropped.get("over --max-turns"), Some(&1));
        assert_eq!(summary.dropped.get("over --max-record-bytes"), Some(&1));
    }

    #[test]
    fn ends_a_chunk_once_it_holds_its_bytes_of_text() {
        let records = (0..5).map(|i| record(i, None, "hello there")).collect();
        let opts = PrepareOptions {
            chunk_bytes: 20,
            ..Default::default()
        };
        let (summary, samples, _, progress) = run_limited(records, opts, Limits::default());
        assert_eq!(summary.unwrap().samples, 5);
        assert_eq!(
            samples.iter().map(|s| s.id).collect::<Vec<_>>(),
            [0, 1, 2, 3, 4]
        );
        // 12 bytes per record: a chunk ends with the record that reaches 20.
        assert_eq!(progress, [2, 4, 5]);
    }

    #[test]
    fn frees_values_nested_as_deep_as_the_fuel_allows() {
        // Nests lists 20 levels a step: before the template's guard stopped it at 512 levels,
        // until the fuel ran out at 200,000, ten times what a default thread's stack can free
        // (the process aborted with a stack overflow).
        let nest = format!(
            "{{% set ns = namespace(x=[]) %}}{{% for i in range(100000) %}}{{% set ns.x = {}ns.x{} %}}{{% endfor %}}",
            "[".repeat(20),
            "]".repeat(20)
        );
        let dir = tempfile::tempdir().unwrap();
        let model = test_model::write(
            dir.path(),
            &format!(
                "{{% if messages[0]['content'] == 'nest' %}}{nest}{{% else %}}{}{{% endif %}}",
                test_model::CHATML
            ),
        );
        let limits = Limits {
            template_fuel: 400_000,
            ..Default::default()
        };
        let tok = test_model::load(&model, limits).unwrap();
        let mut nesting = record(0, None, "a").unwrap();
        if let Ok(c) = &mut nesting.conversation {
            c.messages[0].content = "nest".into();
        }
        let (mut samples, mut dropped) = (0, vec![]);
        let summary = prepare(
            Path::new("in.jsonl"),
            &mut vec![Ok(nesting), record(1, None, "a")].into_iter(),
            &tok,
            &PrepareOptions::default(),
            &mut |_| {
                samples += 1;
                Ok(())
            },
            &mut |loc, reason| dropped.push(format!("{loc}: {reason}")),
            &|_| {},
        )
        .unwrap();
        assert_eq!((summary.samples, samples), (1, 1));
        assert_eq!(dropped.len(), 1);
        assert_eq!(
            dropped,
            ["line 1: chat template error: a value nested deeper than 512 levels"]
        );
    }

    #[test]
    fn the_pipeline_is_a_plain_function_compiled_here() {
        // Generic, `prepare` would be compiled in the crate that calls it, at that crate's
        // opt-level (0 for the CLI in the setup's build); it would then not name itself without
        // type arguments, or not compile here at all. The same holds for the records' `next`.
        assert_eq!(
            std::any::type_name_of_val(&prepare),
            "hslake_prepare::pipeline::prepare"
        );
        assert_eq!(
            std::any::type_name_of_val(&<crate::source::Conversations as Iterator>::next),
            "<hslake_prepare::source::Conversations as core::iter::traits::iterator::Iterator>::next"
        );
    }

    #[test]
    fn refuses_max_seq_len_0() {
        let zero = PrepareOptions {
            max_seq_len: Some(0),
            ..Default::default()
        };
        let e = zero.validate().unwrap_err().to_string();
        assert!(e.starts_with("--max-seq-len: must be at least 1"), "{e}");
        // And before reading a record.
        let mut read = 0;
        let mut records = std::iter::from_fn(|| {
            read += 1;
            Some(record(0, None, "a"))
        });
        let dir = tempfile::tempdir().unwrap();
        let tok = test_model::load(
            &test_model::write(dir.path(), test_model::CHATML),
            Limits::default(),
        )
        .unwrap();
        let r = prepare(
            Path::new("in.jsonl"),
            &mut records,
            &tok,
            &zero,
            &mut |_| Ok(()),
            &mut |_, _| {},
            &|_| {},
        );
        assert!(r.is_err());
        assert_eq!(read, 0);
    }

    #[test]
    fn keeps_input_order_across_parallel_chunks() {
        let records = (0..50)
            .map(|i| record(i, None, if i % 2 == 0 { "a" } else { "hello there" }))
            .collect();
        let (summary, samples, _) = run(
            records,
            PrepareOptions {
                chunk_size: 7,
                ..Default::default()
            },
        );
        let summary = summary.unwrap();
        assert_eq!(
            samples.iter().map(|s| s.id).collect::<Vec<_>>(),
            (0..50).collect::<Vec<_>>()
        );
        assert_eq!((summary.conversations, summary.samples), (50, 50));
        // 8 tokens with 2 of loss, or 9 with 3.
        assert_eq!(
            (summary.tokens, summary.loss_tokens),
            (25 * 8 + 25 * 9, 25 * 2 + 25 * 3)
        );
    }

    #[test]
    fn counts_duplicates_and_overlong_records_by_reason() {
        let records = vec![
            record(0, Some(5), "a"),
            record(1, Some(5), "a"),
            record(2, Some(6), "hello there"),
        ];
        let opts = PrepareOptions {
            max_seq_len: Some(8),
            overlong: Overlong::Skip,
            ..Default::default()
        };
        let (summary, samples, dropped) = run(records, opts);
        let summary = summary.unwrap();
        assert_eq!(samples.len(), 1);
        assert_eq!(
            dropped,
            [
                "line 2: duplicate id 5 (first at line 1)",
                "line 3: 9 tokens, longer than --max-seq-len 8"
            ]
        );
        assert_eq!(summary.dropped.get("duplicate id"), Some(&1));
        assert_eq!(summary.dropped.get("longer than --max-seq-len"), Some(&1));
    }

    #[test]
    fn truncates_overlong_samples_with_their_masks() {
        let opts = PrepareOptions {
            max_seq_len: Some(7),
            ..Default::default()
        };
        let (summary, samples, _) = run(vec![record(0, None, "hello there")], opts);
        assert_eq!(summary.unwrap().truncated, 1);
        assert_eq!(samples[0].input_ids, [1, 4, 9, 2, 1, 5, 7]);
        assert_eq!(samples[0].loss_mask, [0, 0, 0, 0, 0, 0, 1]);
    }

    #[test]
    fn strict_fails_on_the_first_bad_record_with_its_location() {
        let mut bad = record(1, None, "a").unwrap();
        bad.conversation = Err(RecordError::Empty);
        let opts = PrepareOptions {
            strict: true,
            ..Default::default()
        };
        let (summary, samples, _) = run(vec![record(0, None, "a"), Ok(bad)], opts);
        assert_eq!(
            summary.unwrap_err().to_string(),
            "in.jsonl: line 2: empty conversation: no messages"
        );
        assert_eq!(samples.len(), 1);
    }
}
