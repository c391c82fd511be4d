//! The `samples` table: a DataFusion table over exactly the shard files one manifest names.
//! The bytes every query reads are counted by the store's [`CountingStore`], which the session
//! registers in place of the dataset's object store.
use std::sync::Arc;

use async_trait::async_trait;
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::catalog::Session;
use datafusion::common::config::ConfigOptions;
use datafusion::common::stats::Precision;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{ColumnStatistics, DataFusionError, Result, ScalarValue, Statistics};
use datafusion::datasource::file_format::parquet::ParquetFormat;
use datafusion::datasource::file_format::FileFormat;
use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::object_store::ObjectStoreUrl;
use datafusion::datasource::physical_plan::{FileGroup, FileScanConfigBuilder};
use datafusion::datasource::table_schema::TableSchema;
use datafusion::datasource::{TableProvider, TableType};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::{Expr, TableProviderFilterPushDown};
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::empty::EmptyExec;
use datafusion::physical_plan::execution_plan::CardinalityEffect;
use datafusion::physical_plan::filter_pushdown::{
    ChildPushdownResult, FilterDescription, FilterPushdownPhase, FilterPushdownPropagation,
};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    ChildStats, DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties, StatisticsArgs,
};
use futures::StreamExt;
use hslake_store::format::guard::{decoder_failure, guarded_stream};
use hslake_store::format::tokens::{TokenRows, TOKEN_CHECKSUM_COLUMN};
pub use hslake_store::io::{CountingStore, ReadLog};
use object_store::path::Path;

use crate::error::{BadTensorValue, QueryError};

/// One shard file as the manifest describes it.
#[derive(Debug, Clone)]
pub struct ShardFile {
    /// Location inside the table's object store.
    pub path: Path,
    /// Size in bytes (from the manifest, so no HEAD request is needed).
    pub bytes: u64,
    /// Rows (samples).
    pub rows: u64,
    /// Tokens over all rows.
    pub tokens: u64,
    /// Smallest sample id in the shard.
    pub min_sample_id: u64,
    /// Largest sample id in the shard.
    pub max_sample_id: u64,
}

/// Where a scan's shard files are: the dataset's URL and the object-store URL the session
/// registered the dataset's store under. The name carries the URL ([`store_name`]), from which
/// a worker of a distributed query opens the store when a plan names it
/// ([`crate::distributed::roots`]), so the scan's file paths mean the same there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScanSource {
    /// The dataset's canonical URL.
    pub dataset_url: String,
    /// The store's name in the session (`hslake://ds<N>`).
    pub store_url: ObjectStoreUrl,
}

/// A table over a fixed list of Parquet shard files with a known schema.
///
/// Unlike a listing table it never lists a directory, so a pinned version sees only the shards
/// its manifest names, and it needs no HEAD request per file. Projection and filters go to
/// DataFusion's Parquet scan: only the column chunks a query touches are fetched, and row groups
/// whose statistics exclude a filter are skipped.
#[derive(Debug)]
pub struct ShardTable {
    schema: SchemaRef,
    source: ScanSource,
    files: Vec<ShardFile>,
}

impl ShardTable {
    /// A table whose files live in the object store registered under `source.store_url`.
    pub fn new(schema: SchemaRef, source: ScanSource, files: Vec<ShardFile>) -> Self {
        ShardTable {
            schema,
            source,
            files,
        }
    }

    /// Per-file statistics the manifest gives for free: exact row counts (so `count(*)` reads
    /// nothing) and the sample-id range (so `WHERE sample_id = ...` skips whole shards).
    fn file_statistics(&self, f: &ShardFile) -> Statistics {
        let mut columns = vec![ColumnStatistics::new_unknown(); self.schema.fields().len()];
        if let Ok(i) = self.schema.index_of("sample_id") {
            columns[i] = ColumnStatistics::new_unknown()
                .with_null_count(Precision::Exact(0))
                .with_min_value(Precision::Exact(ScalarValue::UInt64(Some(f.min_sample_id))))
                .with_max_value(Precision::Exact(ScalarValue::UInt64(Some(f.max_sample_id))));
        }
        Statistics {
            num_rows: Precision::Exact(f.rows as usize),
            total_byte_size: Precision::Inexact(f.bytes as usize),
            column_statistics: columns,
        }
    }

