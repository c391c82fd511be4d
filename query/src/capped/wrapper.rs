//! The capped form of a growing built-in, and the rewrite that caps the calls the SQL
//! planner makes itself, `a || b` among them.
use std::sync::Arc;

use datafusion::arrow::datatypes::{DataType, Field, FieldRef, Schema};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::{DFSchema, DataFusionError, Result, ScalarValue};
use datafusion::logical_expr::binary::BinaryTypeCoercer;
use datafusion::logical_expr::expr::ScalarFunction;
use datafusion::logical_expr::expr_rewriter::FunctionRewrite;
use datafusion::logical_expr::interval_arithmetic::Interval;
use datafusion::logical_expr::preimage::PreimageResult;
use datafusion::logical_expr::simplify::{ExprSimplifyResult, SimplifyContext};
use datafusion::logical_expr::sort_properties::{ExprProperties, SortProperties};
use datafusion::logical_expr::{
    BinaryExpr, ColumnarValue, Documentation, Expr, ExpressionPlacement, Operator, ReturnFieldArgs,
    ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl, Signature, StructFieldMapping, Volatility,
};
use datafusion::physical_expr::{expressions, PhysicalExpr};

use super::growth::Growth;
use super::sizes::scalar_bytes;
use super::{growth_of, CONCAT_OPERATOR};
use crate::budget::{holding, QueryBudget};

pub(super) fn is_capped(f: &ScalarUDF) -> bool {
    f.inner().is::<CappedFn>()
}

/// `f` wrapped in its check, if it is a growing built-in not yet wrapped.
pub(super) fn capped(f: &Arc<ScalarUDF>) -> Option<ScalarUDF> {
    let growth = growth_of(f.name())?;
    (!is_capped(f)).then(|| {
        ScalarUDF::new_from_impl(CappedFn {
            inner: f.clone(),
            growth,
        })
    })
}

/// A built-in that can grow its result, checking each call's result size before it runs.
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct CappedFn {
    inner: Arc<ScalarUDF>,
    growth: Growth,
}

impl CappedFn {
    fn inner(&self) -> &dyn ScalarUDFImpl {
        self.inner.inner().as_ref()
    }
}

impl ScalarUDFImpl for CappedFn {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn aliases(&self) -> &[String] {
        self.inner.aliases()
    }

    fn schema_name(&self, args: &[Expr]) -> Result<String> {
        self.inner().schema_name(args)
    }

    fn signature(&self) -> &Signature {
        self.inner.signature()
    }

    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        self.inner().return_type(arg_types)
    }

    fn with_updated_config(&self, config: &ConfigOptions) -> Option<ScalarUDF> {
        let updated = Arc::new(self.inner().with_updated_config(config)?);
        capped(&updated)
    }

    fn return_field_from_args(&self, args: ReturnFieldArgs) -> Result<FieldRef> {
        self.inner().return_field_from_args(args)
    }

    fn is_strict(&self) -> bool {
        self.inner().is_strict()
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let budget = QueryBudget::of(&args.config_options);
        let bound = self.growth.bound(&args.args, args.number_rows)?;
        if args
            .args
            .iter()
            .all(|a| matches!(a, ColumnarValue::Scalar(_)))
        {
            // A call on constants builds one constant, which DataFusion may copy into each row
            // of a batch: of the batch it is called for, or, folded while the plan is made, of
            // any batch. A fold refused here is left in the plan and runs with the query.
            let rows = if budget.is_folding() {
                args.config_options.execution.batch_size.get()
            } else {
                args.number_rows
            };
            let what = format!("query stopped: {} would build a constant", self.name());
            budget
                .check_constant(&what, bound.largest, rows)
                .map_err(|e| DataFusionError::External(Box::new(e)))?;
        }
        let held = budget.admit(self.name(), bound)?;
        let out = self.inner().invoke_with_args(args)?;
        Ok(match (out, held) {
            (ColumnarValue::Array(a), Some(reservation)) => {
                ColumnarValue::Array(holding(a, reservation)?)
            }
            (out, _) => out,
        })
    }

    fn simplify(&self, args: Vec<Expr>, info: &SimplifyContext) -> Result<ExprSimplifyResult> {
        // A function may simplify by building a value from its constant arguments at once
        // (`concat` and `concat_ws` join their literals), outside `invoke_with_args`. Such a
        // value holds each constant at most once per argument (a separator between each
        // two); past what a folded constant may be the call stays as it is, and its
        // evaluation, which knows the exact size, decides.
        let constants: u64 = args
            .iter()
            .map(|a| match a {
                Expr::Literal(v, _) => scalar_bytes(v),
                _ => 0,
            })
            .sum();
        let joined = constants.saturating_mul(args.len() as u64);
        let config = info.config_options();
        let folded = QueryBudget::of(config).max_constant(config.execution.batch_size.get());
        if joined > folded as u64 {
            return Ok(ExprSimplifyResult::Original(args));
        }
        // It may also simplify into a call of a built-in it names itself (a new `concat`),
        // which must be capped too.
        Ok(match self.inner().simplify(args, info)? {
            ExprSimplifyResult::Simplified(e) => ExprSimplifyResult::Simplified(cap_all(e)?),
            original => original,
        })
    }

    fn preimage(
        &self,
        args: &[Expr],
        lit: &Expr,
        info: &SimplifyContext,
    ) -> Result<PreimageResult> {
        self.inner().preimage(args, lit, info)
    }

    fn short_circuits(&self) -> bool {
        self.inner().short_circuits()
    }

    fn conditional_arguments<'a>(
        &self,
        args: &'a [Expr],
    ) -> Option<(Vec<&'a Expr>, Vec<&'a Expr>)> {
        self.inner().conditional_arguments(args)
    }

    fn evaluate_bounds(&self, input: &[&Interval]) -> Result<Interval> {
        self.inner().evaluate_bounds(input)
    }

    fn propagate_constraints(
        &self,
        interval: &Interval,
        inputs: &[&Interval],
    ) -> Result<Option<Vec<Interval>>> {
        self.inner().propagate_constraints(interval, inputs)
    }

    fn output_ordering(&self, inputs: &[ExprProperties]) -> Result<SortProperties> {
        self.inner().output_ordering(inputs)
    }

    fn preserves_lex_ordering(&self, inputs: &[ExprProperties]) -> Result<bool> {
        self.inner().preserves_lex_ordering(inputs)
    }

    fn strictly_order_preserving(&self, inputs: &[ExprProperties]) -> Result<bool> {
        self.inner().strictly_order_preserving(inputs)
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> Result<Vec<DataType>> {
        self.inner().coerce_types(arg_types)
    }

    fn struct_field_mapping(
        &self,
        literal_args: &[Option<ScalarValue>],
    ) -> Option<StructFieldMapping> {
        self.inner().struct_field_mapping(literal_args)
    }

    fn documentation(&self) -> Option<&Documentation> {
        self.inner().documentation()
    }

    fn placement(&self, args: &[ExpressionPlacement]) -> ExpressionPlacement {
        self.inner().placement(args)
    }
}

