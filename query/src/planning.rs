//! Where and within which bounds a statement is planned.
//!
//! DataFusion's SQL planner, analyzer, optimizer and physical planner, our own rewrites, the
//! codec that sends plans to workers, and even dropping a plan recurse once per level of
//! nesting. A chain of 700 `+` or 450 `UNION ALL`s (10 KB of SQL) overflowed a tokio worker's
//! 2 MiB stack, and a stack overflow aborts the process: every client of `serve-sql` with it.
//! So each statement is planned
//! 1. only if its text is at most [`MAX_SQL_BYTES`]: the parser builds at most one level of
//!    nesting per token (its recursive descent is bounded by DataFusion's
//!    `sql_parser.recursion_limit` as well), so this bounds how deep the parser and the SQL
//!    planner recurse over the parsed statement;
//! 2. on a thread of its own whose stack, [`PLANNER_STACK`], holds that recursion several times
//!    over (tested below for the deepest statement of each kind);
//! 3. only if the parsed statement nests at most [`MAX_DEPTH`] levels (expressions, queries,
//!    unions; each table joined counts one) and its CTEs, expanded as the SQL planner expands
//!    them (it plans each use of a CTE as a copy, and walks each copy), come to at most
//!    [`MAX_EXPANDED_SQL_BYTES`] of SQL ([`check_statement`], a linear walk): the SQL planner's
//!    work grows with the square of a chain of `+` or joins (two minutes for 20,000 `+` in a
//!    debug build), and doubles at each link of a chain of CTEs that each use the one before
//!    twice, before a plan exists to measure;
//! 4. only if the logical plan the SQL planner makes, measured by a walk that does not recurse
//!    ([`PlanShape::of`]), nests at most [`MAX_DEPTH`] levels of plan steps, expressions and
//!    subqueries and holds at most [`MAX_NODES`] of them (a subplan counted once per use, and
//!    twice for each subquery around it: DataFusion checks each subquery again from every
//!    subquery that holds it, so 16 nested ones took minutes); checked before the analyzer,
//!    which is the first pass that recurses over the whole plan.
//!
//! The passes after the check recurse at most [`MAX_DEPTH`] levels, times the few levels they add
//! (casts, aliases), on the planner's thread. The physical plan they return runs and is dropped
//! on the caller's threads; at [`MAX_DEPTH`] it fits a 2 MiB tokio worker's stack (tested). A
//! statement over a limit is refused with [`QueryError::TooComplex`], naming the limit and its
//! own size, before anything recurses over it.
//!
//! Planning also counts against the query's time limit: the caller stops waiting at the
//! deadline and cancels the query, which stops its functions (a constant being folded) between
//! rows; the planner thread ends with the pass it is in, bounded by the limits above.
use std::future::Future;
use std::sync::Arc;

use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::error::DataFusionError;
use std::ops::ControlFlow;

use datafusion::logical_expr::{
    Aggregate, Distinct, DistinctOn, Expr, Filter, Join, Limit, LogicalPlan, Partitioning,
    Projection, Repartition, Sort, Statement, TableScan, Values, Window,
};
use datafusion::sql::parser::Statement as DFStatement;
use datafusion::sql::sqlparser::ast::{
    BinaryOperator, Expr as SqlExpr, ObjectName, Query, SetExpr, TableFactor, Visit, Visitor,
};
use tokio::sync::Semaphore;

use crate::limits::{Cancel, Deadline};
use crate::{QueryError, Result};

/// Bytes of SQL text one statement may have.
pub const MAX_SQL_BYTES: usize = 256 << 10;
/// Levels of nesting (plan steps, expressions, subqueries) one statement's plan may have.
pub const MAX_DEPTH: u64 = 1000;
/// Plan steps and expression nodes one statement's plan may hold, each subplan counted once per
/// use and twice for each subquery around it.
pub const MAX_NODES: u64 = 200_000;
/// Bytes of SQL one statement comes to with each use of a CTE replaced by the CTE's body.
pub const MAX_EXPANDED_SQL_BYTES: u64 = 1 << 20;
/// Levels one `||` adds to a statement's nesting. `||` is planned as a function call, whose
/// name DataFusion builds anew, copying its arguments' names, each time the optimizer names an
/// expression: planning a chain of n costs n^3 (400 `||`: 43 s in a debug build, 1000: over
/// ten minutes), where a chain of `+` costs n^2. So a chain of `||` may be a quarter as long.
const CONCAT_LEVELS: u64 = 4;
/// Stack of the thread that plans a statement. Only the part a plan uses is ever touched.
pub const PLANNER_STACK: usize = 256 << 20;

