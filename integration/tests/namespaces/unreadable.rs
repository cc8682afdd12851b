//! What the gateway cannot read, behind the real redirect: a ClientHello
//! carrying `encrypted_client_hello` to a name an exemption covers is never
//! spliced, and with `policy.opaque_streams = "deny"` an unreadable stream
//! to an allowed address is refused while SSH to an entry that names it
//! passes.

use egress_gateway::peek::fixture::{ech_outer, hello_with, records, sni_data};
use serde_json::json;

use crate::topology::{available, Topology, SB1_IP};

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `egress-probe request --hex` from sb1: what came back.
fn send(t: &Topology, dst: &str, bytes: &[u8]) -> String {
    let out = t.exec(
        &t.sb1,
        env!("CARGO_BIN_EXE_egress-probe"),
        &["request", "--connect", dst, "--hex", &hex(bytes)],
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn an_ech_hello_to_an_exempt_name_is_never_spliced() {
    if !available() {
        return;
    }
    let t = Topology::new();
    t.push(
        "sb1",
        SB1_IP,
        r#"{"default": "deny", "tls_interception": "on",
            "allow": [{"ip": "8.8.8.8"}, {"wildcard_domain": "*.relay.example.test"}],
            "tls_interception_exemptions": [{"wildcard_domain": "*.relay.example.test"}]}"#,
    );
    assert!(t
        .dig(&t.sb1, "a.relay.example.test", false)
        .contains("203.0.113.20"));
    let sni = (0x0000, sni_data(&[(0, b"a.relay.example.test")]));
    // The same hello with and without an outer ECH extension.
    for (ech, reason) in [(false, "exempt"), (true, "ech")] {
        let mut exts = vec![sni.clone()];
        if ech {
            exts.push((0xfe0d, ech_outer(0x17, 32, 180)));
        }
        send(&t, "203.0.113.20:443", &records(&hello_with(&exts), 16_384));
        let flows = t.flows_when(|f| f.iter().any(|l| l["reason"] == reason));
        let flow = flows.iter().find(|l| l["reason"] == reason);
        let verdict = if ech { "intercept" } else { "splice" };
        assert_eq!(
            flow.map(|l| &l["verdict"]),
            Some(&json!(verdict)),
            "ech={ech}: {flows:?}"
        );
    }
}

#[test]
fn unreadable_streams_are_refused_and_named_ssh_passes() {
    if !available() {
        return;
    }
    let mut t = Topology::new();
    t.stop_gateway();
    t.set_policy_config(r#"opaque_streams = "deny""#);
    t.start_gateway();
    t.push(
        "sb1",
        SB1_IP,
        r#"{"default": "deny",
            "allow": [{"ip": "203.0.113.43", "streams": ["ssh"]}, {"ip": "203.0.113.44"}]}"#,
    );
    // SSH to the entry that names it: both ways.
    let reply = send(&t, "203.0.113.43:22", b"SSH-2.0-OpenSSH_9.6\r\n");
    assert!(reply.contains("SSH-2.0-fake-internet"), "{reply}");
    // An SSLv2-style hello to an address allowed without `streams`.
    let sslv2 = [
        0x80, 0x2e, 0x01, 0x00, 0x02, 0x00, 0x15, 0x00, 0x00, 0x00, 0x10,
    ];
    let reply = send(&t, "203.0.113.44:22", &sslv2);
    assert!(!reply.contains("SSH-2.0-fake-internet"), "{reply}");
    let flows = t.flows_when(|f| f.len() >= 2);
    let by_dst = |dst: &str| {
        flows
            .iter()
            .find(|l| l["dst"] == dst)
            .cloned()
            .unwrap_or_default()
    };
    let ssh = by_dst("203.0.113.43:22");
    assert_eq!(
        (&ssh["verdict"], &ssh["protocol"]),
        (&json!("allow"), &json!("ssh")),
        "{flows:?}"
    );
    let opaque = by_dst("203.0.113.44:22");
    assert_eq!(
        (&opaque["verdict"], &opaque["reason"]),
        (&json!("deny"), &json!("unreadable_stream")),
        "{flows:?}"
    );
}
