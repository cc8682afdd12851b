//! The E2B compatibility layer's create body (`POST /sandboxes`) and its
//! translation into a tenant egress [`Policy`].
//!
//! E2B decides a destination like this: allowed if it matches an `allowOut`
//! entry; otherwise allowed if internet access is on and it matches no
//! `denyOut` entry. `allowOut` wins over `denyOut`, and
//! `allow_internet_access: false` denies everything `allowOut` does not name.
//! Our model decides the other way round: a deny always wins, then an allow,
//! then `default`. [`translate`] bridges the two exactly or not at all:
//!
//! - **Everything denied** (internet off, or `denyOut` covers all of
//!   `0.0.0.0/0` *and* `::/0`): `default: deny`, `allow` = the `allowOut`
//!   entries, no denies.
//! - **Otherwise**: `default: allow`, and `deny` = the `denyOut` addresses
//!   minus every `allowOut` address, as an exact CIDR set difference
//!   (`difference`); no allows (the default already allows them).
//!
//! Names do not subtract from addresses, so a domain allow in the second case
//! is exact only when nothing is left to deny, and a domain deny only when
//! `allowOut` is empty. Anything else is [`E2bError::Inexact`]: the API
//! refuses the create rather than enforce something else than the caller
//! asked for.
//!
//! E2B allows its nameserver 8.8.8.8 on its own whenever `allowOut` names a
//! domain; the translation does the same (`E2B_NAMESERVER`).
//!
//! Pure: no I/O. Entries are validated by [`translate`], not [`parse`],
//! because an [`E2bCreate`] can also be built by hand.

use std::collections::{BTreeSet, HashSet};
use std::fmt;
use std::marker::PhantomData;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use egress_policy::{DefaultAction, Destination, Kind, Policy, TlsInterception};
use ipnet::IpNet;
use serde::de::value::MapAccessDeserializer;
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;

/// The nameserver E2B allows by itself when `allowOut` names a domain ("the
/// default nameserver 8.8.8.8 is automatically allowed"). It is also one of
/// the gateway's reserved resolvers, so the names resolved through it are
/// attributed and the domain allows work.
const E2B_NAMESERVER: IpAddr = IpAddr::V4(Ipv4Addr::new(8, 8, 8, 8));

/// All addresses of both families (E2B's `ALL_TRAFFIC` is the first).
const ALL_TRAFFIC: [IpNet; 2] = [
    IpNet::new_assert(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
    IpNet::new_assert(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0),
];

/// The E2B create body fields we read.
///
/// Parsed through a private raw struct that also accepts (and checks the
/// type of) E2B's other documented create fields, `envVars`, `secure` and
/// `autoPause`, which the translation ignores. Unknown fields are refused.
#[derive(Debug, Clone, PartialEq)]
pub struct E2bCreate {
    pub template_id: String,
    pub timeout: Option<u64>,
    pub metadata: Option<serde_json::Map<String, serde_json::Value>>,
    pub allow_internet_access: Option<bool>,
    pub network: Option<E2bNetwork>,
}

/// E2B's `network` object: IPs, CIDRs and (in `allowOut`) domain names.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct E2bNetwork {
    #[serde(default)]
    pub allow_out: Vec<String>,
    #[serde(default)]
    pub deny_out: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum E2bError {
    /// The body is not a valid create (bad JSON, unknown field, bad value): names the field and value.
    #[error("{0}")]
    Invalid(String),
    /// The request is valid E2B but our model cannot express it exactly: says why.
    #[error("cannot translate exactly: {0}")]
    Inexact(String),
}

/// Every field of the create body, as E2B names it.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawCreate {
    #[serde(rename = "templateID")]
    template_id: String,
    #[serde(default)]
    timeout: Option<u64>,
    #[serde(default)]
    metadata: Option<UniqueKeys<serde_json::Value>>,
    #[serde(default, rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    #[serde(default)]
    network: Option<ObjectOnly<E2bNetwork>>,
    // Accepted (and type-checked) so E2B clients work unchanged; the egress
    // policy has no use for them.
    #[serde(default)]
    #[allow(dead_code)]
    env_vars: Option<UniqueKeys<String>>,
    #[serde(default)]
    #[allow(dead_code)]
    secure: Option<bool>,
    #[serde(default)]
    #[allow(dead_code)]
    auto_pause: Option<bool>,
}

/// A `T` read only from a JSON object: serde's derived structs also accept
/// an array of the fields in order, a shape nobody writes on purpose.
struct ObjectOnly<T>(T);

