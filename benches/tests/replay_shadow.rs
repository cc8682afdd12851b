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
    let out = Command::new(env!("CARGO_BIN_EXE_egress-replay"))
        .arg("--log")
        .arg(sample("sample-flows.jsonl"))
        .arg("--shadow")
        .arg(candidate)
        .output()
        .expect("egress-replay runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("a JSON report")
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
