//! The operator CLI, run as a process: JSON on stdout, errors on stderr, exit codes.

use std::io::Write;
use std::process::Command;

use serde_json::{json, Value};

const PROFILES: &str = r#"{
  "audit": {"default": true, "allow": [{"domain": "audit.example.test"}]},
  "sensor": {"allow": [{"domain": "sensor.example.test"}, {"cidr": "198.51.100.0/24"}],
             "tls_interception_exemptions": [{"domain": "sensor.example.test"}]}
}"#;
const EXEMPTIONS: &str =
    r#"[{"domain":"relay.example.test"},{"wildcard_domain":"*.relay.example.test"}]"#;

struct Run {
    code: i32,
    stdout: Option<Value>,
    stderr: String,
}

fn gateway(args: &[&str], env: &[(&str, &str)]) -> Run {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_egress-gateway"));
    cmd.args(args)
        .env_remove("SPACE_EGRESS_PROFILES")
        .env_remove("SPACE_TLS_INTERCEPTION_EXEMPTIONS");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("runs");
    let stdout = String::from_utf8(out.stdout).expect("utf-8");
    Run {
        code: out.status.code().expect("exited"),
        stdout: (!stdout.trim().is_empty())
            .then(|| serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{stdout:?}: {e}"))),
        stderr: String::from_utf8(out.stderr).expect("utf-8"),
    }
}

fn both() -> [(&'static str, &'static str); 2] {
    [
        ("SPACE_EGRESS_PROFILES", PROFILES),
        ("SPACE_TLS_INTERCEPTION_EXEMPTIONS", EXEMPTIONS),
    ]
}

fn file(text: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().expect("temp file");
    f.write_all(text.as_bytes()).expect("write");
    f
}

#[test]
fn check_config_summarises_valid_configuration() {
    let r = gateway(&["policy", "check-config"], &both());
    assert_eq!(r.code, 0, "{}", r.stderr);
    let out = r.stdout.expect("json");
    assert_eq!(
        out["profiles"],
        json!({"enabled": true, "names": ["audit", "sensor"], "defaults": ["audit"]})
    );
    assert_eq!(out["tls_interception_exemptions"]["enabled"], json!(true));
    assert_eq!(
        out["tls_interception_exemptions"]["destinations"][1],
        json!({"wildcard_domain": "*.relay.example.test"})
    );

    let r = gateway(
        &["policy", "check-config"],
        &[("SPACE_EGRESS_PROFILES", "{}")],
    );
    assert_eq!(r.code, 0);
    let out = r.stdout.expect("json");
    assert_eq!(out["profiles"]["enabled"], json!(false));
    assert_eq!(out["tls_interception_exemptions"]["enabled"], json!(false));
}

#[test]
fn check_config_fails_with_the_error_on_stderr() {
    let cases = [
        (
            "SPACE_EGRESS_PROFILES",
            r#"{"Bad": {"allow": [{"ip": "203.0.113.7"}]}}"#,
            "invalid profile name \"Bad\"",
        ),
        (
            "SPACE_EGRESS_PROFILES",
            r#"{"a": {"allow": [{"wildcard_domain": "*.a.test"}]}}"#,
            "profile \"a\": field \"allow[0]\"",
        ),
        ("SPACE_EGRESS_PROFILES", "{", "not valid JSON"),
        ("SPACE_TLS_INTERCEPTION_EXEMPTIONS", "[]", "empty list"),
        (
            "SPACE_TLS_INTERCEPTION_EXEMPTIONS",
            r#"[{"ip": "203.0.113.7"}]"#,
            "ip destinations are not accepted here",
        ),
    ];
    for (var, value, needle) in cases {
        let r = gateway(&["policy", "check-config"], &[(var, value)]);
        assert_eq!(r.code, 1, "{var}={value}");
        assert!(r.stdout.is_none(), "nothing on stdout");
        assert!(
            r.stderr.contains(var) && r.stderr.contains(needle),
            "{var}={value}: {}",
            r.stderr
        );
    }
}

#[test]
fn select_prints_profiles_and_admissions() {
    let env = both();
    let r = gateway(&["policy", "select", "--header", "+sensor -audit"], &env);
    assert_eq!(r.code, 0);
    assert_eq!(
        r.stdout.expect("json"),
        json!({"status": 200, "profiles": ["sensor"], "admissions": [{"profile": "sensor", "outcome": "ok", "reason": "ready"}]})
    );
    // A value that begins with `-`, both spellings.
    for args in [
        &["policy", "select", "--header", "-audit"][..],
        &["policy", "select", "--header=-audit"][..],
    ] {
        let r = gateway(args, &env);
        assert_eq!(r.code, 0, "{args:?}: {}", r.stderr);
        assert_eq!(r.stdout.expect("json")["profiles"], json!([]));
    }
    let r = gateway(&["policy", "select"], &env);
    assert_eq!(
        r.stdout.expect("json")["profiles"],
        json!(["audit"]),
        "absent header: defaults"
    );
}

#[test]
fn select_refusals_are_400_with_a_reason() {
    let env = both();
    let cases = [
        ("", "empty"),
        ("+sensor  -audit", "malformed"),
        (" +sensor", "malformed"),
        ("+sensor +sensor", "repeated"),
        ("+sensor -sensor", "conflicting"),
        ("+nope", "unknown"),
    ];
    for (header, reason) in cases {
        let r = gateway(&["policy", "select", &format!("--header={header}")], &env);
        assert_eq!(r.code, 1, "{header:?}");
        let out = r.stdout.expect("json");
        assert_eq!(out["status"], json!(400), "{header:?}");
        assert_eq!(out["reason"], json!(reason), "{header:?}");
        assert!(out["error"].as_str().is_some_and(|e| !e.is_empty()));
        assert_eq!(out["admissions"][0]["outcome"], json!("failed"));
        assert_eq!(out["admissions"][0]["reason"], json!("invalid_request"));
    }
}

#[test]
fn select_non_federated_selects_nothing() {
    let r = gateway(
        &["policy", "select", "--non-federated", "--header", "+sensor"],
        &both(),
    );
    assert_eq!(r.code, 0);
    assert_eq!(
        r.stdout.expect("json"),
        json!({"status": 200, "profiles": [], "admissions": [{"profile": "unknown", "outcome": "failed", "reason": "invalid_request"}]})
    );
}

#[test]
fn compose_saved_selection_with_deployment_exemptions() {
    let base = file(
        r#"{"default": "deny", "deny": [{"cidr": "198.51.100.0/28"}], "tls_interception": "on"}"#,
    );
    let path = base.path().to_str().expect("utf-8 path");
    let r = gateway(
        &["policy", "compose", "--base", path, "--profiles", "sensor"],
        &both(),
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    let out = r.stdout.expect("json");
    assert_eq!(out["status"], json!(200));
    assert_eq!(out["changed"], json!(true));
    assert_eq!(
        out["policy"],
        json!({
            "default": "deny",
            "allow": [{"domain": "sensor.example.test"}, {"cidr": "198.51.100.0/24"}, {"ip": "8.8.8.8"}, {"ip": "1.1.1.1"}],
            "deny": [{"cidr": "198.51.100.0/28"}],
            "tls_interception": "on",
            "tls_interception_exemptions": [{"domain": "sensor.example.test"}, {"domain": "relay.example.test"}, {"wildcard_domain": "*.relay.example.test"}]
        })
    );
    assert_eq!(
        out["admissions"],
        json!([{"profile": "sensor", "outcome": "ok", "reason": "ready"}])
    );
}

#[test]
fn compose_missing_saved_name_is_503_and_never_applies_defaults() {
    let base = file(r#"{"default": "deny"}"#);
    let path = base.path().to_str().expect("utf-8 path");
    let r = gateway(
        &[
            "policy",
            "compose",
            "--base",
            path,
            "--profiles",
            "sensor,retired",
        ],
        &both(),
    );
    assert_eq!(r.code, 1);
    let out = r.stdout.expect("json");
    assert_eq!(out["status"], json!(503));
    assert_eq!(
        out["admissions"],
        json!([{"profile": "retired", "outcome": "failed", "reason": "unconfigured"}])
    );

    let r = gateway(&["policy", "compose", "--base", path], &both());
    let out = r.stdout.expect("json");
    assert_eq!(
        out["changed"],
        json!(false),
        "no saved names: the default profile is not applied"
    );
    assert_eq!(out["policy"]["allow"], json!([]));
}

#[test]
fn compose_inherited_template_becomes_override_only_when_changed() {
    let exempt = file(
        r#"{"tls_interception": "on", "tls_interception_exemptions": [{"domain": "relay.example.test"}, {"wildcard_domain": "*.relay.example.test"}]}"#,
    );
    let off = file(r#"{"tls_interception": "off"}"#);
    let on = file(r#"{"tls_interception": "on"}"#);
    for (f, want) in [(&exempt, false), (&off, false), (&on, true)] {
        let path = f.path().to_str().expect("utf-8 path");
        let r = gateway(
            &["policy", "compose", "--base", path, "--inherited"],
            &both(),
        );
        let out = r.stdout.expect("json");
        assert_eq!(out["override"], json!(want), "{out}");
        assert_eq!(out["changed"], json!(want));
    }
}

#[test]
fn compose_reports_a_bad_base_file_by_name() {
    let base = file(r#"{"allow": [{"cidr": "203.0.113.1/24"}]}"#);
    let path = base.path().to_str().expect("utf-8 path");
    let r = gateway(&["policy", "compose", "--base", path], &[]);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.contains(path)
            && r.stderr.contains("allow[0]")
            && r.stderr.contains("203.0.113.0/24"),
        "{}",
        r.stderr
    );
    let r = gateway(
        &["policy", "compose", "--base", "/nonexistent/base.json"],
        &[],
    );
    assert_eq!(r.code, 1);
    assert!(r.stderr.contains("/nonexistent/base.json"), "{}", r.stderr);
}

#[test]
fn explain_verdicts() {
    let policy = file(
        r#"{"allow": [{"domain": "api.example.test"}, {"ip": "203.0.113.9"}, {"ip": "203.0.113.8", "streams": ["ssh"]}], "deny": [{"domain": "bad.example.test"}],
            "tls_interception": "on", "tls_interception_exemptions": [{"wildcard_domain": "*.relay.example.test"}],
            "default": "deny"}"#,
    );
    let p = policy.path().to_str().expect("utf-8 path");
    let cases: &[(&[&str], &str, &str)] = &[
        (&["--dst", "169.254.169.254:80"], "deny", "platform_deny"),
        (
            &["--dst", "[::ffff:10.0.0.1]:443", "--tls"],
            "deny",
            "platform_deny",
        ),
        (&["--dst", "203.0.113.9:22"], "allow", "allow_address"),
        (
            &["--dst", "203.0.113.9:22", "--opaque-streams", "deny"],
            "deny",
            "unreadable_stream",
        ),
        (
            &[
                "--dst",
                "203.0.113.8:22",
                "--stream",
                "ssh",
                "--opaque-streams",
                "deny",
            ],
            "allow",
            "allow_address",
        ),
        (
            &[
                "--dst",
                "203.0.113.9:22",
                "--stream",
                "ssh",
                "--opaque-streams",
                "deny",
            ],
            "deny",
            "unreadable_stream",
        ),
        (
            &[
                "--dst",
                "203.0.113.9:443",
                "--tls",
                "--ech",
                "--sni",
                "a.relay.example.test",
                "--attributed",
                "a.relay.example.test",
            ],
            "intercept",
            "ech",
        ),
        (
            &[
                "--dst",
                "203.0.113.9:443",
                "--tls",
                "--sni",
                "a.relay.example.test",
                "--attributed",
                "a.relay.example.test",
            ],
            "splice",
            "exempt",
        ),
        (
            &[
                "--dst",
                "203.0.113.7:443",
                "--tls",
                "--sni",
                "api.example.test",
                "--attributed",
                "api.example.test",
            ],
            "intercept",
            "not_exempt",
        ),
        (
            &[
                "--dst",
                "203.0.113.7:443",
                "--tls",
                "--sni",
                "api.example.test",
            ],
            "intercept",
            "needs_verification",
        ),
        (
            &[
                "--dst",
                "203.0.113.7:443",
                "--tls",
                "--sni",
                "bad.example.test",
            ],
            "deny",
            "tenant_deny",
        ),
        (
            &[
                "--dst",
                "203.0.113.7:443",
                "--tls",
                "--sni",
                "a.relay.example.test",
            ],
            "deny",
            "no_dns_seen",
        ),
        (
            &[
                "--dst",
                "203.0.113.9:443",
                "--tls",
                "--sni",
                "a.relay.example.test",
                "--attributed",
                "a.relay.example.test",
            ],
            "splice",
            "exempt",
        ),
        (
            &[
                "--dst",
                "203.0.113.9:443",
                "--tls",
                "--sni",
                "a.relay.example.test",
            ],
            "intercept",
            "no_dns_seen",
        ),
        (
            &["--dst", "203.0.113.9:443", "--tls", "--sni", "203.0.113.9"],
            "intercept",
            "no_dns_seen",
        ),
        (
            &[
                "--dst",
                "203.0.113.7:80",
                "--host",
                "api.example.test",
                "--attributed",
                "api.example.test",
            ],
            "allow",
            "allow_attributed_name",
        ),
    ];
    for (args, verdict, code) in cases {
        let mut all = vec!["policy", "explain", "--policy", p];
        all.extend_from_slice(args);
        let r = gateway(&all, &[]);
        assert_eq!(r.code, 0, "{args:?}: {}", r.stderr);
        let out = r.stdout.expect("json");
        assert_eq!(
            (out["verdict"].as_str(), out["reason"].as_str()),
            (Some(*verdict), Some(*code)),
            "{args:?}: {out}"
        );
        assert!(
            out["detail"].as_str().is_some_and(|s| s.len() > 10),
            "{out}"
        );
    }
}

#[test]
fn explain_refuses_bad_arguments() {
    let policy = file("{}");
    let p = policy.path().to_str().expect("utf-8 path");
    let r = gateway(
        &["policy", "explain", "--policy", p, "--dst", "203.0.113.7"],
        &[],
    );
    assert_eq!(r.code, 2, "clap usage error: {}", r.stderr);
    for bad in [
        &["--stream", "rdp"][..],
        &["--opaque-streams", "block"],
        &["--ech"],
        &["--tls", "--stream", "ssh"],
    ] {
        let mut args = vec![
            "policy",
            "explain",
            "--policy",
            p,
            "--dst",
            "203.0.113.7:22",
        ];
        args.extend_from_slice(bad);
        let r = gateway(&args, &[]);
        assert_eq!(r.code, 2, "{bad:?}: {}", r.stderr);
    }
    let r = gateway(
        &[
            "policy",
            "explain",
            "--policy",
            p,
            "--dst",
            "203.0.113.7:80",
            "--host",
            "bad_host",
        ],
        &[],
    );
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.contains("--host") && r.stderr.contains("bad_host"),
        "{}",
        r.stderr
    );
    // An SNI the gateway would reset is refused, not read as "no SNI".
    let r = gateway(
        &[
            "policy",
            "explain",
            "--policy",
            p,
            "--dst",
            "203.0.113.7:443",
            "--tls",
            "--sni",
            "bad_sni",
        ],
        &[],
    );
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.contains("--sni")
            && r.stderr.contains("bad_sni")
            && r.stderr.contains("malformed_client_hello"),
        "{}",
        r.stderr
    );
}
