//! Limits that keep one query from taking the process down: a memory pool of its own with a
//! fixed size, a cap on the size of any one value a function builds, and a wall-clock
//! deadline. Each turns into [`QueryError::Limit`], which names the limit and the setting that
//! changes it.
use std::future::Future;
use std::num::NonZeroUsize;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::DataFusionError;
use datafusion::execution::memory_pool::{
    human_readable_size, GreedyMemoryPool, MemoryPool, TrackConsumersPool, UnboundedMemoryPool,
};
use datafusion::execution::{RecordBatchStream, SendableRecordBatchStream};
use datafusion::physical_plan::EmptyRecordBatchStream;
use futures::{Stream, StreamExt};

use crate::QueryError;

/// Command-line flag setting [`QueryLimits::memory_per_query`].
pub const MEMORY_FLAG: &str = "--query-memory";
/// Command-line flag setting [`QueryLimits::timeout`].
pub const TIMEOUT_FLAG: &str = "--query-timeout";
/// Command-line flag setting [`QueryLimits::max_value`].
pub const VALUE_FLAG: &str = "--max-value-size";

/// The per-value cap without a memory limit to derive it from: Arrow's 32-bit offsets hold
/// 2 GiB per array, and a value that size is copied a few times on its way to a client.
pub const DEFAULT_MAX_VALUE: usize = 1 << 30;

/// What one query may use. `None` leaves that resource unbounded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueryLimits {
    /// Bytes the query's operators may reserve (joins, aggregates, sorts); past it the query
    /// stops (operators that can spill to disk do so first).
    pub memory_per_query: Option<usize>,
    /// Wall-clock time from the start of planning to the last batch.
    pub timeout: Option<Duration>,
    /// Bytes of the largest value (string, binary, list, tensor) one function call may build;
    /// `None`: a quarter of `memory_per_query`, or [`DEFAULT_MAX_VALUE`] without one.
    pub max_value: Option<usize>,
}

impl QueryLimits {
    /// Limits for `concurrent` queries running at once on this machine: together they may
    /// reserve a quarter of its memory; no time limit. A quarter, not more, because the pool
    /// sees only operator reservations: an `array_agg` cross join that reserved 2.99 GB held
    /// 6.45 GB resident once its result was built, so reservations are about half of what a
    /// query really holds.
    pub fn for_machine(concurrent: usize) -> Self {
        let memory = machine_memory().unwrap_or(DEFAULT_MACHINE_MEMORY);
        QueryLimits {
            memory_per_query: Some(memory_share(memory, concurrent)),
            timeout: None,
            max_value: None,
        }
    }

    /// The per-value cap in force. A quarter of the query's memory by default: DataFusion
    /// copies a value a few times after the function that built it returns (into a scalar,
    /// into each row of a batch, into the client's message), and those copies are not
    /// counted in the pool.
    pub fn value_cap(&self) -> usize {
        self.max_value
            .or(self.memory_per_query.map(|m| m / 4))
            .unwrap_or(DEFAULT_MAX_VALUE)
    }

    /// A fresh memory pool for one query: its own, so one query's use never counts against
    /// another's, and the biggest consumers are named when it runs out.
    pub fn memory_pool(&self) -> Arc<dyn MemoryPool> {
        match self.memory_per_query {
            Some(bytes) => Arc::new(TrackConsumersPool::new(
                GreedyMemoryPool::new(bytes),
                NonZeroUsize::new(3).unwrap_or(NonZeroUsize::MIN),
            )),
            None => Arc::new(UnboundedMemoryPool::default()),
        }
    }

    /// The deadline of a query starting now, if it has a time limit.
    pub fn deadline(&self) -> Option<Deadline> {
        self.timeout.map(|limit| Deadline {
            at: Instant::now() + limit,
            limit,
        })
    }

    /// `stream` with `deadline` applied and memory errors named as this limit; `cancel` is
    /// set when it is dropped or stopped, so that work still running for it stops too.
    pub fn guard(
        &self,
        stream: SendableRecordBatchStream,
        cancel: Cancel,
        deadline: Option<Deadline>,
    ) -> SendableRecordBatchStream {
        Box::pin(LimitedStream {
            schema: stream.schema(),
            inner: stream,
            cancel,
            deadline: deadline.map(|d| (Box::pin(tokio::time::sleep_until(d.at.into())), d.limit)),
            memory: self.memory_per_query,
            done: false,
        })
    }

    /// The error for a query whose operators asked for more memory than the pool holds.
    pub fn memory_error(&self, detail: &str) -> QueryError {
        QueryError::Limit {
            what: "query stopped: it needs more memory than one query may use".into(),
            limit: match self.memory_per_query {
                Some(b) => format!("{} per query", human_readable_size(b)),
                None => "the memory pool".into(),
            },
            setting: MEMORY_FLAG.into(),
            detail: format!("; {}", detail.trim()),
        }
    }
}

/// When a query must be done by: its start (planning included) plus its time limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadline {
    /// The moment.
    pub at: Instant,
    /// The limit it comes from, for the error.
    pub limit: Duration,
}

/// Memory assumed when the machine's cannot be read (non-Linux).
const DEFAULT_MACHINE_MEMORY: u64 = 8 << 30;

/// The share of `memory` one of `concurrent` queries gets: a quarter of it, split evenly.
pub fn memory_share(memory: u64, concurrent: usize) -> usize {
    let share = memory / 4 / concurrent.max(1) as u64;
    usize::try_from(share).unwrap_or(usize::MAX)
}