/// Refuse SQL text longer than [`MAX_SQL_BYTES`], before it is parsed.
pub fn check_sql_size(sql: &str) -> Result<()> {
    if sql.len() <= MAX_SQL_BYTES {
        return Ok(());
    }
    Err(QueryError::TooComplex {
        what: format!("its text is {} bytes long", sql.len()),
        limit: format!("{MAX_SQL_BYTES} bytes of SQL"),
    })
}

/// Refuse a parsed statement that nests deeper than [`MAX_DEPTH`] (expressions, queries,
/// unions, one level per table it joins), or that, each use of a CTE replaced by the CTE's
/// body, comes to more than [`MAX_EXPANDED_SQL_BYTES`] of SQL. The SQL planner's work grows
/// with the square of a chain of operators or joins (two minutes for 20,000 `+` in a debug
/// build) and with the expanded CTEs, so both are bounded before it starts.
pub fn check_statement(sql: &str, statement: &DFStatement) -> Result<()> {
    let mut shape = StatementShape {
        total: sql.len() as u64,
        ..StatementShape::default()
    };
    let mut statement = statement;
    while let DFStatement::Explain(e) = statement {
        statement = &e.statement;
    }
    if let DFStatement::Statement(s) = statement {
        let _ = s.visit(&mut shape);
    }
    let depth = shape.deepest.max(shape.relations);
    if depth > MAX_DEPTH {
        return Err(too_deep(depth));
    }
    if shape.total <= MAX_EXPANDED_SQL_BYTES {
        return Ok(());
    }
    Err(QueryError::TooComplex {
        what: format!(
            "with each use of a CTE replaced by its body (as it is planned), it comes to {} \
             bytes of SQL",
            shape.total
        ),
        limit: format!("{MAX_EXPANDED_SQL_BYTES} bytes of SQL with its CTEs expanded"),
    })
}

fn too_deep(depth: u64) -> QueryError {
    QueryError::TooComplex {
        what: format!(
            "it nests {depth} levels deep (operators, function calls, subqueries, unions, joins \
             and CTEs each add one, `||` {CONCAT_LEVELS})"
        ),
        limit: format!("{MAX_DEPTH} levels"),
    }
}

/// How deep a parsed statement nests, how many tables it names, and how much SQL its CTE uses
/// stand for, one query (scope) at a time.
#[derive(Default)]
struct StatementShape {
    /// The statement's bytes, plus the expanded bytes of every use of a CTE (saturating).
    total: u64,
    /// The queries entered and not yet left, innermost last.
    scopes: Vec<Scope>,
    /// Expressions and queries around the node being visited.
    nesting: u64,
    /// The most `nesting` has been, a query's chain of unions included.
    deepest: u64,
    /// Tables, subqueries and CTEs named in FROM clauses.
    relations: u64,
}

/// Set operations chained in `e` (`a UNION ALL b UNION ALL c`: 2), down to the queries they join.
fn set_operations(e: &SetExpr) -> u64 {
    match e {
        SetExpr::SetOperation { left, right, .. } => {
            1 + set_operations(left).max(set_operations(right))
        }
        _ => 0,
    }
}

/// Levels of nesting `e` adds: [`CONCAT_LEVELS`] for `||`, one for any other expression.
fn levels(e: &SqlExpr) -> u64 {
    match e {
        SqlExpr::BinaryOp {
            op: BinaryOperator::StringConcat,
            ..
        } => CONCAT_LEVELS,
        _ => 1,
    }
}

/// A query being visited: the CTEs it defines and what the uses within it stand for.
struct Scope {
    /// Each CTE's name (lowercase: a CTE's name matches as the SQL planner's does, or more
    /// often), its body, and its expanded size once its body has been visited.
    ctes: Vec<(String, *const Query, Option<u64>)>,
    /// Expanded bytes of the CTE uses inside this query so far.
    uses: u64,
}

impl Visitor for StatementShape {
    type Break = ();

    fn pre_visit_expr(&mut self, e: &SqlExpr) -> ControlFlow<()> {
        self.nesting += levels(e);
        self.deepest = self.deepest.max(self.nesting);
        ControlFlow::Continue(())
    }

