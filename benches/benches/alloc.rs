//! Heap allocations on the cached path of one flow: classify the ClientHello,
//! look up the attribution, decide. Counted with dhat; run with
//! `cargo bench -p egress-benches --bench alloc`. Prints allocations per flow
//! for each step, so a regression on the hot path shows as a number.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use dns_attrib::{Attribution, AttributionCache, CacheConfig, SystemClock};
use egress_gateway::peek::classify_bytes;
use egress_gateway::peek::fixture::{hello, records};
use egress_policy::SandboxId;
use egress_policy::{CompiledPolicy, Flow, Hostname, PlatformDenies, Policy, Protocol};

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

const FLOWS: u64 = 10_000;

fn count(label: &str, mut f: impl FnMut()) {
    f(); // warm: first-use allocations are not per flow
    let before = dhat::HeapStats::get();
    for _ in 0..FLOWS {
        f();
    }
    let after = dhat::HeapStats::get();
    let blocks = after.total_blocks - before.total_blocks;
    let bytes = after.total_bytes - before.total_bytes;
    println!(
        "{label:<28} {:>6.2} allocations/flow {:>8.1} bytes/flow",
        blocks as f64 / FLOWS as f64,
        bytes as f64 / FLOWS as f64
    );
}

fn main() {
    // `cargo test --benches` runs this once too; keep it quick and honest.
    let _profiler = dhat::Profiler::builder().testing().build();
    let hello_bytes = records(
        &hello(Some("api.example.test"), &["h2", "http/1.1"], 0, false),
        16_384,
    );
    let policy = Policy::from_json(
        r#"{"allow": [{"domain": "api.example.test"}], "tls_interception": "on",
            "tls_interception_exemptions": [{"wildcard_domain": "*.relay.example.test"}]}"#,
    )
    .expect("policy");
    let compiled = CompiledPolicy::new(policy, Arc::new(PlatformDenies::builtin()));
    let cache = AttributionCache::new(CacheConfig::default(), SystemClock::new());
    let sandbox = SandboxId::new("bench");
    let ip: IpAddr = "203.0.113.7".parse().expect("ip");
    let api = Hostname::parse("api.example.test").expect("name");
    cache.record(
        &sandbox,
        &Attribution {
            names: vec![api.clone()],
            addrs: vec![ip],
            ttl: 300,
        },
    );
    let dst = SocketAddr::new(ip, 443);

    println!("heap allocations on the cached path ({FLOWS} flows each):");
    count("classify ClientHello", || {
        let _ = std::hint::black_box(classify_bytes(&hello_bytes));
    });
    count("attribution lookup (hit)", || {
        let l = cache.names_for(&sandbox, ip);
        std::hint::black_box(l.names().len());
    });
    let names = [api.clone()];
    count("decide", || {
        let v = compiled.decide(&Flow {
            dst,
            protocol: Protocol::Tls,
            sni: Some(&api),
            host: None,
            attributed: &names,
            attribution_gap: egress_policy::AttributionGap::NoDnsSeen,
            encrypted_dns: None,
            ech: false,
        });
        std::hint::black_box(v);
    });
    count("SNI validation", || {
        let _ = std::hint::black_box(Hostname::parse("api.example.test"));
    });
}
