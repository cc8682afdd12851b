//! A fleet's worker: sandbox interfaces fenced from the moment they appear
//! and redirected exactly while attached.

use serde_json::json;

use crate::topology::*;

/// The third sandbox's address (see [`Topology::add_sandbox`]).
const SB3_IP: &str = "100.64.5.2";

/// The fence's drop counter for its first pattern.
fn fence_drops(t: &Topology) -> u64 {
    let out = t.exec(
        &t.gw,
        "nft",
        &["list", "chain", "inet", "egress_gw_fence", "fence"],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    text.split("counter packets ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no fence counter in {text}"))
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