    fn post_visit_expr(&mut self, e: &SqlExpr) -> ControlFlow<()> {
        self.nesting = self.nesting.saturating_sub(levels(e));
        ControlFlow::Continue(())
    }

    fn pre_visit_table_factor(&mut self, _: &TableFactor) -> ControlFlow<()> {
        self.relations += 1;
        ControlFlow::Continue(())
    }

    fn pre_visit_query(&mut self, query: &Query) -> ControlFlow<()> {
        self.nesting += 1;
        let unions = set_operations(&query.body);
        self.deepest = self.deepest.max(self.nesting + unions);
        let ctes = query.with.iter().flat_map(|w| &w.cte_tables);
        self.scopes.push(Scope {
            ctes: ctes
                .map(|c| {
                    (
                        c.alias.name.value.to_lowercase(),
                        &*c.query as *const Query,
                        None,
                    )
                })
                .collect(),
            uses: 0,
        });
        ControlFlow::Continue(())
    }

    fn post_visit_query(&mut self, query: &Query) -> ControlFlow<()> {
        self.nesting = self.nesting.saturating_sub(1);
        let Some(done) = self.scopes.pop() else {
            return ControlFlow::Continue(());
        };
        if let Some(parent) = self.scopes.last_mut() {
            match parent.ctes.iter_mut().find(|c| std::ptr::eq(c.1, query)) {
                // A CTE's body: each later use stands for its text and the uses in it.
                Some(cte) => {
                    cte.2 = Some((query.to_string().len() as u64).saturating_add(done.uses))
                }
                None => parent.uses = parent.uses.saturating_add(done.uses),
            }
        }
        ControlFlow::Continue(())
    }

    fn pre_visit_relation(&mut self, relation: &ObjectName) -> ControlFlow<()> {
        let [part] = relation.0.as_slice() else {
            return ControlFlow::Continue(());
        };
        let Some(name) = part.as_ident().map(|i| i.value.to_lowercase()) else {
            return ControlFlow::Continue(());
        };
        // The innermost CTE of that name already visited; one still being visited (a
        // recursive CTE naming itself) is planned once.
        let size = self
            .scopes
            .iter()
            .rev()
            .find_map(|s| s.ctes.iter().find(|c| c.0 == name && c.2.is_some()))
            .and_then(|c| c.2);
        if let (Some(size), Some(scope)) = (size, self.scopes.last_mut()) {
            scope.uses = scope.uses.saturating_add(size);
            self.total = self.total.saturating_add(size);
        }
        ControlFlow::Continue(())
    }
}

/// How deep and how large a logical plan is, counting plan steps, expression nodes and the
/// plans of subqueries together.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlanShape {
    /// Nodes on the longest path from the root down.
    pub depth: u64,
    /// Nodes in all, a subplan used twice counted twice, a node inside n subqueries 2^n times
    /// (saturating).
    pub nodes: u64,
}

impl PlanShape {
    /// The shape of `plan`, by a walk with a stack of its own (not the thread's), which measures
    /// each shared subplan once.
    pub fn of(plan: &LogicalPlan) -> PlanShape {
        let mut measured: std::collections::HashMap<*const LogicalPlan, PlanShape> =
            Default::default();
        let mut stack = vec![Frame::new(Node::Plan(plan))];
        loop {
            let Some(top) = stack.last_mut() else {
                return PlanShape::default();
            };
            if let Some(child) = top.children.pop() {
                match child.plan().and_then(|p| measured.get(&(p as *const _))) {
                    Some(shape) => top.add(shape.inside(child)),
                    None => stack.push(Frame::new(child)),
                }
                continue;
            }
            let Some(done) = stack.pop() else {
                return PlanShape::default();
            };
            let shape = PlanShape {
                depth: done.below.depth + 1,
                nodes: done.below.nodes.saturating_add(1),
            };
            if let Some(p) = done.node.plan() {
                measured.insert(p as *const _, shape);
            }
            match stack.last_mut() {
                Some(parent) => parent.add(shape.inside(done.node)),
                None => return shape,
            }
        }
    }

    /// This shape as it counts where `node` uses it: a subquery's nodes twice, since
    /// DataFusion's check of subqueries walks each subquery again from every subquery that
    /// holds it (`check_subquery_expr`), on every analyzer and optimizer pass.
    fn inside(self, node: Node) -> PlanShape {
        let weight = if matches!(node, Node::Subquery(_)) {
            2
        } else {
            1
        };
        PlanShape {
            nodes: self.nodes.saturating_mul(weight),
            ..self
        }
    }

