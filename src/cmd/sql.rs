//! `hslake sql`: run SQL over one dataset version, or an interactive prompt.
use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use futures::TryStreamExt;
use hslake_query::distributed::Workers;
use hslake_query::{write_batches, OutputFormat, QueryLimits, QuerySession};
use hslake_store::tools::files::{check_output, Existing, OutputError, OutputFile};

use hslake_schemas::units::{DurationRange, SizeRange};

use super::human_bytes;

/// `--query-memory`: a MiB up to a PiB.
const QUERY_MEMORY: SizeRange = SizeRange::bytes("--query-memory", 1 << 20, 1 << 50);
/// `--max-value-size`: from 1 KiB (smaller breaks ordinary rows) to 1 PiB.
const MAX_VALUE_SIZE: SizeRange = SizeRange::bytes("--max-value-size", 1 << 10, 1 << 50);
/// `--query-timeout`: a millisecond up to a year.
const QUERY_TIMEOUT: DurationRange =
    DurationRange::seconds("--query-timeout", Duration::from_millis(1), super::YEAR);

/// Arguments of `hslake sql`.
#[derive(clap::Args)]
pub struct Args {
    /// Dataset URL (file:///abs/dir, s3://bucket/prefix, or a local path).
    pub url: String,
    /// The SQL statement. Without it, statements ending in `;` are read from stdin
    /// (an interactive prompt on a terminal).
    pub query: Option<String>,
    /// Output format: table, csv, json (one object per line) or parquet.
    #[arg(long, default_value = "table")]
    pub format: String,
    /// Version to query (default: the newest).
    #[arg(long)]
    pub version: Option<u64>,
    /// Write results to this file instead of stdout: a new file, outside every dataset, not a
    /// symbolic link; written under a temporary name beside it and renamed into place when
    /// complete.
    #[arg(long, short)]
    pub output: Option<PathBuf>,
    /// Replace the file --output names if it exists (a regular file; links and paths inside a
    /// dataset are still refused).
    #[arg(long, requires = "output")]
    pub force: bool,
    #[command(flatten)]
    pub limits: LimitArgs,
    #[command(flatten)]
    pub workers: WorkerArgs,
}

/// `--scan-partition-bytes`: a KiB up to a TiB.
const PARTITION_BYTES: SizeRange = SizeRange::bytes("--scan-partition-bytes", 1 << 10, 1 << 40);

/// Workers to run queries on, shared by `hslake sql` and `hslake serve-sql`.
#[derive(clap::Args)]
pub struct WorkerArgs {
    /// Run queries on these workers (`hslake serve-sql --worker`), comma-separated
    /// http://HOST:PORT URLs; this process plans each query and collects its result. Every
    /// worker must reach the datasets at the URLs given here.
    #[arg(long, requires = "worker_token_file")]
    pub workers: Option<String>,
    /// File holding the token the workers were started with (first line, trimmed).
    #[arg(long, requires = "workers")]
    pub worker_token_file: Option<PathBuf>,
    /// Shard bytes per scan partition of a distributed query, e.g. 64MiB (default 16MiB): a
    /// scan gets one task per cores × this, so a smaller value spreads a small dataset over
    /// more workers.
    #[arg(long, requires = "workers", value_parser = PARTITION_BYTES.parser())]
    pub scan_partition_bytes: Option<u64>,
}

impl WorkerArgs {
    /// An empty session: distributed over the workers given, else one on this process.
    pub fn session(&self) -> Result<QuerySession> {
        let (Some(list), Some(token_file)) = (&self.workers, &self.worker_token_file) else {
            return Ok(QuerySession::new()?);
        };
        let token = super::read_token_file(token_file)?;
        let mut workers = Workers::parse(list, &token).context("--workers")?;
        if let Some(b) = self.scan_partition_bytes {
            workers = workers.with_partition_bytes(usize::try_from(b).unwrap_or(usize::MAX));
        }
        let urls: Vec<&str> = workers.urls().iter().map(|u| u.as_str()).collect();
        tracing::info!(workers = urls.join(","), "queries run distributed");
        Ok(QuerySession::distributed(&workers)?)
    }
}

