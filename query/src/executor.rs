//! Runs a server's queries on a runtime of their own, a bounded number at a time, each stopped
//! as soon as whoever reads its results goes away.
//!
//! Queries execute on a separate tokio runtime so that CPU-bound operators (tensor functions
//! over a cross join keep a core busy for seconds per batch) never starve the runtime that
//! accepts connections and answers the cheap calls: the operating system shares the cores
//! between the two. A semaphore bounds how many queries run at once; a query that cannot get
//! a slot within the queue timeout is refused with an error naming the limit.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::DataFusionError;
use futures::{Stream, StreamExt};
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};

use crate::{Cancel, QueryError, QuerySession, Result};

/// Command-line flag setting [`ExecutorLimits::max_queries`].
pub const MAX_QUERIES_FLAG: &str = "--max-queries";
/// Command-line flag setting [`ExecutorLimits::queue_timeout`].
pub const QUEUE_TIMEOUT_FLAG: &str = "--queue-timeout";

/// How many queries run at once and how long one waits for its turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExecutorLimits {
    /// Queries executing at the same time; more wait in a queue.
    pub max_queries: usize,
    /// How long a query waits for a slot before it is refused.
    pub queue_timeout: Duration,
    /// Worker threads of the query runtime.
    pub threads: usize,
}

impl ExecutorLimits {
    /// Defaults for this machine: two queries per core (at least four), each waiting up to
    /// 30 s, on one worker thread per core.
    pub fn for_machine() -> Self {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        ExecutorLimits {
            max_queries: (2 * cores).max(4),
            queue_timeout: Duration::from_secs(30),
            threads: cores,
        }
    }
}

/// Runs queries of one session under [`ExecutorLimits`] and the session's
/// [`crate::QueryLimits`].
pub struct QueryExecutor {
    // Option so that Drop can hand the runtime to `shutdown_background`: dropping a runtime
    // inside another one's task would panic.
    runtime: Option<tokio::runtime::Runtime>,
    slots: Arc<Semaphore>,
    limits: ExecutorLimits,
    running: Arc<AtomicUsize>,
}

