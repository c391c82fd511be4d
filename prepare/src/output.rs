//! Tokenized samples written as `hslake capture` reads them (`id`, `input_ids`, `loss_mask`;
//! JSONL or Parquet), under a temporary name that becomes the output only when complete (the
//! store's [`files::OutputFile`], which also removes what killed runs left).
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::builder::{ListBuilder, UInt32Builder, UInt8Builder};
use arrow_array::{ArrayRef, Int64Array, RecordBatch};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use hslake_store::tools::files::{self, Existing, OutputError, OutputFile};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;

use crate::error::{PrepareError, Result};
use crate::source::FileFormat;

/// One sample ready for capture.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    /// The sample id.
    pub id: u64,
    /// Token ids.
    pub input_ids: Vec<u32>,
    /// 1 where the loss applies.
    pub loss_mask: Vec<u8>,
}

// A sample as one JSON line, `{"id":…,"input_ids":[…],"loss_mask":[…]}` (serde_json's compact
// form), appended to `line`. Written here rather than through serde: the line is only unsigned
// numbers, and serde_json's number formatting is compiled at opt-level 1 in the setup's build,
// where it took about a tenth of `hslake prepare`'s time; this is compiled at opt-level 3.
fn push_json_line(line: &mut Vec<u8>, s: &Sample) {
    line.extend_from_slice(b"{\"id\":");
    push_decimal(line, s.id);
    line.extend_from_slice(b",\"input_ids\":[");
    push_list(line, s.input_ids.iter().map(|&t| u64::from(t)));
    line.extend_from_slice(b"],\"loss_mask\":[");
    push_list(line, s.loss_mask.iter().map(|&m| u64::from(m)));
    line.extend_from_slice(b"]}\n");
}

fn push_list(line: &mut Vec<u8>, values: impl Iterator<Item = u64>) {
    for (i, v) in values.enumerate() {
        if i > 0 {
            line.push(b',');
        }
        push_decimal(line, v);
    }
}

fn push_decimal(line: &mut Vec<u8>, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    line.extend_from_slice(&digits[at..]);
}

const PARQUET_BATCH: usize = 2048;

enum Sink {
    Jsonl {
        file: BufWriter<std::fs::File>,
        // The line being written, kept between samples for its capacity.
        line: Vec<u8>,
    },
    Parquet {
        // Boxed: the writer is ten times the size of the JSONL variant.
        writer: Box<ArrowWriter<std::fs::File>>,
        pending: Vec<Sample>,
    },
}

/// Writes samples to a hidden temporary file next to the output; [`SampleWriter::finish`]
/// renames it into place, and dropping it unfinished removes it.
pub struct SampleWriter {
    path: PathBuf,
    out: OutputFile,
    sink: Sink,
}

fn schema() -> SchemaRef {
    let item = |t| Arc::new(Field::new("item", t, false));
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("input_ids", DataType::List(item(DataType::UInt32)), false),
        Field::new("loss_mask", DataType::List(item(DataType::UInt8)), false),
    ]))
}

fn batch(samples: &[Sample]) -> std::result::Result<RecordBatch, arrow_schema::ArrowError> {
    let item = |t| Field::new("item", t, false);
    let mut ids = ListBuilder::new(UInt32Builder::new()).with_field(item(DataType::UInt32));
    let mut masks = ListBuilder::new(UInt8Builder::new()).with_field(item(DataType::UInt8));
    for s in samples {
        ids.values().append_slice(&s.input_ids);
        ids.append(true);
        masks.values().append_slice(&s.loss_mask);
        masks.append(true);
    }
    let id = Int64Array::from_iter_values(samples.iter().map(|s| s.id as i64));
    RecordBatch::try_new(
        schema(),
        vec![
            Arc::new(id) as ArrayRef,
            Arc::new(ids.finish()),
            Arc::new(masks.finish()),
        ],
    )
}

impl From<OutputError> for PrepareError {
    fn from(e: OutputError) -> Self {
        PrepareError::Output {
            path: e.path,
            message: e.reason,
        }
    }
}

