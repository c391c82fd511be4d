//! The one decoder of stored tensor values. Samples (`codec`), `verify`, the loader and the
//! SQL tensor functions all decode through here, so every value is checked against what its
//! row and the schema say it holds (`seq_len × hidden` elements, or `seq_len` scales) before
//! anything is sized from it: a corrupt value whose frames claim another length is refused,
//! never allocated for. Every value's checksum, where present, is checked on the way (its
//! CRC-32 trailer, computed frame by frame as zstd reads them, or zstd's frame checksums); a file that declares checksummed values ([`planes::CHECKSUM_META_KEY`] in its
//! schema metadata) has every value without one of the declared kind refused.
use std::fmt::Write;

use arrow_array::cast::AsArray;
use arrow_array::types::UInt64Type;
use arrow_array::{Array, LargeBinaryArray, RecordBatch, UInt64Array};
use arrow_buffer::{Buffer, OffsetBuffer, ScalarBuffer};
use hslake_schemas::{CapturePoint, DType};

use crate::format::planes::{self, Checksums, PlaneError};
use crate::{Result, StoreError};

/// What each token of a stored value holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueKind {
    /// A tensor's token row: `hidden` elements of `dtype`.
    Tensor {
        /// Element type.
        dtype: DType,
        /// Elements per token.
        hidden: usize,
    },
    /// An fp8 tensor's per-token scale: one f32.
    Scales,
}

impl ValueKind {
    fn elem_size(self) -> usize {
        match self {
            ValueKind::Tensor { dtype, .. } => dtype.size(),
            ValueKind::Scales => 4,
        }
    }

    fn width(self) -> usize {
        match self {
            ValueKind::Tensor { hidden, .. } => hidden,
            ValueKind::Scales => 1,
        }
    }

    /// Elements in `tokens` tokens (saturating: an absurd row length cannot wrap around into a
    /// plausible one).
    pub fn elements(self, tokens: usize) -> usize {
        tokens.saturating_mul(self.width())
    }

    /// Bytes of `tokens` decoded tokens.
    pub fn bytes(self, tokens: usize) -> usize {
        self.elements(tokens).saturating_mul(self.elem_size())
    }

    /// `shape [8, 64] of bf16` or `8 f32 scales (one per token)`.
    fn expected(self, tokens: usize) -> String {
        match self {
            ValueKind::Tensor { dtype, hidden } => format!("shape [{tokens}, {hidden}] of {dtype}"),
            ValueKind::Scales => format!("{tokens} f32 scales (one per token)"),
        }
    }

    /// What a value of `found` elements holds, in the terms of [`ValueKind::expected`].
    fn found(self, found: usize) -> String {
        match self {
            ValueKind::Tensor { hidden, .. } if found.is_multiple_of(hidden) => {
                format!("[{}, {hidden}]", found / hidden)
            }
            ValueKind::Tensor { .. } => format!("{found} elements"),
            ValueKind::Scales => format!("{found}"),
        }
    }

    fn refuse(self, tokens: usize, e: PlaneError) -> ValueError {
        let reason = match e {
            PlaneError::WrongLength { found, .. } => {
                format!(
                    "expected {}, got {}",
                    self.expected(tokens),
                    self.found(found)
                )
            }
            e @ (PlaneError::Checksum { .. } | PlaneError::Trailer { .. }) => {
                format!("corrupt value: {e}")
            }
            e => format!("cannot be decoded as {}: {e}", self.expected(tokens)),
        };
        ValueError { reason }
    }
}

/// Why a value was refused, before the caller says where it sits ([`ValueError::at`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ValueError {
    /// What is wrong, e.g. `expected shape [8, 64] of bf16, got [3125000, 64]`.
    pub reason: String,
}

impl std::fmt::Display for ValueError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.reason)
    }
}

impl ValueError {
    /// The store error naming where the value sits.
    pub fn at(self, at: &ValueAt<'_>) -> StoreError {
        StoreError::BadValue {
            file: at.file.map(str::to_string),
            row_group: at.row_group,
            row: at.row,
            sample_id: at.sample_id,
            column: at.column.to_string(),
            reason: self.reason,
        }
    }
}

