//! JSONL inputs: one JSON object per line, each parsed with serde_json into an input record.
//! Lines are read with a length bound, so a file without line breaks is refused instead of
//! being buffered until memory runs out.
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use serde_json::Value;

use super::{input_err, RawId, Record};
use crate::error::{CaptureError, Result};

/// The longest JSONL line accepted: far above any real sample (a million tokens is ~10 MB of
/// JSON), and a bound on what a file without line breaks (`/dev/zero`) can make us buffer.
pub(super) const MAX_LINE_BYTES: usize = 256 << 20;

/// Every record of a JSONL file whose lines are at most `max_line` bytes; blank lines are
/// skipped (but counted in line numbers).
pub(super) fn read_jsonl(path: &Path, max_line: usize) -> Result<Vec<Record>> {
    let io = |source| CaptureError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut reader = BufReader::with_capacity(1 << 20, File::open(path).map_err(io)?);
    let mut out = vec![];
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
        let location = format!("line {number}");
        if n > max_line && line.last() != Some(&b'\n') {
            return Err(input_err(
                path,
                &location,
                format!(
                    "longer than {max_line} bytes without a line break; expected one JSON object \
                     per line (is this a JSONL file?)"
                ),
            ));
        }
        if line.trim_ascii().is_empty() {
            continue;
        }
        out.push(record(path, location, &line)?);
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
