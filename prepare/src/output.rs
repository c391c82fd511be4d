//! Tokenized samples written as `hslake capture` reads them (`id`, `input_ids`, `loss_mask`;
//! JSONL or Parquet), under a temporary name that becomes the output only when complete.
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::builder::{ListBuilder, UInt32Builder, UInt8Builder};
use arrow_array::{ArrayRef, Int64Array, RecordBatch};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use tempfile::NamedTempFile;

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

// A sample as one JSON line, serialized straight from its slices (no intermediate `Value`).
#[derive(serde::Serialize)]
struct JsonRow<'a> {
    id: u64,
    input_ids: &'a [u32],
    loss_mask: &'a [u8],
}

impl<'a> From<&'a Sample> for JsonRow<'a> {
    fn from(s: &'a Sample) -> Self {
        JsonRow {
            id: s.id,
            input_ids: &s.input_ids,
            loss_mask: &s.loss_mask,
        }
    }
}

const PARQUET_BATCH: usize = 2048;

enum Sink {
    Jsonl(BufWriter<std::fs::File>),
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
    tmp: NamedTempFile,
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

impl SampleWriter {
    /// Starts writing `path` in `format`.
    pub fn create(path: &Path, format: FileFormat) -> Result<Self> {
        let out_err = |message: String| PrepareError::Output {
            path: path.to_path_buf(),
            message,
        };
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let tmp = tempfile::Builder::new()
            .prefix(&format!(".{name}."))
            .suffix(".tmp")
            .tempfile_in(&dir)
            .map_err(|e| {
                out_err(format!(
                    "cannot create a temporary file in {}: {e}",
                    dir.display()
                ))
            })?;
        let file = tmp.reopen().map_err(|e| out_err(e.to_string()))?;
        let sink = match format {
            FileFormat::Jsonl => Sink::Jsonl(BufWriter::with_capacity(1 << 20, file)),
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
            tmp,
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
            Sink::Jsonl(w) => {
                let r = serde_json::to_writer(&mut *w, &JsonRow::from(&sample))
                    .map_err(std::io::Error::from)
                    .and_then(|_| w.write_all(b"\n"));
                r.map_err(|e| err(e.to_string()))
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
        let SampleWriter { path, tmp, sink } = self;
        let out_err = |message: String| PrepareError::Output {
            path: path.clone(),
            message,
        };
        let file = match sink {
            Sink::Jsonl(w) => w.into_inner().map_err(|e| out_err(e.to_string()))?,
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
        file.sync_all().map_err(|e| out_err(e.to_string()))?;
        tmp.persist(&path)
            .map_err(|e| out_err(format!("cannot rename into place: {}", e.error)))?;
        Ok(())
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
