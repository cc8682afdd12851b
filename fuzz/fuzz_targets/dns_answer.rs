//! What an upstream DNS answer attributes, and the cache it fills.
//!
//! Input, byte 0 chooses:
//!
//! - bit 7 clear — raw: frames `[sandbox: u8][len: u16 BE][message]`, each
//!   message parsed with `Message::from_vec` as the proxy parses an upstream
//!   reply (compression pointers, odd sections and all); its question is
//!   the message's first query (the proxy checks the reply echoes the
//!   query's), or `fallback.test.` when it has none.
//! - bit 7 set — built: the rest is read with `arbitrary` into answers of
//!   CNAME/A/AAAA records over a small pool of names (chains, loops, case
//!   changes, owners off the chain, absurd TTLs, many answers), encoded to
//!   the wire and parsed back, plus clock advances between answers.
//!
//! Properties:
//!
//! - `attribution` equals a model written here, over the answer's records of
//!   class IN only: follow the first CNAME owned
//!   by the current name (ASCII case ignored) from the question, at most 16
//!   links, stopping at a loop; the addresses are the A/AAAA records owned
//!   by the chain's last name, in answer order, once each (an IPv4-mapped
//!   AAAA counting as its IPv4 address), at most 64 (a record of an
//!   address past those is not used), and none when that name
//!   owns a CNAME itself (a loop, or the limit); the names are the chain
//!   names whose every label is letters, digits and inner hyphens (a valid
//!   hostname), once each; the TTL is the smallest of the links and address
//!   records used; `None` without an address or a name. In particular only
//!   names on the question's CNAME chain are attributed, and every address
//!   is owned by the chain's last name.
//! - the cache (per_sandbox_ips 64, names_per_ip 4, max_sandboxes 4) refuses
//!   a fifth sandbox and only that; after `sync()` it holds at most 64
//!   addresses per sandbox; a lookup returns at most 4 names, each recorded
//!   for that sandbox and address and not yet expired on the cache's clock;
//!   every address of the answer just recorded is found.
#![no_main]

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::time::Duration;

use arbitrary::{Arbitrary, Unstructured};
use dns_attrib::{attribution, Attribution, AttributionCache, CacheConfig, ManualClock, Millis};
use egress_policy::{Hostname, SandboxId};
use hickory_proto::op::{Message, MessageType, OpCode, Query};
use hickory_proto::rr::rdata::{A, AAAA, CNAME, TXT};
use hickory_proto::rr::{DNSClass, Name, RData, Record, RecordType};
use libfuzzer_sys::fuzz_target;

const MAX_CHAIN: usize = 16;
/// Addresses taken from one answer (`dns_attrib`'s own bound).
const MAX_ADDRS: usize = 64;
const PER_SANDBOX_IPS: u64 = 64;
const NAMES_PER_IP: usize = 4;
const MAX_SANDBOXES: usize = 4;
/// Distinct sandbox ids the input can name: one more than fit.
const SANDBOX_IDS: u8 = 6;
const MAX_STEPS: usize = 24;

/// Names the built answers draw from: a chain, case variants, a name that
/// is not a hostname, a numeric one, the root.
const POOL: &[&str] = &[
    "www.shop.test.",
    "shop.cdn.test.",
    "edge.cdn.test.",
    "WWW.Shop.TEST.",
    "www.shop.test",
    "_svc.shop.test.",
    "evil.test.",
    "10.0.0.1.",
    "a.b.c.d.e.f.test.",
    ".",
];

#[derive(Arbitrary, Debug)]
enum Owner {
    Pool(u8),
    /// Raw labels: dots inside a label, bytes no hostname has.
    Labels(Vec<Vec<u8>>),
}

#[derive(Arbitrary, Debug)]
enum Data {
    Cname(Owner),
    A([u8; 4]),
    Aaaa([u8; 16]),
    Txt(String),
}

#[derive(Arbitrary, Debug)]
struct Rec {
    owner: Owner,
    ttl: u32,
    data: Data,
    /// In the authority or additional section instead: never counts.
    elsewhere: bool,
}

#[derive(Arbitrary, Debug)]
enum Step {
    Answer {
        sandbox: u8,
        question: Owner,
        /// Put the question in the message's question section.
        echo: bool,
        records: Vec<Rec>,
    },
    Advance(u32),
}

/// A name as the model compares names: its labels, ASCII lower-cased.
type Key = Vec<Vec<u8>>;

fn key(n: &Name) -> Key {
    n.iter().map(|l| l.to_ascii_lowercase()).collect()
}

