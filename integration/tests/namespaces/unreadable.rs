//! What the gateway cannot read, behind the real redirect: a ClientHello
//! carrying `encrypted_client_hello` to a name an exemption covers is never
//! spliced, and with `policy.opaque_streams = "deny"` an unreadable stream
//! to an allowed address is refused while SSH to an entry that names it
//! passes; and a sandbox interface tracks at most its bound of connections,
//! for at most its bound of sources.

use egress_gateway::peek::fixture::{ech_outer, hello_with, records, sni_data};
use serde_json::json;

use crate::topology::{available, Topology, SB1_IP, SB2_IP};

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

/// The topology with sb1 and sb2 open, and sb1's interface attached again
/// by `egress-gateway redirect --apply` under a configuration of `toml`.
fn attached_with(toml: &str) -> Topology {
    let t = Topology::new();
    let open = r#"{"default": "allow", "tls_interception": "on"}"#;
    t.push("sb1", SB1_IP, open);
    t.push("sb2", SB2_IP, open);
    let config = t.path("redirect.toml");
    std::fs::write(&config, toml).expect("config");
    let gateway = crate::topology::bin("egress-gateway");
    let config = config.to_str().expect("utf-8");
    let args = [
        "redirect",
        "--sandbox-iface",
        "sb1",
        "--config",
        config,
        "--apply",
    ];
    let out = t.exec(&t.gw, gateway.to_str().expect("utf-8"), &args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    t
}

/// A sandbox holding connections fills its own share of the host's
/// connection tracking, not the table: past `redirect.max_tracked_connections`
/// open ones from a source address, that address's new connections are
/// dropped before NAT (a SYN that never gets an answer), while its other
/// address (IPv6) and the other sandbox still connect; once it lets its
/// connections go, it connects again.
#[test]
fn a_sandbox_interface_tracks_at_most_its_bound_of_connections() {
    if !available() {
        return;
    }
    let t = attached_with("[redirect]\nmax_tracked_connections = 4\n");
    // Four held, a fifth refused; all let go, and a sixth connects.
    // All within the gateway's peek timeout (2 s), which would close the
    // held ones: four held, its IPv6 address (another source) connects, a
    // fifth from the IPv4 one does not; all let go, and a sixth connects.
    let script = r#"
import socket, time
def dial(family=socket.AF_INET, to=("203.0.113.20", 443)):
    s = socket.socket(family); s.settimeout(1.0)
    try:
        s.connect(to); return s
    except OSError:
        return None
held = [dial() for _ in range(4)]
print("held", sum(s is not None for s in held))
print("own address", dial(socket.AF_INET6, ("2001:db8:f::20", 443)) is not None)
print("fifth", dial() is not None)
for s in held:
    if s: s.close()
time.sleep(1.0)
print("after", dial() is not None)
"#;
    let out = t.exec(&t.sb1, "python3", &["-c", script]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        said,
        "held 4\nown address True\nfifth False\nafter True\n",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let other = "import socket; socket.create_connection(('203.0.113.20', 443), 2); print('ok')";
    let out = t.exec(&t.sb2, "python3", &["-c", other]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "ok\n",
        "sb2 is not bounded by sb1's table"
    );
}

/// A source the interface's full set of counted sources cannot take is
/// not let through uncounted: with room for one source of each family,
/// sb1's IPv6 address connects and a second one on its prefix (routed
/// back through sb1: no spoof) is dropped, while its IPv4 address and sb2,
/// on its own interface, still connect.
#[test]
fn a_source_past_the_counted_sources_is_dropped() {
    if !available() {
        return;
    }
    let t = attached_with("[redirect]\nmax_tracked_sources = 1\n");
    let second = [
        "-6",
        "addr",
        "add",
        "2001:db8:1::3/64",
        "dev",
        "eth0",
        "nodad",
    ];
    assert!(t.exec(&t.sb1, "ip", &second).status.success());
    // The gateway's side knows the second address's link address (its
    // neighbour solicitation would go unanswered in this topology).
    let mac = t.exec(&t.sb1, "cat", &["/sys/class/net/eth0/address"]);
    let mac = String::from_utf8_lossy(&mac.stdout).trim().to_owned();
    let neigh = [
        "-6",
        "neigh",
        "replace",
        "2001:db8:1::3",
        "lladdr",
        &mac,
        "dev",
        "sb1",
    ];
    assert!(t.exec(&t.gw, "ip", &neigh).status.success());
    let script = r#"
import socket
def dial(source, to=("2001:db8:f::20", 443)):
    s = socket.socket(socket.AF_INET6); s.settimeout(1.0)
    try:
        s.bind((source, 0)); s.connect(to); return s
    except OSError:
        return None
first = dial("2001:db8:1::2")
print("first", first is not None)
print("second source", dial("2001:db8:1::3") is not None)
print("first again", dial("2001:db8:1::2") is not None)
print("ipv4", socket.create_connection(("203.0.113.20", 443), 2) is not None)
"#;
    // What the rule for sources past the set dropped: the second source's
    // dial is refused there, not lost on the way.
    let past_the_set = || -> u64 {
        let listed = t.exec(&t.gw, "nft", &["list", "ruleset"]);
        String::from_utf8_lossy(&listed.stdout)
            .lines()
            .filter(|l| l.contains("ip6 saddr != @tracked6 counter"))
            .filter_map(|l| {
                l.split("packets ")
                    .nth(1)?
                    .split_whitespace()
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
            .sum()
    };
    let before = past_the_set();
    let out = t.exec(&t.sb1, "python3", &["-c", script]);
    assert!(
        past_the_set() > before,
        "the second source was not dropped by its rule"
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "first True\nsecond source False\nfirst again True\nipv4 True\n",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let other = "import socket; socket.create_connection(('203.0.113.20', 443), 2); print('ok')";
    let out = t.exec(&t.sb2, "python3", &["-c", other]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "ok\n",
        "sb2 is not bounded by sb1's set"
    );
}