    /// Tokens per row of the shard with the longest rows on average: the row length the
    /// batch size is worked out for ([`crate::batching`]). The manifest holds each shard's
    /// total, not its longest row; a batch is many rows, so the average is what it holds.
    pub fn tokens_per_row(&self) -> u64 {
        self.files
            .iter()
            .filter(|f| f.rows > 0)
            .map(|f| f.tokens.div_ceil(f.rows))
            .max()
            .unwrap_or(0)
    }

    fn table_statistics(&self) -> Statistics {
        let rows: u64 = self.files.iter().map(|f| f.rows).sum();
        let bytes: u64 = self.files.iter().map(|f| f.bytes).sum();
        let mut columns = vec![ColumnStatistics::new_unknown(); self.schema.fields().len()];
        if let (Ok(i), Some(min), Some(max)) = (
            self.schema.index_of("sample_id"),
            self.files.iter().map(|f| f.min_sample_id).min(),
            self.files.iter().map(|f| f.max_sample_id).max(),
        ) {
            columns[i] = ColumnStatistics::new_unknown()
                .with_null_count(Precision::Exact(0))
                .with_min_value(Precision::Exact(ScalarValue::UInt64(Some(min))))
                .with_max_value(Precision::Exact(ScalarValue::UInt64(Some(max))));
        }
        Statistics {
            num_rows: Precision::Exact(rows as usize),
            total_byte_size: Precision::Inexact(bytes as usize),
            column_statistics: columns,
        }
    }
}

#[async_trait]
impl TableProvider for ShardTable {
    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    fn statistics(&self) -> Option<Statistics> {
        Some(self.table_statistics())
    }

    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> Result<Vec<TableProviderFilterPushDown>> {
        // Inexact: the Parquet scan prunes row groups and pages with the filter, and DataFusion
        // still applies it to the rows that remain.
        Ok(vec![TableProviderFilterPushDown::Inexact; filters.len()])
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if self.files.is_empty() {
            let schema = match projection {
                Some(p) => Arc::new(self.schema.project(p)?),
                None => self.schema.clone(),
            };
            return Ok(Arc::new(EmptyExec::new(schema)));
        }
        // A file's statistics hold a column vector each (about 3 KB a shard at 15 columns: 3 GB
        // for 10^6 shards), and all they add to the table's is pruning shards by sample id: they
        // are attached where a filter names it.
        let by_id = filters.iter().any(|f| {
            f.column_refs()
                .iter()
                .any(|c| c.name.as_str() == "sample_id")
        });
        let files_with = |extra: &dyn Fn(Statistics) -> Statistics| -> Vec<PartitionedFile> {
            self.files
                .iter()
                .map(|f| {
                    let file = PartitionedFile::new(f.path.to_string(), f.bytes);
                    match by_id {
                        true => file.with_statistics(Arc::new(extra(self.file_statistics(f)))),
                        false => file,
                    }
                })
                .collect()
        };
        let partitions = state.config().target_partitions().max(1);
        let mut options = state.table_options().parquet.clone();
        // DataFusion's default is to fetch the last 512 KiB of a file hoping to get the footer
        // in one request; on shards of a few MiB that alone reads tensor bytes. Fetching the
        // exact footer costs one more small request and keeps metadata queries tiny.
        options.global.metadata_size_hint = None;
        let format = ParquetFormat::default().with_options(options);
        let n = self.schema.fields().len();
        let wanted: Vec<usize> = projection.cloned().unwrap_or_else(|| (0..n).collect());
        let reads_tokens = wanted.iter().any(|&i| {
            matches!(
                self.schema.field(i).name().as_str(),
                "input_ids" | "loss_mask"
            )
        });
        if !reads_tokens {
            let groups = FileGroup::new(files_with(&|st| st)).split_files(partitions);
            let source = format.file_source(TableSchema::from(self.schema.clone()));
            let config = FileScanConfigBuilder::new(self.source.store_url.clone(), source)
                .with_file_groups(groups)
                .with_statistics(self.table_statistics())
                .with_projection_indices(projection.cloned())?
                .with_limit(limit)
                .build();
            return Ok(Arc::new(ShardScanExec::new(
                format.create_physical_plan(state, config).await?,
                false,
                self.source.clone(),
            )));
        }
        // Tokens are checked against their row's checksum: the scan also reads both token
        // columns, the sample id (for the error) and the checksum, which the table does not
        // show (a file that predates it yields nulls), and drops them again after the check.
        let mut fields: Vec<Field> = self
            .schema
            .fields()
            .iter()
            .map(|f| f.as_ref().clone())
            .collect();
        fields.push(Field::new(TOKEN_CHECKSUM_COLUMN, DataType::UInt32, true));
        let scan_schema =
            Arc::new(Schema::new(fields).with_metadata(self.schema.metadata().clone()));
        let mut cols = wanted.clone();
        for name in ["sample_id", "input_ids", "loss_mask"] {
            let i = self.schema.index_of(name)?;
            if !cols.contains(&i) {
                cols.push(i);
            }
        }
        cols.push(n);
        let with_checksum = |mut st: Statistics| {
            st.column_statistics.push(ColumnStatistics::new_unknown());
            st
        };
        let groups = FileGroup::new(files_with(&with_checksum)).split_files(partitions);
        let source = format.file_source(TableSchema::from(scan_schema));
        let config = FileScanConfigBuilder::new(self.source.store_url.clone(), source)
            .with_file_groups(groups)
            .with_statistics(with_checksum(self.table_statistics()))
            .with_projection_indices(Some(cols))?
            .with_limit(limit)
            .build();
        let checked: Arc<dyn ExecutionPlan> = Arc::new(ShardScanExec::new(
            format.create_physical_plan(state, config).await?,
            true,
            self.source.clone(),
        ));
        let shown = checked.schema();
        let exprs = (0..wanted.len()).map(|i| {
            let name = shown.field(i).name().clone();
            (
                Arc::new(Column::new(&name, i)) as Arc<dyn PhysicalExpr>,
                name,
            )
        });
        Ok(Arc::new(ProjectionExec::try_new(exprs, checked)?))
    }
}

