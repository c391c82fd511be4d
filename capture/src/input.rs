//! Tokenized samples from JSONL or Parquet (`input_ids`, optional `loss_mask`, optional `id`),
//! checked record by record with errors that name the line (JSONL) or row (Parquet). Both
//! formats become Arrow record batches first (JSONL through arrow-json), and one path turns
//! batches into records and checks them.
use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float32Type, Float64Type, Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type,
    UInt64Type, UInt8Type,
};
use arrow_array::{Array, ArrayRef, Int64Array, RecordBatch};
use arrow_json::ReaderBuilder;
use arrow_schema::{ArrowError, DataType, Field, Schema, SchemaRef};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

use crate::error::{CaptureError, Result};

/// The longest JSONL line accepted: far above any real sample (a million tokens is ~10 MB of
/// JSON), and a bound on what a file without line breaks (`/dev/zero`) can make us buffer.
pub(crate) const MAX_LINE_BYTES: usize = 256 << 20;

/// JSONL lines decoded together (and at most this many bytes).
const CHUNK_LINES: usize = 1024;
const CHUNK_BYTES: usize = 16 << 20;

/// What to do with a sample longer than `--max-seq-len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Overlong {
    /// Keep its first `max_seq_len` tokens.
    #[default]
    Truncate,
    /// Leave it out.
    Skip,
}

impl std::str::FromStr for Overlong {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "truncate" => Ok(Overlong::Truncate),
            "skip" => Ok(Overlong::Skip),
            _ => Err(format!(
                "unknown overlong policy {s:?}; expected truncate or skip"
            )),
        }
    }
}

/// One tokenized sample ready for the model.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct InputSample {
    /// The dataset's sample id: the input's integer `id`, else the 0-based record index.
    pub sample_id: u64,
    /// Token ids.
    pub input_ids: Vec<i32>,
    /// 1 where the loss applies.
    pub loss_mask: Vec<u8>,
}

/// All usable samples of an input file and what was done to the rest.
#[derive(Debug, Default)]
pub(crate) struct Inputs {
    /// Samples to capture, in input order.
    pub samples: Vec<InputSample>,
    /// Samples cut to `max_seq_len`.
    pub truncated: u64,
    /// Samples left out for being longer than `max_seq_len`.
    pub skipped_overlong: u64,
    /// Whether sample ids came from an integer `id` field (else from record positions).
    pub ids_from_input: bool,
}

/// Limits every record is checked against.
#[derive(Debug, Clone, Copy)]
pub(crate) struct InputLimits {
    /// Token ids must be below this.
    pub vocab_size: usize,
    /// Longest sample kept as is.
    pub max_seq_len: Option<usize>,
    /// What to do with longer ones.
    pub overlong: Overlong,
}

enum RawId {
    None,
    Int(i64),
    Str,
}

struct Record {
    location: String,
    id: RawId,
    input_ids: Option<Vec<i64>>,
    loss_mask: Option<Vec<i64>>,
}

/// Reads `path` (`.parquet` by extension, JSON lines otherwise) and checks every record.
pub(crate) fn read_inputs(path: &Path, limits: InputLimits) -> Result<Inputs> {
    let is_parquet = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("parquet"));
    let records = if is_parquet {
        read_parquet(path)?
    } else {
        read_jsonl(path, MAX_LINE_BYTES)?
    };
    check_records(path, records, limits)
}

fn input_err(path: &Path, location: &str, message: impl Into<String>) -> CaptureError {
    CaptureError::Input {
        path: path.to_path_buf(),
        location: location.to_string(),
        message: message.into(),
    }
}