/// Limits of one query, shared by `hslake sql` and `hslake serve-sql`.
#[derive(clap::Args)]
pub struct LimitArgs {
    /// Memory one query's joins, aggregates and sorts may hold, e.g. 4GiB; past it the query
    /// stops with an error naming this limit (default: a quarter of the machine's memory, for
    /// serve-sql divided by --max-queries).
    #[arg(long, value_parser = QUERY_MEMORY.parser())]
    pub query_memory: Option<u64>,
    /// Time one query may run, e.g. 30s or 10m; past it the query stops (default: none for
    /// sql, 60s for serve-sql).
    #[arg(long, value_parser = QUERY_TIMEOUT.parser())]
    pub query_timeout: Option<Duration>,
    /// Largest value (text, bytes, list, tensor) one function call may build, e.g. 256MiB;
    /// a call that would build a larger one stops the query with an error naming this limit
    /// (default: a quarter of --query-memory).
    #[arg(long, value_parser = MAX_VALUE_SIZE.parser())]
    pub max_value_size: Option<u64>,
}

impl LimitArgs {
    /// The limits to apply: the flags given, else `defaults`.
    pub fn resolve(&self, defaults: QueryLimits) -> QueryLimits {
        QueryLimits {
            memory_per_query: self
                .query_memory
                .map(|b| usize::try_from(b).unwrap_or(usize::MAX))
                .or(defaults.memory_per_query),
            timeout: self.query_timeout.or(defaults.timeout),
            max_value: self
                .max_value_size
                .map(|b| usize::try_from(b).unwrap_or(usize::MAX))
                .or(defaults.max_value),
        }
    }
}

/// Log the limits in force, so that a refused query can be matched with its setting.
pub fn log_limits(limits: &QueryLimits) {
    tracing::info!(
        query_memory = limits
            .memory_per_query
            .map_or("unlimited".to_string(), |b| human_bytes(b as u64)),
        query_timeout = limits
            .timeout
            .map_or("none".to_string(), |t| format!("{} s", t.as_secs_f64())),
        max_value_size = human_bytes(limits.value_cap() as u64),
        "query limits"
    );
}

/// Run the command.
pub async fn run(args: Args) -> Result<ExitCode> {
    let format: OutputFormat = args.format.parse()?;
    // Before the dataset is opened or a query runs: a refused output costs nothing.
    let mut output = match &args.output {
        Some(path) => Some(Output::check(path, args.force)?),
        None => None,
    };
    let mut session = args.workers.session()?;
    let ds = hslake_store::Dataset::open(&args.url)
        .await
        .with_context(|| format!("opening {}", args.url))?;
    session
        .add_dataset(None, &ds, args.version)
        .await
        .with_context(|| format!("opening {}", args.url))?;
    // One query at a time: it may reserve a quarter of the machine's memory.
    let limits = args.limits.resolve(QueryLimits::for_machine(1));
    session.set_limits(limits);
    let m = &session.datasets()[0].manifest;
    tracing::info!(url = %args.url, version = m.version, samples = m.num_samples(), shards = m.shards.len(), "opened dataset");
    log_limits(&limits);
    match args.query {
        Some(q) => {
            run_one(&session, &q, format, &mut output).await?;
            Ok(ExitCode::SUCCESS)
        }
        None => interactive(&session, format, &mut output).await,
    }
}

/// Where `--output` writes: the path the checks gave (the output's folder with its links
/// resolved), and what may happen to a file found there.
struct Output {
    given: PathBuf,
    target: PathBuf,
    existing: Existing,
}

impl Output {
    /// `path` checked: refused inside any dataset (the one read included), as a link, as
    /// anything but a regular file, and where a file exists, without `force`.
    fn check(path: &Path, force: bool) -> Result<Self> {
        let existing = match force {
            true => Existing::Replace,
            false => Existing::RefuseWithout("--force"),
        };
        let target =
            check_output(path, &[], existing).map_err(|e| anyhow::anyhow!("--output {e}"))?;
        Ok(Output {
            given: path.to_path_buf(),
            target,
            existing,
        })
    }