    /// Refuse a plan deeper than [`MAX_DEPTH`] or larger than [`MAX_NODES`].
    pub fn check(&self) -> Result<()> {
        if self.depth > MAX_DEPTH {
            return Err(too_deep(self.depth));
        }
        if self.nodes > MAX_NODES {
            return Err(QueryError::TooComplex {
                what: format!(
                    "its plan holds {} steps and expressions (a CTE counts once per use, one \
                     inside n subqueries 2^n times)",
                    self.nodes
                ),
                limit: format!("{MAX_NODES} of them"),
            });
        }
        Ok(())
    }
}

/// A node of the combined tree of plan steps and expressions.
#[derive(Clone, Copy)]
enum Node<'a> {
    Plan(&'a LogicalPlan),
    /// The plan of a subquery, below the expression that holds it.
    Subquery(&'a LogicalPlan),
    Expr(&'a Expr),
}

impl<'a> Node<'a> {
    fn plan(self) -> Option<&'a LogicalPlan> {
        match self {
            Node::Plan(p) | Node::Subquery(p) => Some(p),
            Node::Expr(_) => None,
        }
    }
}

/// A node being measured: the children still to measure, and what those measured so far add.
struct Frame<'a> {
    node: Node<'a>,
    children: Vec<Node<'a>>,
    below: PlanShape,
}

impl<'a> Frame<'a> {
    fn new(node: Node<'a>) -> Self {
        let mut children = Vec::new();
        match node {
            Node::Plan(p) | Node::Subquery(p) => {
                children.extend(p.inputs().into_iter().map(Node::Plan));
                expressions(p, &mut children);
            }
            Node::Expr(e) => {
                let _ = e.apply_children(|c| {
                    children.push(Node::Expr(c));
                    Ok(TreeNodeRecursion::Continue)
                });
                if let Some(plan) = subquery(e) {
                    children.push(Node::Subquery(plan));
                }
            }
        }
        Frame {
            node,
            children,
            below: PlanShape::default(),
        }
    }

    fn add(&mut self, child: PlanShape) {
        self.below.depth = self.below.depth.max(child.depth);
        self.below.nodes = self.below.nodes.saturating_add(child.nodes);
    }
}

/// The plan of the subquery `e` holds, if any.
fn subquery(e: &Expr) -> Option<&LogicalPlan> {
    match e {
        Expr::ScalarSubquery(s) => Some(&s.subquery),
        Expr::Exists(e) => Some(&e.subquery.subquery),
        Expr::InSubquery(i) => Some(&i.subquery.subquery),
        Expr::SetComparison(c) => Some(&c.subquery.subquery),
        _ => None,
    }
}

/// The expressions of plan step `p` (not of its inputs), borrowed for as long as the plan: what
/// [`LogicalPlan::apply_expressions`] visits, except the few it copies first (a range
/// partitioning's order, an extension's, an unnest's columns), which SQL over our tables does
/// not plan. Every variant is named, so that DataFusion adding one fails to build here.
fn expressions<'a>(p: &'a LogicalPlan, out: &mut Vec<Node<'a>>) {
    let mut add = |e: &'a Expr| out.push(Node::Expr(e));
    match p {
        LogicalPlan::Projection(Projection { expr, .. }) => expr.iter().for_each(add),
        LogicalPlan::Values(Values { values, .. }) => values.iter().flatten().for_each(add),
        LogicalPlan::Filter(Filter { predicate, .. }) => add(predicate),
        LogicalPlan::Repartition(Repartition {
            partitioning_scheme,
            ..
        }) => match partitioning_scheme {
            Partitioning::Hash(expr, _) | Partitioning::DistributeBy(expr) => {
                expr.iter().for_each(add)
            }
            _ => {}
        },
        LogicalPlan::Window(Window { window_expr, .. }) => window_expr.iter().for_each(add),
        LogicalPlan::Aggregate(Aggregate {
            group_expr,
            aggr_expr,
            ..
        }) => group_expr.iter().chain(aggr_expr).for_each(add),
        LogicalPlan::Join(Join { on, filter, .. }) => {
            for (l, r) in on {
                add(l);
                add(r);
            }
            filter.iter().for_each(add);
        }
        LogicalPlan::Sort(Sort { expr, .. }) => expr.iter().map(|s| &s.expr).for_each(add),
        LogicalPlan::TableScan(TableScan { filters, .. }) => filters.iter().for_each(add),
        LogicalPlan::Distinct(Distinct::On(DistinctOn {
            on_expr,
            select_expr,
            sort_expr,
            ..
        })) => {
            on_expr.iter().chain(select_expr).for_each(&mut add);
            sort_expr.iter().flatten().map(|s| &s.expr).for_each(add);
        }
        LogicalPlan::Limit(Limit { skip, fetch, .. }) => {
            skip.iter().chain(fetch).map(|e| e.as_ref()).for_each(add)
        }
        LogicalPlan::Statement(Statement::Execute(e)) => e.parameters.iter().for_each(add),
        LogicalPlan::Statement(_)
        | LogicalPlan::Extension(_)
        | LogicalPlan::Unnest(_)
        | LogicalPlan::Dml(_)
        | LogicalPlan::EmptyRelation(_)
        | LogicalPlan::RecursiveQuery(_)
        | LogicalPlan::Subquery(_)
        | LogicalPlan::SubqueryAlias(_)
        | LogicalPlan::Analyze(_)
        | LogicalPlan::Explain(_)
        | LogicalPlan::Union(_)
        | LogicalPlan::Distinct(Distinct::All(_))
        | LogicalPlan::Ddl(_)
        | LogicalPlan::Copy(_)
        | LogicalPlan::DescribeTable(_) => {}
    }
}

