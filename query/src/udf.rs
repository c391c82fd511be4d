//! SQL functions on tensor columns.
//!
//! A tensor column is `LargeBinary` whose field carries `hslake.tensor` metadata (dtype, shape
//! `[null, hidden]`, `plane_zstd` encoding). DataFusion hands the argument fields, metadata
//! included, both to planning (`return_field_from_args`) and to execution, so each function
//! checks its arguments while the query is planned and decodes with the dtype and width of the
//! very column it is given; no per-dataset state is needed and one session can mix datasets.
//!
//! fp8 tensors hold one f32 scale per token in a sibling column. [`TensorArgRewrite`] rewrites
//! `f(layer_30)` into `f(dequantize(layer_30, layer_30_scale))` while the plan still sees the
//! table's columns, so users never name the scale column themselves; it also hands each tensor
//! argument its row's `seq_len`, so a value whose frames claim another length is refused, and
//! its `sample_id`, so that a value that does not decode is named by sample
//! ([`QueryError::BadValue`]; the session adds its file and row group).
use std::any::Any;
use std::sync::Arc;

use datafusion::arrow::array::{
    Array, ArrayRef, AsArray, Float32Builder, Float64Builder, LargeBinaryBuilder, ListBuilder,
    UInt64Array, UInt64Builder,
};
use datafusion::arrow::datatypes::{DataType, Field, FieldRef, Int64Type, UInt64Type};
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::Transformed;
use datafusion::common::{
    exec_err, plan_datafusion_err, plan_err, DFSchema, DataFusionError, ExprSchema, Result,
    ScalarValue,
};
use datafusion::execution::FunctionRegistry;
use datafusion::logical_expr::expr::ScalarFunction;
use datafusion::logical_expr::expr_rewriter::FunctionRewrite;
use datafusion::logical_expr::{
    ColumnarValue, Expr, ReturnFieldArgs, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl, Signature,
    Volatility,
};
use datafusion::prelude::SessionContext;
use hslake_schemas::{DType, TensorFieldMeta, TENSOR_META_KEY};

use crate::error::BadTensorValue;
use crate::tensor::{self, TensorKind};
use crate::QueryError;

/// Names of every tensor function, for docs and help.
pub const FUNCTION_NAMES: [&str; 11] = [
    "tensor_shape",
    "tensor_norm",
    "tensor_max_abs",
    "tensor_mean",
    "tensor_std",
    "nan_count",
    "inf_count",
    "token_norms",
    "cosine_similarity",
    "token_vector",
    "dequantize",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Op {
    Shape,
    Norm,
    MaxAbs,
    Mean,
    Std,
    NanCount,
    InfCount,
    TokenNorms,
    Cosine,
    TokenVector,
    Dequantize,
}

impl Op {
    const ALL: [Op; 11] = [
        Op::Shape,
        Op::Norm,
        Op::MaxAbs,
        Op::Mean,
        Op::Std,
        Op::NanCount,
        Op::InfCount,
        Op::TokenNorms,
        Op::Cosine,
        Op::TokenVector,
        Op::Dequantize,
    ];

    fn name(self) -> &'static str {
        FUNCTION_NAMES[Op::ALL.iter().position(|&o| o == self).unwrap_or(0)]
    }

    fn arity(self) -> usize {
        match self {
            Op::Cosine | Op::TokenVector | Op::Dequantize => 2,
            _ => 1,
        }
    }

    /// Argument positions that must be tensor columns.
    fn tensor_args(self) -> &'static [usize] {
        match self {
            Op::Cosine => &[0, 1],
            _ => &[0],
        }
    }

    fn return_type(self) -> DataType {
        let list = |t| DataType::List(Arc::new(Field::new("item", t, true)));
        match self {
            Op::Shape => list(DataType::UInt64),
            Op::Norm | Op::MaxAbs | Op::Mean | Op::Std | Op::Cosine => DataType::Float64,
            Op::NanCount | Op::InfCount => DataType::UInt64,
            Op::TokenNorms => list(DataType::Float64),
            Op::TokenVector => list(DataType::Float32),
            Op::Dequantize => DataType::LargeBinary,
        }
    }
}