/// The Parquet scan of the shards as the table runs it. Every poll of the scan is guarded: parquet
/// asserts on some corrupt input (store's `format::guard`), and unguarded that panic would be
/// printed from a DataFusion worker thread before the query failed; here it becomes the query's
/// named error where it happens. When the scan reads tokens, each row's `input_ids` and
/// `loss_mask` are also checked against its token checksum (rows of files that predate token
/// checksums carry a null and pass); that error names the sample and the session adds the file
/// and row group. Rows pass through unchanged, so statistics, limits, filters, repartitioning
/// and (without the token check) projections go on to the scan below.
#[derive(Debug)]
pub struct ShardScanExec {
    input: Arc<dyn ExecutionPlan>,
    check_tokens: bool,
    source: ScanSource,
}

impl ShardScanExec {
    /// The scan `input` (DataFusion's Parquet scan of the shards of `source`), guarded, and
    /// with `check_tokens` each row's tokens checked against their checksum.
    pub fn new(input: Arc<dyn ExecutionPlan>, check_tokens: bool, source: ScanSource) -> Self {
        ShardScanExec {
            input,
            check_tokens,
            source,
        }
    }

    /// Whether rows' tokens are checked against their checksum.
    pub fn check_tokens(&self) -> bool {
        self.check_tokens
    }

    /// Where the scanned files are.
    pub fn source(&self) -> &ScanSource {
        &self.source
    }

    fn over(&self, input: Arc<dyn ExecutionPlan>) -> Arc<dyn ExecutionPlan> {
        Arc::new(ShardScanExec::new(
            input,
            self.check_tokens,
            self.source.clone(),
        ))
    }
}

impl DisplayAs for ShardScanExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "ShardScanExec: check_tokens={}", self.check_tokens)
    }
}

impl ExecutionPlan for ShardScanExec {
    fn name(&self) -> &str {
        "ShardScanExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.input.properties()
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![true]
    }

    fn child_stats_requests(&self, partition: Option<usize>) -> Vec<ChildStats> {
        vec![ChildStats::At(partition)]
    }

    fn statistics_from_inputs(
        &self,
        input_stats: &[Arc<Statistics>],
        _args: &StatisticsArgs,
    ) -> Result<Arc<Statistics>> {
        Ok(input_stats[0].clone())
    }

    fn supports_limit_pushdown(&self) -> bool {
        true
    }

