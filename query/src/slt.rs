//! SQL behaviour tests: the files in `query/tests/sql/*.slt`, run by the `sqllogictest` crate
//! (the format DataFusion pins its own SQL with), and the SQL guide's examples
//! (`docs/guide/sql.md`).
//!
//! ```text
//! # comment
//! query IR
//! SELECT sample_id, tensor_norm(layer_2) FROM samples WHERE sample_id = 0
//! ----
//! 0 2.2360679775
//!
//! query error
//! SELECT tensor_norm(seq_len) FROM samples
//! ----
//! Error during planning: tensor_norm: argument 1 (seq_len) is UInt32; ...
//! ```
//!
//! Column types are checked (`I` integer, `R` floating point, `T` text, `?` anything else).
//! Floating-point values, also inside lists, are shown rounded to 12 significant digits so that
//! a different summation order in a future DataFusion does not break a test; NULL is `NULL`.
//! With `HSLAKE_BLESS=1` the files are rewritten with the actual output (review the diff!).
use std::path::{Path, PathBuf};
use std::sync::Arc;

use datafusion::arrow::array::{Array, AsArray};
use datafusion::arrow::datatypes::{DataType, Float32Type, Float64Type, Schema};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::arrow::util::display::{ArrayFormatter, FormatOptions};
use futures::TryStreamExt;
use hslake_schemas::DType;
use sqllogictest::{DBOutput, DefaultColumnType};

use crate::{testdata, QueryError, QuerySession};

/// One test connection: the shared session, read-only, so every file can use it.
struct HslakeDb {
    session: Arc<QuerySession>,
}

#[async_trait::async_trait]
impl sqllogictest::AsyncDB for HslakeDb {
    type Error = QueryError;
    type ColumnType = DefaultColumnType;

    async fn run(&mut self, sql: &str) -> Result<DBOutput<DefaultColumnType>, QueryError> {
        let stream = self.session.execute(sql).await?;
        let schema = stream.schema();
        let batches: Vec<RecordBatch> = stream.try_collect().await?;
        Ok(rows(&schema, &batches))
    }

    async fn shutdown(&mut self) {}

    fn engine_name(&self) -> &str {
        "hslake"
    }

    async fn sleep(dur: std::time::Duration) {
        tokio::time::sleep(dur).await;
    }
}

fn rows(schema: &Schema, batches: &[RecordBatch]) -> DBOutput<DefaultColumnType> {
    let types = schema
        .fields()
        .iter()
        .map(|f| column_type(f.data_type()))
        .collect();
    let mut rows = Vec::new();
    for b in batches {
        for r in 0..b.num_rows() {
            rows.push(b.columns().iter().map(|c| cell(c.as_ref(), r)).collect());
        }
    }
    DBOutput::Rows { types, rows }
}

fn column_type(t: &DataType) -> DefaultColumnType {
    match t {
        t if t.is_integer() => DefaultColumnType::Integer,
        t if t.is_floating() || matches!(t, DataType::Decimal128(..)) => {
            DefaultColumnType::FloatingPoint
        }
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => DefaultColumnType::Text,
        _ => DefaultColumnType::Any,
    }
}

/// The text of one value: floats normalised (also inside lists), everything else as Arrow
/// displays it; `NULL` for null and `(empty)` for an empty string, so that a row's cells stay
/// separable by spaces.
fn cell(a: &dyn Array, row: usize) -> String {
    if a.is_null(row) {
        return "NULL".into();
    }
    match a.data_type() {
        DataType::Float64 => float(a.as_primitive::<Float64Type>().value(row)),
        DataType::Float32 => float32(a.as_primitive::<Float32Type>().value(row)),
        DataType::List(_) => list(a.as_list::<i32>().value(row).as_ref()),
        DataType::LargeList(_) => list(a.as_list::<i64>().value(row).as_ref()),
        _ => {
            let text = ArrayFormatter::try_new(a, &FormatOptions::default())
                .map(|f| f.value(row).to_string())
                .unwrap_or_else(|e| format!("<unprintable: {e}>"));
            if text.is_empty() {
                "(empty)".into()
            } else {
                text
            }
        }
    }
}

