//! Proposals: the allow entries that would have let a sandbox's denied flows
//! and refused requests through, with the evidence for each.
//!
//! The gateway hands every denial to [`Proposals::record`]; an operator (or
//! the controller) lists them with [`Proposals::list`] and approves the ones
//! it wants. Pure: the time of each denial is passed in.
//!
//! What is proposed, and why:
//!
//! - Only denials the policy made for want of an allow
//!   ([`PROPOSED_REASONS`]): `no_allow_match`, the attribution gaps
//!   (`no_dns_seen`, `expired`, `evicted`) and, per request,
//!   `http_not_allowed`. A platform deny is the operator's and a tenant
//!   deny (or an `http_deny`) beats every allow, so proposing an allow would
//!   not help; evidence that reads two ways (`sni_mismatch`,
//!   `ambiguous_path`, malformed hellos) or flows an allow does not fix
//!   (`needs_interception`, `unreadable_stream`, `encrypted_dns`,
//!   credentials) are never proposed either.
//! - A flow with a name proposes that name: the SNI, else the `Host`, else
//!   the first name attributed to the address. One without any proposes
//!   its address.
//! - A refused request proposes the entry that decided (a `domain`, or the
//!   `wildcard_domain` whose level holds the qualified entries, so adding it
//!   does not narrow that level's other names) with its method and normal
//!   path: `{"domain": .., "http": {"methods": ["POST"], "paths": ["/v1/x"]}}`.
//!   A path that as a pattern would cover more than itself (`/`, or one with
//!   a `*`) proposes nothing: the sandbox chooses its paths.
//! - A flow without a name whose address's attribution `expired` or was
//!   `evicted` proposes nothing: resolving the name again is the fix, and an
//!   address entry would open the address to every name.
//! - At least [`WILDCARD_SIBLINGS`] distinct names under one registrable
//!   domain (Public Suffix List, the `psl` crate) are also listed as one
//!   `*.<registrable domain>`, beside the names: never a wildcard over a public suffix
//!   (`*.co.uk`, `*.github.io`), since a registrable domain is one label
//!   more than its suffix.
//! - At least [`AGGREGATE_ADDRESSES`] addresses in one `/24` (IPv4) or `/48`
//!   (IPv6) are also listed as that network, beside the addresses, unless
//!   it overlaps a platform deny. An address that embeds an IPv4 one
//!   (mapped, NAT64) is proposed as that one.
//!
//! Bounds: [`MAX_SEEN`] entries per sandbox (the least recently seen is
//! evicted), [`MAX_EXAMPLES`] examples per entry (the most recent). The
//! gateway bounds the sum over its sandboxes too ([`MAX_SEEN_PER_GATEWAY`]).

#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::time::SystemTime;

use ipnet::IpNet;

use crate::dest::canonical_ip;
use crate::{Destination, Hostname, PlatformDenies, Rule, WildcardDomain};

/// Entries kept per sandbox: a sandbox scanning addresses or names cannot
/// grow the gateway's memory past this.
pub const MAX_SEEN: usize = 256;
/// Entries kept over every sandbox of one gateway (64 sandboxes' worth): past
/// it, the sandbox holding most gives up its least recently seen entry, so
/// many sandboxes scanning together cannot grow it either, and the one
/// scanning most pays first.
pub const MAX_SEEN_PER_GATEWAY: usize = 64 * MAX_SEEN;
/// Examples kept per proposal.
pub const MAX_EXAMPLES: usize = 3;
/// Distinct names under one registrable domain before they are proposed as
/// one wildcard: two could be chance, three are a pattern (CDN shards,
/// regional endpoints).
pub const WILDCARD_SIBLINGS: usize = 3;
/// Distinct addresses in one `/24` or `/48` before they are proposed as it.
pub const AGGREGATE_ADDRESSES: usize = 3;
/// The longest path a refused request proposes an entry for, in bytes...
pub const MAX_PROPOSED_PATH: usize = 256;
/// ... and in segments.
pub const MAX_PROPOSED_SEGMENTS: usize = 32;

/// The deny reasons an allow entry would have prevented.
pub const PROPOSED_REASONS: &[&str] = &[
    "no_allow_match",
    "no_dns_seen",
    "expired",
    "evicted",
    "http_not_allowed",
];

/// One denied flow or refused request, as the gateway saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Denial {
    pub at: SystemTime,
    pub dst: SocketAddr,
    pub sni: Option<Hostname>,
    pub host: Option<Hostname>,
    pub attributed: Vec<Hostname>,
    /// The reason code (docs/reason-codes.md).
    pub reason: &'static str,
    /// Set for a refused request.
    pub request: Option<DeniedRequest>,
}

