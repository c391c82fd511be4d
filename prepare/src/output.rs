//! Tokenized samples written as `hslake capture` reads them (`id`, `input_ids`, `loss_mask`;
//! JSONL or Parquet), under a temporary name that becomes the output only when complete.
//!
//! The temporary file is locked (`flock`) while its run writes it, and the kernel drops the lock
//! when the process ends however it ends; so a run that was killed or aborted leaves a file no
//! process holds, and the next run writing the same output removes it.
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

// The folder an output goes into.
fn folder_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Whether two paths name the same file: the same device and inode where both exist (through
/// symbolic and hard links), else the same name in the same folder.
pub fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => {
            let folder = |p: &Path| folder_of(p).canonicalize().ok();
            a.file_name().is_some() && a.file_name() == b.file_name() && {
                let fa = folder(a);
                fa.is_some() && fa == folder(b)
            }
        }
    }
}

/// Refuses an output path that a finished file cannot replace, or that names one of `inputs`:
/// a directory, a symbolic link (renaming into place would replace the link, not write its
/// target), a device, pipe or socket (it would be replaced by a regular file), a folder that does
/// not exist, or an input (the samples would replace what they are made from).
pub fn check_output(path: &Path, inputs: &[&Path]) -> Result<()> {
    let refuse = |message: String| {
        Err(PrepareError::Output {
            path: path.to_path_buf(),
            message,
        })
    };
    if path.file_name().is_none() || path.as_os_str().to_string_lossy().ends_with('/') {
        return refuse("names a directory; expected a file path".into());
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => return refuse("is a directory; expected a file path".into()),
        Ok(m) if m.file_type().is_symlink() => {
            let target = std::fs::read_link(path)
                .map(|t| format!(" (to {})", t.display()))
                .unwrap_or_default();
            return refuse(format!(
                "is a symbolic link{target}; the output is written under a temporary name and \
                 renamed into place, which would replace the link and leave its target as it \
                 was; give the target's path or a new name"
            ));
        }
        Ok(m) if !m.is_file() => {
            return refuse(
                "is not a regular file (a device, pipe or socket); the output is written under \
                 a temporary name and renamed into place, which would replace it; expected a \
                 file path"
                    .into(),
            )
        }
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return refuse(format!("cannot inspect: {e}")),
    }
    let dir = folder_of(path);
    if !dir.is_dir() {
        return refuse(format!("the folder {} does not exist", dir.display()));
    }
    if let Some(input) = inputs.iter().find(|i| same_file(path, i)) {
        return refuse(format!(
            "is the input {}; the samples would replace the conversations they are made from; \
             expected another path",
            input.display()
        ));
    }
    Ok(())
}

// What every temporary file of `name` starts with; `.tmp` ends it.
fn temporary_prefix(name: &str) -> String {
    format!(".{name}.hslake-")
}

// Removes the temporary files of `name` in `dir` that no process holds locked: left by runs that
// were killed or aborted before they could remove them.
fn remove_abandoned(dir: &Path, name: &str) {
    let prefix = temporary_prefix(name);
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let file_name = file_name.to_string_lossy();
        if !file_name.starts_with(&prefix)
            || !file_name.ends_with(".tmp")
            || !entry.file_type().is_ok_and(|t| t.is_file())
        {
            continue;
        }
        let path = entry.path();
        let Ok(file) = std::fs::File::open(&path) else {
            continue;
        };
        // A run writing it now holds the lock.
        if file.try_lock().is_ok() && std::fs::remove_file(&path).is_ok() {
            tracing::info!(file = %path.display(), "removed a temporary file left by an earlier run that did not finish");
        }
    }
}

impl SampleWriter {
    /// Starts writing `path` in `format`, after removing temporary files that earlier runs
    /// writing `path` left behind.
    pub fn create(path: &Path, format: FileFormat) -> Result<Self> {
        check_output(path, &[])?;
        let out_err = |message: String| PrepareError::Output {
            path: path.to_path_buf(),
            message,
        };
        let dir = folder_of(path);
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        remove_abandoned(&dir, &name);
        let tmp = tempfile::Builder::new()
            .prefix(&temporary_prefix(&name))
            .suffix(".tmp")
            .tempfile_in(&dir)
            .map_err(|e| {
                out_err(format!(
                    "cannot create a temporary file in {}: {e}",
                    dir.display()
                ))
            })?;
        // Held until the file is renamed into place or removed; another run that opens it in
        // the moment before it is taken may remove it, and this run then fails to rename it.
        tmp.as_file()
            .lock()
            .map_err(|e| out_err(format!("cannot lock the temporary file: {e}")))?;
        let file = tmp.reopen().map_err(|e| out_err(e.to_string()))?;
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
        let SampleWriter { path, tmp, sink } = self;
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
    fn refuses_outputs_a_finished_file_cannot_replace() {
        let dir = tempfile::tempdir().unwrap();
        let err = |p: &Path, inputs: &[&Path]| check_output(p, inputs).unwrap_err().to_string();
        assert!(err(dir.path(), &[]).ends_with("is a directory; expected a file path"));
        let target = dir.path().join("t.jsonl");
        std::fs::write(&target, "x").unwrap();
        let link = dir.path().join("l.jsonl");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let e = err(&link, &[]);
        assert!(e.contains("is a symbolic link (to "), "{e}");
        let e = err(&dir.path().join("missing/o.jsonl"), &[]);
        assert!(e.ends_with("missing does not exist"), "{e}");
        let e = err(&target, &[&link]);
        assert!(e.contains("is the input"), "{e}");
        let e = err(Path::new("/dev/null"), &[]);
        assert!(e.contains("is not a regular file"), "{e}");
        check_output(&dir.path().join("new.jsonl"), &[&target]).unwrap();
        check_output(&target, &[]).unwrap();
    }

    #[test]
    fn same_file_follows_links_and_compares_names_of_files_not_yet_written() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a");
        std::fs::write(&a, "x").unwrap();
        let hard = dir.path().join("h");
        std::fs::hard_link(&a, &hard).unwrap();
        assert!(same_file(&a, &hard));
        let new = dir.path().join("n");
        let sub = dir.path().join("sub");
        std::fs::create_dir(&sub).unwrap();
        assert!(same_file(&new, &sub.join("../n")));
        assert!(!same_file(&new, &a));
    }

    #[test]
    fn removes_temporary_files_no_running_writer_holds() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("s.jsonl");
        let running = SampleWriter::create(&out, FileFormat::Jsonl).unwrap();
        // What a killed run leaves: its file, no lock.
        let abandoned = dir.path().join(".s.jsonl.hslake-dead00.tmp");
        std::fs::write(&abandoned, "partial").unwrap();
        let mut second = SampleWriter::create(&out, FileFormat::Jsonl).unwrap();
        assert!(!abandoned.exists());
        assert!(
            running.tmp.path().exists(),
            "a running writer's file is kept"
        );
        second.write(sample(1)).unwrap();
        second.finish().unwrap();
        drop(running);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
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
