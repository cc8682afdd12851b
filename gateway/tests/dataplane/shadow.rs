//! Shadow policies on real flows: the active policy decides, the candidate
//! is judged on the same evidence; flow-level and request-level
//! differences reach the flow log, the metric and the report; a spliced
//! flow whose requests the candidate would judge is `unobservable`; a
//! promotion decides the very next flow.

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::*;

const H1: &[&[u8]] = &[b"http/1.1"];

const ACTIVE: &str = r#"{"allow": [{"domain": "api.example.test"}, {"domain": "relay.example.test"}, {"domain": "plain.example.test"}, {"ip": "8.8.8.8"}],
  "tls_interception": "on", "tls_interception_exemptions": [{"domain": "relay.example.test"}]}"#;
const CANDIDATE: &str = r#"{"allow": [{"domain": "api.example.test", "http": "read_only"}, {"domain": "relay.example.test", "http": "read_only"}, {"ip": "8.8.8.8"}],
  "tls_interception": "on", "tls_interception_exemptions": [{"domain": "relay.example.test"}]}"#;

/// One admin call: the status and the JSON body.
async fn admin(e: &Env, method: &str, path: &str, body: Option<String>) -> (u16, Value) {
    let mut s = tokio::net::TcpStream::connect(e.gateway.bound().admin)
        .await
        .expect("admin");
    let body = body.unwrap_or_default();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).await.expect("read");
    let status = out.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = out.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (status, serde_json::from_str(body).unwrap_or(json!(body)))
}

async fn setup() -> Env {
    let e = env(Options::default()).await;
    e.sandbox("a", SANDBOX_A, policy(ACTIVE));
    for name in [
        "api.example.test.",
        "relay.example.test.",
        "plain.example.test.",
    ] {
        e.resolve(SANDBOX_A, name).await;
    }
    let shadow = format!(r#"{{"policy": {CANDIDATE}}}"#);
    let (status, v) = admin(&e, "PUT", "/v1/sandboxes/a/shadow", Some(shadow)).await;
    assert_eq!(status, 200, "{v}");
    e
}

/// The report's entry for `destination` whose shadow side is `shadow`.
fn entry<'a>(report: &'a Value, destination: &str, shadow: &Value) -> &'a Value {
    report["differences"]
        .as_array()
        .expect("differences")
        .iter()
        .find(|d| d["destination"] == destination && d["shadow"]["verdict"] == shadow["verdict"])
        .unwrap_or_else(|| panic!("no {destination} {shadow} in {report}"))
}

