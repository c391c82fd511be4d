//! The decision for each request: which rule fires and with which fault, and the counts.

use std::collections::BTreeMap;

use crate::counters::{Counters, RuleCounters};
use crate::error::Error;
use crate::rules::{CompiledRule, Fault, RequestInfo, RuleSet};

/// The current rules with their counters; one per proxy, behind a lock.
pub(crate) struct Injector {
    seed: u64,
    rules: Vec<CompiledRule>,
    rule_faults: Vec<BTreeMap<String, u64>>,
    requests: u64,
    faults: BTreeMap<String, u64>,
}

/// A fault chosen for one request.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Injection {
    /// The rule that fired.
    pub(crate) rule: String,
    /// The fault to apply (never `random`: that is resolved to what it drew).
    pub(crate) fault: Fault,
}

impl Injector {
    /// An injector with these rules; nothing is changed when one is invalid.
    pub(crate) fn new(set: &RuleSet) -> Result<Self, Error> {
        let mut inj = Injector {
            seed: 0,
            rules: Vec::new(),
            rule_faults: Vec::new(),
            requests: 0,
            faults: BTreeMap::new(),
        };
        inj.replace(set)?;
        Ok(inj)
    }

    /// Replaces the rules (their counters start at 0); the per-class totals carry on.
    /// On error the previous rules stay in force.
    pub(crate) fn replace(&mut self, set: &RuleSet) -> Result<(), Error> {
        let rules = set
            .rules
            .iter()
            .enumerate()
            .map(|(i, r)| CompiledRule::compile(r, i, set.seed))
            .collect::<Result<Vec<_>, _>>()?;
        self.seed = set.seed;
        self.rule_faults = vec![BTreeMap::new(); rules.len()];
        self.rules = rules;
        Ok(())
    }

    /// The rules in force, as set.
    pub(crate) fn rules(&self) -> RuleSet {
        RuleSet {
            seed: self.seed,
            rules: self.rules.iter().map(|r| r.spec.clone()).collect(),
        }
    }

    /// Counts the request and returns the fault of the first rule that fires on it, if any.
    pub(crate) fn decide(&mut self, req: &RequestInfo<'_>) -> Option<Injection> {
        self.requests += 1;
        for (rule, counts) in self.rules.iter_mut().zip(&mut self.rule_faults) {
            if !rule.matches(req) {
                continue;
            }
            if let Some(fault) = rule.fire() {
                let class = fault.class();
                *counts.entry(class.clone()).or_default() += 1;
                *self.faults.entry(class).or_default() += 1;
                return Some(Injection {
                    rule: rule.name.clone(),
                    fault,
                });
            }
        }
        None
    }

    /// A snapshot of every counter.
    pub(crate) fn counters(&self) -> Counters {
        Counters {
            requests: self.requests,
            faults: self.faults.clone(),
            rules: self
                .rules
                .iter()
                .zip(&self.rule_faults)
                .map(|(r, f)| RuleCounters {
                    name: r.name.clone(),
                    matched: r.matched,
                    faults: f.clone(),
                })
                .collect(),
        }
    }

    /// Sets every counter to 0, the rules' match counts included (so `from`/`to` start over).
    pub(crate) fn reset_counters(&mut self) {
        self.requests = 0;
        self.faults.clear();
        for (r, f) in self.rules.iter_mut().zip(&mut self.rule_faults) {
            r.matched = 0;
            f.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use http::{HeaderMap, Method};

    use super::*;
    use crate::rules::Rule;

    fn put(inj: &mut Injector, target: &str) -> Option<String> {
        let headers = HeaderMap::new();
        inj.decide(&RequestInfo {
            method: &Method::PUT,
            target,
            headers: &headers,
        })
        .map(|i| format!("{}:{}", i.rule, i.fault.class()))
    }

    #[test]
    fn first_rule_that_fires_decides_and_later_rules_do_not_count_it() {
        let mut inj = Injector::new(&RuleSet::new(vec![
            Rule::new(Fault::slow_down())
                .key("a")
                .nth(1, 1)
                .name("first"),
            Rule::new(Fault::ResetAfter).name("second"),
        ]))
        .unwrap();
        assert_eq!(put(&mut inj, "/b/a").as_deref(), Some("first:status_503"));
        assert_eq!(put(&mut inj, "/b/a").as_deref(), Some("second:reset_after"));
        assert_eq!(put(&mut inj, "/b/c").as_deref(), Some("second:reset_after"));
        let c = inj.counters();
        assert_eq!(c.requests, 3);
        assert_eq!(c.class("status_503"), 1);
        assert_eq!(c.class("reset_after"), 2);
        assert_eq!(c.rule("first").unwrap().matched, 2);
        assert_eq!(c.rule("second").unwrap().matched, 2);
        assert_eq!(c.rule("second").unwrap().injected(), 2);
    }

    #[test]
    fn invalid_replacement_keeps_the_rules_in_force() {
        let set = RuleSet::new(vec![Rule::new(Fault::ResetBefore)]);
        let mut inj = Injector::new(&set).unwrap();
        let bad = RuleSet::new(vec![Rule::new(Fault::ResetAfter).key("[")]);
        assert!(inj.replace(&bad).is_err());
        assert_eq!(inj.rules(), set);
        assert_eq!(
            put(&mut inj, "/b/x").as_deref(),
            Some("rule-0:reset_before")
        );
    }

    #[test]
    fn replacing_rules_restarts_rule_counts_but_keeps_class_totals() {
        let mut inj = Injector::new(&RuleSet::new(vec![Rule::new(Fault::ResetBefore)])).unwrap();
        put(&mut inj, "/b/x");
        inj.replace(&RuleSet::new(vec![Rule::new(Fault::ResetBefore).nth(1, 1)]))
            .unwrap();
        assert!(
            put(&mut inj, "/b/x").is_some(),
            "a fresh rule starts at match 1"
        );
        let c = inj.counters();
        assert_eq!(c.class("reset_before"), 2);
        assert_eq!(c.rules[0].matched, 1);
        inj.reset_counters();
        assert_eq!(inj.counters().total_faults(), 0);
        assert!(
            put(&mut inj, "/b/x").is_some(),
            "reset counters restart from/to"
        );
    }
}
