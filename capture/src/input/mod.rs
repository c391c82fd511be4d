//! Tokenized samples from JSONL or Parquet (`input_ids`, optional `loss_mask`, optional `id`),
//! checked record by record with errors that name the line (JSONL) or row (Parquet). Each
//! format is read into the same records ([`jsonl`] with serde_json, [`parquet`] through Arrow)
//! and one path checks them (here). JSONL is not read through arrow-json: on token lists it
//! measured 3-4x slower than serde_json (docs/PERFORMANCE.md).
//!
//! Records stream: each is checked and turned into its sample (or counted and dropped, for a
//! check that keeps nothing) before the next is read, and a list is read straight into the
//! sample's types, so that reading holds one record's lists at a time besides the samples it
//! keeps. What remains per input is the set of integer ids seen (8 bytes an id, for the
//! duplicate check); the line an id was first seen at is found by reading the input again, and
//! only for the error.
use std::collections::HashSet;
use std::fmt;
use std::path::Path;

use crate::error::{CaptureError, Result};
use hslake_schemas::{InputShard, Overlong};

mod jsonl;
mod parquet;

/// Where a record sits in its input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Location {
    /// 1-based line of a JSONL file.
    Line(u64),
    /// 0-based row of a Parquet file.
    Row(u64),
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Line(n) => write!(f, "line {n}"),
            Location::Row(n) => write!(f, "row {n}"),
        }
    }
}

/// A record's `id`, before the checks decide what it means.
#[derive(Debug, PartialEq)]
enum RawId {
    None,
    Int(i64),
    Str,
    /// Neither: why, as the error says it.
    Bad(String),
}

/// A list field of a record as read.
#[derive(Debug)]
enum Field<T> {
    /// Absent or null.
    Missing,
    /// Not a list of integers; what follows "must be a list of integers" in the error.
    Bad(String),
    List(Ints<T>),
}

/// A list of integers as read: the first [`Rules::keep`] values that pass the field's check,
/// converted, the list's length, and the first value that does not pass (position, value).
#[derive(Debug)]
struct Ints<T> {
    kept: Vec<T>,
    len: usize,
    first_bad: Option<(usize, i64)>,
}

impl<T> Ints<T> {
    fn new() -> Self {
        Ints {
            kept: vec![],
            len: 0,
            first_bad: None,
        }
    }

    /// Adds the next value: kept if `converted` and within `keep`, else the first refused one
    /// is remembered.
    fn push(&mut self, value: i64, converted: Option<T>, keep: usize) {
        match converted {
            Some(v) if self.len < keep => self.kept.push(v),
            Some(_) => {}
            None => {
                self.first_bad.get_or_insert((self.len, value));
            }
        }
        self.len += 1;
    }
}

/// How the readers convert a record's lists: token ids below `vocab` as `i32`, mask values 0
/// and 1 as `u8`, at most `keep` of each list kept (0 for a check that keeps nothing).
#[derive(Debug, Clone, Copy)]
struct Rules {
    vocab: u64,
    keep: usize,
}

impl Rules {
    fn token(&self, v: i64) -> Option<i32> {
        (v >= 0 && (v as u64) < self.vocab).then_some(v as i32)
    }

    fn mask(v: i64) -> Option<u8> {
        matches!(v, 0 | 1).then_some(v as u8)
    }
}

/// One input record as read, before its checks.
struct Record {
    location: Location,
    id: RawId,
    input_ids: Field<i32>,
    loss_mask: Field<u8>,
}

/// One tokenized sample ready for the model.
#[derive(Debug, Clone, PartialEq)]
pub struct InputSample {
    /// The dataset's sample id: the input's integer `id`, else the 0-based record index.
    pub sample_id: u64,
    /// Token ids.
    pub input_ids: Vec<i32>,
    /// 1 where the loss applies.
    pub loss_mask: Vec<u8>,
}

