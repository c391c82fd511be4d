//! Parquet inputs: each row group's record batch into input records (`input_ids` and
//! `loss_mask` as lists of integers or booleans, `id` as integers or strings).
use std::fs::File;
use std::path::Path;

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type, UInt64Type, UInt8Type,
};
use arrow_array::{Array, ArrayRef, RecordBatch};
use arrow_schema::DataType;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

use super::{input_err, RawId, Record};
use crate::error::{CaptureError, Result};

/// The records of one batch; `location(i)` names row `i`.
fn batch_records(
    path: &Path,
    batch: &RecordBatch,
    location: impl Fn(usize) -> String,
) -> Result<Vec<Record>> {
    let n = batch.num_rows();
    let column = |name: &str| -> Result<Vec<Option<ArrayRef>>> {
        match batch.column_by_name(name) {
            None => Ok(vec![None; n]),
            Some(c) => list_values(c).ok_or_else(|| {
                input_err(
                    path,
                    &format!("column {name:?}"),
                    format!("expected a list of integers, got {}", c.data_type()),
                )
            }),
        }
    };
    let (ids, masks) = (column("input_ids")?, column("loss_mask")?);
    let id_col: Vec<RawId> = match batch.column_by_name("id") {
        None => (0..n).map(|_| RawId::None).collect(),
        Some(c) if matches!(c.data_type(), DataType::Utf8 | DataType::LargeUtf8) => {
            (0..n).map(|_| RawId::Str).collect()
        }
        Some(c) => {
            let read = integer_reader(c.as_ref()).map_err(|_| {
                input_err(
                    path,
                    "column \"id\"",
                    format!("expected integers or strings, got {}", c.data_type()),
                )
            })?;
            (0..n)
                .map(|i| match c.is_null(i) {
                    true => Ok(RawId::None),
                    false => read(i)
                        .map(RawId::Int)
                        .map_err(|m| input_err(path, &location(i), format!("id {m}"))),
                })
                .collect::<Result<_>>()?
        }
    };
    let mut out = Vec::with_capacity(n);
    for (i, ((ids, mask), id)) in ids.into_iter().zip(masks).zip(id_col).enumerate() {
        let location = location(i);
        let list = |field: &str, values: Option<ArrayRef>| -> Result<Option<Vec<i64>>> {
            values
                .map(|v| {
                    integers(v.as_ref()).map_err(|m| {
                        input_err(
                            path,
                            &location,
                            format!("\"{field}\" must be a list of integers: {m}"),
                        )
                    })
                })
                .transpose()
        };
        out.push(Record {
            input_ids: list("input_ids", ids)?,
            loss_mask: list("loss_mask", mask)?,
            location,
            id,
        });
    }
    Ok(out)
}

/// Each row's list (`None` for null), for a list or large-list column.
fn list_values(col: &ArrayRef) -> Option<Vec<Option<ArrayRef>>> {
    let rows = |len: usize, is_null: &dyn Fn(usize) -> bool, value: &dyn Fn(usize) -> ArrayRef| {
        (0..len).map(|i| (!is_null(i)).then(|| value(i))).collect()
    };
    match col.data_type() {
        DataType::List(_) => {
            let l = col.as_list::<i32>();
            Some(rows(l.len(), &|i| l.is_null(i), &|i| l.value(i)))
        }
        DataType::LargeList(_) => {
            let l = col.as_list::<i64>();
            Some(rows(l.len(), &|i| l.is_null(i), &|i| l.value(i)))
        }
        _ => None,
    }
}

/// Reads element `i` of an array as an integer.
type IntegerReader<'a> = Box<dyn Fn(usize) -> Result<i64, String> + 'a>;

/// How to read the (non-null) elements of an integer or boolean array as integers, chosen
/// once by its type; `Err` names a type that holds no integers.
fn integer_reader(a: &dyn Array) -> Result<IntegerReader<'_>, String> {
    macro_rules! exact {
        ($t:ty) => {{
            let v = a.as_primitive::<$t>();
            Box::new(move |i| Ok(v.value(i) as i64))
        }};
    }
    Ok(match a.data_type() {
        DataType::Int8 => exact!(Int8Type),
        DataType::Int16 => exact!(Int16Type),
        DataType::Int32 => exact!(Int32Type),
        DataType::Int64 => exact!(Int64Type),
        DataType::UInt8 => exact!(UInt8Type),
        DataType::UInt16 => exact!(UInt16Type),
        DataType::UInt32 => exact!(UInt32Type),
        DataType::UInt64 => {
            let v = a.as_primitive::<UInt64Type>();
            Box::new(move |i| {
                let x = v.value(i);
                i64::try_from(x).map_err(|_| format!("{x} is beyond {}", i64::MAX))
            })
        }
        DataType::Boolean => {
            let v = a.as_boolean();
            Box::new(move |i| Ok(v.value(i) as i64))
        }
        other => return Err(format!("holds {other}, not integers")),
    })
}

/// Every element of a list value as an integer; names the first that is null or out of range.
fn integers(values: &dyn Array) -> Result<Vec<i64>, String> {
    let read = integer_reader(values)?;
    (0..values.len())
        .map(|i| match values.is_null(i) {
            true => Err(format!("element {i} is null")),
            false => read(i).map_err(|m| format!("element {i}: {m}")),
        })
        .collect()
}

pub(super) fn read_parquet(path: &Path) -> Result<Vec<Record>> {
    let file = File::open(path).map_err(|source| CaptureError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let pq = |e: parquet::errors::ParquetError| {
        input_err(path, "file", format!("not a readable Parquet file: {e}"))
    };
    let reader = ParquetRecordBatchReaderBuilder::try_new(file)
        .map_err(pq)?
        .build()
        .map_err(pq)?;
    let mut out = vec![];
    for batch in reader {
        let batch = batch.map_err(|e| pq(e.into()))?;
        let first = out.len();
        out.extend(batch_records(path, &batch, |i| {
            format!("row {}", first + i)
        })?);
    }
    Ok(out)
}
