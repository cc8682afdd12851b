//! Restart under load: a thousand flows open when the gateway is told to
//! stop, and a SIGKILL. In-flight requests finish within the drain; while
//! the gateway is down or starting, nothing is served with an empty or
//! default-allow policy; after a restart the snapshot's policy is in force
//! before the first accepted flow.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::topology::{available, Topology, SB1_IP};

/// Allows the API by name, intercepted; everything else is denied.
const POLICY: &str = r#"{"default": "deny", "tls_interception": "on",
    "allow": [{"ip": "8.8.8.8"}, {"domain": "api.example.test"}]}"#;

/// Requests the origin for api.example.test has received (it counts them as
/// they arrive), read from the fake internet directly.
fn reached(t: &Topology) -> u64 {
    let (_, body) = t.http_in_gw("GET", "http://203.0.113.10/_counts", &[], None);
    serde_json::from_str::<serde_json::Value>(&body)
        .ok()
        .and_then(|c| c["api.example.test"].as_u64())
        .unwrap_or(0)
}

/// A request from sb1 to a destination the policy denies: true if it was
/// answered by the origin (it must never be).
fn denied_reached(t: &Topology) -> bool {
    let (code, body) = t.curl(
        &t.sb1,
        "both",
        "https://other.example.test/",
        &["-4", "--connect-timeout", "1", "--max-time", "3"],
    );
    code == 0 && body.contains("fake internet")
}

#[test]
fn a_thousand_open_flows_drain_on_sigterm_and_nothing_leaks_across_restarts() {
    const MIN_OPEN: u64 = 100;
    if !available() {
        return;
    }
    let mut t = Topology::new();
    t.push("sb1", SB1_IP, POLICY);
    assert!(t
        .dig(&t.sb1, "api.example.test", false)
        .contains("203.0.113.10"));
    assert!(t
        .dig(&t.sb1, "other.example.test", false)
        .contains("203.0.113.11"));
    assert!(!denied_reached(&t), "denied before anything happens");

    // A thousand requests to a path that answers after 8 s, all at once.
    let bundle = t.ca("gateway");
    let probe = Command::new("ip")
        .args(["netns", "exec", &t.sb1])
        .arg(env!("CARGO_BIN_EXE_egress-probe"))
        .args([
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
            "1000",
            "--path",
            "/slow/8",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("probe");
    // SIGTERM once the origin holds them all, or once no more arrive (a
    // loaded machine may not finish a thousand handshakes in 8 s; on two
    // cores shared with builds a few hundred is what it manages, so a
    // hundred open flows is the floor the drain is judged on). The origin
    // counts requests as they arrive and answers each 8 s later.
    let deadline = Instant::now() + Duration::from_secs(7);
    let (mut open, mut last_rise) = (0, Instant::now());
    while Instant::now() < deadline && open < 1_000 {
        let now = reached(&t);
        if now > open {
            (open, last_rise) = (now, Instant::now());
        } else if open >= MIN_OPEN && last_rise.elapsed() > Duration::from_secs(1) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    if open < MIN_OPEN {
        let mut probe = probe;
        let _ = probe.kill();
        let out = probe.wait_with_output().expect("probe");
        panic!(
            "only {open} requests reached the origin; probe: {} {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
    }
    let stopping = Instant::now();
    // While it drains, the listeners are closed: a new flow is refused.
    let during = {
        let ns = t.sb1.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            Command::new("ip")
                .args(["netns", "exec", &ns, "curl", "-sk", "-4", "--max-time", "2"])
                .arg("https://other.example.test/")
                .output()
                .expect("curl")
        })
    };
    assert!(t.stop_gateway().success(), "a clean drain");
    let drained = stopping.elapsed();
    let out = probe.wait_with_output().expect("probe");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    // Every request the origin held at SIGTERM finished; one that had not
    // connected yet was refused (the listener closes when the drain starts).
    let ok = report["ok"].as_u64().unwrap_or(0);
    assert!(
        ok >= open,
        "{open} in flight at SIGTERM, {ok} finished: {report}"
    );
    for e in report["first_errors"].as_array().expect("errors") {
        let e = e.as_str().unwrap_or("");
        assert!(
            e.contains("onnect"),
            "a request not yet open fails to connect: {e}"
        );
    }
    let during = during.join().expect("curl thread");
    assert!(
        !String::from_utf8_lossy(&during.stdout).contains("fake internet"),
        "nothing reached an origin while stopping"
    );

    // Restarted: the snapshot's policy, from the first flow.
    t.start_gateway();
    assert!(!denied_reached(&t), "denied after a restart");
    let (code, body) = t.curl(&t.sb1, "gateway", "https://api.example.test/after", &["-4"]);
    assert_eq!(code, 0, "allowed after a restart: {body}");

    // SIGKILL: no drain, no last write; the restarted gateway enforces the
    // snapshot before it accepts a flow.
    t.kill_gateway();
    assert!(!denied_reached(&t), "nothing is served while it is down");
    t.start_gateway();
    assert!(!denied_reached(&t), "denied after SIGKILL and restart");
    let (code, body) = t.curl(&t.sb1, "gateway", "https://api.example.test/again", &["-4"]);
    assert_eq!(code, 0, "allowed after SIGKILL and restart: {body}");
    println!(
        "restart under load: {open} requests in flight at SIGTERM, {ok} of 1000 finished (the rest had not connected and were refused); the drain took {:.1} s; denied destination never reached before, during or after SIGTERM and SIGKILL restarts",
        drained.as_secs_f64()
    );
}

/// The gateway's resident memory (KiB) and open descriptors.
fn footprint(pid: u32) -> (u64, usize) {
    let rss = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0);
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count);
    (rss, fds)
}

