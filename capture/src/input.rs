//! Tokenized samples from JSONL or Parquet (`input_ids`, optional `loss_mask`, optional `id`),
//! checked record by record with errors that name the line (JSONL) or row (Parquet).
use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;

use arrow_array::{
    Array, ArrayRef, BooleanArray, Int16Array, Int32Array, Int64Array, Int8Array, LargeListArray,
    LargeStringArray, ListArray, RecordBatch, StringArray, UInt16Array, UInt32Array, UInt64Array,
    UInt8Array,
};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

use crate::error::{CaptureError, Result};

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
pub struct InputSample {
    /// The dataset's sample id: the input's integer `id`, else the 0-based record index.
    pub sample_id: u64,
    /// Token ids.
    pub input_ids: Vec<i32>,
    /// 1 where the loss applies.
    pub loss_mask: Vec<u8>,
}

/// All usable samples of an input file and what was done to the rest.
#[derive(Debug, Default)]
pub struct Inputs {
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
pub struct InputLimits {
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
pub fn read_inputs(path: &Path, limits: InputLimits) -> Result<Inputs> {
    let is_parquet = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("parquet"));
    let records = if is_parquet {
        read_parquet(path)?
    } else {
        read_jsonl(path)?
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

fn int_list(v: &serde_json::Value) -> Option<Vec<i64>> {
    v.as_array()?
        .iter()
        .map(|x| x.as_i64().or_else(|| x.as_bool().map(i64::from)))
        .collect()
}

fn read_jsonl(path: &Path) -> Result<Vec<Record>> {
    let io = |source| CaptureError::Io {
        path: path.to_path_buf(),
        source,
    };
    let reader = BufReader::new(File::open(path).map_err(io)?);
    let mut out = vec![];
    for (n, line) in reader.lines().enumerate() {
        let line = line.map_err(io)?;
        if line.trim().is_empty() {
            continue;
        }
        let location = format!("line {}", n + 1);
        let v: serde_json::Value = serde_json::from_str(&line)
            .map_err(|e| input_err(path, &location, format!("not valid JSON: {e}")))?;
        if !v.is_object() {
            return Err(input_err(
                path,
                &location,
                "expected a JSON object with \"input_ids\"",
            ));
        }
        let list = |field: &str| -> Result<Option<Vec<i64>>> {
            match v.get(field) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(x) => int_list(x).map(Some).ok_or_else(|| {
                    input_err(
                        path,
                        &location,
                        format!("\"{field}\" must be a list of integers"),
                    )
                }),
            }
        };
        let input_ids = list("input_ids")?;
        let loss_mask = list("loss_mask")?;
        let id = match v.get("id") {
            None | Some(serde_json::Value::Null) => RawId::None,
            Some(serde_json::Value::String(_)) => RawId::Str,
            Some(x) => RawId::Int(x.as_i64().ok_or_else(|| {
                input_err(
                    path,
                    &location,
                    format!("\"id\" must be an integer or a string, got {x}"),
                )
            })?),
        };
        out.push(Record {
            location,
            id,
            input_ids,
            loss_mask,
        });
    }
    Ok(out)
}

fn ints(a: &dyn Array) -> Option<Vec<Option<i64>>> {
    macro_rules! try_as {
        ($($t:ty),*) => {$(
            if let Some(x) = a.as_any().downcast_ref::<$t>() {
                return Some(x.iter().map(|v| v.map(|v| v as i64)).collect());
            }
        )*};
    }
    try_as!(
        Int64Array,
        Int32Array,
        Int16Array,
        Int8Array,
        UInt32Array,
        UInt16Array,
        UInt8Array
    );
    if let Some(x) = a.as_any().downcast_ref::<UInt64Array>() {
        return Some(
            x.iter()
                .map(|v| v.map(|v| v.min(i64::MAX as u64) as i64))
                .collect(),
        );
    }
    if let Some(x) = a.as_any().downcast_ref::<BooleanArray>() {
        return Some(x.iter().map(|v| v.map(i64::from)).collect());
    }
    None
}

fn list_rows(path: &Path, name: &str, col: &ArrayRef) -> Result<Vec<Option<Vec<i64>>>> {
    let bad = || CaptureError::Input {
        path: path.to_path_buf(),
        location: format!("column {name:?}"),
        message: format!("expected a list of integers, got {}", col.data_type()),
    };
    let row = |values: ArrayRef| -> Result<Vec<i64>> {
        ints(values.as_ref())
            .ok_or_else(bad)?
            .into_iter()
            .map(|v| v.ok_or_else(bad))
            .collect()
    };
    let mut out = Vec::with_capacity(col.len());
    if let Some(l) = col.as_any().downcast_ref::<ListArray>() {
        for i in 0..l.len() {
            out.push(if l.is_null(i) {
                None
            } else {
                Some(row(l.value(i))?)
            });
        }
    } else if let Some(l) = col.as_any().downcast_ref::<LargeListArray>() {
        for i in 0..l.len() {
            out.push(if l.is_null(i) {
                None
            } else {
                Some(row(l.value(i))?)
            });
        }
    } else {
        return Err(bad());
    }
    Ok(out)
}

fn read_parquet(path: &Path) -> Result<Vec<Record>> {
    let path = path.to_path_buf();
    let file = File::open(&path).map_err(|source| CaptureError::Io {
        path: path.clone(),
        source,
    })?;
    let pq = |e: parquet::errors::ParquetError| CaptureError::Input {
        path: path.clone(),
        location: "file".into(),
        message: format!("not a readable Parquet file: {e}"),
    };
    let reader = ParquetRecordBatchReaderBuilder::try_new(file)
        .map_err(pq)?
        .build()
        .map_err(pq)?;
    let mut out = vec![];
    for batch in reader {
        let batch: RecordBatch = batch.map_err(|e| pq(e.into()))?;
        let n = batch.num_rows();
        let ids = match batch.column_by_name("input_ids") {
            Some(c) => list_rows(&path, "input_ids", c)?,
            None => vec![None; n],
        };
        let masks = match batch.column_by_name("loss_mask") {
            Some(c) => list_rows(&path, "loss_mask", c)?,
            None => vec![None; n],
        };
        let id_col: Vec<RawId> = match batch.column_by_name("id") {
            None => (0..n).map(|_| RawId::None).collect(),
            Some(c) if c.as_any().is::<StringArray>() || c.as_any().is::<LargeStringArray>() => {
                (0..n).map(|_| RawId::Str).collect()
            }
            Some(c) => ints(c.as_ref())
                .ok_or_else(|| CaptureError::Input {
                    path: path.clone(),
                    location: "column \"id\"".into(),
                    message: format!("expected integers or strings, got {}", c.data_type()),
                })?
                .into_iter()
                .map(|v| v.map_or(RawId::None, RawId::Int))
                .collect(),
        };
        for ((input_ids, loss_mask), id) in ids.into_iter().zip(masks).zip(id_col) {
            let location = format!("row {}", out.len());
            out.push(Record {
                location,
                id,
                input_ids,
                loss_mask,
            });
        }
    }
    Ok(out)
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
}
