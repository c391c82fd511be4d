//! Samples to Arrow record batches and back: `plane_zstd` tensors and fp8 scales, statistics
//! columns.
use std::sync::Arc;

use arrow_array::builder::{LargeBinaryBuilder, ListBuilder, PrimitiveBuilder};
use arrow_array::cast::AsArray;
use arrow_array::types::{Int32Type, UInt64Type, UInt8Type};
use arrow_array::{
    ArrayRef, Float32Array, LargeBinaryArray, RecordBatch, UInt32Array, UInt64Array,
};
use arrow_buffer::{Buffer, OffsetBuffer, ScalarBuffer};
use arrow_schema::{DataType, Field, Schema};
use hslake_schemas::{DatasetSchema, Sample, StatKind, TensorData, TensorStats};

use crate::format::decode::TensorColumn;
use crate::format::planes::ValueChecksum;
use crate::format::tokens::{token_checksum, TOKEN_CHECKSUM_COLUMN};
use crate::{Result, StoreError};

/// Little-endian values of `size` bytes in the `plane_zstd` encoding at zstd `level`, with a
/// checksum of `checksum`'s kind (see [`crate::format::planes`]); `what` names them in the
/// error.
fn encode_values(
    raw: &[u8],
    size: usize,
    level: i32,
    checksum: Option<ValueChecksum>,
    what: &str,
) -> Result<Vec<u8>> {
    crate::format::planes::encode(raw, size, level, checksum)
        .map_err(|e| StoreError::Usage(format!("encoding {what}: {e}")))
}

/// How the bytes of a sample's tensors are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorBytes {
    /// Little-endian elements.
    Elements,
    /// Their elements already split into planes, as [`crate::format::planes::to_planes`] splits
    /// them (a capture does this on the GPU); the same number of bytes for even element counts.
    Planes,
}

/// A tensor's values, `data` of elements of `size` bytes laid out as `bytes` says, in the
/// `plane_zstd` encoding at zstd `level`, with a checksum of `checksum`'s kind.
///
/// Takes the bytes rather than a `TensorData<D>`, and is never inlined, so that it is compiled
/// here at the store's opt-level 3: a generic encoder is compiled in each crate that calls it,
/// and the capture writers and the CLI are built at opt-level 0 in the setup's build (see
/// `hslake_schemas::stats_of`).
#[inline(never)]
pub fn encode_tensor(
    data: &[u8],
    size: usize,
    bytes: TensorBytes,
    level: i32,
    checksum: Option<ValueChecksum>,
) -> Result<Vec<u8>> {
    match bytes {
        TensorBytes::Elements => encode_values(data, size, level, checksum, "a tensor"),
        TensorBytes::Planes => crate::format::planes::encode_planes(data, size, level, checksum)
            .map_err(|e| StoreError::Usage(format!("encoding a tensor split into planes: {e}"))),
    }
}

/// A tensor's fp8 scales, one f32 per token, in the `plane_zstd` encoding (see
/// [`encode_tensor`], which this is beside for the same reason).
#[inline(never)]
pub fn encode_scales(
    scales: &[f32],
    level: i32,
    checksum: Option<ValueChecksum>,
) -> Result<Vec<u8>> {
    let raw: Vec<u8> = scales.iter().flat_map(|v| v.to_le_bytes()).collect();
    encode_values(&raw, 4, level, checksum, "fp8 scales")
}

/// A sample ready to be written: tensors encoded, statistics computed.
#[derive(Debug, Clone)]
pub struct EncodedSample {
    /// The sample id.
    pub sample_id: u64,
    /// Token ids.
    pub input_ids: Vec<i32>,
    /// Loss mask.
    pub loss_mask: Vec<u8>,
    /// Encoded (`plane_zstd`) tensors, in schema order.
    pub tensors: Vec<Vec<u8>>,
    /// Encoded (`plane_zstd` f32) fp8 scales, in schema order.
    pub scales: Vec<Option<Vec<u8>>>,
    /// Statistics, in schema order.
    pub stats: Vec<TensorStats>,
    /// Raw (decoded) tensor bytes.
    raw_bytes: u64,
    /// The checksum each of its values carries.
    checksum: Option<ValueChecksum>,
}

