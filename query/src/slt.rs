//! Runs the SQL behaviour files in `query/tests/sql/*.slt`: each block is a statement and its
//! expected output (a text table) or its exact error message.
//!
//! ```text
//! # comment
//! query
//! SELECT count(*) FROM samples
//! ----
//! +----------+
//! | count(*) |
//! ...
//!
//! error
//! SELECT tensor_norm(seq_len) FROM samples
//! ----
//! Error during planning: tensor_norm: argument 1 (seq_len) is UInt32; ...
//! ```
//!
//! With `HSLAKE_BLESS=1` the files are rewritten with the actual output (review the diff!).
use std::path::{Path, PathBuf};

use hslake_schemas::DType;

use crate::{testdata, QuerySession};

struct Block {
    kind: String,
    sql: String,
    expected: String,
}

fn parse(text: &str) -> (Vec<String>, Vec<Block>) {
    // Comments before each block are kept so a blessed file keeps them.
    let mut blocks = Vec::new();
    let mut comments = Vec::new();
    let mut pending = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        if line.starts_with('#') || line.trim().is_empty() {
            if line.starts_with('#') {
                pending.push_str(line);
                pending.push('\n');
            }
            continue;
        }
        let kind = line.trim().to_string();
        assert!(
            kind == "query" || kind == "error",
            "unknown directive {kind:?}"
        );
        let mut sql = Vec::new();
        for l in lines.by_ref() {
            if l == "----" {
                break;
            }
            sql.push(l);
        }
        let mut expected = Vec::new();
        while let Some(l) = lines.peek() {
            if l.trim().is_empty() {
                break;
            }
            expected.push(*l);
            lines.next();
        }
        comments.push(std::mem::take(&mut pending));
        blocks.push(Block {
            kind,
            sql: sql.join("\n"),
            expected: expected.join("\n"),
        });
    }
    (comments, blocks)
}

async fn actual(session: &QuerySession, b: &Block) -> String {
    match session.query(&b.sql).await {
        Ok(batches) => {
            if b.kind == "error" {
                return "<no error>".into();
            }
            let text = datafusion::arrow::util::pretty::pretty_format_batches(&batches)
                .unwrap()
                .to_string();
            text.lines()
                .map(str::trim_end)
                .collect::<Vec<_>>()
                .join("\n")
        }
        Err(e) => {
            if b.kind == "query" {
                format!("<error> {e}")
            } else {
                e.to_string()
            }
        }
    }
}

async fn run_file(path: &Path, session: &QuerySession) {
    let text = std::fs::read_to_string(path).unwrap();
    let (comments, blocks) = parse(&text);
    let bless = std::env::var("HSLAKE_BLESS").is_ok();
    let mut out = String::new();
    let mut failures = Vec::new();
    for (c, b) in comments.iter().zip(&blocks) {
        let got = actual(session, b).await;
        if got != b.expected {
            failures.push(format!(
                "{}\n--- expected\n{}\n--- got\n{}",
                b.sql, b.expected, got
            ));
        }
        out.push_str(&format!("{c}{}\n{}\n----\n{}\n\n", b.kind, b.sql, got));
    }
    if bless {
        std::fs::write(path, out.trim_end().to_string() + "\n").unwrap();
    } else {
        assert!(
            failures.is_empty(),
            "{}: {} block(s) differ:\n\n{}",
            path.display(),
            failures.len(),
            failures.join("\n\n")
        );
    }
}

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

#[tokio::test]
async fn sql_files_over_a_bf16_dataset_give_the_pinned_results() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    testdata::write(&url, DType::Bf16, 10, 2).await;
    let session = QuerySession::open(&url, None).await.unwrap();
    for f in files("bf16_") {
        run_file(&f, &session).await;
    }
}

#[tokio::test]
async fn sql_files_over_an_fp8_dataset_give_the_pinned_results() {
    testdata::write("memory://slt-fp8", DType::Fp8E4m3, 6, 1).await;
    let session = QuerySession::open("memory://slt-fp8", None).await.unwrap();
    for f in files("fp8_") {
        run_file(&f, &session).await;
    }
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
async fn every_sql_example_in_the_readme_runs() {
    let readme = Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md");
    let text = std::fs::read_to_string(&readme).unwrap();
    let examples = sql_examples(&text);
    assert!(
        examples.len() >= 5,
        "expected the README's SQL examples, found {}",
        examples.len()
    );
    testdata::write("memory://readme-examples", DType::Bf16, 10, 2).await;
    let session = QuerySession::open("memory://readme-examples", None)
        .await
        .unwrap();
    for sql in examples {
        if let Err(e) = session.query(&sql).await {
            panic!("README example fails:\n{sql}\n{e}");
        }
    }
}