/// Where a value sits, for the error that refuses it; callers fill in what they know.
#[derive(Debug, Clone, Copy, Default)]
pub struct ValueAt<'a> {
    /// The shard file.
    pub file: Option<&'a str>,
    /// The row group in that file.
    pub row_group: Option<usize>,
    /// The row in the batch being decoded.
    pub row: Option<usize>,
    /// The row's sample id.
    pub sample_id: Option<u64>,
    /// The column.
    pub column: &'a str,
}

impl<'a> ValueAt<'a> {
    /// Row `row` of a batch read from `file`'s `row_group`, with its sample id where the batch
    /// has that column.
    pub(crate) fn row_of(
        file: &'a str,
        row_group: Option<usize>,
        sample_ids: Option<&UInt64Array>,
        row: usize,
        column: &'a str,
    ) -> Self {
        ValueAt {
            file: Some(file),
            row_group,
            row: Some(row),
            sample_id: sample_ids
                .filter(|ids| row < ids.len())
                .map(|ids| ids.value(row)),
            column,
        }
    }
}

/// Where a value sits, as errors print it: `file: row group 2: row 3 (sample 17) layer_30`,
/// leaving out what is not known.
pub fn describe_site(
    file: &Option<String>,
    row_group: &Option<usize>,
    row: &Option<usize>,
    sample_id: &Option<u64>,
    column: &str,
) -> String {
    let mut s = String::new();
    if let Some(f) = file {
        let _ = write!(s, "{f}: ");
    }
    if let Some(g) = row_group {
        let _ = write!(s, "row group {g}: ");
    }
    if let Some(r) = row {
        let _ = write!(s, "row {r} ");
    }
    if let Some(id) = sample_id {
        let _ = write!(s, "(sample {id}) ");
    }
    s.push_str(column);
    s
}

/// Decode a value that must hold `tokens` tokens of `kind` into `out`, which is exactly
/// `kind.bytes(tokens)` long; `checks` says whether its frames must carry checksums.
pub fn decode_value_into(
    value: &[u8],
    kind: ValueKind,
    tokens: usize,
    checks: Checksums,
    out: &mut [u8],
) -> Result<(), ValueError> {
    if out.len() != kind.bytes(tokens) {
        return Err(ValueError {
            reason: format!(
                "a buffer of {} bytes cannot hold {}",
                out.len(),
                kind.expected(tokens)
            ),
        });
    }
    planes::decode_into(value, kind.elem_size(), checks, out).map_err(|e| kind.refuse(tokens, e))
}

/// Decode a value that must hold `tokens` tokens of `kind` into `out`, resized to fit only
/// after the value's own header agrees with `tokens`; `checks` says whether its frames must
/// carry checksums.
pub fn decode_value(
    value: &[u8],
    kind: ValueKind,
    tokens: usize,
    checks: Checksums,
    out: &mut Vec<u8>,
) -> Result<(), ValueError> {
    planes::decode_to_vec(value, kind.elem_size(), kind.elements(tokens), checks, out)
        .map_err(|e| kind.refuse(tokens, e))
}

/// Check, without decoding, that a value's header claims `tokens` tokens of `kind`. The value's
/// checksum is computed only where the header disagrees, so that a corrupt header is reported
/// as corrupt; decoding checks it in any case.
pub fn check_tokens(
    value: &[u8],
    kind: ValueKind,
    tokens: usize,
    checks: Checksums,
) -> Result<(), ValueError> {
    let expected = kind.elements(tokens);
    let err = match planes::element_count(value, kind.elem_size(), checks) {
        Ok(found) if found == expected => return Ok(()),
        Ok(found) => PlaneError::WrongLength { found, expected },
        Err(e) => e,
    };
    match planes::check_trailer(value, kind.elem_size(), checks) {
        Err(corrupt @ PlaneError::Trailer { .. }) => Err(kind.refuse(tokens, corrupt)),
        _ => Err(kind.refuse(tokens, err)),
    }
}

