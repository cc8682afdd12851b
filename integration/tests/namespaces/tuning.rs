//! The operator's loop, end to end: a sandbox is blocked, the gateway
//! proposes the rules that would let it through, a shadow of the candidate
//! runs on live traffic, and an approval through the controller opens
//! exactly what was proposed — nothing else.

use serde_json::{json, Value};

use crate::controller::*;
use crate::topology::*;

/// The tenant's policy: deny by default; DNS through 8.8.8.8 (no profile
/// brings the resolver allowance here); other.example.test read-only.
const TENANT_POLICY: &str = r#"{"default": "deny", "tls_interception": "on",
    "allow": [{"ip": "8.8.8.8"}, {"domain": "other.example.test", "http": "read_only"}]}"#;

/// What sb1 tries: `GET https://api.example.test/`, `POST
/// https://other.example.test/v1/x` and `GET https://plain.example.test/`;
/// each answer's HTTP status (0 when refused before any answer), and what
/// curl printed for each.
fn attempts_said(t: &Topology) -> ([u16; 3], [String; 3]) {
    let status = |url: &str, extra: &[&str]| {
        let mut args = vec!["-4", "-o", "/dev/null", "-w", "%{http_code}"];
        args.extend_from_slice(extra);
        let (code, out) = t.curl(&t.sb1, "gateway", url, &args);
        let status = out.get(..3).and_then(|s| s.parse().ok()).unwrap_or(0);
        (status, format!("{url}: curl exit {code}: {}", out.trim()))
    };
    let (a, a_said) = status("https://api.example.test/", &[]);
    let (b, b_said) = status(
        "https://other.example.test/v1/x",
        &["-X", "POST", "-d", "{}"],
    );
    let (c, c_said) = status("https://plain.example.test/", &[]);
    ([a, b, c], [a_said, b_said, c_said])
}

/// The statuses of [`attempts_said`].
fn attempts(t: &Topology) -> [u16; 3] {
    attempts_said(t).0
}

