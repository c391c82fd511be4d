//! One row group as read from a shard, with only the columns the loader needs, checked and
//! decoded once so that batch assembly can slice it without further checks.
use arrow_array::cast::AsArray;
use arrow_array::types::{Int32Type, UInt64Type, UInt8Type};
use arrow_array::{Int32Array, RecordBatch, UInt64Array, UInt8Array};
use hslake_schemas::{CapturePoint, DType};
use hslake_store::format::decode::{DecodedColumn, TensorColumn};
use hslake_store::StoreError;
use std::collections::BTreeMap;

use crate::LoaderError;

/// The columns of one row group that batches are assembled from.
#[derive(Debug)]
pub(crate) struct RowGroupData {
    pub sample_ids: UInt64Array,
    /// `offsets[r]..offsets[r + 1]` are row r's tokens in `input_ids` and `loss_mask`.
    pub offsets: Vec<usize>,
    pub input_ids: Int32Array,
    pub loss_mask: UInt8Array,
    /// Auxiliary tensors, in the configured order.
    pub aux: Vec<DecodedColumn>,
    pub target: DecodedColumn,
    /// Rows whose values did not decode (read with `skip_corrupt`), with the error naming each:
    /// their samples are left out, the rest of the row group is used.
    pub bad_rows: BTreeMap<usize, StoreError>,
}

impl RowGroupData {
    /// Tokens of row `r`.
    pub(crate) fn seq_len(&self, r: usize) -> usize {
        self.offsets[r + 1] - self.offsets[r]
    }

    /// Why row `r` cannot be used, if it cannot (its values did not decode).
    pub(crate) fn refusal(&self, r: usize) -> Option<&StoreError> {
        self.bad_rows.get(&r)
    }
}

/// Names of the columns to read for these points.
pub(crate) fn needed_columns(
    dtype: DType,
    aux: &[CapturePoint],
    target: CapturePoint,
) -> Vec<String> {
    let mut cols: Vec<String> = ["sample_id", "input_ids", "loss_mask"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let mut points: Vec<CapturePoint> = aux.to_vec();
    if !points.contains(&target) {
        points.push(target);
    }
    for p in points {
        cols.push(p.column());
        if dtype.has_scales() {
            cols.push(p.scale_column());
        }
    }
    cols
}

/// The error of a value at batch row `r`, naming row `rows[r]` of the row group where the batch
/// holds only those rows.
fn in_row_group(e: StoreError, rows: Option<&[usize]>) -> StoreError {
    let row = match (&e, rows) {
        (StoreError::BadValue { row: Some(r), .. }, Some(rows)) => rows.get(*r).copied(),
        _ => None,
    };
    match row {
        Some(r) => e.in_row(r),
        None => e,
    }
}

/// Pick and check the columns of a freshly read row group, or of `rows` of it (the batch's row
/// `i` being row `rows[i]`, as errors name it). With `skip_corrupt`, a row whose tensor values
/// do not decode is recorded in [`RowGroupData::bad_rows`] instead of failing the row group.
#[allow(clippy::too_many_arguments)]
pub(crate) fn from_batch(
    batch: &RecordBatch,
    path: &str,
    row_group: usize,
    dtype: DType,
    hidden: usize,
    aux: &[CapturePoint],
    target: CapturePoint,
    skip_corrupt: bool,
    rows: Option<&[usize]>,
) -> Result<RowGroupData, LoaderError> {
    let bad = |message: String| LoaderError::Shard {
        path: path.to_string(),
        row_group,
        message,
    };
    let col = |name: &str| {
        batch
            .column_by_name(name)
            .ok_or_else(|| bad(format!("column {name:?} is missing")))
    };
    let wrong = |name: &str, want: &str| bad(format!("column {name:?} is not {want}"));

    let sample_ids = col("sample_id")?
        .as_primitive_opt::<UInt64Type>()
        .ok_or_else(|| wrong("sample_id", "UInt64"))?
        .clone();
    let ids_list = col("input_ids")?
        .as_list_opt::<i32>()
        .ok_or_else(|| wrong("input_ids", "List<Int32>"))?;
    let mask_list = col("loss_mask")?
        .as_list_opt::<i32>()
        .ok_or_else(|| wrong("loss_mask", "List<UInt8>"))?;
    let input_ids = ids_list
        .values()
        .as_primitive_opt::<Int32Type>()
        .ok_or_else(|| wrong("input_ids", "List<Int32>"))?;
    let loss_mask = mask_list
        .values()
        .as_primitive_opt::<UInt8Type>()
        .ok_or_else(|| wrong("loss_mask", "List<UInt8>"))?;
    if ids_list.offsets() != mask_list.offsets() {
        return Err(bad("input_ids and loss_mask have different lengths".into()));
    }
    let base = ids_list.offsets().first().copied().unwrap_or(0);
    if base < 0 {
        return Err(bad("input_ids has a negative offset".into()));
    }
    // Offsets made relative to the (possibly sliced) value arrays.
    let offsets: Vec<usize> = ids_list
        .offsets()
        .iter()
        .map(|&o| (o - base) as usize)
        .collect();
    let input_ids = input_ids.slice(base as usize, offsets.last().copied().unwrap_or(0));
    let mask_base = mask_list.offsets().first().copied().unwrap_or(0) as usize;
    let loss_mask = loss_mask.slice(mask_base, offsets.last().copied().unwrap_or(0));

    if sample_ids.len() + 1 != offsets.len() {
        return Err(bad(
            "sample_id and input_ids have different row counts".into()
        ));
    }
    // Decoding checks every value against its row's token count, and errors name the shard,
    // row group, sample and column.
    let mut bad_rows = BTreeMap::new();
    let mut tensor = |p: CapturePoint| -> Result<DecodedColumn, LoaderError> {
        let col = TensorColumn::from_batch(batch, dtype, hidden, p, path, Some(row_group))
            .map_err(|e| match e {
                StoreError::Corrupt { reason, .. } => bad(reason),
                e => e.into(),
            })?;
        Ok(match skip_corrupt {
            true => col.decode_chunk_skipping(&offsets, &mut bad_rows)?,
            false => col
                .decode_chunk(&offsets)
                .map_err(|e| in_row_group(e, rows))?,
        })
    };
    let aux = aux
        .iter()
        .map(|&p| tensor(p))
        .collect::<Result<Vec<_>, _>>()?;
    let target = tensor(target)?;
    let bad_rows = bad_rows
        .into_iter()
        .map(|(r, e)| (r, in_row_group(e, rows)))
        .collect();
    Ok(RowGroupData {
        sample_ids,
        offsets,
        input_ids,
        loss_mask,
        aux,
        target,
        bad_rows,
    })
}