/// Tokens in a value whose row length is not known (an SQL value cut off from its row): from
/// the value's own header, which is trusted only as far as its frames can hold it.
pub fn header_tokens(
    value: &[u8],
    kind: ValueKind,
    checks: Checksums,
) -> Result<usize, ValueError> {
    let n = planes::element_count(value, kind.elem_size(), checks).map_err(|e| ValueError {
        reason: e.to_string(),
    })?;
    let width = kind.width();
    if !n.is_multiple_of(width) {
        let dtype = match kind {
            ValueKind::Tensor { dtype, .. } => dtype,
            ValueKind::Scales => DType::F32,
        };
        return Err(ValueError {
            reason: format!(
                "a value of {n} {dtype} elements is not a whole number of rows of {width}"
            ),
        });
    }
    Ok(n / width)
}

/// `batch` with its file's schema metadata (Parquet key-value metadata included), which Arrow
/// readers leave off the batches they return: [`TensorColumn::from_batch`] reads from it
/// whether the file declares checksummed values.
pub fn with_file_metadata(
    batch: RecordBatch,
    metadata: &std::collections::HashMap<String, String>,
) -> RecordBatch {
    if metadata.is_empty() {
        return batch;
    }
    let schema = batch
        .schema_ref()
        .as_ref()
        .clone()
        .with_metadata(metadata.clone());
    // The same fields with more metadata, which `with_schema` accepts.
    match batch.clone().with_schema(std::sync::Arc::new(schema)) {
        Ok(b) => b,
        Err(_) => batch,
    }
}

/// The batch's `sample_id` column, where it has one: errors about its rows name their samples.
pub(crate) fn sample_ids_of(batch: &RecordBatch) -> Option<UInt64Array> {
    batch
        .column_by_name("sample_id")
        .and_then(|c| c.as_primitive_opt::<UInt64Type>())
        .cloned()
}

/// A column decoded to plain little-endian tokens: row `r` holds its `[tokens, hidden]` values
/// (or its scales as little-endian f32).
#[derive(Debug, Clone)]
pub struct DecodedColumn {
    /// The tensor values, one array value per row.
    pub values: LargeBinaryArray,
    /// For fp8, the per-token scales, one array value per row.
    pub scales: Option<LargeBinaryArray>,
}

/// One capture point's stored columns in a record batch: its tensor values and, for fp8, their
/// per-token scales, with what errors need to name the file, row group, sample and column.
#[derive(Debug, Clone)]
pub struct TensorColumn {
    kind: ValueKind,
    name: String,
    values: LargeBinaryArray,
    scales: Option<(String, LargeBinaryArray)>,
    sample_ids: Option<UInt64Array>,
    file: String,
    row_group: Option<usize>,
    checks: Checksums,
}

impl TensorColumn {
    /// `point`'s tensor column, and for fp8 its scale column, in `batch` (read from `file`, row
    /// group `row_group` where known); a missing or mistyped column is
    /// [`StoreError::Corrupt`]. The batch's `sample_id` column, if read, names samples in errors.
    /// The batch's schema metadata is its file's: where it declares
    /// [`planes::CHECKSUM_META_KEY`], every value must carry a checksum of the declared kind (a
    /// kind this build does not know is [`StoreError::Corrupt`]).
    pub fn from_batch(
        batch: &RecordBatch,
        dtype: DType,
        hidden: usize,
        point: CapturePoint,
        file: &str,
        row_group: Option<usize>,
    ) -> Result<Self> {
        let binary = |name: &str| -> Result<LargeBinaryArray> {
            let col = batch
                .column_by_name(name)
                .ok_or_else(|| StoreError::corrupt(file, format!("column {name:?} is missing")))?;
            col.as_binary_opt::<i64>().cloned().ok_or_else(|| {
                StoreError::corrupt(
                    file,
                    format!("column {name:?} is {}, not LargeBinary", col.data_type()),
                )
            })
        };
        let checks = Checksums::declared_by(batch.schema_ref().metadata())
            .map_err(|why| StoreError::corrupt(file, why))?;
        let name = point.column();
        let values = binary(&name)?;
        let scales = if dtype.has_scales() {
            let sname = point.scale_column();
            let s = binary(&sname)?;
            Some((sname, s))
        } else {
            None
        };
        let sample_ids = sample_ids_of(batch);
        Ok(TensorColumn {
            kind: ValueKind::Tensor { dtype, hidden },
            name,
            values,
            scales,
            sample_ids,
            file: file.to_string(),
            row_group,
            checks,
        })
    }

