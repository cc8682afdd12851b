//! `egress-replay --shadow`: the sample flow log judged under a candidate
//! that opens one more name reports exactly that destination, and nothing
//! else changes; the sample's own policy changes nothing.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};

fn sample(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("replay")
        .join(name)
}

fn replay(candidate: &Path) -> Value {
    replay_log(&sample("sample-flows.jsonl"), candidate, &[]).0
}

/// `log` judged under `candidate` (with `extra` arguments): the report,
/// and what was said on stderr.
fn replay_log(log: &Path, candidate: &Path, extra: &[&str]) -> (Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_egress-replay"))
        .arg("--log")
        .arg(log)
        .arg("--shadow")
        .arg(candidate)
        .args(extra)
        .output()
        .expect("egress-replay runs");
    let said = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{said}");
    let report = serde_json::from_slice(&out.stdout).expect("a JSON report");
    (report, said)
}

#[test]
fn the_sample_policy_changes_nothing() {
    let r = replay(&sample("sample-policy.json"));
    assert_eq!(r["differences"], json!([]), "{r}");
    assert_eq!(r["unchanged"], r["flows"]);
}

#[test]
fn opening_one_more_name_reports_that_destination_only() {
    let text = std::fs::read_to_string(sample("sample-policy.json")).expect("sample policy");
    let mut policy: Value = serde_json::from_str(&text).expect("json");
    policy["allow"]
        .as_array_mut()
        .expect("an allow list")
        .push(json!({"domain": "unknown.example.test"}));
    let dir = tempfile::tempdir().expect("dir");
    let candidate = dir.path().join("candidate.json");
    std::fs::write(&candidate, policy.to_string()).expect("write");
    let r = replay(&candidate);
    let d = r["differences"].as_array().expect("differences");
    assert_eq!(d.len(), 1, "{r}");
    assert_eq!(d[0]["destination"], "unknown.example.test");
    assert_eq!(
        d[0]["active"],
        json!({"verdict": "deny", "reason": "no_dns_seen"})
    );
    assert_eq!(d[0]["shadow"]["verdict"], "intercept", "{r}");
    let count = d[0]["count"].as_u64().expect("count");
    let (flows, unchanged) = (r["flows"].as_u64(), r["unchanged"].as_u64());
    assert_eq!(
        unchanged.zip(flows).map(|(u, f)| u + count == f),
        Some(true),
        "every other decision is unchanged: {r}"
    );
    assert!(d[0]["example"]["line"].is_u64() && d[0]["first_seen"].is_string());
}

/// A line is judged as the gateway judged its flow: by the protocol it
/// records (an SSH stream the candidate lets through by `streams`), a TLS
/// flow by its ClientHello (not the `Host` of its last request), one
/// sandbox's lines with `--sandbox`; a line the policy never judged
/// (`closed_early`) is counted apart, and one cut short is skipped, not the
/// end of the log.
#[test]
fn a_line_is_judged_as_the_gateway_judged_its_flow() {
    let dir = tempfile::tempdir().expect("dir");
    let line = |v: Value| format!("{v}\n");
    let mut log = String::new();
    log += &line(
        json!({"ts": "2026-12-06T10:00:00Z", "sandbox": "sb1", "dst": "203.0.113.5:22",
        "sni": null, "host": null, "attributed": ["git.test"], "protocol": "ssh",
        "verdict": "deny", "reason": "unreadable_stream"}),
    );
    log += &line(
        json!({"ts": "2026-12-06T10:00:01Z", "sandbox": "sb1", "dst": "203.0.113.6:443",
        "sni": null, "host": "denied.test", "attributed": ["api.test"], "protocol": "tls",
        "verdict": "splice", "reason": "interception_off"}),
    );
    log += &line(
        json!({"ts": "2026-12-06T10:00:02Z", "sandbox": "sb1", "dst": "203.0.113.7:443",
        "sni": null, "host": null, "attributed": [], "verdict": "deny", "reason": "closed_early"}),
    );
    log += &line(
        json!({"ts": "2026-12-06T10:00:03Z", "sandbox": "sb2", "dst": "203.0.113.8:443",
        "sni": "x.test", "host": null, "attributed": [], "protocol": "tls",
        "verdict": "deny", "reason": "no_dns_seen"}),
    );
    let mut bytes = log.into_bytes();
    bytes.extend_from_slice(b"{\"ts\":\"2026-12-06T10:00:04Z\",\"detail\":\"caf\xc3\n");
    bytes.extend_from_slice(
        line(
            json!({"ts": "2026-12-06T10:00:05Z", "sandbox": "sb1", "dst": "203.0.113.9:443",
            "sni": "api.test", "host": null, "attributed": ["api.test"], "protocol": "tls",
            "verdict": "splice", "reason": "interception_off"}),
        )
        .as_bytes(),
    );
    let log_at = dir.path().join("flows.jsonl");
    std::fs::write(&log_at, bytes).expect("write log");
    let candidate = dir.path().join("candidate.json");
    std::fs::write(
        &candidate,
        r#"{"allow": [{"domain": "git.test", "streams": ["ssh"]}, {"domain": "api.test"}],
            "deny": [{"domain": "denied.test"}]}"#,
    )
    .expect("write candidate");
    let (r, said) = replay_log(&log_at, &candidate, &["--sandbox", "sb1"]);
    let d = r["differences"].as_array().expect("differences");
    assert_eq!(d.len(), 1, "{r}");
    assert_eq!(d[0]["destination"], "git.test");
    assert_eq!(d[0]["shadow"]["verdict"], "allow", "{r}");
    assert_eq!(
        (
            &r["unchanged"],
            &r["not_judged"],
            &r["other_sandboxes"],
            &r["flows"]
        ),
        (&json!(2), &json!(1), &json!(1), &json!(5)),
        "{r}"
    );
    assert!(said.contains("1 line(s) skipped"), "{said}");
}

/// A replay connects to every recorded destination: outside a network
/// namespace of its own it refuses, before reading anything.
#[test]
fn a_replay_outside_a_namespace_of_its_own_is_refused() {
    let mine = std::fs::read_link("/proc/self/ns/net").ok();
    if mine.is_none() || mine != std::fs::read_link("/proc/1/ns/net").ok() {
        // Already in a namespace of its own (or PID 1's cannot be read):
        // nothing to refuse here.
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_egress-replay"))
        .arg("--log")
        .arg(sample("sample-flows.jsonl"))
        .args([
            "--gateway-ca",
            "/nonexistent",
            "--origin-ca",
            "/nonexistent",
        ])
        .output()
        .expect("egress-replay runs");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("not in a network namespace of its own"),
        "{err}"
    );
}