    /// Writes one result, under a temporary name renamed into place when it is complete.
    fn write(
        &mut self,
        format: OutputFormat,
        schema: arrow::datatypes::SchemaRef,
        batches: &[arrow_array::RecordBatch],
    ) -> Result<()> {
        let given = self.given.display();
        let flagged = |e: OutputError| anyhow::anyhow!("--output {given}: {}", e.reason);
        let out = OutputFile::create(&self.target).map_err(flagged)?;
        let mut w = std::io::BufWriter::new(out.file().map_err(flagged)?);
        write_batches(format, schema, batches, &mut w)?;
        let file = w
            .into_inner()
            .map_err(|e| e.into_error())
            .with_context(|| format!("--output {given}: cannot write"))?;
        out.finish(file, self.existing).map_err(flagged)?;
        // Each later statement at the prompt replaces the result this one wrote.
        self.existing = Existing::Replace;
        Ok(())
    }
}

async fn run_one(
    session: &QuerySession,
    sql: &str,
    format: OutputFormat,
    output: &mut Option<Output>,
) -> Result<()> {
    let start = std::time::Instant::now();
    session.reset_counters();
    let stream = session.execute(sql).await?;
    let schema = stream.schema();
    let batches: Vec<_> = stream
        .try_collect()
        .await
        .map_err(hslake_query::QueryError::from)?;
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    match output {
        Some(out) => out.write(format, schema, &batches)?,
        None => {
            if format == OutputFormat::Parquet && std::io::stdout().is_terminal() {
                bail!("--format parquet writes binary data: give --output FILE or redirect stdout");
            }
            write_batches(format, schema, &batches, std::io::stdout())?;
        }
    }
    tracing::info!(
        rows,
        bytes_read = session.bytes_read(),
        requests = session.read_requests(),
        elapsed_ms = start.elapsed().as_millis() as u64,
        "query done"
    );
    Ok(())
}