    fn cardinality_effect(&self) -> CardinalityEffect {
        CardinalityEffect::Equal
    }

    fn repartitioned(
        &self,
        target_partitions: usize,
        config: &ConfigOptions,
    ) -> Result<Option<Arc<dyn ExecutionPlan>>> {
        Ok(self
            .input
            .repartitioned(target_partitions, config)?
            .map(|input| self.over(input)))
    }

    // The token check needs the token, sample-id and checksum columns that a projection above
    // it drops, so only a scan without it lets projections through.
    fn try_swapping_with_projection(
        &self,
        projection: &ProjectionExec,
    ) -> Result<Option<Arc<dyn ExecutionPlan>>> {
        if self.check_tokens {
            return Ok(None);
        }
        Ok(self
            .input
            .try_swapping_with_projection(projection)?
            .map(|input| self.over(input)))
    }

    // Rows pass through unchanged, so filters on them may go on to the Parquet scan, which
    // prunes row groups by them.
    fn gather_filters_for_pushdown(
        &self,
        _phase: FilterPushdownPhase,
        parent_filters: Vec<Arc<dyn PhysicalExpr>>,
        _config: &ConfigOptions,
    ) -> Result<FilterDescription> {
        FilterDescription::from_children(parent_filters, &self.children())
    }

    fn handle_child_pushdown_result(
        &self,
        _phase: FilterPushdownPhase,
        child_pushdown_result: ChildPushdownResult,
        _config: &ConfigOptions,
    ) -> Result<FilterPushdownPropagation<Arc<dyn ExecutionPlan>>> {
        Ok(FilterPushdownPropagation::if_all(child_pushdown_result))
    }

    fn with_new_children(
        self: Arc<Self>,
        mut children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        Ok(self.over(children.swap_remove(0)))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let scanned = unpanicking(self.input.execute(partition, context)?);
        if !self.check_tokens {
            return Ok(scanned);
        }
        let schema = scanned.schema();
        let checked = scanned.map(|batch| {
            let batch = batch?;
            let corrupt = |e: hslake_store::StoreError| match e {
                hslake_store::StoreError::BadValue {
                    row,
                    sample_id,
                    column,
                    reason,
                    ..
                } => DataFusionError::External(Box::new(QueryError::BadValue(Box::new(
                    BadTensorValue {
                        function: "reading samples".into(),
                        file: None,
                        row_group: None,
                        row,
                        sample_id,
                        column,
                        reason,
                    },
                )))),
                e => DataFusionError::External(Box::new(e)),
            };
            if let Some(rows) = TokenRows::from_batch(&batch, "", None).map_err(corrupt)? {
                rows.passing_unsummed_rows().check().map_err(corrupt)?;
            }
            Ok(batch)
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, checked)))
    }
}

/// `stream` polled through the store's decoder guard: a panic inside it (parquet asserting on a
/// corrupt shard) ends it with a named error instead of unwinding through DataFusion.
pub(crate) fn unpanicking(stream: SendableRecordBatchStream) -> SendableRecordBatchStream {
    let schema = stream.schema();
    let guarded = guarded_stream(stream).map(|r| {
        r.map_err(|m| {
            DataFusionError::External(Box::new(hslake_store::StoreError::Corrupt {
                path: "a shard of the dataset".into(),
                reason: decoder_failure(&m),
            }))
        })?
    });
    Box::pin(RecordBatchStreamAdapter::new(schema, guarded))
}

/// The object-store name a session gives dataset `id` at `url`: the URL travels in it, so a
/// worker of a distributed query resolves the name without being told (DataFusion resolves a
/// Parquet scan's store while it decodes the plan, before any node of ours is seen).
pub(crate) fn store_name(id: usize, url: &str) -> String {
    let hex: String = url.bytes().map(|b| format!("{b:02x}")).collect();
    format!("hslake://ds{id}-{hex}")
}

/// The dataset URL in a [`store_name`], or `None` for any other store URL.
pub(crate) fn dataset_of_store(url: &url::Url) -> Option<String> {
    if url.scheme() != "hslake" {
        return None;
    }
    let (_, hex) = url.host_str()?.split_once('-')?;
    let bytes: Option<Vec<u8>> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect();
    String::from_utf8(bytes?).ok()
}