fn owner_name(o: &Owner) -> Option<Name> {
    match o {
        Owner::Pool(i) => Name::from_ascii(POOL[usize::from(*i) % POOL.len()]).ok(),
        Owner::Labels(labels) => Name::from_labels(labels.iter().map(|l| l.as_slice())).ok(),
    }
}

/// The answer's records of class IN: no other class attributes.
fn internet(answer: &Message) -> impl Iterator<Item = &Record> {
    answer
        .answers
        .iter()
        .filter(|r| r.dns_class == DNSClass::IN)
}

/// The model of `attribution` (see the module docs).
fn model(question: &Name, answer: &Message) -> Option<Attribution> {
    let mut chain: Vec<Key> = vec![key(question)];
    let mut ttl = u32::MAX;
    for _ in 0..MAX_CHAIN {
        let current = chain.last()?;
        let Some((target, t)) = internet(answer).find_map(|r| match &r.data {
            RData::CNAME(c) if key(&r.name) == *current => Some((key(&c.0), rfc2181(r.ttl))),
            _ => None,
        }) else {
            break;
        };
        if chain.contains(&target) {
            break;
        }
        ttl = ttl.min(t);
        chain.push(target);
    }
    let last = chain.last()?.clone();
    let cname_of_last =
        internet(answer).any(|r| matches!(r.data, RData::CNAME(_)) && key(&r.name) == last);
    let mut addrs = Vec::new();
    for r in internet(answer).filter(|_| !cname_of_last) {
        let addr = match &r.data {
            RData::A(a) => IpAddr::V4(a.0),
            // An IPv4-mapped AAAA is the IPv4 address its flows carry.
            RData::AAAA(a) => IpAddr::V6(a.0).to_canonical(),
            _ => continue,
        };
        if key(&r.name) != last {
            continue;
        }
        if !addrs.contains(&addr) {
            if addrs.len() == MAX_ADDRS {
                continue;
            }
            addrs.push(addr);
        }
        ttl = ttl.min(rfc2181(r.ttl));
    }
    let mut names: Vec<Hostname> = Vec::new();
    for k in &chain {
        let ldh = |l: &Vec<u8>| {
            l.iter().all(|b| b.is_ascii_alphanumeric() || *b == b'-')
                && l.first() != Some(&b'-')
                && l.last() != Some(&b'-')
        };
        if k.is_empty() || !k.iter().all(ldh) {
            continue;
        }
        let text: Vec<&str> = k
            .iter()
            .map(|l| std::str::from_utf8(l).unwrap_or("?"))
            .collect();
        // The remaining rules (lengths, a numeric last label) are Hostname's own.
        if let Ok(h) = Hostname::parse(&text.join(".")) {
            if !names.contains(&h) {
                names.push(h);
            }
        }
    }
    if addrs.is_empty() || names.is_empty() {
        return None;
    }
    Some(Attribution { names, addrs, ttl })
}

/// The cache under test and what the model knows was recorded.
struct World {
    clock: Arc<ManualClock>,
    cache: AttributionCache,
    with_cache: HashSet<SandboxId>,
    /// (sandbox, address, name) → the latest expiry recorded.
    recorded: HashMap<(SandboxId, IpAddr, Hostname), Millis>,
}

impl World {
    fn new() -> Self {
        let clock = ManualClock::new();
        let config = CacheConfig {
            per_sandbox_ips: PER_SANDBOX_IPS,
            names_per_ip: NAMES_PER_IP,
            max_sandboxes: MAX_SANDBOXES,
            ..CacheConfig::default()
        };
        Self {
            cache: AttributionCache::new(config, clock.clone()),
            clock,
            with_cache: HashSet::new(),
            recorded: HashMap::new(),
        }
    }

    fn answer(&mut self, sandbox: u8, question: &Name, message: &Message) {
        let got = attribution(question, message);
        let want = model(question, message);
        assert_eq!(
            got, want,
            "attribution differs from the model for {question}"
        );
        let Some(a) = got else { return };

        let id = SandboxId::new(&format!("sandbox-{}", sandbox % SANDBOX_IDS));
        let fits = self.with_cache.contains(&id) || self.with_cache.len() < MAX_SANDBOXES;
        assert_eq!(
            self.cache.record(&id, &a),
            fits,
            "record refused or admitted {id}"
        );
        if !fits {
            return;
        }
        self.with_cache.insert(id.clone());
        let now = self.cache.now();
        let expiry = now.saturating_add(self.cache.lifetime(a.ttl));
        for ip in &a.addrs {
            for n in &a.names {
                let e = self
                    .recorded
                    .entry((id.clone(), *ip, n.clone()))
                    .or_insert(expiry);
                *e = (*e).max(expiry);
            }
        }
        self.cache.sync();
        self.check_bounds();
        if a.addrs.len() as u64 <= PER_SANDBOX_IPS {
            for ip in &a.addrs {
                let names = self.cache.names_for(&id, *ip).names().into_owned();
                assert!(
                    !names.is_empty(),
                    "{ip} just recorded for {id} is not found"
                );
            }
        }
        for ip in &a.addrs {
            self.check_lookup(&id, *ip);
        }
    }