/// Read statements ending in `;` from stdin and run each; an error (bad SQL, a line that is
/// not UTF-8) is printed and the prompt continues. `\q`, `quit` or end of input leaves.
async fn interactive(
    session: &QuerySession,
    format: OutputFormat,
    output: &mut Option<Output>,
) -> Result<ExitCode> {
    let tty = std::io::stdin().is_terminal();
    let prompt = |continued: bool| {
        if tty {
            eprint!("{}", if continued { "     ...> " } else { "hslake> " });
            let _ = std::io::stderr().flush();
        }
    };
    if tty {
        eprintln!("Tables: samples, shards, versions. End statements with ';'. \\q to quit.");
    }
    let mut failed = false;
    let mut statements = Statements::default();
    let mut stdin = std::io::stdin().lock();
    let mut line = Vec::new();
    prompt(false);
    loop {
        line.clear();
        if stdin
            .read_until(b'\n', &mut line)
            .context("reading stdin")?
            == 0
        {
            break;
        }
        let step = statements.push_line(&line);
        match step {
            Step::Quit => break,
            Step::More => {}
            Step::Run(sql) => {
                if let Err(e) = run_one(session, &sql, format, output).await {
                    eprintln!("error: {e:#}");
                    failed = true;
                }
            }
            Step::Skipped(why) => {
                eprintln!("error: {why}");
                failed = true;
            }
        }
        prompt(statements.continued());
    }
    match statements.finish() {
        Step::Run(sql) => {
            // A last statement without ';' at end of input still runs.
            if let Err(e) = run_one(session, &sql, format, output).await {
                eprintln!("error: {e:#}");
                failed = true;
            }
        }
        Step::Skipped(why) => {
            eprintln!("error: {why}");
            failed = true;
        }
        Step::More | Step::Quit => {}
    }
    Ok(if failed && !tty {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// What the prompt does after a line.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    /// The statement goes on.
    More,
    /// A complete statement to run.
    Run(String),
    /// A complete statement that cannot run, and why.
    Skipped(String),
    /// The user asked to leave.
    Quit,
}

/// Collects input lines into statements ending in `;`. A line that is not UTF-8 spoils the
/// statement it belongs to (guessing at its bytes could change a string literal), which is
/// then reported instead of run; the next statement starts clean.
#[derive(Default)]
struct Statements {
    buf: String,
    line_no: usize,
    bad_line: Option<(usize, usize)>,
}

impl Statements {
    fn push_line(&mut self, raw: &[u8]) -> Step {
        self.line_no += 1;
        let text = match std::str::from_utf8(raw) {
            Ok(t) => t,
            Err(e) => {
                self.bad_line.get_or_insert((self.line_no, e.valid_up_to()));
                // The valid prefix still tells whether the statement ends on this line.
                let lossy = String::from_utf8_lossy(raw).into_owned();
                return self.add(&lossy);
            }
        };
        let t = text.trim();
        if self.buf.trim().is_empty()
            && self.bad_line.is_none()
            && matches!(t, "\\q" | "quit" | "exit")
        {
            return Step::Quit;
        }
        self.add(text)
    }

    fn add(&mut self, text: &str) -> Step {
        self.buf.push_str(text.trim_end_matches(['\n', '\r']));
        self.buf.push('\n');
        if text.trim().ends_with(';') {
            self.take()
        } else {
            Step::More
        }
    }

    /// Whether a statement is half read.
    fn continued(&self) -> bool {
        !self.buf.trim().is_empty()
    }

    /// End of input: the statement read so far, if any.
    fn finish(&mut self) -> Step {
        if self.continued() || self.bad_line.is_some() {
            self.take()
        } else {
            Step::More
        }
    }

    fn take(&mut self) -> Step {
        let sql = std::mem::take(&mut self.buf)
            .trim()
            .trim_end_matches(';')
            .trim()
            .to_string();
        if let Some((line, byte)) = self.bad_line.take() {
            return Step::Skipped(format!(
                "line {line} is not valid UTF-8 (byte {} of the line); statement skipped, expected UTF-8 text",
                byte + 1
            ));
        }
        if sql.is_empty() {
            Step::More
        } else {
            Step::Run(sql)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(input: &[&[u8]]) -> Vec<Step> {
        let mut s = Statements::default();
        let mut out: Vec<Step> = input
            .iter()
            .map(|l| s.push_line(l))
            .filter(|st| *st != Step::More)
            .collect();
        out.push(s.finish());
        out.retain(|st| *st != Step::More);
        out
    }

    #[test]
    fn statements_end_at_semicolons_and_at_end_of_input() {
        assert_eq!(
            feed(&[b"SELECT 1\n", b"FROM t;\n", b"SELECT 2"]),
            [
                Step::Run("SELECT 1\nFROM t".into()),
                Step::Run("SELECT 2".into())
            ]
        );
    }

    #[test]
    fn a_line_that_is_not_utf8_skips_its_statement_and_the_next_one_runs() {
        let steps = feed(&[b"SELECT 'caf\xe9'\n", b"AS x;\n", b"SELECT 2;\n"]);
        assert_eq!(steps.len(), 2, "{steps:?}");
        match &steps[0] {
            Step::Skipped(why) => {
                assert!(
                    why.starts_with("line 1 is not valid UTF-8 (byte 12"),
                    "{why}"
                )
            }
            other => panic!("expected a skipped statement, got {other:?}"),
        }
        assert_eq!(steps[1], Step::Run("SELECT 2".into()));
    }

    #[test]
    fn quit_leaves_only_between_statements() {
        assert_eq!(feed(&[b"\\q\n"]), [Step::Quit]);
        assert_eq!(
            feed(&[b"SELECT\n", b"quit;\n"]),
            [Step::Run("SELECT\nquit".into())]
        );
    }
}
