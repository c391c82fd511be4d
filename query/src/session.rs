//! A DataFusion session over pinned dataset versions.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, BooleanArray, StringArray, UInt32Array, UInt64Array};
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::catalog::MemorySchemaProvider;
use datafusion::common::config::ConfigNonZeroUsize;
use datafusion::datasource::object_store::ObjectStoreUrl;
use datafusion::datasource::MemTable;
use datafusion::error::DataFusionError;
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::execution::{
    SendableRecordBatchStream, SessionState, SessionStateBuilder, TaskContext,
};
use datafusion::logical_expr::LogicalPlan;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::{DataFrame, SQLOptions, SessionContext};
use datafusion::sql::parser::{DFParserBuilder, Statement as DFStatement};
use datafusion::sql::sqlparser::ast::Statement;
use datafusion::sql::sqlparser::dialect::GenericDialect;
use datafusion::sql::sqlparser::parser::ParserError;
use futures::{StreamExt, TryStreamExt};
use hslake_store::{Dataset, DatasetReader, Manifest};

use crate::batching::{batch_rows, widest_row, BATCH_BYTES};
use crate::budget::QueryBudget;
use crate::limits::{Cancel, QueryLimits};
use crate::planning::{check_sql_size, check_statement, PlanShape, Planner};
use crate::table::{unpanicking, CountingStore, ScanSource, ShardFile, ShardTable};
use crate::udf::register_tensor_functions;
use crate::{QueryError, Result};

// Each registered dataset gets its own object-store URL (`hslake://ds<N>-<hex of its URL>`),
// unique in the process, so datasets on different stores never share a DataFusion store entry;
// a worker of a distributed query opens the store from the URL in the name.
static NEXT_STORE: AtomicUsize = AtomicUsize::new(0);

/// What a session knows about one registered dataset version.
#[derive(Debug, Clone)]
pub struct RegisteredDataset {
    /// SQL schema holding its tables (`None`: the default schema, tables unqualified).
    pub name: Option<String>,
    /// The dataset's canonical URL.
    pub url: String,
    /// The pinned version's manifest.
    pub manifest: Manifest,
    /// Counts bytes read from the dataset's store by queries.
    pub counter: Arc<CountingStore>,
    /// The dataset, for finding where a sample named in an error sits.
    pub dataset: Dataset,
}

/// A DataFusion session with hslake datasets registered as tables and the tensor functions
/// available. Every query is read-only.
///
/// For each dataset the session has three tables: `samples` (one row per sample, every
/// column of the shards, tensors included), `shards` (one row per shard file of the pinned
/// version) and `versions` (one row per committed version). A dataset registered without a
/// name has them unqualified; a named one has them in a schema of that name
/// (`kimi.samples`).
pub struct QuerySession {
    ctx: SessionContext,
    datasets: Vec<RegisteredDataset>,
    limits: QueryLimits,
    batch_bytes: usize,
    planner: Planner,
    /// Where its queries run, if not here.
    pub(crate) workers: Option<crate::distributed::Workers>,
}

impl QuerySession {
    /// An empty session with the tensor functions registered, and DataFusion's functions that
    /// can build large values capped.
    pub fn new() -> Result<Self> {
        Self::over(SessionStateBuilder::new().with_default_features())
    }

    /// A session over `builder` (default features, or a coordinator's planner) with our
    /// functions, limits and batching.
    pub(crate) fn over(builder: SessionStateBuilder) -> Result<Self> {
        let limits = QueryLimits::default();
        let budget = QueryBudget::new(&limits, None, Cancel::default());
        Ok(QuerySession {
            ctx: hslake_context(builder, budget)?,
            datasets: Vec::new(),
            limits,
            batch_bytes: BATCH_BYTES,
            planner: Planner::default(),
            workers: None,
        })
    }

    /// A session over one dataset version (`None`: the newest), tables unqualified.
    pub async fn open(url: &str, version: Option<u64>) -> Result<Self> {
        let mut s = QuerySession::new()?;
        let ds = Dataset::open(url).await?;
        s.add_dataset(None, &ds, version).await?;
        Ok(s)
    }

