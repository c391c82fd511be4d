//! Each row's checksum of its tokens (`input_ids` and `loss_mask`): how it is computed, and
//! the check every read path runs on it. Parquet writes no page checksums, so a bit flipped in
//! a token page that still decompresses would otherwise change a token unseen.
use arrow_array::cast::AsArray;
use arrow_array::types::{Int32Type, UInt32Type, UInt8Type};
use arrow_array::{Array, ListArray, RecordBatch, UInt32Array, UInt64Array};

use crate::format::decode::{sample_ids_of, ValueAt, ValueError};
use crate::format::planes::{self, Checksums, ValueChecksum};
use crate::{Result, StoreError};

/// The column of a format-3 shard holding each row's checksum of its `input_ids` and
/// `loss_mask` (docs/FORMAT.md): Parquet writes no page checksums, so without it a flip in
/// those pages that still decompresses would change a token unseen.
pub const TOKEN_CHECKSUM_COLUMN: &str = "token_checksum";

/// The checksum of one row's tokens: [`ValueChecksum::DEFAULT`] over its token ids as
/// little-endian i32, then its loss-mask bytes.
pub fn token_checksum(input_ids: &[i32], loss_mask: &[u8]) -> u32 {
    let mut bytes = Vec::with_capacity(4 * input_ids.len() + loss_mask.len());
    bytes.extend(input_ids.iter().flat_map(|t| t.to_le_bytes()));
    bytes.extend_from_slice(loss_mask);
    ValueChecksum::DEFAULT
        .checksum(&bytes)
        .expect("the default kind is a trailer checksum")
}

/// A batch's `input_ids` and `loss_mask` with the checksum each row carries, to check row by
/// row; errors name the file, row group, row, sample and the two columns.
#[derive(Debug)]
pub struct TokenRows {
    ids: ListArray,
    mask: ListArray,
    sums: UInt32Array,
    sample_ids: Option<UInt64Array>,
    file: String,
    row_group: Option<usize>,
    unsummed_pass: bool,
}

impl TokenRows {
    /// The token columns of `batch` (read from `file`, row group `row_group` where known) and
    /// their checksums; `None` where the batch has no checksums to check them by (a file that
    /// predates them) or lacks a token column (a projection without it). A file that declares
    /// [`ValueChecksum::DEFAULT`] value checksums must have the checksum column.
    pub fn from_batch(
        batch: &RecordBatch,
        file: &str,
        row_group: Option<usize>,
    ) -> Result<Option<Self>> {
        let list = |name: &str| -> Result<Option<ListArray>> {
            match batch.column_by_name(name) {
                None => Ok(None),
                Some(c) => c.as_list_opt::<i32>().cloned().map(Some).ok_or_else(|| {
                    StoreError::corrupt(file, format!("column {name:?} is {}", c.data_type()))
                }),
            }
        };
        let (Some(ids), Some(mask)) = (list("input_ids")?, list("loss_mask")?) else {
            return Ok(None);
        };
        let sums = match batch.column_by_name(TOKEN_CHECKSUM_COLUMN) {
            Some(c) => c.as_primitive_opt::<UInt32Type>().cloned().ok_or_else(|| {
                StoreError::corrupt(
                    file,
                    format!(
                        "column {TOKEN_CHECKSUM_COLUMN:?} is {}, not UInt32",
                        c.data_type()
                    ),
                )
            })?,
            None => {
                let declared = Checksums::declared_by(batch.schema_ref().metadata())
                    .map_err(|why| StoreError::corrupt(file, why))?;
                if declared == Checksums::Declared(ValueChecksum::DEFAULT) {
                    return Err(StoreError::corrupt(
                        file,
                        format!(
                            "the file declares {} = {} but has no {TOKEN_CHECKSUM_COLUMN:?} column",
                            planes::CHECKSUM_META_KEY,
                            ValueChecksum::DEFAULT
                        ),
                    ));
                }
                return Ok(None);
            }
        };
        if sums.len() != ids.len() || mask.len() != ids.len() {
            return Err(StoreError::corrupt(
                file,
                format!(
                    "{} token checksums for {} rows of input_ids and {} of loss_mask",
                    sums.len(),
                    ids.len(),
                    mask.len()
                ),
            ));
        }
        Ok(Some(TokenRows {
            ids,
            mask,
            sums,
            sample_ids: sample_ids_of(batch),
            file: file.to_string(),
            row_group,
            unsummed_pass: false,
        }))
    }

    /// Let rows with a null checksum pass unchecked: for batches that mix files, where a file
    /// that predates token checksums has its column filled with nulls (SQL).
    pub fn passing_unsummed_rows(mut self) -> Self {
        self.unsummed_pass = true;
        self
    }

