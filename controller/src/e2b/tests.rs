//! Tests for the E2B translation: parsing, each translation case, the CIDR
//! difference against exhaustive and random sets, and end to end against E2B's
//! own rule and the gateway's matcher.

use std::net::SocketAddr;
use std::sync::Arc;

use egress_policy::{CompiledPolicy, Flow, PlatformDenies, Protocol, Verdict};
use serde_json::json;

use super::*;

fn body(v: serde_json::Value) -> Vec<u8> {
    serde_json::to_vec(&v).expect("serialises")
}

fn create(network: serde_json::Value) -> E2bCreate {
    let mut v = json!({"templateID": "base"});
    for (k, val) in network.as_object().expect("object") {
        v[k] = val.clone();
    }
    parse(&body(v)).expect("valid body")
}

fn net(s: &str) -> IpNet {
    s.parse().expect(s)
}

fn nets(list: &[&str]) -> Vec<IpNet> {
    list.iter().map(|s| net(s)).collect()
}

fn dests(list: &[&str]) -> Vec<egress_policy::Rule> {
    list.iter()
        .map(|s| parse_entry(s).expect(s).into())
        .collect()
}

fn translated(network: serde_json::Value) -> Policy {
    let c = create(network);
    let p = translate(&c).unwrap_or_else(|e| panic!("{c:?}: {e}"));
    assert_eq!(p.tls_interception, TlsInterception::Off);
    assert!(p.tls_interception_exemptions.is_empty());
    let text = serde_json::to_string(&p).expect("serialises");
    let again = Policy::from_json(&text).expect("the output parses");
    assert_eq!(again, p, "the output is in normal form: {text}");
    p
}

fn inexact(network: serde_json::Value) -> String {
    match translate(&create(network)) {
        Err(E2bError::Inexact(why)) => why,
        other => panic!("expected Inexact, got {other:?}"),
    }
}

// --- parse ---

#[test]
fn parses_every_documented_field() {
    let c = parse(&body(json!({
        "templateID": "base",
        "timeout": 300,
        "metadata": {"user": "u1", "n": 2},
        "allow_internet_access": true,
        "network": {"allowOut": ["1.1.1.1"], "denyOut": ["0.0.0.0/0"]},
        "envVars": {"A": "1"},
        "secure": true,
        "autoPause": false
    })))
    .expect("valid");
    assert_eq!(c.template_id, "base");
    assert_eq!(c.timeout, Some(300));
    assert_eq!(c.metadata.expect("metadata")["n"], json!(2));
    assert_eq!(c.allow_internet_access, Some(true));
    let n = c.network.expect("network");
    assert_eq!(
        (n.allow_out, n.deny_out),
        (vec!["1.1.1.1".to_owned()], vec!["0.0.0.0/0".to_owned()])
    );
}

