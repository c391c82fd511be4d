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
use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, AsArray, UInt64Array};
use datafusion::arrow::datatypes::{DataType, Field, FieldRef, UInt64Type};
use datafusion::common::{exec_err, plan_datafusion_err, Result, ScalarValue};
use datafusion::execution::FunctionRegistry;
use datafusion::logical_expr::{
    ColumnarValue, ReturnFieldArgs, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl, Signature,
    Volatility,
};
use datafusion::prelude::SessionContext;
use hslake_schemas::{DType, TensorFieldMeta, TENSOR_META_KEY};

use crate::budget::QueryBudget;
use crate::tensor::TensorKind;

mod eval;
mod pins;
mod rewrite;

use eval::{evaluate, RowInfo};
use pins::Pins;
pub use rewrite::TensorArgRewrite;

/// Names of every tensor function, for docs and help.
pub const FUNCTION_NAMES: [&str; Op::ALL.len()] = {
    let mut names = [""; Op::ALL.len()];
    let mut i = 0;
    while i < names.len() {
        names[i] = Op::ALL[i].name();
        i += 1;
    }
    names
};

/// One tensor function; its SQL name is [`Op::name`].
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

    /// The function's name in SQL.
    const fn name(self) -> &'static str {
        match self {
            Op::Shape => "tensor_shape",
            Op::Norm => "tensor_norm",
            Op::MaxAbs => "tensor_max_abs",
            Op::Mean => "tensor_mean",
            Op::Std => "tensor_std",
            Op::NanCount => "nan_count",
            Op::InfCount => "inf_count",
            Op::TokenNorms => "token_norms",
            Op::Cosine => "cosine_similarity",
            Op::TokenVector => "token_vector",
            Op::Dequantize => "dequantize",
        }
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
    /// where the query does not see them), then the arguments' pinned metadata ([`Pins`]) follow
    /// the arguments; only [`TensorArgRewrite`] makes such calls.
    seq_lens: bool,
}

impl TensorFn {
    fn new(op: Op, seq_lens: bool) -> Self {
        let extra = if seq_lens {
            2 * op.tensor_args().len() + 1
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
    /// Whether a call with `n` arguments is one [`TensorArgRewrite`] completed: its own
    /// arguments, each tensor argument's `seq_len` and `sample_id`, and its [`Pins`] last.
    fn completed(&self, n: usize) -> std::result::Result<bool, String> {
        let own = self.op.arity();
        let full = own + 2 * self.op.tensor_args().len() + 1;
        match n {
            n if n == own => Ok(false),
            n if n == full => Ok(true),
            n => Err(format!(
                "{}: {n} arguments; expected {own} ({full} where hslake's rewrite completed the call)",
                self.op.name()
            )),
        }
    }

    /// The call's argument fields, each tensor field that lost its metadata on the way to a
    /// worker given what the call's pins say; `last` is the call's last argument, if a literal.
    fn call_fields(
        &self,
        fields: &[FieldRef],
        last: Option<&ScalarValue>,
    ) -> std::result::Result<Vec<FieldRef>, String> {
        if self.completed(fields.len())? {
            Ok(Pins::read(self.op.name(), last)?.fill(fields))
        } else {
            Ok(fields.to_vec())
        }
    }

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
        let last = args.scalar_arguments.last().copied().flatten();
        let fields = self
            .call_fields(args.arg_fields, last)
            .map_err(|e| plan_datafusion_err!("{e}"))?;
        self.check_args(&fields, false)
            .map_err(|e| plan_datafusion_err!("{e}"))?;
        let mut field = Field::new(self.name(), self.op.return_type(), true);
        if self.op == Op::Dequantize {
            // The result is an f32 tensor of the same shape; describe it so other functions
            // (and clients) can read it.
            if let Some(json) = fields[0].metadata().get(TENSOR_META_KEY) {
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
        let (values, last) = match self.completed(args.args.len()) {
            Ok(true) => args.args.split_at(args.args.len() - 1),
            Ok(false) => (args.args.as_slice(), &[][..]),
            Err(e) => return exec_err!("{e}"),
        };
        let last = match last.first() {
            Some(ColumnarValue::Scalar(v)) => Some(v),
            _ => None,
        };
        let kinds = match self
            .call_fields(&args.arg_fields, last)
            .and_then(|fields| self.check_args(&fields, true))
        {
            Ok(k) => k,
            Err(e) => return exec_err!("{e}"),
        };
        let all_scalar = values.iter().all(|a| matches!(a, ColumnarValue::Scalar(_)));
        let arrays: Vec<ArrayRef> = values
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
            let budget = QueryBudget::of(&args.config_options);
            evaluate(self.op, &kinds, arrays, &rows, budget)?
        };
        if all_scalar {
            Ok(ColumnarValue::Scalar(ScalarValue::try_from_array(&out, 0)?))
        } else {
            Ok(ColumnarValue::Array(out))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_function_has_its_name() {
        let names: Vec<String> = tensor_udfs().iter().map(|f| f.name().to_string()).collect();
        assert_eq!(names, FUNCTION_NAMES);
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