/// The request part of a [`Denial`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeniedRequest {
    pub method: String,
    /// The normal path (query dropped).
    pub path: String,
    /// For `http_not_allowed`: the destination of the allow entry that
    /// decided (its level's first qualified entry).
    pub level: Option<Destination>,
}

/// One proposed allow entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Proposal {
    /// `p-` and a hash of the rule's JSON: the same rule has the same id.
    pub id: String,
    pub rule: Rule,
    pub reasons: Vec<&'static str>,
    pub count: u64,
    pub first_seen: SystemTime,
    pub last_seen: SystemTime,
    /// Up to [`MAX_EXAMPLES`], oldest first.
    pub examples: Vec<Denial>,
}

/// One sandbox's denials, merged by what each would propose.
#[derive(Clone, Debug, Default)]
pub struct Proposals {
    seen: HashMap<Key, Seen>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Key {
    Name(Hostname),
    Addr(IpAddr),
    Request(Rule),
}

#[derive(Clone, Debug)]
struct Seen {
    reasons: BTreeSet<&'static str>,
    count: u64,
    first: SystemTime,
    last: SystemTime,
    examples: Vec<Denial>,
}

// === impl Proposals ===

impl Proposals {
    /// Records one denial; `false` when it proposes nothing.
    pub fn record(&mut self, denial: Denial) -> bool {
        let Some(key) = key_of(&denial) else {
            return false;
        };
        if !self.seen.contains_key(&key) && self.seen.len() >= MAX_SEEN {
            self.evict();
        }
        let at = denial.at;
        self.seen
            .entry(key)
            .or_insert_with(|| Seen::new(at))
            .add(denial);
        true
    }

    /// Entries held (before wildcards and networks merge them).
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }

    /// The proposals, most recently seen first; `platform` keeps an
    /// aggregated network off any address the operator denies.
    pub fn list(&self, platform: &PlatformDenies) -> Vec<Proposal> {
        self.list_except(platform, &[])
    }

    /// [`Proposals::list`], leaving out — before names merge into wildcards
    /// and addresses into networks — what was denied only for an
    /// attribution gap (`no_dns_seen`, `expired`, `evicted`) though an
    /// entry of `allow` already covers it: a name any entry names (qualified
    /// or not) or a wildcard covers, an address an `ip` or `cidr` entry
    /// covers. An entry would fix nothing (the sandbox must resolve the
    /// name through the gateway), and a whole-destination entry or a merged
    /// wildcard would open more than the sandbox has.
    pub fn list_except(&self, platform: &PlatformDenies, allow: &[Rule]) -> Vec<Proposal> {
        let mut names: BTreeMap<&Hostname, &Seen> = BTreeMap::new();
        let mut addrs: BTreeMap<IpAddr, &Seen> = BTreeMap::new();
        let mut out = Vec::new();
        for (key, seen) in &self.seen {
            if seen.gap_only() && allowed(key, allow) {
                continue;
            }
            match key {
                Key::Name(n) => {
                    names.insert(n, seen);
                }
                Key::Addr(ip) => {
                    addrs.insert(*ip, seen);
                }
                Key::Request(rule) => out.push(seen.proposal(rule.clone())),
            }
        }
        out.extend(wildcards(names));
        out.extend(networks(addrs, platform));
        out.sort_by(|a, b| b.last_seen.cmp(&a.last_seen).then(a.id.cmp(&b.id)));
        out
    }

    /// Drops the least recently seen entry.
    /// Drops the least recently seen entry, if any (the gateway's bound
    /// over every sandbox takes from the one holding most).
    pub fn evict(&mut self) {
        let oldest = self
            .seen
            .iter()
            .min_by_key(|(_, s)| s.last)
            .map(|(k, _)| k.clone());
        if let Some(k) = oldest {
            self.seen.remove(&k);
        }
    }
}

/// Whether an entry of `allow` covers a name or address `key`.
fn allowed(key: &Key, allow: &[Rule]) -> bool {
    allow.iter().any(|r| match (key, &r.dest) {
        (Key::Name(n), Destination::Domain(d)) => d == n,
        (Key::Name(n), Destination::WildcardDomain(w)) => w.matches(n),
        (Key::Addr(ip), Destination::Ip(a)) => canonical_ip(*a) == *ip,
        (Key::Addr(ip), Destination::Cidr(net)) => net.contains(ip),
        _ => false,
    })
}

