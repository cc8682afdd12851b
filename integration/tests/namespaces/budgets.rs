//! Budgets (issue 27) seen from inside a sandbox: a curl loop over its
//! request budget gets `429`s naming the budget, a spliced bulk download is
//! cut (reset) at its byte budget and the next connection refused, and the
//! other sandbox, under the same policy, is not slowed by either.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::topology::*;

/// Sets up a topology, or returns from the test when it cannot run here.
macro_rules! topology {
    () => {{
        if !available() {
            return;
        }
        Topology::new()
    }};
}

/// The request budget: 5 a minute on api.example.test, behind an entry
/// for another name so `rule=` is the covering entry's index, not 0.
const REQUESTS: u64 = 5;

/// One intercepted GET from `ns`: status code and the response head.
fn get(t: &Topology, ns: &str, path: &str) -> (u16, String) {
    let url = format!("https://api.example.test{path}");
    let (code, text) = t.curl(
        ns,
        "gateway",
        &url,
        &["-4", "-D", "-", "-o", "/dev/null", "-w", "%{http_code}\n"],
    );
    assert_eq!(code, 0, "{text}");
    let (head, status) = text.trim_end().rsplit_once('\n').unwrap_or(("", ""));
    (
        status.trim().parse().unwrap_or(0),
        head.to_ascii_lowercase(),
    )
}

#[test]
fn a_loop_over_its_request_budget_gets_429_and_the_other_sandbox_does_not() {
    let t = topology!();
    let policy = format!(
        r#"{{"default": "deny", "tls_interception": "on",
            "allow": [{{"ip": "8.8.8.8"}}, {{"domain": "api.example.test"}}],
            "budgets": [{{"destination": "other.example.test", "requests_per_minute": 100}},
                        {{"destination": "api.example.test", "requests_per_minute": {REQUESTS}}}]}}"#
    );
    t.push("sb1", SB1_IP, &policy);
    t.push("sb2", SB2_IP, &policy);
    // 5 a minute refill one every 12 s: the loop must end well before.
    let started = Instant::now();
    let mut codes = Vec::new();
    let mut denied = Vec::new();
    for i in 0..8 {
        let (status, head) = get(&t, &t.sb1, &format!("/loop/{i}"));
        codes.push(status);
        if status == 429 {
            denied.push(head);
        }
    }
    let took = started.elapsed();
    assert!(took < Duration::from_secs(10), "the loop took {took:?}");
    assert_eq!(
        codes,
        [200, 200, 200, 200, 200, 429, 429, 429],
        "sb1's loop: {denied:?}"
    );
    for head in &denied {
        assert!(
            head.contains("x-egress-denied: budget_exceeded; rule=1"),
            "{head}"
        );
    }
    // sb2, same policy, same minute: a budget of its own, all of it.
    let sb2: Vec<u16> = (0..REQUESTS)
        .map(|i| get(&t, &t.sb2, &format!("/other/{i}")).0)
        .collect();
    assert_eq!(sb2, [200; REQUESTS as usize], "sb2 is not slowed");
    // The flow log: one line per curl, sb1's last three refused by budgets[1].
    let budget_lines = |f: &[serde_json::Value]| {
        f.iter()
            .filter(|l| {
                l["request_denied"]
                    .as_str()
                    .is_some_and(|d| d.starts_with("budget_exceeded budgets[1]"))
            })
            .cloned()
            .collect::<Vec<_>>()
    };
    let flows = t.flows_when(|f| {
        f.iter()
            .filter(|l| l["sni"] == json!("api.example.test"))
            .count()
            >= 8 + REQUESTS as usize
    });
    let refused = budget_lines(&flows);
    assert_eq!(refused.len(), 3, "{flows:?}");
    for l in &refused {
        assert_eq!(l["sandbox"], json!("sb1"), "{l}");
        assert_eq!(l["verdict"], json!("intercept"), "{l}");
        assert_eq!(l["denied_requests"], json!(1), "{l}");
    }
    assert!(
        flows
            .iter()
            .filter(|l| l["sandbox"] == json!("sb2"))
            .all(|l| l.get("request_denied").is_none()),
        "{flows:?}"
    );
}

