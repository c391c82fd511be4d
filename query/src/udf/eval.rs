//! Evaluation of the tensor functions over whole argument arrays.
use std::sync::Arc;

use datafusion::arrow::array::{
    Array, ArrayRef, AsArray, Float32Builder, Float64Builder, LargeBinaryBuilder, ListBuilder,
    UInt64Array, UInt64Builder,
};
use datafusion::arrow::datatypes::{DataType, Int64Type};
use datafusion::common::{exec_err, DataFusionError, Result};
use datafusion::execution::memory_pool::MemoryReservation;
use hslake_schemas::DType;

use super::Op;
use crate::budget::QueryBudget;
use crate::error::BadTensorValue;
use crate::tensor::{self, TensorKind};
use crate::QueryError;

/// What the rows of each tensor argument are, where the query sees it: their row lengths
/// (`seq_len`) and sample ids; and the names errors use.
pub(super) struct RowInfo<'a> {
    pub(super) seq_lens: Vec<UInt64Array>,
    pub(super) sample_ids: Vec<UInt64Array>,
    /// The tensor arguments' column names.
    pub(super) columns: Vec<String>,
    pub(super) function: &'a str,
}

impl RowInfo<'_> {
    fn get(a: &[UInt64Array], arg: usize, row: usize) -> Option<u64> {
        a.get(arg).filter(|a| a.is_valid(row)).map(|a| a.value(row))
    }

    /// Tokens of row `row` of tensor argument `arg`; `None` where unknown.
    fn seq_len(&self, arg: usize, row: usize) -> Option<usize> {
        Self::get(&self.seq_lens, arg, row).map(|n| n as usize)
    }

    /// The error for a value of tensor argument `arg` (in `column`) at `row` that does not
    /// decode; the session names its file and row group from the sample id.
    fn bad(&self, arg: usize, column: &str, row: usize, reason: String) -> DataFusionError {
        DataFusionError::External(Box::new(QueryError::BadValue(Box::new(BadTensorValue {
            function: self.function.to_string(),
            file: None,
            row_group: None,
            row: Some(row),
            sample_id: Self::get(&self.sample_ids, arg, row),
            column: column.to_string(),
            reason,
        }))))
    }
}

/// What one call holds in memory, checked before each row is decoded: the decode buffers of
/// the largest row so far (they are reused from row to row) and every result value built so
/// far, against the per-value cap and the query's memory pool; and whether the query was
/// cancelled, so that a long batch stops between rows.
struct Holding<'a> {
    budget: &'a QueryBudget,
    function: &'a str,
    reservation: Option<MemoryReservation>,
    buffers: u64,
    results: u64,
}

impl<'a> Holding<'a> {
    fn new(budget: &'a QueryBudget, function: &'a str) -> Self {
        Holding {
            budget,
            function,
            reservation: budget.reservation(function),
            buffers: 0,
            results: 0,
        }
    }

    /// Before row `row`, which needs `buffers` bytes to decode and builds a `result` of that
    /// many bytes.
    fn row(&mut self, row: usize, buffers: u64, result: u64) -> Result<()> {
        self.budget.check_cancelled()?;
        self.budget.check_value(self.function, result, row)?;
        self.buffers = self.buffers.max(buffers);
        self.results = self.results.saturating_add(result);
        if let Some(r) = &self.reservation {
            let total = self.buffers.saturating_add(self.results);
            r.try_resize(usize::try_from(total).unwrap_or(usize::MAX))?;
        }
        Ok(())
    }
}

/// Bytes `op` needs to decode one row of `tokens` tokens of `k` (raw bytes and their f32 copy,
/// for each tensor argument) and bytes of the value it builds for the row.
fn row_cost(op: Op, k: TensorKind, tokens: usize) -> (u64, u64) {
    let (tokens, hidden) = (tokens as u64, k.hidden as u64);
    let elements = tokens.saturating_mul(hidden);
    let decode = elements.saturating_mul(k.dtype.size() as u64 + 4);
    match op {
        Op::Shape => (0, 24),
        Op::Norm | Op::MaxAbs | Op::Mean | Op::Std | Op::NanCount | Op::InfCount => (decode, 8),
        // The second tensor has the same width and at most 4 bytes per element.
        Op::Cosine => (decode.saturating_add(elements.saturating_mul(8)), 8),
        Op::TokenNorms => (decode, 8 + tokens * 8),
        Op::TokenVector => (decode, 8 + hidden * 4),
        // Scaled f32 values, their bytes for the encoder, and the encoded value: zstd's worst
        // case adds a little to incompressible input.
        Op::Dequantize => {
            let f32_bytes = elements.saturating_mul(4);
            let scratch = f32_bytes.saturating_add(tokens * 8);
            (
                decode.saturating_add(scratch),
                f32_bytes + f32_bytes / 64 + 1024,
            )
        }
    }
}