/// What `d` would propose, if anything.
fn key_of(d: &Denial) -> Option<Key> {
    if !PROPOSED_REASONS.contains(&d.reason) {
        return None;
    }
    let name = match &d.request {
        Some(_) => d.host.as_ref().or(d.sni.as_ref()),
        None => d.sni.as_ref().or(d.host.as_ref()),
    }
    .or(d.attributed.first());
    match (&d.request, name) {
        (Some(r), Some(name)) if d.reason == "http_not_allowed" => {
            let dest = r
                .level
                .clone()
                .unwrap_or_else(|| Destination::Domain(name.clone()));
            qualified(dest, &r.method, &r.path).map(Key::Request)
        }
        (Some(_), None) if d.reason == "http_not_allowed" => None,
        (_, Some(name)) => Some(Key::Name(name.clone())),
        // The address was attributed, but no longer is: resolving it again
        // is the fix, not an address entry that opens it to every name.
        (_, None) if matches!(d.reason, "expired" | "evicted") => None,
        // An address that embeds an IPv4 one (mapped, NAT64) is proposed
        // as that address, as policy reads it: grouped with its own kind,
        // never into a `/48` of the NAT64 prefix, which is every address.
        (_, None) => Some(Key::Addr(
            crate::dest::embedded_ipv4(d.dst.ip()).map_or(canonical_ip(d.dst.ip()), IpAddr::V4),
        )),
    }
}

/// `dest` qualified by one method and path, as the schema writes it; `None`
/// for a path that, as a pattern, would cover more than itself: `/` (every
/// path lies under it) or one with a `*` (a segment of `*` matches any
/// segment; a `*` inside one is no pattern at all). The sandbox chooses its
/// paths, so it would choose what is proposed.
fn qualified(dest: Destination, method: &str, path: &str) -> Option<Rule> {
    if path.trim_matches('/').is_empty() || path.contains('*') {
        return None;
    }
    // A long path is no entry an operator writes, and a sandbox choosing
    // new ones would make each proposal cost some 20 KiB (its segments,
    // its examples) against a name's 2.
    let segments = path.split('/').filter(|s| !s.is_empty()).count();
    if path.len() > MAX_PROPOSED_PATH || segments > MAX_PROPOSED_SEGMENTS {
        return None;
    }
    let key = dest.kind().as_str();
    let value = dest.value();
    let with_path = serde_json::json!({key: value, "http": {"methods": [method], "paths": [path]}});
    serde_json::from_value(with_path).ok()
}

/// Registrable domains with a public suffix beneath them
/// (`s3.amazonaws.com` under `amazonaws.com`), from the Public Suffix List
/// of the pinned `psl` crate (`policy/data/gen_registrable_with_suffixes.py`).
static WITH_SUFFIXES: std::sync::LazyLock<std::collections::HashSet<&'static str>> =
    std::sync::LazyLock::new(|| {
        include_str!("../data/registrable_with_suffixes.txt")
            .lines()
            .collect()
    });

/// Whether `*.<reg>` would cover other people's sites: `reg` has a public
/// suffix beneath it (`*.amazonaws.com` covers every S3 bucket).
fn covers_public_suffixes(reg: &str) -> bool {
    WITH_SUFFIXES.contains(reg)
}

/// Names, with [`WILDCARD_SIBLINGS`] or more under one registrable domain
/// merged into `*.<registrable>`, unless a public suffix lies beneath it.
fn wildcards(names: BTreeMap<&Hostname, &Seen>) -> Vec<Proposal> {
    let mut groups: BTreeMap<&str, Vec<(&Hostname, &Seen)>> = BTreeMap::new();
    let mut out = Vec::new();
    for (name, seen) in names {
        match psl::domain_str(name.as_str()) {
            // The apex is not a sibling: a wildcard never covers it.
            Some(reg) if reg != name.as_str() && !covers_public_suffixes(reg) => {
                groups.entry(reg).or_default().push((name, seen))
            }
            _ => out.push(seen.proposal(Destination::Domain(name.clone()).into())),
        }
    }
    for (reg, members) in groups {
        let wildcard = WildcardDomain::parse(&format!("*.{reg}")).ok();
        match wildcard {
            Some(w) if members.len() >= WILDCARD_SIBLINGS => {
                let merged = Seen::merged(members.iter().map(|(_, s)| *s));
                out.push(merged.proposal(Destination::WildcardDomain(w).into()));
                // The names stay proposals of their own too: an operator
                // who wants only the one they were looking at can still
                // approve it, whatever else the sandbox dialled since.
                out.extend(
                    members
                        .into_iter()
                        .map(|(n, s)| s.proposal(Destination::Domain(n.clone()).into())),
                );
            }
            _ => out.extend(
                members
                    .into_iter()
                    .map(|(n, s)| s.proposal(Destination::Domain(n.clone()).into())),
            ),
        }
    }
    out
}