#[cfg(test)]
mod tests {
    use std::ops::Range;

    use hslake_schemas::DType;

    use super::*;

    #[test]
    fn a_store_name_carries_its_dataset_url_and_nothing_else_reads_as_one() {
        for url in ["s3://bucket/runs/ds-1", "file:///tmp/a b/ds", "memory://x"] {
            let name = url::Url::parse(&store_name(7, url)).unwrap();
            assert_eq!(dataset_of_store(&name).as_deref(), Some(url));
        }
        for other in [
            "file:///",
            "s3://bucket/ds",
            "hslake://nohex",
            "hslake://ds1-zz",
        ] {
            assert_eq!(
                dataset_of_store(&url::Url::parse(other).unwrap()),
                None,
                "{other}"
            );
        }
    }
    use crate::{testdata, QuerySession};

    /// Byte ranges of every tensor column chunk (and its scale column) in every shard.
    async fn tensor_chunks(session: &QuerySession, only: Option<&str>) -> Vec<(Path, Range<u64>)> {
        let d = &session.datasets()[0];
        let ds = hslake_store::Dataset::open(&d.url).await.unwrap();
        let mut out = Vec::new();
        let reader = hslake_store::DatasetReader::open(&ds, Some(d.manifest.version))
            .await
            .unwrap();
        for (i, s) in d.manifest.shards.iter().enumerate() {
            let path = ds.object_path(&s.path);
            let meta = reader.shard_metadata(i).await.unwrap();
            for rg in meta.row_groups() {
                for c in rg.columns() {
                    let name = c.column_path().string();
                    let tensor = name.starts_with("layer_")
                        && !name.ends_with("_norm")
                        && !name.ends_with("_max_abs")
                        && !name.ends_with("_count");
                    if tensor && only.is_none_or(|o| o == name) {
                        let (start, len) = c.byte_range();
                        out.push((path.clone(), start..start + len));
                    }
                }
            }
        }
        out
    }

    fn touches(reads: &[(Path, Range<u64>)], chunks: &[(Path, Range<u64>)]) -> u64 {
        let mut n = 0;
        for (p, r) in reads {
            for (q, c) in chunks {
                if p == q && r.start < c.end && c.start < r.end {
                    n += r.end.min(c.end) - r.start.max(c.start);
                }
            }
        }
        n
    }

    #[tokio::test]
    async fn queries_without_tensor_columns_read_no_tensor_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("file://{}", dir.path().display());
        testdata::write(&url, DType::F32, 40, 2).await;
        let session = QuerySession::open(&url, None).await.unwrap();
        let chunks = tensor_chunks(&session, None).await;
        assert_eq!(chunks.len(), 4, "two tensor columns in each of two shards");
        let counter = session.datasets()[0].counter.clone();

        for sql in [
            "SELECT count(*), avg(seq_len) FROM samples",
            "SELECT sample_id FROM samples WHERE layer_30_nan_count > 0",
            "SELECT sum(num_loss_tokens), max(layer_2_norm) FROM samples WHERE seq_len > 4",
            "SELECT input_ids FROM samples WHERE sample_id = 7",
        ] {
            counter.record_ranges();
            let rows: usize = session
                .query(sql)
                .await
                .unwrap()
                .iter()
                .map(|b| b.num_rows())
                .sum();
            assert!(rows > 0, "{sql}");
            let reads = counter.ranges();
            assert_eq!(
                touches(&reads, &chunks),
                0,
                "{sql} read tensor bytes: {reads:?}"
            );
        }

