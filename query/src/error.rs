use datafusion::error::DataFusionError;
use hslake_store::format::decode::describe_site;

/// Everything that can go wrong in hslake-query.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum QueryError {
    /// Opening a dataset or reading its manifests failed.
    #[error(transparent)]
    Store(#[from] hslake_store::StoreError),
    /// Planning or running a query failed (bad SQL, unknown column, wrong argument type, ...).
    #[error("{0}")]
    Sql(DataFusionError),
    /// The statement would change something; hslake's SQL is read-only.
    #[error("{statement}: refused, SQL over hslake datasets is read-only (expected a query: SELECT, WITH, EXPLAIN, SHOW, DESCRIBE)")]
    ReadOnly {
        /// The kind of statement that was refused, e.g. `CREATE TABLE`.
        statement: String,
    },
    /// A dataset name (used as a SQL schema) is not a plain identifier or is taken.
    #[error("dataset name {name:?}: {reason}")]
    BadName {
        /// The name given.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The query ran into a limit that protects the process (memory, time, concurrent
    /// queries) and was stopped or refused; nothing else is affected.
    #[error("{what} (limit: {limit}, set by {setting}){detail}")]
    Limit {
        /// What happened, e.g. `query stopped: it ran longer than one query may run`.
        what: String,
        /// The limit in force, e.g. `60 s`.
        limit: String,
        /// The setting that changes it, e.g. `--query-timeout`.
        setting: String,
        /// More about it (the biggest memory consumers), empty or starting with `; `.
        detail: String,
    },
    /// The statement is longer or nests deeper than hslake plans: refused before anything
    /// recurses over it, since planning it could overflow the planner's stack or take too long
    /// ([`crate::planning`]).
    #[error("query refused: {what}; a query may have at most {limit} (a fixed limit of hslake's SQL planner)")]
    TooComplex {
        /// What is too large about it, with its size, e.g. `it nests 1503 levels deep`.
        what: String,
        /// The limit, e.g. `1000 levels`.
        limit: String,
    },
    /// The query was cancelled (its result stream was dropped: the client went away) and
    /// stopped where it was.
    #[error("query cancelled: its result stream was dropped")]
    Cancelled,
    /// A tensor function met a stored value that does not decode (wrong length, corrupt
    /// frames, a checksum that does not match). The session fills in the file and row group
    /// from the sample id before the error reaches the caller.
    #[error("{0}")]
    BadValue(Box<BadTensorValue>),
    /// A worker of a distributed query: its URL is not one, it cannot be reached, or it
    /// refused the query.
    #[error("worker {url}: {reason}")]
    Worker {
        /// The worker's URL as given.
        url: String,
        /// What is wrong.
        reason: String,
    },
    /// A worker's `--allowed-root` list is not one.
    #[error("--allowed-root {root}: {reason}")]
    BadRoot {
        /// The list given.
        root: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A plan sent to a worker names a dataset or store outside the worker's allowed roots.
    #[error(
        "{what} is outside this worker's --allowed-root ({roots}); a worker reads only the \
         shard files of datasets under them"
    )]
    OutsideRoots {
        /// What the plan names, e.g. `dataset file:///home/me/other`.
        what: String,
        /// The worker's roots, comma-separated.
        roots: String,
    },
    /// Writing results failed.
    #[error("writing {format} output: {detail}")]
    Output {
        /// Output format.
        format: String,
        /// What failed.
        detail: String,
    },
}

/// Result with [`QueryError`].
pub type Result<T> = std::result::Result<T, QueryError>;

impl From<datafusion::arrow::error::ArrowError> for QueryError {
    fn from(e: datafusion::arrow::error::ArrowError) -> Self {
        QueryError::Sql(DataFusionError::ArrowError(Box::new(e), None))
    }
}

impl From<DataFusionError> for QueryError {
    fn from(e: DataFusionError) -> Self {
        // Limits travel through DataFusion's streams as external errors; unwrap them so callers
        // can tell a refused query from a wrong one.
        if let DataFusionError::External(inner) = e.find_root() {
            if let Some(QueryError::Limit {
                what,
                limit,
                setting,
                detail,
            }) = inner.downcast_ref::<QueryError>()
            {
                return QueryError::Limit {
                    what: what.clone(),
                    limit: limit.clone(),
                    setting: setting.clone(),
                    detail: detail.clone(),
                };
            }
            match inner.downcast_ref::<QueryError>() {
                Some(QueryError::BadValue(b)) => return QueryError::BadValue(b.clone()),
                Some(QueryError::Cancelled) => return QueryError::Cancelled,
                Some(QueryError::OutsideRoots { what, roots }) => {
                    return QueryError::OutsideRoots {
                        what: what.clone(),
                        roots: roots.clone(),
                    }
                }
                Some(QueryError::Worker { url, reason }) => {
                    return QueryError::Worker {
                        url: url.clone(),
                        reason: reason.clone(),
                    }
                }
                _ => {}
            }
        }
        QueryError::Sql(strip_context(e))
    }
}

/// A stored value a tensor function could not decode, and where it sits.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{function}: {}: {reason}", describe_site(.file, .row_group, .row, .sample_id, .column))]
pub struct BadTensorValue {
    /// The function, e.g. `tensor_norm`.
    pub function: String,
    /// The shard file, where known.
    pub file: Option<String>,
    /// The row group in that file, where known.
    pub row_group: Option<usize>,
    /// The row: in the row group once located, else in the batch the function was given.
    pub row: Option<usize>,
    /// The row's sample id, where the query sees it.
    pub sample_id: Option<u64>,
    /// The column.
    pub column: String,
    /// What is wrong.
    pub reason: String,
}

/// Drop the analyzer-rule names DataFusion wraps around errors (`apply_function_rewrites
/// caused by ...`): users need the message, not the rule that raised it.
fn strip_context(e: DataFusionError) -> DataFusionError {
    match e {
        DataFusionError::Context(_, inner) => strip_context(*inner),
        other => other,
    }
}
