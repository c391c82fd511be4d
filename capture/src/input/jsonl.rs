//! JSON lines into Arrow record batches through arrow-json, a chunk of lines at a time, with
//! every error named by its line: a bounded line length, the first record deciding how `id`
//! is read, and a line-by-line retry that finds the line Arrow refused.
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::{Array, Int64Array, RecordBatch};
use arrow_json::ReaderBuilder;
use arrow_schema::{ArrowError, DataType, Field, Schema, SchemaRef};

use super::input_err;
use super::records::{batch_records, Record};
use crate::error::{CaptureError, Result};

/// The longest JSONL line accepted: far above any real sample (a million tokens is ~10 MB of
/// JSON), and a bound on what a file without line breaks (`/dev/zero`) can make us buffer.
pub(super) const MAX_LINE_BYTES: usize = 256 << 20;

/// JSONL lines decoded together (and at most this many bytes).
pub(super) const CHUNK_LINES: usize = 1024;
const CHUNK_BYTES: usize = 16 << 20;

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

/// Every record of a JSONL file whose lines are at most `max_line` bytes.
pub(super) fn read_jsonl(path: &Path, max_line: usize) -> Result<Vec<Record>> {
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
        let ids = match ids {
            Some(ids) => ids,
            None => *ids.insert(first_record_ids(path, number, &line)?),
        };
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
    if d.has_partial_record() || !rest.trim_ascii().is_empty() {
        return Err(ArrowError::JsonError(
            "the lines do not hold one JSON value each".into(),
        ));
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
            Ok(_) => "holds no JSON value".into(),
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
