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
    const OPEN: u64 = 1_000;
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

    // A thousand requests to a path the origin holds until the test
    // releases it, all at once: however slowly a loaded machine makes the
    // handshakes, all thousand are open at the origin before SIGTERM.
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
            "/hold",
            "--response-timeout-secs",
            "150",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("probe");
    // The deadline only bounds a failure; a pass never waits for it.
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut open = 0;
    while Instant::now() < deadline && open < OPEN {
        open = t.reached();
        std::thread::sleep(Duration::from_millis(100));
    }
    if open < OPEN {
        let mut probe = probe;
        let _ = probe.kill();
        let out = probe.wait_with_output().expect("probe");
        panic!(
            "only {open} of {OPEN} requests reached the origin in 90 s; probe: {} {}",
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
    // The origin answers the held requests a second after SIGTERM, once the
    // new flow above has been tried against the draining gateway.
    let release = {
        let gw = t.gw.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(1));
            Command::new("ip")
                .args(["netns", "exec", &gw, "curl", "-s", "--max-time", "5"])
                .arg("http://203.0.113.10/_release")
                .output()
                .expect("curl")
        })
    };
    assert!(t.stop_gateway().success(), "a clean drain");
    let drained = stopping.elapsed();
    let released = release.join().expect("release thread");
    assert!(
        String::from_utf8_lossy(&released.stdout).contains("released"),
        "the origin released the held requests"
    );
    let out = probe.wait_with_output().expect("probe");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    // Every one of the thousand requests open at SIGTERM finished.
    assert_eq!(report["ok"], json!(OPEN), "{report}");
    assert_eq!(report["errors"], json!({}), "{report}");
    let ok = OPEN;
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
        "restart under load: {open} requests in flight at SIGTERM, {ok} of 1000 finished; the drain took {:.1} s; denied destination never reached before, during or after SIGTERM and SIGKILL restarts",
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

