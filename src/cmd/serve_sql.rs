//! `hslake serve-sql`: a read-only Arrow Flight SQL server over named datasets.
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use hslake_query::QuerySession;

/// Arguments of `hslake serve-sql`.
#[derive(clap::Args)]
pub struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub bind: SocketAddr,
    /// A dataset as NAME=URL (repeatable); its tables are NAME.samples, NAME.shards,
    /// NAME.versions. Append @N to the URL to pin version N (default: the newest).
    #[arg(long = "dataset", required = true)]
    pub datasets: Vec<String>,
    /// File holding the bearer token clients must present (first line, trimmed).
    #[arg(long)]
    pub token_file: PathBuf,
}

/// Run the command until Ctrl-C.
pub async fn run(args: Args) -> Result<ExitCode> {
    let token = std::fs::read_to_string(&args.token_file)
        .with_context(|| format!("reading token file {}", args.token_file.display()))?;
    let token = token.lines().next().unwrap_or("").trim().to_string();
    if token.is_empty() {
        bail!(
            "token file {} is empty; expected a bearer token on its first line",
            args.token_file.display()
        );
    }
    let mut session = QuerySession::new()?;
    for spec in &args.datasets {
        let Some((name, url)) = spec.split_once('=') else {
            bail!("--dataset {spec:?}: expected NAME=URL");
        };
        let (url, version) = match url.rsplit_once('@') {
            Some((u, v)) if v.chars().all(|c| c.is_ascii_digit()) && !v.is_empty() => (
                u,
                Some(
                    v.parse::<u64>()
                        .with_context(|| format!("--dataset {spec:?}: version"))?,
                ),
            ),
            _ => (url, None),
        };
        let ds = hslake_store::Dataset::open(url)
            .await
            .with_context(|| format!("opening dataset {name} at {url}"))?;
        session
            .add_dataset(Some(name), &ds, version)
            .await
            .with_context(|| format!("--dataset {spec:?}"))?;
        let m = &session
            .datasets()
            .last()
            .context("dataset just added")?
            .manifest;
        tracing::info!(
            name,
            url,
            version = m.version,
            samples = m.num_samples(),
            "serving dataset"
        );
    }
    let listener = tokio::net::TcpListener::bind(args.bind)
        .await
        .with_context(|| format!("binding {}", args.bind))?;
    tracing::info!(addr = %listener.local_addr()?, "Flight SQL server listening (read-only, bearer token required)");
    hslake_query::flight::serve_listener(session, token, listener, async {
        let _ = tokio::signal::ctrl_c().await;
        tracing::info!("shutting down");
    })
    .await
    .context("Flight SQL server")?;
    Ok(ExitCode::SUCCESS)
}
