//! A fleet's worker: sandbox interfaces fenced from the moment they appear
//! and redirected exactly while attached.

use serde_json::json;

use crate::topology::*;

/// The third sandbox's address (see [`Topology::add_sandbox`]).
const SB3_IP: &str = "100.64.5.2";

/// The fence's drop counter for its first pattern.
fn fence_drops(t: &Topology) -> u64 {
    t.rule_count("egress_gw_fence", "@attached counter")
}

/// Whether sbx3 is in the fence's `attached` set.
fn attached(t: &Topology) -> bool {
    let out = t.exec(
        &t.gw,
        "nft",
        &["list", "set", "inet", "egress_gw_fence", "attached"],
    );
    String::from_utf8_lossy(&out.stdout).contains("\"sbx3\"")
}

/// Whether sbx3's table redirects its TCP to the gateway.
fn redirected(t: &Topology) -> bool {
    let out = t.exec(
        &t.gw,
        "nft",
        &["list", "chain", "inet", "egress_gw_sbx3", "to_gateway"],
    );
    String::from_utf8_lossy(&out.stdout).contains(r#"iifname "sbx3" meta l4proto tcp redirect to"#)
}

fn sb3_flows(t: &Topology) -> usize {
    t.flows()
        .iter()
        .filter(|f| f["src"].as_str().is_some_and(|s| s.starts_with(SB3_IP)))
        .count()
}

#[test]
fn a_sandbox_interface_is_fenced_until_attached_and_again_once_detached() {
    if !available() {
        return;
    }
    let mut t = Topology::new();
    let sb3 = t.add_sandbox("sb3", "sbx3", 5);
    // A worker that forwards for its sandboxes (this one forwards only sb3,
    // both ways): without rules for the interface, sb3 reaches the fake
    // internet directly, past the gateway — the window the fence closes.
    t.exec(&t.gw, "sysctl", &["-qw", "net.ipv4.ip_forward=1"]);
    for rule in ["iifname \"sbx3\" accept", "oifname \"sbx3\" accept"] {
        let mut args = vec!["add", "rule", "inet", "egw_forward", "forward"];
        args.extend(rule.split(' '));
        assert!(t.exec(&t.gw, "nft", &args).status.success(), "{rule}");
    }
    let direct = |t: &Topology| {
        t.curl(
            &sb3,
            "origin",
            "http://198.51.100.20/",
            &["--max-time", "3"],
        )
    };
    let (code, body) = direct(&t);
    assert_eq!(
        code, 0,
        "the unfenced, unredirected sandbox should leak: {body}"
    );
    t.gateway_cli(&["redirect", "--fence", "--fence-pattern", "sbx*", "--apply"]);
    t.push(
        "sb3",
        SB3_IP,
        r#"{"default": "deny", "tls_interception": "on", "allow": [{"ip": "8.8.8.8"}, {"domain": "api.example.test"}]}"#,
    );
    let drops = fence_drops(&t);

    // Appeared, not attached: its DNS and its connections are dropped
    // before routing (counted), and the gateway sees no flow.
    let (code, body) = t.curl(
        &sb3,
        "gateway",
        "https://api.example.test/",
        &["--max-time", "3"],
    );
    assert_ne!(
        code, 0,
        "an unattached sandbox reached a destination: {body}"
    );
    let (code, body) = direct(&t);
    assert_ne!(code, 0, "the fence let a direct connection out: {body}");
    let fenced = fence_drops(&t);
    assert!(
        fenced > drops,
        "the fence counted no drop ({drops} -> {fenced})"
    );
    assert_eq!(
        sb3_flows(&t),
        0,
        "the gateway saw a flow from a fenced interface"
    );
    // Its fragments are dropped before connection tracking would
    // reassemble them, in memory the whole host shares.
    let fragments = || t.rule_count("egress_gw_fence", "ip frag-off & 16383 != 0");
    let before = fragments();
    let send = "import socket\n\
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
                s.setsockopt(socket.IPPROTO_IP, 10, 0)\n\
                s.sendto(b'x' * 3000, ('198.51.100.20', 53))\n";
    let out = t.exec(&sb3, "python3", &["-c", send]);
    assert!(out.status.success(), "{out:?}");
    assert!(
        fragments() >= before + 2,
        "the fence's fragment rule counted {before} → {}",
        fragments()
    );

    // Attached: its table and its place in the fence come in one transaction.
    t.gateway_cli(&["redirect", "--sandbox-iface", "sbx3", "--apply"]);
    let (code, body) = t.curl(&sb3, "gateway", "https://api.example.test/hello", &[]);
    assert_eq!(code, 0, "{body}");
    assert!(body.contains("fake internet: GET /hello"), "{body}");
    let flows = t.flows_when(|f| f.iter().any(|l| l["sandbox"] == json!("sb3")));
    assert!(
        flows
            .iter()
            .any(|l| l["sandbox"] == json!("sb3") && l["verdict"] == json!("intercept")),
        "{flows:?}"
    );

    // Detached: the table is gone and the fence closed again, together.
    t.gateway_cli(&["redirect", "--sandbox-iface", "sbx3", "--remove"]);
    let listed = t.exec(&t.gw, "nft", &["list", "table", "inet", "egress_gw_sbx3"]);
    assert!(
        !listed.status.success(),
        "the detached interface's table is still there"
    );
    let before = fence_drops(&t);
    let (code, body) = t.curl(
        &sb3,
        "gateway",
        "https://api.example.test/",
        &["--max-time", "3"],
    );
    assert_ne!(code, 0, "a detached sandbox reached a destination: {body}");
    let (code, body) = direct(&t);
    assert_ne!(code, 0, "a detached sandbox leaked directly: {body}");
    assert!(
        fence_drops(&t) > before,
        "the fence counted no drop after detaching"
    );

    // Detaching twice, and re-applying the fence, are harmless: the fence
    // keeps the attached sandboxes it knew (sb1 still reaches its site).
    t.gateway_cli(&["redirect", "--sandbox-iface", "sbx3", "--remove"]);
    t.gateway_cli(&[
        "redirect",
        "--fence",
        "--fence-pattern",
        "sbx*",
        "--fence-pattern",
        "sb1",
        "--apply",
    ]);
    t.push(
        "sb1",
        SB1_IP,
        r#"{"default": "allow", "tls_interception": "on"}"#,
    );
    let (code, body) = t.curl(&t.sb1, "gateway", "https://api.example.test/", &[]);
    assert_eq!(
        code, 0,
        "re-applying the fence cut an attached sandbox: {body}"
    );
}

/// With `redirect.fence` in its configuration, the gateway keeps the fence
/// in place: installed at its start, and installed again (counted) within
/// a few seconds after another tool deletes or empties it. Until this, a
/// ruleset flushed under a running gateway left every sandbox interface
/// unfenced for good. The interfaces it let through are attached again
/// with it, as is one whose table alone went: until then, a flushed
/// ruleset cut every sandbox off until someone attached it again.
#[test]
fn the_gateway_keeps_the_fence_in_place() {
    if !available() {
        return;
    }
    let mut t = Topology::new();
    t.set_extra_config("[redirect]\nfence = [\"sbx*\"]\n");
    assert!(t.stop_gateway().success());
    t.start_gateway();
    let fenced = |t: &Topology| {
        let out = t.exec(
            &t.gw,
            "nft",
            &["list", "chain", "inet", "egress_gw_fence", "fence"],
        );
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("\"sbx*\"")
    };
    let within = |what: &str| eventually(what, || fenced(&t));
    within("the gateway did not install the fence at its start");
    for how in ["delete", "flush"] {
        let out = t.exec(&t.gw, "nft", &[how, "table", "inet", "egress_gw_fence"]);
        assert!(out.status.success(), "{out:?}");
        assert!(!fenced(&t), "{how}: the fence is still there");
        within(&format!(
            "the fence did not come back after nft {how} table"
        ));
    }
    // An older build's fence, without the chain that drops fragments, is
    // installed again whole.
    let fragments = |t: &Topology| {
        t.exec(
            &t.gw,
            "nft",
            &["list", "chain", "inet", "egress_gw_fence", "fragments"],
        )
        .status
        .success()
    };
    let out = t.exec(
        &t.gw,
        "nft",
        &["delete", "chain", "inet", "egress_gw_fence", "fragments"],
    );
    assert!(out.status.success(), "{out:?}");
    eventually("the fence's fragments chain did not come back", || {
        fragments(&t)
    });
    assert!(fenced(&t), "the fence went with its fragments chain");
    // A process that binds the redirect rules' lock (any process of the
    // namespace can) does not keep a missing fence from coming back.
    let mut squatter = std::process::Command::new("ip")
        .args(["netns", "exec", &t.gw, "python3", "-c"])
        .arg(
            "import socket, time\n\
             s = socket.socket(socket.AF_UNIX)\n\
             s.bind('\\0egress-gateway/redirect-rules')\n\
             s.listen()\n\
             print('bound', flush=True)\n\
             time.sleep(60)\n",
        )
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3");
    let mut said = String::new();
    let stdout = squatter.stdout.as_mut().expect("stdout");
    std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut said).expect("read");
    assert_eq!(said.trim(), "bound");
    let out = t.exec(
        &t.gw,
        "nft",
        &["delete", "table", "inet", "egress_gw_fence"],
    );
    assert!(out.status.success(), "{out:?}");
    within("the fence did not come back while another process held the lock");
    let _ = squatter.kill();
    let _ = squatter.wait();
    // An attached interface whose table is emptied (or deleted) would pass
    // the fence unredirected: the gateway attaches it again.
    let sb3 = t.add_sandbox("sb3", "sbx3", 5);
    t.gateway_cli(&["redirect", "--sandbox-iface", "sbx3", "--apply"]);
    assert!(attached(&t), "attached");
    std::thread::sleep(std::time::Duration::from_secs(6));
    assert!(
        attached(&t),
        "an interface with its redirect stays attached"
    );
    let out = t.exec(&t.gw, "nft", &["flush", "table", "inet", "egress_gw_sbx3"]);
    assert!(out.status.success(), "{out:?}");
    assert!(!redirected(&t), "the flush left sbx3's redirect");
    eventually(
        "sbx3 was not attached again after its table was emptied",
        || redirected(&t) && attached(&t),
    );
    // A flushed ruleset takes the fence and the interfaces' tables in one
    // go: the fence comes back, and the interface it let through with it.
    let out = t.exec(
        &t.gw,
        "nft",
        &["delete table inet egress_gw_fence; delete table inet egress_gw_sbx3"],
    );
    assert!(out.status.success(), "{out:?}");
    assert!(!fenced(&t) && !redirected(&t), "the flush left rules");
    eventually("sbx3 was not attached again with the fence", || {
        fenced(&t) && redirected(&t) && attached(&t)
    });
    // And what it sends goes through the gateway again.
    t.push(
        "sb3",
        SB3_IP,
        r#"{"default": "deny", "tls_interception": "on", "allow": [{"ip": "8.8.8.8"}, {"domain": "api.example.test"}]}"#,
    );
    let (code, body) = t.curl(&sb3, "gateway", "https://api.example.test/hello", &[]);
    assert_eq!(code, 0, "{body}");
    assert!(body.contains("fake internet: GET /hello"), "{body}");
    let (_, metrics) = t.admin("GET", "/metrics", None);
    let restored = metrics
        .lines()
        .find_map(|l| l.strip_prefix("egress_redirect_fence_restored_total "))
        .unwrap_or_else(|| panic!("no fence metric:\n{metrics}"));
    // Four fences put back, sbx3 attached again twice, and the fence put
    // back with it once; the start's install is not counted.
    assert_eq!(
        restored.trim(),
        "7",
        "{}",
        std::fs::read_to_string(t.path("gateway.log")).unwrap_or_default()
    );
    moves_an_older_builds_table(&mut t);
    rewrites_an_older_builds_tracked_chain(&mut t);
}