/// Upstream connections the gateway's pool holds (its gauge): each may hold
/// a descriptor, so the footprint is compared with them taken into account.
fn pooled(t: &Topology) -> usize {
    let (status, text) = t.admin("GET", "/metrics", None);
    assert_eq!(status, 200, "{text}");
    text.lines()
        .find_map(|l| l.strip_prefix("egress_upstream_pooled_connections "))
        .and_then(|v| v.trim().parse().ok())
        .expect("egress_upstream_pooled_connections in /metrics")
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

/// The five loads of one wave (10,000 flows), run at once while `meanwhile`
/// runs; each report by name.
fn wave(t: &Topology, meanwhile: impl FnOnce()) -> Vec<(&'static str, serde_json::Value)> {
    let loads = [
        (
            "intercepted",
            &t.sb1,
            "203.0.113.10:443",
            "api.example.test",
            "gateway",
            4_300,
            300,
        ),
        (
            "spliced",
            &t.sb1,
            "203.0.113.20:443",
            "a.relay.example.test",
            "origin",
            2_000,
            200,
        ),
        (
            "denied",
            &t.sb2,
            "203.0.113.11:443",
            "other.example.test",
            "both",
            2_000,
            200,
        ),
        (
            "reset origin",
            &t.sb2,
            "203.0.113.60:443",
            "reset.example.test",
            "gateway",
            1_500,
            150,
        ),
        (
            "stalled origin",
            &t.sb1,
            "203.0.113.61:443",
            "stall.example.test",
            "gateway",
            200,
            100,
        ),
    ];
    let running: Vec<_> = loads
        .into_iter()
        .map(|(name, ns, target, sni, ca, count, concurrency)| {
            (name, many(t, ns, target, sni, ca, count, concurrency))
        })
        .collect();
    meanwhile();
    running
        .into_iter()
        .map(|(name, probe)| (name, probe.join().expect("probe")))
        .collect()
}

/// The upstream DNS server goes away (its packets dropped in the fake
/// internet): a clear SERVFAIL; then it comes back.
fn dns_outage(t: &Topology) {
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
}

/// What the origin for api.example.test has answered so far.
fn api_reached(t: &Topology) -> serde_json::Value {
    let (_, counts) = t.http_in_gw("GET", "http://203.0.113.10/_counts", &[], None);
    serde_json::from_str(&counts).expect("counts")
}

/// Every flow of a wave accounted for: allowed requests complete (or fail to
/// connect in the kernel's queues, rarely), denied ones never reach an
/// origin, failing origins get clear 502s; `before`: the api origin's count
/// before the wave. Returns (intercepted ok, reset origin ok, reset failed).
fn check_wave(
    t: &Topology,
    reports: &[(&str, serde_json::Value)],
    before: u64,
    first: bool,
) -> [u64; 3] {
    let get = |name: &str| &reports.iter().find(|(n, _)| *n == name).expect("report").1;
    let ok = |name: &str| get(name)["ok"].as_u64().unwrap_or(0);
    let failed = |name: &str| get(name)["failed"].as_u64().unwrap_or(0);
    // Every error of a load, by kind, is one of `kinds`.
    let only = |name: &str, kinds: &[&str]| {
        for (kind, _) in get(name)["errors"].as_object().expect("errors") {
            assert!(
                kinds.iter().any(|k| kind.starts_with(k)),
                "{name}: {}",
                get(name)
            );
        }
    };
    // On a loaded 2-core machine a client connect can time out in the
    // kernel's queues (the probe says so); anything else is a loss.
    for (name, count) in [("intercepted", 4_300), ("spliced", 2_000)] {
        assert_eq!(ok(name) + failed(name), count, "{}", get(name));
        assert!(failed(name) <= count / 200, "{name}: {}", get(name));
        only(name, &["connect timed out"]);
    }
    assert_eq!(ok("denied"), 0, "{}", get("denied"));
    let reset_failed = failed("reset origin");
    // One new upstream connection in ten is reset; the gateway reuses
    // upstream connections, so fewer than one request in ten meets a reset
    // (in the first wave, with a cold pool, at least one does; the second
    // may reuse connections the first left).
    let least = u64::from(first);
    assert!(
        (least..=300).contains(&reset_failed),
        "some, at most about one in ten, fail: {}",
        get("reset origin")
    );
    assert_eq!(failed("stalled origin"), 200, "{}", get("stalled origin"));
    // The failures are answers that say what happened, not hangs.
    only("reset origin", &["HTTP/1.1 502"]);
    only("stalled origin", &["HTTP/1.1 502"]);
    let counts = api_reached(t);
    assert!(counts.get("other.example.test").is_none(), "{counts}");
    assert_eq!(
        counts["api.example.test"],
        json!(before + ok("intercepted")),
        "every intercepted request that succeeded reached the origin once: {counts}"
    );
    [ok("intercepted"), ok("reset origin"), reset_failed]
}

/// Ten thousand flows from two sandboxes — intercepted, spliced, denied, to
/// an origin that resets one connection in ten and to one that stalls —
/// while the upstream DNS server goes away and comes back; then the same
/// ten thousand again. Every allowed request completes or fails with a clear
/// error, no denied flow reaches an origin, and the second wave leaves the
/// gateway's memory where the first left it (a leak of a few KiB per flow
/// would show) and its descriptors exactly where they were.
#[test]
fn ten_thousand_flows_with_faults_lose_nothing_and_leak_nothing() {
    /// Most resident memory the second wave may add, per flow. A wave's
    /// buffers are freed and reused; what stays is what leaked. Seen on an
    /// idle machine: -0.3 KiB; with the rest of the suite running beside
    /// it: up to 1.5 KiB (allocator pages taken while other tests ran). A
    /// leak of 20 KiB per flow moved it 21.6 KiB.
    const MAX_GROWTH_PER_FLOW_KIB: u64 = 4;
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
    let (code, body) = t.curl(&t.sb1, "gateway", "https://api.example.test/warm", &["-4"]);
    assert_eq!(code, 0, "{body}");
    let pid = t.gateway_pid();
    let (_, fds_start) = footprint(pid);

    let started = Instant::now();
    let first = wave(&t, || dns_outage(&t));
    let elapsed = started.elapsed();
    let [ok1, reset_ok, reset_failed] = check_wave(&t, &first, 1, true);
    // Flows that end are logged and torn down just after the client sees
    // the end: let the gateway settle before reading its footprint.
    std::thread::sleep(Duration::from_secs(3));
    let pooled_first = pooled(&t);
    let (rss_first, fds_first) = footprint(pid);

    let second = wave(&t, || ());
    let [ok2, ..] = check_wave(&t, &second, 1 + ok1, false);
    std::thread::sleep(Duration::from_secs(3));
    let pooled_second = pooled(&t);
    let (rss_second, fds_second) = footprint(pid);
    // After each wave, nothing is open beyond what was open before it and
    // the upstream connections the pool holds (bounded; they close as they
    // expire).
    for (wave, fds, pooled) in [(1, fds_first, pooled_first), (2, fds_second, pooled_second)] {
        assert!(
            fds <= fds_start + pooled,
            "descriptors after wave {wave}: {fds}, more than the {fds_start} before the waves and the {pooled} pooled upstream connections"
        );
    }
    let growth = rss_second.saturating_sub(rss_first);
    assert!(
        growth <= 10_000 * MAX_GROWTH_PER_FLOW_KIB,
        "the second wave of 10,000 flows grew RSS {rss_first} → {rss_second} KiB ({} B per flow)",
        growth * 1024 / 10_000
    );
    println!(
        "fault and load: 10,000 flows in {:.1} s (intercepted {ok1} of 4,300 ok, denied 2,000 refused and none reached an origin, reset origin {reset_ok} ok / {reset_failed} clear 502s, stalled origin 200 clear 502s after the upstream handshake timeout); DNS outage answered SERVFAIL and recovered; a second wave ({ok2} intercepted ok) moved RSS {rss_first} → {rss_second} KiB and descriptors {fds_start} → {fds_first} → {fds_second} ({pooled_first} and {pooled_second} pooled)",
        elapsed.as_secs_f64(),
    );
}