/// `egress-probe many` from `ns`: a thread running it, joined for its report.
fn many(
    t: &Topology,
    ns: &str,
    target: &str,
    sni: &str,
    ca: &str,
    count: usize,
    concurrency: usize,
) -> std::thread::JoinHandle<serde_json::Value> {
    let bundle = t.ca(ca);
    let ns = ns.to_owned();
    let (target, sni) = (target.to_owned(), sni.to_owned());
    std::thread::spawn(move || {
        let out = Command::new("ip")
            .args(["netns", "exec", &ns])
            .arg(env!("CARGO_BIN_EXE_egress-probe"))
            .args(["many", "--connect", &target, "--sni", &sni, "--ca"])
            .arg(&bundle)
            .args([
                "--count",
                &count.to_string(),
                "--concurrency",
                &concurrency.to_string(),
            ])
            .output()
            .expect("probe");
        serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)))
    })
}

fn nft_in(ns: &str, script: &str) {
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns, "nft", "-f", "-"])
        .stdin(Stdio::piped())
        .spawn()
        .expect("nft");
    std::io::Write::write_all(child.stdin.as_mut().expect("stdin"), script.as_bytes())
        .expect("write");
    assert!(child.wait().expect("nft").success(), "nft: {script}");
}

/// Ten thousand flows from two sandboxes — intercepted, spliced, denied, to
/// an origin that resets one connection in ten and to one that stalls —
/// while the upstream DNS server goes away and comes back. Every allowed
/// request completes or fails with a clear error, no denied flow reaches an
/// origin, and the gateway's memory and descriptors come back down.
#[test]
fn ten_thousand_flows_with_faults_lose_nothing_and_leak_nothing() {
    if !available() {
        return;
    }
    let t = Topology::new();
    t.push(
        "sb1",
        SB1_IP,
        r#"{"default": "deny", "tls_interception": "on",
            "allow": [{"ip": "8.8.8.8"}, {"domain": "api.example.test"},
                      {"wildcard_domain": "*.relay.example.test"}, {"domain": "stall.example.test"}],
            "tls_interception_exemptions": [{"wildcard_domain": "*.relay.example.test"}]}"#,
    );
    t.push(
        "sb2",
        crate::topology::SB2_IP,
        r#"{"default": "deny", "tls_interception": "on",
            "allow": [{"ip": "8.8.8.8"}, {"domain": "reset.example.test"}]}"#,
    );
    for (ns, name, ip) in [
        (&t.sb1, "api.example.test", "203.0.113.10"),
        (&t.sb1, "a.relay.example.test", "203.0.113.20"),
        (&t.sb1, "stall.example.test", egress_integration::STALL_IP),
        (&t.sb2, "reset.example.test", egress_integration::RESET_IP),
        (&t.sb2, "other.example.test", "203.0.113.11"),
    ] {
        assert!(t.dig(ns, name, false).contains(ip), "{name}");
    }
    // Warm up, then the baseline.
    let (code, body) = t.curl(&t.sb1, "gateway", "https://api.example.test/warm", &["-4"]);
    assert_eq!(code, 0, "{body}");
    std::thread::sleep(Duration::from_millis(500));
    let pid = t.gateway_pid();
    let (rss_before, fds_before) = footprint(pid);

    let started = Instant::now();
    let intercepted = many(
        &t,
        &t.sb1,
        "203.0.113.10:443",
        "api.example.test",
        "gateway",
        4_300,
        300,
    );
    let spliced = many(
        &t,
        &t.sb1,
        "203.0.113.20:443",
        "a.relay.example.test",
        "origin",
        2_000,
        200,
    );
    let denied = many(
        &t,
        &t.sb2,
        "203.0.113.11:443",
        "other.example.test",
        "both",
        2_000,
        200,
    );
    let resets = many(
        &t,
        &t.sb2,
        "203.0.113.60:443",
        "reset.example.test",
        "gateway",
        1_500,
        150,
    );
    let stalls = many(
        &t,
        &t.sb1,
        "203.0.113.61:443",
        "stall.example.test",
        "gateway",
        200,
        100,
    );

    // The upstream DNS server goes away mid-run (its packets dropped in the
    // fake internet) and comes back.
    std::thread::sleep(Duration::from_secs(1));
    nft_in(
        &t.inet,
        "table inet dns_outage {\n chain input {\n  type filter hook input priority 0; policy accept;\n  th dport 53 drop\n }\n}\n",
    );
    let during = t.exec(
        &t.sb2,
        "dig",
        &["+time=6", "+tries=1", "@8.8.8.8", "deb.example.test"],
    );
    let during = String::from_utf8_lossy(&during.stdout).into_owned();
    assert!(
        during.contains("status: SERVFAIL"),
        "a clear SERVFAIL while the upstream is gone: {during}"
    );
    nft_in(&t.inet, "delete table inet dns_outage\n");
    assert!(
        t.dig(&t.sb2, "deb.example.test", false)
            .contains("198.51.100.21"),
        "DNS is back"
    );

    let reports = [
        ("intercepted", intercepted.join().expect("probe")),
        ("spliced", spliced.join().expect("probe")),
        ("denied", denied.join().expect("probe")),
        ("reset origin", resets.join().expect("probe")),
        ("stalled origin", stalls.join().expect("probe")),
    ];
    let elapsed = started.elapsed();
    let get = |name: &str| &reports.iter().find(|(n, _)| *n == name).expect("report").1;
    let ok = |name: &str| get(name)["ok"].as_u64().unwrap_or(0);
    let failed = |name: &str| get(name)["failed"].as_u64().unwrap_or(0);
    // On a loaded 2-core machine a client connect can time out in the
    // kernel's queues (the probe says so); anything else is a loss.
    for (name, count) in [("intercepted", 4_300), ("spliced", 2_000)] {
        assert_eq!(ok(name) + failed(name), count, "{}", get(name));
        assert!(failed(name) <= count / 200, "{name}: {}", get(name));
        for e in get(name)["first_errors"].as_array().expect("errors") {
            assert_eq!(e, "connect timed out", "{name}: {}", get(name));
        }
    }
    assert_eq!(ok("denied"), 0, "{}", get("denied"));
    let reset_failed = failed("reset origin");
    // One upstream connection in ten is reset; the gateway reuses upstream
    // connections, so fewer than one request in ten meets a reset.
    assert!(
        (1..=300).contains(&reset_failed),
        "some, at most about one in ten, fail: {}",
        get("reset origin")
    );
    assert_eq!(failed("stalled origin"), 200, "{}", get("stalled origin"));
    // The failures are answers that say what happened, not hangs.
    for name in ["reset origin", "stalled origin"] {
        for e in get(name)["first_errors"].as_array().expect("errors") {
            let e = e.as_str().unwrap_or("");
            assert!(e.starts_with("HTTP/1.1 502"), "{name}: {e}");
        }
    }
    // No denied flow reached an origin.
    let (_, counts) = t.http_in_gw("GET", "http://203.0.113.10/_counts", &[], None);
    let counts: serde_json::Value = serde_json::from_str(&counts).expect("counts");
    assert!(counts.get("other.example.test").is_none(), "{counts}");
    assert_eq!(
        counts["api.example.test"],
        json!(ok("intercepted") + 1),
        "every intercepted request that succeeded reached the origin once (and the warm-up): {counts}"
    );

    // Memory and descriptors come back down once the flows are over (the
    // upstream pool may keep up to 32 idle connections per origin).
    std::thread::sleep(Duration::from_secs(3));
    let (rss_after, fds_after) = footprint(pid);
    assert!(
        fds_after <= fds_before + 2 * 32 + 8,
        "descriptors {fds_before} → {fds_after}"
    );
    assert!(
        rss_after <= rss_before.max(64 * 1024) * 4,
        "RSS {rss_before} KiB → {rss_after} KiB"
    );
    println!(
        "fault and load: 10,000 flows in {:.1} s (intercepted {} of 4,300 ok, spliced {} of 2,000 ok, denied 2,000 refused and none reached an origin, reset origin {} ok / {reset_failed} clear 502s, stalled origin 200 clear 502s after the upstream handshake timeout); DNS outage answered SERVFAIL and recovered; gateway RSS {} → {} MiB, descriptors {fds_before} → {fds_after}",
        elapsed.as_secs_f64(),
        ok("intercepted"),
        ok("spliced"),
        ok("reset origin"),
        rss_before / 1024,
        rss_after / 1024,
    );
}
