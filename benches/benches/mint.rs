//! Leaf certificates: a cold mint (a name never seen) against a cache hit.
//!
//! `cargo bench -p egress-benches --bench mint`

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion};
use egress_certs::{CertificateAuthority, LeafMinter, LeafName, MintConfig};
use egress_policy::Hostname;

fn bench_mint(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = Arc::new(CertificateAuthority::create(dir.path()).expect("CA"));
    let minter = LeafMinter::new(ca, MintConfig::default()).expect("minter");
    let mut group = c.benchmark_group("leaf");

    let mut i = 0u64;
    group.bench_function("cold_mint", |b| {
        b.iter_batched(
            || {
                i += 1;
                LeafName::Dns(Hostname::parse(&format!("n{i}.cold.example.test")).expect("valid"))
            },
            |name| minter.leaf(black_box(&name)).expect("minted"),
            criterion::BatchSize::SmallInput,
        )
    });

    let hot = LeafName::Dns(Hostname::parse("hot.example.test").expect("valid"));
    minter.leaf(&hot).expect("minted");
    group.bench_function("cache_hit", |b| {
        b.iter(|| minter.leaf(black_box(&hot)).expect("cached"))
    });
    group.finish();
}

criterion_group!(benches, bench_mint);
criterion_main!(benches);