fn check_records(path: &Path, records: Vec<Record>, limits: InputLimits) -> Result<Inputs> {
    let mut out = Inputs {
        ids_from_input: matches!(records.first().map(|r| &r.id), Some(RawId::Int(_))),
        ..Default::default()
    };
    let mut seen: HashMap<u64, String> = HashMap::new();
    for (index, r) in records.into_iter().enumerate() {
        let err = |m: String| input_err(path, &r.location, m);
        let sample_id = match (&r.id, out.ids_from_input) {
            (RawId::Int(i), true) => u64::try_from(*i).map_err(|_| err(format!("id {i} is negative; ids must be >= 0")))?,
            (_, true) => return Err(err("has no integer \"id\" but earlier records do; use integer ids everywhere or nowhere".into())),
            (RawId::Int(_), false) => {
                return Err(err("has an integer \"id\" but the first record does not; use integer ids everywhere or nowhere".into()))
            }
            (RawId::None | RawId::Str, false) => index as u64,
        };
        if let Some(first) = seen.insert(sample_id, r.location.clone()) {
            return Err(err(format!(
                "duplicate id {sample_id} (first seen at {first})"
            )));
        }
        let ids = r
            .input_ids
            .as_ref()
            .ok_or_else(|| err("missing field \"input_ids\"".into()))?;
        if ids.is_empty() {
            return Err(err(
                "empty input_ids: a sample needs at least one token".into()
            ));
        }
        if let Some((pos, &tok)) = ids
            .iter()
            .enumerate()
            .find(|(_, &t)| t < 0 || t as u64 >= limits.vocab_size as u64)
        {
            return Err(err(format!(
                "token id {tok} at position {pos} is outside the model's vocabulary (0..{})",
                limits.vocab_size
            )));
        }
        let mask = match &r.loss_mask {
            None => vec![1u8; ids.len()],
            Some(m) if m.len() != ids.len() => {
                return Err(err(format!(
                    "loss_mask has length {}, expected {} (the length of input_ids)",
                    m.len(),
                    ids.len()
                )))
            }
            Some(m) => {
                if let Some((pos, v)) = m.iter().enumerate().find(|(_, &v)| v != 0 && v != 1) {
                    return Err(err(format!(
                        "loss_mask value {v} at position {pos}; expected 0 or 1"
                    )));
                }
                m.iter().map(|&v| v as u8).collect()
            }
        };
        let mut input_ids: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
        let mut loss_mask = mask;
        if let Some(max) = limits.max_seq_len {
            if input_ids.len() > max {
                match limits.overlong {
                    Overlong::Skip => {
                        out.skipped_overlong += 1;
                        tracing::debug!(location = %r.location, len = input_ids.len(), max, "skipped: longer than --max-seq-len");
                        continue;
                    }
                    Overlong::Truncate => {
                        input_ids.truncate(max);
                        loss_mask.truncate(max);
                        out.truncated += 1;
                    }
                }
            }
        }
        out.samples.push(InputSample {
            sample_id,
            input_ids,
            loss_mask,
        });
    }
    Ok(out)
}

/// The records of one batch, whichever format it came from; `location(i)` names row `i`.
fn batch_records(
    path: &Path,
    batch: &RecordBatch,
    location: impl Fn(usize) -> String,
) -> Result<Vec<Record>> {
    let n = batch.num_rows();
    let column = |name: &str| -> Result<Vec<Option<ArrayRef>>> {
        match batch.column_by_name(name) {
            None => Ok(vec![None; n]),
            Some(c) => list_values(c).ok_or_else(|| {
                input_err(
                    path,
                    &format!("column {name:?}"),
                    format!("expected a list of integers, got {}", c.data_type()),
                )
            }),
        }
    };
    let (ids, masks) = (column("input_ids")?, column("loss_mask")?);
    let id_col: Vec<RawId> = match batch.column_by_name("id") {
        None => (0..n).map(|_| RawId::None).collect(),
        Some(c) if matches!(c.data_type(), DataType::Utf8 | DataType::LargeUtf8) => {
            (0..n).map(|_| RawId::Str).collect()
        }
        Some(c) if !integer_type(c.data_type()) => {
            return Err(input_err(
                path,
                "column \"id\"",
                format!("expected integers or strings, got {}", c.data_type()),
            ))
        }
        Some(c) => (0..n)
            .map(|i| match integer(c.as_ref(), i) {
                Some(Ok(v)) => Ok(RawId::Int(v)),
                Some(Err(m)) => Err(input_err(path, &location(i), format!("id {m}"))),
                None => Ok(RawId::None),
            })
            .collect::<Result<_>>()?,
    };
    let mut out = Vec::with_capacity(n);
    for (i, ((ids, mask), id)) in ids.into_iter().zip(masks).zip(id_col).enumerate() {
        let location = location(i);
        let list = |field: &str, values: Option<ArrayRef>| -> Result<Option<Vec<i64>>> {
            values
                .map(|v| {
                    integers(v.as_ref()).map_err(|m| {
                        input_err(
                            path,
                            &location,
                            format!("\"{field}\" must be a list of integers: {m}"),
                        )
                    })
                })
                .transpose()
        };
        out.push(Record {
            input_ids: list("input_ids", ids)?,
            loss_mask: list("loss_mask", mask)?,
            location,
            id,
        });
    }
    Ok(out)
}

