//! The named counters of the tables `egress_machine` (the node table,
//! `inet`, and the links' table, `netdev`), read from the kernel over
//! nfnetlink (`NFT_MSG_GETOBJ`, a dump of the tables' counter objects) instead of
//! `nft -j list counters`: `nft` loads its cache of the whole table first,
//! every VM's sets and their elements, which at 500 VMs of 256 rules cost
//! 1.2–1.4 s of CPU per read, every observer round. The dump is the
//! counters and nothing else.
//!
//! Used with `machine_egress.observe = "events"`, which already requires the
//! rules in the gateway's own network namespace (the NFLOG group is bound
//! there); `sampled` keeps the `nft` command, which may govern another
//! namespace.
//!
//! [`request`] and [`messages`] are pure (and tested on bytes); [`read`]
//! does the I/O: one socket, one request, the answer read to its end
//! (bounded in messages and by a 2 s timeout on each read). [`rules`]
//! counts a chain's rules the same way (`NFT_MSG_GETRULE`, filtered by table
//! and chain): a table flushed by another tool keeps its counters; and
//! [`link_rules`] the rules of every chain of the links' table.

use rustix::net::{self, RecvFlags, SendFlags};
use std::collections::BTreeMap;

use crate::netlink::{
    self, attr, attributes, read_u64_be, Malformed, NFGEN_LEN, NLMSG_ERROR, NLMSG_HDRLEN,
    NLM_F_REQUEST,
};

const NLMSG_DONE: u16 = 3;
const NLM_F_DUMP: u16 = 0x300;
const SUBSYS_NFTABLES: u16 = 10 << 8;
const MSG_NEWRULE: u16 = 6;
const MSG_GETRULE: u16 = 7;
const MSG_NEWOBJ: u16 = 18;
const MSG_GETOBJ: u16 = 19;
const RULE_TABLE: u16 = 1;
const RULE_CHAIN: u16 = 2;
const NFPROTO_UNSPEC: u8 = 0;
const NFPROTO_INET: u8 = 1;
const NFPROTO_NETDEV: u8 = 5;
const OBJ_TABLE: u16 = 1;
const OBJ_NAME: u16 = 2;
const OBJ_TYPE: u16 = 3;
const OBJ_DATA: u16 = 4;
const OBJECT_COUNTER: u32 = 1;
const COUNTER_PACKETS: u16 = 2;

/// Largest datagram read at once.
const DATAGRAM: usize = 64 * 1024;
/// Counter objects one dump may hold: three per VM (refused, spoofed,
/// lost) for far more VMs than a node runs; past it the read fails.
const MAX_OBJECTS: usize = 200_000;
/// Datagrams one dump may take (a few hundred counters fit in each).
const MAX_DATAGRAMS: usize = 10_000;

/// What one netlink message of the answer says.
#[derive(Debug, PartialEq, Eq)]
pub enum Part {
    /// A counter: its name and packets.
    Counter(String, u64),
    /// A rule (of the chain a [`rule_request`] names).
    Rule,
    /// A rule of the links' table (`netdev`), and its chain's name
    /// ([`link_rule_request`]).
    LinkRule(String),
    /// The end of the dump.
    Done,
    /// The kernel's error (a negative errno; `0` is an acknowledgement).
    Error(i32),
    /// Anything else (skipped).
    Other,
}

/// The dump request for the counters of the tables named `table`, of
/// every family (the answer's other families are skipped: [`messages`]).
pub fn request(table: &str, seq: u32) -> Vec<u8> {
    let mut attrs = Vec::new();
    let mut name = table.as_bytes().to_vec();
    name.push(0);
    attr(&mut attrs, OBJ_TABLE, &name);
    attr(&mut attrs, OBJ_TYPE, &OBJECT_COUNTER.to_be_bytes());
    let kind = SUBSYS_NFTABLES | MSG_GETOBJ;
    netlink::request(
        kind,
        NLM_F_REQUEST | NLM_F_DUMP,
        seq,
        [NFPROTO_UNSPEC, 0, 0, 0],
        &attrs,
    )
}

