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
use parquet::file::metadata::ParquetMetaData;

use super::{
    input_err, Field, InputLimits, Ints, Location, RawId, Record, Rules, SAMPLE_BYTES, TOKEN_BYTES,
};
use crate::error::{CaptureError, Result};

/// Hands the records of one batch to `each` until it answers false (then returns false); row
/// `i` of the batch is row `first + i` of the file.
fn batch_records(
    path: &Path,
    batch: &RecordBatch,
    first: u64,
    rules: Rules,
    each: &mut dyn FnMut(Record) -> Result<bool>,
) -> Result<bool> {
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
    let id_col = batch.column_by_name("id");
    let id_reader = match id_col {
        Some(c) if !matches!(c.data_type(), DataType::Utf8 | DataType::LargeUtf8) => {
            Some(integer_reader(c.as_ref()).map_err(|_| {
                input_err(
                    path,
                    "column \"id\"",
                    format!("expected integers or strings, got {}", c.data_type()),
                )
            })?)
        }
        _ => None,
    };
    for (i, (ids, mask)) in ids.into_iter().zip(masks).enumerate() {
        let id = match (id_col, &id_reader) {
            (None, _) => RawId::None,
            (Some(c), _) if c.is_null(i) => RawId::None,
            (Some(_), None) => RawId::Str,
            (Some(_), Some(read)) => match read(i) {
                Ok(v) => RawId::Int(v),
                Err(m) => RawId::Bad(format!("id {m}")),
            },
        };
        let record = Record {
            location: Location::Row(first + i as u64),
            id,
            input_ids: field(ids, |v| rules.token(v), rules.keep),
            loss_mask: field(mask, Rules::mask, rules.keep),
        };
        if !each(record)? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// A row's list as a record's field.
fn field<T>(values: Option<ArrayRef>, convert: impl Fn(i64) -> Option<T>, keep: usize) -> Field<T> {
    let Some(values) = values else {
        return Field::Missing;
    };
    let read = match integer_reader(values.as_ref()) {
        Ok(read) => read,
        Err(m) => return Field::Bad(format!(": {m}")),
    };
    let mut ints = Ints::new();
    ints.kept.reserve_exact(values.len().min(keep));
    for i in 0..values.len() {
        if values.is_null(i) {
            return Field::Bad(format!(": element {i} is null"));
        }
        match read(i) {
            Ok(v) => ints.push(v, convert(v), keep),
            Err(m) => return Field::Bad(format!(": element {i}: {m}")),
        }
    }
    Field::List(ints)
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

/// Hands every record of a Parquet file to `each` until it answers false, a batch of rows at
/// a time. With `limits`, a file whose metadata already says that its samples take more memory
/// than `limits.max_memory` is refused before any of it is decoded: a small file can hold many
/// rows and long lists (a run of one value is stored in a few bytes).
pub(super) fn read_parquet(
    path: &Path,
    rules: Rules,
    limits: Option<&InputLimits>,
    each: &mut dyn FnMut(Record) -> Result<bool>,
) -> Result<()> {
    let file = File::open(path).map_err(|source| CaptureError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let pq = |e: parquet::errors::ParquetError| {
        input_err(path, "file", format!("not a readable Parquet file: {e}"))
    };
    let builder = ParquetRecordBatchReaderBuilder::try_new(file).map_err(pq)?;
    if let Some(l) = limits.filter(|l| l.shard.is_none()) {
        check_declared_size(path, builder.metadata(), l)?;
    }
    let reader = builder.build().map_err(pq)?;
    let mut first = 0;
    for batch in reader {
        let batch = batch.map_err(|e| pq(e.into()))?;
        if !batch_records(path, &batch, first, rules, each)? {
            break;
        }
        first += batch.num_rows() as u64;
    }
    Ok(())
}

// Refuses a file whose rows and `input_ids` values, as its metadata counts them, would take
// more than `limits.max_memory` as samples (each sample cut to `max_seq_len`).
fn check_declared_size(path: &Path, meta: &ParquetMetaData, limits: &InputLimits) -> Result<()> {
    let Some(limit) = limits.max_memory else {
        return Ok(());
    };
    let rows = meta.file_metadata().num_rows().max(0) as u64;
    let values: u64 = meta
        .row_groups()
        .iter()
        .flat_map(|rg| rg.columns())
        .filter(|c| c.column_path().parts().first().map(String::as_str) == Some("input_ids"))
        .map(|c| c.num_values().max(0) as u64)
        .sum();
    let tokens = match limits.max_seq_len {
        Some(max) => values.min(rows.saturating_mul(max as u64)),
        None => values,
    };
    let memory = tokens
        .saturating_mul(TOKEN_BYTES)
        .saturating_add(rows.saturating_mul(SAMPLE_BYTES));
    if memory > limit {
        return Err(CaptureError::SamplesTooLarge {
            path: path.to_path_buf(),
            samples: rows,
            tokens,
            limit,
        });
    }
    Ok(())
}