    /// Register a dataset version as tables `samples`, `shards`, `versions`, in the default
    /// schema (`name` = `None`) or in a schema called `name`.
    pub async fn add_dataset(
        &mut self,
        name: Option<&str>,
        dataset: &Dataset,
        version: Option<u64>,
    ) -> Result<()> {
        if let Some(n) = name {
            check_name(n)?;
            if self.datasets.iter().any(|d| d.name.as_deref() == Some(n)) {
                return Err(QueryError::BadName {
                    name: n.into(),
                    reason: "already registered".into(),
                });
            }
        } else if self.datasets.iter().any(|d| d.name.is_none()) {
            return Err(QueryError::BadName {
                name: String::new(),
                reason: "a default dataset is already registered".into(),
            });
        }
        let manifest = dataset.manifest(version).await?;
        let versions = versions_batch(dataset, manifest.version).await?;

        let counter = Arc::new(CountingStore::new(dataset.object_store()));
        let id = NEXT_STORE.fetch_add(1, Ordering::Relaxed);
        let store_url = ObjectStoreUrl::parse(crate::table::store_name(id, dataset.url()))?;
        self.ctx
            .register_object_store(store_url.as_ref(), counter.clone());

        let files: Vec<ShardFile> = manifest
            .shards
            .iter()
            .map(|s| ShardFile {
                path: dataset.object_path(&s.path),
                bytes: s.bytes,
                rows: s.rows,
                tokens: s.tokens,
                min_sample_id: s.min_sample_id,
                max_sample_id: s.max_sample_id,
            })
            .collect();
        let schema: SchemaRef = Arc::new(manifest.schema.to_arrow());
        let source = ScanSource {
            dataset_url: dataset.url().to_string(),
            store_url,
        };
        let samples = ShardTable::new(schema, source, files);
        let shards = MemTable::try_new(shards_schema(), vec![vec![shards_batch(&manifest)?]])?;
        let versions = MemTable::try_new(versions.schema(), vec![vec![versions]])?;

        let qualify = |t: &str| match name {
            Some(n) => format!("{n}.{t}"),
            None => t.to_string(),
        };
        if let Some(n) = name {
            let catalog = self.ctx.catalog("datafusion").ok_or_else(|| {
                QueryError::Sql(datafusion::error::DataFusionError::Internal(
                    "no default catalog".into(),
                ))
            })?;
            catalog.register_schema(n, Arc::new(MemorySchemaProvider::new()))?;
        }
        self.ctx
            .register_table(qualify("samples"), Arc::new(samples))?;
        self.ctx
            .register_table(qualify("shards"), Arc::new(shards))?;
        self.ctx
            .register_table(qualify("versions"), Arc::new(versions))?;
        tracing::debug!(
            url = dataset.url(),
            version = manifest.version,
            name,
            "registered dataset"
        );
        self.datasets.push(RegisteredDataset {
            name: name.map(str::to_string),
            url: dataset.url().to_string(),
            manifest,
            counter,
            dataset: dataset.clone(),
        });
        Ok(())
    }

    /// The DataFusion context, for anything this type does not wrap.
    pub fn context(&self) -> &SessionContext {
        &self.ctx
    }

    /// The registered datasets.
    pub fn datasets(&self) -> &[RegisteredDataset] {
        &self.datasets
    }

    /// Plan one read-only SQL statement. Statements that would write, create, alter or drop
    /// anything are refused before planning (checked on the parsed statement) and again by
    /// DataFusion's own verifier; so is one too long or nesting too deep to plan
    /// ([`crate::planning`]). Planning runs on a planner thread, within the query's time limit.
    pub async fn sql(&self, sql: &str) -> Result<DataFrame> {
        let state = self.ctx.state();
        let sql = sql.to_string();
        let (state, plan) = self
            .planner
            .run(self.limits.deadline(), &Cancel::default(), async move {
                let plan = logical_plan(&state, &sql).await?;
                Ok((state, plan))
            })
            .await?;
        Ok(DataFrame::new(state, plan))
    }

    /// Apply `limits` to every query run from now on (default: none but the per-value cap).
    pub fn set_limits(&mut self, limits: QueryLimits) {
        self.limits = limits;
        // The per-value cap also shows in `information_schema.df_settings`.
        self.ctx
            .state_ref()
            .write()
            .config_mut()
            .options_mut()
            .extensions
            .insert(QueryBudget::new(&limits, None, Cancel::default()));
    }

    /// The limits each query runs under.
    pub fn limits(&self) -> QueryLimits {
        self.limits
    }