/// The dump request for the rules of chain `chain` of the `inet` table
/// `table`: the kernel filters them by both names.
pub fn rule_request(table: &str, chain: &str, seq: u32) -> Vec<u8> {
    rule_dump(
        NFPROTO_INET,
        &[(RULE_TABLE, table), (RULE_CHAIN, chain)],
        seq,
    )
}

/// The dump request for every rule of the `netdev` table `table` (the
/// links' table): the kernel filters them by the table's name.
pub fn link_rule_request(table: &str, seq: u32) -> Vec<u8> {
    rule_dump(NFPROTO_NETDEV, &[(RULE_TABLE, table)], seq)
}

/// A rule dump request of `family`, filtered by the named attributes.
fn rule_dump(family: u8, names: &[(u16, &str)], seq: u32) -> Vec<u8> {
    let mut attrs = Vec::new();
    for (kind, name) in names {
        let mut name = name.as_bytes().to_vec();
        name.push(0);
        attr(&mut attrs, *kind, &name);
    }
    netlink::request(
        SUBSYS_NFTABLES | MSG_GETRULE,
        NLM_F_REQUEST | NLM_F_DUMP,
        seq,
        [family, 0, 0, 0],
        &attrs,
    )
}

/// Splits one datagram of the answer into its messages and reads each
/// ([`netlink::split`]).
pub fn messages(datagram: &[u8]) -> Vec<Result<Part, Malformed>> {
    netlink::split(datagram, part)
}

fn part(kind: u16, msg: &[u8]) -> Result<Part, Malformed> {
    let body = &msg[NLMSG_HDRLEN..];
    match kind {
        NLMSG_DONE => Ok(Part::Done),
        NLMSG_ERROR => netlink::error_code(body).map(Part::Error),
        // Only the families the gateway writes: a table of that name in
        // another family is not ours.
        k if k == SUBSYS_NFTABLES | MSG_NEWOBJ => match body.first() {
            Some(&(NFPROTO_INET | NFPROTO_NETDEV)) => counter(body.get(NFGEN_LEN..).unwrap_or(&[])),
            _ => Ok(Part::Other),
        },
        k if k == SUBSYS_NFTABLES | MSG_NEWRULE => match body.first() {
            Some(&NFPROTO_INET) => Ok(Part::Rule),
            Some(&NFPROTO_NETDEV) => link_rule(body.get(NFGEN_LEN..).unwrap_or(&[])),
            _ => Ok(Part::Other),
        },
        _ => Ok(Part::Other),
    }
}

/// A rule of the links' table: the name of its chain.
fn link_rule(attrs: &[u8]) -> Result<Part, Malformed> {
    let chain = attributes(attrs)?
        .into_iter()
        .find(|(t, _)| *t == RULE_CHAIN)
        .ok_or(Malformed("a rule without its chain"))?
        .1;
    let chain = chain.split(|&b| b == 0).next().unwrap_or(&[]);
    let chain = std::str::from_utf8(chain).map_err(|_| Malformed("a chain name not UTF-8"))?;
    Ok(Part::LinkRule(chain.to_owned()))
}

/// A counter object: its name, and the packets inside its data.
fn counter(attrs: &[u8]) -> Result<Part, Malformed> {
    let (mut name, mut packets, mut kind) = (None, None, None);
    for (t, value) in attributes(attrs)? {
        match t {
            OBJ_NAME => {
                let text = value.split(|&b| b == 0).next().unwrap_or(&[]);
                let text = std::str::from_utf8(text).map_err(|_| Malformed("a name not UTF-8"))?;
                name = Some(text.to_owned());
            }
            OBJ_TYPE => kind = read_u32_be_opt(value),
            OBJ_DATA => {
                for (t, v) in attributes(value)? {
                    if t == COUNTER_PACKETS {
                        packets = Some(read_u64_be(v, 0).ok_or(Malformed("packets cut short"))?);
                    }
                }
            }
            _ => {}
        }
    }
    if kind != Some(OBJECT_COUNTER) {
        return Ok(Part::Other);
    }
    match (name, packets) {
        (Some(n), Some(p)) => Ok(Part::Counter(n, p)),
        _ => Err(Malformed("a counter without its name or packets")),
    }
}

