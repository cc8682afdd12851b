use std::sync::Arc;

use proptest::prelude::*;

use super::*;

/// One flow, written compactly: `dst`, protocol, SNI, Host, attributed names, gap.
#[derive(Clone)]
struct F {
    dst: &'static str,
    proto: Protocol,
    sni: Option<&'static str>,
    host: Option<&'static str>,
    names: Vec<&'static str>,
    gap: AttributionGap,
    encrypted_dns: Option<EncryptedDns>,
    ech: bool,
}

fn tls(dst: &'static str) -> F {
    F {
        dst,
        proto: Protocol::Tls,
        sni: None,
        host: None,
        names: vec![],
        gap: AttributionGap::NoDnsSeen,
        encrypted_dns: None,
        ech: false,
    }
}
fn http(dst: &'static str) -> F {
    F {
        proto: Protocol::Http,
        ..tls(dst)
    }
}
fn opaque(dst: &'static str) -> F {
    F {
        proto: Protocol::Opaque(None),
        ..tls(dst)
    }
}

impl F {
    fn sni(mut self, s: &'static str) -> Self {
        self.sni = Some(s);
        self
    }
    fn host(mut self, h: &'static str) -> Self {
        self.host = Some(h);
        self
    }
    fn dns(mut self, names: &[&'static str]) -> Self {
        self.names = names.to_vec();
        self
    }
    fn gap(mut self, gap: AttributionGap) -> Self {
        self.gap = gap;
        self
    }
    fn dns_over(mut self, kind: EncryptedDns) -> Self {
        self.encrypted_dns = Some(kind);
        self
    }
    /// The ClientHello carries `encrypted_client_hello`.
    fn ech(mut self) -> Self {
        self.ech = true;
        self
    }
}

fn h(s: &str) -> Hostname {
    Hostname::parse(s).expect(s)
}

fn compile(policy: &str) -> CompiledPolicy {
    CompiledPolicy::new(
        Policy::from_json(policy).expect(policy),
        Arc::new(PlatformDenies::builtin()),
    )
}

fn decide(p: &CompiledPolicy, f: &F) -> Verdict {
    let sni = f.sni.map(h);
    let host = f.host.map(h);
    let names: Vec<Hostname> = f.names.iter().map(|n| h(n)).collect();
    p.decide(&Flow {
        dst: f.dst.parse().expect(f.dst),
        protocol: f.proto,
        sni: sni.as_ref(),
        host: host.as_ref(),
        attributed: &names,
        attribution_gap: f.gap,
        encrypted_dns: f.encrypted_dns,
        ech: f.ech,
    })
}

/// Checks `(policy, flow, verdict name, reason code)` rows.
fn table(rows: &[(&str, F, &str, &str)]) {
    table_under(OpaqueStreams::Allow, rows);
}

/// [`table`] with the gateway's `opaque_streams` set to `mode`.
fn table_under(mode: OpaqueStreams, rows: &[(&str, F, &str, &str)]) {
    for (i, (policy, flow, verdict, code)) in rows.iter().enumerate() {
        let p = CompiledPolicy::new(
            Policy::from_json(policy).expect(policy),
            Arc::new(PlatformDenies::builtin().with_opaque_streams(mode)),
        );
        let v = decide(&p, flow);
        assert_eq!(
            (v.name(), v.code()),
            (*verdict, *code),
            "row {i}: {policy} dst={} sni={:?} host={:?} dns={:?}: {}",
            flow.dst,
            flow.sni,
            flow.host,
            flow.names,
            v.describe(&p)
        );
    }
}

const ALLOW_ALL: &str = r#"{"default": "allow"}"#;
const ALLOW_ALL_ON: &str = r#"{"default": "allow", "tls_interception": "on"}"#;

#[test]
fn platform_denies_beat_everything() {
    let explicit = r#"{"default": "allow", "allow": [{"cidr": "10.0.0.0/8"}, {"ip": "169.254.169.254"}, {"domain": "metadata.google.internal"}],
                      "tls_interception": "on", "tls_interception_exemptions": [{"cidr": "0.0.0.0/0"}]}"#;
    table(&[
        (
            ALLOW_ALL,
            opaque("169.254.169.254:80"),
            "deny",
            "platform_deny",
        ),
        (
            ALLOW_ALL,
            opaque("[::ffff:169.254.169.254]:80"),
            "deny",
            "platform_deny",
        ),
        (
            ALLOW_ALL,
            opaque("[64:ff9b::a9fe:a9fe]:80"),
            "deny",
            "platform_deny",
        ),
        (
            ALLOW_ALL,
            opaque("[64:ff9b::7f00:1]:80"),
            "deny",
            "platform_deny",
        ),
        (
            ALLOW_ALL,
            opaque("[fd00:ec2::254]:80"),
            "deny",
            "platform_deny",
        ),
        (
            ALLOW_ALL,
            opaque("168.63.129.16:80"),
            "deny",
            "platform_deny",
        ),
        (
            ALLOW_ALL,
            opaque("127.0.0.1:15000"),
            "deny",
            "platform_deny",
        ),
        (ALLOW_ALL, opaque("[::1]:15000"), "deny", "platform_deny"),
        (ALLOW_ALL, opaque("100.64.0.2:443"), "deny", "platform_deny"),
        (ALLOW_ALL, opaque("224.0.0.1:443"), "deny", "platform_deny"),
        (
            ALLOW_ALL,
            opaque("255.255.255.255:443"),
            "deny",
            "platform_deny",
        ),
        (ALLOW_ALL, opaque("[fe80::1]:443"), "deny", "platform_deny"),
        // 6to4 of 10.0.0.1, Teredo, IPv4-compatible 10.0.0.1: a tunnel on
        // the host would carry each to an IPv4 address nobody checked.
        (
            ALLOW_ALL,
            opaque("[2002:a00:1::1]:22"),
            "deny",
            "platform_deny",
        ),
        (
            ALLOW_ALL,
            opaque("[2001:0:4136:e378::1]:22"),
            "deny",
            "platform_deny",
        ),
        (ALLOW_ALL, opaque("[::a00:1]:22"), "deny", "platform_deny"),
        // The IPv4-translated form of 169.254.169.254 (RFC 2765).
        (
            ALLOW_ALL,
            opaque("[::ffff:0:a9fe:a9fe]:80"),
            "deny",
            "platform_deny",
        ),
        // The local-use NAT64 prefix: a translator maps it to any IPv4
        // address, the metadata service's here.
        (
            ALLOW_ALL,
            opaque("[64:ff9b:1::a9fe:a9fe]:80"),
            "deny",
            "platform_deny",
        ),
        (
            ALLOW_ALL,
            opaque("[2001:db8::7]:443"),
            "allow",
            "allow_default",
        ),
        (explicit, tls("10.1.2.3:443"), "deny", "platform_deny"),
        (
            explicit,
            tls("169.254.169.254:443").dns(&["metadata.google.internal"]),
            "deny",
            "platform_deny",
        ),
        (
            ALLOW_ALL,
            opaque("203.0.113.7:443"),
            "allow",
            "allow_default",
        ),
        (
            ALLOW_ALL,
            opaque("[64:ff9b::cb00:7107]:443"),
            "allow",
            "allow_default",
        ),
    ]);
}