impl EncodedSample {
    /// Encode a sample (already validated against the schema) whose tensor bytes are laid out
    /// as `bytes` says at zstd `level`, each value with a checksum of `checksum`'s kind; `stats`
    /// are its tensors' [`tensor_stats`], in order.
    pub fn new<D: AsRef<[u8]>>(
        s: &Sample<D>,
        bytes: TensorBytes,
        stats: Vec<TensorStats>,
        level: i32,
        checksum: Option<ValueChecksum>,
    ) -> Result<Self> {
        Ok(EncodedSample {
            checksum,
            sample_id: s.sample_id,
            input_ids: s.input_ids.clone(),
            loss_mask: s.loss_mask.clone(),
            raw_bytes: s.tensors.iter().map(|t| t.data.as_ref().len() as u64).sum(),
            tensors: s
                .tensors
                .iter()
                .map(|t| encode_tensor(t.data.as_ref(), t.dtype.size(), bytes, level, checksum))
                .collect::<Result<_>>()?,
            scales: s
                .tensors
                .iter()
                .map(|t| {
                    t.scales
                        .as_deref()
                        .map(|sc| encode_scales(sc, level, checksum))
                        .transpose()
                })
                .collect::<Result<_>>()?,
            stats,
        })
    }

    /// Uncompressed tensor bytes.
    pub fn raw_bytes(&self) -> u64 {
        self.raw_bytes
    }

    /// The checksum each of its values carries.
    pub fn checksum(&self) -> Option<ValueChecksum> {
        self.checksum
    }
}

/// Build one record batch of a shard's Arrow schema (`shard::shard_schema`) from encoded
/// samples; where the schema has a token checksum column, each row's is computed here. The
/// rows' encoded tensor values move into the batch (the rows keep everything else).
pub fn build_batch(
    schema: &DatasetSchema,
    arrow: &Arc<Schema>,
    rows: &mut [EncodedSample],
) -> Result<RecordBatch> {
    let mut cols: Vec<ArrayRef> = vec![
        Arc::new(UInt64Array::from_iter_values(
            rows.iter().map(|r| r.sample_id),
        )),
        Arc::new(UInt32Array::from_iter_values(
            rows.iter().map(|r| r.input_ids.len() as u32),
        )),
        Arc::new(UInt32Array::from_iter_values(
            rows.iter()
                .map(|r| r.loss_mask.iter().filter(|&&m| m != 0).count() as u32),
        )),
    ];
    let item = |dt| Arc::new(Field::new("item", dt, false));
    let mut ids =
        ListBuilder::new(PrimitiveBuilder::<Int32Type>::new()).with_field(item(DataType::Int32));
    let mut mask =
        ListBuilder::new(PrimitiveBuilder::<UInt8Type>::new()).with_field(item(DataType::UInt8));
    for r in rows.iter() {
        ids.values().append_slice(&r.input_ids);
        ids.append(true);
        mask.values().append_slice(&r.loss_mask);
        mask.append(true);
    }
    cols.push(Arc::new(ids.finish()));
    cols.push(Arc::new(mask.finish()));
    for (i, _) in schema.points.iter().enumerate() {
        cols.push(binary_column(
            rows.iter_mut()
                .map(|r| std::mem::take(&mut r.tensors[i]))
                .collect(),
        ));
        if schema.dtype.has_scales() {
            let mut b = LargeBinaryBuilder::new();
            for r in rows.iter() {
                b.append_value(r.scales[i].as_deref().unwrap_or_default());
            }
            cols.push(Arc::new(b.finish()));
        }
        for k in StatKind::ALL {
            let col: ArrayRef = match k {
                StatKind::Norm => Arc::new(Float32Array::from_iter_values(
                    rows.iter().map(|r| r.stats[i].mean_norm),
                )),
                StatKind::MaxAbs => Arc::new(Float32Array::from_iter_values(
                    rows.iter().map(|r| r.stats[i].max_abs),
                )),
                StatKind::NanCount => Arc::new(UInt64Array::from_iter_values(
                    rows.iter().map(|r| r.stats[i].nan_count),
                )),
                StatKind::InfCount => Arc::new(UInt64Array::from_iter_values(
                    rows.iter().map(|r| r.stats[i].inf_count),
                )),
            };
            cols.push(col);
        }
    }
    if arrow.column_with_name(TOKEN_CHECKSUM_COLUMN).is_some() {
        cols.push(Arc::new(UInt32Array::from_iter_values(
            rows.iter()
                .map(|r| token_checksum(&r.input_ids, &r.loss_mask)),
        )));
    }
    RecordBatch::try_new(arrow.clone(), cols).map_err(|source| StoreError::Arrow {
        context: "building a shard batch".into(),
        source,
    })
}

