//! A row's token count, held to one rule on every read path: its `seq_len` must equal the
//! lengths of its `input_ids` and `loss_mask`. The values of a row are checked against its
//! token lists, so a `seq_len` that disagrees (`u32::MAX` in a hand-edited shard) would
//! otherwise pass the reader, the loader and `export` unseen and mislead anything that sizes
//! from it. [`crate::DatasetReader`] checks it wherever a read includes a token column (so
//! the loader and `export` do), and `verify` checks it on every row.
use arrow_array::cast::AsArray;
use arrow_array::types::UInt32Type;
use arrow_array::{Array, RecordBatch, UInt32Array, UInt64Array};
use arrow_buffer::OffsetBuffer;

use crate::format::decode::{sample_ids_of, ValueAt, ValueError};
use crate::{Result, StoreError};

/// A batch's `seq_len` with the lengths of its `input_ids` and `loss_mask`, to check row by row.
#[derive(Debug)]
pub struct RowLengths {
    seq_len: UInt32Array,
    ids: OffsetBuffer<i32>,
    mask: OffsetBuffer<i32>,
    sample_ids: Option<UInt64Array>,
    file: String,
    row_group: Option<usize>,
}

impl RowLengths {
    /// The three columns of `batch` (read from `file`, row group `row_group` where known);
    /// `None` where the batch lacks one of them (a projection without it). A column of the
    /// wrong type, or of another row count, is [`StoreError::Corrupt`].
    pub fn from_batch(
        batch: &RecordBatch,
        file: &str,
        row_group: Option<usize>,
    ) -> Result<Option<Self>> {
        let (Some(seq), Some(ids), Some(mask)) = (
            batch.column_by_name("seq_len"),
            batch.column_by_name("input_ids"),
            batch.column_by_name("loss_mask"),
        ) else {
            return Ok(None);
        };
        let wrong = |name: &str, want: &str, c: &dyn Array| {
            StoreError::corrupt(
                file,
                format!("column {name:?} is {}, not {want}", c.data_type()),
            )
        };
        let seq_len = seq
            .as_primitive_opt::<UInt32Type>()
            .ok_or_else(|| wrong("seq_len", "UInt32", seq.as_ref()))?
            .clone();
        let ids = ids
            .as_list_opt::<i32>()
            .ok_or_else(|| wrong("input_ids", "a list", ids.as_ref()))?
            .offsets()
            .clone();
        let mask = mask
            .as_list_opt::<i32>()
            .ok_or_else(|| wrong("loss_mask", "a list", mask.as_ref()))?
            .offsets()
            .clone();
        if ids.len() != seq_len.len() + 1 || mask.len() != seq_len.len() + 1 {
            return Err(StoreError::corrupt(
                file,
                format!(
                    "{} rows of seq_len, {} of input_ids and {} of loss_mask",
                    seq_len.len(),
                    ids.len() - 1,
                    mask.len() - 1
                ),
            ));
        }
        Ok(Some(RowLengths {
            seq_len,
            ids,
            mask,
            sample_ids: sample_ids_of(batch),
            file: file.to_string(),
            row_group,
        }))
    }

    /// Row `row`'s token count, once its `seq_len` agrees with its token lists.
    pub fn check_row(&self, row: usize) -> Result<usize> {
        let len = |o: &OffsetBuffer<i32>| (o[row + 1] - o[row]).max(0) as usize;
        let (n, ids, mask) = (
            self.seq_len.value(row) as usize,
            len(&self.ids),
            len(&self.mask),
        );
        if self.seq_len.is_null(row) || n != ids || n != mask {
            let at = ValueAt::row_of(
                &self.file,
                self.row_group,
                self.sample_ids.as_ref(),
                row,
                "seq_len",
            );
            let shown = match self.seq_len.is_null(row) {
                true => "null".to_string(),
                false => n.to_string(),
            };
            return Err(ValueError {
                reason: format!(
                    "seq_len {shown}, but input_ids holds {ids} tokens and loss_mask {mask}"
                ),
            }
            .at(&at));
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::builder::{ListBuilder, UInt8Builder};
    use arrow_array::ArrayRef;
    use arrow_schema::{Field, Schema};

    use super::*;

    fn batch(seq_len: Vec<u32>, tokens: &[usize]) -> RecordBatch {
        let mut ids = ListBuilder::new(arrow_array::builder::Int32Builder::new());
        let mut mask = ListBuilder::new(UInt8Builder::new());
        for &n in tokens {
            ids.values().append_slice(&vec![7; n]);
            ids.append(true);
            mask.values().append_slice(&vec![1; n]);
            mask.append(true);
        }
        let cols: Vec<ArrayRef> = vec![
            Arc::new(UInt64Array::from_iter_values(10..10 + tokens.len() as u64)),
            Arc::new(UInt32Array::from(seq_len)),
            Arc::new(ids.finish()),
            Arc::new(mask.finish()),
        ];
        let schema = Schema::new(
            ["sample_id", "seq_len", "input_ids", "loss_mask"]
                .iter()
                .zip(&cols)
                .map(|(n, c)| Field::new(*n, c.data_type().clone(), true))
                .collect::<Vec<_>>(),
        );
        RecordBatch::try_new(Arc::new(schema), cols).unwrap()
    }

    #[test]
    fn a_seq_len_that_disagrees_with_the_tokens_is_named_with_its_row_and_sample() {
        let ok = RowLengths::from_batch(&batch(vec![3, 5], &[3, 5]), "data/a.parquet", Some(0))
            .unwrap()
            .unwrap();
        assert_eq!(ok.check_row(0).unwrap(), 3);
        assert_eq!(ok.check_row(1).unwrap(), 5);
        let bad = RowLengths::from_batch(
            &batch(vec![3, u32::MAX], &[3, 5]),
            "data/a.parquet",
            Some(2),
        )
        .unwrap()
        .unwrap();
        let err = bad.check_row(1).unwrap_err().to_string();
        assert_eq!(
            err,
            "data/a.parquet: row group 2: row 1 (sample 11) seq_len: seq_len 4294967295, but \
             input_ids holds 5 tokens and loss_mask 5"
        );
    }

    #[test]
    fn a_projection_without_the_token_columns_is_not_checked() {
        let b = batch(vec![3], &[3]);
        let only_seq = b.project(&[0, 1]).unwrap();
        assert!(RowLengths::from_batch(&only_seq, "f", None)
            .unwrap()
            .is_none());
    }
}
