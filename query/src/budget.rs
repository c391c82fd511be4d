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

use datafusion::common::config::{ConfigEntry, ConfigExtension, ConfigOptions, ExtensionOptions};
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::memory_pool::{
    human_readable_size, MemoryConsumer, MemoryPool, MemoryReservation,
};

use crate::limits::{Cancel, QueryLimits, VALUE_FLAG};
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
}

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
        }
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
    /// is dropped, which the caller does once the values are built.
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