/// A JSON object whose keys are all different: serde_json's `Map` would
/// silently keep the last of two.
struct UniqueKeys<V>(Vec<(String, V)>);

/// One validated `allowOut` / `denyOut` entry and where it was written.
struct Entry<'a> {
    field: &'static str,
    index: usize,
    raw: &'a str,
    dest: Destination,
}

// === impl E2bCreate ===

impl<'de> Deserialize<'de> for E2bCreate {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let ObjectOnly(raw) = ObjectOnly::<RawCreate>::deserialize(d)?;
        Ok(raw.into())
    }
}

impl From<RawCreate> for E2bCreate {
    fn from(raw: RawCreate) -> Self {
        // Listed so a new field is a decision here, not a silent drop.
        let RawCreate {
            template_id,
            timeout,
            metadata,
            allow_internet_access,
            network,
            env_vars: _,
            secure: _,
            auto_pause: _,
        } = raw;
        Self {
            template_id,
            timeout,
            metadata: metadata.map(|UniqueKeys(entries)| entries.into_iter().collect()),
            allow_internet_access,
            network: network.map(|ObjectOnly(n)| n),
        }
    }
}

// === impl ObjectOnly / UniqueKeys ===

impl<'de, T: Deserialize<'de>> Deserialize<'de> for ObjectOnly<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ObjectVisitor<T>(PhantomData<T>);

        impl<'de, T: Deserialize<'de>> Visitor<'de> for ObjectVisitor<T> {
            type Value = T;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object")
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(MapAccessDeserializer::new(map))
            }
        }

        d.deserialize_map(ObjectVisitor(PhantomData)).map(Self)
    }
}

impl<'de, V: Deserialize<'de>> Deserialize<'de> for UniqueKeys<V> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct EntriesVisitor<V>(PhantomData<V>);

        impl<'de, V: Deserialize<'de>> Visitor<'de> for EntriesVisitor<V> {
            type Value = UniqueKeys<V>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut seen = BTreeSet::new();
                let mut out = Vec::new();
                while let Some((key, value)) = map.next_entry::<String, V>()? {
                    if !seen.insert(key.clone()) {
                        return Err(de::Error::custom(format!("duplicate key {key:?}")));
                    }
                    out.push((key, value));
                }
                Ok(UniqueKeys(out))
            }
        }

        d.deserialize_map(EntriesVisitor(PhantomData))
    }
}

// === parse / translate ===

/// Parses a create body; the error names the field (`network.allowOut[1]`) and the value.
pub fn parse(body: &[u8]) -> Result<E2bCreate, E2bError> {
    let text = std::str::from_utf8(body)
        .map_err(|e| E2bError::Invalid(format!("the body is not UTF-8: {e}")))?;
    egress_policy::from_json(text).map_err(|e| E2bError::Invalid(e.to_string()))
}

/// Translates an E2B network update body (`PUT /sandboxes/{id}/network`:
/// `{"allowOut": [...], "denyOut": [...]}`, optionally with
/// `allow_internet_access`) the way a create's `network` is translated.
pub fn translate_network(body: &serde_json::Value) -> Result<Policy, E2bError> {
    let mut network = body.clone();
    let internet = match network.as_object_mut() {
        Some(map) => match map.remove("allow_internet_access") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::Bool(b)) => Some(b),
            Some(other) => {
                return Err(E2bError::Invalid(format!(
                    "allow_internet_access: expected a boolean, got {other}"
                )))
            }
        },
        None => return Err(E2bError::Invalid("the body must be a JSON object".into())),
    };
    let network: E2bNetwork = egress_policy::from_json(&network.to_string())
        .map_err(|e| E2bError::Invalid(format!("network: {e}")))?;
    translate(&E2bCreate {
        template_id: String::new(),
        timeout: None,
        metadata: None,
        allow_internet_access: internet,
        network: Some(network),
    })
}

/// Translates the create's network settings into an equivalent tenant policy
/// (see the module docs), or says why there is none.
///
/// `tls_interception` stays off and the exemptions empty: the API composes
/// the deployment's afterwards.
pub fn translate(create: &E2bCreate) -> Result<Policy, E2bError> {
    let (allow_out, deny_out) = match &create.network {
        Some(n) => (n.allow_out.as_slice(), n.deny_out.as_slice()),
        None => (&[][..], &[][..]),
    };
    let allow = entries("allowOut", allow_out)?;
    let deny = entries("denyOut", deny_out)?;
    let internet = create.allow_internet_access.unwrap_or(true);
    if !internet || covers_all_traffic(&addresses(&deny)) {
        return Ok(deny_by_default(&allow));
    }
    allow_by_default(&allow, &deny)
}