    /// Bytes of rows each query's batches aim to hold (default [`BATCH_BYTES`]); queries over
    /// wide rows run in batches of fewer rows ([`crate::batching`]). Results do not change.
    pub fn set_batch_bytes(&mut self, bytes: usize) {
        self.batch_bytes = bytes;
    }

    /// Plan one read-only statement and start it under the session's limits: a memory pool of
    /// its own, the per-value cap and a deadline. Dropping the stream stops the query.
    pub async fn execute(&self, sql: &str) -> Result<SendableRecordBatchStream> {
        self.execute_cancellable(sql, Cancel::default()).await
    }

    /// [`Self::execute`], stopping also once `cancel` is set: functions of the query check it
    /// between rows, so it stops within a row's work even while a batch is being computed,
    /// before whoever drives the stream can drop it.
    pub async fn execute_cancellable(
        &self,
        sql: &str,
        cancel: Cancel,
    ) -> Result<SendableRecordBatchStream> {
        // The time limit counts from here: planning (constants folded) is part of the query.
        let deadline = self.limits.deadline();
        let pool = self.limits.memory_pool();
        let budget = QueryBudget::new(&self.limits, Some(pool.clone()), cancel.clone());
        let planned = physical_plan(
            self.ctx.state(),
            sql.to_string(),
            budget,
            self.workers.clone(),
            self.batch_bytes,
        );
        let (plan, state) = self.planner.run(deadline, &cancel, planned).await?;
        let runtime = RuntimeEnvBuilder::from_runtime_env(state.runtime_env())
            .with_memory_pool(pool)
            .build_arc()?;
        let task = Arc::new(TaskContext::from(&state).with_runtime(runtime));
        let stream = datafusion::physical_plan::execute_stream(plan, task)?;
        Ok(self.locating(self.limits.guard(unpanicking(stream), cancel, deadline)))
    }

    /// `stream` with each [`QueryError::BadValue`] it fails with completed by the file, row
    /// group and row that hold the sample: a tensor function sees values apart from their file,
    /// so it names the sample and this finds the rest (only on the error path).
    fn locating(&self, stream: SendableRecordBatchStream) -> SendableRecordBatchStream {
        let datasets: Arc<Vec<(Dataset, u64)>> = Arc::new(
            self.datasets
                .iter()
                .map(|d| (d.dataset.clone(), d.manifest.version))
                .collect(),
        );
        let schema = stream.schema();
        let located = stream.then(move |r| {
            let datasets = datasets.clone();
            async move {
                match r {
                    Ok(b) => Ok(b),
                    Err(e) => Err(locate_bad_value(e, &datasets).await),
                }
            }
        });
        Box::pin(RecordBatchStreamAdapter::new(schema, located))
    }

    /// Plan and run one statement under the session's limits, collecting every batch.
    pub async fn query(&self, sql: &str) -> Result<Vec<RecordBatch>> {
        Ok(self.execute(sql).await?.try_collect().await?)
    }

    /// Bytes read from every dataset's store by queries so far.
    pub fn bytes_read(&self) -> u64 {
        self.datasets.iter().map(|d| d.counter.bytes_read()).sum()
    }

    /// Read requests made by queries so far.
    pub fn read_requests(&self) -> u64 {
        self.datasets.iter().map(|d| d.counter.requests()).sum()
    }

    /// Set the read counters to zero.
    pub fn reset_counters(&self) {
        self.datasets.iter().for_each(|d| d.counter.reset());
    }
}

/// hslake's setup of a DataFusion session, the one for a coordinator, a single node and a
/// worker alike: the information schema, `budget` in the config (functions find their limits
/// there), the tensor functions and DataFusion's functions that can build large values capped.
/// `builder` brings the rest: default features, a distributed planner, a worker's runtime.
pub(crate) fn hslake_context(
    mut builder: SessionStateBuilder,
    budget: QueryBudget,
) -> Result<SessionContext> {
    let config = builder.config().get_or_insert_default();
    config.options_mut().catalog.information_schema = true;
    config.options_mut().extensions.insert(budget);
    // The SQL planner drops a subquery's ORDER BY with a rewrite of the whole subquery, run
    // again for each use of a CTE: a chain of CTEs that each use the one before twice made
    // it rewrite 2^n copies before hslake could measure the plan ([`crate::planning`]). A
    // sort kept in a subquery costs time under the query's limits, not correctness.
    config
        .options_mut()
        .sql_parser
        .enable_subquery_sort_elimination = false;
    let ctx = SessionContext::new_with_state(builder.build());
    register_tensor_functions(&ctx)?;
    crate::capped::register(&ctx)?;
    Ok(ctx)
}

