//! End-to-end: distributed SQL with the `hslake` binary. Two `hslake serve-sql --worker`
//! processes on 127.0.0.1, `hslake sql --workers` as the coordinator: the SQL corpus of the
//! query crate (`query/tests/sql/{bf16,fp8}_*.slt`) gives the same results as `hslake sql`
//! alone, a worker that cannot be reached is named in the error, and a worker refuses a dataset
//! outside its `--allowed-root`.
#![cfg(feature = "sql")]

mod common;

use common::hslake;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A worker process, stopped when dropped.
struct Worker {
    child: Child,
    url: String,
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Start `hslake serve-sql --worker` on a free loopback port, reading datasets under `root`;
/// its address is read from its log.
fn start_worker(token_file: &Path, root: &Path) -> Worker {
    let mut child = Command::new(env!("CARGO_BIN_EXE_hslake"))
        .args([
            "serve-sql",
            "--worker",
            "--bind",
            "127.0.0.1:0",
            "--token-file",
        ])
        .arg(token_file)
        .arg("--allowed-root")
        .arg(root)
        .env("HSLAKE_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start worker");
    let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
    let addr = loop {
        let line = lines
            .next()
            .expect("the worker logs its address before anything can end its log")
            .expect("worker log");
        if let Some(rest) = line.split("addr=").nth(1) {
            if line.contains("worker listening") {
                break rest.split_whitespace().next().unwrap().to_string();
            }
        }
    };
    // Keep reading, so the worker never blocks on a full pipe.
    std::thread::spawn(move || lines.for_each(drop));
    Worker {
        child,
        url: format!("http://{addr}"),
    }
}

/// Every statement of the `.slt` files whose names start with `prefix`, at least `at_least`.
fn corpus(prefix: &str, at_least: usize) -> Vec<String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("query/tests/sql");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with(prefix))
        .collect();
    files.sort();
    let mut out = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let mut lines = text.lines();
        while let Some(line) = lines.next() {
            if line.starts_with("query") || line.starts_with("statement") {
                let sql: Vec<&str> = lines
                    .by_ref()
                    .take_while(|l| !l.is_empty() && *l != "----")
                    .collect();
                out.push(sql.join("\n"));
            }
        }
    }
    assert!(out.len() >= at_least, "the corpus has its queries: {out:?}");
    out
}

/// What a run of `hslake sql` gave, comparable across one node and workers: floats to 10
/// significant digits (summation order differs), rows sorted unless the query orders them.
fn result(sql: &str, o: &Output) -> String {
    if !o.status.success() {
        let err = String::from_utf8_lossy(&o.stderr);
        return format!("error: {}", err.lines().last().unwrap_or(""));
    }
    let text = String::from_utf8_lossy(&o.stdout);
    let mut rows: Vec<String> = text
        .lines()
        .map(|l| {
            l.split(',')
                .map(|c| match c.parse::<f64>() {
                    Ok(v) if c.contains('.') || c.contains('e') => format!("{v:.9e}"),
                    _ => c.to_string(),
                })
                .collect::<Vec<_>>()
                .join(",")
        })
        .collect();
    if !sql.to_uppercase().contains("ORDER BY") && rows.len() > 1 {
        rows[1..].sort();
    }
    rows.join("\n")
}

