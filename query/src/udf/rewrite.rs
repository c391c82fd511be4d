//! The rewrite that completes tensor functions' arguments while the plan still sees the
//! table's columns: fp8 scales, and each tensor argument's `seq_len` and `sample_id`.
use std::any::Any;
use std::sync::Arc;

use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::Transformed;
use datafusion::common::{plan_err, DFSchema, ExprSchema, Result, ScalarValue};
use datafusion::logical_expr::expr::ScalarFunction;
use datafusion::logical_expr::expr_rewriter::FunctionRewrite;
use datafusion::logical_expr::{Expr, ScalarUDF};
use hslake_schemas::{TensorFieldMeta, TENSOR_META_KEY};

use super::{Op, Pins, TensorFn};

/// Completes the arguments of every tensor function while the plan still sees the table's
/// columns:
/// - an fp8 tensor column `c` becomes `dequantize(c, <c's scale column>)`, so per-token scales
///   are always applied;
/// - each tensor argument gets its row's `seq_len` (from the table of the first column it
///   names), so the decoder refuses a value whose frames claim another length instead of
///   allocating for the claim. Where the query does not see `seq_len` (a tensor aliased
///   through a subquery), the argument gets NULL and the value's own header is used;
/// - last, what each argument's field says ([`Pins`]), for workers whose plans lose it.
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

/// `op(args..., <seq_len of each tensor argument>, <sample_id of each tensor argument>,
/// <the arguments' pins>)`.
fn with_row_info(op: Op, mut args: Vec<Expr>, schema: &DFSchema) -> Expr {
    let pins = Pins::of_args(&args, schema);
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
    args.push(pins.literal());
    let f = Arc::new(ScalarUDF::new_from_impl(TensorFn::new(op, true)));
    Expr::ScalarFunction(ScalarFunction::new_udf(f, args))
}