/// `default: deny` with the `allowOut` entries (and E2B's nameserver when a
/// domain needs it).
fn deny_by_default(allow: &[Entry<'_>]) -> Policy {
    let mut list: Vec<Destination> = allow.iter().map(|e| e.dest.clone()).collect();
    let nameserver_covered = addresses(allow).iter().any(|n| n.contains(&E2B_NAMESERVER));
    if names_a_domain(allow) && !nameserver_covered {
        list.push(Destination::Ip(E2B_NAMESERVER));
    }
    policy(DefaultAction::Deny, list, Vec::new())
}

/// `default: allow` with `denyOut` minus `allowOut` as denies, or `Inexact`
/// when a name would have to beat an address (or the other way round).
fn allow_by_default(allow: &[Entry<'_>], deny: &[Entry<'_>]) -> Result<Policy, E2bError> {
    let mut granted = addresses(allow);
    if names_a_domain(allow) {
        granted.push(IpNet::from(E2B_NAMESERVER));
    }
    let mut denied: Vec<Destination> = difference(&addresses(deny), &granted)
        .ok_or_else(|| {
            E2bError::Invalid(format!(
                "network.denyOut: less the allowOut addresses, more than {MAX_PIECES} networks \
                 (each address allowed inside a denied network splits it by up to 128)"
            ))
        })?
        .into_iter()
        .filter(|n| !is_ipv4_mapped(n))
        .map(net_destination)
        .collect();
    let deny_names: Vec<&Entry<'_>> = deny.iter().filter(|e| e.dest.is_name()).collect();
    if let (Some(name), false) = (deny_names.first(), allow.is_empty()) {
        return Err(E2bError::Inexact(format!(
            "{name}: a domain deny would also block the allowOut addresses that belong to it, \
             which E2B allows (allowOut wins over denyOut there; here a deny always wins)"
        )));
    }
    denied.extend(deny_names.iter().map(|e| e.dest.clone()));
    let allow_name = allow.iter().find(|e| e.dest.is_name());
    if let (Some(name), false) = (allow_name, denied.is_empty()) {
        return Err(E2bError::Inexact(format!(
            "{name}: a domain allow cannot take precedence over the address denies this \
             network needs (here a deny always wins); it is exact when denyOut covers all \
             traffic (0.0.0.0/0 and ::/0) or internet access is off"
        )));
    }
    // Domain allows, if any, are redundant here: nothing they name is denied.
    Ok(policy(DefaultAction::Allow, Vec::new(), denied))
}

fn policy(default: DefaultAction, allow: Vec<Destination>, deny: Vec<Destination>) -> Policy {
    Policy {
        default,
        allow: allow.into_iter().map(Into::into).collect(),
        deny: deny.into_iter().map(Into::into).collect(),
        tls_interception: TlsInterception::Off,
        tls_interception_exemptions: Vec::new(),
        dns: None,
        budgets: Default::default(),
    }
}

// === entries ===

impl fmt::Display for Entry<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "network.{}[{}] {:?}", self.field, self.index, self.raw)
    }
}

/// Validates one list, dropping repeats (the first occurrence stays, in order).
fn entries<'a>(field: &'static str, raw: &'a [String]) -> Result<Vec<Entry<'a>>, E2bError> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for (index, value) in raw.iter().enumerate() {
        let dest = parse_entry(value)
            .map_err(|why| E2bError::Invalid(format!("network.{field}[{index}]: {why}")))?;
        if seen.insert(dest.clone()) {
            out.push(Entry {
                field,
                index,
                raw: value,
                dest,
            });
        }
    }
    Ok(out)
}

/// Reads an address, a CIDR (host bits must be clear), a domain or a
/// wildcard domain, in the project's normal form; a single-address CIDR is
/// written as an `ip`.
fn parse_entry(value: &str) -> Result<Destination, String> {
    let kind = if value.contains('/') {
        Kind::Cidr
    } else if value.parse::<IpAddr>().is_ok() {
        Kind::Ip
    } else if value.starts_with('*') {
        Kind::WildcardDomain
    } else {
        Kind::Domain
    };
    match Destination::parse(kind, value) {
        Ok(Destination::Cidr(net)) => Ok(net_destination(net)),
        Ok(dest) => Ok(dest),
        Err(egress_policy::DestinationError::Domain { value, reason }) => Err(format!(
            "{value:?} is not an IP address, a CIDR or a domain name: {reason}"
        )),
        Err(e) => Err(e.to_string()),
    }
}