/// Bytes a kept token takes in memory: its id (`i32`) and its mask value.
pub const TOKEN_BYTES: u64 = 5;
/// Bytes a kept sample takes in memory besides its tokens, at most: the sample itself (56
/// bytes, twice that in a list that has just grown), its two allocations (at least 32 bytes
/// each to the allocator) and its place in the batch plan.
pub const SAMPLE_BYTES: u64 = 192;

impl InputSample {
    /// Bytes a kept sample of `tokens` tokens takes in memory.
    pub const fn memory(tokens: u64) -> u64 {
        tokens * TOKEN_BYTES + SAMPLE_BYTES
    }
}

/// All usable samples of an input file and what was done to the rest.
#[derive(Debug, Default)]
pub struct Inputs {
    /// Samples to capture, in input order (none from [`scan_inputs`]).
    pub samples: Vec<InputSample>,
    /// Samples cut to `max_seq_len`.
    pub truncated: u64,
    /// Samples left out for being longer than `max_seq_len`.
    pub skipped_overlong: u64,
    /// Whether sample ids came from an integer `id` field (else from record positions).
    pub ids_from_input: bool,
    /// Records read (of every shard, before overlong ones are left out).
    pub records: u64,
    /// Samples handed on (of the shard), their tokens, and the memory they take.
    pub kept: KeptSamples,
}

/// What the samples handed on take.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KeptSamples {
    /// Samples.
    pub samples: u64,
    /// Their tokens (after truncation).
    pub tokens: u64,
    /// Bytes they take in memory ([`InputSample::memory`]), whether kept or not.
    pub memory: u64,
}

/// Limits every record is checked against.
#[derive(Debug, Clone, Copy)]
pub struct InputLimits {
    /// Token ids must be below this.
    pub vocab_size: usize,
    /// Longest sample kept as is.
    pub max_seq_len: Option<usize>,
    /// What to do with longer ones.
    pub overlong: Overlong,
    /// Only the samples of this part of the input are handed on (all are checked).
    pub shard: Option<InputShard>,
    /// The samples handed on may take at most this much memory ([`InputSample::memory`]);
    /// past it the input is refused ([`CaptureError::SamplesTooLarge`]).
    pub max_memory: Option<u64>,
}

impl InputLimits {
    /// The checks without a shard or a bound on memory.
    pub fn new(vocab_size: usize, max_seq_len: Option<usize>, overlong: Overlong) -> Self {
        InputLimits {
            vocab_size,
            max_seq_len,
            overlong,
            shard: None,
            max_memory: None,
        }
    }
}

/// The buffer a JSONL input is read through.
const READ_BUFFER: u64 = 1 << 20;

/// The most memory [`scan_inputs`] takes, keeping no samples, for a JSONL input of `bytes`
/// bytes: its read buffer, the longest line, and the ids seen (a record with an integer id
/// takes at least 25 bytes of JSON, its id at most 31 bytes of the set while the set grows, so
/// lines and ids together stay within 1.25 bytes a byte). A Parquet input's rows and values
/// are not bounded by its size.
pub const fn check_memory(bytes: u64) -> u64 {
    READ_BUFFER + bytes + bytes / 4
}

/// Whether `path` is read as Parquet (by its extension) rather than as JSON lines.
pub fn is_parquet(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("parquet"))
}

/// Reads `path` (`.parquet` by extension, JSON lines otherwise) and checks every record,
/// keeping every sample.
pub fn read_inputs(path: &Path, limits: InputLimits) -> Result<Inputs> {
    let mut samples = vec![];
    let mut inputs = scan_inputs(path, limits, true, &mut |s, _| {
        samples.push(s);
        Ok(())
    })?;
    inputs.samples = samples;
    Ok(inputs)
}

/// Reads `path` and checks every record, handing each sample and its number of tokens to
/// `sink` in input order. With `keep` false the samples come without their lists (a check
/// holds no more than one record at a time).
pub fn scan_inputs(
    path: &Path,
    limits: InputLimits,
    keep: bool,
    sink: &mut dyn FnMut(InputSample, usize) -> Result<()>,
) -> Result<Inputs> {
    let rules = Rules {
        vocab: limits.vocab_size as u64,
        keep: match keep {
            true => limits.max_seq_len.unwrap_or(usize::MAX),
            false => 0,
        },
    };
    let mut checker = Checker {
        path,
        limits,
        out: Inputs::default(),
        ids_from_input: None,
        seen: HashSet::new(),
        index: 0,
    };
    read_records(path, rules, Some(&limits), &mut |r| {
        if let Some((sample, tokens)) = checker.record(r)? {
            sink(sample, tokens)?;
        }
        Ok(true)
    })?;
    Ok(checker.out)
}

