use hslake_store::StoreError;
use thiserror::Error;

/// Everything that can go wrong while loading, each naming the thing that is wrong.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum LoaderError {
    /// A configuration value that cannot work (e.g. rank 2 of world size 2).
    #[error("invalid loader configuration: {0}")]
    Config(String),
    /// An option's value outside its declared range (`LoaderConfig::OPTIONS`), naming the
    /// option, the value and the range.
    #[error("invalid loader option: {0}")]
    Option(hslake_schemas::SchemaError),
    /// A capture point asked for that the dataset does not hold.
    #[error("dataset {url} has no {wanted} (asked for as {role}); it holds {available}")]
    MissingPoint {
        /// The dataset.
        url: String,
        /// The point asked for, e.g. `layer_7`.
        wanted: String,
        /// `aux_layers` or `target`.
        role: &'static str,
        /// The dataset's capture points.
        available: String,
    },
    /// A dataset that lacks a capture point a trainer preset needs.
    #[error("dataset {url} does not fit preset {preset}: missing {missing}; it holds {available}. {hint}")]
    PresetMismatch {
        /// The preset, e.g. `speculators`.
        preset: &'static str,
        /// The dataset.
        url: String,
        /// The missing points, e.g. `layer_29, final_norm`.
        missing: String,
        /// The dataset's capture points.
        available: String,
        /// What the preset expects and how to capture it.
        hint: String,
    },
    /// A file of a trainer-layout export that cannot be written.
    #[error("export {path}: {message}")]
    Export {
        /// The file or directory.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// A resume state that does not belong to this loader's configuration.
    #[error("cannot resume: the saved state has {field} = {saved}, but this loader has {current}")]
    StateMismatch {
        /// The setting that differs.
        field: &'static str,
        /// Its value in the saved state.
        saved: String,
        /// Its value in this loader.
        current: String,
    },
    /// A resume state that cannot be parsed.
    #[error("cannot parse the loader state: {0}")]
    BadState(String),
    /// A shard that cannot be read or decoded.
    #[error("shard {path} (row group {row_group}): {message}")]
    Shard {
        /// The shard file, relative to the dataset root.
        path: String,
        /// The row group.
        row_group: usize,
        /// What went wrong.
        message: String,
    },
    /// A store call that did not finish in time (the store retries transient errors itself).
    #[error(
        "{what} did not finish within {seconds} s; is the storage endpoint reachable? ({hint})"
    )]
    Timeout {
        /// The operation.
        what: String,
        /// The limit.
        seconds: f64,
        /// Where the loader was talking to.
        hint: String,
    },
    /// An error from the store.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The background pipeline stopped unexpectedly (a bug, not bad input).
    #[error("the loader pipeline stopped: {0}")]
    Pipeline(String),
}
