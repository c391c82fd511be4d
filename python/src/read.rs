//! Reading a pinned version one row group, or some rows of one, at a time: for engines that
//! schedule their own read tasks (Ray Data through `hslake.ray`). Metadata columns come back as
//! Arrow IPC, tensors decoded by the store's one decoder (`TensorColumn::decode_chunk`) into
//! host buffers of a numpy dtype: f16 and f32 as stored, bf16 widened to f32 (exact), fp8
//! multiplied by its per-token scale in f32, as the loader and the SQL functions apply it.
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::UInt32Type;
use arrow_array::RecordBatch;
use arrow_schema::Schema;
use hslake_loader::{ElemType, HostTensor, LoaderError};
use hslake_schemas::{CapturePoint, DType, TENSOR_META_KEY};
use hslake_store::format::decode::{DecodedColumn, TensorColumn};
use hslake_store::{Dataset, DatasetReader, StoreError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tokio::runtime::Runtime;

use crate::{buffer, io_timeout, runtime, to_py, Buffer, ConfigError, HslakeError};

/// One decoded tensor column of a read: (column, numpy dtype name, hidden, values, token offsets
/// of each row: row `r` is `values[offsets[r]..offsets[r + 1]]` as `[tokens, hidden]`).
type TensorOut = (String, &'static str, usize, Buffer, Vec<usize>);

/// A reader pinned to one version, with the metadata columns and capture points it delivers
/// checked against the dataset once, when it is opened.
#[pyclass(module = "hslake._hslake")]
pub(crate) struct NativeReader {
    rt: Arc<Runtime>,
    reader: DatasetReader,
    columns: Vec<String>,
    points: Vec<CapturePoint>,
}

/// The dataset's columns that hold no tensor (ids, lengths, tokens, statistics), in file order.
fn metadata_columns(reader: &DatasetReader) -> Vec<String> {
    reader
        .schema()
        .to_arrow()
        .fields()
        .iter()
        .filter(|f| !f.metadata().contains_key(TENSOR_META_KEY))
        .map(|f| f.name().clone())
        .collect()
}

fn store_err(e: StoreError) -> PyErr {
    to_py(LoaderError::from(e))
}

/// Which of `given` to deliver (`None`: all of `all`), each checked to be in `all`, once.
fn chosen<T: Clone + PartialEq>(
    given: Option<Vec<T>>,
    all: &[T],
    refuse: impl Fn(&T, &str) -> String,
) -> PyResult<Vec<T>> {
    let Some(given) = given else {
        return Ok(all.to_vec());
    };
    for (i, g) in given.iter().enumerate() {
        if !all.contains(g) {
            return Err(ConfigError::new_err(refuse(g, "is not one of them")));
        }
        if given[..i].contains(g) {
            return Err(ConfigError::new_err(refuse(g, "is given twice")));
        }
    }
    Ok(given)
}

fn names(points: &[CapturePoint]) -> Vec<String> {
    points.iter().map(|p| p.column()).collect()
}

#[pymethods]
impl NativeReader {
    /// `columns`: metadata columns to deliver (`None`: all); `points`: capture points whose
    /// tensors to deliver, as `layer_2`, `2` or `final_norm` (`None`: all).
    #[new]
    #[pyo3(signature = (url, version=None, columns=None, points=None, timeout=60.0))]
    fn new(
        py: Python<'_>,
        url: String,
        version: Option<u64>,
        columns: Option<Vec<String>>,
        points: Option<Vec<String>>,
        timeout: f64,
    ) -> PyResult<Self> {
        let limit = io_timeout(timeout)?;
        let rt = runtime(1)?;
        let opened = py.detach(|| {
            rt.block_on(async {
                tokio::time::timeout(limit, async {
                    let ds = Dataset::open(&url).await?;
                    DatasetReader::open(&ds, version).await
                })
                .await
            })
        });
        let reader = match opened {
            Ok(r) => r.map_err(store_err)?,
            Err(_) => {
                return Err(HslakeError::new_err(format!(
                    "opening {url} did not finish within {timeout} s"
                )))
            }
        };
        let shown = format!(
            "{} version {}",
            reader.dataset().url(),
            reader.manifest().version
        );
        let all_columns = metadata_columns(&reader);
        let all_points = reader.schema().points.clone();
        let columns = chosen(columns, &all_columns, |c, why| {
            let hint = match all_points.iter().any(|p| p.column() == *c) {
                true => " (tensors are chosen with points=)",
                false => "",
            };
            format!(
                "column {c:?}: {shown} has the metadata columns {all_columns:?}; {c:?} {why}{hint}"
            )
        })?;
        let points = points
            .map(|ps| {
                ps.iter()
                    .map(|p| {
                        p.parse::<CapturePoint>()
                            .map_err(|e| ConfigError::new_err(format!("point {p:?}: {e}")))
                    })
                    .collect::<PyResult<Vec<_>>>()
            })
            .transpose()?;
        let points = chosen(points, &all_points, |p, why| {
            format!(
                "point {:?}: {shown} holds the points {:?}; {:?} {why}",
                p.column(),
                names(&all_points),
                p.column()
            )
        })?;
        Ok(NativeReader {
            rt,
            reader,
            columns,
            points,
        })
    }

    /// The pinned version.
    #[getter]
    fn version(&self) -> u64 {
        self.reader.manifest().version
    }

    /// The metadata columns delivered, in the order given.
    #[getter]
    fn columns(&self) -> Vec<String> {
        self.columns.clone()
    }

    /// Every metadata column of the dataset, in file order.
    #[getter]
    fn metadata_columns(&self) -> Vec<String> {
        metadata_columns(&self.reader)
    }

    /// The tensor columns delivered (one per capture point), in the order given.
    #[getter]
    fn points(&self) -> Vec<String> {
        names(&self.points)
    }

    /// The width of every tensor row.
    #[getter]
    fn hidden(&self) -> usize {
        self.reader.schema().hidden_size
    }

    /// The numpy dtype name of the tensors delivered.
    #[getter]
    fn tensor_dtype(&self) -> &'static str {
        delivered(self.reader.schema().dtype).torch_name()
    }

    /// The Arrow schema of metadata `columns` (any of `metadata_columns`), as an Arrow IPC
    /// stream of no rows.
    fn schema_ipc<'py>(
        &self,
        py: Python<'py>,
        columns: Vec<String>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        self.check_metadata(&columns)?;
        let empty = RecordBatch::new_empty(Arc::new(self.reader.schema().to_arrow()));
        Ok(PyBytes::new(py, &metadata_ipc(&empty, &columns)?))
    }

    /// Every row group of the version as (shard, row group, rows, tokens estimated from its
    /// shard's mean), in shard order.
    fn row_groups(&self) -> Vec<(usize, usize, u64, u64)> {
        let mut out = Vec::new();
        for (i, s) in self.reader.manifest().shards.iter().enumerate() {
            for (rg, &rows) in s.row_groups.iter().enumerate() {
                let tokens = s.tokens.saturating_mul(rows) / s.rows.max(1);
                out.push((i, rg, rows, tokens));
            }
        }
        out
    }

    /// Read row group `row_group` of shard `shard`, or only its `rows` (ascending, distinct,
    /// not empty): the metadata `columns` (any of `metadata_columns`) as one Arrow IPC stream,
    /// and with `tensors` the delivered points' tensors of the same rows.
    #[pyo3(signature = (shard, row_group, rows, columns, tensors))]
    fn read<'py>(
        &self,
        py: Python<'py>,
        shard: usize,
        row_group: usize,
        rows: Option<Vec<usize>>,
        columns: Vec<String>,
        tensors: bool,
    ) -> PyResult<(Bound<'py, PyBytes>, Vec<TensorOut>)> {
        if rows.as_ref().is_some_and(|r| r.is_empty()) {
            return Err(ConfigError::new_err(
                "rows to read is empty: give None for the whole row group, or at least one row",
            ));
        }
        self.check_metadata(&columns)?;
        let (ipc, decoded) = py.detach(|| {
            self.rt
                .block_on(self.read_native(shard, row_group, rows.as_deref(), &columns, tensors))
        })?;
        let decoded = decoded
            .into_iter()
            .map(|(name, hidden, t, offsets)| {
                (name, t.dtype.torch_name(), hidden, buffer(t), offsets)
            })
            .collect();
        Ok((PyBytes::new(py, &ipc), decoded))
    }
}