#[tokio::test]
async fn flow_and_request_differences_reach_the_log_the_metric_and_the_report() {
    let e = setup().await;
    // Plain HTTP the candidate does not allow: the active policy serves it.
    let tcp = e.connect(SANDBOX_A, e.origins.plain).await;
    let (status, _) = http_get(tcp, false, "plain.example.test", "/x")
        .await
        .expect("get");
    assert_eq!(status, 200, "the active policy decides");
    // A POST the candidate's read_only would refuse, on an intercepted flow.
    let (tls, minted) = e
        .tls(SANDBOX_A, e.origins.api, "api.example.test", H1)
        .await
        .expect("tls");
    assert!(minted);
    // A long path: the report keeps its first 256 characters.
    let long = format!("/write/{}", "x".repeat(4000));
    let (status, _) = http_post(tls, "api.example.test", &long, b"x".to_vec())
        .await
        .expect("post");
    assert_eq!(status, 200, "the active policy lets it through");

    let lines = e.flow_lines(2).await;
    let plain = lines
        .iter()
        .find(|l| l["host"] == "plain.example.test")
        .expect("plain line");
    assert_eq!(plain["verdict"], "allow");
    assert_eq!(plain["shadow"]["verdict"], "deny", "{plain}");
    let api = lines
        .iter()
        .find(|l| l["sni"] == "api.example.test")
        .expect("api line");
    assert_eq!(api["shadow"]["verdict"], "intercept", "{api}");

    let (status, report) = admin(&e, "GET", "/v1/sandboxes/a/shadow/report", None).await;
    assert_eq!(status, 200);
    assert_eq!(report["flows"], 2, "{report}");
    assert_eq!(report["requests"], 2, "{report}");
    let flow = entry(&report, "plain.example.test", &json!({"verdict": "deny"}));
    assert_eq!(flow["active"]["verdict"], "allow");
    assert!(flow["count"].as_u64() >= Some(1));
    assert!(flow["first_seen"].as_str().is_some() && flow["last_seen"].as_str().is_some());
    let request = entry(&report, "api.example.test", &json!({"verdict": "deny"}));
    assert_eq!(request["active"]["verdict"], "allow", "{request}");
    assert_eq!(request["shadow"]["reason"], "http_not_allowed", "{request}");
    assert_eq!(request["example"]["method"], "POST");
    assert_eq!(
        request["example"]["path"],
        long[..256],
        "cut to 256 characters"
    );

    let metrics = scrape(&e).await;
    assert!(
        metrics.contains(r#"egress_shadow_diff_total{active="allow",shadow="deny""#),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_spliced_flow_the_candidate_would_judge_requests_of_is_unobservable() {
    let e = setup().await;
    let (tls, minted) = e
        .tls(SANDBOX_A, e.origins.relay, "relay.example.test", H1)
        .await
        .expect("tls");
    assert!(!minted, "spliced by the exemption");
    let (status, _) = http_get(tls, false, "relay.example.test", "/")
        .await
        .expect("get");
    assert_eq!(status, 200);
    let lines = e.flow_lines(1).await;
    assert_eq!(lines[0]["verdict"], "splice");
    assert_eq!(lines[0]["shadow"], "unobservable", "{}", lines[0]);
    let (_, report) = admin(&e, "GET", "/v1/sandboxes/a/shadow/report", None).await;
    let d = &report["differences"][0];
    assert_eq!(
        (d["destination"].clone(), d["shadow"].clone()),
        (json!("relay.example.test"), json!("unobservable")),
        "{report}"
    );
    let metrics = scrape(&e).await;
    assert!(
        metrics.contains(r#"egress_shadow_diff_total{active="splice",shadow="unobservable",reason="request_rules"} 1"#),
        "{metrics}"
    );
}

#[tokio::test]
async fn the_flow_after_a_promotion_is_decided_by_the_candidate() {
    let e = setup().await;
    let get = || async {
        let tcp = e.connect(SANDBOX_A, e.origins.plain).await;
        http_get(tcp, false, "plain.example.test", "/x")
            .await
            .expect("get")
            .0
    };
    assert_eq!(get().await, 200);
    let (status, v) = admin(&e, "POST", "/v1/sandboxes/a/shadow/promote", None).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        get().await,
        403,
        "the next flow: the promoted policy denies it"
    );
    let lines = e.flow_lines(2).await;
    assert!(
        lines[1].get("shadow").is_none(),
        "no shadow any more: {}",
        lines[1]
    );
}

#[tokio::test]
async fn a_push_that_changes_the_policy_restarts_the_report_and_holds_the_promotion() {
    let e = setup().await;
    let tcp = e.connect(SANDBOX_A, e.origins.plain).await;
    let (status, _) = http_get(tcp, false, "plain.example.test", "/x")
        .await
        .expect("get");
    assert_eq!(status, 200);
    let (_, report) = admin(&e, "GET", "/v1/sandboxes/a/shadow/report", None).await;
    assert_eq!(report["flows"], 1, "{report}");
    let push = |policy: &str| {
        Some(format!(
            r#"{{"addresses": ["{SANDBOX_A}"], "policy": {policy}}}"#
        ))
    };

    // The same policy again: the report goes on.
    let (status, v) = admin(&e, "PUT", "/v1/sandboxes/a", push(ACTIVE)).await;
    assert_eq!(status, 200, "{v}");
    let (_, report) = admin(&e, "GET", "/v1/sandboxes/a/shadow/report", None).await;
    assert_eq!(report["flows"], 1, "{report}");
    assert!(report.get("policy_changed").is_none(), "{report}");

    // Another policy: the report counts from the change, and the
    // candidate, written over the old one, is not promoted.
    let changed = ACTIVE.replace(r#"{"domain": "plain.example.test"}, "#, "");
    let (status, v) = admin(&e, "PUT", "/v1/sandboxes/a", push(&changed)).await;
    assert_eq!(status, 200, "{v}");
    let (_, report) = admin(&e, "GET", "/v1/sandboxes/a/shadow/report", None).await;
    assert_eq!(report["flows"], 0, "{report}");
    assert!(report["policy_changed"].is_string(), "{report}");
    let (_, shadow) = admin(&e, "GET", "/v1/sandboxes/a/shadow", None).await;
    assert_eq!(
        shadow["policy_changed"], report["policy_changed"],
        "{shadow}"
    );
    let (status, v) = admin(&e, "POST", "/v1/sandboxes/a/shadow/promote", None).await;
    assert_eq!(status, 409, "{v}");
    let (_, now) = admin(&e, "GET", "/v1/sandboxes/a", None).await;
    assert_eq!(
        now["policy"]["allow"].as_array().map(Vec::len),
        Some(3),
        "the pushed policy stays: {now}"
    );

    // Put again over the new policy, it is promoted.
    let shadow = format!(r#"{{"policy": {CANDIDATE}}}"#);
    let (status, v) = admin(&e, "PUT", "/v1/sandboxes/a/shadow", Some(shadow)).await;
    assert_eq!(status, 200, "{v}");
    assert!(v.get("policy_changed").is_none(), "{v}");
    let (status, v) = admin(&e, "POST", "/v1/sandboxes/a/shadow/promote", None).await;
    assert_eq!(status, 200, "{v}");
}
