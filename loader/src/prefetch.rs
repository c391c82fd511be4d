//! The row-group reads of one segment as the pipeline consumes them: started ahead of use in
//! schedule order, each held while picks still need it, and under the skip policy a failed read
//! left out, with its unit counted once however many reads it had.
use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use tokio::task::JoinError;

use crate::plan::Unit;
use crate::rowgroup::RowGroupData;
use crate::{CorruptPolicy, LoaderError, LoaderStats};

/// What a read task returns: its index in the schedule, the unit it read, and the data.
pub(crate) type Loaded = (usize, usize, Result<RowGroupData, LoaderError>);

/// Reads in flight and read, by their index in the schedule.
pub(crate) struct Prefetch<'a, S> {
    loads: S,
    /// Picks each read still serves; a read is dropped after its last.
    uses: Vec<u32>,
    loaded: HashMap<usize, Arc<RowGroupData>>,
    /// Failed reads left out under the skip policy, and the units they read.
    skipped: HashSet<usize>,
    skipped_units: HashSet<usize>,
    units: &'a [Unit],
    on_corrupt: CorruptPolicy,
    stats: Arc<LoaderStats>,
}

impl<'a, S> Prefetch<'a, S>
where
    S: Stream<Item = Result<Loaded, JoinError>> + Unpin,
{
    /// Reads coming in from `loads` in schedule order, `uses[i]` picks needing read `i`.
    pub(crate) fn new(
        loads: S,
        uses: Vec<u32>,
        units: &'a [Unit],
        on_corrupt: CorruptPolicy,
        stats: Arc<LoaderStats>,
    ) -> Self {
        Prefetch {
            loads,
            uses,
            loaded: HashMap::new(),
            skipped: HashSet::new(),
            skipped_units: HashSet::new(),
            units,
            on_corrupt,
            stats,
        }
    }

    /// The data of read `read`, waiting for it (and the reads before it); `None` where it
    /// failed and the skip policy leaves it out.
    pub(crate) async fn get(
        &mut self,
        read: usize,
    ) -> Result<Option<Arc<RowGroupData>>, LoaderError> {
        while !self.loaded.contains_key(&read) && !self.skipped.contains(&read) {
            let Some(next) = self.loads.next().await else {
                return Err(LoaderError::Pipeline(
                    "row-group reads ended before the plan".into(),
                ));
            };
            let (r, u, result) =
                next.map_err(|e| LoaderError::Pipeline(format!("a read task failed: {e}")))?;
            match result {
                Ok(data) => {
                    self.loaded.insert(r, Arc::new(data));
                }
                Err(e) if self.on_corrupt == CorruptPolicy::Skip => {
                    if self.skipped_units.insert(u) {
                        let rows = self.units[u].rows;
                        tracing::warn!("loader: skipping the {rows} samples of: {e}");
                        self.stats
                            .row_groups_skipped
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    self.skipped.insert(r);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(self.loaded.get(&read).cloned())
    }

    /// One pick of read `read` is done; after its last the read's data is let go.
    pub(crate) fn used(&mut self, read: usize) {
        if let Some(n) = self.uses.get_mut(read) {
            *n -= 1;
            if *n == 0 {
                self.loaded.remove(&read);
            }
        }
    }
}
