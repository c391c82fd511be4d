//! Conversation records from JSONL or Parquet, one at a time, each with its line (JSONL, 1-based)
//! or row (Parquet, 0-based); a URL input is fetched through the store's object-store URLs first.
use std::collections::VecDeque;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use hslake_schemas::{JsonLine, JsonLines, MAX_LINE_BYTES};
use object_store::ObjectStoreExt;
use parquet::arrow::arrow_reader::{ParquetRecordBatchReader, ParquetRecordBatchReaderBuilder};
use serde_json::Value;

use crate::conversation::{parse_conversation, Conversation};
use crate::error::{io_err, PrepareError, RecordError, Result};

/// A file format of conversations or samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileFormat {
    /// One JSON object per line.
    Jsonl,
    /// A Parquet file.
    Parquet,
}

impl FileFormat {
    /// `.parquet` is Parquet, anything else JSON lines.
    pub fn of_path(path: &Path) -> FileFormat {
        if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("parquet"))
        {
            FileFormat::Parquet
        } else {
            FileFormat::Jsonl
        }
    }
}

impl std::str::FromStr for FileFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "jsonl" => Ok(FileFormat::Jsonl),
            "parquet" => Ok(FileFormat::Parquet),
            _ => Err(format!("unknown format {s:?}; expected jsonl or parquet")),
        }
    }
}

/// One input record, parsed as JSON or not.
#[derive(Debug, Clone)]
pub struct RawRecord {
    /// 0-based position among the input's records (blank lines are not records); the default
    /// sample id.
    pub index: u64,
    /// `line N` or `row N`.
    pub location: String,
    /// The record, or why it is unreadable.
    pub value: Result<Value, RecordError>,
}

/// One input record read as a conversation.
#[derive(Debug, Clone)]
pub struct ConversationRecord {
    /// 0-based position among the input's records.
    pub index: u64,
    /// `line N` or `row N`.
    pub location: String,
    /// The conversation, or why the record is not one.
    pub conversation: Result<Conversation, RecordError>,
}

impl ConversationRecord {
    /// The sample id: the record's integer `id`, else its position.
    pub fn sample_id(&self) -> u64 {
        self.conversation
            .as_ref()
            .ok()
            .and_then(|c| c.id)
            .unwrap_or(self.index)
    }
}

enum Inner {
    Jsonl(JsonLines<BufReader<File>>),
    Parquet {
        reader: ParquetRecordBatchReader,
        pending: VecDeque<Value>,
        row: u64,
    },
}

/// The records of an input file, in order.
pub struct Records {
    path: PathBuf,
    inner: Inner,
    index: u64,
    // After a JSONL line without a line break within the bound: nothing after it is a record.
    ended: bool,
}

/// Opens a JSONL or Parquet file (by extension) for reading record by record.
pub fn open_records(path: &Path) -> Result<Records> {
    let file = File::open(path).map_err(io_err(path))?;
    let inner = match FileFormat::of_path(path) {
        FileFormat::Jsonl => Inner::Jsonl(JsonLines::new(
            BufReader::with_capacity(1 << 20, file),
            MAX_LINE_BYTES,
        )),
        FileFormat::Parquet => {
            let bad = |e: parquet::errors::ParquetError| PrepareError::Input {
                path: path.to_path_buf(),
                message: format!("not a readable Parquet file: {e}"),
            };
            let reader = ParquetRecordBatchReaderBuilder::try_new(file)
                .map_err(bad)?
                .with_batch_size(1024)
                .build()
                .map_err(bad)?;
            Inner::Parquet {
                reader,
                pending: VecDeque::new(),
                row: 0,
            }
        }
    };
    Ok(Records {
        path: path.to_path_buf(),
        inner,
        index: 0,
        ended: false,
    })
}

/// The records of a file read as conversations.
pub fn read_conversations(path: &Path) -> Result<Conversations> {
    Ok(Conversations(open_records(path)?))
}

