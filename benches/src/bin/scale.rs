//! `egress-scale`: the decision at fleet scale, in process, on the gateway's
//! own types: a [`Registry`] of S sandboxes (one address and a 21-rule
//! policy each) and one [`AttributionCache`] (on a manual clock) holding N
//! attributed names per sandbox, each recorded as the DNS proxy records an
//! answer. Side by side in one run, in interleaved rounds, it times what the
//! flow path does per connection — the registry lookup by source address,
//! then [`decide`] (attribution lookup + compiled policy) — for:
//!
//! - flows of the one sandbox of a small world (1 × 10 names by default);
//! - flows of one sandbox of the large world (S × N);
//! - flows spread over every sandbox of the large world, and, to tell the
//!   sandbox count from the name count, over every sandbox of a control
//!   world with as many sandboxes but the small world's names (S × 10).
//!
//! It reports what each build phase adds to the process's RSS (VmRSS, with
//! the gateway's allocator, mimalloc): the registry (policies compiled), the
//! first answer of every sandbox (each sandbox's cache made), the remaining
//! answers.
//!
//! Nothing goes on the network: destination addresses are in-memory keys
//! from the benchmarking block 198.18.0.0/15.
//!
//! `cargo build --release -p egress-benches --bin egress-scale &&
//!  target/release/egress-scale` (defaults: 10,000 × 1,000 against 1 × 10;
//!  about 7 GiB and 2 minutes with the moka-based cache)

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use dns_attrib::{Attribution, AttributionCache, CacheConfig, ManualClock};
use egress_gateway::decide::{decide, Claims};
use egress_gateway::doh::DohNames;
use egress_gateway::registry::Registry;
use egress_policy::{Hostname, PlatformDenies, Policy, Protocol, SandboxId, Verdict};

/// The gateway's allocator, so RSS reads as it would in the gateway.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
struct Args {
    /// Sandboxes in the large world (and the spread control world).
    #[arg(long, default_value_t = 10_000)]
    sandboxes: usize,
    /// Attributed names per sandbox in the large world.
    #[arg(long, default_value_t = 1_000)]
    names: usize,
    /// Attributed names of the small world's sandbox (and of the control world's).
    #[arg(long, default_value_t = 10)]
    small_names: usize,
    /// Interleaved measurement rounds.
    #[arg(long, default_value_t = 7)]
    rounds: usize,
    /// Flows timed per case per round.
    #[arg(long, default_value_t = 2_000_000)]
    decisions: usize,
    /// Distinct flows each case cycles through.
    #[arg(long, default_value_t = 1_024)]
    flows: usize,
    /// `max_sandboxes` of the large worlds' caches (0: the sandbox count).
    /// The gateway builds its cache with the default (4,096).
    #[arg(long, default_value_t = 0)]
    cache_sandboxes: usize,
    /// Skip the S × 10 control world.
    #[arg(long)]
    no_control: bool,
    /// Time only this case, `decisions × rounds` flows, and print nothing
    /// else (for `perf record`): small, one, spread, control.
    #[arg(long)]
    profile: Option<String>,
    /// Give up building after this many seconds.
    #[arg(long, default_value_t = 900)]
    build_limit: u64,
}

/// Which of the 10 services of its tenant a name belongs to; services 0–4
/// are allowed by a wildcard rule, 5–9 match nothing (default deny).
const SERVICES: usize = 10;
/// Seconds every attribution lives (the clock never moves: all stay live).
const TTL: u32 = 3_600;

fn tenant(i: usize) -> String {
    format!("tenant{i}.example.test")
}

/// Name `j` of sandbox `i`: `n<j>.svc<j % 10>.tenant<i>.example.test`.
fn name(i: usize, j: usize) -> Hostname {
    Hostname::parse(&format!("n{j}.svc{}.{}", j % SERVICES, tenant(i))).expect("valid name")
}

