//! `hslake serve-sql`: a read-only Arrow Flight SQL server over named datasets.
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use hslake_query::executor::{ExecutorLimits, QueryExecutor};
use hslake_query::flight::HslakeFlightSql;
use hslake_query::{QueryLimits, QuerySession};

use hslake_schemas::units::DurationRange;

use super::listen::{grpc, ConnArgs};
use super::sql::{log_limits, LimitArgs};

/// `--queue-timeout`: no wait at all up to a day.
const QUEUE_TIMEOUT: DurationRange = DurationRange::seconds(
    "--queue-timeout",
    Duration::ZERO,
    Duration::from_secs(86_400),
);

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
    /// Queries executing at once; more wait for a slot (default: two per core, at least 4).
    #[arg(long)]
    pub max_queries: Option<usize>,
    /// How long a query waits for a slot before it is refused, e.g. 30s.
    #[arg(long, value_parser = QUEUE_TIMEOUT.parser(), default_value = "30s")]
    pub queue_timeout: Duration,
    // Query memory and time limits. Defaults here: a quarter of the machine's memory split among
    // --max-queries, and 60 s.
    #[command(flatten)]
    pub limits: LimitArgs,
    /// Connection caps and deadlines.
    #[command(flatten)]
    pub conn: ConnArgs,
}

/// Requests one HTTP/2 connection may have open at once: a client runs its queries on a few
/// streams, and --max-queries bounds the queries themselves.
const STREAMS_PER_CONNECTION: u32 = 64;

/// Run the command until Ctrl-C.
pub async fn run(args: Args) -> Result<ExitCode> {
    let token = super::read_token_file(&args.token_file)?;
    args.conn.check()?;
    let mut executor_limits = ExecutorLimits::for_machine();
    executor_limits.queue_timeout = args.queue_timeout;
    if let Some(n) = args.max_queries {
        if n == 0 {
            bail!("--max-queries 0: expected at least 1");
        }
        executor_limits.max_queries = n;
    }
    let mut defaults = QueryLimits::for_machine(executor_limits.max_queries);
    defaults.timeout = Some(Duration::from_secs(60));
    let limits = args.limits.resolve(defaults);
    let mut session = QuerySession::new()?;
    session.set_limits(limits);
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
    let listener = super::listen::bind(args.bind)?;
    log_limits(&limits);
    tracing::info!(
        max_queries = executor_limits.max_queries,
        queue_timeout_s = executor_limits.queue_timeout.as_secs_f64(),
        query_threads = executor_limits.threads,
        "concurrency limits"
    );
    let executor = QueryExecutor::new(executor_limits).context("starting the query runtime")?;
    let service = HslakeFlightSql::new(session, executor, token);
    tracing::info!(addr = %listener.local_addr()?, "Flight SQL server listening (read-only, bearer token required)");
    tracing::info!(
        max_connections = args.conn.max_connections,
        per_client = args.conn.max_connections_per_client,
        header_timeout_s = args.conn.header_timeout.as_secs_f64(),
        idle_timeout_s = args.conn.idle_timeout.as_secs_f64(),
        "connection limits"
    );
    tonic::transport::Server::builder()
        .max_concurrent_streams(STREAMS_PER_CONNECTION)
        .http2_keepalive_interval(Some(grpc::keepalive_interval(&args.conn)))
        .http2_keepalive_timeout(Some(args.conn.header_timeout))
        .add_service(hslake_query::flight::flight_service(service))
        .serve_with_incoming_shutdown(grpc::incoming(listener, &args.conn), async {
            let _ = tokio::signal::ctrl_c().await;
            tracing::info!("shutting down");
        })
        .await
        .context("Flight SQL server")?;
    Ok(ExitCode::SUCCESS)
}