    /// What this column's values are held to: the checksum its file declares, if any.
    pub fn checksums(&self) -> Checksums {
        self.checks
    }

    /// The tensor column's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether row `row` has no tensor value (verify reports these; the writer never makes them).
    pub fn is_null(&self, row: usize) -> bool {
        self.values.is_null(row)
    }

    fn at<'a>(&'a self, row: usize, column: &'a str) -> ValueAt<'a> {
        ValueAt::row_of(
            &self.file,
            self.row_group,
            self.sample_ids.as_ref(),
            row,
            column,
        )
    }

    /// Decode row `row`, which holds `tokens` tokens, into `out` and, for fp8, its scales into
    /// `scales` (little-endian f32); each is resized to fit only once the value agrees.
    pub fn decode_row(
        &self,
        row: usize,
        tokens: usize,
        out: &mut Vec<u8>,
        scales: &mut Vec<u8>,
    ) -> Result<()> {
        decode_value(self.values.value(row), self.kind, tokens, self.checks, out)
            .map_err(|e| e.at(&self.at(row, &self.name)))?;
        if let Some((sname, col)) = &self.scales {
            decode_value(
                col.value(row),
                ValueKind::Scales,
                tokens,
                self.checks,
                scales,
            )
            .map_err(|e| e.at(&self.at(row, sname)))?;
        }
        Ok(())
    }

    /// Decode every row into one contiguous buffer per column (the loader's column chunk);
    /// row `r` holds the tokens `offsets[r]..offsets[r + 1]`.
    pub fn decode_chunk(&self, offsets: &[usize]) -> Result<DecodedColumn> {
        self.decode_chunk_rows(offsets, None)
    }

    /// As [`TensorColumn::decode_chunk`], but a row whose value (or scales) does not decode is
    /// recorded in `bad` (row → the error naming it) and left zeroed instead of failing the
    /// chunk, so that a reader can drop that sample alone; rows already in `bad` (refused by
    /// another column) are not decoded.
    pub fn decode_chunk_skipping(
        &self,
        offsets: &[usize],
        bad: &mut std::collections::BTreeMap<usize, StoreError>,
    ) -> Result<DecodedColumn> {
        self.decode_chunk_rows(offsets, Some(bad))
    }

    fn decode_chunk_rows(
        &self,
        offsets: &[usize],
        mut bad: Option<&mut std::collections::BTreeMap<usize, StoreError>>,
    ) -> Result<DecodedColumn> {
        if offsets.len() != self.values.len() + 1 {
            return Err(StoreError::Usage(format!(
                "{}: {} token offsets for {} rows of {}",
                self.file,
                offsets.len(),
                self.values.len(),
                self.name
            )));
        }
        let values = self.decode_rows(
            &self.values,
            self.kind,
            offsets,
            &self.name,
            bad.as_deref_mut(),
        )?;
        let scales = match &self.scales {
            Some((sname, col)) => {
                Some(self.decode_rows(col, ValueKind::Scales, offsets, sname, bad)?)
            }
            None => None,
        };
        Ok(DecodedColumn { values, scales })
    }

