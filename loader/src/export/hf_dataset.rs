//! A Hugging Face `datasets` directory as `Dataset.save_to_disk` writes it and `load_from_disk`
//! reads it: one Arrow IPC stream file `data-00000-of-00001.arrow` (schema metadata
//! `huggingface` carrying the features), `dataset_info.json` and `state.json` (torch format).
//! Columns: `input_ids` and `loss_mask` (lists of int64), `seq_len` and `sample_id` (int64).
//! Rows are appended as they come and flushed in record batches, so memory stays bounded.
use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::builder::{Int64Builder, ListBuilder};
use arrow_array::{ArrayRef, RecordBatch};
use arrow_ipc::writer::StreamWriter;
use arrow_schema::{DataType, Field, Schema};

use super::{create_file, io_err, publish, tmp_name, write_atomic};
use crate::LoaderError;

const DATA_FILE: &str = "data-00000-of-00001.arrow";
const FLUSH_ROWS: usize = 1024;

/// Appends rows to a `datasets` directory; nothing is visible to `load_from_disk` until
/// [`HfDatasetWriter::finish`] renames the files into place.
pub struct HfDatasetWriter {
    dir: PathBuf,
    schema: Arc<Schema>,
    writer: StreamWriter<BufWriter<File>>,
    input_ids: ListBuilder<Int64Builder>,
    loss_mask: ListBuilder<Int64Builder>,
    seq_len: Int64Builder,
    sample_id: Int64Builder,
    pending: usize,
    rows: usize,
}

fn features_json() -> serde_json::Value {
    let list = |dtype: &str| serde_json::json!({"feature": {"dtype": dtype, "_type": "Value"}, "_type": "List"});
    let value = |dtype: &str| serde_json::json!({"dtype": dtype, "_type": "Value"});
    serde_json::json!({
        "input_ids": list("int64"),
        "loss_mask": list("int64"),
        "seq_len": value("int64"),
        "sample_id": value("int64"),
    })
}

impl HfDatasetWriter {
    /// Start writing into `dir` (which must exist).
    pub fn create(dir: &Path) -> Result<Self, LoaderError> {
        let item = |n: &str| Field::new(n, DataType::Int64, true);
        let list = |n: &str| Field::new(n, DataType::List(Arc::new(item("item"))), true);
        let meta = serde_json::json!({"info": {"features": features_json()}}).to_string();
        let schema = Arc::new(
            Schema::new(vec![
                list("input_ids"),
                list("loss_mask"),
                item("seq_len"),
                item("sample_id"),
            ])
            .with_metadata([("huggingface".to_string(), meta)].into()),
        );
        let path = tmp_name(&dir.join(DATA_FILE));
        let file = create_file(&path)?;
        let writer =
            StreamWriter::try_new(BufWriter::new(file), &schema).map_err(|e| io_err(&path, e))?;
        Ok(HfDatasetWriter {
            dir: dir.to_path_buf(),
            schema,
            writer,
            input_ids: ListBuilder::new(Int64Builder::new()),
            loss_mask: ListBuilder::new(Int64Builder::new()),
            seq_len: Int64Builder::new(),
            sample_id: Int64Builder::new(),
            pending: 0,
            rows: 0,
        })
    }

    /// Append one row.
    pub fn append(
        &mut self,
        sample_id: u64,
        input_ids: &[i64],
        loss_mask: &[i64],
    ) -> Result<(), LoaderError> {
        self.input_ids.values().append_slice(input_ids);
        self.input_ids.append(true);
        self.loss_mask.values().append_slice(loss_mask);
        self.loss_mask.append(true);
        self.seq_len.append_value(input_ids.len() as i64);
        self.sample_id.append_value(sample_id as i64);
        self.pending += 1;
        self.rows += 1;
        if self.pending >= FLUSH_ROWS {
            self.flush()?;
        }
        Ok(())
    }

    fn data_path(&self) -> PathBuf {
        tmp_name(&self.dir.join(DATA_FILE))
    }

    fn flush(&mut self) -> Result<(), LoaderError> {
        if self.pending == 0 {
            return Ok(());
        }
        let cols: Vec<ArrayRef> = vec![
            Arc::new(self.input_ids.finish()) as ArrayRef,
            Arc::new(self.loss_mask.finish()) as ArrayRef,
            Arc::new(self.seq_len.finish()) as ArrayRef,
            Arc::new(self.sample_id.finish()) as ArrayRef,
        ];
        let batch = RecordBatch::try_new(self.schema.clone(), cols)
            .map_err(|e| io_err(&self.data_path(), e))?;
        self.writer
            .write(&batch)
            .map_err(|e| io_err(&self.data_path(), e))?;
        self.pending = 0;
        Ok(())
    }

    /// Flush, close the stream and put the three files in place (the Arrow file last but
    /// one, `state.json` last: `load_from_disk` starts from it).
    pub fn finish(mut self) -> Result<usize, LoaderError> {
        self.flush()?;
        self.writer
            .finish()
            .map_err(|e| io_err(&self.data_path(), e))?;
        publish(&self.dir.join(DATA_FILE))?;
        let info = serde_json::json!({
            "citation": "", "description": "", "homepage": "", "license": "",
            "features": features_json(),
        });
        write_atomic(
            &self.dir.join("dataset_info.json"),
            serde_json::to_string_pretty(&info)
                .unwrap_or_default()
                .as_bytes(),
        )?;
        let state = serde_json::json!({
            "_data_files": [{"filename": DATA_FILE}],
            "_fingerprint": format!("{:016x}", fingerprint(self.rows)),
            "_format_columns": null,
            "_format_kwargs": {},
            "_format_type": "torch",
            "_output_all_columns": false,
            "_split": null,
        });
        write_atomic(
            &self.dir.join("state.json"),
            serde_json::to_string_pretty(&state)
                .unwrap_or_default()
                .as_bytes(),
        )?;
        Ok(self.rows)
    }
}

/// `datasets` keys its cache by this string; any stable value per content is fine. The row
/// count and the time keep two exports apart.
fn fingerprint(rows: usize) -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    t ^ (rows as u64).rotate_left(32)
}
