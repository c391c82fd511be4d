//! What the functions of one running query may build, and whether the query is still wanted.
//!
//! DataFusion hands a scalar function the config options its query was planned with
//! (`ScalarFunctionArgs::config_options`), not the query's task context, so the query's memory
//! pool and its cancellation travel in that config as an extension, [`QueryBudget`]: the
//! session's own config holds one with the per-value cap, and each query's copy adds the
//! query's memory pool and cancellation flag ([`crate::QuerySession::execute`]). The capped
//! built-ins ([`crate::capped`]) and the tensor functions ([`crate::udf`]) check every value
//! they build against it before allocating it, and stop between rows once the query is
//! cancelled.
use std::any::Any;
use std::sync::{Arc, LazyLock};

use datafusion::arrow::array::{make_array, Array, ArrayData, ArrayRef};
use datafusion::arrow::buffer::Buffer;
use datafusion::common::config::{ConfigEntry, ConfigExtension, ConfigOptions, ExtensionOptions};
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::memory_pool::{
    human_readable_size, MemoryConsumer, MemoryLimit, MemoryPool, MemoryReservation,
};

use crate::limits::{Cancel, QueryLimits, MEMORY_FLAG, VALUE_FLAG};
use crate::QueryError;

/// The largest value and the total bytes one function call would build, worked out from its
/// arguments before anything is built.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutputBound {
    /// Bytes of the largest single value.
    pub largest: u64,
    /// The row of the batch that holds it.
    pub row: usize,
    /// Bytes of all the call's values together.
    pub total: u64,
}

impl OutputBound {
    /// Count a value of `bytes` in row `row`.
    pub fn add(&mut self, row: usize, bytes: u64) {
        if bytes > self.largest {
            self.largest = bytes;
            self.row = row;
        }
        self.total = self.total.saturating_add(bytes);
    }
}

/// The per-value cap, the query's memory pool and its cancellation, as a DataFusion config
/// extension (`hslake.max_value_bytes` in `information_schema.df_settings`).
///
/// A copy shares the pool and the cancellation flag: both belong to the query, and DataFusion
/// copies its config into every part of the plan.
#[derive(Debug, Clone)]
pub struct QueryBudget {
    max_value: usize,
    pool: Option<Arc<dyn MemoryPool>>,
    cancel: Cancel,
    folding: bool,
}

/// Constants up to this size are always allowed, whatever the memory limit: SQL text rarely
/// holds more, and a limit set very low for a test should not refuse ordinary literals.
pub const SMALL_CONSTANT: usize = 64 << 10;

/// Used where no budget is in the config (a plan made outside [`crate::QuerySession`]).
static UNLIMITED: LazyLock<QueryBudget> =
    LazyLock::new(|| QueryBudget::new(&QueryLimits::default(), None, Cancel::default()));

impl QueryBudget {
    /// The budget of a query under `limits`, with its memory pool (`None`: the session's own
    /// budget, which no query runs under) and cancellation.
    pub fn new(limits: &QueryLimits, pool: Option<Arc<dyn MemoryPool>>, cancel: Cancel) -> Self {
        QueryBudget {
            max_value: limits.value_cap(),
            pool,
            cancel,
            folding: false,
        }
    }

    /// This budget for the functions the optimizer calls while the plan is made, to fold calls
    /// on constants into constants. What such a call builds stays in the plan, outside the
    /// query's memory pool, is copied with the plan and then into every row of a batch: so it
    /// is held to [`Self::max_constant`] of a whole batch, and a call that would build more is
    /// left to run with the query, where the pool and the per-value cap hold
    /// ([`crate::capped`]).
    pub fn folding(&self) -> Self {
        QueryBudget {
            folding: true,
            ..self.clone()
        }
    }

    /// Whether this is the budget of functions folding constants ([`Self::folding`]).
    pub fn is_folding(&self) -> bool {
        self.folding
    }