/// Every fifth answer is a CNAME chain to a CDN name, as real answers often are.
fn chain(i: usize, j: usize) -> Vec<Hostname> {
    let mut names = vec![name(i, j)];
    if j.is_multiple_of(5) {
        names.push(Hostname::parse(&format!("e{j}.t{i}.cdn.example.net")).expect("valid name"));
    }
    names
}

/// The address name `j` of sandbox `i` resolved to: one per name, from 198.18.0.0/15.
fn dst(i: usize, j: usize) -> IpAddr {
    let k = u32::try_from((i * 7_919 + j) % (1 << 17)).expect("17 bits");
    IpAddr::V4(Ipv4Addr::from(0xc612_0000 | k))
}

/// Sandbox `i`'s source address, from 100.64.0.0/10.
fn src(i: usize) -> IpAddr {
    let i = u32::try_from(i).expect("fits");
    IpAddr::V4(Ipv4Addr::from(0x6440_0000 + i))
}

/// 21 rules: five service wildcards, ten exact names, an API CIDR, the
/// reserved resolvers, and a wildcard deny.
fn policy(i: usize) -> Policy {
    let t = tenant(i);
    let mut allow: Vec<serde_json::Value> = (0..SERVICES / 2)
        .map(|k| serde_json::json!({"wildcard_domain": format!("*.svc{k}.{t}")}))
        .collect();
    allow.extend((0..10).map(|k| serde_json::json!({"domain": format!("api{k}.{t}")})));
    allow.push(serde_json::json!({"cidr": "203.0.113.0/24"}));
    allow.push(serde_json::json!({"ip": "8.8.8.8"}));
    allow.push(serde_json::json!({"ip": "1.1.1.1"}));
    let deny = serde_json::json!([{"wildcard_domain": format!("*.blocked.{t}")}]);
    let text = serde_json::json!({"default": "deny", "tls_interception": "on",
        "allow": allow, "deny": deny})
    .to_string();
    egress_policy::from_json(&text).expect("valid policy")
}

/// Resident set, KiB.
#[derive(Clone, Copy)]
struct Mem {
    rss: u64,
}

impl Mem {
    fn now() -> Self {
        let rss = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("VmRSS:"))
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|v| v.parse().ok())
            })
            .unwrap_or(0);
        Self { rss }
    }

    fn minus(self, before: Self) -> Self {
        Self {
            rss: self.rss.saturating_sub(before.rss),
        }
    }
}

/// What one build phase added.
struct Phase {
    what: String,
    added: Mem,
    /// What it is counted per, and how many.
    per: &'static str,
    count: usize,
}

/// One world: a registry and its attribution cache.
struct World {
    registry: Registry,
    cache: AttributionCache,
    sandboxes: usize,
    names: usize,
}

impl World {
    fn build(
        sandboxes: usize,
        names: usize,
        cache_sandboxes: usize,
        limit: Instant,
        phases: &mut Vec<Phase>,
    ) -> Self {
        let label = format!("{sandboxes} × {names}");
        let mut phases = Marks::new(phases);
        let registry = Registry::new(Arc::new(PlatformDenies::builtin()));
        let cache = AttributionCache::new(
            CacheConfig {
                max_sandboxes: cache_sandboxes,
                ..CacheConfig::default()
            },
            ManualClock::new(),
        );
        let ids = register(&registry, sandboxes);
        phases.mark(
            format!("{label}: registry (one address, 21 rules each)"),
            "sandbox",
            sandboxes,
        );
        for i in 0..sandboxes {
            record(&cache, &ids, i, 0);
        }
        cache.sync();
        phases.mark(
            format!("{label}: first answer of each sandbox (its cache made)"),
            "sandbox",
            sandboxes,
        );
        record_others(&cache, &ids, names, limit, &label);
        if names > 1 {
            phases.mark(
                format!("{label}: the other answers"),
                "name",
                sandboxes * (names - 1),
            );
        }
        Self {
            registry,
            cache,
            sandboxes,
            names,
        }
    }