// Hands every record of `path` to `each` until it answers false (`limits`: see
// [`parquet::read_parquet`]).
fn read_records(
    path: &Path,
    rules: Rules,
    limits: Option<&InputLimits>,
    each: &mut dyn FnMut(Record) -> Result<bool>,
) -> Result<()> {
    if is_parquet(path) {
        parquet::read_parquet(path, rules, limits, each)
    } else {
        jsonl::read_jsonl(path, hslake_schemas::MAX_LINE_BYTES, rules, each)
    }
}

fn input_err(path: &Path, location: &str, message: impl Into<String>) -> CaptureError {
    CaptureError::Input {
        path: path.to_path_buf(),
        location: location.to_string(),
        message: message.into(),
    }
}

// The checks of one record after another.
struct Checker<'a> {
    path: &'a Path,
    limits: InputLimits,
    out: Inputs,
    /// Decided by the first record.
    ids_from_input: Option<bool>,
    /// Integer ids seen so far.
    seen: HashSet<u64>,
    /// Records checked so far.
    index: u64,
}

impl Checker<'_> {
    // The record's sample and its number of tokens, or `None` for one left out as overlong.
    fn record(&mut self, r: Record) -> Result<Option<(InputSample, usize)>> {
        let path = self.path;
        let err = |m: String| input_err(path, &r.location.to_string(), m);
        if let Field::Bad(detail) = &r.input_ids {
            return Err(err(format!(
                "\"input_ids\" must be a list of integers{detail}"
            )));
        }
        if let Field::Bad(detail) = &r.loss_mask {
            return Err(err(format!(
                "\"loss_mask\" must be a list of integers{detail}"
            )));
        }

        if let RawId::Bad(why) = &r.id {
            return Err(err(why.clone()));
        }
        let index = self.index;
        self.index += 1;
        let from_input = *self
            .ids_from_input
            .get_or_insert(matches!(r.id, RawId::Int(_)));
        self.out.ids_from_input = from_input;
        let sample_id = match (&r.id, from_input) {
            (RawId::Int(i), true) => u64::try_from(*i).map_err(|_| err(format!("id {i} is negative; ids must be >= 0")))?,
            (_, true) => return Err(err("has no integer \"id\" but earlier records do; use integer ids everywhere or nowhere".into())),
            (RawId::Int(_), false) => {
                return Err(err("has an integer \"id\" but the first record does not; use integer ids everywhere or nowhere".into()))
            }
            (_, false) => index,
        };
        if from_input && !self.seen.insert(sample_id) {
            let first = first_seen(path, sample_id)?;
            return Err(err(format!(
                "duplicate id {sample_id} (first seen at {first})"
            )));
        }
        let Field::List(ids) = r.input_ids else {
            return Err(err("missing field \"input_ids\"".into()));
        };
        if ids.len == 0 {
            return Err(err(
                "empty input_ids: a sample needs at least one token".into()
            ));
        }
        if let Some((pos, tok)) = ids.first_bad {
            return Err(err(format!(
                "token id {tok} at position {pos} is outside the model's vocabulary (0..{})",
                self.limits.vocab_size
            )));
        }
        let loss_mask = match r.loss_mask {
            Field::List(m) if m.len != ids.len => {
                return Err(err(format!(
                    "loss_mask has length {}, expected {} (the length of input_ids)",
                    m.len, ids.len
                )))
            }
            Field::List(m) => match m.first_bad {
                Some((pos, v)) => {
                    return Err(err(format!(
                        "loss_mask value {v} at position {pos}; expected 0 or 1"
                    )))
                }
                None => m.kept,
            },
            _ => vec![1u8; ids.kept.len()],
        };
        self.out.records += 1;
        let mut tokens = ids.len;
        if let Some(max) = self.limits.max_seq_len.filter(|&max| ids.len > max) {
            match self.limits.overlong {
                Overlong::Skip => {
                    self.out.skipped_overlong += 1;
                    tracing::debug!(location = %r.location, len = ids.len, max, "skipped: longer than --max-seq-len");
                    return Ok(None);
                }
                Overlong::Truncate => {
                    self.out.truncated += 1;
                    tokens = max;
                }
            }
        }
        if self.limits.shard.is_some_and(|s| !s.contains(sample_id)) {
            return Ok(None);
        }
        let kept = &mut self.out.kept;
        kept.samples += 1;
        kept.tokens += tokens as u64;
        kept.memory += InputSample::memory(tokens as u64);
        if let Some(limit) = self.limits.max_memory.filter(|&l| kept.memory > l) {
            return Err(CaptureError::SamplesTooLarge {
                path: path.to_path_buf(),
                samples: kept.samples,
                tokens: kept.tokens,
                limit,
            });
        }
        let sample = InputSample {
            sample_id,
            input_ids: ids.kept,
            loss_mask,
        };
        Ok(Some((sample, tokens)))
    }
}