/// Asserts the statuses of [`attempts_said`]; when they differ, says what
/// curl printed, the end of the gateway's log and the flow log's last lines.
fn assert_attempts(t: &Topology, want: [u16; 3], what: &str) {
    let (got, said) = attempts_said(t);
    if got != want {
        let log = std::fs::read_to_string(t.path("gateway.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(40).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        let flows = std::fs::read_to_string(t.path("flows.jsonl")).unwrap_or_default();
        let last: Vec<&str> = flows.lines().rev().take(6).collect();
        panic!(
            "{what}: {got:?}, wanted {want:?}\n{}\n-- the gateway's log, its end:\n{}\n-- the flow log, its last lines:\n{}",
            said.join("\n"),
            tail.join("\n"),
            last.join("\n")
        );
    }
}

/// The proposal whose rule is `rule`, from the controller.
fn proposal(t: &Topology, id: &str, rule: &Value) -> Value {
    let (s, v) = api(
        t,
        "GET",
        &format!("/v1/sandboxes/{id}/proposals"),
        TENANT_TOKEN,
        &[],
        None,
    );
    assert_eq!(s, 200, "{v}");
    v["proposals"]
        .as_array()
        .and_then(|all| all.iter().find(|p| &p["rule"] == rule))
        .cloned()
        .unwrap_or_else(|| panic!("no proposal {rule} in {v}"))
}

#[test]
fn blocked_to_allowed_through_proposals_a_shadow_and_an_approval() {
    if !available() {
        return;
    }
    let Some((socket_dir, port)) = postgres() else {
        return;
    };
    let t = Topology::new();
    let url = fresh_database(&socket_dir, &port, "tuning");
    let _controller = start_controller(&t, &url);
    base_and_worker(&t);
    let body = format!(r#"{{"template": "base", "policy": {TENANT_POLICY}}}"#);
    let (s, v) = api(&t, "POST", "/v1/sandboxes", TENANT_TOKEN, &[], Some(&body));
    assert_eq!(s, 202, "{v}");
    let id = v["sandbox"].as_str().expect("id").to_owned();
    eventually("the push", || {
        t.admin("GET", &format!("/v1/sandboxes/{id}"), None).0 == 200
    });

    // Blocked: the name (reset before any answer) and the request (403).
    assert_attempts(&t, [0, 403, 0], "before");

    // The proposals name both, with the evidence.
    let name = proposal(&t, &id, &json!({"domain": "api.example.test"}));
    let request_rule = json!({"domain": "other.example.test",
        "http": {"methods": ["POST"], "paths": ["/v1/x"]}});
    let request = proposal(&t, &id, &request_rule);
    assert!(name["count"].as_u64() >= Some(1), "{name}");
    assert_eq!(request["examples"][0]["method"], json!("POST"), "{request}");

    // The candidate with both proposals, as a shadow on live traffic: the
    // report shows exactly those two changing, and nothing is enforced.
    let candidate = json!({"policy": {"default": "deny", "tls_interception": "on",
        "allow": [{"ip": "8.8.8.8"}, {"domain": "other.example.test", "http": "read_only"},
                  name["rule"], request_rule]}});
    let shadow = format!("/v1/sandboxes/{id}/shadow");
    let (s, v) = api(
        &t,
        "PUT",
        &shadow,
        TENANT_TOKEN,
        &[],
        Some(&candidate.to_string()),
    );
    assert_eq!(s, 200, "{v}");
    assert_attempts(&t, [0, 403, 0], "a shadow enforced something");
    let (s, report) = api(
        &t,
        "GET",
        &format!("{shadow}/report"),
        TENANT_TOKEN,
        &[],
        None,
    );
    assert_eq!(s, 200, "{report}");
    let changed: Vec<(String, Value, Value)> = report["differences"]
        .as_array()
        .expect("differences")
        .iter()
        .map(|d| {
            let dest = d["destination"].as_str().unwrap_or_default().to_owned();
            (
                dest,
                d["active"]["verdict"].clone(),
                d["shadow"]["verdict"].clone(),
            )
        })
        .collect();
    let dests: std::collections::BTreeSet<&str> =
        changed.iter().map(|(d, _, _)| d.as_str()).collect();
    assert_eq!(
        dests.into_iter().collect::<Vec<_>>(),
        ["api.example.test", "other.example.test"],
        "{report}"
    );
    assert!(
        changed
            .iter()
            .all(|(_, a, s)| a == &json!("deny") && s != &json!("deny")),
        "{report}"
    );
    let (s, v) = api(&t, "DELETE", &shadow, TENANT_TOKEN, &[], None);
    assert_eq!(s, 200, "{v}");

    // Approved for this sandbox: both open, and nothing else does.
    for p in [&name, &request] {
        let pid = p["id"].as_str().expect("pid");
        let path = format!("/v1/sandboxes/{id}/proposals/{pid}/approve");
        let (s, v) = api(
            &t,
            "POST",
            &path,
            TENANT_TOKEN,
            &[],
            Some(r#"{"scope": "sandbox"}"#),
        );
        assert_eq!(s, 201, "{v}");
    }
    eventually("the approvals pushed", || attempts(&t)[..2] == [200, 200]);
    assert_attempts(&t, [200, 200, 0], "after the approval");
    // A GET on the read-only host was allowed before and still is; a PUT
    // (not proposed, not approved) is still refused.
    let (_, put) = t.curl(
        &t.sb1,
        "gateway",
        "https://other.example.test/v1/x",
        &[
            "-4",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "-X",
            "PUT",
            "-d",
            "{}",
        ],
    );
    assert_eq!(put.trim(), "403", "an unapproved method opened");

    // The approval is in the sandbox's provenance, with who approved it.
    let (_, doc) = api(
        &t,
        "GET",
        &format!("/v1/sandboxes/{id}"),
        TENANT_TOKEN,
        &[],
        None,
    );
    let text = doc.to_string();
    assert!(
        text.contains("approval"),
        "no approval in the provenance: {doc}"
    );
    let (_, listed) = api(&t, "GET", "/v1/approvals", TENANT_TOKEN, &[], None);
    assert_eq!(
        listed["approvals"].as_array().map(Vec::len),
        Some(2),
        "{listed}"
    );
    // Another tenant sees none of it.
    let (s, _) = api(
        &t,
        "GET",
        &format!("/v1/sandboxes/{id}/proposals"),
        OTHER_TOKEN,
        &[],
        None,
    );
    assert_eq!(s, 404, "another tenant read the proposals");
}