    /// The largest constant DataFusion may copy into each of `rows` rows: the per-value cap,
    /// or the query's memory split over the rows where that is less, but never below
    /// [`SMALL_CONSTANT`].
    pub fn max_constant(&self, rows: usize) -> usize {
        let per_row = match self.pool.as_ref().map(|p| p.memory_limit()) {
            Some(MemoryLimit::Finite(memory)) => memory / rows.max(1),
            _ => usize::MAX,
        };
        self.max_value.min(per_row).max(SMALL_CONSTANT)
    }

    /// Refuse a constant of `bytes` that DataFusion may copy into each of `rows` rows, if
    /// over [`Self::max_constant`]; `what` says where it comes from (`it holds a constant`,
    /// `query stopped: repeat would build a constant`).
    pub fn check_constant(
        &self,
        what: &str,
        bytes: u64,
        rows: usize,
    ) -> std::result::Result<(), QueryError> {
        let max = self.max_constant(rows);
        if bytes <= max as u64 {
            return Ok(());
        }
        let (limit, setting) = if max == self.max_value {
            (format!("{} per value", human_size(max as u64)), VALUE_FLAG)
        } else {
            let memory = match self.pool.as_ref().map(|p| p.memory_limit()) {
                Some(MemoryLimit::Finite(memory)) => memory,
                _ => usize::MAX,
            };
            (
                format!("{} per query", human_readable_size(memory)),
                MEMORY_FLAG,
            )
        };
        Err(QueryError::Limit {
            what: format!(
                "{what} of {}, which DataFusion copies into each row of a batch (up to {rows} \
                 rows); at most {} is allowed",
                human_size(bytes),
                human_size(max as u64)
            ),
            limit,
            setting: setting.into(),
            detail: String::new(),
        })
    }

    /// The budget a function was planned with.
    pub fn of(config: &ConfigOptions) -> &QueryBudget {
        config.extensions.get::<QueryBudget>().unwrap_or(&UNLIMITED)
    }

    /// The largest value one function call may build, in bytes.
    pub fn max_value(&self) -> usize {
        self.max_value
    }

    /// The query's memory pool, while it runs.
    pub fn pool(&self) -> Option<&Arc<dyn MemoryPool>> {
        self.pool.as_ref()
    }

    /// An error once the query was cancelled.
    pub fn check_cancelled(&self) -> Result<()> {
        if self.cancel.is_cancelled() {
            Err(DataFusionError::External(Box::new(QueryError::Cancelled)))
        } else {
            Ok(())
        }
    }

    /// Admit what `function` would build: its largest value against the per-value cap, then
    /// all of it against the query's memory pool. The reservation holds that memory until it
    /// is dropped: once the values are built, or with them ([`holding`]).
    pub fn admit(&self, function: &str, bound: OutputBound) -> Result<Option<MemoryReservation>> {
        self.check_cancelled()?;
        self.check_value(function, bound.largest, bound.row)?;
        let Some(reservation) = self.reservation(function) else {
            return Ok(None);
        };
        reservation.try_grow(usize::try_from(bound.total).unwrap_or(usize::MAX))?;
        Ok(Some(reservation))
    }

    /// An empty reservation for `function` in the query's memory pool, to grow as it works.
    pub fn reservation(&self, function: &str) -> Option<MemoryReservation> {
        self.pool
            .as_ref()
            .map(|pool| MemoryConsumer::new(function).register(pool))
    }

    /// Refuse a value of `bytes` (in row `row` of the batch) over the per-value cap.
    pub fn check_value(&self, function: &str, bytes: u64, row: usize) -> Result<()> {
        if bytes <= self.max_value as u64 {
            return Ok(());
        }
        Err(DataFusionError::External(Box::new(QueryError::Limit {
            what: format!(
                "query stopped: {function} would build a value of {} (row {row} of its batch), \
                 larger than one value may be",
                human_size(bytes),
            ),
            limit: format!("{} per value", human_readable_size(self.max_value)),
            setting: VALUE_FLAG.into(),
            detail: String::new(),
        })))
    }
}

