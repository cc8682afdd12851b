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

/// The gateway's active flows, from `/metrics` (0 when it cannot be read).
fn active(t: &Topology) -> u64 {
    let (_, text) = t.admin("GET", "/metrics", None);
    text.lines()
        .find_map(|l| l.strip_prefix("egress_active_connections "))
        .and_then(|v| v.trim().parse().ok())
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

    // A thousand requests to a path that answers after 2 s, all at once.
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
            "/slow",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("probe");
    // SIGTERM once most of them are open.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut open = 0;
    while Instant::now() < deadline {
        open = active(&t);
        if open >= 900 {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    if open < 900 {
        let mut probe = probe;
        let _ = probe.kill();
        let out = probe.wait_with_output().expect("probe");
        let (_, metrics) = t.admin("GET", "/metrics", None);
        panic!(
            "only {open} flows open; probe: {} {}; metrics: {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            metrics
                .lines()
                .filter(|l| l.contains("active"))
                .collect::<Vec<_>>()
                .join(" | ")
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
    assert_eq!(
        report["ok"],
        json!(1000),
        "every in-flight request finished: {report}"
    );
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
        "restart under load: 1000 requests open ({open} flows active at SIGTERM) all finished; the drain took {:.1} s; denied destination never reached before, during or after SIGTERM and SIGKILL restarts",
        drained.as_secs_f64()
    );
}