/// Run `op` over whole arrays (tensor arrays already checked to be LargeBinary) within
/// `budget`.
pub(super) fn evaluate(
    op: Op,
    kinds: &[TensorKind],
    arrays: &[ArrayRef],
    info: &RowInfo<'_>,
    budget: &QueryBudget,
) -> Result<ArrayRef> {
    let name = info.function;
    let col = info.columns[0].as_str();
    let t = arrays[0].as_binary::<i64>();
    let k = kinds[0];
    let rows = t.len();
    let mut buf = Vec::new();
    let mut raw = Vec::new();
    let mut held = Holding::new(budget, name);
    // Tokens of row i of the first tensor argument, checked, with what the row will hold
    // admitted before anything is decoded.
    let mut admit = |i: usize| -> Result<usize> {
        let tokens = k
            .expect_tokens(t.value(i), info.seq_len(0, i))
            .map_err(|e| info.bad(0, col, i, e))?;
        let (buffers, result) = row_cost(op, k, tokens);
        held.row(i, buffers, result)?;
        Ok(tokens)
    };
    // Decode row i of the first tensor argument into `buf`, checking its length.
    let mut decode = |i: usize, buf: &mut Vec<f32>| -> Result<usize> {
        let tokens = admit(i)?;
        k.decode_tokens_into(t.value(i), Some(tokens), &mut raw, buf)
            .map_err(|e| info.bad(0, col, i, e))
    };
    macro_rules! per_row_f64 {
        ($f:expr) => {{
            let mut b = Float64Builder::with_capacity(rows);
            for i in 0..rows {
                if t.is_null(i) {
                    b.append_null();
                    continue;
                }
                decode(i, &mut buf)?;
                b.append_option($f(&buf));
            }
            Arc::new(b.finish()) as ArrayRef
        }};
    }
    Ok(match op {
        Op::Shape => {
            let mut b = ListBuilder::new(UInt64Builder::new());
            for i in 0..rows {
                if t.is_null(i) {
                    b.append_null();
                    continue;
                }
                let tokens = admit(i)?;
                b.values().append_value(tokens as u64);
                b.values().append_value(k.hidden as u64);
                b.append(true);
            }
            Arc::new(b.finish())
        }
        Op::Norm => per_row_f64!(|v: &[f32]| tensor::mean_norm(v, k.hidden)),
        Op::MaxAbs => per_row_f64!(tensor::max_abs),
        Op::Mean => per_row_f64!(|v: &[f32]| tensor::mean_std(v).map(|m| m.0)),
        Op::Std => per_row_f64!(|v: &[f32]| tensor::mean_std(v).map(|m| m.1)),
        Op::NanCount | Op::InfCount => {
            let mut b = UInt64Builder::with_capacity(rows);
            for i in 0..rows {
                if t.is_null(i) {
                    b.append_null();
                    continue;
                }
                decode(i, &mut buf)?;
                let n = if op == Op::NanCount {
                    buf.iter().filter(|v| v.is_nan()).count()
                } else {
                    buf.iter().filter(|v| v.is_infinite()).count()
                };
                b.append_value(n as u64);
            }
            Arc::new(b.finish())
        }
        Op::TokenNorms => {
            let mut b = ListBuilder::new(Float64Builder::new());
            for i in 0..rows {
                if t.is_null(i) {
                    b.append_null();
                    continue;
                }
                decode(i, &mut buf)?;
                for row in buf.chunks_exact(k.hidden) {
                    b.values().append_value(tensor::row_norm(row));
                }
                b.append(true);
            }
            Arc::new(b.finish())
        }
        Op::Cosine => {
            let u = arrays[1].as_binary::<i64>();
            let ku = kinds[1];
            let (mut other, mut other_raw) = (Vec::new(), Vec::new());
            let mut b = Float64Builder::with_capacity(rows);
            for i in 0..rows {
                if t.is_null(i) || u.is_null(i) {
                    b.append_null();
                    continue;
                }
                let ta = decode(i, &mut buf)?;
                let tb = ku
                    .decode_tokens_into(u.value(i), info.seq_len(1, i), &mut other_raw, &mut other)
                    .map_err(|e| info.bad(1, &info.columns[1], i, e))?;
                if ta != tb {
                    return exec_err!("{name}: row {i} has {ta} tokens in argument 1 and {tb} in argument 2; expected equal token counts");
                }
                b.append_option(tensor::mean_cosine(&buf, &other, k.hidden));
            }
            Arc::new(b.finish())
        }
        Op::TokenVector => {
            let idx = datafusion::arrow::compute::cast(&arrays[1], &DataType::Int64)?;
            let idx = idx.as_primitive::<Int64Type>();
            let mut b = ListBuilder::new(Float32Builder::new());
            for i in 0..rows {
                if t.is_null(i) || idx.is_null(i) {
                    b.append_null();
                    continue;
                }
                let tokens = decode(i, &mut buf)?;
                let j = idx.value(i);
                // Out of range gives NULL, like indexing past the end of an array in SQL.
                if j < 0 || j as usize >= tokens {
                    b.append_null();
                    continue;
                }
                let j = j as usize;
                b.values()
                    .append_slice(&buf[j * k.hidden..(j + 1) * k.hidden]);
                b.append(true);
            }
            Arc::new(b.finish())
        }
        Op::Dequantize => {
            let s = arrays[1].as_binary::<i64>();
            let sk = TensorKind {
                dtype: DType::F32,
                hidden: 1,
            };
            let (mut scales, mut scale_raw) = (Vec::new(), Vec::new());
            let mut b = LargeBinaryBuilder::with_capacity(rows, 0);
            for i in 0..rows {
                if t.is_null(i) || s.is_null(i) {
                    b.append_null();
                    continue;
                }
                let tokens = decode(i, &mut buf)?;
                if let Err(e) =
                    sk.decode_tokens_into(s.value(i), Some(tokens), &mut scale_raw, &mut scales)
                {
                    let scale_col = format!("{col}'s scales");
                    return Err(info.bad(
                        0,
                        &scale_col,
                        i,
                        format!("{e} (one f32 scale per token)"),
                    ));
                }
                for (row, sc) in buf.chunks_exact_mut(k.hidden).zip(&scales) {
                    row.iter_mut().for_each(|v| *v *= sc);
                }
                match tensor::encode_f32(&buf) {
                    Ok(v) => b.append_value(v),
                    Err(e) => return exec_err!("{name}: row {i}: {e}"),
                }
            }
            Arc::new(b.finish())
        }
    })
}