/// Each range of the built-in list, written out by hand at its first and
/// last address, and the addresses just outside them: a range dropped
/// from the list, narrowed or mistyped fails here.
#[test]
fn the_built_in_ranges_are_denied_edge_to_edge() {
    let denied = [
        "0.0.0.0:443",
        "0.255.255.255:443",
        "10.0.0.0:443",
        "10.255.255.255:443",
        "100.64.0.0:443",
        "100.127.255.255:443",
        "127.0.0.0:443",
        "127.255.255.255:443",
        "169.254.0.0:443",
        "169.254.255.255:443",
        "172.16.0.0:443",
        "172.31.255.255:443",
        "192.168.0.0:443",
        "192.168.255.255:443",
        "224.0.0.0:443",
        "239.255.255.255:443",
        "240.0.0.0:443",
        "[fc00::]:443",
        "[fd12:3456::1]:443",
        "[fdff:ffff:ffff:ffff:ffff:ffff:ffff:ffff]:443",
        "[fe80::]:443",
        "[febf:ffff:ffff:ffff:ffff:ffff:ffff:ffff]:443",
        "[ff00::]:443",
        "[ff0e::1]:443",
        "[::]:443",
        "[::ffff:ffff]:443",
        "[2001::]:443",
        "[2001:0:ffff:ffff:ffff:ffff:ffff:ffff]:443",
        "[2002::]:443",
        "[2002:ffff:ffff:ffff:ffff:ffff:ffff:ffff]:443",
        "[64:ff9b:1::]:443",
        "[64:ff9b:1:ffff:ffff:ffff:ffff:ffff]:443",
        "[::ffff:0:0:0]:443",
        "[::ffff:0:ffff:ffff]:443",
    ];
    let allowed = [
        "1.0.0.0:443",
        "9.255.255.255:443",
        "11.0.0.0:443",
        "100.63.255.255:443",
        "100.128.0.0:443",
        "126.255.255.255:443",
        "128.0.0.0:443",
        "169.253.255.255:443",
        "169.255.0.0:443",
        "172.15.255.255:443",
        "172.32.0.0:443",
        "192.167.255.255:443",
        "192.169.0.0:443",
        "223.255.255.255:443",
        "[fbff:ffff:ffff:ffff:ffff:ffff:ffff:ffff]:443",
        "[fe00::1]:443",
        "[fec0::]:443",
        "[2001:1::]:443",
        "[2000:ffff::1]:443",
        "[2003::]:443",
        "[64:ff9b:2::]:443",
        "[::fffe:ffff:ffff:ffff]:443",
        "[::ffff:1:0:0]:443",
    ];
    let rows: Vec<_> = denied
        .iter()
        .map(|a| (ALLOW_ALL, opaque(a), "deny", "platform_deny"))
        .chain(
            allowed
                .iter()
                .map(|a| (ALLOW_ALL, opaque(a), "allow", "allow_default")),
        )
        .collect();
    table(&rows);
}

#[test]
fn tenant_denies_match_address_or_any_name_evidence() {
    let p = r#"{"default": "allow", "allow": [{"cidr": "203.0.113.0/24"}, {"domain": "bad.test"}],
                "deny": [{"ip": "203.0.113.7"}, {"cidr": "2001:db8:bad::/48"}, {"domain": "bad.test"}, {"wildcard_domain": "*.evil.test"}],
                "tls_interception": "on", "tls_interception_exemptions": [{"domain": "bad.test"}, {"cidr": "203.0.113.0/24"}]}"#;
    table(&[
        (p, tls("203.0.113.7:443"), "deny", "tenant_deny"),
        (p, tls("[::ffff:203.0.113.7]:443"), "deny", "tenant_deny"),
        (p, tls("[64:ff9b::cb00:7107]:443"), "deny", "tenant_deny"),
        (p, tls("203.0.113.8:443"), "splice", "exempt"),
        (p, tls("[2001:db8:bad::1]:443"), "deny", "tenant_deny"),
        (
            p,
            tls("198.51.100.1:443")
                .dns(&["good.test", "bad.test"])
                .sni("good.test"),
            "deny",
            "tenant_deny",
        ),
        (
            p,
            tls("198.51.100.1:443").sni("bad.test"),
            "deny",
            "tenant_deny",
        ),
        (
            p,
            tls("198.51.100.1:443").sni("BAD.test"),
            "deny",
            "tenant_deny",
        ),
        (
            p,
            tls("198.51.100.1:443").host("bad.test"),
            "deny",
            "tenant_deny",
        ),
        (
            p,
            http("198.51.100.1:80").host("a.evil.test"),
            "deny",
            "tenant_deny",
        ),
        (
            p,
            tls("198.51.100.1:443").dns(&["a.b.evil.test"]),
            "deny",
            "tenant_deny",
        ),
        (
            p,
            tls("198.51.100.1:443").sni("evil.test"),
            "intercept",
            "not_exempt",
        ),
    ]);
}

#[test]
fn address_allows() {
    let p = r#"{"allow": [{"ip": "203.0.113.7"}, {"cidr": "198.51.100.0/24"}, {"cidr": "2001:db8::/32"}]}"#;
    table(&[
        (p, opaque("203.0.113.7:22"), "allow", "allow_address"),
        (p, tls("203.0.113.7:443"), "splice", "interception_off"),
        (p, http("[::ffff:203.0.113.7]:80"), "allow", "allow_address"),
        (
            p,
            tls("[64:ff9b::cb00:7107]:443"),
            "splice",
            "interception_off",
        ),
        (p, tls("198.51.100.255:443"), "splice", "interception_off"),
        (p, tls("[2001:db8::5]:443"), "splice", "interception_off"),
        (p, tls("203.0.113.8:443"), "deny", "no_allow_match"),
        (p, tls("[2001:db9::5]:443"), "deny", "no_allow_match"),
    ]);
}

#[test]
fn domain_allows_need_dns_attribution_on_spliced_and_opaque_flows() {
    let p = r#"{"allow": [{"domain": "api.test"}, {"wildcard_domain": "*.cdn.test"}]}"#;
    let dst = "203.0.113.7:443";
    table(&[
        (
            p,
            tls(dst).sni("api.test").dns(&["api.test"]),
            "splice",
            "interception_off",
        ),
        (p, tls(dst).dns(&["api.test"]), "splice", "interception_off"),
        (p, tls(dst).sni("api.test"), "deny", "no_dns_seen"),
        (
            p,
            tls(dst).sni("api.test").gap(AttributionGap::Expired),
            "deny",
            "expired",
        ),
        (
            p,
            tls(dst).sni("api.test").gap(AttributionGap::Evicted),
            "deny",
            "evicted",
        ),
        (
            p,
            tls(dst).sni("other.test").dns(&["api.test"]),
            "deny",
            "sni_mismatch",
        ),
        // An SNI attributed beside an allowed name, but not allowed itself:
        // on a shared CDN address the CDN would route by it.
        (
            p,
            tls(dst).sni("alias.test").dns(&["api.test", "alias.test"]),
            "deny",
            "no_allow_match",
        ),
        (p, tls(dst).dns(&["other.test"]), "deny", "no_allow_match"),
        (
            p,
            tls(dst).sni("x.cdn.test").dns(&["x.cdn.test"]),
            "splice",
            "interception_off",
        ),
        (
            p,
            tls(dst).sni("cdn.test").dns(&["cdn.test"]),
            "deny",
            "no_allow_match",
        ),
        (
            p,
            opaque(dst).dns(&["api.test"]),
            "allow",
            "allow_attributed_name",
        ),
        (p, opaque(dst), "deny", "no_dns_seen"),
        (
            p,
            http("203.0.113.7:80").host("api.test").dns(&["api.test"]),
            "allow",
            "allow_attributed_name",
        ),
        (
            p,
            http("203.0.113.7:80").host("api.test").dns(&["other.test"]),
            "deny",
            "no_allow_match",
        ),
        (
            p,
            http("203.0.113.7:80").host("api.test"),
            "deny",
            "no_dns_seen",
        ),
        (
            p,
            http("203.0.113.7:80").host("other.test").dns(&["api.test"]),
            "deny",
            "sni_mismatch",
        ),
        (
            p,
            http("203.0.113.7:80").dns(&["api.test"]),
            "allow",
            "allow_attributed_name",
        ),
    ]);
}

#[test]
fn terminated_flows_accept_a_verified_server_name() {
    let p = r#"{"allow": [{"domain": "api.test"}], "tls_interception": "on"}"#;
    let dst = "203.0.113.7:443";
    table(&[
        (
            p,
            tls(dst).sni("api.test"),
            "intercept",
            "needs_verification",
        ),
        (
            p,
            tls(dst).sni("api.test").host("api.test"),
            "intercept",
            "needs_verification",
        ),
        (
            p,
            tls(dst).host("api.test"),
            "intercept",
            "needs_verification",
        ),
        (
            p,
            tls(dst).sni("api.test").dns(&["api.test"]),
            "intercept",
            "not_exempt",
        ),
        (
            p,
            tls(dst)
                .sni("api.test")
                .host("other.test")
                .dns(&["api.test"]),
            "deny",
            "misdirected",
        ),
        (p, tls(dst).sni("other.test"), "deny", "no_dns_seen"),
        (p, tls(dst), "deny", "no_dns_seen"),
        (ALLOW_ALL_ON, tls(dst), "intercept", "not_exempt"),
    ]);
}

#[test]
fn without_sni_a_terminated_requests_host_is_the_claim() {
    // A shared address attributed to an allowed name: a client that sends
    // no SNI may not name another host on it and pass on that attribution.
    let p = r#"{"allow": [{"domain": "api.test"}], "tls_interception": "on"}"#;
    let dst = "203.0.113.7:443";
    table(&[
        // The flow itself (no Host yet) passes on the attribution.
        (p, tls(dst).dns(&["api.test"]), "intercept", "not_exempt"),
        // Its requests: the allowed, attributed name passes …
        (
            p,
            tls(dst).host("api.test").dns(&["api.test"]),
            "intercept",
            "not_exempt",
        ),
        // … a name neither allowed nor attributed does not, …
        (
            p,
            tls(dst).host("other.test").dns(&["api.test"]),
            "deny",
            "sni_mismatch",
        ),
        // … and one attributed beside it, but not allowed itself, is
        // judged as the same SNI would be: denied.
        (
            p,
            tls(dst).host("other.test").dns(&["api.test", "other.test"]),
            "deny",
            "no_allow_match",
        ),
        (
            p,
            tls(dst).sni("other.test").dns(&["api.test", "other.test"]),
            "deny",
            "no_allow_match",
        ),
    ]);
}

