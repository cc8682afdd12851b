//! Every behaviour docs/policy.md and docs/evidence.md describe, seen from inside a sandbox.

use std::time::Duration;

use serde_json::json;

use crate::topology::*;

const INTERCEPT_ALL: &str = r#"{"default": "allow", "tls_interception": "on"}"#;

/// Sets up a topology, or returns from the test when it cannot run here.
macro_rules! topology {
    () => {{
        if !available() {
            return;
        }
        Topology::new()
    }};
}

fn probe_line(t: &Topology, ns: &str, ip: &str, sni: &str) -> Result<serde_json::Value, String> {
    let bundle = t.ca("both");
    let out = t.exec(
        ns,
        env!("CARGO_BIN_EXE_egress-probe"),
        &[
            "line",
            "--connect",
            &format!("{ip}:443"),
            "--sni",
            sni,
            "--ca",
            bundle.to_str().expect("utf-8"),
            "--send",
            "PING",
        ],
    );
    if out.status.success() {
        Ok(serde_json::from_slice(&out.stdout).expect("json"))
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

#[test]
fn allowed_and_denied_by_ip_cidr_and_domain() {
    let t = topology!();
    t.push(
        "sb1",
        SB1_IP,
        r#"{"default": "deny", "tls_interception": "on",
            "allow": [{"ip": "8.8.8.8"}, {"ip": "203.0.113.11"}, {"cidr": "198.51.100.0/24"}, {"domain": "api.example.test"}],
            "deny": [{"cidr": "198.51.100.16/28"}]}"#,
    );
    // Domain allow after DNS through the reserved resolver, intercepted: the gateway's CA verifies.
    let (code, body) = t.curl(&t.sb1, "gateway", "https://api.example.test/hello", &[]);
    assert_eq!(code, 0, "{body}");
    assert!(
        body.contains("fake internet: GET /hello host=api.example.test"),
        "{body}"
    );
    // IP allow, by address (IPv4 rules: the client uses IPv4; the IPv6
    // paths are in dual_stack.rs).
    let (code, body) = t.curl(&t.sb1, "gateway", "https://other.example.test/", &["-4"]);
    assert_eq!(code, 0, "{body}");
    // CIDR allow (the CNAME chain ends at 198.51.100.10).
    let (code, body) = t.curl(
        &t.sb1,
        "gateway",
        "https://www.chain.example.test/",
        &["-4"],
    );
    assert_eq!(code, 0, "{body}");
    // CIDR deny beats the CIDR allow: plain HTTP gets a 403 naming the rule.
    let (code, body) = t.curl(
        &t.sb1,
        "gateway",
        "http://plain.example.test/",
        &["-4", "-w", "%{http_code}"],
    );
    assert_eq!(code, 0);
    assert!(
        body.contains("403") && body.contains("tenant deny: cidr 198.51.100.16/28"),
        "{body}"
    );
    // Not allowed at all: the handshake is reset.
    let (code, _) = t.curl(&t.sb1, "gateway", "https://a.relay.example.test/", &[]);
    assert_ne!(code, 0);
}

#[test]
fn platform_deny_for_metadata_and_unknown_sandboxes() {
    let t = topology!();
    t.push("sb1", SB1_IP, r#"{"default": "allow"}"#);
    let (code, body) = t.curl(
        &t.sb1,
        "gateway",
        "http://169.254.169.254/latest/meta-data/",
        &["-w", "%{http_code}"],
    );
    assert_eq!(code, 0, "{body}");
    assert!(
        body.contains("403") && body.contains("platform deny"),
        "{body}"
    );
    // sb2 was never pushed: denied, and its DNS is refused.
    let (code, _) = t.curl(&t.sb2, "gateway", "https://203.0.113.10/", &["-k"]);
    assert_ne!(code, 0);
    assert_eq!(
        t.dig(&t.sb2, "api.example.test", false).trim(),
        "",
        "REFUSED: no answer"
    );
}

/// An address the gateway's host gains after the start is denied to
/// sandboxes once the host is read again (every 5 s): before, only the
/// unit test's hand-set reading showed "later".
#[test]
fn an_address_the_host_gains_later_is_denied() {
    let t = topology!();
    t.push("sb1", SB1_IP, r#"{"default": "allow"}"#);
    let gained = ["addr", "add", "198.51.100.177/32", "dev", "lo"];
    assert!(t.exec(&t.gw, "ip", &gained).status.success());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    let denied = loop {
        let (_, body) = t.curl(
            &t.sb1,
            "gateway",
            "http://198.51.100.177/",
            &["-s", "-m", "2", "-w", "%{http_code}"],
        );
        if body.contains("platform deny") || std::time::Instant::now() > deadline {
            break body;
        }
        std::thread::sleep(std::time::Duration::from_millis(250));
    };
    assert!(
        denied.contains("403") && denied.contains("platform deny"),
        "{denied}"
    );
}

#[test]
fn exemption_splices_only_after_dns_through_the_reserved_resolvers() {
    let t = topology!();
    t.push(
        "sb1",
        SB1_IP,
        r#"{"default": "allow", "tls_interception": "on",
            "tls_interception_exemptions": [{"wildcard_domain": "*.relay.example.test"}, {"domain": "turn.example.test"}]}"#,
    );
    // SNI alone (the address from elsewhere, no DNS seen): terminated, so only the gateway's CA verifies.
    let resolve = "a.relay.example.test:443:203.0.113.20";
    assert_ne!(
        t.curl(
            &t.sb1,
            "origin",
            "https://a.relay.example.test/",
            &["--resolve", resolve]
        )
        .0,
        0
    );
    assert_eq!(
        t.curl(
            &t.sb1,
            "gateway",
            "https://a.relay.example.test/",
            &["--resolve", resolve]
        )
        .0,
        0
    );
    // Resolving with another resolver is not possible (other UDP is dropped
    // by the redirect rules' guard) and not attribution. The resolver is
    // there: asked from the gateway's namespace, it answers.
    assert!(t
        .dig_at(
            &t.gw,
            egress_integration::DNS_IP,
            "a.relay.example.test",
            false
        )
        .contains("203.0.113.20"));
    let dropped = || udp_guard_drops(&t, "sb1");
    let before = dropped();
    let elsewhere = t.dig_at(
        &t.sb1,
        egress_integration::DNS_IP,
        "a.relay.example.test",
        false,
    );
    assert!(
        elsewhere.contains("no servers could be reached") && !elsewhere.contains("203.0.113.20"),
        "{elsewhere}"
    );
    assert!(dropped() > before, "the guard dropped the query");
    // After DNS through 8.8.8.8: spliced, the client sees the origin's own certificate.
    assert!(t
        .dig(&t.sb1, "a.relay.example.test", false)
        .contains("203.0.113.20"));
    let (code, body) = t.curl(&t.sb1, "origin", "https://a.relay.example.test/", &[]);
    assert_eq!(code, 0, "{body}");
    // The exact-domain exemption: the non-HTTP TLS service works only when exempted.
    let intercepted =
        probe_line(&t, &t.sb1, "203.0.113.30", "turn.example.test").expect("handshake");
    assert_eq!(intercepted["issuer_gateway"], json!(true));
    assert!(
        !intercepted["reply"].as_str().unwrap_or("").contains("PONG"),
        "{intercepted}"
    );
    assert!(t
        .dig(&t.sb1, "turn.example.test", false)
        .contains("203.0.113.30"));
    let exempt = probe_line(&t, &t.sb1, "203.0.113.30", "turn.example.test").expect("handshake");
    assert_eq!(exempt, json!({"issuer_gateway": false, "reply": "PONG\n"}));
}

#[test]
fn attribution_expires_and_follows_cname_chains_per_sandbox() {
    let t = topology!();
    let policy = r#"{"default": "deny", "allow": [{"ip": "8.8.8.8"}, {"domain": "www.chain.example.test"}, {"domain": "short.relay.example.test"}]}"#;
    t.push("sb1", SB1_IP, policy);
    t.push("sb2", SB2_IP, policy);
    // A CNAME chain: the allowed name at its head attributes the address at its end.
    assert!(t
        .dig(&t.sb1, "www.chain.example.test", false)
        .contains("198.51.100.10"));
    let (code, body) = t.curl(&t.sb1, "origin", "https://www.chain.example.test/", &[]);
    assert_eq!(code, 0, "{body}");
    // Sandbox B cannot ride on A's attribution.
    let (code, _) = t.curl(
        &t.sb2,
        "origin",
        "https://www.chain.example.test/",
        &["--resolve", "www.chain.example.test:443:198.51.100.10"],
    );
    assert_ne!(code, 0);
    // A 1-second TTL (the gateway's floor is 1 s here) expires.
    assert!(t
        .dig(&t.sb1, "short.relay.example.test", false)
        .contains("203.0.113.21"));
    assert_eq!(
        t.curl(&t.sb1, "origin", "https://short.relay.example.test/", &[])
            .0,
        0
    );
    std::thread::sleep(Duration::from_millis(2_500));
    let resolve = "short.relay.example.test:443:203.0.113.21";
    assert_ne!(
        t.curl(
            &t.sb1,
            "origin",
            "https://short.relay.example.test/",
            &["--resolve", resolve]
        )
        .0,
        0,
        "expired"
    );
    let reasons: Vec<String> = t
        .flows_when(|f| f.iter().any(|l| l["reason"] == "expired"))
        .iter()
        .map(|f| f["reason"].as_str().unwrap_or("").to_owned())
        .collect();
    assert!(reasons.iter().any(|r| r == "expired"), "{reasons:?}");
}

/// `limits.thread_per_core` behind the real redirect: every worker thread's
/// `SO_REUSEPORT` listener gets redirected flows and reads their original
/// destination, and DNS over UDP and TCP is answered on whichever thread's
/// socket the kernel picks.
#[test]
fn per_core_workers_behind_the_redirect_decide_alike() {
    let mut t = topology!();
    t.stop_gateway();
    t.set_limits("thread_per_core = true\nworker_threads = 2");
    t.start_gateway();
    t.push(
        "sb1",
        SB1_IP,
        r#"{"default": "deny", "tls_interception": "on",
            "allow": [{"ip": "8.8.8.8"}, {"domain": "api.example.test"}]}"#,
    );
    for tcp in [false, true] {
        assert!(
            t.dig(&t.sb1, "api.example.test", tcp)
                .contains("203.0.113.10"),
            "DNS (tcp: {tcp}) through a worker's socket"
        );
    }
    // Each curl is a new source port: the kernel spreads them.
    for _ in 0..12 {
        let (code, body) = t.curl(&t.sb1, "gateway", "https://api.example.test/hello", &["-4"]);
        assert_eq!(code, 0, "{body}");
        assert!(body.contains("host=api.example.test"), "{body}");
        let (code, _) = t.curl(&t.sb1, "gateway", "https://a.relay.example.test/", &["-4"]);
        assert_ne!(code, 0, "not allowed on any thread");
    }
    let (status, metrics) = t.admin("GET", "/metrics", None);
    assert_eq!(status, 200);
    let accepted = |worker: u32| -> u64 {
        let series = format!("egress_worker_connections_total{{worker=\"{worker}\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(series.as_str()))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {series} in the scrape"))
    };
    let (w0, w1) = (accepted(0), accepted(1));
    assert!(w0 > 0 && w1 > 0, "both threads accepted: {w0} and {w1}");
    assert!(w0 + w1 >= 24, "{w0} + {w1}");
}