/// Each row's list (`None` for null), for a list or large-list column.
fn list_values(col: &ArrayRef) -> Option<Vec<Option<ArrayRef>>> {
    let rows = |len: usize, is_null: &dyn Fn(usize) -> bool, value: &dyn Fn(usize) -> ArrayRef| {
        (0..len)
            .map(|i| (!is_null(i)).then(|| value(i)))
            .collect()
    };
    match col.data_type() {
        DataType::List(_) => {
            let l = col.as_list::<i32>();
            Some(rows(l.len(), &|i| l.is_null(i), &|i| l.value(i)))
        }
        DataType::LargeList(_) => {
            let l = col.as_list::<i64>();
            Some(rows(l.len(), &|i| l.is_null(i), &|i| l.value(i)))
        }
        _ => None,
    }
}

fn integer_type(t: &DataType) -> bool {
    t.is_integer() || t.is_floating() || *t == DataType::Boolean
}

/// Element `i` of an integer, float or boolean array as an integer: `None` if null, `Err`
/// (what it is instead) if it is not a whole number in range or the array holds no numbers.
fn integer(a: &dyn Array, i: usize) -> Option<Result<i64, String>> {
    if a.is_null(i) {
        return None;
    }
    let whole = |v: f64| {
        // i64::MAX as f64 rounds up to 2^63, which is out of range itself.
        if v.fract() == 0.0 && v >= i64::MIN as f64 && v < i64::MAX as f64 {
            Ok(v as i64)
        } else {
            Err(format!("{v} is not an integer"))
        }
    };
    Some(match a.data_type() {
        DataType::Int8 => Ok(a.as_primitive::<Int8Type>().value(i) as i64),
        DataType::Int16 => Ok(a.as_primitive::<Int16Type>().value(i) as i64),
        DataType::Int32 => Ok(a.as_primitive::<Int32Type>().value(i) as i64),
        DataType::Int64 => Ok(a.as_primitive::<Int64Type>().value(i)),
        DataType::UInt8 => Ok(a.as_primitive::<UInt8Type>().value(i) as i64),
        DataType::UInt16 => Ok(a.as_primitive::<UInt16Type>().value(i) as i64),
        DataType::UInt32 => Ok(a.as_primitive::<UInt32Type>().value(i) as i64),
        DataType::UInt64 => {
            let v = a.as_primitive::<UInt64Type>().value(i);
            i64::try_from(v).map_err(|_| format!("{v} is beyond {}", i64::MAX))
        }
        DataType::Float32 => whole(a.as_primitive::<Float32Type>().value(i) as f64),
        DataType::Float64 => whole(a.as_primitive::<Float64Type>().value(i)),
        DataType::Boolean => Ok(a.as_boolean().value(i) as i64),
        other => Err(format!("holds {other}, not numbers")),
    })
}

/// Every element of a list value as an integer; names the first that is not one.
fn integers(values: &dyn Array) -> Result<Vec<i64>, String> {
    (0..values.len())
        .map(|i| match integer(values, i) {
            Some(Ok(v)) => Ok(v),
            Some(Err(m)) => Err(format!("element {i}: {m}")),
            None => Err(format!("element {i} is null")),
        })
        .collect()
}

