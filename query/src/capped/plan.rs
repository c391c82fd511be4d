//! The last check before a query runs: no growing built-in escaped its cap, and no constant
//! is too large to be copied into every row of a batch.
use std::sync::Arc;

use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::{expressions, PhysicalExpr, ScalarFunctionExpr};
use datafusion::physical_plan::ExecutionPlan;

use super::growth_of;
use super::wrapper::is_capped;
use crate::budget::QueryBudget;
use crate::QueryError;

/// Refuse a physical plan in which a growing built-in escaped its cap (a bug), or that holds a
/// constant too large to copy into every row of a batch: DataFusion expands a constant to a
/// full column wherever a column is needed (`SELECT '<100 MB of text>' FROM samples` makes it
/// 8192 rows of a batch), outside any function and outside the memory pool. A call on
/// constants is folded into one only up to the same size, and checked so when it runs
/// ([`super::CappedFn`]). The limit is the per-value cap, and the query's memory split
/// over a batch's rows where that is less, but never below [`crate::budget::SMALL_CONSTANT`]
/// ([`QueryBudget::max_constant`]).
pub fn check_plan(
    plan: &Arc<dyn ExecutionPlan>,
    budget: &QueryBudget,
    batch_size: usize,
) -> std::result::Result<(), QueryError> {
    let mut found = None;
    plan.apply(|node| {
        node.apply_expressions(&mut |root| {
            root.apply(|e| {
                if let Some(problem) = escaped_growth(e.as_ref()).or_else(|| {
                    let value = e.downcast_ref::<expressions::Literal>()?.value();
                    let what = "query refused: it holds a constant";
                    budget
                        .check_constant(what, value.size() as u64, batch_size)
                        .err()
                }) {
                    found = Some(problem);
                    return Ok(TreeNodeRecursion::Stop);
                }
                Ok(TreeNodeRecursion::Continue)
            })
        })
    })?;
    match found {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

fn escaped_growth(e: &dyn PhysicalExpr) -> Option<QueryError> {
    let name = if let Some(f) = e.downcast_ref::<ScalarFunctionExpr>() {
        let f = f.fun();
        (growth_of(f.name()).is_some() && !is_capped(f)).then(|| f.name().to_string())
    } else if let Some(b) = e.downcast_ref::<expressions::BinaryExpr>() {
        (*b.op() == Operator::StringConcat).then(|| "||".to_string())
    } else {
        None
    }?;
    Some(QueryError::Sql(
        datafusion::error::DataFusionError::Internal(format!(
            "{name} reached the query plan without its size check; refused (a bug in hslake: \
         report the query)"
        )),
    ))
}