impl NativeReader {
    fn check_metadata(&self, columns: &[String]) -> PyResult<()> {
        let all = metadata_columns(&self.reader);
        match columns.iter().find(|c| !all.contains(c)) {
            Some(c) => Err(ConfigError::new_err(format!(
                "column {c:?} is not a metadata column: expected some of {all:?}"
            ))),
            None => Ok(()),
        }
    }

    async fn read_native(
        &self,
        shard: usize,
        row_group: usize,
        rows: Option<&[usize]>,
        columns: &[String],
        tensors: bool,
    ) -> PyResult<(Vec<u8>, Vec<(String, usize, HostTensor, Vec<usize>)>)> {
        let schema = self.reader.schema();
        let mut read_cols: Vec<String> = columns.to_vec();
        if tensors {
            // seq_len sizes each row's tensor (and is checked against the value's own header);
            // sample_id names the sample in a decoding error.
            for c in ["sample_id", "seq_len"] {
                if !read_cols.iter().any(|x| x == c) {
                    read_cols.push(c.to_string());
                }
            }
            for p in &self.points {
                read_cols.push(p.column());
                if schema.dtype.has_scales() {
                    read_cols.push(p.scale_column());
                }
            }
        }
        let batch = match rows {
            None => {
                self.reader
                    .read_row_group(shard, row_group, Some(&read_cols))
                    .await
            }
            Some(rows) => {
                self.reader
                    .read_rows(shard, row_group, rows, Some(&read_cols))
                    .await
            }
        }
        .map_err(store_err)?;
        let ipc = metadata_ipc(&batch, columns)?;
        if !tensors {
            return Ok((ipc, Vec::new()));
        }
        let shown = format!(
            "{}/{}",
            self.reader.dataset().url(),
            self.reader.manifest().shards[shard].path
        );
        let seq_len = batch
            .column_by_name("seq_len")
            .and_then(|c| c.as_primitive_opt::<UInt32Type>())
            .ok_or_else(|| {
                HslakeError::new_err(format!("{shown}: column seq_len is not UInt32"))
            })?;
        let mut offsets = Vec::with_capacity(seq_len.len() + 1);
        offsets.push(0usize);
        for n in seq_len.values() {
            offsets.push(offsets.last().copied().unwrap_or(0) + *n as usize);
        }
        let mut out = Vec::with_capacity(self.points.len());
        for &p in &self.points {
            let col = TensorColumn::from_batch(
                &batch,
                schema.dtype,
                schema.hidden_size,
                p,
                &shown,
                Some(row_group),
            )
            .and_then(|c| c.decode_chunk(&offsets))
            .map_err(|e| store_err(in_rows(e, rows)))?;
            let t = host_tensor(&col, schema.dtype, schema.hidden_size, &offsets);
            out.push((p.column(), schema.hidden_size, t, offsets.clone()));
        }
        Ok((ipc, out))
    }
}

