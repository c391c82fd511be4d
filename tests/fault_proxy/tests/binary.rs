//! The `hslake-fault-proxy` process as pytest and scripts use it: endpoint on stdout, port
//! file, rules file, the control endpoint over HTTP, keep-alive, exit when stdin closes.
//! Needs no S3 server: the upstream is a port nobody listens on.

mod support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use hslake_fault_proxy::{Counters, RuleSet};
use support::{request, RawConn};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn binary_prints_its_endpoint_serves_control_and_exits_with_stdin() {
    let dir = tempfile::tempdir().unwrap();
    let rules_file = dir.path().join("rules.json");
    std::fs::write(
        &rules_file,
        r#"{"seed": 5, "rules": [{"name": "slow", "method": "GET", "key": "^/b/slow", "fault": {"kind": "status"}}]}"#,
    )
    .unwrap();
    let port_file = dir.path().join("port");
    let dead_upstream = format!("http://127.0.0.1:{}", free_port());
    let mut child = Command::new(env!("CARGO_BIN_EXE_hslake-fault-proxy"))
        .args([
            "--upstream",
            &dead_upstream,
            "--exit-on-stdin-eof",
            "--port-file",
        ])
        .arg(&port_file)
        .arg("--rules")
        .arg(&rules_file)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut endpoint = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut endpoint)
        .unwrap();
    let endpoint = endpoint.trim().to_string();
    let port: u16 = std::fs::read_to_string(&port_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(endpoint, format!("http://127.0.0.1:{port}"));
    let addr = endpoint.trim_start_matches("http://");

    // The rules file is in force and reads back as given.
    let resp = request(addr, "GET", "/__fault_proxy/rules", b"");
    assert_eq!(resp.status, 200);
    let rules: RuleSet = serde_json::from_slice(&resp.body).unwrap();
    assert_eq!(
        (rules.seed, rules.rules[0].name.as_deref()),
        (5, Some("slow"))
    );

    // Faults and forwarding on one keep-alive connection: the rule answers 503 itself, the
    // other request is forwarded and the dead upstream gives a 502 that names it.
    let mut conn = RawConn::connect(addr);
    let slow = conn.request("GET", "/b/slow/x", b"");
    assert_eq!(slow.status, 503);
    assert!(
        slow.text().contains("<Code>SlowDown</Code>"),
        "{}",
        slow.text()
    );
    let fwd = conn.request("GET", "/b/other", b"");
    assert_eq!(fwd.status, 502);
    assert!(fwd.text().contains(&dead_upstream), "{}", fwd.text());

    let counters: Counters =
        serde_json::from_slice(&request(addr, "GET", "/__fault_proxy/counters", b"").body).unwrap();
    assert_eq!(counters.requests, 2);
    assert_eq!(counters.class("status_503"), 1);
    assert_eq!(counters.rule("slow").unwrap().matched, 1);

    // Bad rules: 400 naming the problem, the old rules stay.
    let bad = request(
        addr,
        "PUT",
        "/__fault_proxy/rules",
        br#"{"rules": [{"to": 0, "fault": {"kind": "reset_before"}}]}"#,
    );
    assert_eq!(bad.status, 400);
    assert!(
        bad.text().contains("to (0) is before from (1)"),
        "{}",
        bad.text()
    );
    let cleared = request(addr, "DELETE", "/__fault_proxy/rules", b"");
    assert_eq!(cleared.status, 200);
    assert_eq!(request(addr, "GET", "/b/slow/x", b"").status, 502);
    let reset = request(addr, "DELETE", "/__fault_proxy/counters", b"");
    let counters: Counters = serde_json::from_slice(&reset.body).unwrap();
    assert_eq!(counters, Counters::default());

    // Closing stdin ends the process cleanly.
    drop(child.stdin.take());
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}");
}

#[test]
fn binary_refuses_a_bad_upstream_and_bad_rules_file_with_the_reason() {
    let out = Command::new(env!("CARGO_BIN_EXE_hslake-fault-proxy"))
        .args(["--upstream", "https://s3.amazonaws.com"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("only plain http"), "{err}");

    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.json");
    std::fs::write(&rules, r#"{"rules": [{"fault": {"kind": "teleport"}}]}"#).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_hslake-fault-proxy"))
        .args(["--upstream", "http://127.0.0.1:9", "--rules"])
        .arg(&rules)
        .stdin(Stdio::piped())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("rules.json") && err.contains("unknown variant `teleport`"),
        "{err}"
    );
}