#[test]
fn minimal_and_null_fields() {
    let c = parse(br#"{"templateID": "t", "timeout": null, "network": {}}"#).expect("valid");
    assert_eq!(c.timeout, None);
    assert_eq!(c.metadata, None);
    assert_eq!(c.allow_internet_access, None);
    assert_eq!(
        c.network,
        Some(E2bNetwork {
            allow_out: vec![],
            deny_out: vec![]
        })
    );
}

/// Bodies `parse` refuses, and what the error must say (field path first).
const PARSE_ERRORS: &[(&[u8], &str)] = &[
    (br#"{"timeout": 5}"#, "missing field `templateID`"),
    (
        br#"{"templateID": "t", "template": "x"}"#,
        "unknown field `template`",
    ),
    (
        br#"{"templateID": "t", "network": {"allowOUT": []}}"#,
        "network.allowOUT: unknown field `allowOUT`",
    ),
    (
        br#"{"templateID": "t", "timeout": -1}"#,
        "timeout: invalid value: integer `-1`",
    ),
    (
        br#"{"templateID": "t", "allow_internet_access": "no"}"#,
        "allow_internet_access: invalid type: string \"no\"",
    ),
    (
        br#"{"templateID": "t", "allowInternetAccess": false}"#,
        "unknown field `allowInternetAccess`",
    ),
    (
        br#"{"templateID": "t", "network": {"allowOut": "1.1.1.1"}}"#,
        "network.allowOut: invalid type: string \"1.1.1.1\"",
    ),
    (
        br#"{"templateID": "t", "network": {"denyOut": ["1.1.1.1", 7]}}"#,
        "network.denyOut[1]: invalid type: integer `7`",
    ),
    (
        br#"{"templateID": "t", "network": [["1.1.1.1"], []]}"#,
        "network: invalid type: sequence, expected an object",
    ),
    (br#"["t", 5]"#, "invalid type: sequence, expected an object"),
    (
        br#"{"templateID": "t", "metadata": {"a": "1", "a": "2"}}"#,
        "metadata: duplicate key \"a\"",
    ),
    (
        br#"{"templateID": "t", "envVars": {"A": 1}}"#,
        "envVars.A: invalid type: integer `1`",
    ),
    (
        br#"{"templateID": "t", "secure": "yes"}"#,
        "secure: invalid type: string \"yes\"",
    ),
    (
        br#"{"templateID": "t", "templateID": "u"}"#,
        "duplicate field `templateID`",
    ),
    (br#"{"templateID": "t"} {}"#, "trailing characters"),
    (br#"{"templateID": "t""#, "EOF"),
    (b"", "EOF"),
    (b"{\"templateID\": \"\xff\"}", "not UTF-8"),
];

#[test]
fn parse_errors_name_field_and_value() {
    for (text, needle) in PARSE_ERRORS {
        let shown = String::from_utf8_lossy(text);
        match parse(text) {
            Err(E2bError::Invalid(msg)) => {
                assert!(msg.contains(needle), "{shown}: {msg:?} lacks {needle:?}");
            }
            other => panic!("{shown}: expected Invalid, got {other:?}"),
        }
    }
}

// --- entries ---

#[test]
fn invalid_entries_name_list_index_and_value() {
    let cases = [
        (json!({"allowOut": ["1.1.1.1", "10.0.0.1/8"]}), "network.allowOut[1]: cidr \"10.0.0.1/8\" has host bits set: did you mean \"10.0.0.0/8\"?"),
        (json!({"denyOut": ["2001:db8::1/32"]}), "network.denyOut[0]: cidr \"2001:db8::1/32\" has host bits set: did you mean \"2001:db8::/32\"?"),
        (json!({"denyOut": ["10.0.0.0/33"]}), "network.denyOut[0]: invalid cidr \"10.0.0.0/33\""),
        (json!({"allowOut": ["bad_name.test"]}), "network.allowOut[0]: \"bad_name.test\" is not an IP address, a CIDR or a domain name: character '_'"),
        (json!({"allowOut": ["1.2.3"]}), "network.allowOut[0]: \"1.2.3\" is not an IP address, a CIDR or a domain name: an IP literal"),
        (json!({"allowOut": ["1.2.3.4:443"]}), "network.allowOut[0]: \"1.2.3.4:443\" is not an IP address"),
        (json!({"allowOut": ["a.test", ""]}), "network.allowOut[1]: \"\" is not an IP address, a CIDR or a domain name: empty name"),
        (json!({"allowOut": ["*.*.a.test"]}), "network.allowOut[0]: invalid wildcard_domain \"*.*.a.test\""),
    ];
    for (network, want) in cases {
        let c = create(json!({"network": network}));
        match translate(&c) {
            Err(E2bError::Invalid(msg)) => assert!(msg.starts_with(want), "{msg:?} vs {want:?}"),
            other => panic!("{network}: expected Invalid, got {other:?}"),
        }
    }
}

#[test]
fn invalid_beats_inexact() {
    let c =
        create(json!({"network": {"allowOut": ["a.test", "nope!"], "denyOut": ["10.0.0.0/8"]}}));
    assert!(
        matches!(translate(&c), Err(E2bError::Invalid(m)) if m.starts_with("network.allowOut[1]"))
    );
}

#[test]
fn entries_take_the_normal_form() {
    let got = dests(&[
        "API.Example.test.",
        "::ffff:1.2.3.4",
        "1.2.3.4/32",
        "2001:db8::1/128",
        "::ffff:10.0.0.0/104",
        "*.Relay.test",
    ]);
    let text = serde_json::to_value(&got).expect("serialises");
    assert_eq!(
        text,
        json!([
            {"domain": "api.example.test"}, {"ip": "1.2.3.4"}, {"ip": "1.2.3.4"},
            {"ip": "2001:db8::1"}, {"cidr": "10.0.0.0/8"}, {"wildcard_domain": "*.relay.test"}
        ])
    );
}

// --- translation cases ---

#[test]
fn no_network_allows_everything() {
    let p = translated(json!({}));
    assert_eq!(
        (p.default, p.allow, p.deny),
        (DefaultAction::Allow, vec![], vec![])
    );
    let p =
        translated(json!({"allow_internet_access": true, "network": {"allowOut": ["1.1.1.1"]}}));
    assert_eq!(
        (p.default, p.allow, p.deny),
        (DefaultAction::Allow, vec![], vec![])
    );
}

#[test]
fn internet_off_is_default_deny_with_allow_out() {
    let p = translated(json!({"allow_internet_access": false}));
    assert_eq!(
        (p.default, p.allow, p.deny),
        (DefaultAction::Deny, vec![], vec![])
    );
    let p = translated(json!({"allow_internet_access": false, "network": {
        "allowOut": ["1.1.1.1", "api.example.test", "8.8.4.0/24", "1.1.1.1/32", "API.example.test"],
        "denyOut": ["9.9.9.9", "bad.example.test"]
    }}));
    assert_eq!(p.default, DefaultAction::Deny);
    assert_eq!(
        p.allow,
        dests(&["1.1.1.1", "api.example.test", "8.8.4.0/24", "8.8.8.8"])
    );
    assert!(
        p.deny.is_empty(),
        "nothing outside allowOut is allowed anyway"
    );
}

#[test]
fn deny_of_both_families_is_default_deny() {
    for deny in [
        json!(["0.0.0.0/0", "::/0"]),
        json!(["::/0", "10.0.0.0/8", "0.0.0.0/1", "128.0.0.0/1"]),
        json!(["0.0.0.0/0", "::/1", "8000::/1"]),
        json!(["0.0.0.0/0", "::/0", "bad.example.test"]),
    ] {
        let p = translated(
            json!({"network": {"denyOut": deny, "allowOut": ["1.1.1.1", "8.8.8.0/24"]}}),
        );
        assert_eq!(p.default, DefaultAction::Deny, "{deny}");
        assert_eq!(p.allow, dests(&["1.1.1.1", "8.8.8.0/24"]));
        assert!(p.deny.is_empty());
    }
}

#[test]
fn domains_are_exact_when_everything_else_is_denied() {
    let p = translated(json!({"network": {
        "allowOut": ["api.example.test", "*.cdn.example.test", "1.1.1.1"],
        "denyOut": ["0.0.0.0/0", "::/0"]
    }}));
    assert_eq!(p.default, DefaultAction::Deny);
    assert_eq!(
        p.allow,
        dests(&[
            "api.example.test",
            "*.cdn.example.test",
            "1.1.1.1",
            "8.8.8.8"
        ])
    );
    assert!(egress_policy::RESERVED_RESOLVERS.contains(&E2B_NAMESERVER));
    let p = translated(
        json!({"network": {"allowOut": ["a.test", "8.8.8.8"], "denyOut": ["0.0.0.0/0", "::/0"]}}),
    );
    assert_eq!(
        p.allow,
        dests(&["a.test", "8.8.8.8"]),
        "the nameserver is not repeated"
    );
}

#[test]
fn cidr_minus_address_gives_the_prefix_difference() {
    let p = translated(json!({"network": {"denyOut": ["10.0.0.0/8"], "allowOut": ["10.1.2.3"]}}));
    assert_eq!(p.default, DefaultAction::Allow);
    assert!(p.allow.is_empty());
    assert_eq!(p.deny.len(), 24);
    let want = dests(&[
        "10.0.0.0/16",
        "10.1.0.0/23",
        "10.1.2.0/31",
        "10.1.2.2",
        "10.1.2.4/30",
        "10.1.2.8/29",
        "10.1.2.16/28",
        "10.1.2.32/27",
        "10.1.2.64/26",
        "10.1.2.128/25",
        "10.1.3.0/24",
        "10.1.4.0/22",
        "10.1.8.0/21",
        "10.1.16.0/20",
        "10.1.32.0/19",
        "10.1.64.0/18",
        "10.1.128.0/17",
        "10.2.0.0/15",
        "10.4.0.0/14",
        "10.8.0.0/13",
        "10.16.0.0/12",
        "10.32.0.0/11",
        "10.64.0.0/10",
        "10.128.0.0/9",
    ]);
    assert_eq!(p.deny, want);
}

#[test]
fn denying_all_of_ipv4_is_e2bs_all_traffic_and_denies_ipv6_too() {
    let p = translated(json!({"network": {"denyOut": ["0.0.0.0/0"], "allowOut": ["1.1.1.1"]}}));
    assert_eq!(p.default, DefaultAction::Deny);
    assert_eq!((p.allow, p.deny), (dests(&["1.1.1.1"]), vec![]));
    let p = translated(json!({"network": {"denyOut": ["0.0.0.0/0"]}}));
    assert_eq!(
        (p.default, p.allow.len(), p.deny.len()),
        (DefaultAction::Deny, 0, 0)
    );
    // E2B's documented example: a domain allowed, all traffic denied.
    let p = translated(
        json!({"network": {"allowOut": ["api.example.test"], "denyOut": ["0.0.0.0/0"]}}),
    );
    assert_eq!(p.default, DefaultAction::Deny);
    assert_eq!(
        p.allow.len(),
        2,
        "the domain and E2B's nameserver: {:?}",
        p.allow
    );
}

#[test]
fn translate_network_reads_an_update_body() {
    let p = translate_network(&json!({"allowOut": ["1.1.1.1"], "denyOut": ["0.0.0.0/0"]}))
        .expect("valid");
    assert_eq!(
        (p.default, p.allow),
        (DefaultAction::Deny, dests(&["1.1.1.1"]))
    );
    let p = translate_network(&json!({"allow_internet_access": false})).expect("valid");
    assert_eq!(p.default, DefaultAction::Deny);
    for bad in [
        json!([]),
        json!({"allowOut": "x"}),
        json!({"nope": 1}),
        json!({"allow_internet_access": 1}),
    ] {
        assert!(
            matches!(translate_network(&bad), Err(E2bError::Invalid(_))),
            "{bad}"
        );
    }
}

#[test]
fn deny_is_merged_and_deduplicated() {
    let p = translated(json!({"network": {"denyOut": [
        "1.2.3.4", "1.2.3.4/32", "1.2.3.0/24", "1.2.2.0/24", "2001:db8::/33", "2001:db8:8000::/33", "9.9.9.9"
    ]}}));
    assert_eq!(p.deny, dests(&["1.2.2.0/23", "9.9.9.9", "2001:db8::/32"]));
    let p = translated(json!({"network": {"denyOut": ["1.2.3.4"], "allowOut": ["1.2.3.0/24"]}}));
    assert!(p.deny.is_empty(), "allowOut covers the whole deny");
}

#[test]
fn domain_allow_against_address_denies_is_inexact() {
    let why = inexact(
        json!({"network": {"allowOut": ["1.1.1.1", "api.example.test"], "denyOut": ["10.0.0.0/8"]}}),
    );
    assert!(
        why.starts_with("network.allowOut[1] \"api.example.test\": a domain allow cannot"),
        "{why}"
    );
    let why = inexact(
        json!({"network": {"allowOut": ["*.example.test"], "denyOut": ["203.0.113.0/24"]}}),
    );
    assert!(
        why.starts_with("network.allowOut[0] \"*.example.test\""),
        "{why}"
    );
    let err = translate(&create(
        json!({"network": {"allowOut": ["a.test"], "denyOut": ["10.0.0.0/8"]}}),
    ))
    .expect_err("inexact");
    assert!(
        err.to_string()
            .starts_with("cannot translate exactly: network.allowOut[0]"),
        "{err}"
    );
}

#[test]
fn domain_allow_with_nothing_left_to_deny_is_dropped() {
    for deny in [json!([]), json!(["8.8.8.8"]), json!(["1.2.3.4"])] {
        let p = translated(
            json!({"network": {"allowOut": ["api.example.test", "1.2.3.4"], "denyOut": deny}}),
        );
        assert_eq!(
            (p.default, p.allow, p.deny),
            (DefaultAction::Allow, vec![], vec![]),
            "{deny}"
        );
    }
}

#[test]
fn domain_deny_is_exact_only_without_allow_out() {
    let p = translated(
        json!({"network": {"denyOut": ["bad.example.test", "*.bad.example.test", "10.0.0.0/8"]}}),
    );
    assert_eq!(p.default, DefaultAction::Allow);
    assert_eq!(
        p.deny,
        dests(&["10.0.0.0/8", "bad.example.test", "*.bad.example.test"])
    );
    let why = inexact(
        json!({"network": {"denyOut": ["10.0.0.0/8", "bad.example.test"], "allowOut": ["1.1.1.1"]}}),
    );
    assert!(
        why.starts_with("network.denyOut[1] \"bad.example.test\": a domain deny"),
        "{why}"
    );
}

#[test]
fn mapped_pieces_are_left_out() {
    // ::/0 minus ::fffe:0:1 has ::ffff:0:0/96 as a piece, whose normal
    // form would be 0.0.0.0/0.
    let p = translated(json!({"network": {"denyOut": ["::/0"], "allowOut": ["::fffe:0:1"]}}));
    assert_eq!(p.default, DefaultAction::Allow);
    assert_eq!(p.deny.len(), 127);
    assert!(p.deny.iter().all(|d| matches!(
        d.dest,
        Destination::Cidr(IpNet::V6(_)) | Destination::Ip(IpAddr::V6(_))
    )));
    assert!(!p
        .deny
        .iter()
        .any(|d| matches!(d.dest, Destination::Cidr(n) if is_ipv4_mapped(&n))));
    let p = translated(json!({"network": {"denyOut": ["::ffff:10.0.0.0/104"]}}));
    assert_eq!(p.deny, dests(&["10.0.0.0/8"]));
}

// --- CIDR difference ---

/// [`difference`] within its bound.
fn diff(a: &[IpNet], b: &[IpNet]) -> Vec<IpNet> {
    difference(a, b).expect("within the bound")
}

#[test]
fn difference_examples() {
    assert_eq!(diff(&nets(&["10.0.0.0/8"]), &nets(&["10.0.0.0/8"])), vec![]);
    assert_eq!(
        diff(&nets(&["10.0.0.0/24"]), &nets(&["10.0.0.0/8"])),
        vec![]
    );
    assert_eq!(
        diff(&nets(&["10.0.0.0/8"]), &nets(&["11.0.0.0/8"])),
        nets(&["10.0.0.0/8"])
    );
    assert_eq!(
        diff(&nets(&["10.0.0.0/8"]), &nets(&["::/0"])),
        nets(&["10.0.0.0/8"])
    );
    assert_eq!(
        diff(&nets(&["::/0"]), &nets(&["0.0.0.0/0"])),
        nets(&["::/0"])
    );
    assert_eq!(
        diff(
            &nets(&["10.0.0.0/30", "2001:db8::/126"]),
            &nets(&["10.0.0.1/32", "2001:db8::2/127"])
        ),
        nets(&["10.0.0.0/32", "10.0.0.2/31", "2001:db8::/127"])
    );
    assert_eq!(
        diff(&nets(&["10.0.0.0/31", "10.0.0.2/31"]), &[]),
        nets(&["10.0.0.0/30"])
    );
    assert_eq!(diff(&[], &nets(&["10.0.0.0/8"])), vec![]);
    let all_but_one = diff(&nets(&["::/0"]), &nets(&["2001:db8::1/128"]));
    assert_eq!(all_but_one.len(), 128);
}

/// Each address allowed inside a denied IPv6 network splits it by up to
/// 128: 60,000 of them (a body under 1 MiB) would come to millions of
/// networks. Past the bound the difference stops and the create is
/// refused, naming the field.
#[test]
fn a_difference_of_millions_of_networks_is_refused() {
    let holes: Vec<IpNet> = (0..60_000u32)
        .map(|i| net(&format!("2000:{:x}:{:x}::/128", i >> 8, i & 0xff)))
        .collect();
    assert_eq!(difference(&nets(&["2000::/3"]), &holes), None);
    let allow: Vec<String> = (0..2_000u32).map(|i| format!("2000:{:x}::", i)).collect();
    let body = json!({"denyOut": ["2000::/3"], "allowOut": allow});
    match translate_network(&body) {
        Err(E2bError::Invalid(m)) => assert!(m.starts_with("network.denyOut"), "{m}"),
        other => panic!("{:?}", other.map(|p| p.deny.len())),
    }
}

/// A deterministic xorshift, so failures reproduce.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// Every CIDR inside `universe`, and the universe's addresses plus one on each side.
fn universe(universe: &str) -> (Vec<IpNet>, Vec<IpAddr>) {
    let u = net(universe);
    let subnets = (u.prefix_len()..=u.max_prefix_len())
        .flat_map(|p| u.subnets(p).expect("valid prefix"))
        .collect();
    let mut addrs: Vec<IpAddr> = u.hosts().collect();
    addrs.extend([u.network(), u.broadcast()]);
    let outside = |ip: IpAddr, up: bool| match ip {
        IpAddr::V4(v4) => IpAddr::V4(Ipv4Addr::from(if up {
            u32::from(v4) + 1
        } else {
            u32::from(v4) - 1
        })),
        IpAddr::V6(v6) => IpAddr::V6(Ipv6Addr::from(if up {
            u128::from(v6) + 1
        } else {
            u128::from(v6) - 1
        })),
    };
    addrs.extend([outside(u.network(), false), outside(u.broadcast(), true)]);
    addrs.sort();
    addrs.dedup();
    (subnets, addrs)
}

fn check_difference(a: &[IpNet], b: &[IpNet], addrs: &[IpAddr]) {
    let got = diff(a, b);
    assert_eq!(
        IpNet::aggregate(&got),
        got,
        "{a:?} - {b:?}: minimal and sorted"
    );
    assert!(got.iter().all(|n| n.trunc() == *n), "canonical");
    for ip in addrs {
        let want = a.iter().any(|n| n.contains(ip)) && !b.iter().any(|n| n.contains(ip));
        assert_eq!(
            got.iter().any(|n| n.contains(ip)),
            want,
            "{ip} in {a:?} - {b:?} = {got:?}"
        );
    }
}

#[test]
fn difference_is_exact_for_every_pair_in_a_small_universe() {
    for u in ["192.0.2.0/28", "2001:db8::/124"] {
        let (subnets, addrs) = universe(u);
        for a in &subnets {
            for b in &subnets {
                check_difference(&[*a], &[*b], &addrs);
                let got = diff(&[*a], &[*b]);
                if b.contains(a) || !a.contains(b) {
                    continue;
                }
                let bound = usize::from(b.prefix_len() - a.prefix_len());
                assert_eq!(got.len(), bound, "{a} - {b}");
            }
        }
    }
}

#[test]
fn difference_is_exact_for_random_sets() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let (v4, v4_addrs) = universe("192.0.2.0/28");
    let (v6, v6_addrs) = universe("2001:db8::/124");
    let pool: Vec<IpNet> = v4.iter().chain(&v6).copied().collect();
    let addrs: Vec<IpAddr> = v4_addrs.into_iter().chain(v6_addrs).collect();
    for _ in 0..3000 {
        let pick = |rng: &mut Rng| -> Vec<IpNet> {
            (0..rng.below(6))
                .map(|_| pool[rng.below(pool.len())])
                .collect()
        };
        let a = pick(&mut rng);
        let b = pick(&mut rng);
        check_difference(&a, &b, &addrs);
    }
}

// --- end to end ---

/// E2B's rule, read from the body independently of the translation.
fn e2b_allows(c: &E2bCreate, ip: IpAddr) -> bool {
    let (allow_out, deny_out) = c
        .network
        .as_ref()
        .map_or((&[][..], &[][..]), |n| (&n.allow_out[..], &n.deny_out[..]));
    let as_net = |s: &String| {
        s.parse::<IpNet>()
            .ok()
            .or_else(|| s.parse::<IpAddr>().ok().map(IpNet::from))
    };
    let matches = |list: &[String]| list.iter().filter_map(as_net).any(|n| n.contains(&ip));
    let has_domain = allow_out.iter().any(|s| as_net(s).is_none());
    if matches(allow_out) || (has_domain && ip == E2B_NAMESERVER) {
        return true;
    }
    // E2B's "all traffic" is all of IPv4; its sandboxes have no IPv6.
    let denies_all_ipv4 = IpNet::aggregate(&deny_out.iter().filter_map(as_net).collect())
        .iter()
        .any(|n| n.prefix_len() == 0 && n.network().is_ipv4());
    let silent_ipv6 = ip.is_ipv6() && denies_all_ipv4;
    c.allow_internet_access.unwrap_or(true) && !matches(deny_out) && !silent_ipv6
}

/// Our rule by address: deny wins, then allow, then the default.
fn ours_allows(p: &Policy, ip: IpAddr) -> bool {
    let hit = |list: &[egress_policy::Rule]| {
        list.iter().any(|d| match &d.dest {
            Destination::Ip(a) => *a == ip,
            Destination::Cidr(n) => n.contains(&ip),
            Destination::Domain(_) | Destination::WildcardDomain(_) => false,
        })
    };
    !hit(&p.deny) && (hit(&p.allow) || p.default == DefaultAction::Allow)
}

/// The gateway's own matcher, for a flow with no name evidence.
fn matcher_allows(p: &Policy, ip: IpAddr) -> bool {
    let compiled = CompiledPolicy::new(p.clone(), Arc::new(PlatformDenies::new(vec![])));
    let flow = Flow {
        dst: SocketAddr::new(ip, 443),
        protocol: Protocol::Opaque(None),
        sni: None,
        host: None,
        attributed: &[],
        attribution_gap: Default::default(),
        encrypted_dns: None,
        ech: false,
    };
    !matches!(compiled.decide(&flow), Verdict::Deny(_))
}

/// Fixed samples plus each entry's edges and their neighbours.
fn samples(c: &E2bCreate) -> Vec<IpAddr> {
    let mut out: Vec<IpAddr> = [
        "0.0.0.0",
        "1.1.1.1",
        "8.8.8.8",
        "10.1.2.3",
        "255.255.255.255",
        "::",
        "::1",
        "2001:db8::1",
        "ffff::1",
    ]
    .iter()
    .map(|s| s.parse().expect(s))
    .collect();
    let lists = c
        .network
        .iter()
        .flat_map(|n| n.allow_out.iter().chain(&n.deny_out));
    for n in lists.filter_map(|s| {
        s.parse::<IpNet>()
            .ok()
            .or_else(|| s.parse::<IpAddr>().ok().map(IpNet::from))
    }) {
        for ip in [n.network(), n.broadcast()] {
            out.push(ip);
            match ip {
                IpAddr::V4(v4) => out.extend(
                    [u32::from(v4).wrapping_sub(1), u32::from(v4).wrapping_add(1)]
                        .map(|x| IpAddr::V4(x.into())),
                ),
                IpAddr::V6(v6) => out.extend(
                    [
                        u128::from(v6).wrapping_sub(1),
                        u128::from(v6).wrapping_add(1),
                    ]
                    .map(|x| IpAddr::V6(x.into())),
                ),
            }
        }
    }
    // Mapped and NAT64 addresses follow their IPv4 rules here, not E2B's literal ones.
    out.retain(|ip| ip.to_canonical() == *ip && egress_policy::embedded_ipv4(*ip).is_none());
    out
}

fn check_end_to_end(c: &E2bCreate, p: &Policy, extra: &[IpAddr]) {
    for ip in samples(c).iter().chain(extra) {
        let want = e2b_allows(c, *ip);
        assert_eq!(ours_allows(p, *ip), want, "{ip}: {c:?} -> {p:?}");
        assert_eq!(matcher_allows(p, *ip), want, "matcher, {ip}: {c:?}");
    }
}

#[test]
fn e2b_and_translation_agree_by_address() {
    let table = [
        json!({}),
        json!({"allow_internet_access": false}),
        json!({"allow_internet_access": false, "network": {"allowOut": ["1.1.1.1", "8.8.4.0/24", "a.test"]}}),
        json!({"network": {"denyOut": ["0.0.0.0/0", "::/0"], "allowOut": ["1.1.1.1", "2001:db8::/64", "a.test"]}}),
        json!({"network": {"denyOut": ["10.0.0.0/8"], "allowOut": ["10.1.2.3"]}}),
        json!({"network": {"denyOut": ["0.0.0.0/0"], "allowOut": ["1.1.1.1", "192.0.2.0/24"]}}),
        json!({"network": {"denyOut": ["::/0", "203.0.113.0/24"], "allowOut": ["2001:db8::1", "203.0.113.128/25"]}}),
        json!({"network": {"denyOut": ["8.8.8.8"], "allowOut": ["a.test", "9.9.9.0/24"]}}),
        json!({"network": {"denyOut": ["1.2.3.4", "1.2.3.0/24", "1.2.2.0/24"], "allowOut": ["1.2.2.255"]}}),
        json!({"network": {"denyOut": ["::/0"], "allowOut": ["::fffe:0:1"]}}),
        json!({"network": {"denyOut": ["bad.test", "10.0.0.0/8"]}}),
        json!({"network": {"allowOut": ["a.test", "1.1.1.1"]}}),
    ];
    for network in table {
        let c = create(network);
        let p = translate(&c).unwrap_or_else(|e| panic!("{c:?}: {e}"));
        check_end_to_end(&c, &p, &[]);
    }
}

#[test]
fn e2b_and_translation_agree_for_random_bodies() {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let (v4, mut addrs) = universe("192.0.2.0/28");
    let (v6, v6_addrs) = universe("2001:db8::/126");
    addrs.extend(v6_addrs);
    let mut pool: Vec<String> = v4
        .iter()
        .chain(&v6)
        .map(|n| net_destination(*n).value())
        .collect();
    pool.extend(["0.0.0.0/0", "::/0", "a.test"].map(String::from));
    let mut translated = 0;
    for _ in 0..2000 {
        let pick = |rng: &mut Rng| -> Vec<String> {
            (0..rng.below(5))
                .map(|_| pool[rng.below(pool.len())].clone())
                .collect()
        };
        let network = json!({"allowOut": pick(&mut rng), "denyOut": pick(&mut rng)});
        let internet = [json!(null), json!(true), json!(false)][rng.below(3)].clone();
        let c = create(json!({"network": network, "allow_internet_access": internet}));
        match translate(&c) {
            Ok(p) => {
                translated += 1;
                check_end_to_end(&c, &p, &addrs);
            }
            Err(E2bError::Inexact(_)) => {
                let n = c.network.as_ref().expect("network");
                let named = n.allow_out.iter().chain(&n.deny_out).any(|s| s == "a.test");
                assert!(named, "only a domain makes it inexact: {c:?}");
            }
            Err(e) => panic!("{c:?}: {e}"),
        }
    }
    assert!(translated > 1000, "{translated}");
}