// Where the record with integer id `id` first appears: the input is read again, keeping
// nothing, so that the check holds the ids seen and not where each was.
fn first_seen(path: &Path, id: u64) -> Result<Location> {
    let rules = Rules { vocab: 0, keep: 0 };
    let mut found = None;
    read_records(path, rules, None, &mut |r| {
        if r.id == RawId::Int(id as i64) {
            found = Some(r.location);
        }
        Ok(found.is_none())
    })?;
    found.ok_or_else(|| input_err(path, "file", format!("id {id} changed while it was read")))
}

#[cfg(test)]
mod tests {
    use super::jsonl::read_jsonl;
    use super::*;
    use arrow_array::{ArrayRef, RecordBatch};
    use hslake_schemas::MAX_LINE_BYTES;
    use std::io::Write;
    use std::sync::Arc;

    const LIMITS: InputLimits = InputLimits {
        vocab_size: 100,
        max_seq_len: None,
        overlong: Overlong::Truncate,
        shard: None,
        max_memory: None,
    };

    fn jsonl(lines: &[&str]) -> tempfile::NamedTempFile {
        let mut f = tempfile::Builder::new()
            .suffix(".jsonl")
            .tempfile()
            .unwrap();
        for l in lines {
            writeln!(f, "{l}").unwrap();
        }
        f
    }

    const GOOD: &str = r#"{"input_ids": [1, 2, 3]}"#;

