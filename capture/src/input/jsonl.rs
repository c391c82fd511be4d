//! JSONL inputs: one JSON object per line, each parsed with serde_json into an input record.
//! Lines are read through the schemas crate's bounded reader, so a file without line breaks is
//! refused instead of being buffered until memory runs out.
use std::fs::File;
use std::io::BufReader;
use std::path::Path;

use hslake_schemas::{JsonLine, JsonLines};
use serde_json::Value;

use super::{input_err, RawId, Record};
use crate::error::{CaptureError, Result};

/// Every record of a JSONL file whose lines are at most `max_line` bytes; blank lines are
/// skipped (but counted in line numbers).
pub(super) fn read_jsonl(path: &Path, max_line: usize) -> Result<Vec<Record>> {
    let io = |source| CaptureError::Io {
        path: path.to_path_buf(),
        source,
    };
    let reader = BufReader::with_capacity(1 << 20, File::open(path).map_err(io)?);
    let mut lines = JsonLines::new(reader, max_line);
    let mut out = vec![];
    loop {
        let (number, bytes) = match lines.next_line().map_err(io)? {
            None => break,
            Some(JsonLine::Text { number, bytes }) => (number, bytes),
            Some(JsonLine::TooLong { number }) => {
                let reason = lines.too_long_reason();
                return Err(input_err(path, &format!("line {number}"), reason));
            }
        };
        out.push(record(path, format!("line {number}"), bytes)?);
    }
    Ok(out)
}

/// One line's record.
fn record(path: &Path, location: String, line: &[u8]) -> Result<Record> {
    let err = |m: String| input_err(path, &location, m);
    let v: Value = serde_json::from_slice(line).map_err(|e| err(format!("not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(err("expected a JSON object with \"input_ids\"".into()));
    }
    let list = |field: &str| -> Result<Option<Vec<i64>>> {
        match v.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => integers(x)
                .map(Some)
                .ok_or_else(|| err(format!("\"{field}\" must be a list of integers"))),
        }
    };
    let input_ids = list("input_ids")?;
    let loss_mask = list("loss_mask")?;
    let id = match v.get("id") {
        None | Some(Value::Null) => RawId::None,
        Some(Value::String(_)) => RawId::Str,
        Some(x) => RawId::Int(
            x.as_i64()
                .ok_or_else(|| err(format!("\"id\" must be an integer or a string, got {x}")))?,
        ),
    };
    Ok(Record {
        location,
        id,
        input_ids,
        loss_mask,
    })
}

/// A JSON list of integers (booleans count as 0 and 1); `None` if it is anything else.
fn integers(v: &Value) -> Option<Vec<i64>> {
    v.as_array()?
        .iter()
        .map(|x| x.as_i64().or_else(|| x.as_bool().map(i64::from)))
        .collect()
}