/// Runs planning work on threads of [`PLANNER_STACK`], a bounded number at a time.
#[derive(Debug, Clone)]
pub(crate) struct Planner {
    slots: Arc<Semaphore>,
}

impl Default for Planner {
    fn default() -> Self {
        // As many as queries may run in a server by default: planning is short, and a caller
        // waiting for a slot waits within its own deadline.
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        Planner {
            slots: Arc::new(Semaphore::new((2 * cores).max(4))),
        }
    }
}

impl Planner {
    /// Run `work` on a planner thread of its own, inside the caller's tokio runtime, and wait
    /// for its result until `deadline`; past it, set `cancel` and answer the time limit's
    /// error. Whatever the work leaves (a refused plan, a result nobody waits for) is dropped
    /// on that thread, whose stack holds it.
    pub(crate) async fn run<T, F>(
        &self,
        deadline: Option<Deadline>,
        cancel: &Cancel,
        work: F,
    ) -> Result<T>
    where
        T: Send + 'static,
        F: Future<Output = Result<T>> + Send + 'static,
    {
        let handle = tokio::runtime::Handle::current();
        let slots = self.slots.clone();
        let planned = async move {
            let slot = slots.acquire_owned().await.map_err(|_| {
                QueryError::Sql(DataFusionError::Internal("planner slots closed".into()))
            })?;
            let (tx, rx) = tokio::sync::oneshot::channel();
            std::thread::Builder::new()
                .name("hslake-plan".into())
                .stack_size(PLANNER_STACK)
                .spawn(move || {
                    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        handle.block_on(work)
                    }))
                    .unwrap_or_else(|panic| Err(planner_panicked(panic.as_ref())));
                    // Sent back, or dropped here if the caller stopped waiting.
                    let _ = tx.send(result);
                    drop(slot);
                })
                .map_err(|e| {
                    QueryError::Sql(DataFusionError::ResourcesExhausted(format!(
                        "cannot start a thread to plan the query: {e}"
                    )))
                })?;
            rx.await.map_err(|_| {
                QueryError::Sql(DataFusionError::Internal(
                    "the planner thread ended without an answer".into(),
                ))
            })?
        };
        match deadline {
            None => planned.await,
            Some(d) => match tokio::time::timeout_at(d.at.into(), planned).await {
                Ok(result) => result,
                Err(_) => {
                    cancel.cancel();
                    Err(crate::limits::timeout_error(d.limit))
                }
            },
        }
    }
}