    fn err(lines: &[&str], limits: InputLimits) -> String {
        read_inputs(jsonl(lines).path(), limits)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn defaults_loss_mask_to_ones_and_ids_to_record_index() {
        let f = jsonl(&[
            r#"{"input_ids": [1, 2]}"#,
            "",
            r#"{"input_ids": [3], "loss_mask": [0], "id": "conv-7"}"#,
        ]);
        let s = read_inputs(f.path(), LIMITS).unwrap().samples;
        assert_eq!(
            s[0],
            InputSample {
                sample_id: 0,
                input_ids: vec![1, 2],
                loss_mask: vec![1, 1]
            }
        );
        assert_eq!(
            s[1],
            InputSample {
                sample_id: 1,
                input_ids: vec![3],
                loss_mask: vec![0]
            }
        );
    }

    #[test]
    fn integer_ids_become_sample_ids() {
        let f = jsonl(&[
            r#"{"input_ids": [1], "id": 40}"#,
            r#"{"input_ids": [2], "id": 7}"#,
        ]);
        let s = read_inputs(f.path(), LIMITS).unwrap();
        assert!(s.ids_from_input);
        assert_eq!(
            s.samples.iter().map(|x| x.sample_id).collect::<Vec<_>>(),
            vec![40, 7]
        );
    }

    #[test]
    fn each_bad_record_names_its_line() {
        assert!(err(&[r#"{"input_ids": [1]}"#, r#"{"ids": [1]}"#], LIMITS)
            .ends_with("line 2: missing field \"input_ids\""));
        assert!(err(&[r#"{"input_ids": []}"#], LIMITS).contains("line 1: empty input_ids"));
        let e = err(&[r#"{"input_ids": [1, 100]}"#], LIMITS);
        assert!(
            e.contains(
                "line 1: token id 100 at position 1 is outside the model's vocabulary (0..100)"
            ),
            "{e}"
        );
        assert!(err(&[r#"{"input_ids": [1], "loss_mask": [1, 0]}"#], LIMITS)
            .contains("loss_mask has length 2, expected 1"));
        assert!(err(&["{nope"], LIMITS).contains("line 1: not valid JSON"));
        assert!(err(&["not json"], LIMITS).contains("line 1: not valid JSON: expected ident"));
        assert!(err(
            &[
                r#"{"input_ids": [1], "id": 3}"#,
                r#"{"input_ids": [1], "id": 3}"#
            ],
            LIMITS
        )
        .contains("line 2: duplicate id 3 (first seen at line 1)"));
    }

    #[test]
    fn overlong_samples_are_truncated_or_skipped_and_counted() {
        let lines = [r#"{"input_ids": [1, 2, 3, 4]}"#, r#"{"input_ids": [5]}"#];
        let t = read_inputs(
            jsonl(&lines).path(),
            InputLimits {
                max_seq_len: Some(2),
                ..LIMITS
            },
        )
        .unwrap();
        assert_eq!(
            (t.truncated, t.samples[0].input_ids.clone()),
            (1, vec![1, 2])
        );
        let s = read_inputs(
            jsonl(&lines).path(),
            InputLimits {
                max_seq_len: Some(2),
                overlong: Overlong::Skip,
                ..LIMITS
            },
        )
        .unwrap();
        assert_eq!(
            (s.skipped_overlong, s.samples.len(), s.samples[0].sample_id),
            (1, 1, 1)
        );
    }

    #[test]
    fn a_file_without_line_breaks_is_refused_at_the_line_bound() {
        // /dev/zero is one endless line: before the bound, reading it ran until the kernel
        // killed the process.
        let e = read_inputs(Path::new("/dev/zero"), LIMITS)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            format!(
                "/dev/zero: line 1: longer than {MAX_LINE_BYTES} bytes without a line break; \
                 expected one JSON object per line (is this a JSONL file?)"
            )
        );
        let f = jsonl(&[
            r#"{"input_ids": [1]}"#,
            r#"{"input_ids": [1, 2, 3, 4, 5, 6]}"#,
        ]);
        let rules = Rules {
            vocab: 100,
            keep: 0,
        };
        let e = match read_jsonl(f.path(), 24, rules, &mut |_: Record| Ok(true)) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("a 34-byte line passed a 24-byte bound"),
        };
        assert!(e.contains("line 2: longer than 24 bytes"), "{e}");
    }

    #[test]
    fn lists_hold_integers_or_booleans_and_each_line_one_object() {
        let s = read_inputs(
            jsonl(&[r#"{"input_ids": [1, 2], "loss_mask": [false, true]}"#]).path(),
            LIMITS,
        )
        .unwrap();
        assert_eq!(s.samples[0].loss_mask, vec![0, 1]);
        for bad in [r#"{"input_ids": [1, 2.5]}"#, r#"{"input_ids": "1 2 3"}"#] {
            let e = err(&[GOOD, bad], LIMITS);
            assert!(
                e.ends_with("line 2: \"input_ids\" must be a list of integers"),
                "{e}"
            );
        }
        let e = err(&[GOOD, r#"{"input_ids": [1]} {"input_ids": [2]}"#], LIMITS);
        assert!(
            e.contains("line 2: not valid JSON: trailing characters"),
            "{e}"
        );
        let e = err(&[GOOD, "[1, 2]"], LIMITS);
        assert!(
            e.ends_with("line 2: expected a JSON object with \"input_ids\""),
            "{e}"
        );
    }

    #[test]
    fn ids_are_integers_everywhere_or_nowhere() {
        let e = err(
            &[
                r#"{"input_ids": [1], "id": 4}"#,
                r#"{"input_ids": [1], "id": "x"}"#,
            ],
            LIMITS,
        );
        assert!(e.ends_with("line 2: has no integer \"id\" but earlier records do; use integer ids everywhere or nowhere"), "{e}");
        let e = err(
            &[
                r#"{"input_ids": [1], "id": "a"}"#,
                r#"{"input_ids": [1], "id": 7}"#,
            ],
            LIMITS,
        );
        assert!(e.ends_with("line 2: has an integer \"id\" but the first record does not; use integer ids everywhere or nowhere"), "{e}");
        let e = err(&[r#"{"input_ids": [1], "id": 4.5}"#], LIMITS);
        assert!(
            e.ends_with("line 1: \"id\" must be an integer or a string, got 4.5"),
            "{e}"
        );
        let e = err(&[r#"{"input_ids": [1], "id": -2}"#], LIMITS);
        assert!(
            e.ends_with("line 1: id -2 is negative; ids must be >= 0"),
            "{e}"
        );
    }

    #[test]
    fn parquet_rows_go_through_the_same_checks() {
        use arrow_array::builder::{Int32Builder, ListBuilder};
        let mut ids = ListBuilder::new(Int32Builder::new());
        ids.append_value([Some(1), Some(2)]);
        ids.append_value([Some(3), Some(500)]);
        let batch = RecordBatch::try_from_iter([("input_ids", Arc::new(ids.finish()) as ArrayRef)])
            .unwrap();
        let f = tempfile::Builder::new()
            .suffix(".parquet")
            .tempfile()
            .unwrap();
        let mut w =
            ::parquet::arrow::ArrowWriter::try_new(f.reopen().unwrap(), batch.schema(), None)
                .unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
        let e = read_inputs(f.path(), LIMITS).unwrap_err().to_string();
        assert!(
            e.ends_with(
                "row 1: token id 500 at position 1 is outside the model's vocabulary (0..100)"
            ),
            "{e}"
        );
    }

    // Bytes this thread has allocated now and at its peak (other tests' threads are not
    // counted).
    mod counting {
        use std::alloc::{GlobalAlloc, Layout, System};
        use std::cell::Cell;

        thread_local! {
            static NOW: Cell<usize> = const { Cell::new(0) };
            static PEAK: Cell<usize> = const { Cell::new(0) };
        }

        fn add(bytes: usize) {
            let _ = NOW.try_with(|n| {
                n.set(n.get() + bytes);
                let _ = PEAK.try_with(|p| p.set(p.get().max(n.get())));
            });
        }

        fn sub(bytes: usize) {
            let _ = NOW.try_with(|n| n.set(n.get().saturating_sub(bytes)));
        }

        pub struct Counting;

        unsafe impl GlobalAlloc for Counting {
            unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
                let p = unsafe { System.alloc(layout) };
                if !p.is_null() {
                    add(layout.size());
                }
                p
            }

            unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
                unsafe { System.dealloc(p, layout) };
                sub(layout.size());
            }

            unsafe fn realloc(&self, p: *mut u8, layout: Layout, new: usize) -> *mut u8 {
                let q = unsafe { System.realloc(p, layout, new) };
                if !q.is_null() {
                    add(new);
                    sub(layout.size());
                }
                q
            }
        }

        #[global_allocator]
        static ALLOCATOR: Counting = Counting;

        /// What `f` returns, and the bytes it allocated at its peak on this thread.
        pub fn peak<T>(f: impl FnOnce() -> T) -> (T, usize) {
            let before = NOW.with(Cell::get);
            PEAK.with(|p| p.set(before));
            let out = f();
            (out, PEAK.with(Cell::get) - before)
        }
    }

    #[test]
    fn a_check_holds_one_record_and_the_ids_and_a_read_its_samples() {
        // 25-byte records with integer ids: the most ids a byte. Read whole into records before,
        // a check of them took about 12 times their size.
        let mut f = tempfile::Builder::new()
            .suffix(".jsonl")
            .tempfile()
            .unwrap();
        for i in 0..100_000 {
            writeln!(f, r#"{{"id":{},"input_ids":[1]}}"#, i % 100_000).unwrap();
        }
        let size = f.as_file().metadata().unwrap().len();
        let (checked, peak) = counting::peak(|| {
            let mut handed = 0;
            let inputs = scan_inputs(f.path(), LIMITS, false, &mut |s, tokens| {
                assert!(s.input_ids.is_empty() && s.loss_mask.is_empty() && tokens == 1);
                handed += 1;
                Ok(())
            })
            .unwrap();
            (inputs, handed)
        });
        let (inputs, handed) = checked;
        assert_eq!((handed, inputs.records), (100_000, 100_000));
        assert_eq!(inputs.kept.memory, 100_000 * InputSample::memory(1));
        assert!(
            peak as u64 <= check_memory(size),
            "a check of {size} bytes took {peak}"
        );
        let (read, peak) = counting::peak(|| read_inputs(f.path(), LIMITS).unwrap());
        assert_eq!(read.samples.len(), 100_000);
        assert!(
            peak as u64 <= check_memory(size) + read.kept.memory,
            "a read of {size} bytes into {} of samples took {peak}",
            read.kept.memory
        );
    }

    #[test]
    fn samples_past_max_memory_are_refused_while_read_counting_only_the_shard() {
        let lines: Vec<String> = (0..10)
            .map(|i| format!(r#"{{"id": {i}, "input_ids": [1, 2, 3]}}"#))
            .collect();
        let f = jsonl(&lines.iter().map(String::as_str).collect::<Vec<_>>());
        let three = 3 * InputSample::memory(3);
        let limits = InputLimits {
            max_memory: Some(three),
            ..LIMITS
        };
        match read_inputs(f.path(), limits).unwrap_err() {
            CaptureError::SamplesTooLarge {
                samples,
                tokens,
                limit,
                ..
            } => assert_eq!((samples, tokens, limit), (4, 12, three)),
            e => panic!("{e}"),
        }
        // Half the samples are another process's: five of them pass three samples' bound.
        let shard = "0/2".parse().unwrap();
        let limits = InputLimits {
            shard: Some(shard),
            max_memory: Some(5 * InputSample::memory(3)),
            ..LIMITS
        };
        let read = read_inputs(f.path(), limits).unwrap();
        assert_eq!((read.records, read.kept.samples), (10, 5));
        assert!(read.samples.iter().all(|s| shard.contains(s.sample_id)));
    }

    #[test]
    fn a_parquet_file_whose_metadata_counts_too_many_tokens_is_refused_before_it_is_decoded() {
        use arrow_array::builder::{Int32Builder, ListBuilder};
        // 1,000 rows of 1,000 equal tokens: a few kilobytes of file, 5 MB of samples.
        let mut ids = ListBuilder::new(Int32Builder::new());
        for _ in 0..1000 {
            ids.append_value(std::iter::repeat_n(Some(7), 1000));
        }
        let batch = RecordBatch::try_from_iter([("input_ids", Arc::new(ids.finish()) as ArrayRef)])
            .unwrap();
        let f = tempfile::Builder::new()
            .suffix(".parquet")
            .tempfile()
            .unwrap();
        let mut w =
            ::parquet::arrow::ArrowWriter::try_new(f.reopen().unwrap(), batch.schema(), None)
                .unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
        let limits = InputLimits {
            max_memory: Some(1 << 20),
            ..LIMITS
        };
        let (e, peak) = counting::peak(|| read_inputs(f.path(), limits).unwrap_err());
        match e {
            CaptureError::SamplesTooLarge {
                samples, tokens, ..
            } => assert_eq!((samples, tokens), (1000, 1_000_000)),
            e => panic!("{e}"),
        }
        assert!(peak < 1 << 20, "refused after {peak} bytes");
    }
}
