use hslake_schemas::SchemaError;
use thiserror::Error;

use crate::format::decode::describe_site;

/// Everything a store operation can fail with; each names the dataset, file or sample.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The URL cannot address a dataset.
    #[error("{url}: not a dataset URL: {reason}")]
    InvalidUrl {
        /// The URL given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// No committed manifest at this location.
    #[error("{url}: not an hslake dataset (no manifest under _hslake/versions/)")]
    NotADataset {
        /// The dataset URL.
        url: String,
    },
    /// `create` on a location that already holds a dataset.
    #[error("{url}: a dataset already exists here")]
    AlreadyExists {
        /// The dataset URL.
        url: String,
    },
    /// A version that was never committed.
    #[error("{url}: version {version} does not exist (latest is {latest})")]
    VersionNotFound {
        /// The dataset URL.
        url: String,
        /// The version asked for.
        version: u64,
        /// The newest committed version.
        latest: u64,
    },
    /// A manifest written by a newer hslake.
    #[error("{path}: manifest format version {found} is newer than this build supports ({supported}); upgrade hslake")]
    NewerFormat {
        /// The manifest file.
        path: String,
        /// Its format version.
        found: u32,
        /// The newest this build reads.
        supported: u32,
    },
    /// A manifest of a format this build no longer reads (before the `plane_zstd` encoding).
    #[error("{path}: manifest format version {found} predates this build's tensor encoding (it reads version {supported} and later); rewrite the dataset with the hslake that wrote it")]
    OlderFormat {
        /// The manifest file.
        path: String,
        /// Its format version.
        found: u32,
        /// The oldest version this build reads.
        supported: u32,
    },
    /// An existing dataset whose schema differs from the one expected.
    #[error("{url}: dataset schema differs from the one requested: {detail}")]
    SchemaMismatch {
        /// The dataset URL.
        url: String,
        /// What differs.
        detail: String,
    },
    /// A sample that does not fit the dataset schema.
    #[error("sample {sample_id}: {source}")]
    InvalidSample {
        /// The sample.
        sample_id: u64,
        /// What is wrong.
        source: SchemaError,
    },
    /// A schema that is wrong in itself.
    #[error(transparent)]
    Schema(#[from] SchemaError),
    /// Commits kept conflicting with other writers.
    #[error(
        "{url}: could not commit after {attempts} attempts; other writers kept committing first"
    )]
    CommitContention {
        /// The dataset URL.
        url: String,
        /// Attempts made.
        attempts: u32,
    },
    /// A commit that would put sample ids into the dataset a second time; nothing was committed.
    #[error("{url}: commit refused: {count} sample id(s) {}{shown}; nothing was committed",
        match .version { Some(v) => format!("are already in version {v}"), None => "occur more than once in the commit itself".to_string() },
        shown = show_ids(.examples, *.count))]
    DuplicateSamples {
        /// The dataset URL.
        url: String,
        /// The version that holds them (`None`: the commit's own shards repeat them).
        version: Option<u64>,
        /// How many ids are duplicated.
        count: usize,
        /// The first few of them.
        examples: Vec<u64>,
    },
    /// A commit naming a shard the head already names, or naming one twice.
    #[error("{url}: commit refused: shard {path} {}; nothing was committed",
        match .version { Some(v) => format!("is already in version {v}"), None => "is named twice in the commit".to_string() })]
    DuplicateShard {
        /// The dataset URL.
        url: String,
        /// The shard's path.
        path: String,
        /// The version that names it (`None`: the commit names it twice).
        version: Option<u64>,
    },
    /// A manifest that names one shard more than once: every reader would read and count its
    /// rows that many times, so readers and commits refuse it.
    #[error("{manifest}: shard {path} is named {times} times{}; a manifest names each shard once \
        (`hslake repair {url} --drop-repeats` commits a version without the repeats)",
        match .others { 0 => String::new(), n => format!(" ({n} more shards are named more than once)") })]
    RepeatedShard {
        /// The dataset URL.
        url: String,
        /// The manifest file.
        manifest: String,
        /// The first shard named more than once.
        path: String,
        /// How many times the manifest names it.
        times: u64,
        /// How many other shards it names more than once.
        others: usize,
    },
    /// A manifest larger than any reader takes (`MAX_MANIFEST_BYTES`), refused before it is read.
    #[error(
        "{path}: the manifest is {bytes} bytes, more than the {limit} bytes a manifest may have"
    )]
    ManifestTooLarge {
        /// The manifest file.
        path: String,
        /// Its size.
        bytes: u64,
        /// The most a manifest may have.
        limit: u64,
    },
    /// A commit naming a shard that is not in storage as its entry describes.
    #[error("{url}/{path}: commit refused: {reason}; nothing was committed")]
    ShardMissing {
        /// The dataset URL.
        url: String,
        /// The shard's path.
        path: String,
        /// What was found instead, e.g. `not in storage (deleted by a vacuum with a short grace?)`.
        reason: String,
    },
    /// A commit naming a shard so old that a vacuum committed before the head may be deleting
    /// it (docs/FORMAT.md, `vacuum`): the shard's samples must be written again.
    #[error("{url}/{path}: commit refused: the shard was last modified at {modified}, at or before \
        {cutoff}, the cutoff of the vacuum at version {vacuum_version} (or one before it), which may \
        have deleted it; write its samples again (a writer must commit within vacuum's --grace); \
        nothing was committed")]
    ShardPredatesVacuum {
        /// The dataset URL.
        url: String,
        /// The shard's path.
        path: String,
        /// When the store says the shard was last modified.
        modified: chrono::DateTime<chrono::Utc>,
        /// The cutoff of the vacuums up to the head.
        cutoff: chrono::DateTime<chrono::Utc>,
        /// The newest vacuum's version.
        vacuum_version: u64,
    },
    /// A vacuum that could reach beyond the dataset's own files.
    #[error("{url}: vacuum refused: {reason}")]
    VacuumRefused {
        /// The dataset URL.
        url: String,
        /// Why.
        reason: String,
    },
    /// A sample id that no shard holds.
    #[error("{url}: sample {sample_id} is not in version {version}")]
    SampleNotFound {
        /// The dataset URL.
        url: String,
        /// The id.
        sample_id: u64,
        /// The pinned version.
        version: u64,
    },
    /// A file whose contents are not what its manifest or format promises.
    #[error("{path}: {reason}")]
    Corrupt {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// A stored tensor or scale value that does not decode to what its row and the schema say.
    #[error("{}: {reason}", describe_site(.file, .row_group, .row, .sample_id, .column))]
    BadValue {
        /// The shard file, where known.
        file: Option<String>,
        /// The row group in that file, where known.
        row_group: Option<usize>,
        /// The row in the batch being decoded, where known.
        row: Option<usize>,
        /// The row's sample id, where known.
        sample_id: Option<u64>,
        /// The column.
        column: String,
        /// What is wrong, e.g. `expected shape [8, 64] of bf16, got [3125000, 64]`.
        reason: String,
    },
    /// Object storage failed.
    #[error("{path}: {source}")]
    ObjectStore {
        /// The object.
        path: String,
        /// The storage error.
        source: object_store::Error,
    },
    /// Parquet encoding or decoding failed.
    #[error("{path}: parquet: {source}")]
    Parquet {
        /// The shard.
        path: String,
        /// The parquet error.
        source: parquet::errors::ParquetError,
    },
    /// Arrow failed while building or slicing batches.
    #[error("{context}: arrow: {source}")]
    Arrow {
        /// What was being done.
        context: String,
        /// The arrow error.
        source: arrow_schema::ArrowError,
    },
    /// A writer used after it failed or was closed.
    #[error("{0}")]
    Usage(String),
}

impl StoreError {
    pub(crate) fn os(path: impl ToString, source: object_store::Error) -> Self {
        StoreError::ObjectStore {
            path: path.to_string(),
            source,
        }
    }

    pub(crate) fn pq(path: impl ToString, source: parquet::errors::ParquetError) -> Self {
        StoreError::Parquet {
            path: path.to_string(),
            source,
        }
    }

    pub(crate) fn corrupt(path: impl ToString, reason: impl Into<String>) -> Self {
        StoreError::Corrupt {
            path: path.to_string(),
            reason: reason.into(),
        }
    }

    /// A [`StoreError::BadValue`] of a value that sits at `row` of its row group (decoded from
    /// a batch cut down to it, whose row numbers start elsewhere); other errors unchanged.
    pub fn in_row(self, row: usize) -> Self {
        match self {
            StoreError::BadValue {
                file,
                row_group,
                sample_id,
                column,
                reason,
                ..
            } => StoreError::BadValue {
                file,
                row_group,
                row: Some(row),
                sample_id,
                column,
                reason,
            },
            e => e,
        }
    }
}

/// ` (e.g. 1, 2, 3)`, with `…` where more than those shown exist.
fn show_ids(examples: &[u64], count: usize) -> String {
    let list: Vec<String> = examples.iter().map(u64::to_string).collect();
    let more = if count > examples.len() { ", …" } else { "" };
    format!(" (e.g. {}{more})", list.join(", "))
}

/// Result of store operations.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;
