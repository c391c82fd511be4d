//! The last check before a query runs: no growing built-in escaped its cap, and no constant
//! is too large to be copied into every row of a batch.
use std::sync::Arc;

use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::execution::memory_pool::MemoryLimit;
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::{expressions, PhysicalExpr, ScalarFunctionExpr};
use datafusion::physical_plan::ExecutionPlan;

use super::growth_of;
use super::wrapper::is_capped;
use crate::budget::{human_size, QueryBudget};
use crate::limits::{MEMORY_FLAG, VALUE_FLAG};
use crate::QueryError;

/// Constants up to this size are always allowed, whatever the memory limit: SQL text rarely
/// holds more, and a limit set very low for a test should not refuse ordinary literals.
const SMALL_CONSTANT: usize = 64 << 10;

/// Refuse a physical plan in which a growing built-in escaped its cap (a bug), or that holds a
/// constant too large to copy into every row of a batch: DataFusion expands a constant to a
/// full column wherever a column is needed (`SELECT repeat('x', 100000000) FROM samples`
/// folds into one 100 MB constant, then makes it 8192 rows of a batch), outside any function
/// and outside the memory pool. The limit is the per-value cap, and the query's memory split
/// over a batch's rows where that is less, but never below [`SMALL_CONSTANT`].
pub fn check_plan(
    plan: &Arc<dyn ExecutionPlan>,
    budget: &QueryBudget,
    batch_size: usize,
) -> std::result::Result<(), QueryError> {
    let per_row = budget
        .pool()
        .map_or(usize::MAX, |_| budget_memory(budget) / batch_size.max(1));
    let max_constant = budget.max_value().min(per_row).max(SMALL_CONSTANT);
    let mut found = None;
    plan.apply(|node| {
        node.apply_expressions(&mut |root| {
            root.apply(|e| {
                if let Some(problem) = escaped_growth(e.as_ref())
                    .or_else(|| large_constant(e.as_ref(), max_constant, batch_size, budget))
                {
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

/// The query's memory limit, as its pool reports it.
fn budget_memory(budget: &QueryBudget) -> usize {
    match budget.pool().map(|p| p.memory_limit()) {
        Some(MemoryLimit::Finite(n)) => n,
        _ => usize::MAX,
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

fn large_constant(
    e: &dyn PhysicalExpr,
    max: usize,
    batch_size: usize,
    budget: &QueryBudget,
) -> Option<QueryError> {
    let value = e.downcast_ref::<expressions::Literal>()?.value();
    let bytes = value.size();
    (bytes > max).then(|| {
        let (limit, setting) = if max == budget.max_value() {
            (format!("{} per value", human_size(max as u64)), VALUE_FLAG)
        } else {
            (
                format!("{} per query", human_size(budget_memory(budget) as u64)),
                MEMORY_FLAG,
            )
        };
        QueryError::Limit {
            what: format!(
                "query refused: it holds a constant of {}, which DataFusion copies into each \
                 row of a batch (up to {batch_size} rows); at most {} is allowed",
                human_size(bytes as u64),
                human_size(max as u64)
            ),
            limit,
            setting: setting.into(),
            detail: String::new(),
        }
    })
}
