//! DNS attribution: cache insert and lookup, and the proxy's round trip and
//! throughput against a loopback upstream, side by side with asking the
//! upstream directly.
//!
//! `cargo bench -p egress-benches --bench dns`

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use dns_attrib::{
    Admit, Attribution, AttributionCache, BudgetLimits, CacheConfig, DnsProxy, ProxyConfig,
    QueryAdmission, SystemClock, Transport,
};
use egress_policy::{CompiledPolicy, Hostname, PlatformDenies, Policy, SandboxId};
use tokio::net::UdpSocket;

fn attribution(i: u32) -> Attribution {
    Attribution {
        names: vec![Hostname::parse(&format!("n{i}.bench.test")).expect("valid")],
        addrs: vec![IpAddr::V4(Ipv4Addr::from(0xcb00_7100 + (i % 100_000)))],
        ttl: 300,
    }
}

fn bench_cache(c: &mut Criterion) {
    let cache = AttributionCache::new(CacheConfig::default(), SystemClock::new());
    let sb = SandboxId::new("bench");
    for i in 0..10_000 {
        cache.record(&sb, &attribution(i));
    }
    let mut g = c.benchmark_group("attribution");
    let mut i = 0u32;
    g.bench_function("insert", |b| {
        b.iter(|| {
            i = i.wrapping_add(1);
            cache.record(&sb, black_box(&attribution(i % 50_000)))
        })
    });
    let hit = IpAddr::V4(Ipv4Addr::from(0xcb00_7100 + 42));
    g.bench_function("lookup_hit", |b| {
        b.iter(|| cache.names_for(&sb, black_box(hit)).names().len())
    });
    let miss = IpAddr::V4(Ipv4Addr::new(198, 51, 100, 1));
    g.bench_function("lookup_miss", |b| {
        b.iter(|| cache.names_for(&sb, black_box(miss)).gap())
    });
    g.finish();
}

/// Answers every query with one A record, by hand on the wire format, so the
/// upstream costs as little as possible and the proxy is what is measured.
async fn upstream() -> SocketAddr {
    let s = UdpSocket::bind("127.0.0.1:0").await.expect("bind");
    let addr = s.local_addr().expect("addr");
    tokio::spawn(async move {
        let mut buf = vec![0u8; 4096];
        while let Ok((n, src)) = s.recv_from(&mut buf).await {
            let mut r = buf[..n].to_vec();
            r[2] |= 0x80; // QR
            r[3] = 0x80; // RA, NOERROR
            r[7] = 1; // ANCOUNT = 1
            r.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 1, 44, 0, 4, 203, 0, 113, 7]);
            let _ = s.send_to(&r, src).await;
        }
    });
    addr
}

fn query(id: u16, name: &str) -> Vec<u8> {
    let mut q = vec![
        (id >> 8) as u8,
        id as u8,
        0x01,
        0x00,
        0,
        1,
        0,
        0,
        0,
        0,
        0,
        0,
    ];
    for label in name.split('.') {
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.extend_from_slice(&[0, 0, 1, 0, 1]);
    q
}

/// Admits every source as one sandbox whose policy has no `dns` section.
struct Everyone(Arc<CompiledPolicy>);

impl QueryAdmission for Everyone {
    fn admit(&self, _src: IpAddr, _resolver: SocketAddr) -> Admit {
        Admit::Allowed(SandboxId::new("bench"), self.0.clone())
    }

    fn holds(&self, _src: IpAddr, _sandbox: &SandboxId, _registration: u64) -> bool {
        true
    }

    fn registered(&self, _sandbox: &SandboxId, _registration: u64) -> bool {
        true
    }
}

/// Sends `n` queries, `window` outstanding at a time, and waits for every answer.
async fn burst(client: &UdpSocket, target: SocketAddr, n: u16, window: u16) {
    let mut buf = [0u8; 512];
    let mut sent = 0u16;
    let mut received = 0u16;
    while received < n {
        while sent < n && sent - received < window {
            client
                .send_to(&query(sent, "api.bench.test"), target)
                .await
                .expect("send");
            sent += 1;
        }
        tokio::time::timeout(Duration::from_secs(2), client.recv_from(&mut buf))
            .await
            .expect("answer within 2 s")
            .expect("recv");
        received += 1;
    }
}

fn bench_proxy(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let (up, proxy_addr, proxy) = rt.block_on(async {
        let up = upstream().await;
        let config = ProxyConfig {
            upstreams: vec![up],
            // Budgets on, as in production, but out of reach: the bench
            // measures what checking them costs, not their refusals.
            budget: BudgetLimits {
                qps: 1_000_000,
                new_names_per_minute: 1_000_000,
            },
            ..ProxyConfig::default()
        };
        let cache = Arc::new(AttributionCache::new(
            CacheConfig::default(),
            SystemClock::new(),
        ));
        let proxy = DnsProxy::new(
            config,
            cache,
            Arc::new(Everyone(Arc::new(CompiledPolicy::new(
                Policy::default(),
                Arc::new(PlatformDenies::builtin()),
            )))),
        );
        let sock = UdpSocket::bind("127.0.0.1:0").await.expect("bind");
        let addr = sock.local_addr().expect("addr");
        tokio::spawn(
            proxy
                .clone()
                .serve_udp(sock, "8.8.8.8:53".parse().expect("addr")),
        );
        (up, addr, proxy)
    });
    let client = rt.block_on(UdpSocket::bind("127.0.0.1:0")).expect("bind");

    let mut g = c.benchmark_group("dns_round_trip");
    g.bench_function("direct", |b| {
        b.iter(|| rt.block_on(burst(&client, up, 1, 1)))
    });
    g.bench_function("through_proxy", |b| {
        b.iter(|| rt.block_on(burst(&client, proxy_addr, 1, 1)))
    });
    let raw = query(7, "api.bench.test");
    g.bench_function("proxy_answer_in_process", |b| {
        b.iter(|| {
            rt.block_on(proxy.answer(
                black_box(&raw),
                IpAddr::V4(Ipv4Addr::LOCALHOST),
                "8.8.8.8:53".parse().expect("addr"),
                Transport::Udp,
            ))
        })
    });
    g.finish();

    let mut g = c.benchmark_group("dns_throughput");
    g.throughput(Throughput::Elements(256));
    g.bench_function("direct", |b| {
        b.iter(|| rt.block_on(burst(&client, up, 256, 32)))
    });
    g.bench_function("through_proxy", |b| {
        b.iter(|| rt.block_on(burst(&client, proxy_addr, 256, 32)))
    });
    g.finish();
}

criterion_group!(benches, bench_cache, bench_proxy);
criterion_main!(benches);
