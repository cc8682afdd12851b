//! ClientHello classification: a small hello in one record, a post-quantum-
//! sized (~2 KB) one, and the same split over many small records.
//!
//! `cargo bench -p egress-benches --bench peek`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use egress_gateway::peek::classify_bytes;
use egress_gateway::peek::fixture::{hello, records};

fn bench_peek(c: &mut Criterion) {
    let small = records(
        &hello(Some("api.example.test"), &["h2", "http/1.1"], 0, false),
        16_384,
    );
    let pq = records(
        &hello(Some("api.example.test"), &["h2", "http/1.1"], 1_800, false),
        16_384,
    );
    let fragmented = records(
        &hello(Some("api.example.test"), &["h2", "http/1.1"], 1_800, false),
        100,
    );
    let http = b"GET /index.html HTTP/1.1\r\nHost: api.example.test\r\nUser-Agent: bench\r\nAccept: */*\r\n\r\n".to_vec();
    let mut g = c.benchmark_group("classify");
    for (name, bytes) in [
        ("small_hello", &small),
        ("pq_size_hello", &pq),
        ("fragmented_hello", &fragmented),
        ("http_head", &http),
    ] {
        assert!(
            matches!(classify_bytes(bytes), Ok(Some(_))),
            "{name} classifies"
        );
        g.bench_function(name, |b| b.iter(|| classify_bytes(black_box(bytes))));
    }
    g.finish();
}

criterion_group!(benches, bench_peek);
criterion_main!(benches);
