//! Decision time for a policy of 10 rules against one of 10,000 CIDRs plus
//! 10,000 domains (and the built-in platform denies in both): the matcher
//! must not scan rules, so the two should cost about the same.
//!
//! `cargo bench -p egress-benches --bench decide`

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use egress_policy::{
    AttributionGap, CompiledPolicy, DefaultAction, Destination, Flow, Hostname, Kind,
    PlatformDenies, Policy, Protocol, TlsInterception,
};

/// xorshift64: deterministic rule sets without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// `n` CIDRs and `n` domains (a tenth of them wildcards), plus the rules the
/// benchmark flows hit, so both sizes decide the same flows the same way.
fn policy(n: usize) -> Policy {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut allow = vec![
        Destination::parse(Kind::Cidr, "203.0.113.0/24").expect("valid"),
        Destination::parse(Kind::Domain, "api.example.test").expect("valid"),
        Destination::parse(Kind::WildcardDomain, "*.relay.example.test").expect("valid"),
    ];
    for i in 0..n.saturating_sub(2) {
        let len = 8 + (rng.next() % 25) as u8;
        // Public-looking space away from the flows' addresses.
        let addr = Ipv4Addr::from((rng.next() as u32 & 0x3fff_ffff) | 0x4000_0000);
        let net = ipnet::Ipv4Net::new(addr, len).expect("len <= 32").trunc();
        allow.push(Destination::Cidr(net.into()));
        let name = format!(
            "svc-{i}-{}.tenant{}.example",
            rng.next() % 1000,
            rng.next() % 97
        );
        let kind = if i % 10 == 0 {
            Kind::WildcardDomain
        } else {
            Kind::Domain
        };
        let text = if kind == Kind::WildcardDomain {
            format!("*.{name}")
        } else {
            name
        };
        allow.push(Destination::parse(kind, &text).expect("valid"));
    }
    Policy {
        default: DefaultAction::Deny,
        allow: allow.into_iter().map(Into::into).collect(),
        deny: vec![Destination::parse(Kind::Domain, "bad.example.test")
            .expect("valid")
            .into()],
        tls_interception: TlsInterception::On,
        tls_interception_exemptions: vec![Destination::parse(
            Kind::WildcardDomain,
            "*.relay.example.test",
        )
        .expect("valid")],
        dns: None,
        budgets: Default::default(),
    }
}

struct Case {
    name: &'static str,
    dst: SocketAddr,
    protocol: Protocol,
    sni: Option<Hostname>,
    attributed: Vec<Hostname>,
}

fn cases() -> Vec<Case> {
    let h = |s: &str| Hostname::parse(s).expect("valid");
    let ip = |s: &str| SocketAddr::new(s.parse::<IpAddr>().expect("valid"), 443);
    vec![
        Case {
            name: "cidr_allow",
            dst: ip("203.0.113.7"),
            protocol: Protocol::Tls,
            sni: None,
            attributed: vec![],
        },
        Case {
            name: "attributed_domain_intercept",
            dst: ip("198.51.100.7"),
            protocol: Protocol::Tls,
            sni: Some(h("api.example.test")),
            attributed: vec![h("api.example.test")],
        },
        Case {
            name: "wildcard_exempt_splice",
            dst: ip("198.51.100.8"),
            protocol: Protocol::Tls,
            sni: Some(h("a.b.relay.example.test")),
            attributed: vec![h("a.b.relay.example.test")],
        },
        Case {
            name: "no_match_deny",
            dst: ip("198.51.100.9"),
            protocol: Protocol::Tls,
            sni: Some(h("www.unknown-site.test")),
            attributed: vec![h("www.unknown-site.test")],
        },
    ]
}

