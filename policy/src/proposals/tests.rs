use std::time::{Duration, SystemTime};

use super::*;

fn at(s: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000 + s)
}

fn name(s: &str) -> Hostname {
    Hostname::parse(s).expect(s)
}

fn flow(dst: &str, sni: Option<&str>, reason: &'static str, t: u64) -> Denial {
    Denial {
        at: at(t),
        dst: dst.parse().expect(dst),
        sni: sni.map(name),
        host: None,
        attributed: Vec::new(),
        reason,
        request: None,
    }
}

fn rules(p: &Proposals) -> Vec<String> {
    let mut v: Vec<String> = p
        .list(&PlatformDenies::builtin())
        .iter()
        .map(|p| serde_json::to_string(&p.rule).expect("json"))
        .collect();
    v.sort();
    v
}

#[test]
fn a_denied_name_is_proposed_with_counts_and_examples() {
    let mut p = Proposals::default();
    for t in 0..5 {
        assert!(p.record(flow(
            "198.51.100.7:443",
            Some("api.x.test"),
            "no_allow_match",
            t
        )));
    }
    let list = p.list(&PlatformDenies::builtin());
    assert_eq!(list.len(), 1);
    let one = &list[0];
    assert_eq!(
        serde_json::to_string(&one.rule).expect("json"),
        r#"{"domain":"api.x.test"}"#
    );
    assert_eq!(one.count, 5);
    assert_eq!((one.first_seen, one.last_seen), (at(0), at(4)));
    assert_eq!(one.examples.len(), MAX_EXAMPLES);
    assert_eq!(one.examples[0].at, at(2), "the most recent, oldest first");
    assert_eq!(one.reasons, ["no_allow_match"]);
    // 128 bits of SHA-256: no two rules a sandbox can make share one.
    assert_eq!(one.id, "p-54da844afccb4c73445a270293e139a2", "{}", one.id);
}

#[test]
fn the_id_is_derived_from_the_rule() {
    let mut a = Proposals::default();
    let mut b = Proposals::default();
    a.record(flow(
        "198.51.100.7:443",
        Some("api.x.test"),
        "no_allow_match",
        0,
    ));
    b.record(flow("203.0.113.9:80", Some("api.x.test"), "no_dns_seen", 9));
    let platform = PlatformDenies::builtin();
    assert_eq!(a.list(&platform)[0].id, b.list(&platform)[0].id);
    b.record(flow("203.0.113.9:80", Some("web.x.test"), "no_dns_seen", 9));
    let ids: BTreeSet<String> = b.list(&platform).into_iter().map(|p| p.id).collect();
    assert_eq!(ids.len(), 2);
}

#[test]
fn evidence_names_sni_then_host_then_attribution() {
    let mut d = flow("198.51.100.7:443", None, "no_allow_match", 0);
    d.attributed = vec![name("cdn.x.test"), name("other.x.test")];
    assert_eq!(key_of(&d), Some(Key::Name(name("cdn.x.test"))));
    d.host = Some(name("host.x.test"));
    assert_eq!(key_of(&d), Some(Key::Name(name("host.x.test"))));
    d.sni = Some(name("sni.x.test"));
    assert_eq!(key_of(&d), Some(Key::Name(name("sni.x.test"))));
}

#[test]
fn platform_denies_and_reasons_an_allow_does_not_fix_are_never_proposed() {
    let never = [
        "platform_deny",
        "tenant_deny",
        "http_deny",
        "misdirected",
        "sni_mismatch",
        "ambiguous_path",
        "needs_interception",
        "unreadable_stream",
        "encrypted_dns",
        "credential_required",
        "malformed_client_hello",
        "unknown_sandbox",
    ];
    let mut p = Proposals::default();
    for reason in never {
        assert!(
            !p.record(flow("169.254.169.254:80", None, reason, 0)),
            "{reason}"
        );
        assert!(
            !p.record(flow("198.51.100.7:443", Some("a.x.test"), reason, 0)),
            "{reason}"
        );
    }
    assert!(p.is_empty());
    for reason in PROPOSED_REASONS
        .iter()
        .filter(|r| **r != "http_not_allowed")
    {
        assert!(
            p.record(flow("198.51.100.7:443", Some("a.x.test"), reason, 0)),
            "{reason}"
        );
    }
}

