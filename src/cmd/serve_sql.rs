//! `hslake serve-sql`: a read-only Arrow Flight SQL server over named datasets.
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use hslake_query::distributed::{AllowedRoots, WorkerSessions};
use hslake_query::executor::{ExecutorLimits, QueryExecutor};
use hslake_query::flight::HslakeFlightSql;
use hslake_query::QueryLimits;

use hslake_schemas::units::DurationRange;

use super::listen::{grpc, ConnArgs};
use super::sql::{log_limits, LimitArgs, WorkerArgs};

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
    #[arg(
        long = "dataset",
        required_unless_present = "worker",
        conflicts_with = "worker"
    )]
    pub datasets: Vec<String>,
    /// File holding the bearer token clients must present (first line, trimmed); for a
    /// worker, the token its coordinators present (their --worker-token-file).
    #[arg(long)]
    pub token_file: PathBuf,
    /// Serve as a worker of distributed queries instead: run the parts of queries that
    /// coordinators (`hslake sql --workers`, `serve-sql --workers`) send, reading the datasets
    /// they name under --allowed-root; no Flight SQL, no --dataset. --query-memory bounds each query's tasks on this worker together.
    #[arg(long)]
    pub worker: bool,
    /// Where a worker's datasets are, comma-separated folders or S3 locations (e.g.
    /// /data,s3://bucket/runs); required with --worker. A plan that names a dataset outside
    /// them, or anything of a dataset but its shard files, is refused by name.
    #[arg(long, value_name = "URL,...", requires = "worker")]
    pub allowed_root: Option<String>,
    #[command(flatten)]
    pub workers: WorkerArgs,
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
    if args.worker {
        return serve_worker(&args, &token, limits).await;
    }
    let mut session = args.workers.session()?;
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
    grpc_server(&args.conn)
        .max_concurrent_streams(STREAMS_PER_CONNECTION)
        .add_service(hslake_query::flight::flight_service(service))
        .serve_with_incoming_shutdown(grpc::incoming(listener, &args.conn), until_ctrl_c())
        .await
        .context("Flight SQL server")?;
    Ok(ExitCode::SUCCESS)
}

/// Serve the worker's gRPC service until Ctrl-C, under the same connection limits.
async fn serve_worker(args: &Args, token: &str, limits: QueryLimits) -> Result<ExitCode> {
    if args.workers.workers.is_some() {
        bail!("--worker with --workers: a worker runs the tasks it is sent and has no workers");
    }
    // Deny by default: plans travel as plain gRPC, and the token alone does not say that a
    // plan was not rewritten on its way.
    let Some(list) = &args.allowed_root else {
        bail!(
            "--worker needs --allowed-root URL,...: the folders or S3 locations of the datasets \
             this worker may read (it reads nothing else, whatever a plan names)"
        );
    };
    let roots = AllowedRoots::parse(list)?;
    let listener = super::listen::bind(args.bind)?;
    log_limits(&limits);
    tracing::info!(allowed_roots = roots.urls().join(","), addr = %listener.local_addr()?, "distributed SQL worker listening (coordinator token required)");
    let routes = WorkerSessions::new(token, limits, roots).into_routes();
    // No cap on streams per connection: a coordinator runs all of a query's tasks on a worker
    // over one connection, and every request carries its token.
    grpc_server(&args.conn)
        .add_routes(routes)
        .serve_with_incoming_shutdown(grpc::incoming(listener, &args.conn), until_ctrl_c())
        .await
        .context("distributed SQL worker")?;
    Ok(ExitCode::SUCCESS)
}

/// tonic's server as serve-sql runs it: a ping at half the idle timeout, to be answered within
/// the header timeout.
fn grpc_server(conn: &ConnArgs) -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(grpc::keepalive_interval(conn)))
        .http2_keepalive_timeout(Some(conn.header_timeout))
}

async fn until_ctrl_c() {
    let _ = tokio::signal::ctrl_c().await;
    tracing::info!("shutting down");
}
