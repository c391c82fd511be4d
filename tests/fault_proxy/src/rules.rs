//! Rules as written (JSON or Rust): which requests a rule matches, which of those it fires on,
//! and the fault it injects; checked and compiled once into [`CompiledRule`].

use http::{HeaderMap, HeaderName, Method};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use regex::Regex;
use serde::{Deserialize, Serialize};

use crate::error::Error;

/// Rules in order with the seed of their random choices: what the control endpoint takes.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleSet {
    /// Seed of every random choice (`probability`, `random` faults); same seed, same
    /// sequence of requests → same faults.
    #[serde(default)]
    pub seed: u64,
    /// Evaluated in order; the first rule that fires on a request decides its fault.
    #[serde(default)]
    pub rules: Vec<Rule>,
}

impl RuleSet {
    /// Rules with seed 0.
    pub fn new(rules: Vec<Rule>) -> Self {
        RuleSet { seed: 0, rules }
    }

    /// The same rules with another seed.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }
}

/// One rule: which requests it matches, which of the matches it fires on, and its fault.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// Name in the counters; `rule-<index>` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// HTTP method (`PUT`); any when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    /// Regex searched in the request target, path and query
    /// (`/bucket/ds/_hslake/versions/00000003.json`); anchor it with `^`/`$` if needed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// A header the request must carry (`If-None-Match`: the put-if-absent commits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// First match (1-based) the rule may fire on; 1 when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<u64>,
    /// Last match (inclusive) the rule may fire on; no end when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<u64>,
    /// Chance of firing on a match inside `from..=to`; 1 when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probability: Option<f64>,
    /// What happens to a request the rule fires on.
    pub fault: Fault,
}

impl Rule {
    /// A rule that injects `fault` into every request.
    pub fn new(fault: Fault) -> Self {
        Rule {
            name: None,
            method: None,
            key: None,
            header: None,
            from: None,
            to: None,
            probability: None,
            fault,
        }
    }

    /// Names the rule in the counters.
    pub fn name(mut self, name: &str) -> Self {
        self.name = Some(name.to_string());
        self
    }

    /// Matches only this HTTP method.
    pub fn method(mut self, method: &str) -> Self {
        self.method = Some(method.to_string());
        self
    }

    /// Matches only targets (path and query) in which this regex finds a match.
    pub fn key(mut self, regex: &str) -> Self {
        self.key = Some(regex.to_string());
        self
    }

    /// Matches only requests carrying this header.
    pub fn header(mut self, name: &str) -> Self {
        self.header = Some(name.to_string());
        self
    }

    /// Fires on the `from`-th to the `to`-th match (1-based, inclusive).
    pub fn nth(mut self, from: u64, to: u64) -> Self {
        self.from = Some(from);
        self.to = Some(to);
        self
    }

    /// Fires on a match with probability `p` (seeded, see [`RuleSet::seed`]).
    pub fn probability(mut self, p: f64) -> Self {
        self.probability = Some(p);
        self
    }
}

/// A fault the proxy injects into one request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Fault {
    /// Answer with an S3 error (XML body) without forwarding: 503 `SlowDown`, 500
    /// `InternalError`, or any 4xx/5xx with its `s3_code`.
    Status {
        /// HTTP status; 503 when absent.
        #[serde(default = "default_status")]
        code: u16,
        /// The S3 error code in the body; required for codes other than 500 and 503.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        s3_code: Option<String>,
    },
    /// Reset the connection without forwarding: the store never sees the request.
    ResetBefore,
    /// Forward, let the store apply the request, then reset the connection without answering:
    /// the write landed but the client hears nothing.
    ResetAfter,
    /// Wait `ms` milliseconds before forwarding or before answering.
    Delay {
        /// The wait in milliseconds.
        ms: u64,
        /// Before forwarding (default) or after the store answered.
        #[serde(default)]
        when: DelayPoint,
    },
    /// Send the response headers and the first `bytes` of the body, then close the connection.
    Truncate {
        /// Body bytes passed on; half the response's Content-Length when absent.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        bytes: Option<u64>,
    },
    /// Each fault of `of` on a fraction `p` of the requests the rule fires on (so
    /// `p * len(of)` of them get some fault); `of` empty or absent means every class with
    /// its defaults (see [`Fault::every_class`]).
    Random {
        /// Fraction of requests per fault.
        p: f64,
        /// The faults drawn from.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        of: Vec<Fault>,
    },
}

fn default_status() -> u16 {
    503
}