    /// `n` flows: of sandbox `of` (`None`: a different sandbox per flow,
    /// spread over all), to names spread over its attributed ones.
    fn flows(&self, of: Option<usize>, n: usize) -> Vec<Flow> {
        // xorshift64: a fixed, scattered order.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            usize::try_from(x >> 33).expect("31 bits")
        };
        (0..n)
            .map(|k| {
                let i = of.unwrap_or_else(|| next() % self.sandboxes);
                // Every service equally often, whatever the name count.
                let j = if self.names <= SERVICES {
                    k % self.names
                } else {
                    next() % self.names
                };
                Flow {
                    src: src(i),
                    dst: SocketAddr::new(dst(i, j), 443),
                    sni: name(i, j),
                    allow: j % SERVICES < SERVICES / 2,
                }
            })
            .collect()
    }

    /// Checks every flow decides as its name says (an allowed service is
    /// intercepted, the others denied) and returns how many were allowed.
    fn check(&self, flows: &[Flow]) -> usize {
        let doh = DohNames::new(&[]);
        for f in flows {
            let sandbox = self.registry.lookup(f.src).expect("registered");
            let d = decide(&self.cache, &sandbox.id, &sandbox.policy, &f.claims(), &doh);
            let allowed = matches!(d.verdict, Verdict::Intercept(..));
            assert_eq!(
                allowed,
                f.allow,
                "{} → {}: {}",
                f.sni,
                f.dst,
                d.verdict.code()
            );
        }
        flows.iter().filter(|f| f.allow).count()
    }
}

/// Build phases as they end: each adds what RSS grew by since the last.
struct Marks<'a> {
    phases: &'a mut Vec<Phase>,
    mark: Mem,
}

impl<'a> Marks<'a> {
    fn new(phases: &'a mut Vec<Phase>) -> Self {
        Self {
            phases,
            mark: Mem::now(),
        }
    }

    fn mark(&mut self, what: String, per: &'static str, count: usize) {
        let now = Mem::now();
        self.phases.push(Phase {
            what,
            added: now.minus(self.mark),
            per,
            count,
        });
        self.mark = now;
    }
}

/// Registers `sandboxes` sandboxes, one address and policy each: their ids.
fn register(registry: &Registry, sandboxes: usize) -> Vec<SandboxId> {
    let ids: Vec<SandboxId> = (0..sandboxes)
        .map(|i| SandboxId::new(&format!("sb-{i}")))
        .collect();
    for (i, id) in ids.iter().enumerate() {
        registry
            .put(id.clone(), vec![src(i)], policy(i))
            .expect("distinct addresses");
    }
    ids
}

/// Records answer `j` of sandbox `i` as the DNS proxy does.
fn record(cache: &AttributionCache, ids: &[SandboxId], i: usize, j: usize) {
    let a = Attribution {
        names: chain(i, j),
        addrs: vec![dst(i, j)],
        ttl: TTL,
    };
    assert!(cache.record(&ids[i], &a), "the cache refused sandbox {i}");
}

/// Records every answer but the first of each sandbox, by `limit`, with
/// progress on stderr for large worlds.
fn record_others(
    cache: &AttributionCache,
    ids: &[SandboxId],
    names: usize,
    limit: Instant,
    label: &str,
) {
    let sandboxes = ids.len();
    let started = Instant::now();
    for i in 0..sandboxes {
        for j in 1..names {
            record(cache, ids, i, j);
        }
        if i % 500 == 499 {
            assert!(Instant::now() < limit, "building took too long");
            if sandboxes >= 1_000 {
                eprint!("\r  {label}: {} sandboxes", i + 1);
            }
        }
    }
    cache.sync();
    if sandboxes >= 1_000 {
        eprintln!(
            " ({:.2} µs per answer)",
            started.elapsed().as_secs_f64() * 1e6 / (sandboxes * names.max(2)) as f64
        );
    }
}

struct Flow {
    src: IpAddr,
    dst: SocketAddr,
    sni: Hostname,
    allow: bool,
}

