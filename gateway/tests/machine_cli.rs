//! `egress-gateway machine-egress check`, run as a process: the normal form
//! or every error on stdout, exit 0 or 1, from a file or standard input.

use std::io::Write;
use std::process::{Command, Stdio};

use serde_json::{json, Value};

fn check(args: &[&str], stdin: Option<&str>) -> (i32, Value) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_egress-gateway"))
        .arg("machine-egress")
        .arg("check")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("runs");
    let mut pipe = child.stdin.take().expect("stdin");
    pipe.write_all(stdin.unwrap_or("").as_bytes())
        .expect("write");
    drop(pipe);
    let out = child.wait_with_output().expect("exits");
    let text = String::from_utf8(out.stdout).expect("utf-8");
    let doc = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    (out.status.code().expect("exit code"), doc)
}

#[test]
fn a_valid_policy_prints_its_normal_form() {
    let mut f = tempfile::NamedTempFile::new().expect("temp file");
    f.write_all(
        br#"{"rules": [{"cidr": "10.0.0.0/8", "proto": "tcp", "port": 5151, "note": "Veyron API"},
                       {"cidr": "91.189.88.7"}]}"#,
    )
    .expect("write");
    let path = f.path().to_str().expect("utf-8");
    let (code, doc) = check(&[path], None);
    assert_eq!(code, 0, "{doc}");
    assert_eq!(
        doc,
        json!({"valid": true, "policy": {"mode": "allowlist", "rules": [
            {"cidr": "10.0.0.0/8", "proto": "tcp", "port": 5151, "note": "Veyron API"},
            {"cidr": "91.189.88.7/32"}]}})
    );
    // Nothing at all: loopback.
    let (code, doc) = check(&["-"], Some("{}"));
    assert_eq!((code, &doc["policy"]["mode"]), (0, &json!("loopback")));
}

#[test]
fn errors_name_the_rule_and_exit_1() {
    let (code, doc) = check(
        &[],
        Some(
            r#"{"mode": "allowlist", "rules": [{"cidr": "10.1.2.3/8"}, {"cidr": "::ffff:1.2.3.4"}, {"cidr": "1.2.3.4", "port": 80}]}"#,
        ),
    );
    assert_eq!(code, 1);
    assert_eq!(doc["valid"], false);
    let errors = doc["errors"].as_array().expect("errors");
    let rules: Vec<&Value> = errors.iter().map(|e| &e["rule"]).collect();
    assert_eq!(rules, [&json!(0), &json!(1), &json!(2)], "{doc}");
    assert!(errors[0]["message"]
        .as_str()
        .expect("message")
        .contains("10.0.0.0/8"));
    // Not a JSON object: the document as a whole (rule null).
    for bad in ["[]", "not json", ""] {
        let (code, doc) = check(&["-"], Some(bad));
        assert_eq!(code, 1, "{bad:?}");
        assert_eq!(doc["errors"][0]["rule"], Value::Null, "{bad:?}: {doc}");
    }
}