/// An interface attached by a build whose `tracked` chain let a source the
/// full set could not take through uncounted (no `saddr != @tracked` drop)
/// has its table made again by the running gateway, still attached.
fn rewrites_an_older_builds_tracked_chain(t: &mut Topology) {
    let _sb5 = t.add_sandbox("sb5", "sbx5", 7);
    let rules = t.gateway_cli(&["redirect", "--sandbox-iface", "sbx5"]);
    let old: String = rules
        .lines()
        .filter(|l| !l.contains("saddr != @tracked"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_ne!(old, rules, "the older build's rules lack the drops");
    let script = std::env::temp_dir().join(format!("egw-old5-{}.nft", std::process::id()));
    std::fs::write(&script, old).expect("write the older build's rules");
    let out = t.exec(&t.gw, "nft", &["-f", script.to_str().expect("utf-8")]);
    let _ = std::fs::remove_file(&script);
    assert!(out.status.success(), "{out:?}");
    let chain = |t: &Topology| {
        let out = t.exec(
            &t.gw,
            "nft",
            &["list", "chain", "inet", "egress_gw_sbx5", "tracked"],
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    while !chain(t).contains("ip saddr != @tracked4") {
        assert!(
            std::time::Instant::now() < deadline,
            "not made again: {}",
            chain(t)
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let out = t.exec(
        &t.gw,
        "nft",
        &["list", "set", "inet", "egress_gw_fence", "attached"],
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("\"sbx5\""),
        "still attached: {out:?}"
    );
}

/// An interface attached by a build that named its table with `-` made
/// `_` (`egress_gw_sbx_4` for `sbx-4`, a name `sbx_4` shares) is moved to
/// its own table by the running gateway, still attached, the old one gone.
fn moves_an_older_builds_table(t: &mut Topology) {
    let _sb4 = t.add_sandbox("sb4", "sbx-4", 6);
    let rules = t.gateway_cli(&["redirect", "--sandbox-iface", "sbx-4"]);
    let old = rules.replace("egress_gw_sbx-4", "egress_gw_sbx_4");
    let script = std::env::temp_dir().join(format!("egw-old-{}.nft", std::process::id()));
    std::fs::write(&script, old).expect("write the older build's rules");
    let out = t.exec(&t.gw, "nft", &["-f", script.to_str().expect("utf-8")]);
    let _ = std::fs::remove_file(&script);
    assert!(out.status.success(), "{out:?}");
    let tables = |t: &Topology| {
        let out = t.exec(&t.gw, "nft", &["list", "tables"]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    // The keeper makes the new table, then deletes the old one in a second
    // nft run: both are waited for.
    let moved =
        |tables: &str| tables.contains("egress_gw_sbx-4") && !tables.contains("egress_gw_sbx_4");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    while !moved(&tables(t)) {
        assert!(
            std::time::Instant::now() < deadline,
            "not moved: {}",
            tables(t)
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let out = t.exec(&t.gw, "nft", &["list", "table", "inet", "egress_gw_sbx-4"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(r#"iifname "sbx-4" meta l4proto tcp redirect to"#),
        "{text}"
    );
    let out = t.exec(
        &t.gw,
        "nft",
        &["list", "set", "inet", "egress_gw_fence", "attached"],
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("\"sbx-4\""),
        "still attached: {out:?}"
    );
}

/// `egress-probe many` from sb1 to api.example.test by address (no DNS).
/// The name is exempt from interception, so each flow is spliced on its
/// SNI, which the gateway trusts only while it holds sb1's attribution of
/// the address to that name.
fn probe(t: &Topology, count: &str, concurrency: &str, path: &str) -> std::process::Child {
    probe_from(t, &t.sb1, (count, concurrency), path)
}

/// [`probe`] from the sandbox namespace `ns`.
fn probe_from(
    t: &Topology,
    ns: &str,
    (count, concurrency): (&str, &str),
    path: &str,
) -> std::process::Child {
    std::process::Command::new("ip")
        .args(["netns", "exec", ns])
        .arg(env!("CARGO_BIN_EXE_egress-probe"))
        .args([
            "many",
            "--connect",
            "203.0.113.10:443",
            "--sni",
            "api.example.test",
            "--ca",
        ])
        .arg(t.ca("both"))
        .args([
            "--count",
            count,
            "--concurrency",
            concurrency,
            "--path",
            path,
        ])
        .args(["--response-timeout-secs", "60"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("probe")
}

fn report(child: std::process::Child) -> serde_json::Value {
    let out = child.wait_with_output().expect("probe");
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)))
}

#[test]
fn a_gateway_replaced_under_load_loses_no_flow_and_keeps_its_state() {
    const HELD: u64 = 20;
    const LOAD: u64 = 3_000;
    if !available() {
        return;
    }
    let mut t = Topology::new();
    t.push(
        "sb1",
        SB1_IP,
        r#"{"default": "deny", "tls_interception": "on", "allow": [{"ip": "8.8.8.8"}, {"domain": "api.example.test"}],
            "tls_interception_exemptions": [{"domain": "api.example.test"}]}"#,
    );
    // sb2 has a budget of one request a minute to other.example.test.
    t.push(
        "sb2",
        SB2_IP,
        r#"{"default": "deny", "tls_interception": "on", "allow": [{"ip": "8.8.8.8"}, {"domain": "other.example.test"}],
            "budgets": [{"destination": "other.example.test", "requests_per_minute": 1}]}"#,
    );
    // The only DNS answer of the test: every flow below connects by address.
    assert!(t
        .dig(&t.sb1, "api.example.test", false)
        .contains("203.0.113.10"));

    // The successor's configuration: the same state_dir and [listen], its
    // own flow log, so each process's flows can be counted.
    let first = std::fs::read_to_string(t.path("gateway.toml")).expect("config");
    let flows_a = t.path("flows.jsonl");
    let flows_b = t.path("flows-b.jsonl");
    let second = first.replace(
        &format!("flow_log = \"{}\"", flows_a.display()),
        &format!("flow_log = \"{}\"", flows_b.display()),
    );
    assert_ne!(first, second);
    std::fs::write(t.path("gateway-b.toml"), &second).expect("config");

    // A successor with other listeners is refused; the running gateway
    // goes on serving as if nothing happened.
    let other = second.replace(
        "[listen]\n",
        "[listen]\n            admin = \"127.0.0.1:15999\"\n",
    );
    std::fs::write(t.path("gateway-other.toml"), other).expect("config");
    let refused = t.exec(
        &t.gw,
        bin("egress-gateway").to_str().expect("utf-8"),
        &[
            "run",
            "--take-over",
            "--config",
            t.path("gateway-other.toml").to_str().expect("utf-8"),
        ],
    );
    assert!(!refused.status.success());
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        said.contains("refused the takeover") && said.contains("[listen]"),
        "{said}"
    );
    assert_eq!(
        t.admin("GET", "/readyz", None).0,
        200,
        "the running gateway stopped"
    );

    // Requests the origin holds: open on the first gateway when it hands over.
    let held = probe(&t, "20", "20", "/hold");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while t.reached() < HELD && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    if t.reached() < HELD {
        let mut held = held;
        let _ = held.kill();
        let out = held.wait_with_output().expect("probe");
        panic!(
            "the held requests did not all reach the origin: {} {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    // Load, new connection by new connection, across the replacement.
    let load = probe(&t, &LOAD.to_string(), "16", "/bytes/1000");
    while t.reached() < HELD + 300 {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    // sb2 spends its budget on the first gateway...
    let other = |t: &Topology| {
        t.curl(
            &t.sb2,
            "both",
            "https://other.example.test/",
            &["-4", "--max-time", "3"],
        )
        .1
    };
    let once = other(&t);
    assert!(!once.contains("budget_exceeded"), "{once}");
    let spent = other(&t);
    assert!(spent.contains("budget_exceeded"), "{spent}");
    t.take_over_gateway(&t.path("gateway-b.toml"), "gateway-b.log");
    // ...and the successor took the spent state over (a fresh budget before).
    let after = other(&t);
    assert!(
        after.contains("budget_exceeded"),
        "after the takeover: {after}"
    );
    let (status, sandboxes) = t.admin("GET", "/v1/sandboxes", None);
    assert_eq!(status, 200);
    assert!(
        sandboxes.contains("\"sb1\""),
        "the pushed state was not carried over: {sandboxes}"
    );

    let load = report(load);
    assert_eq!(load["ok"], serde_json::json!(LOAD), "{load}");
    assert_eq!(load["errors"], serde_json::json!({}), "{load}");
    // The predecessor finishes what it had open, then exits cleanly.
    let (_, released) = t.http_in_gw("GET", "http://203.0.113.10/_release", &[], None);
    assert!(released.contains("released"), "{released}");
    let held = report(held);
    assert_eq!(held["ok"], serde_json::json!(HELD), "{held}");
    assert!(t
        .wait_predecessor(std::time::Duration::from_secs(20))
        .success());

    // Every connection was served by one of the two, and each served some.
    let count = |path: &std::path::Path| {
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("\"verdict\":\"splice\""))
            .count() as u64
    };
    // The successor writes its lines from its log thread: wait for them.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let (mut a, mut b) = (count(&flows_a), count(&flows_b));
    while a + b < HELD + LOAD && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(100));
        (a, b) = (count(&flows_a), count(&flows_b));
    }
    assert!(
        a > HELD && b > 0,
        "first gateway {a} flows, successor {b}: {}",
        std::fs::read_to_string(&flows_b)
            .unwrap_or_default()
            .lines()
            .take(3)
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_eq!(
        a + b,
        HELD + LOAD,
        "first gateway {a} + successor {b} spliced flows"
    );
    // The successor still refuses what the policy refuses.
    let (code, body) = t.curl(
        &t.sb1,
        "both",
        "https://other.example.test/",
        &["-4", "--max-time", "3"],
    );
    assert!(!(code == 0 && body.contains("fake internet")), "{body}");
    println!(
        "replaced under load: {LOAD} requests, none failed; {a} flows on the first gateway (its {HELD} held requests finished after the handover), {b} on the successor, which served by sb1's carried-over attribution"
    );
}

/// A sandbox deleted on the successor loses its spliced flows still
/// draining on the predecessor within a second or two (the successor tells
/// the predecessor over the handover connection), not at the drain's end;
/// another sandbox's draining flows finish.
#[test]
fn a_sandbox_deleted_on_the_successor_loses_its_flows_draining_on_the_predecessor() {
    const HELD: u64 = 4;
    if !available() {
        return;
    }
    let mut t = Topology::new();
    let exempt = r#"{"default": "deny", "tls_interception": "on", "allow": [{"ip": "8.8.8.8"}, {"domain": "api.example.test"}],
            "tls_interception_exemptions": [{"domain": "api.example.test"}]}"#;
    t.push("sb1", SB1_IP, exempt);
    t.push("sb2", SB2_IP, exempt);
    for ns in [&t.sb1, &t.sb2] {
        assert!(t
            .dig(ns, "api.example.test", false)
            .contains("203.0.113.10"));
    }
    let held = |ns: &str| probe_from(&t, ns, (&HELD.to_string(), &HELD.to_string()), "/hold");
    let (mut of_sb1, of_sb2) = (held(&t.sb1), held(&t.sb2));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while t.reached() < 2 * HELD && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(
        t.reached(),
        2 * HELD,
        "the held requests reached the origin"
    );
    t.take_over_gateway(&t.path("gateway.toml"), "gateway-b.log");
    let (status, body) = t.admin("DELETE", "/v1/sandboxes/sb1", None);
    assert_eq!(status, 200, "{body}");
    // The drain lasts 10 s: sb1's flows end well before it.
    let deleted = std::time::Instant::now();
    let ended = loop {
        if let Some(status) = of_sb1.try_wait().expect("probe") {
            break Some(status);
        }
        if deleted.elapsed() > std::time::Duration::from_secs(5) {
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let took = deleted.elapsed();
    assert!(
        ended.is_some(),
        "sb1's flows on the predecessor still open 5 s after its delete"
    );
    let cut = report(of_sb1);
    assert_eq!(cut["ok"], serde_json::json!(0), "{cut}");
    let (_, released) = t.http_in_gw("GET", "http://203.0.113.10/_release", &[], None);
    assert!(released.contains("released"), "{released}");
    let kept = report(of_sb2);
    assert_eq!(kept["ok"], serde_json::json!(HELD), "{kept}");
    assert!(t
        .wait_predecessor(std::time::Duration::from_secs(20))
        .success());
    println!(
        "sb1's {HELD} draining flows ended {took:?} after its delete on the successor; sb2's finished"
    );
}

/// The next notification on `socket` (a stand-in for systemd's notify
/// socket: systemd does not run here), as text.
fn notification(socket: &std::os::unix::net::UnixDatagram) -> String {
    let mut buf = [0u8; 4096];
    let n = socket.recv(&mut buf).expect("a notification within 20 s");
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

#[test]
fn sigusr2_starts_a_successor_that_takes_over_and_tells_systemd() {
    if !available() {
        return;
    }
    let mut t = Topology::new();
    let socket = std::os::unix::net::UnixDatagram::bind(t.path("notify")).expect("bind");
    socket
        .set_read_timeout(Some(std::time::Duration::from_secs(20)))
        .expect("timeout");
    let path = t.path("notify").display().to_string();
    t.gateway_env.push(("NOTIFY_SOCKET".into(), path));
    t.stop_gateway();
    t.start_gateway();
    let first = t.gateway_pid();
    let said = notification(&socket);
    assert!(
        said.contains("READY=1") && said.contains(&format!("MAINPID={first}")),
        "{said}"
    );
    t.push(
        "sb1",
        SB1_IP,
        r#"{"default": "allow", "tls_interception": "on"}"#,
    );
    let (code, body) = t.curl(
        &t.sb1,
        "gateway",
        "https://api.example.test/before",
        &["-4"],
    );
    assert_eq!(code, 0, "{body}");

    run("kill", &["-USR2", &first.to_string()]);
    // The successor (started by the gateway itself, the same command with
    // --take-over) says it is now the service's main process as soon as it
    // holds the sockets, before it serves: the first gateway waits for
    // that before it drains and exits, so systemd never sees the main
    // process gone. Then it says it serves.
    let main_pid = |said: &str| -> u32 {
        said.lines()
            .find_map(|l| l.strip_prefix("MAINPID="))
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no MAINPID in {said:?}"))
    };
    let said = notification(&socket);
    let successor = main_pid(&said);
    assert!(!said.contains("READY=1") && successor != first, "{said}");
    let said = notification(&socket);
    assert!(
        said.contains("READY=1") && main_pid(&said) == successor,
        "{said}"
    );
    let cmdline = std::fs::read(format!("/proc/{successor}/cmdline")).expect("successor");
    assert!(
        String::from_utf8_lossy(&cmdline).contains("--take-over"),
        "{}",
        String::from_utf8_lossy(&cmdline)
    );
    // The first one drains (nothing is open) and exits cleanly.
    assert!(t
        .wait_gateway_exit(std::time::Duration::from_secs(20))
        .success());
    let (_, sandboxes) = t.admin("GET", "/v1/sandboxes", None);
    assert!(sandboxes.contains("\"sb1\""), "{sandboxes}");
    let (code, body) = t.curl(&t.sb1, "gateway", "https://api.example.test/after", &["-4"]);
    assert_eq!(code, 0, "the successor does not serve: {body}");
}

/// A sandbox has any number of link-local addresses, so they are good only
/// for finding neighbours: echo requests from three of them to the host
/// are dropped, and none is counted as a source (each would have had a
/// bound of connections of its own). A router advertisement from the
/// sandbox never gives the host a default route through it, even on an
/// interface that would take one.
#[test]
fn link_local_sources_only_find_neighbours_and_never_route() {
    if !available() {
        return;
    }
    let mut t = Topology::new();
    let sb3 = t.add_sandbox("sb3", "sbx3", 5);
    t.gateway_cli(&["redirect", "--sandbox-iface", "sbx3", "--apply"]);
    t.take_router_advertisements("sbx3");
    let sbx3 = t.link_local(&t.gw, "sbx3");
    t.link_local(&sb3, "eth0");
    for n in 1..=3 {
        let source = format!("fe80::51:{n}");
        let add = [
            "addr",
            "add",
            &format!("{source}/64"),
            "dev",
            "eth0",
            "nodad",
        ];
        assert!(t.exec(&sb3, "ip", &add).status.success());
        // An echo request from `source` (python3: the image has no ping);
        // exits 0 on the reply.
        let echo = format!(
            r#"
import socket, struct, sys
s = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
i = socket.if_nametoindex("eth0")
s.bind(("{source}", 0, 0, i))
s.settimeout(2.0)
s.sendto(struct.pack("!BBHHH", 128, 0, 0, 7, {n}), ("{sbx3}", 0, 0, i))
try:
    while True:
        if s.recv(64)[0] == 129:
            sys.exit(0)
except socket.timeout:
    sys.exit(1)
"#
        );
        let echoed = t.exec(&sb3, "python3", &["-c", &echo]);
        assert_eq!(
            echoed.status.code(),
            Some(1),
            "an echo request from {source} reached the host: {}",
            String::from_utf8_lossy(&echoed.stderr)
        );
    }
    let set = t.exec(
        &t.gw,
        "nft",
        &["list", "set", "inet", "egress_gw_sbx3", "tracked6"],
    );
    let set = String::from_utf8_lossy(&set.stdout);
    assert!(!set.contains("fe80"), "link-local sources counted: {set}");
    t.advertise_router(&sb3, "eth0");
    std::thread::sleep(std::time::Duration::from_millis(500));
    let routes = t.exec(&t.gw, "ip", &["-6", "route", "show", "default"]);
    let routes = String::from_utf8_lossy(&routes.stdout);
    assert!(
        !routes.contains("sbx3"),
        "the sandbox's advertisement made it the host's router: {routes}"
    );
}