fn bench_decide(c: &mut Criterion) {
    let platform = Arc::new(PlatformDenies::builtin());
    let sizes = [10usize, 10_000];
    let compiled: Vec<(usize, CompiledPolicy)> = sizes
        .iter()
        .map(|&n| (n, CompiledPolicy::new(policy(n), platform.clone())))
        .collect();
    let mut group = c.benchmark_group("decide");
    for case in cases() {
        let mut verdicts = Vec::new();
        for (n, p) in &compiled {
            let flow = Flow {
                dst: case.dst,
                protocol: case.protocol,
                sni: case.sni.as_ref(),
                host: None,
                attributed: &case.attributed,
                attribution_gap: AttributionGap::NoDnsSeen,
                encrypted_dns: None,
                ech: false,
            };
            verdicts.push(p.decide(&flow).code());
            group.bench_with_input(
                BenchmarkId::new(case.name, format!("{n}_rules")),
                &flow,
                |b, f| b.iter(|| p.decide(black_box(f))),
            );
        }
        // Both sizes must decide the same way, or the comparison means nothing.
        assert!(
            verdicts.windows(2).all(|w| w[0] == w[1]),
            "{}: {verdicts:?}",
            case.name
        );
    }
    group.finish();
}

/// A host with 100 path rules (50 qualified allows, 50 qualified denies),
/// and the per-request check of requests that match early, late and never.
/// With `shared`, every pattern starts with the same segment (`/api/v{i}/…`),
/// so the first-segment index narrows nothing and all 100 are checked.
fn request_policy(shared: bool) -> CompiledPolicy {
    let mut allow = Vec::new();
    let mut deny = Vec::new();
    let root = if shared { "/api" } else { "" };
    for i in 0..50 {
        allow.push(serde_json::json!({"domain": "api.example.test",
            "http": {"methods": ["GET", "HEAD"], "paths": [format!("{root}/v{i}/repos/*/issues")]}}));
        deny.push(serde_json::json!({"domain": "api.example.test",
            "http": {"methods": ["POST"], "paths": [format!("{root}/v{i}/admin/*/keys")]}}));
    }
    let doc = serde_json::json!({"allow": allow, "deny": deny, "tls_interception": "on"});
    let policy = Policy::from_json(&doc.to_string()).expect("valid");
    CompiledPolicy::new(policy, Arc::new(PlatformDenies::builtin()))
}

fn bench_request(c: &mut Criterion) {
    let p = request_policy(false);
    let shared = request_policy(true);
    let plain = CompiledPolicy::new(
        Policy::from_json(
            r#"{"allow": [{"domain": "api.example.test"}], "tls_interception": "on"}"#,
        )
        .expect("valid"),
        Arc::new(PlatformDenies::builtin()),
    );
    let host = Hostname::parse("api.example.test").expect("valid");
    let names = [&host];
    let cases = [
        ("match_first", "GET", "/v0/repos/a/issues/7"),
        ("match_last", "GET", "/v49/repos/a%2Db/issues?state=open"),
        ("deny_last", "POST", "/v49/admin/x/keys"),
        ("no_match", "GET", "/elsewhere/a/b/c/d"),
    ];
    let mut group = c.benchmark_group("request_100_path_rules");
    for (name, method, target) in cases {
        let judged = p.judge_request(&names, method, target);
        let expect_deny = name != "match_first" && name != "match_last";
        assert_eq!(judged.deny.is_some(), expect_deny, "{name}: {judged:?}");
        group.bench_function(name, |b| {
            b.iter(|| p.judge_request(black_box(&names), black_box(method), black_box(target)))
        });
    }
    for (name, method, target) in [
        (
            "shared_first_segment_match_last",
            "GET",
            "/api/v49/repos/a/issues/7",
        ),
        ("shared_first_segment_no_match", "GET", "/api/elsewhere/a/b"),
    ] {
        let judged = shared.judge_request(&names, method, target);
        assert_eq!(
            judged.deny.is_some(),
            name.ends_with("no_match"),
            "{name}: {judged:?}"
        );
        group.bench_function(name, |b| {
            b.iter(|| shared.judge_request(black_box(&names), black_box(method), black_box(target)))
        });
    }
    // The same request under a policy without qualifiers: what every
    // request pays when no rule needs it.
    group.bench_function("no_qualifiers", |b| {
        b.iter(|| plain.judge_request(black_box(&names), "POST", black_box("/v49/admin/x/keys")))
    });
    group.finish();
}

criterion_group!(benches, bench_decide, bench_request);
criterion_main!(benches);