#[test]
fn exemptions_choose_splice_only_with_attribution() {
    let p = r#"{"default": "allow", "tls_interception": "on",
                "tls_interception_exemptions": [{"wildcard_domain": "*.relay.test"}, {"domain": "turn.test"}, {"cidr": "198.51.100.0/24"}]}"#;
    let dst = "203.0.113.7:443";
    table(&[
        (
            p,
            tls(dst).sni("a.relay.test").dns(&["a.relay.test"]),
            "splice",
            "exempt",
        ),
        (p, tls(dst).dns(&["a.relay.test"]), "splice", "exempt"),
        (
            p,
            tls(dst).sni("turn.test").dns(&["turn.test"]),
            "splice",
            "exempt",
        ),
        (p, tls(dst).sni("a.relay.test"), "intercept", "no_dns_seen"),
        (
            p,
            tls(dst).sni("a.relay.test").gap(AttributionGap::Expired),
            "intercept",
            "expired",
        ),
        (
            p,
            tls(dst).sni("a.relay.test").gap(AttributionGap::Evicted),
            "intercept",
            "evicted",
        ),
        (
            p,
            tls(dst).sni("b.relay.test").dns(&["a.relay.test"]),
            "intercept",
            "sni_mismatch",
        ),
        (
            p,
            tls(dst).sni("www.test").dns(&["a.relay.test", "www.test"]),
            "intercept",
            "sni_mismatch",
        ),
        (
            p,
            tls(dst).sni("relay.test").dns(&["relay.test"]),
            "intercept",
            "not_exempt",
        ),
        (
            p,
            tls(dst).sni("www.test").dns(&["www.test"]),
            "intercept",
            "not_exempt",
        ),
        (p, tls(dst).sni("www.test"), "intercept", "not_exempt"),
        (p, tls(dst), "intercept", "no_dns_seen"),
        (p, tls("198.51.100.9:443"), "splice", "exempt"),
        (
            p,
            tls("198.51.100.9:443").sni("www.test"),
            "splice",
            "exempt",
        ),
        (
            p,
            opaque(dst).dns(&["a.relay.test"]),
            "allow",
            "allow_default",
        ),
    ]);
}

fn ssh(dst: &'static str) -> F {
    F {
        proto: Protocol::Opaque(Some(StreamProtocol::Ssh)),
        ..tls(dst)
    }
}

/// Streams the gateway cannot read: under `opaque_streams = "allow"` an
/// allow lets them through (the seed's meaning) unless its `streams` name
/// others; under `"deny"` only an entry naming the protocol does, and the
/// default never. TLS, HTTP and DNS admission are never affected.
#[test]
fn opaque_streams_pass_where_the_setting_or_an_entry_says() {
    let p = r#"{"default": "deny", "tls_interception": "on",
                "allow": [{"cidr": "203.0.113.0/24", "streams": ["ssh"]}, {"cidr": "198.51.100.0/24"},
                          {"ip": "192.0.2.1", "streams": []}, {"domain": "git.test", "streams": ["ssh"]},
                          {"ip": "8.8.8.8"}]}"#;
    let any = r#"{"default": "allow"}"#;
    let rows = |deny: bool| -> Vec<(&str, F, &str, &str)> {
        let refused = |allowed: &'static str| {
            if deny {
                ("deny", "unreadable_stream")
            } else {
                ("allow", allowed)
            }
        };
        let (v, c) = refused("allow_address");
        let (dv, dc) = refused("allow_default");
        vec![
            (p, ssh("203.0.113.7:22"), "allow", "allow_address"),
            (p, opaque("203.0.113.7:22"), "deny", "unreadable_stream"),
            (p, ssh("198.51.100.7:22"), v, c),
            (p, opaque("198.51.100.7:22"), v, c),
            (p, ssh("192.0.2.1:22"), "deny", "unreadable_stream"),
            (p, opaque("192.0.2.1:22"), "deny", "unreadable_stream"),
            (
                p,
                ssh("192.0.2.9:22").dns(&["git.test"]),
                "allow",
                "allow_attributed_name",
            ),
            (
                p,
                opaque("192.0.2.9:22").dns(&["git.test"]),
                "deny",
                "unreadable_stream",
            ),
            (p, ssh("192.0.2.9:22"), "deny", "no_dns_seen"),
            (p, ssh("192.0.2.77:22"), "deny", "no_dns_seen"),
            (any, opaque("192.0.2.9:22"), dv, dc),
            (any, ssh("192.0.2.9:22"), dv, dc),
            // Readable flows and DNS admission are judged as before.
            (p, tls("192.0.2.1:443"), "intercept", "not_exempt"),
            (p, http("203.0.113.7:80"), "allow", "allow_address"),
            (
                p,
                F {
                    proto: Protocol::Dns,
                    ..tls("8.8.8.8:53")
                },
                "allow",
                "allow_address",
            ),
            (
                any,
                F {
                    proto: Protocol::Dns,
                    ..tls("8.8.8.8:53")
                },
                "allow",
                "allow_default",
            ),
        ]
    };
    table_under(OpaqueStreams::Allow, &rows(false));
    table_under(OpaqueStreams::Deny, &rows(true));

    let c = CompiledPolicy::new(
        Policy::from_json(p).expect("policy"),
        Arc::new(PlatformDenies::builtin().with_opaque_streams(OpaqueStreams::Deny)),
    );
    for (flow, text, rule) in [
        (
            opaque("203.0.113.7:22"),
            "unreadable stream: a stream that is not TLS, HTTP or a protocol the gateway can name; allowed by cidr 203.0.113.0/24 streams [ssh], but its streams do not name it",
            Some(0),
        ),
        (
            ssh("198.51.100.7:22"),
            "unreadable stream: an ssh stream; allowed by cidr 198.51.100.0/24, but the gateway's opaque_streams is deny",
            Some(1),
        ),
    ] {
        let v = decide(&c, &flow);
        assert_eq!((v.describe(&c).as_str(), v.deny_rule()), (text, rule));
    }
}

/// A ClientHello with `encrypted_client_hello` is judged on its outer name,
/// and a hostname exemption granted to that name never splices it: the
/// encrypted inner name may be any other. An address exemption still does.
#[test]
fn ech_hellos_are_never_spliced_by_a_hostname_exemption() {
    let p = r#"{"default": "allow", "tls_interception": "on",
                "deny": [{"domain": "denied.test"}],
                "tls_interception_exemptions": [{"wildcard_domain": "*.relay.test"}, {"cidr": "198.51.100.0/24"}]}"#;
    let dst = "203.0.113.7:443";
    let exempt = tls(dst).sni("a.relay.test").dns(&["a.relay.test"]);
    table(&[
        (p, exempt.clone(), "splice", "exempt"),
        (p, exempt.clone().ech(), "intercept", "ech"),
        (p, tls(dst).dns(&["a.relay.test"]).ech(), "intercept", "ech"),
        // What ECH did not change keeps its reason.
        (
            p,
            tls(dst).sni("a.relay.test").ech(),
            "intercept",
            "no_dns_seen",
        ),
        (p, tls(dst).sni("www.test").ech(), "intercept", "not_exempt"),
        // Judged on the outer name: a denied outer name is denied.
        (p, tls(dst).sni("denied.test").ech(), "deny", "tenant_deny"),
        // An address exemption never looked at a name.
        (
            p,
            tls("198.51.100.9:443").sni("a.relay.test").ech(),
            "splice",
            "exempt",
        ),
        (p, tls("198.51.100.9:443").ech(), "splice", "exempt"),
        // With interception off there is nothing to terminate: spliced as before.
        (
            r#"{"default": "allow"}"#,
            exempt.clone().ech(),
            "splice",
            "interception_off",
        ),
    ]);
    let c = compile(p);
    let v = decide(&c, &exempt.ech());
    assert_eq!(
        v.describe(&c),
        "allowed by default; intercepted, not spliced: exemption not applied: ech (the \
         ClientHello carries encrypted_client_hello; wildcard_domain *.relay.test matches only \
         its outer name)"
    );
}