/// Memory this process may use: the machine's total, or the cgroup's limit or the process's
/// address-space limit (`ulimit -v`) when lower.
pub fn machine_memory() -> Option<u64> {
    let total = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| meminfo_total(&t));
    let cgroup = std::fs::read_to_string("/sys/fs/cgroup/memory.max")
        .ok()
        .and_then(|t| t.trim().parse::<u64>().ok());
    let address_space = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|t| address_space_limit(&t));
    [total, cgroup, address_space].into_iter().flatten().min()
}

/// The soft `Max address space` of a `/proc/self/limits` text, in bytes; `None` when unlimited.
fn address_space_limit(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("Max address space"))?;
    line["Max address space".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// `MemTotal` of a `/proc/meminfo` text, in bytes.
fn meminfo_total(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// A record-batch stream that ends with a limit error once its deadline passes, dropping the
/// query's own stream (which aborts the tasks it spawned), and that renames memory-pool
/// errors as the per-query memory limit.
struct LimitedStream {
    schema: SchemaRef,
    inner: SendableRecordBatchStream,
    cancel: Cancel,
    deadline: Option<(Pin<Box<tokio::time::Sleep>>, Duration)>,
    memory: Option<usize>,
    done: bool,
}

impl LimitedStream {
    fn stop(&mut self, e: QueryError) -> Poll<Option<Result<RecordBatch, DataFusionError>>> {
        self.done = true;
        self.cancel.cancel();
        self.inner = Box::pin(EmptyRecordBatchStream::new(self.schema.clone()));
        Poll::Ready(Some(Err(DataFusionError::External(Box::new(e)))))
    }
}

impl Stream for LimitedStream {
    type Item = Result<RecordBatch, DataFusionError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        if let Some((sleep, limit)) = self.deadline.as_mut() {
            if sleep.as_mut().poll(cx).is_ready() {
                let e = timeout_error(*limit);
                return self.stop(e);
            }
        }
        match self.inner.poll_next_unpin(cx) {
            Poll::Ready(Some(Err(e))) => {
                if let DataFusionError::ResourcesExhausted(detail) = e.find_root() {
                    let limits = QueryLimits {
                        memory_per_query: self.memory,
                        ..QueryLimits::default()
                    };
                    let e = limits.memory_error(detail);
                    return self.stop(e);
                }
                self.done = true;
                Poll::Ready(Some(Err(e)))
            }
            Poll::Ready(None) => {
                self.done = true;
                Poll::Ready(None)
            }
            other => other,
        }
    }
}

impl Drop for LimitedStream {
    fn drop(&mut self) {
        // Tasks of the query that are still running (each partition's, spawned by DataFusion)
        // are aborted with the stream, but only once they next yield; this stops the
        // functions among them between rows.
        self.cancel.cancel();
    }
}

impl RecordBatchStream for LimitedStream {
    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }
}

/// The error for a query that ran past its time limit.
pub fn timeout_error(limit: Duration) -> QueryError {
    QueryError::Limit {
        what: "query stopped: it ran longer than one query may run".into(),
        limit: format!("{} s", limit.as_secs_f64()),
        setting: TIMEOUT_FLAG.into(),
        detail: String::new(),
    }
}

/// Set once a query's result is no longer wanted (its stream was dropped, its client went
/// away). Functions check it between rows, so a query stops within a row's work instead of at
/// the end of a batch that may take seconds.
#[derive(Debug, Clone, Default)]
pub struct Cancel(Arc<AtomicBool>);

impl Cancel {
    /// Ask the query to stop.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    /// Whether the query was asked to stop.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_memtotal_in_bytes() {
        let text = "MemTotal:       24576000 kB\nMemFree:        1000 kB\n";
        assert_eq!(meminfo_total(text), Some(24576000 * 1024));
        assert_eq!(meminfo_total("MemFree: 3 kB\n"), None);
    }

    #[test]
    fn reads_the_address_space_limit_in_bytes() {
        let limited = "Max stack size            8388608              unlimited            bytes\n\
                       Max address space         4294967296           unlimited            bytes\n";
        assert_eq!(address_space_limit(limited), Some(4 << 30));
        let unlimited =
            "Max address space         unlimited            unlimited            bytes\n";
        assert_eq!(address_space_limit(unlimited), None);
    }

    #[test]
    fn the_value_cap_is_a_quarter_of_the_query_memory_unless_set() {
        let mut limits = QueryLimits::default();
        assert_eq!(limits.value_cap(), DEFAULT_MAX_VALUE);
        limits.memory_per_query = Some(6 << 30);
        assert_eq!(limits.value_cap(), 3 << 29);
        limits.max_value = Some(1000);
        assert_eq!(limits.value_cap(), 1000);
    }

    #[test]
    fn concurrent_queries_share_a_quarter_of_the_memory() {
        assert_eq!(memory_share(24 << 30, 4), 3 << 29);
        assert_eq!(memory_share(8 << 30, 0), 2 << 30);
    }

    #[test]
    fn memory_error_names_the_limit_and_the_flag() {
        let limits = QueryLimits {
            memory_per_query: Some(3 << 30),
            ..QueryLimits::default()
        };
        let e = limits
            .memory_error("Failed to allocate additional 1 MB")
            .to_string();
        assert!(e.contains("3.0 GB per query"), "{e}");
        assert!(e.contains("--query-memory"), "{e}");
        assert!(e.ends_with("Failed to allocate additional 1 MB"), "{e}");
    }
}