/// The byte budget of the bulk download: 256 KiB an hour, both directions.
const BUDGET: u64 = 256 * 1024;
/// The body asked for: far more than the budget.
const BODY: u64 = 4 * 1024 * 1024;

/// A spliced download of `/bytes/N` from a.relay.example.test (the origin's
/// own certificate) over HTTP/1.1, so curl tells a reset (56, "reset by
/// peer") from a close (18): its exit code, HTTP status and body bytes
/// received, and what it said.
fn download(t: &Topology, ns: &str, n: u64) -> (i32, u16, u64, String) {
    let url = format!("https://a.relay.example.test/bytes/{n}");
    let (code, text) = t.curl(
        ns,
        "origin",
        &url,
        &[
            "-4",
            "--http1.1",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code} %{size_download}\n",
        ],
    );
    let first = text.lines().next().unwrap_or("");
    let mut it = first.split_whitespace();
    let status = it.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    let size = it.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    (code, status, size, text)
}

#[test]
fn a_spliced_bulk_download_is_cut_at_its_byte_budget_and_the_other_sandbox_is_not() {
    let t = topology!();
    let policy = format!(
        r#"{{"default": "allow", "tls_interception": "on",
            "tls_interception_exemptions": [{{"wildcard_domain": "*.relay.example.test"}}],
            "budgets": [{{"destination": "*.relay.example.test", "bytes_per_hour": {BUDGET}}}]}}"#
    );
    t.push("sb1", SB1_IP, &policy);
    t.push("sb2", SB2_IP, &policy);
    for ns in [&t.sb1, &t.sb2] {
        // Through the reserved resolver: the name is attributed, the flow spliced.
        assert!(t
            .dig(ns, "a.relay.example.test", false)
            .contains("203.0.113.20"));
    }
    // sb1: the download starts (the origin's own certificate verifies: spliced)
    // and is reset where it crosses the budget.
    let (code, status, got, said) = download(&t, &t.sb1, BODY);
    assert_eq!(code, 56, "cut by a reset: {said}");
    assert!(said.contains("reset by peer"), "a reset: {said}");
    assert_eq!(status, 200, "spliced and started: {said}");
    assert!(got > 64 * 1024, "bytes flowed before the cut: {got}");
    assert!(got <= BUDGET, "at most the budget: {got} > {BUDGET}");
    // The next connection to a covered name is refused at connect.
    let (code, status, got, said) = download(&t, &t.sb1, 1024);
    assert_ne!(code, 0, "the next flow is refused: {said}");
    assert_eq!((status, got), (0, 0), "{said}");
    // sb2, its own budget: half of it downloads in full.
    let half = BUDGET / 2;
    let (code, status, got, said) = download(&t, &t.sb2, half);
    assert_eq!((code, status, got), (0, 200, half), "{said}");
    // The flow log: the cut flow names the budget, the next one is a deny.
    let flows = t.flows_when(|f| {
        f.iter()
            .filter(|l| l["sni"] == json!("a.relay.example.test"))
            .count()
            >= 3
    });
    let sb1: Vec<&serde_json::Value> = flows
        .iter()
        .filter(|l| l["sandbox"] == json!("sb1") && l["sni"] == json!("a.relay.example.test"))
        .collect();
    assert!(
        sb1.iter().any(|l| l["verdict"] == json!("splice")
            && l["error"]
                .as_str()
                .is_some_and(|e| e.starts_with("budget_exceeded: budgets[0]"))
            && l["bytes_down"].as_u64().is_some_and(|b| b <= BUDGET)),
        "{sb1:?}"
    );
    assert!(
        sb1.iter()
            .any(|l| l["verdict"] == json!("deny") && l["reason"] == json!("budget_exceeded")),
        "{sb1:?}"
    );
    assert!(
        flows
            .iter()
            .filter(|l| l["sandbox"] == json!("sb2") && l["sni"] == json!("a.relay.example.test"))
            // Spliced and never cut by a budget (a client that resets after
            // its last byte — curl sometimes does — is the client's error).
            .all(|l| l["verdict"] == json!("splice")
                && !l["error"]
                    .as_str()
                    .is_some_and(|e| e.starts_with("budget_exceeded"))),
        "{flows:?}"
    );
}