#[test]
fn siblings_become_a_wildcard_only_at_the_threshold() {
    let mut p = Proposals::default();
    for (i, n) in ["a.cdn.x.test", "b.x.test"].iter().enumerate() {
        p.record(flow(
            "198.51.100.7:443",
            Some(n),
            "no_allow_match",
            i as u64,
        ));
    }
    assert_eq!(
        rules(&p),
        [r#"{"domain":"a.cdn.x.test"}"#, r#"{"domain":"b.x.test"}"#]
    );
    // The apex is not a sibling, and stays a name of its own.
    p.record(flow(
        "198.51.100.7:443",
        Some("x.test"),
        "no_allow_match",
        3,
    ));
    assert_eq!(rules(&p).len(), 3);
    p.record(flow("198.51.100.8:443", Some("c.x.test"), "no_dns_seen", 4));
    // The wildcard, and each name still: the operator chooses.
    assert_eq!(
        rules(&p),
        [
            r#"{"domain":"a.cdn.x.test"}"#,
            r#"{"domain":"b.x.test"}"#,
            r#"{"domain":"c.x.test"}"#,
            r#"{"domain":"x.test"}"#,
            r#"{"wildcard_domain":"*.x.test"}"#
        ]
    );
    let list = p.list(&PlatformDenies::builtin());
    let w = list
        .iter()
        .find(|p| p.rule.dest.kind() == crate::Kind::WildcardDomain)
        .expect("wildcard");
    assert_eq!(w.count, 3);
    assert_eq!(w.reasons, ["no_allow_match", "no_dns_seen"]);
    assert_eq!((w.first_seen, w.last_seen), (at(0), at(4)));
}

#[test]
fn never_a_wildcard_over_a_public_suffix() {
    let mut p = Proposals::default();
    for n in [
        "a.co.uk",
        "b.co.uk",
        "c.co.uk",
        "a.github.io",
        "b.github.io",
        "c.github.io",
    ] {
        p.record(flow("198.51.100.7:443", Some(n), "no_allow_match", 0));
    }
    let got = rules(&p);
    assert_eq!(got.len(), 6, "{got:?}");
    assert!(got.iter().all(|r| r.starts_with(r#"{"domain""#)), "{got:?}");
    // Under one registrable domain of a private suffix, siblings do merge.
    for n in ["x.a.github.io", "y.a.github.io", "z.a.github.io"] {
        p.record(flow("198.51.100.7:443", Some(n), "no_allow_match", 0));
    }
    assert!(rules(&p).contains(&r#"{"wildcard_domain":"*.a.github.io"}"#.to_owned()));
}

/// Nor over a registrable domain with a public suffix beneath it:
/// `*.amazonaws.com` would cover every S3 bucket (`s3.amazonaws.com` is a
/// suffix), `*.windows.net` every blob store.
#[test]
fn never_a_wildcard_over_a_domain_with_public_suffixes_beneath() {
    let mut p = Proposals::default();
    for n in [
        "sts.amazonaws.com",
        "iam.amazonaws.com",
        "route53.amazonaws.com",
        "a.windows.net",
        "b.windows.net",
        "c.windows.net",
    ] {
        p.record(flow("198.51.100.7:443", Some(n), "no_allow_match", 0));
    }
    let got = rules(&p);
    assert_eq!(got.len(), 6, "{got:?}");
    assert!(got.iter().all(|r| r.starts_with(r#"{"domain""#)), "{got:?}");
    // The list is the pinned PSL's: a domain with none beneath still merges.
    assert!(covers_public_suffixes("amazonaws.com"));
    assert!(!covers_public_suffixes("example.com"));
}

#[test]
fn addresses_aggregate_to_their_network_only_at_the_threshold() {
    let mut p = Proposals::default();
    p.record(flow("198.51.100.7:443", None, "no_allow_match", 0));
    p.record(flow("198.51.100.8:22", None, "no_allow_match", 1));
    p.record(flow("203.0.113.1:443", None, "no_allow_match", 2));
    p.record(flow("[2001:db8:1:2::1]:443", None, "no_allow_match", 2));
    assert_eq!(
        rules(&p),
        [
            r#"{"ip":"198.51.100.7"}"#,
            r#"{"ip":"198.51.100.8"}"#,
            r#"{"ip":"2001:db8:1:2::1"}"#,
            r#"{"ip":"203.0.113.1"}"#,
        ]
    );
    p.record(flow("198.51.100.200:443", None, "no_allow_match", 3));
    p.record(flow("[2001:db8:1:3::1]:443", None, "no_allow_match", 2));
    p.record(flow("[2001:db8:1:ff::9]:443", None, "no_allow_match", 2));
    assert_eq!(
        rules(&p),
        [
            r#"{"cidr":"198.51.100.0/24"}"#,
            r#"{"cidr":"2001:db8:1::/48"}"#,
            r#"{"ip":"198.51.100.200"}"#,
            r#"{"ip":"198.51.100.7"}"#,
            r#"{"ip":"198.51.100.8"}"#,
            r#"{"ip":"2001:db8:1:2::1"}"#,
            r#"{"ip":"2001:db8:1:3::1"}"#,
            r#"{"ip":"2001:db8:1:ff::9"}"#,
            r#"{"ip":"203.0.113.1"}"#,
        ]
    );
    // A mapped or NAT64 address is its IPv4 address.
    p.record(flow("[::ffff:203.0.113.1]:443", None, "no_allow_match", 4));
    assert_eq!(rules(&p).len(), 9);
    for (i, a) in ["[64:ff9b::cb00:7102]:443", "[64:ff9b::cb00:7103]:443"]
        .iter()
        .enumerate()
    {
        p.record(flow(a, None, "no_allow_match", 5 + i as u64));
    }
    let now = rules(&p);
    assert!(
        now.contains(&r#"{"cidr":"203.0.113.0/24"}"#.to_owned()),
        "{now:?}"
    );
    assert!(
        now.contains(&r#"{"ip":"203.0.113.2"}"#.to_owned()),
        "{now:?}"
    );
    assert!(!now.iter().any(|r| r.contains("64:ff9b")), "{now:?}");
}

#[test]
fn a_network_over_a_platform_deny_is_not_proposed() {
    let platform = PlatformDenies::new(vec![Destination::Ip("198.51.100.1".parse().expect("ip"))]);
    let mut p = Proposals::default();
    for a in ["198.51.100.7:1", "198.51.100.8:1", "198.51.100.9:1"] {
        p.record(flow(a, None, "no_allow_match", 0));
    }
    let list = p.list(&platform);
    assert_eq!(list.len(), 3);
    assert!(list.iter().all(|p| p.rule.dest.kind() == crate::Kind::Ip));
}

fn request(host: &str, method: &str, path: &str, level: Option<Destination>) -> Denial {
    Denial {
        host: Some(name(host)),
        request: Some(DeniedRequest {
            method: method.into(),
            path: path.into(),
            level,
        }),
        ..flow("198.51.100.7:443", Some(host), "http_not_allowed", 0)
    }
}

#[test]
fn a_refused_request_proposes_its_method_and_path_at_the_deciding_level() {
    let mut p = Proposals::default();
    p.record(request("api.x.test", "POST", "/v1/x", None));
    p.record(request("api.x.test", "POST", "/v1/x", None));
    let level = Destination::WildcardDomain(WildcardDomain::parse("*.y.test").expect("w"));
    p.record(request("a.y.test", "DELETE", "/r/1", Some(level)));
    // A path that as a pattern covers more than itself proposes nothing:
    // `/` (every path), a `*` segment (any segment), a `*` inside one.
    // Nor one past 256 bytes or 32 segments (32 are proposed).
    let long = format!("/{}", "a".repeat(256));
    let deep = "/a".repeat(33);
    let mut other = Proposals::default();
    assert!(other.record(request("api.x.test", "PUT", &"/b".repeat(32), None)));
    let trailing = format!("{}/", "/c".repeat(32));
    assert!(other.record(request("api.x.test", "PUT", &trailing, None)));
    for path in ["/", "", "/*", "/v1/*/x", "/a*b", &long, &deep] {
        assert!(
            !p.record(request("api.x.test", "PUT", path, None)),
            "{path:?}"
        );
    }
    assert_eq!(
        rules(&p),
        [
            r#"{"domain":"api.x.test","http":{"methods":["POST"],"paths":["/v1/x"]}}"#,
            r#"{"wildcard_domain":"*.y.test","http":{"methods":["DELETE"],"paths":["/r/1"]}}"#,
        ]
    );
    let list = p.list(&PlatformDenies::builtin());
    let post = list.iter().find(|p| p.rule.http.is_some() && p.count == 2);
    assert!(post.is_some());
    // A request denied by its flow reason proposes the name, unqualified.
    let mut d = request("other.x.test", "GET", "/", None);
    d.reason = "no_allow_match";
    assert_eq!(key_of(&d), Some(Key::Name(name("other.x.test"))));
    // Requests are never merged into wildcards.
    for h in ["a.z.test", "b.z.test", "c.z.test"] {
        assert!(p.record(request(h, "POST", "/up", None)));
    }
    assert!(!rules(&p).iter().any(|r| r.contains("*.z.test")));
}

#[test]
fn entries_are_bounded_least_recently_seen_first_out() {
    let mut p = Proposals::default();
    for i in 0..MAX_SEEN as u64 {
        let host = format!("h{i}.n{i}.test");
        p.record(flow("198.51.100.7:443", Some(&host), "no_allow_match", i));
    }
    // Seen again: now the most recent.
    p.record(flow(
        "198.51.100.7:443",
        Some("h0.n0.test"),
        "no_allow_match",
        10_000,
    ));
    p.record(flow(
        "198.51.100.7:443",
        Some("new.test"),
        "no_allow_match",
        10_001,
    ));
    assert_eq!(p.len(), MAX_SEEN);
    let names: BTreeSet<String> = p
        .list(&PlatformDenies::builtin())
        .iter()
        .map(|p| p.rule.dest.value())
        .collect();
    assert!(names.contains("h0.n0.test"));
    assert!(names.contains("new.test"));
    assert!(
        !names.contains("h1.n1.test"),
        "the least recently seen went"
    );
}

#[test]
fn an_expired_or_evicted_address_without_a_name_proposes_nothing() {
    let mut p = Proposals::default();
    for reason in ["expired", "evicted"] {
        assert!(
            !p.record(flow("198.51.100.7:22", None, reason, 0)),
            "{reason}"
        );
    }
    // Never resolved through the gateway: the address is what there is.
    assert!(p.record(flow("198.51.100.7:22", None, "no_dns_seen", 0)));
    assert_eq!(rules(&p), [r#"{"ip":"198.51.100.7"}"#]);
}

/// What was denied only for an attribution gap, though an allow already
/// covers it, is left out before names merge: no wildcard is built from
/// three names the policy has, and a name a qualified entry allows is not
/// proposed whole (approving it would lift the qualifier). A name denied for
/// want of an allow is still proposed.
#[test]
fn what_an_allow_already_covers_is_left_out_before_merging() {
    let allow: Vec<Rule> = crate::Policy::from_json(
        r#"{"allow": [{"domain": "a.example.test"}, {"domain": "b.example.test"},
            {"wildcard_domain": "*.c.example.test"},
            {"domain": "api.example.test", "http": "read_only"},
            {"cidr": "198.51.100.0/24"}]}"#,
    )
    .expect("policy")
    .allow;
    let mut p = Proposals::default();
    for n in [
        "a.example.test",
        "b.example.test",
        "x.c.example.test",
        "api.example.test",
    ] {
        p.record(flow("203.0.113.7:443", Some(n), "no_dns_seen", 0));
    }
    p.record(flow("198.51.100.9:443", None, "no_dns_seen", 0));
    p.record(flow(
        "203.0.113.8:443",
        Some("d.example.test"),
        "no_allow_match",
        1,
    ));
    let listed: Vec<String> = p
        .list_except(&PlatformDenies::builtin(), &allow)
        .iter()
        .map(|p| serde_json::to_string(&p.rule).expect("json"))
        .collect();
    assert_eq!(listed, [r#"{"domain":"d.example.test"}"#]);
    // Without the allow list, the merged wildcard is there.
    assert!(rules(&p).contains(&r#"{"wildcard_domain":"*.example.test"}"#.to_owned()));
}