    /// Check row `row`'s tokens against its checksum.
    pub fn check_row(&self, row: usize) -> Result<()> {
        let at = ValueAt::row_of(
            &self.file,
            self.row_group,
            self.sample_ids.as_ref(),
            row,
            "input_ids/loss_mask",
        );
        let bad = |reason: String| ValueError { reason }.at(&at);
        if self.unsummed_pass && self.sums.is_null(row) {
            return Ok(());
        }
        if self.sums.is_null(row) || self.ids.is_null(row) || self.mask.is_null(row) {
            return Err(bad(
                "corrupt tokens: a null where every row has a value".into()
            ));
        }
        let ids = self.ids.value(row);
        let mask = self.mask.value(row);
        let (Some(ids), Some(mask)) = (
            ids.as_primitive_opt::<Int32Type>(),
            mask.as_primitive_opt::<UInt8Type>(),
        ) else {
            return Err(bad(
                "input_ids is not List<Int32> or loss_mask not List<UInt8>".into(),
            ));
        };
        let found = token_checksum(ids.values(), mask.values());
        let stored = self.sums.value(row);
        if found != stored {
            return Err(bad(format!(
                "corrupt tokens: {} of input_ids and loss_mask is {found:08x}, \
                 {TOKEN_CHECKSUM_COLUMN} records {stored:08x}",
                ValueChecksum::DEFAULT
            )));
        }
        Ok(())
    }

    /// Check every row, stopping at the first that fails.
    pub fn check(&self) -> Result<()> {
        (0..self.ids.len()).try_for_each(|r| self.check_row(r))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::ArrayRef;
    use arrow_schema::{Field, Schema};

    use super::*;

    /// A batch of samples 41 and 42 with their tokens and, where `sums` is given, token
    /// checksums; its schema metadata declares `declared`, if given.
    fn token_batch(
        ids: [Vec<i32>; 2],
        mask: [Vec<u8>; 2],
        sums: Option<[u32; 2]>,
        declared: Option<&str>,
    ) -> RecordBatch {
        use arrow_array::builder::{ListBuilder, PrimitiveBuilder};
        let mut id_list = ListBuilder::new(PrimitiveBuilder::<Int32Type>::new());
        let mut mask_list = ListBuilder::new(PrimitiveBuilder::<UInt8Type>::new());
        for (i, m) in ids.iter().zip(&mask) {
            id_list.values().append_slice(i);
            id_list.append(true);
            mask_list.values().append_slice(m);
            mask_list.append(true);
        }
        let mut cols: Vec<ArrayRef> = vec![
            Arc::new(UInt64Array::from(vec![41u64, 42])),
            Arc::new(id_list.finish()),
            Arc::new(mask_list.finish()),
        ];
        if let Some(s) = sums {
            cols.push(Arc::new(UInt32Array::from(s.to_vec())));
        }
        let names = ["sample_id", "input_ids", "loss_mask", TOKEN_CHECKSUM_COLUMN];
        let fields: Vec<Field> = cols
            .iter()
            .zip(names)
            .map(|(c, n)| Field::new(n, c.data_type().clone(), true))
            .collect();
        let mut schema = Schema::new(fields);
        if let Some(kind) = declared {
            schema = schema
                .with_metadata([(planes::CHECKSUM_META_KEY.to_string(), kind.to_string())].into());
        }
        RecordBatch::try_new(Arc::new(schema), cols).unwrap()
    }

    #[test]
    fn a_changed_token_id_or_mask_bit_is_named_by_its_row_checksum() {
        let ids = [vec![1, 2, 3], vec![7, 8]];
        let mask = [vec![0, 1, 1], vec![1, 1]];
        let sums = [
            token_checksum(&ids[0], &mask[0]),
            token_checksum(&ids[1], &mask[1]),
        ];
        let ok = token_batch(
            ids.clone(),
            mask.clone(),
            Some(sums),
            Some(ValueChecksum::DEFAULT.name()),
        );
        let rows = TokenRows::from_batch(&ok, "data/a.parquet", Some(3))
            .unwrap()
            .unwrap();
        rows.check().unwrap();

        let site = "data/a.parquet: row group 3: row 1 (sample 42) input_ids/loss_mask: \
                    corrupt tokens: ";
        let changed_id = [ids[0].clone(), vec![7, 8 ^ 0x10]];
        let changed_mask = [mask[0].clone(), vec![1, 0]];
        for (i, m) in [(changed_id, mask.clone()), (ids.clone(), changed_mask)] {
            let bad = token_batch(i, m, Some(sums), None);
            let err = TokenRows::from_batch(&bad, "data/a.parquet", Some(3))
                .unwrap()
                .unwrap()
                .check()
                .unwrap_err()
                .to_string();
            assert!(err.starts_with(site), "{err}");
        }
    }

    #[test]
    fn tokens_without_checksums_are_unchecked_unless_their_file_declares_them() {
        let ids = [vec![1, 2, 3], vec![7, 8]];
        let mask = [vec![0, 1, 1], vec![1, 1]];
        // Format 2 files (no declaration, or format 2's zstd_xxh64) have no token checksums.
        for declared in [None, Some("zstd_xxh64")] {
            let old = token_batch(ids.clone(), mask.clone(), None, declared);
            assert!(TokenRows::from_batch(&old, "f", None).unwrap().is_none());
        }
        // A file declaring format 3's value checksums must have them: a flip in the column's
        // name does not turn the check off.
        let err = TokenRows::from_batch(
            &token_batch(ids, mask, None, Some(ValueChecksum::DEFAULT.name())),
            "f",
            None,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.starts_with("f: ") && err.contains(TOKEN_CHECKSUM_COLUMN),
            "{err}"
        );
    }
}
