//! `hslake sql`: run SQL over one dataset version, or an interactive prompt.
use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use hslake_query::{write_batches, OutputFormat, QuerySession};

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
    /// Write results to this file instead of stdout.
    #[arg(long, short)]
    pub output: Option<PathBuf>,
}

/// Run the command.
pub async fn run(args: Args) -> Result<ExitCode> {
    let format: OutputFormat = args.format.parse()?;
    let session = QuerySession::open(&args.url, args.version)
        .await
        .with_context(|| format!("opening {}", args.url))?;
    let m = &session.datasets()[0].manifest;
    tracing::info!(url = %args.url, version = m.version, samples = m.num_samples(), shards = m.shards.len(), "opened dataset");
    match args.query {
        Some(q) => {
            run_one(&session, &q, format, args.output.as_ref()).await?;
            Ok(ExitCode::SUCCESS)
        }
        None => interactive(&session, format, args.output.as_ref()).await,
    }
}

async fn run_one(
    session: &QuerySession,
    sql: &str,
    format: OutputFormat,
    output: Option<&PathBuf>,
) -> Result<()> {
    let start = std::time::Instant::now();
    session.reset_counters();
    let df = session.sql(sql).await?;
    let schema = std::sync::Arc::new(df.schema().as_arrow().clone());
    let batches = df.collect().await.map_err(hslake_query::QueryError::from)?;
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    match output {
        Some(path) => {
            let f = std::fs::File::create(path)
                .with_context(|| format!("creating {}", path.display()))?;
            write_batches(format, schema, &batches, std::io::BufWriter::new(f))?;
        }
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

/// Read statements ending in `;` from stdin and run each; an error is printed and the prompt
/// continues. `\q`, `quit` or end of input leaves.
async fn interactive(
    session: &QuerySession,
    format: OutputFormat,
    output: Option<&PathBuf>,
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
    let mut buf = String::new();
    prompt(false);
    for line in std::io::stdin().lock().lines() {
        let line = line.context("reading stdin")?;
        let t = line.trim();
        if buf.trim().is_empty() && matches!(t, "\\q" | "quit" | "exit") {
            break;
        }
        buf.push_str(&line);
        buf.push('\n');
        if t.ends_with(';') {
            let sql = buf.trim().trim_end_matches(';').trim().to_string();
            buf.clear();
            if !sql.is_empty() {
                if let Err(e) = run_one(session, &sql, format, output).await {
                    eprintln!("error: {e:#}");
                    failed = true;
                }
            }
        }
        prompt(!buf.trim().is_empty());
    }
    if !buf.trim().is_empty() {
        // A last statement without ';' at end of input still runs.
        if let Err(e) = run_one(session, buf.trim(), format, output).await {
            eprintln!("error: {e:#}");
            failed = true;
        }
    }
    Ok(if failed && !tty {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}
