//! `hslake-fault-proxy`: the fault-injecting S3 proxy as a process, for tests outside Rust.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Parser;
use hslake_fault_proxy::{Proxy, RuleSet};
use tracing_subscriber::EnvFilter;

/// Forwards S3 requests from 127.0.0.1 to an upstream endpoint, injecting faults by rule.
///
/// Prints its endpoint (`http://127.0.0.1:PORT`) as the first line of stdout once it listens.
/// Rules and counters: `PUT`/`GET`/`DELETE /__fault_proxy/rules`, `GET`/`DELETE
/// /__fault_proxy/counters` on the same port.
#[derive(Parser)]
#[command(name = "hslake-fault-proxy", version)]
struct Args {
    /// The S3 endpoint to forward to, e.g. http://127.0.0.1:5000.
    #[arg(long)]
    upstream: String,
    /// Port on 127.0.0.1; 0 picks a free one.
    #[arg(long, default_value_t = 0)]
    port: u16,
    /// Also write the chosen port to this file (complete when it appears).
    #[arg(long)]
    port_file: Option<PathBuf>,
    /// Rules in force from the start: a JSON file as the control endpoint takes.
    #[arg(long)]
    rules: Option<PathBuf>,
    /// Exit when stdin reaches end of file, so a test harness that dies takes the proxy along.
    #[arg(long)]
    exit_on_stdin_eof: bool,
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_env("HSLAKE_LOG").unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let args = Args::parse();
    let rules = match &args.rules {
        None => RuleSet::default(),
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading rules from {}", path.display()))?;
            serde_json::from_str(&text)
                .map_err(|source| hslake_fault_proxy::Error::RulesJson { source })
                .with_context(|| format!("rules file {}", path.display()))?
        }
    };
    let proxy = Proxy::bind(args.port, &args.upstream, &rules)?;
    let port = proxy.local_addr().port();
    if let Some(path) = &args.port_file {
        write_whole(path, &format!("{port}\n"))?;
    }
    let mut out = std::io::stdout().lock();
    writeln!(out, "http://127.0.0.1:{port}").context("printing the endpoint")?;
    out.flush().context("printing the endpoint")?;
    drop(out);

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let exit_on_eof = args.exit_on_stdin_eof;
    runtime.block_on(proxy.run(async move {
        let stdin_closed = async {
            if exit_on_eof {
                wait_for_stdin_eof().await;
            } else {
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            () = stdin_closed => tracing::info!("stdin closed; fault proxy exiting"),
        }
    }))?;
    Ok(())
}

/// Writes to a temporary name and renames, so a reader polling for the file sees it whole.
fn write_whole(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))
}

/// Resolves when stdin ends. A plain thread reads it: tokio's stdin needs a feature nothing
/// else in the workspace uses (it would rebuild tokio for every crate).
async fn wait_for_stdin_eof() {
    use std::io::Read;
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let mut buf = [0u8; 256];
        let mut stdin = std::io::stdin();
        while matches!(stdin.read(&mut buf), Ok(n) if n > 0) {}
        let _ = tx.send(());
    });
    let _ = rx.await;
}
