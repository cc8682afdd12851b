//! Per-request rules and host-bound credentials, from inside a sandbox:
//! real TLS through the gateway's interception, curl over HTTP/1.1 and
//! HTTP/2, and the fake internet's origins recording what reaches them.

use std::time::{Duration, Instant};

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

/// One answer as curl saw it.
#[derive(Debug)]
struct Answer {
    status: u16,
    version: String,
    /// Response headers and body.
    text: String,
}

impl Answer {
    /// The `x-egress-denied` header's value, if any.
    fn denied(&self) -> Option<String> {
        self.text.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("x-egress-denied")
                .then(|| v.trim().to_owned())
        })
    }
}

/// `method url` from sandbox 1 through the gateway (HTTP/2 when `h2`),
/// the path sent as it is written.
fn request(t: &Topology, method: &str, url: &str, h2: bool, extra: &[&str]) -> Answer {
    let version = if h2 { "--http2" } else { "--http1.1" };
    let mut args = vec![
        "-i",
        "--path-as-is",
        version,
        "-X",
        method,
        "-w",
        "\n%{http_code} %{http_version}",
    ];
    args.extend_from_slice(extra);
    let (code, text) = t.curl(&t.sb1, "gateway", url, &args);
    assert_eq!(code, 0, "{method} {url}: {text}");
    let (text, last) = text.trim_end().rsplit_once('\n').unwrap_or(("", ""));
    let (status, version) = last.split_once(' ').unwrap_or(("0", ""));
    Answer {
        status: status.parse().unwrap_or(0),
        version: version.to_owned(),
        text: text.to_owned(),
    }
}

/// What the origins received so far (`METHOD host path authorization=…`).
fn seen_by_origins(t: &Topology) -> Vec<String> {
    let (status, body) = t.http_in_gw("GET", "http://203.0.113.10/_seen", &[], None);
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).expect("seen")
}

/// Polls the flow log until a line satisfies `f`.
fn flow_where(t: &Topology, f: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(line) = t.flows().into_iter().find(|l| f(l)) {
            return line;
        }
        assert!(Instant::now() < deadline, "no such flow: {:#?}", t.flows());
        std::thread::sleep(Duration::from_millis(100));
    }
}

const RULES: &str = r#"{"default": "deny", "tls_interception": "on",
    "allow": [{"ip": "8.8.8.8"},
              {"domain": "api.example.test", "http": "read_only"},
              {"domain": "other.example.test"}],
    "deny": [{"domain": "other.example.test", "http": {"methods": ["POST"], "paths": ["/gists"]}},
             {"domain": "other.example.test", "http": {"paths": ["/audited"]}, "mode": "audit"},
             {"domain": "other.example.test", "http": {"methods": ["GET"], "paths": ["/ws"]}}]}"#;