    /// Decode every row of `col`; a row that fails is an error, or where `bad` is given, recorded
    /// there and left zeroed.
    fn decode_rows(
        &self,
        col: &LargeBinaryArray,
        kind: ValueKind,
        offsets: &[usize],
        column: &str,
        mut bad: Option<&mut std::collections::BTreeMap<usize, StoreError>>,
    ) -> Result<LargeBinaryArray> {
        let row_bytes = kind.bytes(1);
        let mut refused: Vec<bool> = (0..offsets.len().saturating_sub(1))
            .map(|r| bad.as_ref().is_some_and(|b| b.contains_key(&r)))
            .collect();
        let mut refuse = |r: usize, e: ValueError| -> Result<()> {
            let e = e.at(&self.at(r, column));
            match bad.as_deref_mut() {
                Some(b) => {
                    b.entry(r).or_insert(e);
                    Ok(())
                }
                None => Err(e),
            }
        };
        // Row lengths come from the untrusted seq_len column: each value's own header must agree
        // (and is bounded by what its frames can hold) before the chunk is sized from them.
        for (r, w) in offsets.windows(2).enumerate() {
            if refused[r] {
                continue;
            }
            if let Err(e) = check_tokens(col.value(r), kind, w[1].saturating_sub(w[0]), self.checks)
            {
                refuse(r, e)?;
                refused[r] = true;
            }
        }
        let mut decoded = crate::buffer::zeroed(
            offsets
                .last()
                .copied()
                .unwrap_or(0)
                .saturating_mul(row_bytes),
        );
        for (r, w) in offsets.windows(2).enumerate() {
            if refused[r] {
                continue;
            }
            let dst = &mut decoded[w[0] * row_bytes..w[1] * row_bytes];
            if let Err(e) = decode_value_into(col.value(r), kind, w[1] - w[0], self.checks, dst) {
                dst.fill(0);
                refuse(r, e)?;
            }
        }
        let ends = offsets.iter().map(|&o| (o * row_bytes) as i64);
        Ok(LargeBinaryArray::new(
            OffsetBuffer::new(ScalarBuffer::from_iter(ends)),
            Buffer::from_vec(decoded),
            None,
        ))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::ArrayRef;
    use arrow_schema::{Field, Schema};

    use super::*;
    use crate::format::planes::ValueChecksum;

    const CRC: Checksums = Checksums::Declared(ValueChecksum::Crc32);
    const SUMMED: Option<ValueChecksum> = Some(ValueChecksum::DEFAULT);

    const BF16: ValueKind = ValueKind::Tensor {
        dtype: DType::Bf16,
        hidden: 4,
    };

    fn bf16_value(tokens: usize) -> Vec<u8> {
        let raw: Vec<u8> = (0..tokens * 4 * 2).map(|i| (i * 37 % 251) as u8).collect();
        planes::encode(&raw, 2, 1, SUMMED).unwrap()
    }

    /// A value that is valid zstd and claims `claimed` elements: the planes of `claimed` zero
    /// bytes compress to a few bytes (RLE blocks), as in a poisoned shard.
    fn poisoned(claimed: usize) -> Vec<u8> {
        planes::encode(&vec![0u8; claimed * 2], 2, 1, SUMMED).unwrap()
    }

    #[test]
    fn decodes_a_value_of_the_expected_tokens() {
        let mut out = Vec::new();
        decode_value(&bf16_value(3), BF16, 3, CRC, &mut out).unwrap();
        assert_eq!(out.len(), 3 * 4 * 2);
        let mut slice = vec![0u8; 24];
        decode_value_into(&bf16_value(3), BF16, 3, CRC, &mut slice).unwrap();
        assert_eq!(slice, out);
    }

    #[test]
    fn refuses_a_value_that_claims_more_tokens_than_its_row_without_allocating_for_it() {
        // 2.5 million elements in a value of a few hundred bytes, for a row of 8 tokens.
        let value = poisoned(2_500_000);
        assert!(value.len() < 64 << 10, "{} bytes", value.len());
        let mut out = Vec::new();
        let err = decode_value(&value, BF16, 8, CRC, &mut out).unwrap_err();
        assert_eq!(err.reason, "expected shape [8, 4] of bf16, got [625000, 4]");
        assert_eq!(out.capacity(), 0);
    }

    #[test]
    fn refusal_names_file_row_group_sample_and_column() {
        let ids: ArrayRef = Arc::new(UInt64Array::from(vec![41u64, 42]));
        let vals: ArrayRef = Arc::new(LargeBinaryArray::from_iter_values([
            bf16_value(2),
            bf16_value(5),
        ]));
        let schema = Schema::new(vec![
            Field::new("sample_id", arrow_schema::DataType::UInt64, false),
            Field::new("layer_3", arrow_schema::DataType::LargeBinary, false),
        ]);
        let batch = RecordBatch::try_new(Arc::new(schema), vec![ids, vals]).unwrap();
        let col = TensorColumn::from_batch(
            &batch,
            DType::Bf16,
            4,
            CapturePoint::LayerOutput(3),
            "data/a.parquet",
            Some(7),
        )
        .unwrap();
        let err = col.decode_chunk(&[0, 2, 4]).unwrap_err().to_string();
        assert_eq!(
            err,
            "data/a.parquet: row group 7: row 1 (sample 42) layer_3: \
             expected shape [2, 4] of bf16, got [5, 4]"
        );
        let ok = col.decode_chunk(&[0, 2, 7]).unwrap();
        assert_eq!(ok.values.value(1).len(), 5 * 4 * 2);
        assert!(ok.scales.is_none());
    }

    #[test]
    fn missing_scale_column_of_fp8_is_named() {
        let vals: ArrayRef = Arc::new(LargeBinaryArray::from_iter_values([bf16_value(1)]));
        let schema = Schema::new(vec![Field::new(
            "layer_3",
            arrow_schema::DataType::LargeBinary,
            false,
        )]);
        let batch = RecordBatch::try_new(Arc::new(schema), vec![vals]).unwrap();
        let err = TensorColumn::from_batch(
            &batch,
            DType::Fp8E4m3,
            4,
            CapturePoint::LayerOutput(3),
            "f.parquet",
            None,
        )
        .unwrap_err()
        .to_string();
        assert_eq!(err, "f.parquet: column \"layer_3_scale\" is missing");
    }

    #[test]
    fn check_tokens_reads_only_the_header() {
        assert_eq!(check_tokens(&bf16_value(3), BF16, 3, CRC), Ok(()));
        assert_eq!(
            check_tokens(&poisoned(400), BF16, 8, CRC)
                .unwrap_err()
                .reason,
            "expected shape [8, 4] of bf16, got [100, 4]"
        );
    }

    #[test]
    fn header_tokens_refuses_partial_rows() {
        assert_eq!(header_tokens(&bf16_value(3), BF16, CRC), Ok(3));
        let five = planes::encode(&[0u8; 10], 2, 1, SUMMED).unwrap();
        assert_eq!(
            header_tokens(&five, BF16, CRC).unwrap_err().reason,
            "a value of 5 bf16 elements is not a whole number of rows of 4"
        );
    }

    /// A batch of samples 41 and 42 (2 tokens each) of `layer_3`, its schema declaring
    /// checksummed values of the kind named `declared`, or not.
    fn batch_of(values: [Vec<u8>; 2], declared: Option<&str>) -> Result<TensorColumn> {
        let ids: ArrayRef = Arc::new(UInt64Array::from(vec![41u64, 42]));
        let vals: ArrayRef = Arc::new(LargeBinaryArray::from_iter_values(values));
        let mut schema = Schema::new(vec![
            Field::new("sample_id", arrow_schema::DataType::UInt64, false),
            Field::new("layer_3", arrow_schema::DataType::LargeBinary, false),
        ]);
        if let Some(kind) = declared {
            schema = schema
                .with_metadata([(planes::CHECKSUM_META_KEY.to_string(), kind.to_string())].into());
        }
        let batch = RecordBatch::try_new(Arc::new(schema), vec![ids, vals]).unwrap();
        TensorColumn::from_batch(
            &batch,
            DType::Bf16,
            4,
            CapturePoint::LayerOutput(3),
            "data/a.parquet",
            Some(0),
        )
    }

    const RAW: [u8; 16] = [
        0, 37, 74, 111, 148, 185, 222, 8, 45, 82, 119, 156, 193, 230, 16, 53,
    ];

    #[test]
    fn a_value_whose_content_fails_its_checksum_is_named() {
        let site = "data/a.parquet: row group 0: row 1 (sample 42) layer_3: corrupt value: ";
        // Format 3: a flip in the header of frame lengths, reported as what it is: the first
        // pass reads only headers, and a header that disagrees has its value's CRC-32 checked.
        let mut bad = planes::encode(&RAW, 2, 1, SUMMED).unwrap();
        bad[0] ^= 0x01;
        let col = batch_of([bf16_value(2), bad], Some("crc32")).unwrap();
        assert_eq!(col.checksums(), CRC);
        let err = col.decode_chunk(&[0, 2, 4]).unwrap_err().to_string();
        assert!(
            err.starts_with(&format!("{site}crc32 of the value is ")),
            "{err}"
        );
        let (mut out, mut sc) = (Vec::new(), Vec::new());
        col.decode_row(0, 2, &mut out, &mut sc).unwrap();
        assert!(col.decode_row(1, 2, &mut out, &mut sc).is_err());

        // Format 2: the last byte of the last frame is the top byte of its zstd checksum.
        let mut bad = planes::encode(&RAW, 2, 1, Some(ValueChecksum::ZstdXxh64)).unwrap();
        *bad.last_mut().unwrap() ^= 0x01;
        let good = planes::encode(&RAW, 2, 1, Some(ValueChecksum::ZstdXxh64)).unwrap();
        let col = batch_of([good, bad], Some("zstd_xxh64")).unwrap();
        let err = col.decode_chunk(&[0, 2, 4]).unwrap_err().to_string();
        assert!(
            err.starts_with(&format!("{site}plane 2: ")) && err.contains("checksum"),
            "{err}"
        );
    }

    #[test]
    fn decode_chunk_skipping_records_the_corrupt_row_and_decodes_the_rest() {
        let mut bad_value = planes::encode(&RAW, 2, 1, SUMMED).unwrap();
        bad_value[14] ^= 0x10;
        let col = batch_of([bf16_value(2), bad_value], Some("crc32")).unwrap();
        assert!(col.decode_chunk(&[0, 2, 4]).is_err());
        let mut bad = std::collections::BTreeMap::new();
        let out = col.decode_chunk_skipping(&[0, 2, 4], &mut bad).unwrap();
        assert_eq!(bad.keys().copied().collect::<Vec<_>>(), [1]);
        assert!(bad[&1]
            .to_string()
            .contains("(sample 42) layer_3: corrupt value"));
        let (mut row0, mut sc) = (Vec::new(), Vec::new());
        col.decode_row(0, 2, &mut row0, &mut sc).unwrap();
        assert_eq!(out.values.value(0), &row0[..]);
        assert_eq!(
            out.values.value(1),
            &[0u8; 16][..],
            "a refused row is left zeroed"
        );
    }

    #[test]
    fn a_file_declaring_checksums_refuses_a_value_without_them() {
        let unsummed = planes::encode(&RAW, 2, 1, None).unwrap();
        let old_file = batch_of([bf16_value(2), unsummed.clone()], None).unwrap();
        assert_eq!(old_file.checksums(), Checksums::IfPresent);
        assert!(
            old_file.decode_chunk(&[0, 2, 4]).is_ok(),
            "old files still read"
        );
        for (kind, why) in [
            ("zstd_xxh64", "plane 0: frame has no content checksum"),
            ("crc32", "crc32 of the value is"),
        ] {
            let good = planes::encode(&RAW, 2, 1, ValueChecksum::from_name(kind)).unwrap();
            let err = batch_of([good, unsummed.clone()], Some(kind))
                .unwrap()
                .decode_chunk(&[0, 2, 4])
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(&format!("(sample 42) layer_3: corrupt value: {why}")),
                "{kind}: {err}"
            );
        }
    }

    #[test]
    fn a_file_declaring_an_unknown_checksum_kind_is_refused_by_name() {
        let err = batch_of([bf16_value(2), bf16_value(2)], Some("crc32d"))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("data/a.parquet: ") && err.contains("\"crc32d\""),
            "{err}"
        );
    }
}