fn read_parquet(path: &Path) -> Result<Vec<Record>> {
    let file = File::open(path).map_err(|source| CaptureError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let pq = |e: parquet::errors::ParquetError| {
        input_err(path, "file", format!("not a readable Parquet file: {e}"))
    };
    let reader = ParquetRecordBatchReaderBuilder::try_new(file)
        .map_err(pq)?
        .build()
        .map_err(pq)?;
    let mut out = vec![];
    for batch in reader {
        let batch = batch.map_err(|e| pq(e.into()))?;
        let first = out.len();
        out.extend(batch_records(path, &batch, |i| format!("row {}", first + i))?);
    }
    Ok(out)
}

/// How a JSONL file's `id` field is read, decided by its first record: integer ids are then
/// required everywhere (decoded as text so that no float or string is silently rounded);
/// otherwise ids must be strings (or absent) and are not used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum JsonIds {
    Integers,
    Strings,
}

/// The Arrow schema JSONL records are decoded into. Numbers in the token lists decode as
/// f64, which is exact for every token id, so a fractional value is refused, not truncated;
/// `id` decodes as text (see [`JsonIds`]).
fn json_schema() -> SchemaRef {
    let list = |name| {
        Field::new(
            name,
            DataType::List(Arc::new(Field::new("item", DataType::Float64, true))),
            true,
        )
    };
    Arc::new(Schema::new(vec![
        list("input_ids"),
        list("loss_mask"),
        Field::new("id", DataType::Utf8, true),
    ]))
}

/// JSONL lines waiting to be decoded together, with their 1-based line numbers.
#[derive(Default)]
struct JsonChunk {
    bytes: Vec<u8>,
    lines: Vec<(usize, std::ops::Range<usize>)>,
}

fn read_jsonl(path: &Path, max_line: usize) -> Result<Vec<Record>> {
    let io = |source| CaptureError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut reader = BufReader::with_capacity(1 << 20, File::open(path).map_err(io)?);
    let mut out = vec![];
    let mut ids = None;
    let mut chunk = JsonChunk::default();
    let mut line = Vec::new();
    for number in 1.. {
        line.clear();
        let n = (&mut reader)
            .take(max_line as u64 + 1)
            .read_until(b'\n', &mut line)
            .map_err(io)?;
        if n == 0 {
            break;
        }
        if n > max_line && line.last() != Some(&b'\n') {
            return Err(input_err(
                path,
                &format!("line {number}"),
                format!(
                    "longer than {max_line} bytes without a line break; expected one JSON object \
                     per line (is this a JSONL file?)"
                ),
            ));
        }
        if line.trim_ascii().is_empty() {
            continue;
        }
        let ids = *ids.get_or_insert(first_record_ids(path, number, &line)?);
        let start = chunk.bytes.len();
        chunk.bytes.extend_from_slice(&line);
        chunk.lines.push((number, start..chunk.bytes.len()));
        if chunk.lines.len() >= CHUNK_LINES || chunk.bytes.len() >= CHUNK_BYTES {
            out.extend(decode_chunk(path, ids, &std::mem::take(&mut chunk))?);
        }
    }
    if let Some(ids) = ids {
        out.extend(decode_chunk(path, ids, &chunk)?);
    }
    Ok(out)
}

/// How ids are read, from the first record (which must be valid JSON for that).
fn first_record_ids(path: &Path, number: usize, line: &[u8]) -> Result<JsonIds> {
    let v: serde_json::Value = serde_json::from_slice(line).map_err(|e| {
        input_err(path, &format!("line {number}"), format!("not valid JSON: {e}"))
    })?;
    Ok(match v.get("id") {
        Some(id) if id.is_i64() || id.is_u64() => JsonIds::Integers,
        _ => JsonIds::Strings,
    })
}

fn decoder(ids: JsonIds, rows: usize) -> std::result::Result<arrow_json::reader::Decoder, ArrowError> {
    ReaderBuilder::new(json_schema())
        .with_batch_size(rows.max(1))
        .with_coerce_primitive(ids == JsonIds::Integers)
        .build_decoder()
}

