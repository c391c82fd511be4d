//! The counters a loader keeps while it runs.
use std::sync::atomic::AtomicU64;

/// Counters a loader keeps while it runs (shared by all its streams).
#[derive(Debug, Default)]
pub struct LoaderStats {
    /// Row groups read from storage.
    pub row_groups_read: AtomicU64,
    /// Row groups left out under [`crate::CorruptPolicy::Skip`].
    pub row_groups_skipped: AtomicU64,
    /// Samples left out with them.
    pub samples_skipped: AtomicU64,
    /// Batches delivered.
    pub batches: AtomicU64,
}