#[test]
fn dns_over_tcp_and_quic_dropped() {
    let t = topology!();
    t.push("sb1", SB1_IP, r#"{"default": "allow"}"#);
    assert!(
        t.dig(&t.sb1, "api.example.test", true)
            .contains("203.0.113.10"),
        "DNS over TCP through the gateway"
    );
    let listed = t.exec(&t.gw, "nft", &["list", "table", "inet", "egress_gw_sb1"]);
    let before = String::from_utf8_lossy(&listed.stdout).into_owned();
    // A QUIC-like datagram to 443 never leaves the sandbox interface.
    let out = t.exec(
        &t.sb1,
        "bash",
        &[
            "-c",
            "for i in 1 2 3; do echo quic > /dev/udp/203.0.113.10/443; done",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed = t.exec(&t.gw, "nft", &["list", "table", "inet", "egress_gw_sb1"]);
    let after = String::from_utf8_lossy(&listed.stdout).into_owned();
    let dropped = |text: &str| -> u64 {
        text.lines()
            .find(|l| l.contains("meta l4proto udp counter"))
            .and_then(|l| l.split("packets ").nth(1))
            .and_then(|r| r.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    assert!(dropped(&after) >= dropped(&before) + 3, "{after}");
    // The rule that counted them drops them (forwarding is off here, so
    // nothing would leave whatever its verdict: the verdict is what shows).
    let rule = after
        .lines()
        .find(|l| l.contains("meta l4proto udp counter"))
        .unwrap_or_default();
    assert!(rule.trim_end().ends_with(" drop"), "{rule}");
}

#[test]
fn a_push_changes_the_next_flow_and_a_restart_keeps_it() {
    let mut t = topology!();
    t.push("sb1", SB1_IP, INTERCEPT_ALL);
    assert_eq!(
        t.curl(&t.sb1, "gateway", "https://api.example.test/", &[])
            .0,
        0
    );
    t.push("sb1", SB1_IP, r#"{"default": "allow", "deny": [{"domain": "api.example.test"}], "tls_interception": "on"}"#);
    assert_ne!(
        t.curl(&t.sb1, "gateway", "https://api.example.test/", &[])
            .0,
        0,
        "the next flow sees the push"
    );
    assert!(t.stop_gateway().success(), "SIGTERM exits 0");
    // While the gateway is down nothing passes unchecked: the redirect leads nowhere.
    assert_ne!(
        t.curl(&t.sb1, "both", "https://203.0.113.11/", &["-k"]).0,
        0
    );
    t.start_gateway();
    // Before any new push: the snapshot's policy is in force.
    assert_ne!(
        t.curl(&t.sb1, "gateway", "https://api.example.test/", &[])
            .0,
        0
    );
    assert_eq!(
        t.curl(&t.sb1, "gateway", "https://other.example.test/", &[])
            .0,
        0
    );
}

#[test]
fn sigterm_drains_an_open_flow() {
    let mut t = topology!();
    t.push("sb1", SB1_IP, INTERCEPT_ALL);
    let bundle = t.ca("gateway");
    let slow = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            &t.sb1,
            "curl",
            "-sS",
            "--max-time",
            "10",
            "--cacert",
            bundle.to_str().expect("utf-8"),
            "https://api.example.test/slow",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("curl");
    std::thread::sleep(Duration::from_millis(700));
    assert!(t.stop_gateway().success());
    let out = slow.wait_with_output().expect("curl");
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "slow done\n",
        "the open flow finished during the drain"
    );
}

#[test]
fn a_thousand_concurrent_flows_through_one_sandbox() {
    let t = topology!();
    t.push("sb1", SB1_IP, INTERCEPT_ALL);
    let bundle = t.ca("gateway");
    let out = t.exec(
        &t.sb1,
        env!("CARGO_BIN_EXE_egress-probe"),
        &[
            "many",
            "--connect",
            "203.0.113.10:443",
            "--sni",
            "api.example.test",
            "--ca",
            bundle.to_str().expect("utf-8"),
            "--count",
            "1000",
            "--concurrency",
            "250",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(report["ok"], json!(1000), "{report}");
    assert_eq!(report["failed"], json!(0), "{report}");
}

#[test]
fn the_sample_flow_log_replays_with_no_verdict_mismatch() {
    let t = topology!();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../benches/replay");
    let policy = std::fs::read_to_string(root.join("sample-policy.json")).expect("sample policy");
    t.push("sb1", SB1_IP, &policy);
    let (gw_ca, origin_ca) = (t.ca("gateway"), t.ca("origin"));
    let log = root.join("sample-flows.jsonl");
    let out = t.exec(
        &t.sb1,
        bin("egress-replay").to_str().expect("utf-8"),
        &[
            "--log",
            log.to_str().expect("utf-8"),
            "--gateway-ca",
            gw_ca.to_str().expect("utf-8"),
            "--origin-ca",
            origin_ca.to_str().expect("utf-8"),
            "--concurrency",
            "32",
            "--quiet",
        ],
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    eprintln!(
        "{}",
        serde_json::to_string_pretty(&report).unwrap_or_default()
    );
    assert_eq!(report["flows"], json!(3000));
    assert_eq!(report["mismatches"], json!(0), "{report}");
    assert!(out.status.success());
}

/// `egress-probe request` from sb1: the JSON it prints.
fn probe_request(t: &Topology, args: &[&str]) -> serde_json::Value {
    let bundle = t.ca("both");
    let mut all = vec!["request", "--ca", bundle.to_str().expect("utf-8")];
    all.extend_from_slice(args);
    let out = t.exec(&t.sb1, env!("CARGO_BIN_EXE_egress-probe"), &all);
    assert!(
        out.status.success(),
        "probe {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("json")
}

#[test]
fn a_request_that_names_two_hosts_never_reaches_the_origin() {
    let t = topology!();
    t.push(
        "sb1",
        SB1_IP,
        r#"{"default": "allow", "tls_interception": "on",
            "deny": [{"domain": "blocked.example.test"}]}"#,
    );
    let api = "203.0.113.10:443";
    let tls = ["--connect", api, "--sni", "api.example.test"];
    let h1 = |raw: &str| {
        let mut args = tls.to_vec();
        args.extend_from_slice(&["--raw", raw]);
        probe_request(&t, &args)["response"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    // HTTP/1.1: two Host headers, one behind a bare LF, and an absolute-form
    // target naming the denied host.
    for raw in [
        r"GET / HTTP/1.1\r\nHost: api.example.test\r\nHost: blocked.example.test\r\nConnection: close\r\n\r\n",
        r"GET / HTTP/1.1\r\nHost: api.example.test\r\nX-A: b\nHost: blocked.example.test\r\nConnection: close\r\n\r\n",
        r"GET https://blocked.example.test/ HTTP/1.1\r\nHost: api.example.test\r\nConnection: close\r\n\r\n",
    ] {
        let answer = h1(raw);
        assert!(answer.starts_with("HTTP/1.1 400"), "{raw} → {answer}");
        assert!(!answer.contains("fake internet"), "{answer}");
    }
    // The origin receives exactly the one authority the gateway judged, in normal form.
    let answer =
        h1(r"GET /one HTTP/1.1\r\nHost: API.example.test:443\r\nConnection: close\r\n\r\n");
    assert!(
        answer.contains("fake internet: GET /one host=api.example.test:443 authority="),
        "{answer}"
    );
    // A head over the bound.
    let big = format!(
        r"GET / HTTP/1.1\r\nHost: api.example.test\r\nX-Pad: {}\r\nConnection: close\r\n\r\n",
        "p".repeat(100 * 1024)
    );
    assert!(h1(&big).starts_with("HTTP/1.1 431"));

    // HTTP/2: :authority names the SNI, host the denied name.
    let h2 = |hosts: &[&str], pad: &str| {
        let mut args = tls.to_vec();
        args.extend_from_slice(&["--h2-authority", "api.example.test", "--pad", pad]);
        for h in hosts {
            args.extend_from_slice(&["--host", h]);
        }
        probe_request(&t, &args)
    };
    let v = h2(&["blocked.example.test"], "0");
    assert_eq!(v["status"], json!(400), "{v}");
    assert!(!v["body"]
        .as_str()
        .unwrap_or_default()
        .contains("fake internet"));
    let v = h2(&["api.example.test:443"], "0");
    assert_eq!(v["status"], json!(200), "{v}");
    assert!(
        v["body"]
            .as_str()
            .unwrap_or_default()
            .contains("host=api.example.test authority=api.example.test"),
        "the origin sees the judged :authority and no other host: {v}"
    );
    assert_eq!(h2(&[], "102400")["status"], json!(431));

    // Plain HTTP: refused at the peek, and on a later request of a kept-alive connection.
    let plain = |raw: &str| {
        probe_request(&t, &["--connect", "198.51.100.20:80", "--raw", raw])["response"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    let answer =
        plain(r"GET / HTTP/1.1\r\nHost: plain.example.test\r\nHost: blocked.example.test\r\n\r\n");
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    let answer = plain(
        r"GET /1 HTTP/1.1\r\nHost: plain.example.test\r\n\r\nGET /2 HTTP/1.1\r\nHost: plain.example.test\r\nHost: blocked.example.test\r\nConnection: close\r\n\r\n",
    );
    assert!(
        answer.contains("GET /1 host=plain.example.test"),
        "{answer}"
    );
    assert!(
        answer.contains("HTTP/1.1 400") && !answer.contains("GET /2"),
        "{answer}"
    );
    let refused = |l: &serde_json::Value| l["reason"] == json!("malformed_request");
    assert!(
        t.flows_when(|f| f.iter().any(refused)).iter().any(refused),
        "the flow log names the refusal"
    );
}

/// Packets the redirect rules' UDP guard dropped on `iface` so far.
fn udp_guard_drops(t: &Topology, iface: &str) -> u64 {
    let out = t.exec(&t.gw, "nft", &["list", "ruleset"]);
    let rules = String::from_utf8_lossy(&out.stdout);
    let needle = format!("iifname \"{iface}\" meta l4proto udp counter packets ");
    rules
        .lines()
        .find_map(|l| l.trim().strip_prefix(needle.as_str()))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no UDP guard for {iface} in:\n{rules}"))
}

/// curl resolving over DNS over HTTPS (`--doh-url https://dns.google/…`),
/// as a browser upgrading 8.8.8.8 does: the gateway answers the DoH itself,
/// the names are attributed, and an exemption by name splices. With
/// interception off the DoH flow is refused, and curl fails closed.
#[test]
fn doh_to_a_reserved_resolver_attributes_behind_the_redirect() {
    let t = topology!();
    let policy = |interception: &str| {
        format!(
            r#"{{"default": "deny", "tls_interception": "{interception}",
                "allow": [{{"ip": "8.8.8.8"}}, {{"wildcard_domain": "*.relay.example.test"}}],
                "tls_interception_exemptions": [{{"wildcard_domain": "*.relay.example.test"}}]}}"#
        )
    };
    t.push("sb1", SB1_IP, &policy("on"));
    let doh = ["-4", "--doh-url", "https://dns.google/dns-query"];
    // Trusting only the origin's CA for the site, and the gateway's for
    // the DoH server: curl uses one bundle for both.
    let (code, body) = t.curl(&t.sb1, "both", "https://a.relay.example.test/", &doh);
    assert_eq!(code, 0, "{body}");
    assert!(body.contains("fake internet"), "{body}");
    // Both flows end as curl exits; which the log has first is not defined.
    let flows = t.flows_when(|f| {
        let has = |sni: &str| f.iter().any(|l| l["sni"] == sni);
        has("a.relay.example.test") && has("dns.google")
    });
    let site = flows
        .iter()
        .find(|l| l["sni"] == "a.relay.example.test")
        .expect("site flow");
    assert_eq!(
        (&site["verdict"], &site["reason"]),
        (&json!("splice"), &json!("exempt")),
        "{site}"
    );
    let resolver = flows
        .iter()
        .find(|l| l["sni"] == "dns.google")
        .expect("DoH flow");
    assert_eq!(resolver["reason"], json!("doh_answered"), "{resolver}");
    assert_eq!(resolver["dst"], json!("8.8.8.8:443"), "{resolver}");

    // Interception off: the gateway cannot answer DoH, so it refuses it.
    t.push("sb1", SB1_IP, &policy("off"));
    let (code, body) = t.curl(&t.sb1, "both", "https://a.relay.example.test/", &doh);
    assert_ne!(code, 0, "{body}");
    let flows = t.flows_when(|f| f.iter().any(|l| l["reason"] == "encrypted_dns"));
    assert!(
        flows
            .iter()
            .any(|l| l["reason"] == "encrypted_dns" && l["dst"] == "8.8.8.8:443"),
        "{flows:?}"
    );
}