/// A panic while planning, as the error of that query alone.
fn planner_panicked(panic: &(dyn std::any::Any + Send)) -> QueryError {
    let message = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "no message".into());
    QueryError::Sql(DataFusionError::Internal(format!(
        "planning the query panicked: {message}"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{testdata, QuerySession};

    /// `kind`'s statement nesting one level more per `n`.
    fn nested(kind: &str, n: usize) -> String {
        let chain = |head: &str, unit: &str, tail: &str| format!("{head}{}{tail}", unit.repeat(n));
        match kind {
            "plus" => chain("SELECT 1", "+1", ""),
            "and" => chain("SELECT true", " AND true", ""),
            "concat" => chain("SELECT 'a'", "||'a'", ""),
            "union" => chain("SELECT 1 AS x", " UNION ALL SELECT 1", ""),
            "array_type" => chain("SELECT CAST(NULL AS INT", "[]", ")"),
            "join" | "comma" => {
                let unit = if kind == "join" {
                    " JOIN samples s"
                } else {
                    ",samples s"
                };
                let on = if kind == "join" { " ON true" } else { "" };
                let joined: String = (1..=n).map(|i| format!("{unit}{i}{on}")).collect();
                format!("SELECT 1 FROM samples s0{joined}")
            }
            "columns" => chain("SELECT 1", ",1", ""),
            "in_list" => chain("SELECT 1 FROM samples WHERE sample_id IN (1", ",1", ")"),
            "generic_type" => {
                format!(
                    "SELECT CAST(NULL AS {}INT{})",
                    "ARRAY<".repeat(n),
                    ">".repeat(n)
                )
            }
            "cte" | "cte_subquery" | "cte_double" => {
                let mut s = String::from("WITH a0 AS (SELECT 1 AS x)");
                for i in 1..=n {
                    let p = i - 1;
                    s.push_str(&match kind {
                        "cte" => format!(",a{i} AS (SELECT x FROM a{p})"),
                        "cte_subquery" => format!(",a{i} AS (SELECT (SELECT x FROM a{p}) AS x)"),
                        _ => format!(",a{i} AS (SELECT x FROM a{p} UNION ALL SELECT x FROM a{p})"),
                    });
                }
                format!("{s} SELECT x FROM a{n}")
            }
            other => panic!("no kind {other}"),
        }
    }

    /// The longest [`nested`] statement of `kind` within `bytes` bytes.
    fn deep(kind: &str, bytes: usize) -> String {
        let (empty, thousand) = (nested(kind, 0).len(), nested(kind, 1000).len());
        let mut n = bytes.saturating_sub(empty) * 1000 / (thousand - empty);
        loop {
            let sql = nested(kind, n);
            if sql.len() <= bytes || n == 0 {
                return sql;
            }
            n -= n / 100 + 1;
        }
    }

    /// The most deeply nested statement of `kind` that `s` plans, or nearly: the depth ten more
    /// levels of `kind` add, measured on a small statement, give the size to try first, and a
    /// few steps down reach one under the limits (a search would plan dozens of statements).
    async fn deepest_planned(s: &QuerySession, kind: &str) -> String {
        let depth = |n: usize| async move {
            PlanShape::of(s.sql(&nested(kind, n)).await.unwrap().logical_plan()).depth
        };
        // Ten levels: a CTE inside subqueries counts 2^n nodes.
        let (d0, d10) = (depth(0).await, depth(10).await);
        let mut n = ((MAX_DEPTH - d0) * 10 / (d10 - d0).max(1)).min(MAX_DEPTH) as usize;
        loop {
            match s.sql(&nested(kind, n)).await {
                Ok(_) => return nested(kind, n),
                Err(QueryError::TooComplex { .. }) if n > 0 => n -= 1 + n / 50,
                Err(e) => panic!("{kind} at {n}: {e}"),
            }
        }
    }

    /// Bytes of stack this thread has touched: the resident part of the mapping that holds it.
    fn stack_resident() -> usize {
        let here = &0u8 as *const u8 as usize;
        let maps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in maps.lines() {
            let first = line.split_whitespace().next().unwrap_or("");
            if let Some((a, b)) = first.split_once('-') {
                if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
                {
                    inside = a <= here && here < b;
                    continue;
                }
            }
            if inside && line.starts_with("Rss:") {
                let kib: usize = line.split_whitespace().nth(1).unwrap().parse().unwrap();
                return kib << 10;
            }
        }
        panic!("no mapping holds the stack")
    }

    async fn session(name: &str) -> QuerySession {
        let url = format!("memory://{name}");
        testdata::write(&url, hslake_schemas::DType::Bf16, 4, 1).await;
        QuerySession::open(&url, None).await.unwrap()
    }

    /// Kinds of statement whose plan nests one level deeper per few bytes, each a different
    /// way to nest without the parser recursing.
    const KINDS: &[&str] = &[
        "plus",
        "and",
        "concat",
        "union",
        "join",
        "comma",
        "cte",
        "cte_subquery",
    ];

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn refuses_a_statement_nested_deeper_than_the_limit_by_name_and_plans_the_next() {
        // Before: 3000 `+` overflowed the stack of the thread planning it, and the process
        // aborted.
        let s = session("plan-deep").await;
        for kind in KINDS {
            let e = s.query(&deep(kind, 40_000)).await.unwrap_err();
            assert!(matches!(e, QueryError::TooComplex { .. }), "{kind}: {e}");
            let text = e.to_string();
            // Too deep, or (a chain of CTEs each holding the one before) too large expanded.
            assert!(
                (text.starts_with("query refused: it nests ")
                    && text.ends_with(
                        "; a query may have at most 1000 levels (a fixed limit of hslake's SQL \
                         planner)"
                    ))
                    || text.ends_with("bytes of SQL with its CTEs expanded (a fixed limit of hslake's SQL planner)"),
                "{kind}: {text}"
            );
            let n = s.query("SELECT count(*) FROM samples").await.unwrap();
            assert_eq!(n[0].num_rows(), 1);
        }
    }

    #[tokio::test]
    async fn a_chain_of_concat_may_be_a_quarter_as_deep() {
        // Before, 998 `||` were under the limit, and took over ten minutes to plan (debug
        // build), holding a planner thread after the query's time limit had passed.
        let s = session("plan-concat").await;
        let e = s.sql(&nested("concat", 250)).await.unwrap_err().to_string();
        assert!(
            e.starts_with("query refused: it nests 1002 levels deep"),
            "{e}"
        );
        s.sql(&nested("concat", 240)).await.unwrap();
    }

    #[tokio::test]
    async fn refuses_sql_longer_than_the_limit_and_ctes_that_expand_past_theirs() {
        let s = session("plan-large").await;
        let long = format!("SELECT 1{}", " ".repeat(MAX_SQL_BYTES));
        let e = s.query(&long).await.unwrap_err().to_string();
        assert_eq!(
            e,
            format!(
                "query refused: its text is {} bytes long; a query may have at most 262144 \
                 bytes of SQL (a fixed limit of hslake's SQL planner)",
                long.len()
            )
        );
        // Each CTE uses the one before twice: before, the SQL planner walked 2^40 copies of
        // the first (and took 20 GB in 5 minutes, unfinished).
        let doubling = deep("cte_double", 2_400);
        let e = s.query(&doubling).await.unwrap_err().to_string();
        assert!(
            e.starts_with("query refused: with each use of a CTE replaced by its body")
                && e.contains(
                    "; a query may have at most 1048576 bytes of SQL with its CTEs expanded"
                ),
            "{e}"
        );
        // 20 subqueries nested through CTEs, a few hundred plan nodes: DataFusion's check of
        // subqueries walks the innermost 2^20 times (before: minutes at 16). Refused by the
        // plan's node count, as a wide CTE used many times is (the count per use: below).
        let e = s
            .query(&nested("cte_subquery", 20))
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("(a CTE counts once per use, one inside n subqueries 2^n times)"),
            "{e}"
        );
        // The parser's own limit on its recursion is named as one too.
        let nested = format!("SELECT {}1{}", "(".repeat(60), ")".repeat(60));
        let e = s.query(&nested).await.unwrap_err().to_string();
        assert!(e.contains("more than 50 levels deep"), "{e}");
    }

    #[tokio::test]
    async fn measures_depth_and_nodes_over_expressions_subqueries_and_shared_subplans() {
        let s = session("plan-shape").await;
        let shape = |sql: &'static str| {
            let s = &s;
            async move { PlanShape::of(s.sql(sql).await.unwrap().logical_plan()) }
        };
        // Projection > (1 + 2) > 1, and the empty relation below the projection.
        assert_eq!(
            shape("SELECT 1 + 2").await,
            PlanShape { depth: 3, nodes: 5 }
        );
        // The subquery's plan hangs below the expression that holds it: the outer projection
        // and the subquery add two levels.
        // Its nodes count twice.
        let (sub, plain) = (
            shape("SELECT (SELECT 1 + 2)").await,
            shape("SELECT 1 + 2").await,
        );
        assert_eq!(sub.depth, 2 + plain.depth);
        assert_eq!(sub.nodes, 3 + 2 * plain.nodes);
        // A CTE used twice counts twice, though its plan is one.
        let once = shape("WITH a AS (SELECT 1 + 2 AS x) SELECT x FROM a").await;
        let twice =
            shape("WITH a AS (SELECT 1 + 2 AS x) SELECT x FROM a UNION ALL SELECT x FROM a").await;
        assert!(twice.nodes > 2 * once.nodes - 2, "{once:?} {twice:?}");
    }

    #[tokio::test]
    async fn planning_counts_against_the_time_limit() {
        // Before, the limit started with execution: this plan, under the depth limit, takes
        // far longer than a millisecond to make, and the query was answered.
        let mut s = session("plan-time").await;
        s.set_limits(crate::QueryLimits {
            timeout: Some(std::time::Duration::from_millis(1)),
            ..crate::QueryLimits::default()
        });
        let e = s.query(&deep("plus", 1_800)).await.unwrap_err().to_string();
        assert!(
            e.starts_with("query stopped: it ran longer than one query may run"),
            "{e}"
        );
    }

    /// Plan `sql` as [`QuerySession::execute`] does, on a thread with `stack` bytes of stack,
    /// and say how much of the stack it used; the plan is dropped there too.
    fn stack_used(s: &QuerySession, sql: &str, stack: usize) -> (String, usize) {
        let handle = tokio::runtime::Handle::current();
        let state = s.context().state();
        let budget = crate::budget::QueryBudget::new(&s.limits(), None, Cancel::default());
        let batch = crate::batching::BATCH_BYTES;
        let work = crate::session::physical_plan(state, sql.to_string(), budget, None, batch);
        std::thread::scope(|scope| {
            std::thread::Builder::new()
                .stack_size(stack)
                .spawn_scoped(scope, || {
                    let outcome = match handle.block_on(work) {
                        Ok(_) => "planned".to_string(),
                        Err(e) => e.to_string(),
                    };
                    (outcome, stack_resident())
                })
                .unwrap()
                .join()
                .unwrap()
        })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_deepest_statements_plan_within_a_quarter_of_the_planner_stack() {
        let s = session("plan-stack").await;
        let mut worst = (0, "");
        for kind in KINDS
            .iter()
            .chain(&["array_type", "generic_type", "columns", "in_list"])
        {
            // At the size limit (refused: too deep), and just under the depth limit; joins at a
            // tenth of it, what their plan adds to the stack counted ten times: the SQL
            // planner's work grows with the square of a chain of joins (a minute for 250 in a
            // debug build).
            // Lists (columns, IN) do not nest: only their size is tried.
            let mut tried = vec![(deep(kind, MAX_SQL_BYTES), 1)];
            match *kind {
                "join" | "comma" => tried.push((nested(kind, MAX_DEPTH as usize / 10), 10)),
                "columns" | "in_list" => {}
                _ => tried.push((deepest_planned(&s, kind).await, 1)),
            }
            let mut base = None;
            for (sql, scale) in tried {
                let (outcome, used) = stack_used(&s, &sql, PLANNER_STACK);
                let base = *base.get_or_insert(used);
                let used = base + used.saturating_sub(base) * scale;
                eprintln!(
                    "{kind} ({} bytes): {} KiB: {outcome:.80}",
                    sql.len(),
                    used >> 10
                );
                if used > worst.0 {
                    worst = (used, kind);
                }
            }
        }
        assert!(
            worst.0 < PLANNER_STACK / 4,
            "{} used {} KiB",
            worst.1,
            worst.0 >> 10
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_query_at_the_depth_limit_runs_on_a_tokio_worker_stack() {
        // The physical plan runs, and is dropped, where the caller polls it: here on the 2 MiB
        // stacks of this runtime's workers.
        let s = session("plan-run").await;
        let sum = format!(
            "SELECT {} AS x FROM samples",
            vec!["sample_id"; 990].join(" + ")
        );
        let b = tokio::spawn(async move { s.query(&sum).await })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(b.iter().map(|b| b.num_rows()).sum::<usize>(), 4);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore]
    async fn measure() {
        let s = session("plan-measure").await;
        let kinds = std::env::var("KINDS").unwrap();
        let sizes = std::env::var("SIZES").unwrap();
        for kind in kinds.split(',') {
            for bytes in sizes.split(',') {
                let sql = deep(kind, bytes.parse().unwrap());
                let t = std::time::Instant::now();
                let (outcome, used) = stack_used(&s, &sql, PLANNER_STACK);
                eprintln!(
                    "{kind} {bytes}: {:?} {} KiB {outcome:.90}",
                    t.elapsed(),
                    used >> 10
                );
            }
        }
    }
}