/// The records of a file read as conversations, in file order ([`read_conversations`]).
///
/// A named type rather than an `impl Iterator` over a closure: its `next` (the JSON parsing) is
/// then compiled here, at this crate's opt-level, even when the caller turns it into a trait
/// object, as the CLI does for [`crate::prepare`]; a closure's adapter would be compiled in the
/// caller, at opt-level 0 in the setup's build.
pub struct Conversations(Records);

impl Iterator for Conversations {
    type Item = Result<ConversationRecord>;

    fn next(&mut self) -> Option<Self::Item> {
        Some(self.0.next()?.map(|r| ConversationRecord {
            index: r.index,
            location: r.location,
            conversation: r.value.and_then(|v| parse_conversation(&v)),
        }))
    }
}

// A JSON line, or the reason it is not one.
fn parse_line(bytes: &[u8]) -> Result<Value, RecordError> {
    let text = std::str::from_utf8(bytes).map_err(|e| RecordError::InvalidUtf8 {
        offset: e.valid_up_to(),
    })?;
    serde_json::from_str(text).map_err(|e| RecordError::Malformed(format!("not valid JSON: {e}")))
}

impl Iterator for Records {
    type Item = Result<RawRecord>;

    fn next(&mut self) -> Option<Self::Item> {
        let (location, value) = match &mut self.inner {
            Inner::Jsonl(_) if self.ended => return None,
            Inner::Jsonl(lines) => match lines.next_line() {
                Err(e) => return Some(Err(io_err(&self.path)(e))),
                Ok(None) => return None,
                Ok(Some(JsonLine::Text { number, bytes })) => {
                    (format!("line {number}"), parse_line(bytes))
                }
                Ok(Some(JsonLine::TooLong { number })) => {
                    let message = format!("line {number}: {}", lines.too_long_reason());
                    self.ended = true;
                    return Some(Err(PrepareError::Input {
                        path: self.path.clone(),
                        message,
                    }));
                }
            },
            Inner::Parquet {
                reader,
                pending,
                row,
            } => {
                if pending.is_empty() {
                    match reader.next()? {
                        Ok(batch) => match batch_to_json(&batch) {
                            Ok(rows) => pending.extend(rows),
                            Err(message) => {
                                return Some(Err(PrepareError::Input {
                                    path: self.path.clone(),
                                    message,
                                }))
                            }
                        },
                        Err(e) => {
                            return Some(Err(PrepareError::Input {
                                path: self.path.clone(),
                                message: format!("row {row}: cannot read: {e}"),
                            }))
                        }
                    }
                }
                let v = pending.pop_front()?;
                let location = format!("row {row}");
                *row += 1;
                (location, Ok(v))
            }
        };
        let index = self.index;
        self.index += 1;
        Some(Ok(RawRecord {
            index,
            location,
            value,
        }))
    }
}

// Parquet rows as the JSON objects a JSONL file would hold, so one parser serves both.
fn batch_to_json(batch: &arrow_array::RecordBatch) -> Result<Vec<Value>, String> {
    let mut buf = Vec::new();
    {
        let mut w = arrow::json::LineDelimitedWriter::new(&mut buf);
        w.write(batch)
            .map_err(|e| format!("cannot convert rows to records: {e}"))?;
        w.finish()
            .map_err(|e| format!("cannot convert rows to records: {e}"))?;
    }
    buf.split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| {
            serde_json::from_slice(l).map_err(|e| format!("cannot convert rows to records: {e}"))
        })
        .collect()
}

/// The local file an input names: a plain path, or the path of a `file://` URL; `None` for
/// other stores.
pub fn local_input_path(input: &str) -> Option<PathBuf> {
    if !input.contains("://") {
        return Some(PathBuf::from(input));
    }
    hslake_store::location::parse(input).ok()?.local_dir()
}