#[test]
fn encrypted_dns_is_answered_or_needs_an_allow_by_name() {
    use EncryptedDns::{Dot, KnownDoh, ReservedDoh};
    let on = r#"{"default": "deny", "tls_interception": "on",
                 "allow": [{"ip": "8.8.8.8"}, {"cidr": "203.0.113.0/24"}, {"domain": "doh.corp.test"}],
                 "tls_interception_exemptions": [{"ip": "8.8.8.8"}, {"domain": "doh.corp.test"}]}"#;
    let off = r#"{"default": "allow", "allow": [{"domain": "doh.corp.test"}]}"#;
    let dot = |dst| tls(dst).dns_over(Dot);
    table(&[
        // DoH to a reserved resolver: answered, even where an exemption would splice.
        (
            on,
            tls("8.8.8.8:443").sni("dns.google").dns_over(ReservedDoh),
            "intercept",
            "doh_answered",
        ),
        (
            off,
            tls("8.8.8.8:443").dns_over(ReservedDoh),
            "deny",
            "encrypted_dns",
        ),
        // ... only where the policy permits the resolver at all.
        (
            on,
            tls("1.1.1.1:443").dns_over(ReservedDoh),
            "deny",
            "no_dns_seen",
        ),
        // DoT and other DoH: an address allow or the default is not enough.
        (on, dot("203.0.113.9:853"), "deny", "encrypted_dns"),
        (off, dot("198.51.100.9:853"), "deny", "encrypted_dns"),
        (
            on,
            tls("203.0.113.9:443")
                .sni("dns.quad9.net")
                .dns_over(KnownDoh),
            "deny",
            "encrypted_dns",
        ),
        // Allowed by name: it goes on as any flow (here: exempt, spliced).
        (
            on,
            dot("198.51.100.9:853")
                .sni("doh.corp.test")
                .dns(&["doh.corp.test"]),
            "splice",
            "exempt",
        ),
        (
            off,
            tls("198.51.100.9:443")
                .sni("doh.corp.test")
                .dns(&["doh.corp.test"])
                .dns_over(KnownDoh),
            "splice",
            "interception_off",
        ),
        // Denies still win.
        (
            r#"{"default": "allow", "deny": [{"ip": "8.8.8.8"}], "tls_interception": "on"}"#,
            tls("8.8.8.8:443").dns_over(ReservedDoh),
            "deny",
            "tenant_deny",
        ),
    ]);
}

#[test]
fn exemptions_never_grant_access() {
    let p = r#"{"default": "deny", "allow": [{"domain": "api.test"}], "tls_interception": "on",
                "tls_interception_exemptions": [{"wildcard_domain": "*.relay.test"}, {"cidr": "198.51.100.0/24"}, {"domain": "api.test"}]}"#;
    table(&[
        (
            p,
            tls("203.0.113.7:443")
                .sni("a.relay.test")
                .dns(&["a.relay.test"]),
            "deny",
            "no_allow_match",
        ),
        (p, tls("198.51.100.9:443"), "deny", "no_dns_seen"),
        // Allowed only by the SNI claim: the exemption would splice an unverified name.
        (
            p,
            tls("198.51.100.9:443").sni("api.test"),
            "intercept",
            "needs_verification",
        ),
        (
            p,
            tls("198.51.100.9:443").sni("api.test").dns(&["api.test"]),
            "splice",
            "exempt",
        ),
    ]);
}

#[test]
fn reasons_name_the_rule() {
    let p = compile(
        r#"{"allow": [{"domain": "api.test"}], "deny": [{"cidr": "203.0.113.0/28"}], "tls_interception": "on",
            "tls_interception_exemptions": [{"wildcard_domain": "*.relay.test"}]}"#,
    );
    let d = |f: F| decide(&p, &f).describe(&p);
    assert_eq!(
        d(tls("203.0.113.7:443")),
        "tenant deny: cidr 203.0.113.0/28"
    );
    assert_eq!(
        d(tls("169.254.169.254:443")),
        "platform deny: cidr 169.254.0.0/16"
    );
    assert_eq!(
        d(tls("203.0.113.77:443").sni("api.test").dns(&["api.test"])),
        "allowed by domain api.test (DNS attribution); intercepted: no exemption matches"
    );
    assert_eq!(
        d(tls("203.0.113.77:443").sni("x.relay.test")),
        "no allow rule matches: no DNS answer through the reserved resolvers attributes a name to this address"
    );
}

// === properties ===

const NAMES: &[&str] = &["a.test", "b.a.test", "c.test", "x.relay.test", "relay.test"];
const IPS: &[&str] = &["203.0.113.1", "203.0.113.2", "198.51.100.1", "2001:db8::1"];

fn arb_dest() -> impl Strategy<Value = Destination> {
    prop_oneof![
        prop::sample::select(IPS).prop_map(|i| Destination::parse(crate::Kind::Ip, i)),
        prop::sample::select(
            &[
                "203.0.113.0/30",
                "198.51.100.0/24",
                "2001:db8::/32",
                "0.0.0.0/0"
            ][..]
        )
        .prop_map(|c| Destination::parse(crate::Kind::Cidr, c)),
        prop::sample::select(NAMES).prop_map(|n| Destination::parse(crate::Kind::Domain, n)),
        prop::sample::select(&["*.a.test", "*.relay.test", "*.test"][..])
            .prop_map(|w| Destination::parse(crate::Kind::WildcardDomain, w)),
    ]
    .prop_map(|r| r.expect("universe is valid"))
}

fn arb_policy() -> impl Strategy<Value = Policy> {
    let list = || prop::collection::vec(arb_dest(), 0..5);
    (any::<bool>(), list(), list(), any::<bool>(), list()).prop_map(|(allow, a, d, on, e)| Policy {
        default: if allow {
            DefaultAction::Allow
        } else {
            DefaultAction::Deny
        },
        allow: a.into_iter().map(Rule::from).collect(),
        deny: d.into_iter().map(Rule::from).collect(),
        tls_interception: if on {
            TlsInterception::On
        } else {
            TlsInterception::Off
        },
        tls_interception_exemptions: e,
        dns: None,
        budgets: Default::default(),
    })
}

#[derive(Debug, Clone)]
struct Facts {
    ip: &'static str,
    protocol: Protocol,
    sni: Option<&'static str>,
    host: Option<&'static str>,
    names: Vec<&'static str>,
    ech: bool,
}

fn arb_facts() -> impl Strategy<Value = Facts> {
    (
        prop::sample::select(IPS),
        prop::sample::select(
            &[
                Protocol::Tls,
                Protocol::Http,
                Protocol::Opaque(None),
                Protocol::Opaque(Some(StreamProtocol::Ssh)),
                Protocol::Dns,
            ][..],
        ),
        prop::option::of(prop::sample::select(NAMES)),
        prop::option::of(prop::sample::select(NAMES)),
        prop::sample::subsequence(NAMES, 0..3),
        any::<bool>(),
    )
        .prop_map(|(ip, protocol, sni, host, names, ech)| Facts {
            ip,
            protocol,
            sni,
            host,
            names,
            ech: ech && protocol == Protocol::Tls,
        })
}

fn run(p: &CompiledPolicy, f: &Facts) -> Verdict {
    let sni = f.sni.map(h);
    let host = f.host.map(h);
    let names: Vec<Hostname> = f.names.iter().map(|n| h(n)).collect();
    p.decide(&Flow {
        dst: SocketAddr::new(f.ip.parse().expect("ip"), 443),
        protocol: f.protocol,
        sni: sni.as_ref(),
        host: host.as_ref(),
        attributed: &names,
        attribution_gap: AttributionGap::NoDnsSeen,
        encrypted_dns: None,
        ech: f.ech,
    })
}

/// A deny rule that matches the flow: its address, a covering CIDR, or a name of its evidence.
fn matching_deny(f: &Facts, pick: usize) -> Destination {
    let mut options = vec![
        Destination::parse(crate::Kind::Ip, f.ip).expect("ip"),
        Destination::parse(
            crate::Kind::Cidr,
            if f.ip.contains(':') {
                "::/0"
            } else {
                "0.0.0.0/0"
            },
        )
        .expect("cidr"),
    ];
    for n in f.names.iter().chain(&f.sni).chain(&f.host) {
        options.push(Destination::parse(crate::Kind::Domain, n).expect("domain"));
        if let Some((_, parent)) = n.split_once('.') {
            if parent.contains('.') {
                options.push(
                    Destination::parse(crate::Kind::WildcardDomain, &format!("*.{parent}"))
                        .expect("wildcard"),
                );
            }
        }
    }
    options.swap_remove(pick % options.len())
}