fn list(values: &dyn Array) -> String {
    let items: Vec<String> = (0..values.len()).map(|i| cell(values, i)).collect();
    format!("[{}]", items.join(", "))
}

/// An f64 rounded to 12 significant digits, printed in its shortest form (`1`, `2.2360679775`).
fn float(v: f64) -> String {
    if !v.is_finite() {
        return v.to_string();
    }
    let rounded: f64 = format!("{v:.11e}").parse().unwrap_or(v);
    // -0 and 0 print alike.
    if rounded == 0.0 {
        "0".into()
    } else {
        rounded.to_string()
    }
}

/// An f32 in its shortest form: float32 results (statistics, token vectors) carry no
/// summation noise at their own precision.
fn float32(v: f32) -> String {
    if v == 0.0 {
        "0".into()
    } else {
        v.to_string()
    }
}

/// The `.slt` files whose names start with `prefix`.
fn files(prefix: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sql");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "slt"))
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with(prefix))
        .collect();
    v.sort();
    assert!(!v.is_empty(), "no {prefix}*.slt files in {}", dir.display());
    v
}

/// Run (or with `HSLAKE_BLESS=1` rewrite) every file starting with `prefix` against `session`.
async fn run_files(prefix: &str, session: QuerySession) {
    let session = Arc::new(session);
    let mut runner = sqllogictest::Runner::new(move || {
        let session = session.clone();
        async move { Ok::<_, QueryError>(HslakeDb { session }) }
    });
    runner.with_column_validator(sqllogictest::strict_column_validator);
    let bless = std::env::var("HSLAKE_BLESS").is_ok();
    let mut failures = Vec::new();
    for f in files(prefix) {
        if bless {
            runner
                .update_test_file(
                    &f,
                    " ",
                    sqllogictest::default_validator,
                    sqllogictest::default_normalizer,
                    sqllogictest::strict_column_validator,
                )
                .await
                .unwrap();
        } else if let Err(e) = runner.run_file_async(&f).await {
            failures.push(format!("{}", e.display(false)));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[tokio::test]
async fn sql_files_over_a_bf16_dataset_give_the_pinned_results() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    testdata::write(&url, DType::Bf16, 10, 2).await;
    run_files("bf16_", QuerySession::open(&url, None).await.unwrap()).await;
}

/// The same files through a coordinator and two workers (over loopback gRPC): each query's
/// scans split over both, the same results as one node. The workers have the limits the
/// one-node tests give their sessions: a worker's functions keep to its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_files_give_the_pinned_results_on_two_workers() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    testdata::write(&url, DType::Bf16, 10, 2).await;
    testdata::write("memory://slt-caps-distributed", DType::Bf16, 10, 1).await;
    for (prefix, url, limits) in [
        ("bf16_", url.as_str(), crate::QueryLimits::default()),
        ("caps_", "memory://slt-caps-distributed", caps_limits()),
    ] {
        let urls = crate::distributed::worker::spawn_test_workers(2, "slt", limits).await;
        let list: Vec<&str> = urls.iter().map(|u| u.as_str()).collect();
        // Small partitions, so that even these small shards are split over both workers.
        let workers = crate::distributed::Workers::parse(&list.join(","), "slt")
            .unwrap()
            .with_partition_bytes(1024);
        let mut session = QuerySession::distributed(&workers).unwrap();
        session.set_limits(limits);
        let ds = hslake_store::Dataset::open(url).await.unwrap();
        session.add_dataset(None, &ds, None).await.unwrap();
        run_files(prefix, session).await;
    }
}

/// The fp8 files through two workers: `dequantize(...)`'s result and the columns the optimizer
/// computes once for several calls reach a worker without their `hslake.tensor` metadata
/// (datafusion-proto rebuilds a function's result field from its type), so the functions read
/// it from their calls' pins (`udf/pins.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_files_over_an_fp8_dataset_give_the_pinned_results_on_two_workers() {
    // On disk under the temporary folder: the workers read only under their --allowed-root.
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    testdata::write(&url, DType::Fp8E4m3, 6, 1).await;
    let urls = crate::distributed::worker::spawn_test_workers(2, "slt", Default::default()).await;
    let list: Vec<&str> = urls.iter().map(|u| u.as_str()).collect();
    let workers = crate::distributed::Workers::parse(&list.join(","), "slt")
        .unwrap()
        .with_partition_bytes(1024);
    let mut session = QuerySession::distributed(&workers).unwrap();
    let ds = hslake_store::Dataset::open(&url).await.unwrap();
    session.add_dataset(None, &ds, None).await.unwrap();
    run_files("fp8_", session).await;
}

