//! A fault-injecting HTTP proxy for tests: it sits on 127.0.0.1 in front of an S3 endpoint
//! (`moto_server` in the test suite) and, by rule, answers 503 `SlowDown` / 500
//! `InternalError`, resets the connection before forwarding or after the store applied the
//! request (the write lands, the client hears nothing), delays, or cuts a response body short.
//! Everything else it forwards as is, HTTP/1.1 keep-alive, bodies streamed both ways.
//!
//! Rust tests start it in-process; it stops when the handle is dropped:
//!
//! ```no_run
//! use hslake_fault_proxy::{Fault, FaultProxy, Rule, RuleSet};
//!
//! let proxy = FaultProxy::start("http://127.0.0.1:5000").unwrap();
//! // Lose the response of the first put-if-absent manifest write.
//! proxy.set_rules(&RuleSet::new(vec![Rule::new(Fault::ResetAfter)
//!     .name("lost-commit")
//!     .method("PUT")
//!     .key(r"_hslake/versions/.*\.json")
//!     .header("If-None-Match")
//!     .nth(1, 1)])).unwrap();
//! // ... point the S3 client at proxy.endpoint() and run the code under test ...
//! assert_eq!(proxy.counters().class("reset_after"), 1);
//! ```
//!
//! Other processes (pytest, shell) run the binary, `hslake-fault-proxy --upstream URL`, which
//! prints its endpoint and takes the same rules as JSON on its control endpoint
//! (`tests/python/fault_proxy.py` wraps it for pytest):
//!
//! | request | effect |
//! | --- | --- |
//! | `GET /__fault_proxy/rules` | the rules in force |
//! | `PUT /__fault_proxy/rules` | replace them (body: a [`RuleSet`]); 400 names what is wrong |
//! | `DELETE /__fault_proxy/rules` | no rules: every request is forwarded as is |
//! | `GET /__fault_proxy/counters` | the [`Counters`] |
//! | `DELETE /__fault_proxy/counters` | every counter back to 0 |
//!
//! ```json
//! {"seed": 1, "rules": [
//!   {"name": "lost-commit", "method": "PUT", "key": "_hslake/versions/.*\\.json",
//!    "header": "If-None-Match", "from": 1, "to": 1, "fault": {"kind": "reset_after"}},
//!   {"name": "chaos", "fault": {"kind": "random", "p": 0.02}}]}
//! ```
//!
//! The first rule that fires on a request decides its fault; `from`/`to` count a rule's
//! matches from 1, `probability` and `random` draw from a generator seeded per rule. A
//! `truncate` of a response without a body lets the (empty) response through, then closes.
#![deny(missing_docs)]

mod body;
mod conn;
mod control;
mod counters;
mod error;
mod handle;
mod injector;
mod proxy;
mod rules;

pub use counters::{Counters, RuleCounters};
pub use error::Error;
pub use handle::FaultProxy;
pub use proxy::{Proxy, CONTROL_PREFIX};
pub use rules::{DelayPoint, Fault, Rule, RuleSet};