/// `e` with every growing built-in call in it capped, and every `a || b` made a capped call.
fn cap_all(e: Expr) -> Result<Expr> {
    Ok(e.transform_up(cap_one)?.data)
}

fn cap_one(e: Expr) -> Result<Transformed<Expr>> {
    Ok(match e {
        Expr::ScalarFunction(sf) => match capped(&sf.func) {
            Some(f) => Transformed::yes(Expr::ScalarFunction(ScalarFunction::new_udf(
                Arc::new(f),
                sf.args,
            ))),
            None => Transformed::no(Expr::ScalarFunction(sf)),
        },
        Expr::BinaryExpr(BinaryExpr {
            left,
            op: Operator::StringConcat,
            right,
        }) => {
            let op = Arc::new(ScalarUDF::new_from_impl(ConcatOperator::default()));
            let f = capped(&op).map(Arc::new).unwrap_or(op);
            Transformed::yes(Expr::ScalarFunction(ScalarFunction::new_udf(
                f,
                vec![*left, *right],
            )))
        }
        other => Transformed::no(other),
    })
}

/// Caps the built-in calls the SQL planner makes itself (`OVERLAY(s PLACING t FROM 2)` is
/// `overlay`, `[a, b]` is `make_array`, `a || b` on lists is `array_concat`), which do not go
/// through the registry, and turns `a || b` on text and bytes into [`CONCAT_OPERATOR`]. Runs
/// before type coercion, so the operator coerces its arguments as `||` does.
#[derive(Debug)]
pub struct CapRewrite;

impl FunctionRewrite for CapRewrite {
    fn name(&self) -> &str {
        "hslake_cap_builtins"
    }

    fn rewrite(
        &self,
        expr: Expr,
        _schema: &DFSchema,
        _config: &ConfigOptions,
    ) -> Result<Transformed<Expr>> {
        cap_one(expr)
    }
}

/// `a || b` on text or bytes as a function, so it can be capped: DataFusion's own operator
/// evaluated on the two arguments, with the operator's type rules.
#[derive(Debug, PartialEq, Eq, Hash)]
struct ConcatOperator {
    signature: Signature,
}

impl Default for ConcatOperator {
    fn default() -> Self {
        ConcatOperator {
            signature: Signature::user_defined(Volatility::Immutable),
        }
    }
}

impl ConcatOperator {
    fn types(arg_types: &[DataType]) -> Result<BinaryTypeCoercer<'_>> {
        match arg_types {
            [l, r] => Ok(BinaryTypeCoercer::new(l, &Operator::StringConcat, r)),
            other => datafusion::common::plan_err!(
                "{CONCAT_OPERATOR}: expected 2 arguments, got {}",
                other.len()
            ),
        }
    }
}

impl ScalarUDFImpl for ConcatOperator {
    fn name(&self) -> &str {
        CONCAT_OPERATOR
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        Self::types(arg_types)?.get_result_type()
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> Result<Vec<DataType>> {
        let (l, r) = Self::types(arg_types)?.get_input_types()?;
        Ok(vec![l, r])
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let constant = args
            .args
            .iter()
            .all(|a| matches!(a, ColumnarValue::Scalar(_)));
        let rows = if constant { 1 } else { args.number_rows };
        let arrays = args
            .args
            .iter()
            .map(|a| a.to_array(rows))
            .collect::<Result<Vec<_>>>()?;
        let fields: Vec<Field> = ["l", "r"]
            .iter()
            .zip(&arrays)
            .map(|(n, a)| Field::new(*n, a.data_type().clone(), true))
            .collect();
        let batch = RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays)?;
        let op = expressions::BinaryExpr::new(
            Arc::new(expressions::Column::new("l", 0)),
            Operator::StringConcat,
            Arc::new(expressions::Column::new("r", 1)),
        );
        let out = op.evaluate(&batch)?.into_array(rows)?;
        Ok(if constant {
            ColumnarValue::Scalar(ScalarValue::try_from_array(&out, 0)?)
        } else {
            ColumnarValue::Array(out)
        })
    }
}