/// A decoding error at batch row `r` names row `rows[r]` of the row group where only those
/// rows were read.
fn in_rows(e: StoreError, rows: Option<&[usize]>) -> StoreError {
    match (&e, rows) {
        (StoreError::BadValue { row: Some(r), .. }, Some(rows)) => match rows.get(*r) {
            Some(&row) => e.in_row(row),
            None => e,
        },
        _ => e,
    }
}

/// The element type a stored dtype is delivered as: numpy has no bf16 or fp8.
fn delivered(dtype: DType) -> ElemType {
    match dtype {
        DType::F16 => ElemType::F16,
        DType::Bf16 | DType::F32 | DType::Fp8E4m3 => ElemType::F32,
    }
}

/// Decoded values (little-endian `dtype`, rows at token `offsets`) as one `[tokens, hidden]`
/// host tensor of the delivered type.
fn host_tensor(col: &DecodedColumn, dtype: DType, hidden: usize, offsets: &[usize]) -> HostTensor {
    let tokens = offsets.last().copied().unwrap_or(0);
    let n = tokens * hidden;
    let raw = &col.values.values().as_slice()[..n * dtype.size()];
    let elem = delivered(dtype);
    let mut t = HostTensor::zeros(elem, vec![tokens, hidden]);
    let out = t.bytes_mut();
    match (dtype, &col.scales) {
        (DType::F16 | DType::F32, _) => out.copy_from_slice(raw),
        (DType::Fp8E4m3, Some(scales)) => {
            let scales = scales.values().as_slice();
            for (i, o) in out.chunks_exact_mut(4).enumerate() {
                let t = i / hidden;
                let s = f32::from_le_bytes(scales[4 * t..4 * t + 4].try_into().expect("4 bytes"));
                o.copy_from_slice(&(dtype.to_f32(raw, i) * s).to_le_bytes());
            }
        }
        _ => {
            for (i, o) in out.chunks_exact_mut(4).enumerate() {
                o.copy_from_slice(&dtype.to_f32(raw, i).to_le_bytes());
            }
        }
    }
    t
}

/// `columns` of `batch`, in that order and without the file's schema metadata, as one Arrow
/// IPC stream.
fn metadata_ipc(batch: &RecordBatch, columns: &[String]) -> PyResult<Vec<u8>> {
    let fail = |e: arrow_schema::ArrowError| {
        HslakeError::new_err(format!("cannot hand the metadata columns over: {e}"))
    };
    let mut fields = Vec::with_capacity(columns.len());
    let mut arrays = Vec::with_capacity(columns.len());
    for c in columns {
        let i = batch.schema().index_of(c).map_err(fail)?;
        fields.push(batch.schema().field(i).clone());
        arrays.push(batch.column(i).clone());
    }
    let schema = Arc::new(Schema::new(fields));
    let options = arrow_array::RecordBatchOptions::new().with_row_count(Some(batch.num_rows()));
    let out = RecordBatch::try_new_with_options(schema.clone(), arrays, &options).map_err(fail)?;
    let mut w = arrow_ipc::writer::StreamWriter::try_new(Vec::new(), &schema).map_err(fail)?;
    w.write(&out).map_err(fail)?;
    w.finish().map_err(fail)?;
    w.into_inner().map_err(fail)
}