impl QueryExecutor {
    /// Start the query runtime.
    pub fn new(limits: ExecutorLimits) -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(limits.threads.max(1))
            .thread_name("hslake-query")
            .enable_all()
            .build()?;
        Ok(QueryExecutor {
            runtime: Some(runtime),
            slots: Arc::new(Semaphore::new(limits.max_queries.max(1))),
            limits,
            running: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// The limits in force.
    pub fn limits(&self) -> ExecutorLimits {
        self.limits
    }

    /// Queries holding a slot right now (executing or streaming results).
    pub fn running(&self) -> usize {
        self.running.load(Ordering::Relaxed)
    }

    /// Wait for a slot, then plan and start `sql` on the query runtime. The returned stream
    /// yields its batches; dropping it stops the query and frees the slot.
    pub async fn run(&self, session: Arc<QuerySession>, sql: String) -> Result<QueryStream> {
        let permit = self.acquire().await?;
        let runtime = self.runtime.as_ref().ok_or_else(|| {
            QueryError::Sql(DataFusionError::Internal(
                "query runtime already shut down".into(),
            ))
        })?;
        let (schema_tx, schema_rx) = oneshot::channel();
        // Two batches in flight: enough to overlap encoding with execution, and a client
        // that stops reading stops the query instead of filling memory.
        let (tx, rx) = mpsc::channel(2);
        let slot = Slot::new(permit, self.running.clone());
        let cancel = Cancel::default();
        let query = Query {
            session,
            sql,
            cancel: cancel.clone(),
        };
        let task = runtime.spawn(drive(query, schema_tx, tx, slot));
        let mut stream = QueryStream {
            schema: None,
            rx,
            task: Some(task),
            cancel,
            started: Instant::now(),
        };
        match schema_rx.await {
            Ok(Ok(schema)) => {
                stream.schema = Some(schema);
                Ok(stream)
            }
            Ok(Err(e)) => {
                stream.finish();
                Err(e)
            }
            Err(_) => {
                stream.finish();
                Err(QueryError::Sql(DataFusionError::Internal(
                    "the query task ended before planning finished".into(),
                )))
            }
        }
    }

    async fn acquire(&self) -> Result<OwnedSemaphorePermit> {
        let wait = self.slots.clone().acquire_owned();
        match tokio::time::timeout(self.limits.queue_timeout, wait).await {
            Ok(Ok(permit)) => Ok(permit),
            Ok(Err(_)) => Err(QueryError::Sql(DataFusionError::Internal(
                "query slots closed".into(),
            ))),
            Err(_) => Err(QueryError::Limit {
                what: format!(
                    "query refused: the server was running its maximum number of queries for {} s ({QUEUE_TIMEOUT_FLAG}); retry later",
                    self.limits.queue_timeout.as_secs_f64()
                ),
                limit: format!("{} at once", self.limits.max_queries),
                setting: MAX_QUERIES_FLAG.into(),
                detail: String::new(),
            }),
        }
    }
}

impl Drop for QueryExecutor {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// A held concurrency slot, counted in `running` until dropped.
struct Slot {
    _permit: OwnedSemaphorePermit,
    running: Arc<AtomicUsize>,
}

impl Slot {
    fn new(permit: OwnedSemaphorePermit, running: Arc<AtomicUsize>) -> Self {
        running.fetch_add(1, Ordering::Relaxed);
        Slot {
            _permit: permit,
            running,
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.running.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One query to run: its statement, on which session, and the flag that stops it.
struct Query {
    session: Arc<QuerySession>,
    sql: String,
    cancel: Cancel,
}

/// Plan and execute on the query runtime, forwarding batches until the query ends or the
/// receiver is gone. The slot is held exactly as long as this task lives.
async fn drive(
    query: Query,
    schema_tx: oneshot::Sender<Result<SchemaRef>>,
    tx: mpsc::Sender<std::result::Result<RecordBatch, DataFusionError>>,
    _slot: Slot,
) {
    let started = Instant::now();
    let executing = query.session.execute_cancellable(&query.sql, query.cancel);
    let mut stream = match executing.await {
        Ok(s) => s,
        Err(e) => {
            let _ = schema_tx.send(Err(e));
            return;
        }
    };
    if schema_tx.send(Ok(stream.schema())).is_err() {
        return;
    }
    let mut rows = 0;
    while let Some(item) = stream.next().await {
        let elapsed_ms = started.elapsed().as_millis() as u64;
        match &item {
            Ok(b) => rows += b.num_rows(),
            Err(e) => tracing::info!(rows, elapsed_ms, error = %e, "query failed"),
        }
        let failed = item.is_err();
        if tx.send(item).await.is_err() {
            tracing::info!(
                rows,
                elapsed_ms,
                "query cancelled: its client stopped reading"
            );
            return;
        }
        if failed {
            return;
        }
    }
    let elapsed_ms = started.elapsed().as_millis() as u64;
    tracing::info!(rows, elapsed_ms, "query done");
}

/// The batches of a running query. Dropping it before the end cancels the query, so that its
/// functions stop between rows, and aborts the query's task, and with it every task the query
/// spawned, as soon as they yield.
pub struct QueryStream {
    schema: Option<SchemaRef>,
    rx: mpsc::Receiver<std::result::Result<RecordBatch, DataFusionError>>,
    task: Option<tokio::task::JoinHandle<()>>,
    cancel: Cancel,
    started: Instant,
}

impl QueryStream {
    /// The result schema.
    pub fn schema(&self) -> SchemaRef {
        self.schema
            .clone()
            .unwrap_or_else(|| Arc::new(datafusion::arrow::datatypes::Schema::empty()))
    }

    /// The query has ended by itself: nothing to abort.
    fn finish(&mut self) {
        self.task = None;
    }
}

impl Stream for QueryStream {
    type Item = std::result::Result<RecordBatch, DataFusionError>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Self::Item>> {
        let item = self.rx.poll_recv(cx);
        if matches!(item, Poll::Ready(None) | Poll::Ready(Some(Err(_)))) {
            self.finish();
        }
        item
    }
}

impl Drop for QueryStream {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            if !task.is_finished() {
                tracing::info!(
                    elapsed_ms = self.started.elapsed().as_millis() as u64,
                    "query cancelled: its client went away"
                );
            }
            // The task may be inside a batch that takes seconds and yields only at its end;
            // the flag stops it between rows.
            self.cancel.cancel();
            task.abort();
        }
    }
}