proptest! {
    /// Whatever the allows, exemptions, default and interception mode: a
    /// matching deny denies.
    #[test]
    fn a_deny_always_beats_any_allow_or_exemption(mut policy in arb_policy(), f in arb_facts(), pick in 0usize..64, at in 0usize..8) {
        let deny = matching_deny(&f, pick);
        let at = at % (policy.deny.len() + 1);
        policy.deny.insert(at, Rule::from(deny.clone()));
        // The same destination as an allow and an exemption, for good measure.
        policy.allow.push(Rule::from(deny.clone()));
        policy.tls_interception_exemptions.push(deny);
        let p = CompiledPolicy::new(policy, Arc::new(PlatformDenies::new(vec![])));
        let v = run(&p, &f);
        prop_assert!(matches!(v, Verdict::Deny(Denied::Tenant(_))), "{:?}: {}", v, v.describe(&p));
    }

    /// Removing every exemption never turns an allowed flow into a denied one
    /// or a denied one into an allowed one: exemptions only choose splice over terminate.
    #[test]
    fn exemptions_only_choose_between_splice_and_intercept(policy in arb_policy(), f in arb_facts()) {
        let mut without = policy.clone();
        without.tls_interception_exemptions.clear();
        let platform = Arc::new(PlatformDenies::new(vec![]));
        let with_v = run(&CompiledPolicy::new(policy, platform.clone()), &f);
        let without_v = run(&CompiledPolicy::new(without, platform), &f);
        prop_assert_eq!(with_v.is_deny(), without_v.is_deny(), "{:?} vs {:?}", with_v, without_v);
        if let Verdict::Splice(_, Spliced::Exempt(_)) = with_v {
            prop_assert!(matches!(without_v, Verdict::Intercept(..)), "{:?}", without_v);
        }
    }

    /// `opaque_streams = "deny"` never turns a deny into an allow, never
    /// changes a flow that is not an opaque stream, and only denies an
    /// opaque stream as `unreadable_stream`.
    #[test]
    fn denying_opaque_streams_only_refuses_opaque_streams(policy in arb_policy(), f in arb_facts()) {
        let open = run(&CompiledPolicy::new(policy.clone(), Arc::new(PlatformDenies::new(vec![]))), &f);
        let closed = run(&CompiledPolicy::new(policy, Arc::new(PlatformDenies::new(vec![]).with_opaque_streams(OpaqueStreams::Deny))), &f);
        match (open, closed, f.protocol) {
            (a, b, _) if a == b => {}
            (Verdict::Allow(a), Verdict::Deny(Denied::Stream(b, _)), Protocol::Opaque(_)) => prop_assert_eq!(a, b),
            (a, b, _) => prop_assert!(false, "{:?} became {:?}", a, b),
        }
    }

    /// ECH never changes allow or deny, never turns a termination into a
    /// splice, and a flow it spliced by exemption has an address exemption.
    #[test]
    fn ech_only_turns_a_name_exemption_into_termination(policy in arb_policy(), mut f in arb_facts()) {
        f.ech = false;
        let p = CompiledPolicy::new(policy, Arc::new(PlatformDenies::new(vec![])));
        let plain = run(&p, &f);
        f.ech = f.protocol == Protocol::Tls;
        let ech = run(&p, &f);
        prop_assert_eq!(plain.is_deny(), ech.is_deny());
        match (plain, ech) {
            (a, b) if a == b => {}
            (Verdict::Splice(a, Spliced::Exempt(r)), Verdict::Intercept(b, Intercepted::Ech(s))) => {
                prop_assert_eq!((a, r), (b, s));
                prop_assert!(p.exempt.lookup_addr(&Addrs::of(SocketAddr::new(f.ip.parse().expect("ip"), 443))).is_none());
            }
            (a, b) => prop_assert!(false, "{:?} became {:?}", a, b),
        }
    }

    /// A spliced TLS flow allowed by a name always has that name attributed,
    /// and an SNI among the attributed names.
    #[test]
    fn spliced_names_are_attributed(policy in arb_policy(), f in arb_facts()) {
        let v = run(&CompiledPolicy::new(policy, Arc::new(PlatformDenies::new(vec![]))), &f);
        if let Verdict::Splice(allowed, _) = v {
            prop_assert!(!matches!(allowed, Allowed::VerifiedName(_)));
            if let Allowed::AttributedName(_) = allowed {
                prop_assert!(!f.names.is_empty());
                prop_assert!(f.sni.is_none_or(|s| f.names.contains(&s)));
            }
        }
    }
}

// === per-request rules ===

/// Judges `method target` to `name` under `p`: `(deny, would_deny)` as `code rule`.
fn request(p: &CompiledPolicy, name: &str, method: &str, target: &str) -> (String, String) {
    let n = h(name);
    let j = p.judge_request(&[&n], method, target);
    let show = |d: Option<RequestDenial>| {
        d.map_or_else(String::new, |d| {
            format!("{} {}", d.code.as_str(), d.rule.label())
        })
    };
    (show(j.deny), show(j.would_deny))
}

fn pass() -> (String, String) {
    (String::new(), String::new())
}

fn denied(what: &str) -> (String, String) {
    (what.to_owned(), String::new())
}

#[test]
fn read_only_allows_reads_and_refuses_writes() {
    let p = compile(
        r#"{"allow": [{"domain": "github.test", "http": "read_only"}], "tls_interception": "on"}"#,
    );
    assert_eq!(request(&p, "github.test", "GET", "/a"), pass());
    assert_eq!(request(&p, "github.test", "HEAD", "/"), pass());
    assert_eq!(request(&p, "github.test", "OPTIONS", "*"), pass());
    assert_eq!(
        request(&p, "github.test", "POST", "/a"),
        denied("http_not_allowed allow[0]")
    );
    assert_eq!(
        request(&p, "github.test", "DELETE", "/a"),
        denied("http_not_allowed allow[0]")
    );
    // A name with no qualified entry is not judged per request.
    assert_eq!(request(&p, "other.test", "POST", "/a"), pass());
}

/// A deny of `GET` covers `HEAD`, which servers route to the `GET`
/// handler; an allow of `GET` alone does not let `HEAD` through, and one of
/// `HEAD` does not let `GET`.
#[test]
fn a_deny_of_get_covers_head() {
    let p = compile(
        r#"{"allow": [{"domain": "api.test"}, {"domain": "get.test", "http": {"methods": ["GET"]}},
                      {"domain": "head.test", "http": {"methods": ["HEAD"]}}],
            "deny": [{"domain": "api.test", "http": {"methods": ["GET"], "paths": ["/export"]}}],
            "tls_interception": "on"}"#,
    );
    for method in ["GET", "HEAD", "head"] {
        assert_eq!(
            request(&p, "api.test", method, "/export?d=1"),
            denied("http_deny deny[0]"),
            "{method}"
        );
    }
    assert_eq!(request(&p, "api.test", "POST", "/export"), pass());
    assert_eq!(request(&p, "api.test", "HEAD", "/other"), pass());
    assert_eq!(
        request(&p, "get.test", "HEAD", "/"),
        denied("http_not_allowed allow[1]")
    );
    assert_eq!(request(&p, "head.test", "HEAD", "/"), pass());
    assert_eq!(
        request(&p, "head.test", "GET", "/"),
        denied("http_not_allowed allow[2]")
    );
}

/// A deny of `/admin` covers `/admin.json` and `/Admin.v2.xml` (Rails routes
/// a format suffix to the path without it, Spring's suffix patterns any
/// suffix), only in the last segment, and not from a leading `.`; an allow
/// is read as written.
#[test]
fn a_deny_covers_its_path_with_a_format_suffix() {
    let p = compile(
        r#"{"allow": [{"domain": "api.test"}, {"domain": "ok.test", "http": {"paths": ["/gists"]}}],
            "deny": [{"domain": "api.test", "http": {"paths": ["/admin", "/repos/*/keys"]}}],
            "tls_interception": "on"}"#,
    );
    for target in [
        "/admin.json",
        "/Admin.v2.xml",
        "/admin.",
        "/admin.json?x=1",
        "/repos/a/keys.json",
        "/admin/users.json",
    ] {
        assert_eq!(
            request(&p, "api.test", "GET", target),
            denied("http_deny deny[0]"),
            "{target}"
        );
    }
    for target in [
        "/.admin",
        "/adminx.json",
        "/admin.json.d/../",
        "/v1.2/admin2",
        "/repos/a.json/keys2",
    ] {
        assert_ne!(
            request(&p, "api.test", "GET", target),
            denied("http_deny deny[0]"),
            "{target}"
        );
    }
    assert_eq!(
        request(&p, "ok.test", "GET", "/gists.json"),
        denied("http_not_allowed allow[1]")
    );
}