/// `e` with the file, row group and row of the sample it names, if it is a
/// [`QueryError::BadValue`] of a sample exactly one registered dataset holds; otherwise `e`.
async fn locate_bad_value(e: DataFusionError, datasets: &[(Dataset, u64)]) -> DataFusionError {
    let Some(QueryError::BadValue(bad)) = (match e.find_root() {
        DataFusionError::External(inner) => inner.downcast_ref::<QueryError>(),
        _ => None,
    }) else {
        return e;
    };
    let (None, Some(id)) = (&bad.file, &bad.sample_id) else {
        return e;
    };
    let mut sites = Vec::new();
    for (ds, version) in datasets {
        let found = match DatasetReader::open(ds, Some(*version)).await {
            Ok(r) => r.locate_sample(*id).await,
            Err(err) => Err(err),
        };
        match found {
            Ok(Some(site)) => sites.push((ds.url().to_string(), site)),
            Ok(None) => {}
            Err(err) => tracing::warn!("cannot locate sample {id} named in an error: {err}"),
        }
    }
    let [(url, site)] = sites.as_slice() else {
        return e;
    };
    DataFusionError::External(Box::new(QueryError::BadValue(Box::new(
        crate::error::BadTensorValue {
            file: Some(format!("{url}/{}", site.path)),
            row_group: Some(site.row_group),
            row: Some(site.row),
            ..bad.as_ref().clone()
        },
    ))))
}

/// Parse `sql`, one read-only statement, and make its logical plan; a statement too long or
/// nesting too deep is refused before anything recurses over it ([`crate::planning`]). Runs on a
/// planner thread.
async fn logical_plan(state: &SessionState, sql: &str) -> Result<LogicalPlan> {
    check_sql_size(sql)?;
    let limit = state.config().options().sql_parser.recursion_limit.get();
    let statement = parse_read_only(sql, limit)?;
    check_statement(sql, &statement)?;
    let plan = state.statement_to_plan(statement).await?;
    PlanShape::of(&plan).check()?;
    SQLOptions::new()
        .with_allow_ddl(false)
        .with_allow_dml(false)
        .with_allow_statements(false)
        .verify_plan(&plan)?;
    Ok(plan)
}

/// The physical plan of `sql` under `budget` (and how the session state was left: batch size,
/// the budget in its config, the workers told the query's name), made on a planner thread.
pub(crate) async fn physical_plan(
    mut state: SessionState,
    sql: String,
    budget: QueryBudget,
    workers: Option<crate::distributed::Workers>,
    batch_bytes: usize,
) -> Result<(Arc<dyn ExecutionPlan>, SessionState)> {
    let plan = logical_plan(&state, &sql).await?;
    if let Some(workers) = &workers {
        workers.name_query(&mut state)?;
    }
    // Functions get the config the plan is made with, also those the optimizer evaluates to
    // fold constants: the config must hold the budget before, marked so that a folded
    // constant stays small enough to be copied into every row ([`QueryBudget::folding`]).
    state
        .config_mut()
        .options_mut()
        .extensions
        .insert(budget.folding());
    state.mark_start_execution();
    let plan = state.optimize(&plan)?;
    // Before physical planning: filters take their batch size when they are planned.
    let rows = batch_rows(widest_row(&plan)?, batch_bytes, state.config().batch_size());
    let options = state.config_mut().options_mut();
    options.execution.batch_size = ConfigNonZeroUsize::try_new(rows)?;
    options.extensions.insert(budget.clone());
    // The physical plan's functions get the config the execution props hold, a copy taken
    // when execution was marked: they must see the query's budget, not the folding one.
    state.execution_props_mut().config_options = Some(Arc::clone(state.config().options()));
    let plan = state
        .query_planner()
        .create_physical_plan(&plan, &state)
        .await?;
    crate::capped::check_plan(&plan, &budget, state.config().batch_size())?;
    Ok((plan, state))
}