/// Decodes `bytes` (whole lines) into one batch.
fn decode_lines(ids: JsonIds, bytes: &[u8], rows: usize) -> std::result::Result<RecordBatch, ArrowError> {
    let mut d = decoder(ids, rows)?;
    let mut rest = bytes;
    while !rest.is_empty() {
        let used = d.decode(rest)?;
        if used == 0 {
            break;
        }
        rest = &rest[used..];
    }
    if d.has_partial_record() {
        return Err(ArrowError::JsonError("the record does not end on its line".into()));
    }
    Ok(d.flush()?.unwrap_or_else(|| RecordBatch::new_empty(json_schema())))
}

/// One chunk's records; when Arrow refuses the chunk, each line is decoded alone to name the
/// one at fault.
fn decode_chunk(path: &Path, ids: JsonIds, chunk: &JsonChunk) -> Result<Vec<Record>> {
    let batch = match decode_lines(ids, &chunk.bytes, chunk.lines.len()) {
        Ok(b) if b.num_rows() == chunk.lines.len() => b,
        _ => return Err(locate_bad_line(path, ids, chunk)),
    };
    let batch = json_ids_as_integers(path, ids, batch, &chunk.lines)?;
    batch_records(path, &batch, |i| format!("line {}", chunk.lines[i].0))
}

fn locate_bad_line(path: &Path, ids: JsonIds, chunk: &JsonChunk) -> CaptureError {
    for (number, range) in &chunk.lines {
        let line = &chunk.bytes[range.clone()];
        let message = match decode_lines(ids, line, 1) {
            Ok(b) if b.num_rows() == 1 => continue,
            Ok(b) => format!("holds {} JSON values; expected one object per line", b.num_rows()),
            Err(e) => json_error(line, ids, e),
        };
        return input_err(path, &format!("line {number}"), message);
    }
    input_err(
        path,
        &format!("lines {}..={}", chunk.lines[0].0, chunk.lines[chunk.lines.len() - 1].0),
        "not readable together, though each line is alone",
    )
}

/// What is wrong with one line Arrow could not decode: its JSON, or its fields' types.
fn json_error(line: &[u8], ids: JsonIds, e: ArrowError) -> String {
    if let Err(syntax) = serde_json::from_slice::<serde::de::IgnoredAny>(line) {
        return format!("not valid JSON: {syntax}");
    }
    let detail = match e {
        ArrowError::JsonError(m) => m,
        other => other.to_string(),
    };
    let id = match ids {
        JsonIds::Integers => "an integer (as in the first record)",
        JsonIds::Strings => "a string (the first record has no integer id)",
    };
    format!(
        "expected a JSON object with \"input_ids\" and optional \"loss_mask\" (lists of integers) \
         and \"id\" ({id}): {detail}"
    )
}