impl Flow {
    fn claims(&self) -> Claims<'_> {
        Claims {
            dst: self.dst,
            protocol: Protocol::Tls,
            sni: Some(&self.sni),
            host: None,
            ech: false,
        }
    }
}

/// Nanoseconds per flow over `decisions` flows cycling through `flows`:
/// the registry lookup by source, then the decision.
fn time_flows(world: &World, flows: &[Flow], decisions: usize) -> f64 {
    let doh = DohNames::new(&[]);
    let started = Instant::now();
    for k in 0..decisions {
        let f = &flows[k % flows.len()];
        let sandbox = world.registry.lookup(black_box(f.src)).expect("registered");
        let d = decide(
            &world.cache,
            &sandbox.id,
            &sandbox.policy,
            &black_box(f.claims()),
            &doh,
        );
        black_box(d);
    }
    started.elapsed().as_nanos() as f64 / decisions as f64
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// One timed case.
struct Case<'a> {
    name: String,
    world: &'a World,
    flows: Vec<Flow>,
    times: Vec<f64>,
}

fn main() {
    let args = Args::parse();
    let built = Built::new(&args);
    let mut cases = cases(&args, &built);
    let allowed: Vec<usize> = cases.iter().map(|c| c.world.check(&c.flows)).collect();

    if let Some(which) = &args.profile {
        profile(&args, &cases, which);
        return;
    }

    let medians = run_rounds(&args, &mut cases);
    report_times(&args, &cases, &medians, &allowed);
    report_memory(&args, &built, &cases, &medians);
}

/// `max_sandboxes` of the large worlds' caches.
fn cache_sandboxes(args: &Args) -> usize {
    if args.cache_sandboxes == 0 {
        args.sandboxes
    } else {
        args.cache_sandboxes
    }
}

/// The worlds, and what building them took.
struct Built {
    small: World,
    large: World,
    control: Option<World>,
    phases: Vec<Phase>,
    /// At process start, and after the large world.
    start: Mem,
    after_large: Mem,
    /// Seconds the large world took.
    build_s: f64,
}

impl Built {
    fn new(args: &Args) -> Self {
        let limit = Instant::now() + Duration::from_secs(args.build_limit);
        let default_max = CacheConfig::default().max_sandboxes;
        let cache_sandboxes = cache_sandboxes(args);
        let start = Mem::now();
        let mut phases = Vec::new();
        let small = World::build(1, args.small_names, default_max, limit, &mut phases);
        let built = Instant::now();
        let large = World::build(
            args.sandboxes,
            args.names,
            cache_sandboxes,
            limit,
            &mut phases,
        );
        let build_s = built.elapsed().as_secs_f64();
        let after_large = Mem::now();
        let control = (!args.no_control).then(|| {
            World::build(
                args.sandboxes,
                args.small_names,
                cache_sandboxes,
                limit,
                &mut phases,
            )
        });
        Self {
            small,
            large,
            control,
            phases,
            start,
            after_large,
            build_s,
        }
    }
}

/// The cases, in order: small, one, spread, control (if built).
fn cases<'a>(args: &Args, built: &'a Built) -> Vec<Case<'a>> {
    let (small, large) = (&built.small, &built.large);
    let s = args.sandboxes;
    let mut cases = vec![
        Case {
            name: format!("1 sandbox × {} names", args.small_names),
            world: small,
            flows: small.flows(Some(0), args.flows),
            times: Vec::new(),
        },
        Case {
            name: format!("one sandbox of {s} × {}", args.names),
            world: large,
            flows: large.flows(Some(s / 2), args.flows),
            times: Vec::new(),
        },
        Case {
            name: format!("spread over {s} × {}", args.names),
            world: large,
            flows: large.flows(None, args.flows),
            times: Vec::new(),
        },
    ];
    if let Some(c) = &built.control {
        cases.push(Case {
            name: format!("spread over {s} × {} (control)", args.small_names),
            world: c,
            flows: c.flows(None, args.flows),
            times: Vec::new(),
        });
    }
    cases
}