    fn check_bounds(&self) {
        let count = self.cache.entry_count();
        assert!(
            count <= PER_SANDBOX_IPS * self.with_cache.len() as u64,
            "{count} addresses cached for {} sandboxes",
            self.with_cache.len()
        );
        for id in &self.with_cache {
            let entries = self.cache.entries(id);
            assert!(
                entries.len() as u64 <= PER_SANDBOX_IPS,
                "{id}: {} addresses",
                entries.len()
            );
            for (ip, _) in entries {
                self.check_lookup(id, ip);
            }
        }
    }

    fn check_lookup(&self, id: &SandboxId, ip: IpAddr) {
        let now = self.cache.now();
        let names = self.cache.names_for(id, ip).names().into_owned();
        assert!(
            names.len() <= NAMES_PER_IP,
            "{id} {ip}: {} names",
            names.len()
        );
        for n in &names {
            let Some(expiry) = self.recorded.get(&(id.clone(), ip, n.clone())) else {
                panic!("{id} {ip}: {n} was never recorded for this sandbox and address");
            };
            assert!(
                *expiry > now,
                "{id} {ip}: {n} expired at {expiry:?}, now {now:?}"
            );
        }
    }

    fn advance(&mut self, secs: u32) {
        self.clock.advance(Duration::from_secs(u64::from(secs)));
        self.cache.sync();
        self.check_bounds();
    }
}

fn raw(world: &mut World, mut bytes: &[u8]) {
    for _ in 0..MAX_STEPS {
        let [sandbox, l0, l1, rest @ ..] = bytes else {
            return;
        };
        let len = usize::from(u16::from_be_bytes([*l0, *l1])).min(rest.len());
        let (msg, next) = rest.split_at(len);
        bytes = next;
        let Ok(message) = Message::from_vec(msg) else {
            continue;
        };
        let question = match message.queries.first() {
            Some(q) => q.name.clone(),
            None => Name::from_ascii("fallback.test.").expect("a valid name"),
        };
        world.answer(*sandbox, &question, &message);
    }
}

fn built(world: &mut World, bytes: &[u8]) -> arbitrary::Result<()> {
    let mut u = Unstructured::new(bytes);
    let steps: Vec<Step> = u.arbitrary()?;
    for step in steps.into_iter().take(MAX_STEPS) {
        let (sandbox, question, echo, records) = match step {
            Step::Advance(secs) => {
                world.advance(secs);
                continue;
            }
            Step::Answer {
                sandbox,
                question,
                echo,
                records,
            } => (sandbox, question, echo, records),
        };
        let Some(question) = owner_name(&question) else {
            continue;
        };
        let mut m = Message::new(7, MessageType::Response, OpCode::Query);
        if echo {
            m.add_query(Query::query(question.clone(), RecordType::A));
        }
        for r in records {
            let Some(owner) = owner_name(&r.owner) else {
                continue;
            };
            let data = match r.data {
                Data::Cname(t) => match owner_name(&t) {
                    Some(t) => RData::CNAME(CNAME(t)),
                    None => continue,
                },
                Data::A(o) => RData::A(A(Ipv4Addr::from(o))),
                Data::Aaaa(o) => RData::AAAA(AAAA(Ipv6Addr::from(o))),
                Data::Txt(t) => RData::TXT(TXT::new(vec![t])),
            };
            let record = Record::from_rdata(owner, r.ttl, data);
            if r.elsewhere {
                m.add_additional(record);
            } else {
                m.add_answer(record);
            }
        }
        // What the proxy sees: the answer as it crossed the wire.
        let Ok(wire) = m.to_vec() else { continue };
        let Ok(parsed) = Message::from_vec(&wire) else {
            continue;
        };
        world.answer(sandbox, &question, &parsed);
    }
    Ok(())
}

fuzz_target!(|input: &[u8]| {
    let Some((&mode, rest)) = input.split_first() else {
        return;
    };
    let mut world = World::new();
    if mode & 0x80 == 0 {
        raw(&mut world, rest);
    } else {
        let _ = built(&mut world, rest);
    }
});

/// RFC 2181 section 8: a TTL with the top bit set is zero.
fn rfc2181(ttl: u32) -> u32 {
    if ttl & 0x8000_0000 != 0 {
        0
    } else {
        ttl
    }
}
