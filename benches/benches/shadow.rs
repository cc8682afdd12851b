//! The cost of a shadow on one flow's decision: the same flow decided as
//! the dataplane decides it (the attribution lookup, the active policy's
//! judgement) with no shadow, and with a shadow set (the candidate's
//! judgement, the report and the counter too), side by side in one run.
//! Two flows: one both policies decide alike (the common case: nothing is
//! noted) and one they decide differently (noted in the report every time).
//!
//! `cargo bench -p egress-benches --bench shadow`

use std::hint::black_box;
use std::net::SocketAddr;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion};
use dns_attrib::{Attribution, AttributionCache, CacheConfig, ManualClock};
use egress_gateway::decide::Claims;
use egress_gateway::shadow::bench::FlowBench;
use egress_policy::{CompiledPolicy, Hostname, PlatformDenies, Policy, Protocol, SandboxId};

const ACTIVE: &str = include_str!("../replay/sample-policy.json");

fn compiled(text: &str) -> Arc<CompiledPolicy> {
    let policy = Policy::from_json(text).expect("the sample policy");
    Arc::new(CompiledPolicy::new(
        policy,
        Arc::new(PlatformDenies::builtin()),
    ))
}

/// The sample policy, with one more name open.
fn candidate() -> Arc<CompiledPolicy> {
    let mut v: serde_json::Value = serde_json::from_str(ACTIVE).expect("json");
    if let Some(allow) = v["allow"].as_array_mut() {
        allow.push(serde_json::json!({"domain": "unknown.example.test"}));
    }
    compiled(&v.to_string())
}

fn bench(c: &mut Criterion) {
    let active = compiled(ACTIVE);
    let id = SandboxId::new("sb1");
    let cache = AttributionCache::new(CacheConfig::default(), ManualClock::new());
    let api: Hostname = "api.example.test".parse().expect("name");
    let unknown: Hostname = "unknown.example.test".parse().expect("name");
    let api_dst: SocketAddr = "203.0.113.41:443".parse().expect("addr");
    let unknown_dst: SocketAddr = "203.0.113.99:443".parse().expect("addr");
    cache.record(
        &id,
        &Attribution {
            names: vec![api.clone()],
            addrs: vec![api_dst.ip()],
            ttl: 3600,
        },
    );
    let flows = [("alike", api_dst, &api), ("differs", unknown_dst, &unknown)];
    let without = FlowBench::new(None);
    let with = FlowBench::new(Some(candidate()));
    for (name, dst, sni) in flows {
        let claims = Claims {
            dst,
            protocol: Protocol::Tls,
            sni: Some(sni),
            host: None,
            ech: false,
        };
        let mut g = c.benchmark_group(format!("shadow/{name}"));
        g.bench_function("none", |b| {
            b.iter(|| black_box(without.flow(&cache, &id, &active, black_box(&claims))));
        });
        g.bench_function("set", |b| {
            b.iter(|| black_box(with.flow(&cache, &id, &active, black_box(&claims))));
        });
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