#[tokio::test]
async fn sql_files_give_the_same_results_when_tensor_rows_come_one_per_batch() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    testdata::write(&url, DType::Bf16, 10, 2).await;
    let mut session = QuerySession::open(&url, None).await.unwrap();
    // One byte: every query that reads a tensor or token column runs one row per batch.
    session.set_batch_bytes(1);
    run_files("bf16_", session).await;
}

#[tokio::test]
async fn sql_files_over_an_fp8_dataset_give_the_pinned_results() {
    testdata::write("memory://slt-fp8", DType::Fp8E4m3, 6, 1).await;
    let session = QuerySession::open("memory://slt-fp8", None).await.unwrap();
    run_files("fp8_", session).await;
}

#[tokio::test]
async fn sql_files_under_a_small_value_cap_refuse_what_would_outgrow_it() {
    testdata::write("memory://slt-caps", DType::Bf16, 10, 1).await;
    let mut session = QuerySession::open("memory://slt-caps", None).await.unwrap();
    session.set_limits(caps_limits());
    run_files("caps_", session).await;
}

/// A pool this large only counts (nothing is allocated for it); with it, constants up to the
/// cap are left alone, so each refusal of the `caps_` files is the function's own.
fn caps_limits() -> crate::QueryLimits {
    crate::QueryLimits {
        max_value: Some(1 << 20),
        memory_per_query: Some(8 << 30),
        timeout: None,
    }
}

#[test]
fn floats_are_rounded_to_twelve_significant_digits_also_in_lists() {
    assert_eq!(float(0.9999999999999997), "1");
    assert_eq!(float(2.23606797749979), "2.2360679775");
    assert_eq!(float(-0.0), "0");
    assert_eq!(float(f64::NAN), "NaN");
    let values = datafusion::arrow::array::Float64Array::from(vec![Some(1.0 / 3.0), None]);
    assert_eq!(list(&values), "[0.333333333333, NULL]");
    assert_eq!(float32(2.236068), "2.236068");
}

/// The ```sql blocks of a Markdown text, each split into statements at `;`.
fn sql_examples(markdown: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut block: Option<String> = None;
    for line in markdown.lines() {
        match (&mut block, line.trim_start()) {
            (None, l) if l.starts_with("```sql") => block = Some(String::new()),
            (Some(b), l) if l.starts_with("```") => {
                out.extend(
                    b.split(';')
                        .map(str::trim)
                        .filter(|s| !s.is_empty())
                        .map(str::to_string),
                );
                block = None;
            }
            (Some(b), _) => {
                b.push_str(line);
                b.push('\n');
            }
            _ => {}
        }
    }
    out
}

#[test]
fn sql_examples_are_found_in_markdown() {
    let md =
        "text\n```sql\nSELECT 1;\nSELECT 2\n```\n```bash\nls\n```\n  ```sql\nSELECT 3\n  ```\n";
    assert_eq!(sql_examples(md), ["SELECT 1", "SELECT 2", "SELECT 3"]);
}

#[tokio::test]
async fn every_sql_example_in_the_sql_guide_runs() {
    let guide = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/guide/sql.md");
    let text =
        std::fs::read_to_string(&guide).unwrap_or_else(|e| panic!("{}: {e}", guide.display()));
    let examples = sql_examples(&text);
    assert!(
        examples.len() >= 5,
        "expected the SQL guide's examples in {}, found {}",
        guide.display(),
        examples.len()
    );
    testdata::write("memory://guide-examples", DType::Bf16, 10, 2).await;
    let session = QuerySession::open("memory://guide-examples", None)
        .await
        .unwrap();
    for sql in examples {
        if let Err(e) = session.query(&sql).await {
            panic!("docs/guide/sql.md example fails:\n{sql}\n{e}");
        }
    }
}