#[test]
fn read_only_paths_and_audit_are_judged_per_request() {
    let t = topology!();
    t.push("sb1", SB1_IP, RULES);
    for h2 in [false, true] {
        let version = if h2 { "2" } else { "1.1" };
        // Read-only: GET passes, POST is refused on the same host.
        let a = request(&t, "GET", "https://api.example.test/repos", h2, &[]);
        assert_eq!((a.status, a.version.as_str()), (200, version), "{a:?}");
        assert!(a.text.contains("fake internet: GET /repos"), "{a:?}");
        let a = request(
            &t,
            "POST",
            "https://api.example.test/repos",
            h2,
            &["-d", "x"],
        );
        assert_eq!(a.status, 403, "{a:?}");
        assert_eq!(
            a.denied().as_deref(),
            Some("http_not_allowed; rule=1"),
            "{a:?}"
        );
        assert!(a.text.contains(r#""code":"http_not_allowed""#), "{a:?}");
        // Two requests on one connection (curl reuses it after --next): each is judged.
        let bundle = t.ca("gateway");
        let bundle = bundle.to_str().expect("utf-8");
        let flag = if h2 { "--http2" } else { "--http1.1" };
        let (code, text) = t.curl(
            &t.sb1,
            "gateway",
            "https://api.example.test/two",
            &[
                "-i",
                flag,
                "https://api.example.test/one",
                "--next",
                "--cacert",
                bundle,
                "-i",
                flag,
                "-X",
                "DELETE",
                "-w",
                "%{num_connects}",
            ],
        );
        assert_eq!(code, 0, "{text}");
        assert!(text.contains("fake internet: GET /one"), "{text}");
        assert!(
            text.contains("x-egress-denied: http_not_allowed; rule=1"),
            "{text}"
        );
        assert!(
            text.trim_end().ends_with('0'),
            "the second request reused the connection: {text}"
        );
        // A qualified deny on an allowed host, and paths that try to dodge it.
        for (path, code) in [
            ("/gists", "http_deny"),
            ("/%67ists", "http_deny"),
            ("/gist%73/1", "http_deny"),
            // Another case: origins that route without regard to it.
            ("/GISTS", "http_deny"),
            // An authority to origins that read the target as a URI reference.
            ("//gists", "ambiguous_path"),
            // Dot segments read two ways (resolved by some origins, routed
            // as they are by others): refused whenever a rule needs the path.
            ("/x/%2e%2e/gists", "ambiguous_path"),
            ("/./gists/1", "ambiguous_path"),
            ("/gists//../gists", "ambiguous_path"),
        ] {
            let url = format!("https://other.example.test{path}");
            let a = request(&t, "POST", &url, h2, &["-d", "x"]);
            assert_eq!(a.status, 403, "{path}: {a:?}");
            let denied = format!("{code}; rule=0");
            assert_eq!(a.denied().as_deref(), Some(denied.as_str()), "{path}");
        }
        let a = request(
            &t,
            "POST",
            "https://other.example.test/gists;x",
            h2,
            &["-d", "x"],
        );
        assert_eq!(
            a.denied().as_deref(),
            Some("ambiguous_path; rule=0"),
            "{a:?}"
        );
        let a = request(
            &t,
            "POST",
            "https://other.example.test/repos",
            h2,
            &["-d", "x"],
        );
        assert_eq!(a.status, 200, "{a:?}");
        let a = request(&t, "GET", "https://other.example.test/gists", h2, &[]);
        assert_eq!(a.status, 200, "{a:?}");
        // An audited rule lets the request through.
        let a = request(&t, "GET", "https://other.example.test/audited", h2, &[]);
        assert_eq!(a.status, 200, "{a:?}");
    }
    // The origins never saw a refused request.
    let seen = seen_by_origins(&t);
    assert!(
        seen.iter()
            .any(|l| l.starts_with("GET api.example.test /repos")),
        "{seen:?}"
    );
    assert!(
        seen.iter()
            .any(|l| l.starts_with("POST other.example.test /repos")),
        "{seen:?}"
    );
    assert!(
        !seen.iter().any(|l| l.starts_with("POST api.example.test")),
        "{seen:?}"
    );
    assert!(!seen.iter().any(|l| l.contains("DELETE")), "{seen:?}");
    assert!(
        !seen
            .iter()
            .any(|l| l.starts_with("POST other.example.test /gists")
                || l.starts_with("POST other.example.test //gists")
                || l.starts_with("POST other.example.test /%67")),
        "{seen:?}"
    );
    // The flow log says what was refused and what the audit would have refused.
    let line = flow_where(&t, |l| {
        l["would_deny"]
            .as_str()
            .is_some_and(|w| w.contains("/audited"))
    });
    assert_eq!(
        line["would_deny"], "http_deny deny[1]: GET /audited",
        "{line}"
    );
    let line = flow_where(&t, |l| l["denied_requests"].as_u64().is_some());
    assert!(line["request_denied"].is_string(), "{line}");
    let (_, metrics) = t.admin("GET", "/metrics", None);
    assert!(
        metrics.contains(r#"egress_requests_would_deny_total{code="http_deny"} 2"#),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"egress_requests_denied_total{code="http_not_allowed"} 4"#),
        "{metrics}"
    );
    // Explain takes the request.
    let (status, body) = t.admin(
        "POST",
        "/v1/explain",
        Some(
            r#"{"sandbox": "sb1", "dst": "203.0.113.10:443", "tls": true, "sni": "api.example.test",
                "method": "POST", "path": "/a/../repos"}"#,
        ),
    );
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(v["request"]["verdict"], "deny", "{v}");
    assert_eq!(v["request"]["reason"], "http_not_allowed", "{v}");
    assert!(
        v["request"]["detail"]
            .as_str()
            .is_some_and(|d| d.contains("allow[1] domain api.example.test http read_only")),
        "{v}"
    );
}

#[test]
fn websocket_upgrades_are_judged_on_the_upgrade_request() {
    let t = topology!();
    t.push("sb1", SB1_IP, RULES);
    let upgrade = [
        "-H",
        "connection: upgrade",
        "-H",
        "upgrade: websocket",
        "--max-time",
        "3",
    ];
    // Allowed (GET on a read-only host): the origin switches protocols.
    // curl then waits for frames until --max-time, so only the head is read.
    let bundle = t.ca("gateway");
    let ws = |url: &str| {
        let mut args = vec![
            "-si",
            "--http1.1",
            "--cacert",
            bundle.to_str().expect("utf-8"),
        ];
        args.extend_from_slice(&upgrade);
        args.push(url);
        String::from_utf8_lossy(&t.exec(&t.sb1, "curl", &args).stdout).into_owned()
    };
    let head = ws("https://api.example.test/ws");
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    // Refused by the deny for GET /ws on the other host.
    let head = ws("https://other.example.test/ws");
    assert!(head.starts_with("HTTP/1.1 403"), "{head}");
    assert!(
        head.contains("x-egress-denied: http_deny; rule=2"),
        "{head}"
    );
}

#[test]
fn credentials_reach_only_their_hosts_and_never_show() {
    let mut t = topology!();
    let value = "s3cr3t-Value-0123456789-abcdef";
    let secret = t.path("api-token");
    std::fs::write(&secret, format!("{value}\n")).expect("secret");
    // A resync (the controller's PUT of every sandbox) writes the snapshot.
    let doc = format!(
        r#"{{"sandboxes": [{{"id": "sb1", "addresses": ["{SB1_IP}", "{SB1_IP6}"],
            "policy": {{"default": "deny", "tls_interception": "on",
                "allow": [{{"ip": "8.8.8.8"}}, {{"domain": "api.example.test"}}, {{"domain": "other.example.test"}}],
                "tls_interception_exemptions": [{{"domain": "api.example.test"}}]}},
            "credentials": [{{"name": "api", "placeholder": "EGRESS_PH_API_0001", "hosts": ["api.example.test"],
                "inject": {{"header": "authorization", "format": "Bearer {{value}}"}},
                "source": {{"file": "{}"}}, "require": true}}]}}]}}"#,
        secret.display()
    );
    let (status, body) = t.admin("PUT", "/v1/sandboxes", Some(&doc));
    assert_eq!(status, 200, "{body}");
    // A source the gateway cannot read is refused, naming it.
    let bad = doc.replace("api-token", "missing-token");
    let (status, body) = t.admin("PUT", "/v1/sandboxes", Some(&bad));
    assert_eq!(status, 400, "{body}");
    assert!(
        body.contains("missing-token") && body.contains("credentials[0].source"),
        "{body}"
    );
    // And one outside `credentials.files_under`: the gateway reads with its
    // own rights, so whoever pushes may not name any file it can read.
    let outside = doc.replace(&secret.display().to_string(), "/etc/hostname");
    let (status, body) = t.admin("PUT", "/v1/sandboxes", Some(&outside));
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("credentials.files_under"), "{body}");
    let bearer = format!("Bearer {value}");
    for h2 in [false, true] {
        // The placeholder becomes the value on its way to its host; the
        // exemption does not splice it (else nothing could be replaced).
        let a = request(
            &t,
            "GET",
            "https://api.example.test/user",
            h2,
            &["-H", "authorization: Bearer EGRESS_PH_API_0001"],
        );
        assert_eq!(a.status, 200, "{a:?}");
        // A request without the header gets it added.
        let a = request(&t, "GET", "https://api.example.test/added", h2, &[]);
        assert_eq!(a.status, 200, "{a:?}");
        // A key of the sandbox's own is refused (require).
        let a = request(
            &t,
            "GET",
            "https://api.example.test/own",
            h2,
            &["-H", "authorization: Bearer mine"],
        );
        assert_eq!(
            a.denied().as_deref(),
            Some("credential_required; rule=0"),
            "{a:?}"
        );
        // The placeholder to another allowed host is an exfiltration attempt.
        for extra in [
            ["-H", "authorization: Bearer EGRESS_PH_API_0001"],
            ["-H", "x-api-key: EGRESS_PH_API_0001"],
        ] {
            let a = request(&t, "GET", "https://other.example.test/steal", h2, &extra);
            assert_eq!(a.status, 403, "{a:?}");
            assert_eq!(
                a.denied().as_deref(),
                Some("credential_host_mismatch; rule=0"),
                "{a:?}"
            );
        }
        let a = request(
            &t,
            "GET",
            "https://other.example.test/steal?k=EGRESS_PH_API_0001",
            h2,
            &[],
        );
        assert_eq!(a.status, 403, "{a:?}");
    }
    let seen = seen_by_origins(&t);
    for path in ["/user", "/added"] {
        assert_eq!(
            seen.iter()
                .filter(|l| l.starts_with(&format!(
                    "GET api.example.test {path} authorization={bearer} "
                )))
                .count(),
            2,
            "{path}: {seen:?}"
        );
    }
    assert!(
        !seen
            .iter()
            .any(|l| l.contains("/own") || l.contains("/steal")),
        "{seen:?}"
    );
    assert!(
        !seen.iter().any(|l| l.contains("EGRESS_PH_API_0001")),
        "{seen:?}"
    );
    // Intercepted, though exempt: the flow log says why.
    let line = flow_where(&t, |l| l["sni"] == "api.example.test");
    assert_eq!(line["verdict"], "intercept", "{line}");
    assert_eq!(line["reason"], "request_rules", "{line}");

    // SIGHUP reads the value again.
    let rotated = "r0tated-Value-9876543210-fedcba";
    std::fs::write(&secret, rotated).expect("rotate");
    run("kill", &["-HUP", &t.gateway_pid().to_string()]);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let a = request(&t, "GET", "https://api.example.test/rotated", false, &[]);
        assert_eq!(a.status, 200, "{a:?}");
        let seen = seen_by_origins(&t);
        if seen
            .iter()
            .any(|l| l.contains(&format!("/rotated authorization=Bearer {rotated} ")))
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "SIGHUP did not re-read: {seen:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // Every output of the run: the values are in none.
    let mut outputs = vec![
        ("metrics", t.admin("GET", "/metrics", None).1),
        ("sandbox", t.admin("GET", "/v1/sandboxes/sb1", None).1),
        ("sandboxes", t.admin("GET", "/v1/sandboxes", None).1),
        (
            "explain",
            t.admin(
                "POST",
                "/v1/explain",
                Some(
                    r#"{"sandbox": "sb1", "dst": "203.0.113.10:443", "tls": true, "sni": "api.example.test",
                        "method": "GET", "path": "/user"}"#,
                ),
            )
            .1,
        ),
    ];
    assert!(
        outputs[1].1.contains("api-token"),
        "the reference is kept: {}",
        outputs[1].1
    );
    // A restart writes the state through the snapshot and reads the file again.
    t.stop_gateway();
    outputs.push((
        "gateway.log (first run)",
        std::fs::read_to_string(t.path("gateway.log")).unwrap_or_default(),
    ));
    t.gateway_env = vec![("RUST_LOG".into(), "debug".into())];
    t.start_gateway();
    let a = request(&t, "GET", "https://api.example.test/restarted", true, &[]);
    assert_eq!(a.status, 200, "{a:?}");
    assert!(
        seen_by_origins(&t)
            .iter()
            .any(|l| l.contains(&format!("/restarted authorization=Bearer {rotated} "))),
        "the credential survives a restart"
    );
    let a = request(
        &t,
        "GET",
        "https://other.example.test/steal",
        true,
        &["-H", "authorization: Bearer EGRESS_PH_API_0001"],
    );
    assert_eq!(a.status, 403, "{a:?}");
    t.stop_gateway();
    outputs.push((
        "gateway.log (debug run)",
        std::fs::read_to_string(t.path("gateway.log")).unwrap_or_default(),
    ));
    outputs.push((
        "flows.jsonl",
        std::fs::read_to_string(t.path("flows.jsonl")).unwrap_or_default(),
    ));
    for entry in std::fs::read_dir(t.path("gw-state")).expect("state dir") {
        let path = entry.expect("entry").path();
        if path.is_file() {
            let bytes = std::fs::read(&path).expect("state file");
            outputs.push((
                "state file",
                format!("{}: {}", path.display(), String::from_utf8_lossy(&bytes)),
            ));
        }
    }
    assert!(
        outputs
            .iter()
            .any(|(_, o)| o.contains("snapshot.json") && o.contains("api-token")),
        "the snapshot keeps the reference"
    );
    for (what, text) in &outputs {
        for v in [value, rotated] {
            assert!(!text.contains(v), "{what} holds a credential value");
        }
    }
}