// A synthetic dataset under `dir` with `args`, one shard per sample (so that scans split over
// tasks): its URL.
fn synth(dir: &std::path::Path, args: &[&str]) -> String {
    let url = format!("file://{}", dir.join("ds").display());
    let o = hslake(&[&["synth", &url, "--shard-mb", "0"], args].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    url
}

/// A dataset of 8 small samples under `dir`, made with `extra` synth flags too: its URL.
fn small_dataset(dir: &Path, extra: &[&str]) -> String {
    let args = [
        "--samples",
        "8",
        "--seq-len",
        "3:5",
        "--hidden",
        "8",
        "--layers",
        "2",
    ];
    synth(dir, &[&args[..], extra].concat())
}

#[test]
fn the_sql_corpus_gives_the_same_results_on_two_workers_as_on_one_node() {
    let tmp = tempfile::tempdir().unwrap();
    let token = tmp.path().join("token");
    std::fs::write(&token, "worker-secret\n").unwrap();
    let token = token.to_str().unwrap();
    let workers = [
        start_worker(token.as_ref(), tmp.path()),
        start_worker(token.as_ref(), tmp.path()),
    ];
    let list = format!("{},{}", workers[0].url, workers[1].url);

    // fp8 too: its scales and `dequantize`'s results travel to the workers with the calls.
    // At least this many of each corpus's statements succeed (the rest are refusals).
    for (dtype, files, succeed) in [("bf16", "bf16_", 11), ("fp8_e4m3", "fp8_", 4)] {
        let dir = tmp.path().join(dtype);
        let url = synth(
            &dir,
            &[
                "--samples",
                "40",
                "--seq-len",
                "3:9",
                "--hidden",
                "16",
                "--layers",
                "2,30",
                "--seed",
                "3",
                "--row-group-mb",
                "0",
                "--dtype",
                dtype,
            ],
        );
        let queries = corpus(files, succeed);
        let mut compared = 0;
        for sql in &queries {
            let one = hslake(&["sql", &url, sql, "--format", "csv"]);
            let distributed = hslake(&[
                "sql",
                &url,
                sql,
                "--format",
                "csv",
                "--workers",
                &list,
                "--worker-token-file",
                token,
                "--scan-partition-bytes",
                "1KiB",
            ]);
            assert_eq!(
                result(sql, &distributed),
                result(sql, &one),
                "{dtype}: {sql}\n(left: two workers, right: one node)"
            );
            compared += one.status.success() as usize;
        }
        // The refusals are compared too.
        assert!(
            compared >= succeed,
            "{dtype}: only {compared} queries succeeded"
        );
    }
}

#[test]
fn an_unreachable_worker_is_named_in_the_error() {
    let tmp = tempfile::tempdir().unwrap();
    let url = small_dataset(tmp.path(), &[]);
    let token = tmp.path().join("token");
    std::fs::write(&token, "t\n").unwrap();
    // A port nothing listens on: bound, then closed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    // Twice, so that the planner splits the scan (one task would run on the coordinator).
    let dead = format!("http://127.0.0.1:{port},http://127.0.0.1:{port}");
    let start = Instant::now();
    let o = hslake(&[
        "sql",
        &url,
        "SELECT sum(seq_len) FROM samples WHERE seq_len > 0",
        "--workers",
        &dead,
        "--worker-token-file",
        token.to_str().unwrap(),
        "--scan-partition-bytes",
        "1KiB",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains(&format!("127.0.0.1:{port}")), "{err}");
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "took {:?}",
        start.elapsed()
    );
}

#[test]
fn a_worker_refuses_datasets_and_needs_its_token_file() {
    let o = hslake(&[
        "serve-sql",
        "--worker",
        "--dataset",
        "a=/tmp/x",
        "--token-file",
        "t",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--dataset") && err.contains("--worker"),
        "{err}"
    );
    let o = hslake(&[
        "sql",
        "/tmp/x",
        "SELECT 1",
        "--workers",
        "http://127.0.0.1:1",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--worker-token-file"), "{err}");
}

#[test]
fn a_worker_reads_only_datasets_under_its_allowed_roots() {
    let tmp = tempfile::tempdir().unwrap();
    let allowed = tmp.path().join("allowed");
    std::fs::create_dir(&allowed).unwrap();
    // One shard per sample, so that the scan is split over both workers.
    let url = small_dataset(&tmp.path().join("other"), &["--commit-every", "1"]);
    let token = tmp.path().join("token");
    std::fs::write(&token, "t\n").unwrap();
    let workers = [
        start_worker(&token, &allowed),
        start_worker(&token, &allowed),
    ];
    let list = format!("{},{}", workers[0].url, workers[1].url);
    let o = hslake(&[
        "sql",
        &url,
        "SELECT sum(seq_len) FROM samples",
        "--workers",
        &list,
        "--worker-token-file",
        token.to_str().unwrap(),
        "--scan-partition-bytes",
        "1KiB",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    let want = format!(
        "dataset {url} is outside this worker's --allowed-root (file://{})",
        allowed.display()
    );
    assert!(err.contains(&want), "{err}");
    // Deny by default: a worker without roots does not start.
    let o = hslake(&[
        "serve-sql",
        "--worker",
        "--token-file",
        token.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--worker needs --allowed-root URL,..."),
        "{err}"
    );
}