/// One tensor function; which one is chosen by `op`.
#[derive(Debug, PartialEq, Eq, Hash)]
struct TensorFn {
    op: Op,
    signature: Signature,
    /// Whether each tensor argument's row length (`seq_len`), then each one's `sample_id` (NULL
    /// where the query does not see them), follow the arguments; only [`TensorArgRewrite`]
    /// makes such calls.
    seq_lens: bool,
}

impl TensorFn {
    fn new(op: Op, seq_lens: bool) -> Self {
        let extra = if seq_lens {
            2 * op.tensor_args().len()
        } else {
            0
        };
        TensorFn {
            op,
            signature: Signature::any(op.arity() + extra, Volatility::Immutable),
            seq_lens,
        }
    }
}

/// Every tensor function as a DataFusion scalar UDF.
pub fn tensor_udfs() -> Vec<ScalarUDF> {
    Op::ALL
        .iter()
        .map(|&op| ScalarUDF::new_from_impl(TensorFn::new(op, false)))
        .collect()
}

/// Register every tensor function and the rewrite that completes their arguments.
pub fn register_tensor_functions(ctx: &SessionContext) -> Result<()> {
    for f in tensor_udfs() {
        ctx.register_udf(f);
    }
    ctx.state_ref()
        .write()
        .register_function_rewrite(Arc::new(TensorArgRewrite))?;
    Ok(())
}

/// A tensor argument as checked at planning time.
enum TensorArg {
    /// A typed NULL literal: the function returns NULL.
    Null,
    /// A tensor column of this kind.
    Tensor(TensorKind, TensorFieldMeta),
}

/// Check that `field` (argument `pos` of `func`) is a tensor column and return its kind.
/// The error names the function, the argument and what was expected.
fn tensor_arg(func: &str, pos: usize, field: &Field) -> std::result::Result<TensorArg, String> {
    let expected =
        "expected a tensor column (LargeBinary with hslake.tensor metadata, e.g. layer_30)";
    let what = format!("{func}: argument {} ({})", pos + 1, field.name());
    match field.data_type() {
        DataType::Null => return Ok(TensorArg::Null),
        DataType::LargeBinary => {}
        other => return Err(format!("{what} is {other}; {expected}")),
    }
    let Some(json) = field.metadata().get(TENSOR_META_KEY) else {
        return Err(format!(
            "{what} is LargeBinary without {TENSOR_META_KEY} metadata; {expected}"
        ));
    };
    let meta: TensorFieldMeta = serde_json::from_str(json)
        .map_err(|e| format!("{what}: unreadable {TENSOR_META_KEY} metadata: {e}"))?;
    if meta.shape.len() != 2 {
        return Err(format!(
            "{what} is a per-token scale column of shape [tokens]; {expected}"
        ));
    }
    let kind = TensorKind::from_meta(&meta).map_err(|e| format!("{what}: {e}"))?;
    Ok(TensorArg::Tensor(kind, meta))
}

/// The `hslake.tensor` metadata of a scale column, checked.
fn scale_arg(
    func: &str,
    pos: usize,
    field: &Field,
) -> std::result::Result<Option<TensorKind>, String> {
    let expected = "expected the tensor's per-token scale column (e.g. layer_30_scale)";
    let what = format!("{func}: argument {} ({})", pos + 1, field.name());
    match field.data_type() {
        DataType::Null => return Ok(None),
        DataType::LargeBinary => {}
        other => return Err(format!("{what} is {other}; {expected}")),
    }
    let meta: Option<TensorFieldMeta> = field
        .metadata()
        .get(TENSOR_META_KEY)
        .and_then(|j| serde_json::from_str(j).ok());
    match meta {
        Some(m) if m.shape.len() == 1 && m.dtype == DType::F32 => Ok(Some(
            TensorKind::from_meta(&m).map_err(|e| format!("{what}: {e}"))?,
        )),
        _ => Err(format!("{what} is not a scale column; {expected}")),
    }
}