/// `array` with `reservation` held for as long as any of its buffers lives, shrunk to the
/// array's own size where that is less. A function's result stays counted in the query's pool
/// after the function returns, while the operators above hold it, so another function of the
/// same query cannot reserve that memory again meanwhile. The buffers are shared, not copied.
pub fn holding(array: ArrayRef, reservation: MemoryReservation) -> Result<ArrayRef> {
    let size = array.get_array_memory_size();
    if size < reservation.size() {
        reservation.resize(size);
    }
    let reservation = Arc::new(reservation);
    Ok(make_array(held_data(array.to_data(), &reservation)?))
}

fn held_data(data: ArrayData, reservation: &Arc<MemoryReservation>) -> Result<ArrayData> {
    let buffers = data
        .buffers()
        .iter()
        .map(|b| {
            Buffer::from(bytes::Bytes::from_owner(HeldBuffer {
                buffer: b.clone(),
                _reservation: reservation.clone(),
            }))
        })
        .collect();
    let children = data
        .child_data()
        .iter()
        .map(|c| held_data(c.clone(), reservation))
        .collect::<Result<Vec<_>>>()?;
    Ok(data
        .into_builder()
        .buffers(buffers)
        .child_data(children)
        .build()?)
}

/// One buffer of a function's result and the reservation that counts it.
struct HeldBuffer {
    buffer: Buffer,
    _reservation: Arc<MemoryReservation>,
}

impl AsRef<[u8]> for HeldBuffer {
    fn as_ref(&self) -> &[u8] {
        self.buffer.as_slice()
    }
}

/// `bytes` as DataFusion prints sizes (`1.5 GB`), also past `usize`.
pub fn human_size(bytes: u64) -> String {
    human_readable_size(usize::try_from(bytes).unwrap_or(usize::MAX))
}

impl ExtensionOptions for QueryBudget {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }

    fn cloned(&self) -> Box<dyn ExtensionOptions> {
        Box::new(self.clone())
    }

    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "max_value_bytes" => {
                self.max_value = value.parse().map_err(|e| {
                    DataFusionError::Configuration(format!(
                        "hslake.max_value_bytes {value:?}: {e}; expected a number of bytes"
                    ))
                })?;
                Ok(())
            }
            other => Err(DataFusionError::Configuration(format!(
                "unknown option hslake.{other}; expected hslake.max_value_bytes"
            ))),
        }
    }

    fn entries(&self) -> Vec<ConfigEntry> {
        vec![ConfigEntry {
            key: "hslake.max_value_bytes".into(),
            value: Some(self.max_value.to_string()),
            description: "Largest value (string, binary, list, tensor) one function call may \
                          build; set by --max-value-size",
        }]
    }
}

impl ConfigExtension for QueryBudget {
    const PREFIX: &'static str = "hslake";
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::execution::memory_pool::GreedyMemoryPool;

    fn limits(max_value: usize) -> QueryLimits {
        QueryLimits {
            max_value: Some(max_value),
            ..QueryLimits::default()
        }
    }

    #[test]
    fn a_value_over_the_cap_is_refused_naming_the_function_row_and_flag() {
        let budget = QueryBudget::new(&limits(1000), None, Cancel::default());
        let mut bound = OutputBound::default();
        bound.add(0, 10);
        bound.add(3, 1001);
        let e = QueryError::from(budget.admit("repeat", bound).unwrap_err()).to_string();
        assert_eq!(
            e,
            "query stopped: repeat would build a value of 1001.0 B (row 3 of its batch), larger \
             than one value may be (limit: 1000.0 B per value, set by --max-value-size)"
        );
        bound = OutputBound::default();
        bound.add(0, 1000);
        assert!(budget.admit("repeat", bound).unwrap().is_none());
    }

