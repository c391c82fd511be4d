//! The control endpoint under [`CONTROL_PREFIX`] (the crate docs list its requests): rules
//! set, read and cleared at run time, counters read and reset, all as JSON.

use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;

use crate::body::{full, ProxyBody};
use crate::error::Error;
use crate::injector::Injector;
use crate::proxy::{Shared, CONTROL_PREFIX};
use crate::rules::RuleSet;

/// Rule sets are small; anything larger is a mistake, not rules.
const MAX_BODY: usize = 1 << 20;

/// Answers a request whose path starts with [`CONTROL_PREFIX`].
pub(crate) async fn respond(req: Request<Incoming>, shared: &Shared) -> Response<ProxyBody> {
    let (parts, body) = req.into_parts();
    let (status, json) = match Limited::new(body, MAX_BODY).collect().await {
        Ok(body) => {
            let path = parts
                .uri
                .path()
                .strip_prefix(CONTROL_PREFIX)
                .unwrap_or_default();
            answer(
                &parts.method,
                path,
                &body.to_bytes(),
                &mut shared.injector(),
            )
        }
        Err(e) => (
            StatusCode::BAD_REQUEST,
            error_json(&format!(
                "cannot read the body (at most {MAX_BODY} bytes): {e}"
            )),
        ),
    };
    let mut resp = Response::new(full(json));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// The status and JSON body for a control request on `path` (below the prefix).
fn answer(method: &Method, path: &str, body: &[u8], inj: &mut Injector) -> (StatusCode, String) {
    let rules = |inj: &Injector| (StatusCode::OK, to_json(&inj.rules()));
    match (path, method) {
        ("rules", &Method::GET) => rules(inj),
        ("rules", &Method::PUT) => {
            let replaced = serde_json::from_slice::<RuleSet>(body)
                .map_err(|source| Error::RulesJson { source })
                .and_then(|set| inj.replace(&set));
            match replaced {
                Ok(()) => rules(inj),
                Err(e) => (StatusCode::BAD_REQUEST, error_json(&e.to_string())),
            }
        }
        ("rules", &Method::DELETE) => {
            inj.replace(&RuleSet::default())
                .expect("an empty rule set is valid");
            rules(inj)
        }
        ("counters", &Method::GET) => (StatusCode::OK, to_json(&inj.counters())),
        ("counters", &Method::DELETE) => {
            inj.reset_counters();
            (StatusCode::OK, to_json(&inj.counters()))
        }
        ("rules" | "counters", m) => (
            StatusCode::METHOD_NOT_ALLOWED,
            error_json(&format!(
                "{m} {CONTROL_PREFIX}{path}: expected GET, PUT or DELETE on rules, GET or DELETE on counters"
            )),
        ),
        _ => (
            StatusCode::NOT_FOUND,
            error_json(&format!(
                "no control endpoint {CONTROL_PREFIX}{path}; expected {CONTROL_PREFIX}rules or {CONTROL_PREFIX}counters"
            )),
        ),
    }
}

fn to_json(value: &impl serde::Serialize) -> String {
    serde_json::to_string(value).expect("rules and counters serialize")
}

fn error_json(message: &str) -> String {
    serde_json::json!({ "error": message }).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::counters::Counters;

    fn inj() -> Injector {
        Injector::new(&RuleSet::default()).unwrap()
    }

    #[test]
    fn put_replaces_rules_and_get_reads_them_back() {
        let mut inj = inj();
        let body = br#"{"seed": 9, "rules": [{"name": "x", "fault": {"kind": "reset_after"}}]}"#;
        let (status, json) = answer(&Method::PUT, "rules", body, &mut inj);
        assert_eq!(status, StatusCode::OK, "{json}");
        let (_, json) = answer(&Method::GET, "rules", b"", &mut inj);
        let set: RuleSet = serde_json::from_str(&json).unwrap();
        assert_eq!((set.seed, set.rules.len()), (9, 1));
        let (_, json) = answer(&Method::DELETE, "rules", b"", &mut inj);
        assert!(serde_json::from_str::<RuleSet>(&json)
            .unwrap()
            .rules
            .is_empty());
    }

    #[test]
    fn bad_rules_are_a_400_naming_the_problem() {
        let mut inj = inj();
        let (status, json) = answer(&Method::PUT, "rules", b"{\"rules\": 3}", &mut inj);
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(json.contains("rules are not valid JSON"), "{json}");
        let body = br#"{"rules": [{"key": "(", "fault": {"kind": "reset_after"}}]}"#;
        let (status, json) = answer(&Method::PUT, "rules", body, &mut inj);
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(json.contains("rule rule-0: key `(`"), "{json}");
    }

    #[test]
    fn counters_are_json_and_can_be_reset() {
        let mut inj = inj();
        let (status, json) = answer(&Method::GET, "counters", b"", &mut inj);
        assert_eq!(status, StatusCode::OK);
        assert_eq!(
            serde_json::from_str::<Counters>(&json).unwrap(),
            Counters::default()
        );
        let (status, _) = answer(&Method::DELETE, "counters", b"", &mut inj);
        assert_eq!(status, StatusCode::OK);
    }

    #[test]
    fn unknown_paths_and_methods_are_refused_with_what_exists() {
        let mut inj = inj();
        let (status, json) = answer(&Method::GET, "rulez", b"", &mut inj);
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert!(json.contains("/__fault_proxy/rules"), "{json}");
        let (status, json) = answer(&Method::POST, "counters", b"", &mut inj);
        assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
        assert!(json.contains("GET or DELETE on counters"), "{json}");
    }
}