/// `--profile`: times the one case, `decisions × rounds` flows.
fn profile(args: &Args, cases: &[Case<'_>], which: &str) {
    let at = ["small", "one", "spread", "control"]
        .iter()
        .position(|w| *w == which)
        .filter(|&i| i < cases.len())
        .expect("--profile: small, one, spread or control");
    let c = &cases[at];
    let ns = time_flows(c.world, &c.flows, args.decisions * args.rounds);
    eprintln!("{}: {ns:.0} ns per flow", c.name);
}

/// Warm-up, then interleaved rounds (the order rotated each round): the
/// median of each case.
fn run_rounds(args: &Args, cases: &mut [Case<'_>]) -> Vec<f64> {
    for c in cases.iter() {
        time_flows(c.world, &c.flows, args.decisions / 10);
    }
    let n = cases.len();
    for r in 0..args.rounds {
        for k in 0..n {
            let c = &mut cases[(r + k) % n];
            let t = time_flows(c.world, &c.flows, args.decisions);
            c.times.push(t);
        }
    }
    cases.iter_mut().map(|c| median(&mut c.times)).collect()
}

/// The header and the table of times per case.
fn report_times(args: &Args, cases: &[Case<'_>], medians: &[f64], allowed: &[usize]) {
    let s = args.sandboxes;
    let default_max = CacheConfig::default().max_sandboxes;
    println!(
        "egress-scale: {} interleaved rounds × {} flows per case, cycling {} distinct flows \
         (TLS, SNI = the attributed name); per flow: registry lookup by source + decide \
         (attribution lookup and compiled policy); one thread",
        args.rounds, args.decisions, args.flows
    );
    if s > default_max {
        println!(
            "\nNote: the gateway builds its attribution cache with CacheConfig::default(), \
             max_sandboxes = {default_max}: with {s} sandboxes registered, {} would get no \
             attribution and fail closed. The large worlds here use max_sandboxes = {}.",
            s - default_max,
            cache_sandboxes(args)
        );
    }
    println!(
        "\n| case | ns per flow (median) | rounds min–max | vs 1 × {} | allowed / flows |",
        args.small_names
    );
    println!("|---|---:|---:|---:|---:|");
    for (c, (m, a)) in cases.iter().zip(medians.iter().zip(allowed)) {
        println!(
            "| {} | {m:.0} | {:.0}–{:.0} | {:.2}× | {a} / {} |",
            c.name,
            c.times[0],
            c.times[c.times.len() - 1],
            m / medians[0],
            c.flows.len()
        );
    }
}

/// The memory table per build phase, then the JSON summary line.
fn report_memory(args: &Args, built: &Built, cases: &[Case<'_>], medians: &[f64]) {
    let (start, after_large) = (built.start, built.after_large);
    println!(
        "\nMemory (VmRSS, mimalloc): {:.1} MiB at process start, {:.1} MiB after the large \
         world (built in {:.1} s).\n",
        mib(start.rss),
        mib(after_large.rss),
        built.build_s,
    );
    println!("| phase | RSS added MiB | per |");
    println!("|---|---:|---:|");
    for p in &built.phases {
        let b = p.added.rss as f64 * 1024.0 / p.count as f64;
        let per = if b >= 10_240.0 {
            format!("{:.1} KiB / {}", b / 1024.0, p.per)
        } else {
            format!("{b:.0} B / {}", p.per)
        };
        println!("| {} | {:.1} | {per} |", p.what, mib(p.added.rss));
    }
    let large_rss = after_large.rss.saturating_sub(start.rss);
    println!(
        "\n{{\"sandboxes\": {}, \"names\": {}, \"small_names\": {}, \"large_world_rss_kib\": {large_rss}, \
         \"ns_per_flow\": {{{}}}}}",
        args.sandboxes,
        args.names,
        args.small_names,
        cases
            .iter()
            .zip(medians)
            .map(|(c, m)| format!("\"{}\": {m:.1}", c.name))
            .collect::<Vec<_>>()
            .join(", ")
    );
}