impl TensorFn {
    /// Check the argument fields. An fp8 tensor whose scales live in another column is
    /// accepted while planning, since [`TensorArgRewrite`] wraps it in `dequantize` afterwards;
    /// at execution it means the rewrite could not apply, which is an error.
    fn check_args(
        &self,
        fields: &[FieldRef],
        executing: bool,
    ) -> std::result::Result<Vec<Option<TensorKind>>, String> {
        let name = self.op.name();
        let mut kinds = Vec::new();
        for &pos in self.op.tensor_args() {
            match tensor_arg(name, pos, &fields[pos])? {
                TensorArg::Null => kinds.push(None),
                TensorArg::Tensor(kind, meta) => {
                    if self.op == Op::Dequantize && kind.dtype != DType::Fp8E4m3 {
                        return Err(format!(
                            "{name}: argument 1 ({}) is {}; expected an fp8_e4m3 tensor column",
                            fields[0].name(),
                            kind.dtype
                        ));
                    }
                    if executing
                        && self.op != Op::Dequantize
                        && kind.dtype.has_scales()
                        && meta.scale_column.is_some()
                    {
                        // Only reachable when the rewrite could not see the scale column, e.g.
                        // the argument came out of a subquery that did not select it.
                        return Err(format!(
                            "{name}: argument {} ({}) is an fp8_e4m3 tensor whose per-token scales are in \
                             {}; select that column too, or call {name}(dequantize({}, {}))",
                            pos + 1,
                            fields[pos].name(),
                            meta.scale_column.as_deref().unwrap_or("?"),
                            fields[pos].name(),
                            meta.scale_column.as_deref().unwrap_or("?"),
                        ));
                    }
                    kinds.push(Some(kind));
                }
            }
        }
        if let (Op::Cosine, [Some(a), Some(b)]) = (self.op, kinds.as_slice()) {
            if a.hidden != b.hidden {
                return Err(format!(
                    "{name}: arguments have hidden sizes {} and {}; expected tensors of the same width",
                    a.hidden, b.hidden
                ));
            }
        }
        match self.op {
            Op::TokenVector => {
                let t = fields[1].data_type();
                if !(t.is_integer() || t == &DataType::Null) {
                    return Err(format!(
                        "{name}: argument 2 ({}) is {t}; expected an integer token index (0-based)",
                        fields[1].name()
                    ));
                }
            }
            Op::Dequantize => {
                scale_arg(name, 1, &fields[1])?;
            }
            _ => {}
        }
        Ok(kinds)
    }
}