/// Addresses, with [`AGGREGATE_ADDRESSES`] or more in one `/24` or `/48`
/// (that no platform deny overlaps) merged into it; each stays a proposal
/// of its own too, so the operator can approve only the one they looked at.
fn networks(addrs: BTreeMap<IpAddr, &Seen>, platform: &PlatformDenies) -> Vec<Proposal> {
    let mut groups: BTreeMap<IpNet, Vec<(IpAddr, &Seen)>> = BTreeMap::new();
    for (ip, seen) in addrs {
        groups.entry(covering(ip)).or_default().push((ip, seen));
    }
    let mut out = Vec::new();
    for (net, members) in groups {
        if members.len() >= AGGREGATE_ADDRESSES && !overlaps_platform(net, platform) {
            let merged = Seen::merged(members.iter().map(|(_, s)| *s));
            out.push(merged.proposal(Destination::Cidr(net).into()));
        }
        out.extend(
            members
                .into_iter()
                .map(|(ip, s)| s.proposal(Destination::Ip(ip).into())),
        );
    }
    out
}

/// The `/24` (IPv4) or `/48` (IPv6) holding `ip`.
fn covering(ip: IpAddr) -> IpNet {
    let prefix = if ip.is_ipv4() { 24 } else { 48 };
    // The prefix is within both families' lengths.
    IpNet::new(ip, prefix).map_or(IpNet::from(ip), |n| n.trunc())
}

fn overlaps_platform(net: IpNet, platform: &PlatformDenies) -> bool {
    platform.list().iter().any(|d| match d {
        Destination::Ip(ip) => net.contains(ip),
        Destination::Cidr(c) => net.contains(&c.network()) || c.contains(&net.network()),
        Destination::Domain(_) | Destination::WildcardDomain(_) => false,
    })
}

/// `p-` and the first 128 bits of the SHA-256 of the rule's JSON, in hex:
/// stable across restarts and gateways, so the controller can name a
/// proposal it listed. The sandbox chooses what is proposed (its paths, its
/// addresses): with a short or weak hash it could make two rules share an
/// id, and an operator approving the one shown would approve the other.
fn id_of(rule: &Rule) -> String {
    use sha2::Digest;
    let text = serde_json::to_string(rule).unwrap_or_default();
    let digest = sha2::Sha256::digest(text.as_bytes());
    let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("p-{hex}")
}

// === impl Seen ===

impl Seen {
    /// Whether every denial it merges was for an attribution gap only.
    fn gap_only(&self) -> bool {
        self.reasons
            .iter()
            .all(|r| matches!(*r, "no_dns_seen" | "expired" | "evicted"))
    }

    fn new(at: SystemTime) -> Self {
        Self {
            reasons: BTreeSet::new(),
            count: 0,
            first: at,
            last: at,
            examples: Vec::new(),
        }
    }

    fn add(&mut self, d: Denial) {
        self.reasons.insert(d.reason);
        self.count += 1;
        self.first = self.first.min(d.at);
        self.last = self.last.max(d.at);
        self.examples.push(d);
        self.trim();
    }

    /// Keeps the [`MAX_EXAMPLES`] most recent examples, oldest first.
    fn trim(&mut self) {
        self.examples.sort_by_key(|e| e.at);
        let extra = self.examples.len().saturating_sub(MAX_EXAMPLES);
        self.examples.drain(..extra);
    }

    fn merged<'a>(all: impl Iterator<Item = &'a Self>) -> Self {
        let mut out: Option<Self> = None;
        for s in all {
            let m = out.get_or_insert_with(|| Self::new(s.first));
            m.reasons.extend(s.reasons.iter().copied());
            m.count += s.count;
            m.first = m.first.min(s.first);
            m.last = m.last.max(s.last);
            m.examples.extend(s.examples.iter().cloned());
            m.trim();
        }
        out.unwrap_or_else(|| Self::new(SystemTime::UNIX_EPOCH))
    }

    fn proposal(&self, rule: Rule) -> Proposal {
        Proposal {
            id: id_of(&rule),
            rule,
            reasons: self.reasons.iter().copied().collect(),
            count: self.count,
            first_seen: self.first,
            last_seen: self.last,
            examples: self.examples.clone(),
        }
    }
}
