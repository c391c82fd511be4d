//! Counters of requests and injected faults, per class and per rule, as tests read them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A snapshot of the counters (`GET /__fault_proxy/counters` returns it as JSON).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    /// Requests seen, control requests excluded.
    pub requests: u64,
    /// Faults injected per class (`status_503`, `reset_after`, ...; see [`crate::Fault::class`]),
    /// since start or the last reset, across rule changes.
    pub faults: BTreeMap<String, u64>,
    /// One entry per current rule, in order.
    pub rules: Vec<RuleCounters>,
}

/// Counters of one rule.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuleCounters {
    /// The rule's name.
    pub name: String,
    /// Requests it matched (method, key and header), fired or not.
    pub matched: u64,
    /// Faults it injected, per class.
    pub faults: BTreeMap<String, u64>,
}

impl Counters {
    /// Faults injected of one class (0 when none).
    pub fn class(&self, class: &str) -> u64 {
        self.faults.get(class).copied().unwrap_or(0)
    }

    /// Faults injected of every class together.
    pub fn total_faults(&self) -> u64 {
        self.faults.values().sum()
    }

    /// The counters of the rule named `name`.
    pub fn rule(&self, name: &str) -> Option<&RuleCounters> {
        self.rules.iter().find(|r| r.name == name)
    }
}

impl RuleCounters {
    /// Faults this rule injected, all classes together.
    pub fn injected(&self) -> u64 {
        self.faults.values().sum()
    }
}