/// With integer ids, the id texts as integers (null where a record has none or a non-integer,
/// which the record checks then name); a number beyond i64 is refused here.
fn json_ids_as_integers(
    path: &Path,
    ids: JsonIds,
    batch: RecordBatch,
    lines: &[(usize, std::ops::Range<usize>)],
) -> Result<RecordBatch> {
    if ids == JsonIds::Strings {
        return Ok(batch);
    }
    let text = batch.column(2).as_string::<i32>();
    let mut values = Vec::with_capacity(text.len());
    for (i, t) in text.iter().enumerate() {
        values.push(match t.map(str::parse::<i64>) {
            Some(Ok(v)) => Some(v),
            Some(Err(_)) if t.is_some_and(|t| t.parse::<u64>().is_ok()) => {
                return Err(input_err(
                    path,
                    &format!("line {}", lines[i].0),
                    format!("id {} is beyond {}", t.unwrap_or_default(), i64::MAX),
                ))
            }
            _ => None,
        });
    }
    let mut columns = batch.columns().to_vec();
    columns[2] = Arc::new(Int64Array::from(values));
    let fields: Vec<Field> = batch
        .schema()
        .fields()
        .iter()
        .map(|f| match f.name().as_str() {
            "id" => Field::new("id", DataType::Int64, true),
            _ => f.as_ref().clone(),
        })
        .collect();
    RecordBatch::try_new(Arc::new(Schema::new(fields)), columns)
        .map_err(|e| CaptureError::Pipeline(format!("rebuilding the id column: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    const LIMITS: InputLimits = InputLimits {
        vocab_size: 100,
        max_seq_len: None,
        overlong: Overlong::Truncate,
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
        let f = jsonl(&[r#"{"input_ids": [1]}"#, r#"{"input_ids": [1, 2, 3, 4, 5, 6]}"#]);
        let e = match read_jsonl(f.path(), 24) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("a 34-byte line passed a 24-byte bound"),
        };
        assert!(e.contains("line 2: longer than 24 bytes"), "{e}");
    }

    #[test]
    fn numbers_must_be_whole_and_lists_must_be_lists() {
        let ok = read_inputs(jsonl(&[r#"{"input_ids": [1.0, 2], "loss_mask": [true, 0]}"#]).path(), LIMITS);
        assert!(ok.is_err_and(|e| e.to_string().contains("line 1: expected a JSON object")));
        let s = read_inputs(jsonl(&[r#"{"input_ids": [1.0, 2]}"#]).path(), LIMITS).unwrap();
        assert_eq!(s.samples[0].input_ids, vec![1, 2]);
        assert!(err(&[r#"{"input_ids": [1, 2.5]}"#], LIMITS).ends_with(
            "line 1: \"input_ids\" must be a list of integers: element 1: 2.5 is not an integer"
        ));
        let e = err(&[GOOD, GOOD, r#"{"input_ids": "1 2 3"}"#, GOOD], LIMITS);
        assert!(e.contains("line 3: expected a JSON object with \"input_ids\""), "{e}");
        let e = err(&[GOOD, r#"{"input_ids": [1]} {"input_ids": [2]}"#], LIMITS);
        assert!(e.ends_with("line 2: holds 2 JSON values; expected one object per line"), "{e}");
        assert!(err(&[GOOD, "[1, 2]"], LIMITS).contains("line 2: expected a JSON object"));
    }

    #[test]
    fn the_first_record_decides_whether_ids_are_integers() {
        let e = err(&[r#"{"input_ids": [1], "id": 4}"#, r#"{"input_ids": [1], "id": "x"}"#], LIMITS);
        assert!(e.ends_with("line 2: has no integer \"id\" but earlier records do; use integer ids everywhere or nowhere"), "{e}");
        let e = err(&[r#"{"input_ids": [1], "id": 4}"#, r#"{"input_ids": [1], "id": 4.5}"#], LIMITS);
        assert!(e.contains("line 2: has no integer \"id\""), "{e}");
        let e = err(&[r#"{"input_ids": [1], "id": "a"}"#, r#"{"input_ids": [1], "id": 7}"#], LIMITS);
        assert!(e.contains("line 2: expected a JSON object") && e.contains("the first record has no integer id"), "{e}");
        let e = err(&[r#"{"input_ids": [1], "id": 9223372036854775808}"#], LIMITS);
        assert!(e.ends_with("line 1: id 9223372036854775808 is beyond 9223372036854775807"), "{e}");
    }

    #[test]
    fn jsonl_lines_are_named_across_chunks() {
        let mut lines = vec![GOOD; CHUNK_LINES + 5];
        lines.push(r#"{"input_ids": [1, 100]}"#);
        let e = err(&lines, LIMITS);
        assert!(e.contains(&format!("line {}: token id 100", CHUNK_LINES + 6)), "{e}");
    }

    #[test]
    fn parquet_rows_go_through_the_same_checks() {
        use arrow_array::builder::{Int32Builder, ListBuilder};
        let mut ids = ListBuilder::new(Int32Builder::new());
        ids.append_value([Some(1), Some(2)]);
        ids.append_value([Some(3), Some(500)]);
        let batch = RecordBatch::try_from_iter([("input_ids", Arc::new(ids.finish()) as ArrayRef)]).unwrap();
        let f = tempfile::Builder::new().suffix(".parquet").tempfile().unwrap();
        let mut w = parquet::arrow::ArrowWriter::try_new(f.reopen().unwrap(), batch.schema(), None).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
        let e = read_inputs(f.path(), LIMITS).unwrap_err().to_string();
        assert!(e.ends_with("row 1: token id 500 at position 1 is outside the model's vocabulary (0..100)"), "{e}");
    }
}