/// When a [`Fault::Delay`] waits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DelayPoint {
    /// Before the request is forwarded.
    #[default]
    Before,
    /// After the store answered, before the client hears it.
    After,
}

impl Fault {
    /// 503 `SlowDown`, what a throttling S3 answers.
    pub fn slow_down() -> Self {
        Fault::Status {
            code: 503,
            s3_code: None,
        }
    }

    /// 500 `InternalError`.
    pub fn internal_error() -> Self {
        Fault::Status {
            code: 500,
            s3_code: None,
        }
    }

    /// One fault of every class with its defaults: what `random` draws from when `of` is empty.
    pub fn every_class() -> Vec<Fault> {
        vec![
            Fault::slow_down(),
            Fault::internal_error(),
            Fault::ResetBefore,
            Fault::ResetAfter,
            Fault::Delay {
                ms: 100,
                when: DelayPoint::Before,
            },
            Fault::Truncate { bytes: None },
        ]
    }

    /// The counter this fault counts under: `status_503`, `reset_before`, `reset_after`,
    /// `delay`, `truncate` (`random` counts as the fault it draws).
    pub fn class(&self) -> String {
        match self {
            Fault::Status { code, .. } => format!("status_{code}"),
            Fault::ResetBefore => "reset_before".into(),
            Fault::ResetAfter => "reset_after".into(),
            Fault::Delay { .. } => "delay".into(),
            Fault::Truncate { .. } => "truncate".into(),
            Fault::Random { .. } => "random".into(),
        }
    }
}

/// The S3 error code of a status fault's XML body.
pub(crate) fn s3_error_code(code: u16, s3_code: Option<&str>) -> Option<String> {
    match (code, s3_code) {
        (_, Some(c)) => Some(c.to_string()),
        (503, None) => Some("SlowDown".into()),
        (500, None) => Some("InternalError".into()),
        _ => None,
    }
}

/// What a request looks like to the rules.
pub(crate) struct RequestInfo<'a> {
    /// Its method.
    pub(crate) method: &'a Method,
    /// Path and query as sent.
    pub(crate) target: &'a str,
    /// Its headers.
    pub(crate) headers: &'a HeaderMap,
}

/// A checked rule with its match counter and random generator.
pub(crate) struct CompiledRule {
    pub(crate) spec: Rule,
    pub(crate) name: String,
    method: Option<Method>,
    key: Option<Regex>,
    header: Option<HeaderName>,
    from: u64,
    to: u64,
    probability: f64,
    /// The concrete faults a `random` rule draws from (empty otherwise).
    draws: Vec<Fault>,
    draw_p: f64,
    rng: StdRng,
    pub(crate) matched: u64,
}