#[test]
fn qualified_deny_cannot_be_dodged_by_the_path() {
    let p = compile(
        r#"{"allow": [{"domain": "github.test"}],
            "deny": [{"domain": "github.test", "http": {"methods": ["POST"], "paths": ["/gists"]}}],
            "tls_interception": "on"}"#,
    );
    for target in [
        "/gists",
        "/gists/",
        "/gists/1",
        "/%67ists",
        // Upper case: origins that route without regard to case take it
        // for /gists, so the deny does too.
        "/GISTS",
        "/Gists/1",
        "/gists?x=1",
    ] {
        assert_eq!(
            request(&p, "github.test", "POST", target),
            denied("http_deny deny[0]"),
            "{target}"
        );
    }
    for target in [
        // Dot segments: resolved by some origins, routed as they are by
        // others, and after an empty segment resolved two ways.
        "/./gists",
        "/x/../gists",
        "/x/%2e%2e/gists",
        "/x/%2E%2E/gists",
        "/gists//../gists",
        "/gists;x",
        "/a%2f..%2fgists",
        "/a\\..\\gists",
        "/%252e%252e/gists",
        "/a%zz",
        // An authority to origins that read the target as a URI reference.
        "//gists",
        "//x/gists",
    ] {
        assert_eq!(
            request(&p, "github.test", "POST", target),
            denied("ambiguous_path deny[0]"),
            "{target}"
        );
    }
    // A pattern written in capitals denies every case of its path too.
    let capitals = compile(
        r#"{"allow": [{"domain": "github.test"}],
            "deny": [{"domain": "github.test", "http": {"paths": ["/Admin/*/Keys"]}}],
            "tls_interception": "on"}"#,
    );
    for target in ["/Admin/1/Keys", "/admin/x/keys", "/ADMIN/Y/KEYS/z"] {
        assert_eq!(
            request(&capitals, "github.test", "GET", target),
            denied("http_deny deny[0]"),
            "{target}"
        );
    }
    assert_eq!(
        request(&capitals, "github.test", "GET", "/admin/keys"),
        pass()
    );
    // The letters Java folds to ASCII where Rust does not: `İ` and `ı` read
    // as `i`, `ſ` as `s` (Spring's case-insensitive paths route them so).
    let java = compile(
        r#"{"allow": [{"domain": "github.test"}],
            "deny": [{"domain": "github.test", "http": {"paths": ["/admin", "/secret"]}}],
            "tls_interception": "on"}"#,
    );
    for target in ["/ADM%C4%B0N", "/adm%C4%B1n", "/%C5%BFecret", "/%C5%BFECRET"] {
        assert_eq!(
            request(&java, "github.test", "GET", target),
            denied("http_deny deny[0]"),
            "{target}"
        );
    }
    assert_eq!(request(&p, "github.test", "GET", "/gists"), pass());
    assert_eq!(request(&p, "github.test", "POST", "/gistsx"), pass());
    assert_eq!(request(&p, "github.test", "POST", "/repos"), pass());
    // A method the deny does not cover never needs the path.
    assert_eq!(request(&p, "github.test", "GET", "/gists;x"), pass());
    // The flow itself is allowed: a qualified deny denies requests.
    assert!(matches!(
        decide(
            &p,
            &tls("198.51.100.7:443")
                .sni("github.test")
                .dns(&["github.test"])
        ),
        Verdict::Intercept(..)
    ));
}

#[test]
fn a_character_and_its_escape_are_judged_alike() {
    // An origin that decodes a path before routing reads both the same.
    let p = compile(
        r#"{"allow": [{"domain": "npm.test"}],
            "deny": [{"domain": "npm.test", "http": {"methods": ["PUT"], "paths": ["/-/user/org.couchdb.user:x", "/café"]}}],
            "tls_interception": "on"}"#,
    );
    for target in [
        "/-/user/org.couchdb.user:x",
        "/-/user/org.couchdb.user%3Ax",
        "/-/user/org.couchdb.user%3ax",
        "/%2D/user/org.couchdb.user:x",
        "/caf%C3%A9",
        "/café",
    ] {
        assert_eq!(
            request(&p, "npm.test", "PUT", target),
            denied("http_deny deny[0]"),
            "{target}"
        );
    }
    assert_eq!(
        request(&p, "npm.test", "PUT", "/-/user/org.couchdb.user:y"),
        pass()
    );
}

#[test]
fn path_globs_and_methods_select_requests() {
    let p = compile(
        r#"{"allow": [{"domain": "api.test", "http": {"methods": ["GET"], "paths": ["/repos/*/issues"]}},
                      {"domain": "api.test", "http": {"methods": ["POST"], "paths": ["/repos/*/issues/*/comments"]}}],
            "tls_interception": "on"}"#,
    );
    assert_eq!(request(&p, "api.test", "GET", "/repos/a/issues"), pass());
    assert_eq!(request(&p, "api.test", "GET", "/repos/a/issues/3"), pass());
    assert_eq!(
        request(&p, "api.test", "POST", "/repos/a/issues/3/comments"),
        pass()
    );
    assert_eq!(
        request(&p, "api.test", "POST", "/repos/a/issues"),
        denied("http_not_allowed allow[0]")
    );
    assert_eq!(
        request(&p, "api.test", "GET", "/repos/a/pulls"),
        denied("http_not_allowed allow[0]")
    );
    assert_eq!(
        request(&p, "api.test", "GET", "/repos/a%2fb/issues"),
        denied("ambiguous_path allow[0]")
    );
}

#[test]
fn audit_rules_pass_and_say_what_they_would_deny() {
    let p = compile(
        r#"{"allow": [{"domain": "github.test", "http": "read_only", "mode": "audit"}],
            "deny": [{"domain": "github.test", "http": {"paths": ["/admin"]}, "mode": "audit"}],
            "tls_interception": "on"}"#,
    );
    assert_eq!(request(&p, "github.test", "GET", "/a"), pass());
    assert_eq!(
        request(&p, "github.test", "POST", "/a"),
        (String::new(), "http_not_allowed allow[0]".into())
    );
    assert_eq!(
        request(&p, "github.test", "GET", "/admin/x"),
        (String::new(), "http_deny deny[0]".into())
    );
    // Audited entries never change a flow: no denial, and the audited
    // allow lets a spliced flow out as an unqualified one would.
    let off =
        compile(r#"{"allow": [{"domain": "github.test", "http": "read_only", "mode": "audit"}]}"#);
    assert!(matches!(
        decide(
            &off,
            &tls("198.51.100.7:443")
                .sni("github.test")
                .dns(&["github.test"])
        ),
        Verdict::Splice(Allowed::AttributedName(0), Spliced::InterceptionOff)
    ));
}

#[test]
fn the_most_specific_level_decides() {
    let p = compile(
        r#"{"allow": [{"wildcard_domain": "*.github.test"}, {"domain": "api.github.test", "http": "read_only"},
                      {"domain": "raw.github.test", "http": "read_only"}, {"domain": "raw.github.test"}],
            "default": "allow", "tls_interception": "on"}"#,
    );
    assert_eq!(
        request(&p, "api.github.test", "POST", "/"),
        denied("http_not_allowed allow[1]")
    );
    assert_eq!(request(&p, "www.github.test", "POST", "/"), pass());
    // An unqualified entry at the same level opens the name.
    assert_eq!(request(&p, "raw.github.test", "POST", "/"), pass());
    // Default allow does not open a name its entries restrict.
    let d = compile(
        r#"{"default": "allow", "allow": [{"domain": "github.test", "http": "read_only"}], "tls_interception": "on"}"#,
    );
    assert_eq!(
        request(&d, "github.test", "PUT", "/"),
        denied("http_not_allowed allow[0]")
    );
}