impl ScalarUDFImpl for TensorFn {
    fn name(&self) -> &str {
        self.op.name()
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn return_type(&self, _arg_types: &[DataType]) -> Result<DataType> {
        Ok(self.op.return_type())
    }

    fn return_field_from_args(&self, args: ReturnFieldArgs) -> Result<FieldRef> {
        self.check_args(args.arg_fields, false)
            .map_err(|e| plan_datafusion_err!("{e}"))?;
        let mut field = Field::new(self.name(), self.op.return_type(), true);
        if self.op == Op::Dequantize {
            // The result is an f32 tensor of the same shape; describe it so other functions
            // (and clients) can read it.
            if let Some(json) = args.arg_fields[0].metadata().get(TENSOR_META_KEY) {
                if let Ok(mut meta) = serde_json::from_str::<TensorFieldMeta>(json) {
                    meta.dtype = DType::F32;
                    meta.scale_column = None;
                    let json =
                        serde_json::to_string(&meta).map_err(|e| plan_datafusion_err!("{e}"))?;
                    field = field.with_metadata([(TENSOR_META_KEY.to_string(), json)].into());
                }
            }
        }
        Ok(Arc::new(field))
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let name = self.op.name();
        let kinds = match self.check_args(&args.arg_fields, true) {
            Ok(k) => k,
            Err(e) => return exec_err!("{e}"),
        };
        let all_scalar = args
            .args
            .iter()
            .all(|a| matches!(a, ColumnarValue::Scalar(_)));
        let arrays: Vec<ArrayRef> = args
            .args
            .iter()
            .map(|a| a.to_array(args.number_rows))
            .collect::<Result<_>>()?;
        let (arrays, extra) = arrays.split_at(self.op.arity());
        let (lens, ids) = extra.split_at(extra.len() / 2);
        let out = if kinds.iter().any(Option::is_none)
            || arrays[1..].iter().any(|a| a.data_type() == &DataType::Null)
        {
            datafusion::arrow::array::new_null_array(&self.op.return_type(), args.number_rows)
        } else {
            let kinds: Vec<TensorKind> = kinds.into_iter().flatten().collect();
            let u64s = |a: &[ArrayRef]| {
                a.iter()
                    .map(|a| datafusion::arrow::compute::cast(a, &DataType::UInt64))
                    .collect::<std::result::Result<Vec<_>, _>>()
            };
            let (lens, ids) = (u64s(lens)?, u64s(ids)?);
            let prim = |a: &'_ [ArrayRef]| -> Vec<UInt64Array> {
                a.iter()
                    .map(|a| a.as_primitive::<UInt64Type>().clone())
                    .collect()
            };
            let rows = RowInfo {
                seq_lens: prim(&lens),
                sample_ids: prim(&ids),
                columns: self
                    .op
                    .tensor_args()
                    .iter()
                    .map(|&p| args.arg_fields[p].name().to_string())
                    .collect(),
                function: name,
            };
            evaluate(self.op, &kinds, arrays, &rows)?
        };
        if all_scalar {
            Ok(ColumnarValue::Scalar(ScalarValue::try_from_array(&out, 0)?))
        } else {
            Ok(ColumnarValue::Array(out))
        }
    }
}

/// What the rows of each tensor argument are, where the query sees it: their row lengths
/// (`seq_len`) and sample ids; and the names errors use.
struct RowInfo<'a> {
    seq_lens: Vec<UInt64Array>,
    sample_ids: Vec<UInt64Array>,
    /// The tensor arguments' column names.
    columns: Vec<String>,
    function: &'a str,
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

