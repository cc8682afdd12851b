//! What an answer attributes: the A/AAAA records of the name the CNAME
//! chain that starts at the question name ends at, and the address hints of
//! its SVCB/HTTPS records in service mode, to every name on that chain.
//!
//! Only the answer section counts, only records of class IN, and only
//! address records owned by the chain's last name: an upstream (or an
//! attacker who can shape an answer) cannot attribute a name that was not
//! asked for by putting it in the answer, the authority or the additional
//! section, nor an address by giving it another class, nor an address of
//! its own to a name its CNAME points at (`q.attacker.test A 6.6.6.6` beside
//! `q.attacker.test CNAME allowed.test`: a name with a CNAME has no other
//! data, and its A records are not `allowed.test`'s). At most
//! [`MAX_ADDRS`] addresses are taken from one answer.

use std::net::IpAddr;

use egress_policy::Hostname;
use hickory_proto::op::Message;
use hickory_proto::rr::rdata::svcb::{SvcParamValue, SVCB};
use hickory_proto::rr::rdata::HTTPS;
use hickory_proto::rr::{DNSClass, Name, RData, Record};

/// Longest CNAME chain followed; real chains are a handful of links.
const MAX_CHAIN: usize = 16;

/// Addresses taken from one answer, in the answer's order; the rest are not
/// attributed. Real answers carry a handful; a 64 KiB one could carry
/// thousands, each to be merged into the sandbox's cache.
pub(crate) const MAX_ADDRS: usize = 64;

/// The names an answer binds to addresses, and the smallest TTL involved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attribution {
    /// The question name first, then the chain in order (valid hostnames only).
    pub names: Vec<Hostname>,
    pub addrs: Vec<IpAddr>,
    /// Seconds: the smallest TTL on the chain (CNAMEs and the address records used).
    pub ttl: u32,
}

/// A record's TTL as RFC 2181 section 8 reads it: one with the top bit set
/// is zero (so the floor, `dns.min_ttl`, applies), not 68 years.
pub(crate) fn ttl_of(wire: u32) -> u32 {
    if wire >= 1 << 31 {
        0
    } else {
        wire
    }
}

/// Extracts what `answer` attributes for `question`, or `None` when it binds no address.
pub fn attribution(question: &Name, answer: &Message) -> Option<Attribution> {
    let (chain, mut ttl) = follow(question, answer);
    // The chain ends at a name with no CNAME of its own (one that ended in
    // a loop or at the limit has one, and so has no addresses).
    let last = chain.last()?;
    if internet(answer).any(|r| matches!(r.data, RData::CNAME(_)) && same_name(&r.name, last)) {
        return None;
    }
    let mut addrs = Vec::new();
    for r in internet(answer) {
        if !same_name(last, &r.name) {
            continue;
        }
        let took = match &r.data {
            RData::A(a) => take(&mut addrs, IpAddr::V4(a.0)),
            RData::AAAA(a) => take(&mut addrs, IpAddr::V6(a.0)),
            RData::SVCB(s) | RData::HTTPS(HTTPS(s)) => take_hints(&mut addrs, s),
            _ => false,
        };
        // An address not taken (past the limit) does not lower the TTL.
        if took {
            ttl = ttl.min(ttl_of(r.ttl));
        }
    }
    if addrs.is_empty() {
        return None;
    }
    let mut names: Vec<Hostname> = Vec::with_capacity(chain.len());
    for n in &chain {
        // A chain name that is not a hostname (`_svc.example`) can match no
        // domain rule; it is skipped, the rest of the chain still counts.
        if let Some(h) = hostname(n) {
            if !names.contains(&h) {
                names.push(h);
            }
        }
    }
    if names.is_empty() {
        return None;
    }
    Some(Attribution { names, addrs, ttl })
}

/// Adds `addr` to `addrs` unless it is there or they are full; whether it
/// is there now. `::ffff:a.b.c.d` is where a dual-stack socket connects over
/// IPv4: it binds the IPv4 address, as an A record would.
fn take(addrs: &mut Vec<IpAddr>, addr: IpAddr) -> bool {
    let addr = addr.to_canonical();
    if addrs.contains(&addr) {
        return true;
    }
    if addrs.len() == MAX_ADDRS {
        return false;
    }
    addrs.push(addr);
    true
}

/// The `ipv4hint` and `ipv6hint` addresses of a record in service mode,
/// added as [`take`] adds; whether any was taken. A client that uses the
/// record may connect to a hint for the owner's name (RFC 9460, 7.3),
/// whatever the record's target. An alias-mode record (priority 0) binds
/// no address: its parameters are to be ignored (RFC 9460, 2.4.2).
fn take_hints(addrs: &mut Vec<IpAddr>, record: &SVCB) -> bool {
    if record.svc_priority == 0 {
        return false;
    }
    let mut took = false;
    for (_, value) in &record.svc_params {
        match value {
            SvcParamValue::Ipv4Hint(h) => {
                for a in &h.0 {
                    took |= take(addrs, IpAddr::V4(a.0));
                }
            }
            SvcParamValue::Ipv6Hint(h) => {
                for a in &h.0 {
                    took |= take(addrs, IpAddr::V6(a.0));
                }
            }
            _ => {}
        }
    }
    took
}

/// `name` as a hostname (lower case, no trailing dot), or `None` when it is
/// not one. A label with any byte but a letter, a digit or a hyphen is not
/// (its presentation form would need an escape); the rest is
/// [`Hostname::parse`]'s to judge. Built from the labels directly: no
/// escaping pass, no lower-cased copy of the name.
pub(crate) fn hostname(name: &Name) -> Option<Hostname> {
    let mut s = String::with_capacity(name.len());
    for label in name.iter() {
        if !label
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || *b == b'-')
        {
            return None;
        }
        if !s.is_empty() {
            s.push('.');
        }
        s.extend(label.iter().map(|b| char::from(b.to_ascii_lowercase())));
    }
    Hostname::parse(&s).ok()
}

/// The answer section's records of class IN.
fn internet(answer: &Message) -> impl Iterator<Item = &Record> {
    answer
        .answers
        .iter()
        .filter(|r| r.dns_class == DNSClass::IN)
}

/// Case-insensitive, ignoring the trailing root dot.
fn same_name(a: &Name, b: &Name) -> bool {
    a.eq_ignore_root(b)
}

#[cfg(test)]
mod tests;

/// The CNAME chain from `question` in `answer` (compared without regard to
/// case, in whatever order the records come), and its smallest TTL.
fn follow(question: &Name, answer: &Message) -> (Vec<Name>, u32) {
    let mut chain: Vec<Name> = vec![question.clone()];
    let mut ttl = u32::MAX;
    while chain.len() <= MAX_CHAIN {
        let Some(current) = chain.last() else { break };
        let next = internet(answer).find_map(|r| match &r.data {
            RData::CNAME(target) if same_name(&r.name, current) => {
                Some((target.0.clone(), ttl_of(r.ttl)))
            }
            _ => None,
        });
        let Some((target, t)) = next else { break };
        if chain.iter().any(|n| same_name(n, &target)) {
            break; // a loop: the chain ends where it started repeating
        }
        ttl = ttl.min(t);
        chain.push(target);
    }
    (chain, ttl)
}