/// The IP and CIDR entries as networks.
fn addresses(list: &[Entry<'_>]) -> Vec<IpNet> {
    list.iter()
        .filter_map(|e| match e.dest {
            Destination::Ip(ip) => Some(IpNet::from(ip)),
            Destination::Cidr(net) => Some(net),
            Destination::Domain(_) | Destination::WildcardDomain(_) => None,
        })
        .collect()
}

fn names_a_domain(list: &[Entry<'_>]) -> bool {
    list.iter().any(|e| e.dest.is_name())
}

/// A network as a destination: one address is an `ip`, more a `cidr`.
fn net_destination(net: IpNet) -> Destination {
    if net.prefix_len() == net.max_prefix_len() {
        Destination::Ip(net.addr())
    } else {
        Destination::Cidr(net)
    }
}

/// Whether `net` lies inside `::ffff:0:0/96`. Flows to those addresses are
/// matched as the IPv4 address they map (and such a CIDR's normal form *is*
/// the IPv4 range), so an IPv6 piece there would deny nothing as written and
/// all of IPv4 once normalised: it is left out.
fn is_ipv4_mapped(net: &IpNet) -> bool {
    match net {
        IpNet::V6(v6) => v6.prefix_len() >= 96 && v6.network().to_ipv4_mapped().is_some(),
        IpNet::V4(_) => false,
    }
}

/// Whether `deny` is E2B's "all traffic": all of IPv4 (`ALL_TRAFFIC` in
/// E2B is `0.0.0.0/0`, and its sandboxes have no IPv6). The translation then
/// denies IPv6 too — failing closed where E2B's model is silent — so that
/// E2B's documented "allow a domain, deny all traffic" translates exactly.
fn covers_all_traffic(deny: &[IpNet]) -> bool {
    difference(&ALL_TRAFFIC[..1], deny).is_some_and(|rest| rest.is_empty())
}

// === CIDR sets ===

/// The most networks a difference may come to: more than a policy of
/// [`egress_api::body::MAX_BODY`] bytes could hold (each takes more than
/// 16 bytes). Without a bound a body of 60,000 addresses allowed inside
/// one denied IPv6 network came to millions of networks before any size
/// check.
const MAX_PIECES: usize = egress_api::body::MAX_BODY / 16;

/// The addresses in some network of `a` and in none of `b`, as the fewest
/// canonical CIDRs, sorted (IPv4 first); `None` past [`MAX_PIECES`]
/// networks. Families never mix: an IPv4 network only ever loses IPv4
/// addresses.
fn difference(a: &[IpNet], b: &[IpNet]) -> Option<Vec<IpNet>> {
    let holes = IpNet::aggregate(&b.to_vec());
    let mut out = Vec::new();
    for net in IpNet::aggregate(&a.to_vec()) {
        subtract(net, &holes, &mut out)?;
    }
    Some(IpNet::aggregate(&out))
}

/// Pushes the parts of `net` outside `holes` onto `out`. `holes` is sorted
/// and disjoint (as `IpNet::aggregate` returns it), so the holes overlapping
/// `net` are one run found by binary search, and a hole containing `net` is
/// the only one overlapping it. Splitting `net` in halves down to each hole
/// yields at most (hole prefix − `net` prefix) pieces per hole.
/// `None` once `out` holds more than [`MAX_PIECES`].
fn subtract(net: IpNet, holes: &[IpNet], out: &mut Vec<IpNet>) -> Option<()> {
    let start = holes.partition_point(|h| h.broadcast() < net.network());
    let end = holes.partition_point(|h| h.network() <= net.broadcast());
    let overlapping = holes.get(start..end).unwrap_or(&[]);
    match overlapping.first() {
        None if out.len() >= MAX_PIECES => return None,
        None => out.push(net),
        Some(hole) if hole.contains(&net) => {}
        Some(_) => {
            // Some hole lies strictly inside `net`, so `net` is not a single
            // address and has two halves.
            if let Ok(halves) = net.subnets(net.prefix_len().saturating_add(1)) {
                for half in halves {
                    subtract(half, overlapping, out)?;
                }
            }
        }
    }
    Some(())
}

#[cfg(test)]
mod tests;