#[test]
fn flows_whose_requests_cannot_be_seen_are_denied_or_terminated() {
    let ro = r#"{"domain": "github.test", "http": "read_only"}"#;
    // Interception off: the requests would pass unseen, so the flow is denied.
    let off = compile(&format!(r#"{{"default": "allow", "allow": [{ro}]}}"#));
    let to_github = tls("198.51.100.7:443")
        .sni("github.test")
        .dns(&["github.test"]);
    let v = decide(&off, &to_github);
    assert_eq!(v, Verdict::Deny(Denied::Unseen(RuleRef::Allow(0))));
    assert_eq!(v.code(), "needs_interception");
    assert!(
        v.describe(&off)
            .contains("allow[0] domain github.test http read_only"),
        "{}",
        v.describe(&off)
    );
    // Opaque bytes to the name likewise, even with interception on.
    let on = compile(&format!(
        r#"{{"allow": [{ro}, {{"domain": "other.test"}}], "tls_interception": "on",
            "tls_interception_exemptions": [{{"domain": "github.test"}}, {{"cidr": "198.51.100.0/24"}}]}}"#
    ));
    assert_eq!(
        decide(&on, &opaque("198.51.100.7:443").dns(&["github.test"])),
        Verdict::Deny(Denied::Unseen(RuleRef::Allow(0)))
    );
    // An exemption would splice: terminated instead, and explain says why.
    let v = decide(&on, &to_github);
    assert_eq!(
        v,
        Verdict::Intercept(
            Allowed::AttributedName(0),
            Intercepted::RequestRules(RuleRef::Allow(0))
        )
    );
    assert_eq!(v.code(), "request_rules");
    // Plain HTTP is seen: allowed, judged per request.
    assert!(matches!(
        decide(
            &on,
            &http("198.51.100.7:443")
                .host("github.test")
                .dns(&["github.test"])
        ),
        Verdict::Allow(_)
    ));
    // Other names under the same exemption still splice.
    assert!(matches!(
        decide(
            &on,
            &tls("198.51.100.8:443")
                .sni("other.test")
                .dns(&["other.test"])
        ),
        Verdict::Splice(..)
    ));
    // A qualified deny with interception off denies the flow it cannot judge.
    let deny = compile(
        r#"{"default": "allow", "deny": [{"domain": "github.test", "http": {"methods": ["POST"]}}]}"#,
    );
    assert_eq!(
        decide(&deny, &to_github),
        Verdict::Deny(Denied::Unseen(RuleRef::Deny(0)))
    );
}

/// A `streams` entry beside a qualified entry for the same name (what the
/// error for `streams` beside `http` asks for) lets its streams through and
/// leaves the name's requests to the qualifier; a qualified deny still holds
/// the stream back, and a credential for the name does not.
#[test]
fn a_streams_entry_opens_its_streams_and_not_the_names_requests() {
    let pair = r#"{"domain": "github.test", "http": "read_only"}, {"domain": "github.test", "streams": ["ssh"]}"#;
    let p = compile(&format!(
        r#"{{"allow": [{pair}], "tls_interception": "on",
            "tls_interception_exemptions": [{{"domain": "github.test"}}]}}"#
    ));
    assert_eq!(
        request(&p, "github.test", "POST", "/"),
        denied("http_not_allowed allow[0]")
    );
    assert_eq!(request(&p, "github.test", "GET", "/"), pass());
    let to_github = |f: F| f.dns(&["github.test"]);
    assert_eq!(
        decide(&p, &to_github(ssh("198.51.100.7:22"))),
        Verdict::Allow(Allowed::AttributedName(1))
    );
    // Bytes no entry names are still requests the qualifier cannot see.
    assert_eq!(
        decide(&p, &to_github(opaque("198.51.100.7:22"))),
        Verdict::Deny(Denied::Unseen(RuleRef::Allow(0)))
    );
    assert_eq!(
        decide(&p, &to_github(tls("198.51.100.7:443").sni("github.test"))),
        Verdict::Intercept(
            Allowed::AttributedName(0),
            Intercepted::RequestRules(RuleRef::Allow(0))
        )
    );
    let deny = compile(&format!(
        r#"{{"allow": [{pair}], "deny": [{{"domain": "github.test", "http": {{"methods": ["POST"]}}}}],
            "tls_interception": "on"}}"#
    ));
    assert_eq!(
        decide(&deny, &to_github(ssh("198.51.100.7:22"))),
        Verdict::Deny(Denied::Unseen(RuleRef::Deny(0)))
    );
    let hosts = [Destination::Domain(h("github.test"))];
    let with_credential = CompiledPolicy::with_credentials(
        Policy::from_json(r#"{"allow": [{"domain": "github.test", "streams": ["ssh"]}]}"#)
            .expect("valid"),
        Arc::new(PlatformDenies::builtin()),
        [("github", hosts.iter().collect())],
    );
    assert_eq!(
        decide(&with_credential, &to_github(ssh("198.51.100.7:22"))),
        Verdict::Allow(Allowed::AttributedName(0))
    );
}

#[test]
fn credential_hosts_are_never_spliced() {
    let policy = Policy::from_json(
        r#"{"allow": [{"wildcard_domain": "*.test"}], "tls_interception": "on",
            "tls_interception_exemptions": [{"wildcard_domain": "*.test"}]}"#,
    )
    .expect("valid");
    let hosts = [Destination::Domain(h("api.github.test"))];
    let p = CompiledPolicy::with_credentials(
        policy,
        Arc::new(PlatformDenies::builtin()),
        [("github", hosts.iter().collect())],
    );
    let v = decide(
        &p,
        &tls("198.51.100.7:443")
            .sni("api.github.test")
            .dns(&["api.github.test"]),
    );
    assert_eq!(
        v,
        Verdict::Intercept(
            Allowed::AttributedName(0),
            Intercepted::RequestRules(RuleRef::Credential(0))
        )
    );
    assert!(
        v.describe(&p).contains("credential \"github\""),
        "{}",
        v.describe(&p)
    );
    assert!(matches!(
        decide(
            &p,
            &tls("198.51.100.8:443")
                .sni("www.other.test")
                .dns(&["www.other.test"])
        ),
        Verdict::Splice(..)
    ));
    // Credentials never change what a request may do.
    assert_eq!(request(&p, "api.github.test", "POST", "/"), pass());
}