        // The same check sees tensor reads when a query does use a tensor.
        counter.record_ranges();
        session
            .query("SELECT max(tensor_norm(layer_30)) FROM samples")
            .await
            .unwrap();
        let layer30 = tensor_chunks(&session, Some("layer_30")).await;
        let want: u64 = layer30.iter().map(|(_, c)| c.end - c.start).sum();
        assert_eq!(
            touches(&counter.ranges(), &layer30),
            want,
            "every layer_30 chunk is read"
        );
    }

    #[tokio::test]
    async fn a_filter_on_sample_id_still_skips_the_shards_that_cannot_hold_it() {
        // Per-file statistics are attached only for such filters (a column vector per shard
        // otherwise: gigabytes at 10^6 shards); with one, the other shards are not opened.
        let dir = tempfile::tempdir().unwrap();
        let url = format!("file://{}", dir.path().display());
        testdata::write(&url, DType::F32, 40, 4).await;
        let session = QuerySession::open(&url, None).await.unwrap();
        let m = &session.datasets()[0].manifest;
        assert_eq!(m.shards.len(), 4);
        let holder = m
            .shards
            .iter()
            .find(|s| (s.min_sample_id..=s.max_sample_id).contains(&17))
            .unwrap();
        let counter = session.datasets()[0].counter.clone();
        counter.record_ranges();
        let b = session
            .query("SELECT seq_len FROM samples WHERE sample_id = 17")
            .await
            .unwrap();
        assert_eq!(b.iter().map(|b| b.num_rows()).sum::<usize>(), 1);
        let files: std::collections::BTreeSet<String> = counter
            .ranges()
            .iter()
            .map(|(p, _)| p.to_string())
            .collect();
        assert_eq!(files.len(), 1, "{files:?}");
        assert!(files.iter().all(|f| f.ends_with(&holder.path)), "{files:?}");
        // Without such a filter every shard is read, from the table's statistics alone.
        counter.record_ranges();
        session
            .query("SELECT max(seq_len) FROM samples WHERE seq_len > 0")
            .await
            .unwrap();
        let all: std::collections::BTreeSet<String> = counter
            .ranges()
            .iter()
            .map(|(p, _)| p.to_string())
            .collect();
        assert_eq!(all.len(), 4, "{all:?}");
    }

    #[tokio::test]
    async fn count_star_is_answered_from_the_manifest() {
        testdata::write("memory://count-star", DType::Bf16, 12, 3).await;
        let session = QuerySession::open("memory://count-star", None)
            .await
            .unwrap();
        session.reset_counters();
        let b = session
            .query("SELECT count(*) AS n FROM samples")
            .await
            .unwrap();
        let n = b[0]
            .column(0)
            .as_any()
            .downcast_ref::<datafusion::arrow::array::Int64Array>()
            .unwrap()
            .value(0);
        assert_eq!(n, 12);
        assert_eq!(session.bytes_read(), 0);
    }

    #[tokio::test]
    async fn a_pinned_version_sees_only_its_shards() {
        testdata::write("memory://pinned", DType::Bf16, 10, 2).await;
        let old = QuerySession::open("memory://pinned", Some(1))
            .await
            .unwrap();
        let new = QuerySession::open("memory://pinned", None).await.unwrap();
        let count = |b: Vec<datafusion::arrow::record_batch::RecordBatch>| {
            datafusion::arrow::util::pretty::pretty_format_batches(&b)
                .unwrap()
                .to_string()
        };
        assert!(count(
            old.query("SELECT max(sample_id) AS m FROM samples")
                .await
                .unwrap()
        )
        .contains("| 4 |"));
        assert!(count(
            new.query("SELECT max(sample_id) AS m FROM samples")
                .await
                .unwrap()
        )
        .contains("| 9 |"));
    }

    #[tokio::test]
    async fn queries_a_dataset_on_s3_reading_no_tensor_bytes_for_metadata() {
        let Ok(endpoint) = std::env::var("HSLAKE_TEST_S3_ENDPOINT") else {
            eprintln!(
                "skipped: HSLAKE_TEST_S3_ENDPOINT is not set (scripts/test.sh starts an S3 server)"
            );
            return;
        };
        let bucket = hslake_store::tools::s3_bucket::create_bucket(&endpoint, "hslake-query-test")
            .expect("test bucket");
        let url = format!("s3://{bucket}/ds");
        testdata::write(&url, DType::Bf16, 12, 2).await;
        let session = QuerySession::open(&url, None).await.unwrap();
        let chunks = tensor_chunks(&session, None).await;
        let counter = session.datasets()[0].counter.clone();
        counter.record_ranges();
        let b = session
            .query("SELECT sample_id FROM samples WHERE layer_30_nan_count > 0")
            .await
            .unwrap();
        let text = datafusion::arrow::util::pretty::pretty_format_batches(&b)
            .unwrap()
            .to_string();
        assert!(text.contains("| 3         |"), "{text}");
        assert_eq!(touches(&counter.ranges(), &chunks), 0);
        assert!(counter.bytes_read() > 0);
    }
}