    #[test]
    fn the_total_is_reserved_in_the_pool_until_dropped() {
        let pool: Arc<dyn MemoryPool> = Arc::new(GreedyMemoryPool::new(100));
        let budget = QueryBudget::new(&limits(1000), Some(pool.clone()), Cancel::default());
        let mut bound = OutputBound::default();
        bound.add(0, 60);
        let held = budget.admit("concat", bound).unwrap();
        assert_eq!(pool.reserved(), 60);
        let e = budget.admit("concat", bound).unwrap_err();
        assert!(
            matches!(e.find_root(), DataFusionError::ResourcesExhausted(_)),
            "{e}"
        );
        drop(held);
        assert_eq!(pool.reserved(), 0);
    }

    #[test]
    fn a_result_keeps_its_reservation_until_its_last_buffer_is_dropped() {
        use datafusion::arrow::array::{ListArray, StringArray};
        use datafusion::arrow::datatypes::Int32Type;

        let pool: Arc<dyn MemoryPool> = Arc::new(GreedyMemoryPool::new(1 << 20));
        let budget = QueryBudget::new(&limits(1 << 20), Some(pool.clone()), Cancel::default());
        let text: ArrayRef = Arc::new(StringArray::from(vec!["a".repeat(1000); 100]));
        let mut bound = OutputBound::default();
        bound.add(0, 1008);
        bound.total = 500_000;
        let reservation = budget.admit("repeat", bound).unwrap().unwrap();
        // Shrunk from the bound to what the array takes.
        let size = text.get_array_memory_size();
        assert!(size > 100_000 && size < 500_000, "{size}");
        let held = holding(text.clone(), reservation).unwrap();
        drop(text);
        assert_eq!(pool.reserved(), size);
        let part = held.slice(10, 5);
        drop(held);
        assert_eq!(pool.reserved(), size, "a slice still holds the buffers");
        assert_eq!(part.len(), 5);
        drop(part);
        assert_eq!(pool.reserved(), 0);

        // Nested values: the list's child buffers are held too, and the values are unchanged.
        let list: ArrayRef = Arc::new(ListArray::from_iter_primitive::<Int32Type, _, _>(vec![
            Some(vec![Some(1), None, Some(3)]),
            None,
            Some(vec![Some(4)]),
        ]));
        let mut bound = OutputBound::default();
        bound.add(0, 64);
        bound.total = 1 << 20;
        let reservation = budget.admit("make_array", bound).unwrap().unwrap();
        let held = holding(list.clone(), reservation).unwrap();
        assert_eq!(held.to_data(), list.to_data());
        assert!(pool.reserved() > 0);
        drop(held);
        assert_eq!(pool.reserved(), 0);
    }

    #[test]
    fn a_cancelled_query_is_refused_anything_more() {
        let cancel = Cancel::default();
        let budget = QueryBudget::new(&limits(1000), None, cancel.clone());
        assert!(budget.check_cancelled().is_ok());
        cancel.cancel();
        let e = QueryError::from(budget.check_cancelled().unwrap_err());
        assert!(matches!(e, QueryError::Cancelled), "{e}");
        assert!(budget.admit("concat", OutputBound::default()).is_err());
    }

    #[test]
    fn the_budget_travels_in_the_config_and_shows_as_a_setting() {
        let mut config = ConfigOptions::new();
        assert_eq!(
            QueryBudget::of(&config).max_value(),
            QueryLimits::default().value_cap()
        );
        config
            .extensions
            .insert(QueryBudget::new(&limits(4096), None, Cancel::default()));
        assert_eq!(QueryBudget::of(&config).max_value(), 4096);
        config.set("hslake.max_value_bytes", "512").unwrap();
        assert_eq!(QueryBudget::of(&config).max_value(), 512);
        let e = config.set("hslake.max_value_bytes", "lots").unwrap_err();
        assert!(e.to_string().contains("expected a number of bytes"), "{e}");
    }
}