/// Run `op` over whole arrays (tensor arrays already checked to be LargeBinary).
fn evaluate(
    op: Op,
    kinds: &[TensorKind],
    arrays: &[ArrayRef],
    info: &RowInfo<'_>,
) -> Result<ArrayRef> {
    let name = info.function;
    let col = info.columns[0].as_str();
    let t = arrays[0].as_binary::<i64>();
    let k = kinds[0];
    let rows = t.len();
    let mut buf = Vec::new();
    let mut raw = Vec::new();
    // Decode row i of the first tensor argument into `buf`, checking its length.
    let mut decode = |i: usize, buf: &mut Vec<f32>| -> Result<usize> {
        k.decode_tokens_into(t.value(i), info.seq_len(0, i), &mut raw, buf)
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
                let tokens = k
                    .expect_tokens(t.value(i), info.seq_len(0, i))
                    .map_err(|e| info.bad(0, col, i, e))?;
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

/// Completes the arguments of every tensor function while the plan still sees the table's
/// columns:
/// - an fp8 tensor column `c` becomes `dequantize(c, <c's scale column>)`, so per-token scales
///   are always applied;
/// - each tensor argument gets its row's `seq_len` (from the table of the first column it
///   names), so the decoder refuses a value whose frames claim another length instead of
///   allocating for the claim. Where the query does not see `seq_len` (a tensor aliased
///   through a subquery), the argument gets NULL and the value's own header is used.
#[derive(Debug)]
pub struct TensorArgRewrite;

impl FunctionRewrite for TensorArgRewrite {
    fn name(&self) -> &str {
        "hslake_tensor_arg_rewrite"
    }

    fn rewrite(
        &self,
        expr: Expr,
        schema: &DFSchema,
        _config: &ConfigOptions,
    ) -> Result<Transformed<Expr>> {
        let Expr::ScalarFunction(sf) = &expr else {
            return Ok(Transformed::no(expr));
        };
        let Some(tf) = (sf.func.inner().as_ref() as &dyn Any).downcast_ref::<TensorFn>() else {
            return Ok(Transformed::no(expr));
        };
        if tf.seq_lens {
            return Ok(Transformed::no(expr));
        }
        let mut args = sf.args.clone();
        if tf.op != Op::Dequantize {
            for &pos in tf.op.tensor_args() {
                if let Some(deq) = with_scales(tf.op, pos, &args[pos], schema)? {
                    args[pos] = deq;
                }
            }
        }
        Ok(Transformed::yes(with_row_info(tf.op, args, schema)))
    }
}

/// `dequantize(c, <c's scale column>, seq_len)` for an fp8 tensor column `c` (argument `pos`
/// of `op`); `None` for any other argument.
fn with_scales(op: Op, pos: usize, arg: &Expr, schema: &DFSchema) -> Result<Option<Expr>> {
    let Expr::Column(c) = arg else {
        return Ok(None);
    };
    let Ok(field) = schema.field_from_column(c) else {
        return Ok(None);
    };
    let Some(meta) = field
        .metadata()
        .get(TENSOR_META_KEY)
        .and_then(|j| serde_json::from_str::<TensorFieldMeta>(j).ok())
    else {
        return Ok(None);
    };
    let Some(scale) = meta.scale_column.filter(|_| meta.dtype.has_scales()) else {
        return Ok(None);
    };
    let scale_col = datafusion::common::Column::new(c.relation.clone(), scale);
    if schema.field_from_column(&scale_col).is_err() {
        return plan_err!(
            "{}: argument {} ({}) is an fp8_e4m3 tensor whose per-token scales are in {}, which this \
             query does not see; select that column too, or call {}(dequantize({}, {}))",
            op.name(),
            pos + 1,
            c.name,
            scale_col.name,
            op.name(),
            c.name,
            scale_col.name
        );
    }
    let args = vec![Expr::Column(c.clone()), Expr::Column(scale_col)];
    Ok(Some(with_row_info(Op::Dequantize, args, schema)))
}

/// `op(args..., <seq_len of each tensor argument>, <sample_id of each tensor argument>)`.
fn with_row_info(op: Op, mut args: Vec<Expr>, schema: &DFSchema) -> Expr {
    for sibling in ["seq_len", "sample_id"] {
        for &pos in op.tensor_args() {
            let col = args[pos]
                .column_refs()
                .into_iter()
                .next()
                .map(|c| datafusion::common::Column::new(c.relation.clone(), sibling))
                .filter(|s| {
                    schema
                        .field_from_column(s)
                        .is_ok_and(|f| f.data_type().is_unsigned_integer())
                });
            args.push(match col {
                Some(s) => Expr::Column(s),
                None => Expr::Literal(ScalarValue::UInt64(None), None),
            });
        }
    }
    let f = Arc::new(ScalarUDF::new_from_impl(TensorFn::new(op, true)));
    Expr::ScalarFunction(ScalarFunction::new_udf(f, args))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_function_has_its_name() {
        let names: Vec<String> = tensor_udfs().iter().map(|f| f.name().to_string()).collect();
        assert_eq!(names, FUNCTION_NAMES);
    }

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

    #[test]
    fn non_tensor_argument_error_names_function_and_expected_kind() {
        let f = Field::new("seq_len", DataType::UInt32, false);
        let Err(e) = tensor_arg("tensor_norm", 0, &f) else {
            panic!("accepted a UInt32")
        };
        assert_eq!(
            e,
            "tensor_norm: argument 1 (seq_len) is UInt32; expected a tensor column \
             (LargeBinary with hslake.tensor metadata, e.g. layer_30)"
        );
    }
}