impl CompiledRule {
    /// Checks `rule` (the `index`-th of its set) and prepares it; errors name the rule and the field.
    pub(crate) fn compile(rule: &Rule, index: usize, seed: u64) -> Result<Self, Error> {
        let name = rule.name.clone().unwrap_or_else(|| format!("rule-{index}"));
        let bad = |what: String| Error::Rule {
            rule: name.clone(),
            what,
        };
        let method = match &rule.method {
            None => None,
            Some(m) => Some(Method::from_bytes(m.to_ascii_uppercase().as_bytes()).map_err(|_| {
                bad(format!(
                    "method `{m}` is not an HTTP method (expected e.g. GET, PUT, POST, HEAD, DELETE)"
                ))
            })?),
        };
        let key =
            match &rule.key {
                None => None,
                Some(k) => Some(Regex::new(k).map_err(|e| {
                    bad(format!("key `{k}` is not a valid regular expression: {e}"))
                })?),
            };
        let header = match &rule.header {
            None => None,
            Some(h) => Some(HeaderName::from_bytes(h.as_bytes()).map_err(|_| {
                bad(format!(
                    "header `{h}` is not a valid header name (expected e.g. If-None-Match)"
                ))
            })?),
        };
        let from = rule.from.unwrap_or(1);
        if from == 0 {
            return Err(bad(
                "from is 0; matches count from 1 (from: 1 is the first match)".into(),
            ));
        }
        let to = rule.to.unwrap_or(u64::MAX);
        if to < from {
            return Err(bad(format!(
                "to ({to}) is before from ({from}); expected from <= to"
            )));
        }
        let probability = rule.probability.unwrap_or(1.0);
        if !(0.0..=1.0).contains(&probability) {
            return Err(bad(format!("probability {probability} is outside 0..=1")));
        }
        let (draws, draw_p) = match &rule.fault {
            Fault::Random { p, of } => {
                let of = if of.is_empty() {
                    Fault::every_class()
                } else {
                    of.clone()
                };
                for f in &of {
                    check_fault(f).map_err(&bad)?;
                }
                let total = p * of.len() as f64;
                if !(*p > 0.0 && total <= 1.0) {
                    return Err(bad(format!(
                        "random: p {p} for each of {} faults; expected 0 < p and p * {} <= 1",
                        of.len(),
                        of.len()
                    )));
                }
                (of, *p)
            }
            f => {
                check_fault(f).map_err(&bad)?;
                (Vec::new(), 0.0)
            }
        };
        // One generator per rule, so adding a rule leaves the others' draws unchanged.
        let rng = StdRng::seed_from_u64(seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        Ok(CompiledRule {
            spec: rule.clone(),
            name,
            method,
            key,
            header,
            from,
            to,
            probability,
            draws,
            draw_p,
            rng,
            matched: 0,
        })
    }

    /// Whether the request is one this rule counts.
    pub(crate) fn matches(&self, req: &RequestInfo<'_>) -> bool {
        self.method.as_ref().is_none_or(|m| m == req.method)
            && self.key.as_ref().is_none_or(|k| k.is_match(req.target))
            && self
                .header
                .as_ref()
                .is_none_or(|h| req.headers.contains_key(h))
    }

    /// Counts a matching request and decides whether, and with which fault, the rule fires.
    pub(crate) fn fire(&mut self) -> Option<Fault> {
        self.matched += 1;
        if self.matched < self.from || self.matched > self.to {
            return None;
        }
        if self.probability < 1.0 && self.rng.random::<f64>() >= self.probability {
            return None;
        }
        if self.draws.is_empty() {
            return Some(self.spec.fault.clone());
        }
        let u: f64 = self.rng.random();
        let i = (u / self.draw_p) as usize;
        self.draws.get(i).cloned()
    }
}

/// Checks one concrete fault's parameters.
fn check_fault(fault: &Fault) -> Result<(), String> {
    match fault {
        Fault::Status { code, s3_code } => {
            if !(400..=599).contains(code) {
                return Err(format!(
                    "status {code} is not an error status; expected 400..=599"
                ));
            }
            if s3_error_code(*code, s3_code.as_deref()).is_none() {
                return Err(format!(
                    "status {code} needs s3_code (the S3 error code of the body, e.g. NoSuchKey); \
                     only 500 and 503 have defaults"
                ));
            }
            Ok(())
        }
        Fault::Random { .. } => Err("random inside random; list concrete faults in `of`".into()),
        Fault::ResetBefore | Fault::ResetAfter | Fault::Delay { .. } | Fault::Truncate { .. } => {
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compile(rule: Rule) -> Result<CompiledRule, Error> {
        CompiledRule::compile(&rule, 0, 7)
    }

    fn req<'a>(method: &'a Method, target: &'a str, headers: &'a HeaderMap) -> RequestInfo<'a> {
        RequestInfo {
            method,
            target,
            headers,
        }
    }

    #[test]
    fn parses_the_documented_json_form() {
        let set: RuleSet = serde_json::from_str(
            r#"{"seed": 3, "rules": [
                {"name": "lost-commit", "method": "PUT", "key": "_hslake/versions/.*\\.json",
                 "header": "If-None-Match", "from": 1, "to": 1, "fault": {"kind": "reset_after"}},
                {"fault": {"kind": "status"}},
                {"fault": {"kind": "delay", "ms": 50, "when": "after"}},
                {"fault": {"kind": "truncate", "bytes": 10}},
                {"probability": 0.5, "fault": {"kind": "random", "p": 0.1}}]}"#,
        )
        .unwrap();
        assert_eq!(set.seed, 3);
        assert_eq!(set.rules[0].fault, Fault::ResetAfter);
        assert_eq!(set.rules[1].fault, Fault::slow_down());
        assert_eq!(
            set.rules[2].fault,
            Fault::Delay {
                ms: 50,
                when: DelayPoint::After
            }
        );
        let back: RuleSet = serde_json::from_str(&serde_json::to_string(&set).unwrap()).unwrap();
        assert_eq!(back, set);
    }

    #[test]
    fn rejects_unknown_fields_and_kinds() {
        let e =
            serde_json::from_str::<Rule>(r#"{"methd": "PUT", "fault": {"kind": "reset_after"}}"#)
                .unwrap_err();
        assert!(e.to_string().contains("unknown field `methd`"), "{e}");
        let e = serde_json::from_str::<Rule>(r#"{"fault": {"kind": "explode"}}"#).unwrap_err();
        assert!(e.to_string().contains("unknown variant `explode`"), "{e}");
    }

    #[test]
    fn rejects_invalid_rules_naming_rule_and_field() {
        let cases = [
            (
                Rule::new(Fault::ResetAfter).key("(").name("r"),
                "rule r: key `(`",
            ),
            (
                Rule::new(Fault::ResetAfter).method("P UT"),
                "rule rule-0: method `P UT`",
            ),
            (
                Rule::new(Fault::ResetAfter).header("If None"),
                "header `If None`",
            ),
            (Rule::new(Fault::ResetAfter).nth(0, 1), "from is 0"),
            (
                Rule::new(Fault::ResetAfter).nth(3, 2),
                "to (2) is before from (3)",
            ),
            (
                Rule::new(Fault::ResetAfter).probability(1.5),
                "probability 1.5",
            ),
            (
                Rule::new(Fault::Status {
                    code: 200,
                    s3_code: None,
                }),
                "status 200 is not an error",
            ),
            (
                Rule::new(Fault::Status {
                    code: 404,
                    s3_code: None,
                }),
                "status 404 needs s3_code",
            ),
            (
                Rule::new(Fault::Random { p: 0.2, of: vec![] }),
                "p * 6 <= 1",
            ),
            (
                Rule::new(Fault::Random {
                    p: 0.1,
                    of: vec![Fault::Random { p: 0.1, of: vec![] }],
                }),
                "random inside random",
            ),
        ];
        for (rule, want) in cases {
            let e = compile(rule)
                .err()
                .expect("rule must be refused")
                .to_string();
            assert!(e.contains(want), "{e:?} should contain {want:?}");
        }
    }

    #[test]
    fn matches_on_method_key_and_header() {
        let rule = compile(
            Rule::new(Fault::ResetAfter)
                .method("put")
                .key(r"_hslake/versions/.*\.json$")
                .header("If-None-Match"),
        )
        .unwrap();
        let mut cond = HeaderMap::new();
        cond.insert("if-none-match", "*".parse().unwrap());
        let none = HeaderMap::new();
        let manifest = "/b/ds/_hslake/versions/00000002.json";
        assert!(rule.matches(&req(&Method::PUT, manifest, &cond)));
        assert!(!rule.matches(&req(&Method::GET, manifest, &cond)));
        assert!(!rule.matches(&req(&Method::PUT, manifest, &none)));
        assert!(!rule.matches(&req(&Method::PUT, "/b/ds/data/0.parquet", &cond)));
    }

    #[test]
    fn fires_on_the_nth_to_mth_match_only() {
        let mut rule = compile(Rule::new(Fault::ResetBefore).nth(2, 3)).unwrap();
        let fired: Vec<bool> = (0..5).map(|_| rule.fire().is_some()).collect();
        assert_eq!(fired, [false, true, true, false, false]);
        assert_eq!(rule.matched, 5);
    }

    #[test]
    fn random_draws_each_class_on_about_p_of_requests_reproducibly() {
        let draw = |seed| {
            let mut r =
                CompiledRule::compile(&Rule::new(Fault::Random { p: 0.1, of: vec![] }), 0, seed)
                    .unwrap();
            (0..20_000)
                .map(|_| r.fire().map(|f| f.class()))
                .collect::<Vec<_>>()
        };
        let a = draw(1);
        assert_eq!(a, draw(1), "same seed, same faults");
        assert_ne!(a, draw(2), "another seed, other faults");
        for class in Fault::every_class().iter().map(Fault::class) {
            let n = a
                .iter()
                .filter(|c| c.as_deref() == Some(class.as_str()))
                .count();
            // 2000 expected; 5 standard deviations is ±212.
            assert!((1788..=2212).contains(&n), "{class}: {n} of 20000");
        }
        let clean = a.iter().filter(|c| c.is_none()).count();
        assert!((7700..=8300).contains(&clean), "no fault: {clean}");
    }

    #[test]
    fn probability_fires_on_about_that_fraction() {
        let mut r = compile(Rule::new(Fault::slow_down()).probability(0.25)).unwrap();
        let n = (0..10_000).filter(|_| r.fire().is_some()).count();
        assert!((2300..=2700).contains(&n), "{n} of 10000");
    }
}
