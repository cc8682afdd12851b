//! Behind a corporate proxy: `egress-fakeproxy` in the fake internet stands
//! in for the operator's CONNECT proxy, and the gateway's `[upstream_proxy]`
//! names it. An allowed HTTPS destination is reached through it (its log
//! shows a CONNECT to the origin's address), a denied one is refused by the
//! gateway with nothing asked of the proxy, a proxy that refuses gives the
//! sandbox a 502, and a registration's `"direct"` bypasses the proxy.

use std::process::{Child, Command};

use crate::topology::*;

/// The proxies' address in the fake internet (added to its loopback).
const PROXY_IP: &str = "203.0.113.8";

/// A fake proxy in the internet namespace, killed (by PID) on drop.
struct FakeProxy(Child);

impl FakeProxy {
    fn start(t: &Topology, port: u16, log: &str, answer: Option<u16>) -> Self {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &t.inet])
            .arg(env!("CARGO_BIN_EXE_egress-fakeproxy"))
            .args(["--listen", &format!("{PROXY_IP}:{port}"), "--log"])
            .arg(t.path(log));
        if let Some(status) = answer {
            cmd.args(["--answer", &status.to_string()]);
        }
        Self(spawn_ready(&mut cmd, "the fake proxy"))
    }
}

impl Drop for FakeProxy {
    fn drop(&mut self) {
        // `ip netns exec` execs the proxy: this PID is the proxy's.
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The fake proxy's log so far.
fn proxy_log(t: &Topology, log: &str) -> String {
    std::fs::read_to_string(t.path(log)).unwrap_or_default()
}

/// Registers sandbox `id` (sb1's or sb2's addresses) with `policy` and,
/// unless `None`, its own `upstream_proxy`.
fn register(t: &Topology, id: &str, addrs: [&str; 2], policy: &str, way: Option<&str>) {
    let way = way.map_or(String::new(), |w| format!(r#", "upstream_proxy": "{w}""#));
    let doc = format!(
        r#"{{"addresses": ["{}", "{}"], "policy": {policy}{way}}}"#,
        addrs[0], addrs[1]
    );
    let (status, body) = t.admin("PUT", &format!("/v1/sandboxes/{id}"), Some(&doc));
    assert_eq!(status, 200, "register {id}: {body}");
}

const POLICY: &str = r#"{"default": "deny", "tls_interception": "on",
    "allow": [{"ip": "8.8.8.8"}, {"domain": "api.example.test"}, {"domain": "other.example.test"}]}"#;

#[test]
fn proxy_an_allowed_destination_goes_through_it_a_denied_one_never_reaches_it() {
    if !available() {
        return;
    }
    let mut t = Topology::new();
    run(
        "ip",
        &[
            "-n",
            &t.inet,
            "addr",
            "add",
            &format!("{PROXY_IP}/32"),
            "dev",
            "lo",
        ],
    );
    let corp = FakeProxy::start(&t, 3128, "corp.log", None);
    let refuser = FakeProxy::start(&t, 3129, "refuser.log", Some(403));
    let password = t.path("proxy-password");
    std::fs::write(&password, "s3cret\n").expect("password");
    t.stop_gateway();
    t.set_extra_config(&format!(
        r#"
        [upstream_proxy]
        default = "corp"
        [upstream_proxy.proxies.corp]
        address = "{PROXY_IP}:3128"
        username = "gw"
        password_file = "{}"
        [upstream_proxy.proxies.refuser]
        address = "{PROXY_IP}:3129"
        "#,
        password.display()
    ));
    t.start_gateway();
    register(&t, "sb1", [SB1_IP, SB1_IP6], POLICY, None);
    register(&t, "sb2", [SB2_IP, SB2_IP6], POLICY, Some("refuser"));

    // Allowed: through the proxy, which is asked for the origin's address.
    let (code, body) = t.curl(&t.sb1, "gateway", "https://api.example.test/hello", &["-4"]);
    assert_eq!(code, 0, "{body}");
    assert!(
        body.contains("fake internet: GET /hello host=api.example.test"),
        "{body}"
    );
    let log = proxy_log(&t, "corp.log");
    assert!(
        log.contains("CONNECT 203.0.113.10:443 HTTP/1.1 auth=Basic Z3c6czNjcmV0"),
        "{log}"
    );

    // Denied (not in the allow list): refused by the gateway; the proxy
    // never hears of it.
    let (code, _) = t.curl(&t.sb1, "gateway", "https://a.relay.example.test/", &["-4"]);
    assert_ne!(code, 0);
    let log = proxy_log(&t, "corp.log");
    assert!(!log.contains("203.0.113.20"), "{log}");

    // sb2's proxy refuses: the sandbox gets a 502 that says so.
    let (code, body) = t.curl(
        &t.sb2,
        "gateway",
        "https://api.example.test/hello",
        &["-4", "-i"],
    );
    assert_eq!(code, 0, "{body}");
    assert!(
        body.starts_with("HTTP/1.1 502") || body.starts_with("HTTP/2 502"),
        "{body}"
    );
    assert!(
        body.contains("x-egress-upstream-proxy: refuser; refused; status=403"),
        "{body}"
    );
    assert!(
        proxy_log(&t, "refuser.log").contains("CONNECT 203.0.113.10:443 HTTP/1.1 auth=-"),
        "the refusing proxy was asked"
    );

    // sb1 registered "direct": the proxy is bypassed.
    register(&t, "sb1", [SB1_IP, SB1_IP6], POLICY, Some("direct"));
    let before = proxy_log(&t, "corp.log").lines().count();
    let (code, body) = t.curl(&t.sb1, "gateway", "https://other.example.test/", &["-4"]);
    assert_eq!(code, 0, "{body}");
    assert_eq!(
        proxy_log(&t, "corp.log").lines().count(),
        before,
        "direct: nothing asked of the proxy"
    );

    // The flow log of the refused flow says why.
    let flows = t.flows_when(|f| f.iter().any(|l| l["sandbox"] == "sb2"));
    assert!(
        flows
            .iter()
            .any(|l| l["sandbox"] == "sb2" && l["requests"] == 1),
        "{flows:?}"
    );
    drop((corp, refuser));
}
