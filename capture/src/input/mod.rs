//! Tokenized samples from JSONL or Parquet (`input_ids`, optional `loss_mask`, optional `id`),
//! checked record by record with errors that name the line (JSONL) or row (Parquet). Each
//! format is read into the same records ([`jsonl`] with serde_json, [`parquet`] through Arrow)
//! and one path checks them (here). JSONL is not read through arrow-json: on token lists it
//! measured 3-4x slower than serde_json (docs/PERFORMANCE.md).
use std::collections::HashMap;
use std::path::Path;

use crate::error::{CaptureError, Result};
use hslake_schemas::Overlong;

mod jsonl;
mod parquet;

/// A record's `id`, before the checks decide what it means.
enum RawId {
    None,
    Int(i64),
    Str,
}

/// One input record as read, before its checks.
struct Record {
    /// "line N" or "row N".
    location: String,
    /// Its id.
    id: RawId,
    /// Token ids, if present.
    input_ids: Option<Vec<i64>>,
    /// Loss mask, if present.
    loss_mask: Option<Vec<i64>>,
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

/// Reads `path` (`.parquet` by extension, JSON lines otherwise) and checks every record.
pub fn read_inputs(path: &Path, limits: InputLimits) -> Result<Inputs> {
    let is_parquet = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("parquet"));
    let records = if is_parquet {
        parquet::read_parquet(path)?
    } else {
        jsonl::read_jsonl(path, hslake_schemas::MAX_LINE_BYTES)?
    };
    check_records(path, records, limits)
}

pub(super) fn input_err(path: &Path, location: &str, message: impl Into<String>) -> CaptureError {
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
        let f = jsonl(&[
            r#"{"input_ids": [1]}"#,
            r#"{"input_ids": [1, 2, 3, 4, 5, 6]}"#,
        ]);
        let e = match read_jsonl(f.path(), 24) {
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
}