#[test]
fn a_value_an_origin_sends_back_reaches_the_sandbox_as_its_placeholder() {
    let t = topology!();
    let value = "s3cr3t/Value+0123456789-abcdef";
    let secret = t.path("api-token");
    std::fs::write(&secret, value).expect("secret");
    // `replace: "headers"`: the sandbox chooses the header the value goes
    // in, and the origin sends `Origin` back, and every header in its body.
    let doc = format!(
        r#"{{"addresses": ["{SB1_IP}", "{SB1_IP6}"],
            "policy": {{"default": "deny", "tls_interception": "on",
                "allow": [{{"ip": "8.8.8.8"}}, {{"domain": "api.example.test"}}]}},
            "credentials": [{{"name": "api", "placeholder": "EGRESS_PH_API_0001", "hosts": ["api.example.test"],
                "inject": {{"replace": "headers"}}, "source": {{"file": "{}"}}}}]}}"#,
        secret.display()
    );
    let (status, body) = t.admin("PUT", "/v1/sandboxes/sb1", Some(&doc));
    assert!(status == 200 || status == 201, "{status} {body}");
    for h2 in [false, true] {
        let a = request(
            &t,
            "GET",
            "https://api.example.test/reflect",
            h2,
            &[
                "-H",
                "origin: EGRESS_PH_API_0001",
                "-H",
                "accept-encoding: gzip",
                "-H",
                "range: bytes=0-9",
            ],
        );
        assert_eq!(a.status, 200, "{a:?}");
        let text = a.text.to_lowercase();
        assert!(!a.text.contains(value), "{a:?}");
        assert!(
            text.contains("access-control-allow-origin: egress_ph_api_0001"),
            "{a:?}"
        );
        // The origin got the value (it is what it sent back), in plain
        // encoding and whole.
        assert!(text.contains("origin: egress_ph_api_0001\n"), "{a:?}");
        assert!(text.contains("accept-encoding: identity\n"), "{a:?}");
        assert!(!text.contains("range:"), "{a:?}");
        // An answer the gateway cannot read for the value is not passed on.
        let a = request(
            &t,
            "GET",
            "https://api.example.test/reflect-gzip",
            h2,
            &["-H", "origin: EGRESS_PH_API_0001"],
        );
        assert_eq!(a.status, 502, "{a:?}");
        assert_eq!(
            a.denied().as_deref(),
            Some("credential_response_encoded; rule=0"),
            "{a:?}"
        );
        assert!(!a.text.contains(value), "{a:?}");
    }
    let seen = seen_by_origins(&t);
    assert_eq!(
        seen.iter().filter(|l| l.contains("/reflect")).count(),
        4,
        "{seen:?}"
    );
    let (_, metrics) = t.admin("GET", "/metrics", None);
    let reflected = metrics
        .lines()
        .find_map(|l| l.strip_prefix("egress_credentials_reflected_total "))
        .and_then(|v| v.trim().parse::<u64>().ok());
    // Per answer: the header, and `origin` in the body; the refused
    // answers' header too (read before the refusal, whose detail quotes
    // the coding).
    assert_eq!(reflected, Some(6), "{metrics}");
}