/// Copies an object-store URL (`s3://…`, `file://…`) into `dir`, keeping its file name, so the
/// readers above can read it; a plain path is returned as is.
pub async fn fetch_input(input: &str, dir: &Path) -> Result<PathBuf> {
    if !input.contains("://") {
        return Ok(PathBuf::from(input));
    }
    let url_err = |message: String| PrepareError::Url {
        url: input.to_string(),
        message,
    };
    let loc = hslake_store::location::parse(input).map_err(|e| url_err(e.to_string()))?;
    let name = input
        .rsplit('/')
        .next()
        .filter(|n| !n.is_empty())
        .unwrap_or("input.jsonl");
    let data = loc
        .store
        .get(&loc.prefix)
        .await
        .map_err(|e| url_err(format!("cannot read: {e}")))?;
    let bytes = data
        .bytes()
        .await
        .map_err(|e| url_err(format!("cannot read: {e}")))?;
    let path = dir.join(name);
    std::fs::write(&path, &bytes).map_err(io_err(&path))?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::sync::Arc;

    use arrow_array::builder::{ListBuilder, StringBuilder, StructBuilder};
    use arrow_array::{Array, Int64Array, RecordBatch};
    use arrow_schema::{DataType, Field, Fields, Schema};

    #[test]
    fn names_jsonl_lines_and_skips_blank_ones() {
        let mut f = tempfile::Builder::new()
            .suffix(".jsonl")
            .tempfile()
            .unwrap();
        f.write_all(b"{\"prompt\": \"a\"}\n\n{bad\n\xff\xfe\n")
            .unwrap();
        let recs: Vec<RawRecord> = open_records(f.path())
            .unwrap()
            .map(Result::unwrap)
            .collect();
        let locs: Vec<&str> = recs.iter().map(|r| r.location.as_str()).collect();
        assert_eq!(locs, ["line 1", "line 3", "line 4"]);
        assert_eq!(recs.iter().map(|r| r.index).collect::<Vec<_>>(), [0, 1, 2]);
        assert!(recs[0].value.is_ok());
        assert!(
            matches!(&recs[1].value, Err(RecordError::Malformed(m)) if m.contains("not valid JSON"))
        );
        assert_eq!(recs[2].value, Err(RecordError::InvalidUtf8 { offset: 0 }));
    }

    #[test]
    fn reads_parquet_messages_as_conversations() {
        let msg = Fields::from(vec![
            Field::new("role", DataType::Utf8, true),
            Field::new("content", DataType::Utf8, true),
        ]);
        let mut list = ListBuilder::new(StructBuilder::new(
            msg.clone(),
            vec![
                Box::new(StringBuilder::new()),
                Box::new(StringBuilder::new()),
            ],
        ));
        for (role, content) in [("user", "hi"), ("assistant", "hello")] {
            let s = list.values();
            s.field_builder::<StringBuilder>(0)
                .unwrap()
                .append_value(role);
            s.field_builder::<StringBuilder>(1)
                .unwrap()
                .append_value(content);
            s.append(true);
        }
        list.append(true);
        let messages = list.finish();
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("messages", messages.data_type().clone(), true),
        ]));
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![Arc::new(Int64Array::from(vec![42])), Arc::new(messages)],
        )
        .unwrap();
        let f = tempfile::Builder::new()
            .suffix(".parquet")
            .tempfile()
            .unwrap();
        let mut w =
            parquet::arrow::ArrowWriter::try_new(f.reopen().unwrap(), schema, None).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
        let recs: Vec<ConversationRecord> = read_conversations(f.path())
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(recs.len(), 1);
        assert_eq!(recs[0].location, "row 0");
        assert_eq!(recs[0].sample_id(), 42);
        let c = recs[0].conversation.as_ref().unwrap();
        assert_eq!(c.messages[1].content, "hello");
    }

    #[test]
    fn refuses_a_file_that_is_not_parquet() {
        let mut f = tempfile::Builder::new()
            .suffix(".parquet")
            .tempfile()
            .unwrap();
        f.write_all(b"nope").unwrap();
        let e = open_records(f.path()).err().unwrap();
        assert!(e.to_string().contains("not a readable Parquet file"), "{e}");
    }
}