proptest! {
    /// The per-level segment trie finds exactly the entries whose patterns
    /// cover a path, as `PathPattern::covers` says one by one.
    #[test]
    fn the_path_trie_agrees_with_each_pattern(
        patterns in prop::collection::vec(prop::collection::vec(prop::sample::select(vec!["a", "b", "*"]), 0..4), 1..6),
        path in prop::collection::vec(prop::sample::select(vec!["a", "b", "c"]), 0..5),
    ) {
        let texts: Vec<String> = patterns.iter().map(|p| format!("/{}", p.join("/"))).collect();
        let allow: Vec<String> = texts
            .iter()
            .map(|t| format!(r#"{{"domain": "api.test", "http": {{"paths": ["{t}"]}}}}"#))
            .collect();
        let p = compile(&format!(r#"{{"allow": [{}], "tls_interception": "on"}}"#, allow.join(",")));
        let target = format!("/{}", path.join("/"));
        let segs: Vec<&str> = path.clone();
        let naive = texts
            .iter()
            .any(|t| crate::http::PathPattern::parse(t).expect(t).covers(&segs));
        let n = h("api.test");
        let judged = p.judge_request(&[&n], "GET", &target);
        prop_assert_eq!(judged.deny.is_none(), naive, "{:?} {}", texts, target);
    }
}

/// An allow entry past its `until` is compiled as if it were not there,
/// one before it as any other; the policy says when to compile it again.
/// A deny never lapses: `until` on one is refused.
#[test]
fn an_allow_entry_past_its_until_is_out_of_force() {
    let policy = r#"{"default": "deny", "allow": [
        {"domain": "old.test", "until": "2000-01-01T00:00:00Z"},
        {"domain": "new.test", "until": "2999-01-01T00:00:00+02:00"},
        {"domain": "api.test", "http": {"methods": ["GET"]}, "until": "2000-01-01T00:00:00Z"},
        {"domain": "kept.test"}]}"#;
    let flow = |sni| tls("203.0.113.7:443").sni(sni).dns(&[sni]);
    table(&[
        (policy, flow("old.test"), "deny", "no_allow_match"),
        (policy, flow("new.test"), "splice", "interception_off"),
        (policy, flow("kept.test"), "splice", "interception_off"),
        (policy, flow("api.test"), "deny", "no_allow_match"),
    ]);
    let p = compile(policy);
    let rfc3339 = time::format_description::well_known::Rfc3339;
    let expected = time::OffsetDateTime::parse("2999-01-01T00:00:00+02:00", &rfc3339);
    assert_eq!(p.next_expiry(), expected.ok());
    // The normal form keeps `until` (UTC offsets as written).
    let back = serde_json::to_string(&p.policy().allow[1]).expect("ser");
    assert_eq!(
        back,
        r#"{"domain":"new.test","until":"2999-01-01T00:00:00+02:00"}"#
    );
    for bad in [
        r#"{"deny": [{"domain": "x.test", "until": "2999-01-01T00:00:00Z"}]}"#,
        r#"{"allow": [{"domain": "x.test", "until": "tomorrow"}]}"#,
        r#"{"allow": [{"domain": "x.test", "until": "2999-01-01 00:00:00"}]}"#,
    ] {
        assert!(crate::Policy::from_json(bad).is_err(), "{bad}");
    }
}

/// The count a running flow compares: it moves with each new set of
/// registered addresses and each host reading that differs, not with a
/// reading that finds the same addresses.
#[test]
fn the_platforms_count_moves_when_its_addresses_do() {
    let p = PlatformDenies::new(Vec::new());
    let ip = |s: &str| s.parse::<IpAddr>().expect("ip");
    let start = p.changes();
    p.set_host([ip("203.0.113.1"), ip("2001:db8::1")]);
    assert_eq!(p.changes(), start + 1);
    p.set_host([ip("2001:db8::1"), ip("203.0.113.1"), ip("203.0.113.1")]);
    assert_eq!(p.changes(), start + 1, "the same addresses");
    p.set_host([ip("203.0.113.1")]);
    assert_eq!(p.changes(), start + 2);
    p.set_registered(|_| false);
    assert_eq!(p.changes(), start + 3);
}

/// Path patterns in any order make the same trie: written in descending
/// order (which, put in one by one, moved every child at each insertion),
/// every one is found, allow and deny, and a path none names is not.
#[test]
fn path_patterns_in_descending_order_are_each_found() {
    let paths = |entry: usize| -> Vec<String> {
        (0..256)
            .map(|i| format!("\"/p{:05}\"", 99_999 - entry * 256 - i))
            .collect()
    };
    let entries = |kind: &str| -> Vec<String> {
        (0..8)
            .map(|e| {
                let methods = if kind == "deny" {
                    r#""methods": ["DELETE"], "#
                } else {
                    ""
                };
                format!(
                    r#"{{"domain": "api.test", "http": {{{methods}"paths": [{}]}}}}"#,
                    paths(e).join(", ")
                )
            })
            .collect()
    };
    let p = compile(&format!(
        r#"{{"default": "deny", "allow": [{}], "deny": [{}]}}"#,
        entries("allow").join(", "),
        entries("deny").join(", ")
    ));
    for n in (99_999 - 2_047)..=99_999 {
        let path = format!("/p{n:05}");
        assert_eq!(request(&p, "api.test", "GET", &path), pass(), "{path}");
        let (deny, _) = request(&p, "api.test", "DELETE", &path);
        assert!(deny.starts_with("http_deny"), "{path}: {deny}");
    }
    let (deny, _) = request(&p, "api.test", "GET", "/p00001");
    assert!(!deny.is_empty(), "a path no entry names");
}

/// One generated entry for `api.test`: whether it is a deny, its `http`
/// (none; `read_only`; or methods from GET and POST, and paths), audited.
#[derive(Clone, Debug)]
struct ModelEntry {
    deny: bool,
    http: Option<Option<(Vec<&'static str>, Vec<String>)>>,
    audit: bool,
}

impl ModelEntry {
    fn json(&self) -> String {
        let http = match &self.http {
            None => String::new(),
            Some(None) => r#", "http": "read_only""#.to_owned(),
            Some(Some((methods, paths))) => format!(
                r#", "http": {{"methods": {}, "paths": {}}}"#,
                serde_json::json!(methods),
                serde_json::json!(paths)
            )
            .replace(r#""methods": [], "#, "")
            .replace(r#", "paths": []"#, ""),
        };
        let mode = if self.audit {
            r#", "mode": "audit""#
        } else {
            ""
        };
        format!(r#"{{"domain": "api.test"{http}{mode}}}"#)
    }

    /// Whether the entry's methods cover `method` (`None`: unqualified).
    fn covers_method(&self, method: &str) -> Option<bool> {
        let read_only = ["GET", "HEAD", "OPTIONS"];
        Some(match self.http.as_ref()? {
            None => read_only.iter().any(|m| m.eq_ignore_ascii_case(method)),
            Some((methods, _)) => {
                methods.is_empty() || methods.iter().any(|m| m.eq_ignore_ascii_case(method))
            }
        })
    }

    fn paths(&self) -> &[String] {
        match &self.http {
            Some(Some((_, paths))) => paths,
            _ => &[],
        }
    }
}

/// The per-request judgement as the rules read one by one
/// (docs/policy.md, "Per-request rules"): `(code, rule)`, `None` passes.
/// `segs`: the normal path, `None` when it reads two ways.
fn model_refusal(
    entries: &[ModelEntry],
    method: &str,
    segs: Option<&[&str]>,
    audit: bool,
) -> Option<(&'static str, String)> {
    let counts = |e: &ModelEntry| e.http.is_some() && (audit || !e.audit);
    let path_covers = |e: &ModelEntry| match segs {
        _ if e.paths().is_empty() => Some(true),
        None => None,
        Some(s) => Some(e.paths().iter().any(|p| {
            crate::http::PathPattern::parse(p)
                .expect("pattern")
                .covers(s)
        })),
    };
    let covers_for_deny = |e: &ModelEntry| {
        e.covers_method(method) == Some(true)
            || (method.eq_ignore_ascii_case("HEAD") && e.covers_method("GET") == Some(true))
    };
    let denies = entries.iter().filter(|e| e.deny).enumerate();
    for (i, e) in denies.filter(|(_, e)| counts(e) && covers_for_deny(e)) {
        match path_covers(e) {
            Some(true) => return Some(("http_deny", format!("deny[{i}]"))),
            None => return Some(("ambiguous_path", format!("deny[{i}]"))),
            Some(false) => {}
        }
    }
    let allows: Vec<&ModelEntry> = entries.iter().filter(|e| !e.deny).collect();
    let open = allows
        .iter()
        .any(|e| e.http.is_none() || (!audit && e.audit));
    if open || allows.is_empty() {
        return None;
    }
    let covering = allows
        .iter()
        .enumerate()
        .filter(|(_, e)| counts(e) && e.covers_method(method) == Some(true));
    let mut ambiguous = None;
    for (i, e) in covering {
        match path_covers(e) {
            Some(true) => return None,
            None => {
                ambiguous.get_or_insert(i);
            }
            Some(false) => {}
        }
    }
    Some(match ambiguous {
        Some(i) => ("ambiguous_path", format!("allow[{i}]")),
        None => ("http_not_allowed", "allow[0]".to_owned()),
    })
}

fn model_entry() -> impl Strategy<Value = ModelEntry> {
    let methods = prop::sample::subsequence(vec!["GET", "POST"], 0..=2);
    let path = prop::collection::vec(prop::sample::select(vec!["a", "b", "*"]), 1..3)
        .prop_map(|s| format!("/{}", s.join("/")));
    let requests = (methods, prop::collection::vec(path, 0..3))
        .prop_filter("methods, paths or both", |(m, p)| {
            !m.is_empty() || !p.is_empty()
        });
    let http = prop_oneof![Just(None), requests.prop_map(Some)];
    (any::<bool>(), http, any::<bool>(), any::<bool>()).prop_map(
        |(deny, http, qualified, audit)| {
            let http = (qualified || deny).then_some(http);
            ModelEntry {
                deny,
                audit: audit && http.is_some(),
                http,
            }
        },
    )
}

proptest! {
    /// Allow and deny entries with methods, `read_only`, paths and audit,
    /// judged by the compiled rules (the first entry per method, the path
    /// trie) and by the rules read one by one: the same refusal, naming the
    /// same entry, enforced and audited.
    #[test]
    fn the_compiled_request_rules_agree_with_each_entry(
        entries in prop::collection::vec(model_entry(), 1..7),
        method in prop::sample::select(vec!["GET", "get", "POST", "Post", "HEAD", "OPTIONS", "PUT"]),
        path in prop::collection::vec(prop::sample::select(vec!["a", "b", "c", ".."]), 0..4),
    ) {
        let list = |deny: bool| -> Vec<String> {
            entries.iter().filter(|e| e.deny == deny).map(ModelEntry::json).collect()
        };
        let p = compile(&format!(
            r#"{{"tls_interception": "on", "allow": [{}], "deny": [{}]}}"#,
            list(false).join(","),
            list(true).join(",")
        ));
        let target = format!("/{}", path.join("/"));
        let segs: Option<Vec<&str>> = (!path.contains(&"..")).then(|| path.clone());
        let show = |d: Option<(&str, String)>| d.map_or_else(String::new, |(c, r)| format!("{c} {r}"));
        let deny = model_refusal(&entries, method, segs.as_deref(), false);
        let would = match deny {
            Some(_) => None,
            None => model_refusal(&entries, method, segs.as_deref(), true),
        };
        let expected = (show(deny), show(would));
        prop_assert_eq!(request(&p, "api.test", method, &target), expected, "{:?} {} {}", entries, method, target);
    }
}