fn read_u32_be_opt(b: &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(b.get(..4)?.try_into().ok()?))
}

/// Reads every counter of the tables named `table` (families `inet` and
/// `netdev`) in this network namespace: name → packets. An absent table
/// reads as no counters.
pub fn read(table: &str) -> Result<BTreeMap<String, u64>, String> {
    let mut out = BTreeMap::new();
    dump(
        &format!("the counter dump of {table}"),
        &request(table, 1),
        |part| {
            if let Part::Counter(name, packets) = part {
                out.insert(name, packets);
            }
            if out.len() > MAX_OBJECTS {
                return Err(format!("more than {MAX_OBJECTS} counters in {table}"));
            }
            Ok(())
        },
    )?;
    Ok(out)
}

/// Counts the rules of chain `chain` of the `inet` table `table` in this
/// network namespace (a table flushed by another tool keeps its counters
/// and chains, but not its rules). An absent chain is an error.
pub fn rules(table: &str, chain: &str) -> Result<usize, String> {
    let mut n = 0usize;
    let what = format!("the rule dump of {table} {chain}");
    dump(&what, &rule_request(table, chain, 1), |part| {
        n += usize::from(part == Part::Rule);
        match n > MAX_OBJECTS {
            true => Err(format!("more than {MAX_OBJECTS} rules in {chain}")),
            false => Ok(()),
        }
    })?;
    Ok(n)
}

/// Counts the rules of each chain of the `netdev` table `table` (the
/// links' table) in this network namespace: chain → rules; a chain with
/// none is not named. An absent table is an error.
pub fn link_rules(table: &str) -> Result<BTreeMap<String, usize>, String> {
    let mut out = BTreeMap::new();
    let mut n = 0usize;
    let what = format!("the rule dump of netdev {table}");
    dump(&what, &link_rule_request(table, 1), |part| {
        if let Part::LinkRule(chain) = part {
            *out.entry(chain).or_insert(0) += 1;
            n += 1;
        }
        match n > MAX_OBJECTS {
            true => Err(format!("more than {MAX_OBJECTS} rules in netdev {table}")),
            false => Ok(()),
        }
    })?;
    Ok(out)
}

/// Sends `request` on a socket of its own and hands every part of the
/// answer but its end and acknowledgements to `take`, until the end.
fn dump(
    what: &str,
    request: &[u8],
    mut take: impl FnMut(Part) -> Result<(), String>,
) -> Result<(), String> {
    let fd = netlink::socket()?;
    net::send(&fd, request, SendFlags::empty())
        .map_err(|e| format!("sending the request for {what}: {e}"))?;
    let mut buf = vec![0u8; DATAGRAM];
    for _ in 0..MAX_DATAGRAMS {
        let (n, _) = net::recv(&fd, &mut buf[..], RecvFlags::empty())
            .map_err(|e| format!("reading {what}: {e}"))?;
        if n == 0 {
            return Err(format!("{what} ended without its end"));
        }
        for p in messages(&buf[..n.min(buf.len())]) {
            match p.map_err(|e| format!("unreadable answer to {what}: {}", e.0))? {
                Part::Done => return Ok(()),
                Part::Error(0) | Part::Other => {}
                Part::Error(e) => {
                    let why = std::io::Error::from_raw_os_error(-e);
                    return Err(format!("the kernel refused {what}: {why}"));
                }
                part => take(part)?,
            }
        }
    }
    Err(format!("{what} took more than {MAX_DATAGRAMS} datagrams"))
}

#[cfg(test)]
mod tests;