/// One binary column of `values`. A lone value (a row group of one sample: every sample of
/// real-size states fills one) becomes the column's buffer as it is, without a copy.
fn binary_column(mut values: Vec<Vec<u8>>) -> ArrayRef {
    if values.len() == 1 {
        let v = values.pop().expect("one value");
        let offsets = OffsetBuffer::new(ScalarBuffer::from(vec![0i64, v.len() as i64]));
        return Arc::new(LargeBinaryArray::new(offsets, Buffer::from_vec(v), None));
    }
    let bytes = values.iter().map(Vec::len).sum();
    let mut b = LargeBinaryBuilder::with_capacity(values.len(), bytes);
    for v in &values {
        b.append_value(v);
    }
    Arc::new(b.finish())
}

fn column<'a>(batch: &'a RecordBatch, name: &str, path: &str) -> Result<&'a ArrayRef> {
    batch
        .column_by_name(name)
        .ok_or_else(|| StoreError::corrupt(path, format!("missing column {name:?}")))
}

/// Decode every row of a batch (all columns present) into samples.
pub fn decode_samples(schema: &DatasetSchema, batch: &RecordBatch) -> Result<Vec<Sample>> {
    decode_samples_from(schema, batch, "record batch", None)
}

/// Decode every row of a batch read from `path` (row group `row_group`, where known; both
/// named in errors) into samples.
pub fn decode_samples_from(
    schema: &DatasetSchema,
    batch: &RecordBatch,
    path: &str,
    row_group: Option<usize>,
) -> Result<Vec<Sample>> {
    let bad_type =
        |name: &str| StoreError::corrupt(path, format!("column {name:?} has an unexpected type"));
    let ids = column(batch, "sample_id", path)?
        .as_primitive_opt::<UInt64Type>()
        .ok_or_else(|| bad_type("sample_id"))?;
    let toks = column(batch, "input_ids", path)?
        .as_list_opt::<i32>()
        .ok_or_else(|| bad_type("input_ids"))?;
    let mask = column(batch, "loss_mask", path)?
        .as_list_opt::<i32>()
        .ok_or_else(|| bad_type("loss_mask"))?;
    let tensor_cols = schema
        .points
        .iter()
        .map(|&p| {
            TensorColumn::from_batch(batch, schema.dtype, schema.hidden_size, p, path, row_group)
        })
        .collect::<Result<Vec<_>>>()?;
    let mut out = Vec::with_capacity(batch.num_rows());
    for row in 0..batch.num_rows() {
        let sample_id = ids.value(row);
        let input_ids = toks
            .value(row)
            .as_primitive_opt::<Int32Type>()
            .ok_or_else(|| bad_type("input_ids"))?
            .values()
            .to_vec();
        let loss_mask = mask
            .value(row)
            .as_primitive_opt::<UInt8Type>()
            .ok_or_else(|| bad_type("loss_mask"))?
            .values()
            .to_vec();
        let n = input_ids.len();
        let mut tensors = Vec::with_capacity(tensor_cols.len());
        for col in &tensor_cols {
            let (mut data, mut scales) = (Vec::new(), Vec::new());
            col.decode_row(row, n, &mut data, &mut scales)?;
            tensors.push(TensorData {
                dtype: schema.dtype,
                shape: vec![n, schema.hidden_size],
                data,
                scales: schema.dtype.has_scales().then(|| {
                    scales
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect()
                }),
            });
        }
        out.push(Sample {
            sample_id,
            input_ids,
            loss_mask,
            tensors,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_encoders_are_plain_functions_compiled_here() {
        // See `hslake_schemas::stats_of`: a generic encoder would run at the opt-level of the
        // crate calling it, 0 for the capture writers and the CLI in the setup's build.
        assert_eq!(
            std::any::type_name_of_val(&encode_tensor),
            "hslake_store::format::codec::encode_tensor"
        );
        assert_eq!(
            std::any::type_name_of_val(&encode_scales),
            "hslake_store::format::codec::encode_scales"
        );
    }
}