#[cfg(test)]
mod tests {
    use hslake_schemas::DType;

    /// Samples 0 and 1 of 8 tokens; sample 1's layer_1 value is valid zstd whose frames claim
    /// 1000 tokens, as in a poisoned shard.
    async fn poisoned_dataset(url: &str) {
        use hslake_schemas::{CapturePoint, DatasetSchema, Sample, TensorData};
        use hslake_store::{encode_sample, Dataset, DatasetWriter, Provenance, WriterOptions};
        let points = vec![CapturePoint::LayerOutput(1)];
        let schema =
            DatasetSchema::new("m", "LlamaForCausalLM", 64, 2, 100, DType::Bf16, points).unwrap();
        let ds = Dataset::create(url, schema.clone(), Provenance::default())
            .await
            .unwrap();
        let opts = WriterOptions::default();
        let mut w = DatasetWriter::new(&ds, opts).await.unwrap();
        for id in 0..2u64 {
            let s = Sample {
                sample_id: id,
                input_ids: vec![1; 8],
                loss_mask: vec![1; 8],
                tensors: vec![TensorData::from_bf16_bits(&[0x3f80; 8 * 64], vec![8, 64])],
            };
            let mut enc = encode_sample(&schema, &opts, &s).unwrap().unwrap();
            if id == 1 {
                let claim = vec![0u8; 1000 * 64 * 2];
                enc.tensors[0] = hslake_store::format::planes::encode(
                    &claim,
                    2,
                    1,
                    Some(hslake_store::format::planes::ValueChecksum::DEFAULT),
                )
                .unwrap();
            }
            w.append_encoded(Some(enc)).await.unwrap();
        }
        w.commit().await.unwrap();
    }

    #[tokio::test]
    async fn tensor_functions_refuse_a_value_that_claims_more_tokens_than_its_row() {
        poisoned_dataset("memory://udf-poisoned").await;
        let session = crate::QuerySession::open("memory://udf-poisoned", None)
            .await
            .unwrap();
        for f in ["tensor_shape", "tensor_max_abs", "token_norms"] {
            let sql = format!("SELECT {f}(layer_1) FROM samples WHERE sample_id = 1");
            let err = session.query(&sql).await.unwrap_err().to_string();
            // The function sees the value apart from its file; the error names the file, row
            // group and row the session found for the sample.
            assert!(
                err.starts_with(&format!("{f}: memory://udf-poisoned/data/"))
                    && err.contains(
                        ".parquet: row group 0: row 1 (sample 1) layer_1: \
                         expected shape [8, 64] of bf16, got [1000, 64]"
                    ),
                "{sql}: {err}"
            );
        }
        let b = session
            .query("SELECT tensor_shape(layer_1) AS s FROM samples WHERE sample_id = 0")
            .await
            .unwrap();
        let text = datafusion::arrow::util::pretty::pretty_format_batches(&b)
            .unwrap()
            .to_string();
        assert!(text.contains("[8, 64]"), "{text}");
    }
}