impl SampleWriter {
    /// Starts writing `path` in `format`, after removing temporary files that earlier runs
    /// writing `path` left behind. An existing file at `path` is replaced when the samples are
    /// finished.
    pub fn create(path: &Path, format: FileFormat) -> Result<Self> {
        let target = files::check_output(path, &[], Existing::Replace)?;
        let out_err = |message: String| PrepareError::Output {
            path: path.to_path_buf(),
            message,
        };
        let out = OutputFile::create(&target)?;
        let file = out.file()?;
        let sink = match format {
            FileFormat::Jsonl => Sink::Jsonl {
                file: BufWriter::with_capacity(1 << 20, file),
                line: Vec::new(),
            },
            FileFormat::Parquet => {
                let props = WriterProperties::builder()
                    .set_compression(Compression::ZSTD(ZstdLevel::default()))
                    .build();
                let writer = ArrowWriter::try_new(file, schema(), Some(props))
                    .map_err(|e| out_err(e.to_string()))?;
                Sink::Parquet {
                    writer: Box::new(writer),
                    pending: Vec::with_capacity(PARQUET_BATCH),
                }
            }
        };
        Ok(SampleWriter {
            path: path.to_path_buf(),
            out,
            sink,
        })
    }

    /// Appends one sample.
    pub fn write(&mut self, sample: Sample) -> Result<()> {
        let path = &self.path;
        let err = |message: String| PrepareError::Output {
            path: path.clone(),
            message,
        };
        match &mut self.sink {
            Sink::Jsonl { file, line } => {
                line.clear();
                push_json_line(line, &sample);
                file.write_all(line).map_err(|e| err(e.to_string()))
            }
            Sink::Parquet { writer, pending } => {
                pending.push(sample);
                if pending.len() >= PARQUET_BATCH {
                    let r = batch(pending)
                        .map_err(|e| e.to_string())
                        .and_then(|b| writer.write(&b).map_err(|e| e.to_string()));
                    pending.clear();
                    r.map_err(err)?;
                }
                Ok(())
            }
        }
    }

    /// Flushes, syncs and renames the temporary file to the output path.
    pub fn finish(self) -> Result<()> {
        let SampleWriter { path, out, sink } = self;
        let out_err = |message: String| PrepareError::Output {
            path: path.clone(),
            message,
        };
        let file = match sink {
            Sink::Jsonl { file, .. } => file.into_inner().map_err(|e| out_err(e.to_string()))?,
            Sink::Parquet {
                mut writer,
                pending,
            } => {
                if !pending.is_empty() {
                    let b = batch(&pending).map_err(|e| out_err(e.to_string()))?;
                    writer.write(&b).map_err(|e| out_err(e.to_string()))?;
                }
                writer.into_inner().map_err(|e| out_err(e.to_string()))?
            }
        };
        Ok(out.finish(file, Existing::Replace)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(id: u64) -> Sample {
        Sample {
            id,
            input_ids: vec![1, 2, 3],
            loss_mask: vec![0, 1, 1],
        }
    }

    #[test]
    fn writes_jsonl_only_when_finished() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("s.jsonl");
        let mut w = SampleWriter::create(&out, FileFormat::Jsonl).unwrap();
        w.write(sample(4)).unwrap();
        assert!(!out.exists());
        w.finish().unwrap();
        let text = std::fs::read_to_string(&out).unwrap();
        assert_eq!(
            text,
            "{\"id\":4,\"input_ids\":[1,2,3],\"loss_mask\":[0,1,1]}\n"
        );
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn writes_the_json_lines_serde_json_writes() {
        for s in [
            Sample {
                id: u64::MAX,
                input_ids: vec![0, 9, 10, 99, 100, u32::MAX],
                loss_mask: vec![0, 1, 255, 1, 0, 1],
            },
            Sample {
                id: 0,
                input_ids: vec![],
                loss_mask: vec![],
            },
            Sample {
                id: 1_000_000_007,
                input_ids: (0..3000).map(|i| i * 7919).collect(),
                loss_mask: (0..3000).map(|i| (i % 2) as u8).collect(),
            },
        ] {
            let mut line = vec![];
            push_json_line(&mut line, &s);
            let expected = serde_json::json!({
                "id": s.id, "input_ids": s.input_ids, "loss_mask": s.loss_mask,
            });
            assert_eq!(String::from_utf8(line).unwrap(), format!("{expected}\n"));
        }
    }

    #[test]
    fn leaves_nothing_when_dropped_unfinished() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("s.parquet");
        let mut w = SampleWriter::create(&out, FileFormat::Parquet).unwrap();
        w.write(sample(1)).unwrap();
        drop(w);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn writes_parquet_lists() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("s.parquet");
        let mut w = SampleWriter::create(&out, FileFormat::Parquet).unwrap();
        for i in 0..3000 {
            w.write(sample(i)).unwrap();
        }
        w.finish().unwrap();
        let r = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(
            std::fs::File::open(&out).unwrap(),
        )
        .unwrap()
        .build()
        .unwrap();
        let rows: usize = r.map(|b| b.unwrap().num_rows()).sum();
        assert_eq!(rows, 3000);
    }
}