fn check_name(n: &str) -> Result<()> {
    let ok = n
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && n.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if !ok {
        return Err(QueryError::BadName {
            name: n.into(),
            reason: "expected a lower-case SQL identifier (a-z, 0-9, _; not starting with a digit)"
                .into(),
        });
    }
    if ["public", "information_schema"].contains(&n) {
        return Err(QueryError::BadName {
            name: n.into(),
            reason: "reserved schema name".into(),
        });
    }
    Ok(())
}

/// Refuse anything but exactly one query-like statement, judged on the parsed statement.
pub fn check_read_only(sql: &str) -> Result<()> {
    parse_read_only(sql, DEFAULT_RECURSION_LIMIT).map(drop)
}

/// DataFusion's `sql_parser.recursion_limit` unless set otherwise.
const DEFAULT_RECURSION_LIMIT: usize = 50;

/// The one statement of `sql`, if it is query-like; the parser nests at most `recursion_limit`
/// levels of its recursive descent.
fn parse_read_only(sql: &str, recursion_limit: usize) -> Result<DFStatement> {
    let mut statements = DFParserBuilder::new(sql)
        .with_dialect(&GenericDialect {})
        .with_recursion_limit(recursion_limit)
        .build()
        .and_then(|mut p| p.parse_statements())
        .map_err(|e| parse_error(e, recursion_limit))?;
    if statements.len() != 1 {
        return Err(QueryError::Sql(DataFusionError::Plan(format!(
            "expected exactly one SQL statement, got {}",
            statements.len()
        ))));
    }
    let Some(statement) = statements.pop_front() else {
        return Err(QueryError::Sql(DataFusionError::Plan(
            "expected exactly one SQL statement, got 0".into(),
        )));
    };
    if read_only(&statement) {
        Ok(statement)
    } else {
        Err(QueryError::ReadOnly {
            statement: statement_kind(&statement),
        })
    }
}

/// A parser error, the parser's recursion limit named as the limit it is.
fn parse_error(e: DataFusionError, recursion_limit: usize) -> QueryError {
    match e.find_root() {
        DataFusionError::SQL(p, _) if matches!(**p, ParserError::RecursionLimitExceeded) => {
            QueryError::TooComplex {
                what: format!(
                    "it nests parentheses, subqueries or function calls more than \
                     {recursion_limit} levels deep"
                ),
                limit: format!("{recursion_limit} levels of nesting as the SQL parser reads it"),
            }
        }
        _ => QueryError::Sql(e),
    }
}

fn read_only(s: &DFStatement) -> bool {
    match s {
        DFStatement::Statement(s) => read_only_sql(s),
        DFStatement::Explain(e) => read_only(&e.statement),
        _ => false,
    }
}

fn read_only_sql(s: &Statement) -> bool {
    match s {
        Statement::Query(_)
        | Statement::ShowTables { .. }
        | Statement::ShowColumns { .. }
        | Statement::ShowFunctions { .. }
        | Statement::ShowVariable { .. }
        | Statement::ExplainTable { .. } => true,
        // EXPLAIN ANALYZE runs the statement, so the inner statement decides.
        Statement::Explain { statement, .. } => read_only_sql(statement),
        _ => false,
    }
}

/// The first keywords of a statement, for the refusal message (`CREATE TABLE`).
fn statement_kind(s: &DFStatement) -> String {
    let text = s.to_string();
    let words: Vec<&str> = text
        .split_whitespace()
        .take_while(|w| w.chars().all(|c| c.is_ascii_alphabetic()))
        .take(2)
        .collect();
    if words.is_empty() {
        "statement".into()
    } else {
        words.join(" ").to_uppercase()
    }
}

fn shards_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("version", DataType::UInt64, false),
        Field::new("path", DataType::Utf8, false),
        Field::new("bytes", DataType::UInt64, false),
        Field::new("rows", DataType::UInt64, false),
        Field::new("tokens", DataType::UInt64, false),
        Field::new("raw_bytes", DataType::UInt64, false),
        Field::new("min_sample_id", DataType::UInt64, false),
        Field::new("max_sample_id", DataType::UInt64, false),
        Field::new("crc32c", DataType::UInt32, false),
        Field::new("row_groups", DataType::UInt64, false),
    ]))
}

