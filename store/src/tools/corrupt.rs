//! Test tools: flip one byte inside a stored tensor value, or inside the `input_ids` pages, of a
//! shard on local disk, leaving the Parquet file readable (tensor values sit in uncompressed
//! pages, and Parquet pages carry no checksum), so that tests can check that every reader
//! catches the flip and names the sample; or rewrite a shard with edited rows under a manifest
//! that vouches for it, as a tampered or buggy writer would leave it.
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::{Int32Type, UInt64Type};
use arrow_array::{Array, RecordBatch, UInt32Array};
use bytes::Bytes;
use object_store::{ObjectStoreExt, PutPayload};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::{ArrowWriter, ProjectionMask};
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;

use crate::format::decode::with_file_metadata;
use crate::format::planes::plane_count;
use crate::table::commit::{put_manifest, CommitError};
use crate::{Dataset, Result, StoreError};

/// Where a flip landed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flip {
    /// The shard file.
    pub file: PathBuf,
    /// The row group holding the value.
    pub row_group: usize,
    /// The row in that row group.
    pub row: usize,
    /// The sample in that row.
    pub sample_id: u64,
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
                sample_id,
                offset: offset as u64,
            });
        }
    }
    Err(StoreError::Usage(format!(
        "{shown}: no sample {sample_id} in {groups} row groups"
    )))
}

/// The `input_ids` of every row of row group `rg` in a shard held in memory, or `None` where the
/// file no longer reads (or the reader panics on it, which counts as not reading).
fn token_rows(bytes: &Bytes, rg: usize) -> Option<(Vec<u64>, Vec<Vec<i32>>)> {
    let read = || -> Option<(Vec<u64>, Vec<Vec<i32>>)> {
        let builder = ParquetRecordBatchReaderBuilder::try_new(bytes.clone()).ok()?;
        let arrow = builder.schema().clone();
        let cols = [
            arrow.index_of("sample_id").ok()?,
            arrow.index_of("input_ids").ok()?,
        ];
        let mask = ProjectionMask::roots(builder.parquet_schema(), cols);
        let reader = builder
            .with_projection(mask)
            .with_row_groups(vec![rg])
            .build()
            .ok()?;
        let (mut ids, mut rows) = (vec![], vec![]);
        for batch in reader {
            let batch = batch.ok()?;
            ids.extend_from_slice(batch.column(0).as_primitive::<UInt64Type>().values());
            let list = batch.column(1).as_list_opt::<i32>()?;
            for r in 0..list.len() {
                let v = list.value(r);
                rows.push(v.as_primitive_opt::<Int32Type>()?.values().to_vec());
            }
        }
        Some((ids, rows))
    };
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(read))
        .ok()
        .flatten()
}

/// Flip one bit inside the `input_ids` column chunk of the shard at `file` such that the file
/// still reads but some row's token ids come out changed: the flip that a Parquet reader cannot
/// see (its pages carry no checksum). Bits are tried in file order from the middle of each
/// chunk; the first row whose tokens changed is returned.
pub fn flip_token_byte(file: &Path) -> Result<Flip> {
    let shown = file.display().to_string();
    let io = |e: std::io::Error| StoreError::Usage(format!("{shown}: {e}"));
    let original = Bytes::from(std::fs::read(file).map_err(io)?);
    let builder = ParquetRecordBatchReaderBuilder::try_new(original.clone())
        .map_err(|e| StoreError::pq(&shown, e))?;
    let meta = builder.metadata().clone();
    let leaf = (0..meta.file_metadata().schema_descr().num_columns())
        .find(|&i| meta.file_metadata().schema_descr().column(i).path().parts()[0] == "input_ids")
        .ok_or_else(|| StoreError::corrupt(&shown, "no input_ids column"))?;
    for rg in 0..meta.num_row_groups() {
        let (ids, clean) = token_rows(&original, rg)
            .ok_or_else(|| StoreError::corrupt(&shown, "does not read before the flip"))?;
        let (start, len) = meta.row_group(rg).column(leaf).byte_range();
        let (start, len) = (start as usize, len as usize);
        let mut bytes = original.to_vec();
        for k in 0..len {
            let offset = start + (len / 2 + k) % len;
            for bit in [0x10u8, 0x01, 0x80] {
                bytes[offset] ^= bit;
                let changed = token_rows(&Bytes::from(bytes.clone()), rg).and_then(|(_, rows)| {
                    (rows.len() == clean.len())
                        .then(|| rows.iter().zip(&clean).position(|(a, b)| a != b))
                        .flatten()
                });
                if let Some(row) = changed {
                    std::fs::write(file, &bytes).map_err(io)?;
                    return Ok(Flip {
                        file: file.to_path_buf(),
                        row_group: rg,
                        row,
                        sample_id: ids[row],
                        offset: offset as u64,
                    });
                }
                bytes[offset] ^= bit;
            }
        }
    }
    Err(StoreError::Usage(format!(
        "{shown}: no single flipped bit in input_ids leaves the file readable with other tokens"
    )))
}

