//! Test tool: flip one byte inside a stored tensor value of a shard on local disk, leaving the
//! Parquet file readable (tensor values sit in uncompressed pages, and Parquet pages carry no
//! checksum), so that tests can check that every reader catches the flip and names the value.
use std::path::{Path, PathBuf};

use arrow_array::cast::AsArray;
use arrow_array::types::UInt64Type;
use bytes::Bytes;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::ProjectionMask;

use crate::format::planes::plane_count;
use crate::{Result, StoreError};

/// Where a flip landed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flip {
    /// The shard file.
    pub file: PathBuf,
    /// The row group holding the value.
    pub row_group: usize,
    /// The row in that row group.
    pub row: usize,
    /// Byte offset of the flipped byte in the file.
    pub offset: u64,
}

/// Flip one bit of the byte in the middle of the last zstd frame of `column`'s value for
/// `sample_id` in the shard at `file` (`size`: bytes per element of the column, which fixes
/// how many frames a value has).
pub fn flip_value_byte(file: &Path, column: &str, size: usize, sample_id: u64) -> Result<Flip> {
    let shown = file.display().to_string();
    let io = |e: std::io::Error| StoreError::Usage(format!("{shown}: {e}"));
    let mut bytes = std::fs::read(file).map_err(io)?;
    let builder = ParquetRecordBatchReaderBuilder::try_new(Bytes::from(bytes.clone()))
        .map_err(|e| StoreError::pq(&shown, e))?;
    let arrow = builder.schema().clone();
    let idx = |name: &str| {
        arrow
            .index_of(name)
            .map_err(|_| StoreError::corrupt(&shown, format!("no column {name:?}")))
    };
    let mask = ProjectionMask::roots(builder.parquet_schema(), [idx("sample_id")?, idx(column)?]);
    let groups = builder.metadata().num_row_groups();
    for rg in 0..groups {
        let reader = ParquetRecordBatchReaderBuilder::try_new(Bytes::from(bytes.clone()))
            .map_err(|e| StoreError::pq(&shown, e))?
            .with_projection(mask.clone())
            .with_row_groups(vec![rg])
            .build()
            .map_err(|e| StoreError::pq(&shown, e))?;
        let mut row0 = 0;
        for batch in reader {
            let batch = batch.map_err(|e| StoreError::Usage(format!("{shown}: {e}")))?;
            let ids = batch.column(0).as_primitive::<UInt64Type>();
            let Some(r) = ids.values().iter().position(|&x| x == sample_id) else {
                row0 += batch.num_rows();
                continue;
            };
            let value = batch.column(1).as_binary::<i64>().value(r).to_vec();
            let start = bytes
                .windows(value.len())
                .position(|w| w == value.as_slice())
                .ok_or_else(|| {
                    StoreError::corrupt(&shown, "value not found as plain bytes in the file")
                })?;
            // The last frame starts after the header of frame lengths and the other frames.
            let count = plane_count(size);
            let lens: Vec<usize> = (0..count)
                .map(|i| {
                    u32::from_le_bytes(value[4 * i..4 * i + 4].try_into().expect("4")) as usize
                })
                .collect();
            let last = 4 * count + lens[..count - 1].iter().sum::<usize>();
            let offset = start + last + lens[count - 1] / 2;
            bytes[offset] ^= 0x10;
            std::fs::write(file, &bytes).map_err(io)?;
            return Ok(Flip {
                file: file.to_path_buf(),
                row_group: rg,
                row: row0 + r,
                offset: offset as u64,
            });
        }
    }
    Err(StoreError::Usage(format!(
        "{shown}: no sample {sample_id} in {groups} row groups"
    )))
}