fn shards_batch(m: &Manifest) -> Result<RecordBatch> {
    let s = &m.shards;
    let u64s = |f: &dyn Fn(usize) -> u64| {
        Arc::new(UInt64Array::from_iter_values((0..s.len()).map(f))) as ArrayRef
    };
    let cols: Vec<ArrayRef> = vec![
        u64s(&|_| m.version),
        Arc::new(StringArray::from_iter_values(
            s.iter().map(|e| e.path.as_str()),
        )),
        u64s(&|i| s[i].bytes),
        u64s(&|i| s[i].rows),
        u64s(&|i| s[i].tokens),
        u64s(&|i| s[i].raw_bytes),
        u64s(&|i| s[i].min_sample_id),
        u64s(&|i| s[i].max_sample_id),
        Arc::new(UInt32Array::from_iter_values(s.iter().map(|e| e.crc32c))),
        u64s(&|i| s[i].row_groups.len() as u64),
    ];
    Ok(RecordBatch::try_new(shards_schema(), cols)?)
}

/// A version's manifest without its shards, and its shard, sample, token, byte and raw byte
/// counts.
type VersionRow = (Manifest, [u64; 5]);

/// One row per committed version; `pinned` marks the version the session reads.
async fn versions_batch(ds: &Dataset, pinned: u64) -> Result<RecordBatch> {
    // The history as stored (a version before a repair may name a shard twice: counted once),
    // each version's shards dropped once counted, so that memory holds one manifest at a time.
    let mut manifests: Vec<VersionRow> = Vec::new();
    for v in ds.versions().await? {
        let mut m = ds.manifest_as_stored(Some(v)).await?;
        let counts = [
            m.shards.len() as u64,
            m.num_samples(),
            m.num_tokens(),
            m.bytes(),
            m.raw_bytes(),
        ];
        m.shards = Vec::new();
        manifests.push((m, counts));
    }
    let schema = Arc::new(Schema::new(vec![
        Field::new("version", DataType::UInt64, false),
        Field::new("parent", DataType::UInt64, true),
        Field::new("committed_at", DataType::Utf8, false),
        Field::new("shards", DataType::UInt64, false),
        Field::new("samples", DataType::UInt64, false),
        Field::new("tokens", DataType::UInt64, false),
        Field::new("bytes", DataType::UInt64, false),
        Field::new("raw_bytes", DataType::UInt64, false),
        Field::new("pinned", DataType::Boolean, false),
    ]));
    let u64s = |f: &dyn Fn(&VersionRow) -> u64| {
        Arc::new(UInt64Array::from_iter_values(manifests.iter().map(f))) as ArrayRef
    };
    let cols: Vec<ArrayRef> = vec![
        u64s(&|(m, _)| m.version),
        Arc::new(UInt64Array::from_iter(
            manifests.iter().map(|(m, _)| m.parent),
        )),
        Arc::new(StringArray::from_iter_values(
            manifests.iter().map(|(m, _)| m.committed_at.as_str()),
        )),
        u64s(&|(_, c)| c[0]),
        u64s(&|(_, c)| c[1]),
        u64s(&|(_, c)| c[2]),
        u64s(&|(_, c)| c[3]),
        u64s(&|(_, c)| c[4]),
        Arc::new(BooleanArray::from_iter(
            manifests.iter().map(|(m, _)| Some(m.version == pinned)),
        )),
    ];
    Ok(RecordBatch::try_new(schema, cols)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_statements_that_write_or_create() {
        for sql in [
            "CREATE TABLE t AS SELECT 1",
            "INSERT INTO samples VALUES (1)",
            "DROP TABLE samples",
            "COPY (SELECT 1) TO '/tmp/x.parquet'",
            "CREATE EXTERNAL TABLE t STORED AS PARQUET LOCATION '/tmp/x'",
            "CREATE VIEW v AS SELECT 1",
            "SET datafusion.execution.batch_size = 1",
            "EXPLAIN ANALYZE INSERT INTO samples VALUES (1)",
        ] {
            let err = check_read_only(sql).unwrap_err();
            assert!(matches!(err, QueryError::ReadOnly { .. }), "{sql}: {err}");
        }
    }

    #[test]
    fn accepts_queries_explain_and_show() {
        for sql in [
            "SELECT 1",
            "WITH a AS (SELECT 1) SELECT * FROM a",
            "EXPLAIN SELECT 1",
            "SHOW TABLES",
            "DESCRIBE samples",
        ] {
            check_read_only(sql).unwrap();
        }
    }

    #[test]
    fn refusal_names_the_statement() {
        let err = check_read_only("create table t as select 1")
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("CREATE TABLE: refused"), "{err}");
    }
}