/// Rewrite shard `shard` of the newest version of `ds` in place, with `edit` applied to each of
/// its record batches (the file's key-value metadata kept), and put the next version's manifest
/// naming it with its new size, checksum and row groups: a file that the manifest vouches for,
/// as a tampered or buggy writer leaves it. Returns that version.
pub async fn rewrite_shard(
    ds: &Dataset,
    shard: usize,
    edit: impl Fn(RecordBatch) -> RecordBatch,
) -> Result<u64> {
    let head = ds.manifest(None).await?;
    let entry = head.shards.get(shard).ok_or_else(|| {
        StoreError::Usage(format!("no shard {shard} in version {}", head.version))
    })?;
    let shown = format!("{}/{}", ds.url(), entry.path);
    let path = ds.object_path(&entry.path);
    let store = ds.object_store();
    let get = store
        .get(&path)
        .await
        .map_err(|e| StoreError::os(&shown, e))?;
    let bytes = get.bytes().await.map_err(|e| StoreError::os(&shown, e))?;
    let builder = ParquetRecordBatchReaderBuilder::try_new(bytes.clone())
        .map_err(|e| StoreError::pq(&shown, e))?;
    let file_meta = builder.schema().metadata().clone();
    let kv: Vec<KeyValue> = builder
        .metadata()
        .file_metadata()
        .key_value_metadata()
        .into_iter()
        .flatten()
        .filter(|kv| kv.key != "ARROW:schema")
        .cloned()
        .collect();
    let meta = builder.metadata().clone();
    // One edited batch per row group, so the rewritten file keeps the row groups.
    let mut batches = vec![];
    for (rg, group) in meta.row_groups().iter().enumerate() {
        let reader = ParquetRecordBatchReaderBuilder::try_new(bytes.clone())
            .map_err(|e| StoreError::pq(&shown, e))?
            .with_row_groups(vec![rg])
            .with_batch_size(group.num_rows().max(1) as usize)
            .build()
            .map_err(|e| StoreError::pq(&shown, e))?;
        for batch in reader {
            let batch = batch.map_err(|e| StoreError::Usage(format!("{shown}: {e}")))?;
            batches.push(edit(with_file_metadata(batch, &file_meta)));
        }
    }
    let first = batches
        .first()
        .ok_or_else(|| StoreError::corrupt(&shown, "no rows to rewrite"))?;
    let props = WriterProperties::builder()
        .set_key_value_metadata(Some(kv))
        .build();
    let mut w = ArrowWriter::try_new(vec![], first.schema(), Some(props))
        .map_err(|e| StoreError::pq(&shown, e))?;
    for b in &batches {
        w.write(b).map_err(|e| StoreError::pq(&shown, e))?;
        w.flush().map_err(|e| StoreError::pq(&shown, e))?;
    }
    let out = w.into_inner().map_err(|e| StoreError::pq(&shown, e))?;
    let row_groups: Vec<u64> = batches.iter().map(|b| b.num_rows() as u64).collect();
    let mut next = head.clone();
    next.version += 1;
    next.parent = Some(head.version);
    next.commit_id = None;
    next.shards[shard].bytes = out.len() as u64;
    next.shards[shard].crc32c = crc32c::crc32c(&out);
    next.shards[shard].row_groups = row_groups;
    store
        .put(&path, PutPayload::from(out))
        .await
        .map_err(|e| StoreError::os(&shown, e))?;
    match put_manifest(ds.location(), &next).await {
        Ok(()) => Ok(next.version),
        Err(CommitError::Conflict) => Err(StoreError::Usage(format!(
            "{}: version {} was committed while the shard was rewritten",
            ds.url(),
            next.version
        ))),
        Err(CommitError::Other(e)) => Err(e),
    }
}

/// An edit for [`rewrite_shard`]: the row of `sample_id` claims `seq_len` tokens, whatever its
/// token lists and values hold.
pub fn claim_seq_len(sample_id: u64, seq_len: u32) -> impl Fn(RecordBatch) -> RecordBatch {
    move |batch| {
        let (Some(ids), Ok(i)) = (
            batch
                .column_by_name("sample_id")
                .and_then(|c| c.as_primitive_opt::<UInt64Type>()),
            batch.schema().index_of("seq_len"),
        ) else {
            return batch;
        };
        let Some(row) = ids.values().iter().position(|&x| x == sample_id) else {
            return batch;
        };
        let mut v = batch
            .column(i)
            .as_primitive::<arrow_array::types::UInt32Type>()
            .values()
            .to_vec();
        v[row] = seq_len;
        let mut cols = batch.columns().to_vec();
        cols[i] = Arc::new(UInt32Array::from(v));
        RecordBatch::try_new(batch.schema(), cols).unwrap_or(batch)
    }
}
