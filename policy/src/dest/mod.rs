//! Destinations (`{"ip": ..}`, `{"cidr": ..}`, `{"domain": ..}`,
//! `{"wildcard_domain": ..}`) and their normal form.
//!
//! Which kinds a list accepts depends on where it is: tenant policies accept
//! all four, operator profiles IP, CIDR and domain, deployment exemptions
//! domain and wildcard domain. The wrappers [`ProfileDestination`] and
//! [`ExemptionDestination`] carry that restriction in their type, so a parsed
//! value can never hold a kind its context refuses.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::ser::{SerializeMap, Serializer};
use serde::{Deserialize, Serialize};

use crate::name::{Hostname, NameError, WildcardDomain};

/// One destination in normal form.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Destination {
    Ip(IpAddr),
    Cidr(IpNet),
    Domain(Hostname),
    WildcardDomain(WildcardDomain),
}

/// The selector (JSON key) of a destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Ip,
    Cidr,
    Domain,
    WildcardDomain,
}

/// Why a destination object was refused. Every message names the value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DestinationError {
    #[error("expected an object with exactly one of {expected}")]
    Shape { expected: KindList },
    #[error("duplicate key {key:?}")]
    DuplicateKey { key: String },
    #[error("unsupported selector {selector:?}: expected one of {expected}")]
    UnsupportedSelector {
        selector: String,
        expected: KindList,
    },
    #[error("{kind} destinations are not accepted here: expected one of {expected}")]
    KindNotAccepted { kind: Kind, expected: KindList },
    #[error("invalid ip {value:?}: expected an IPv4 or IPv6 address without prefix or port")]
    Ip { value: String },
    #[error("invalid cidr {value:?}: expected address/prefix-length, e.g. 203.0.113.0/24")]
    Cidr { value: String },
    #[error("cidr {value:?} has host bits set: did you mean {canonical:?}?")]
    CidrHostBits { value: String, canonical: String },
    #[error("invalid domain {value:?}: {reason}")]
    Domain { value: String, reason: NameError },
    #[error("invalid wildcard_domain {value:?}: {reason}")]
    Wildcard { value: String, reason: NameError },
}

/// A set of accepted kinds, displayed as `ip, cidr, domain`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KindList(&'static [Kind]);

pub(crate) const ALL_KINDS: KindList =
    KindList(&[Kind::Ip, Kind::Cidr, Kind::Domain, Kind::WildcardDomain]);
pub(crate) const PROFILE_KINDS: KindList = KindList(&[Kind::Ip, Kind::Cidr, Kind::Domain]);
pub(crate) const EXEMPTION_KINDS: KindList = KindList(&[Kind::Domain, Kind::WildcardDomain]);

/// A destination accepted in an operator profile (IP, CIDR or exact domain).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ProfileDestination(Destination);

/// A destination accepted in `SPACE_TLS_INTERCEPTION_EXEMPTIONS` (domain or wildcard domain).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ExemptionDestination(Destination);

// === impl Kind ===

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ip => "ip",
            Self::Cidr => "cidr",
            Self::Domain => "domain",
            Self::WildcardDomain => "wildcard_domain",
        }
    }

    pub(crate) fn from_key(key: &str) -> Option<Self> {
        Some(match key {
            "ip" => Self::Ip,
            "cidr" => Self::Cidr,
            "domain" => Self::Domain,
            "wildcard_domain" => Self::WildcardDomain,
            _ => return None,
        })
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl KindList {
    fn contains(self, kind: Kind) -> bool {
        self.0.contains(&kind)
    }
}

impl fmt::Display for KindList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, k) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            f.write_str(k.as_str())?;
        }
        Ok(())
    }
}

// === impl Destination ===

impl Destination {
    /// Parses the value of one selector into normal form.
    pub fn parse(kind: Kind, value: &str) -> Result<Self, DestinationError> {
        match kind {
            Kind::Ip => value
                .parse::<IpAddr>()
                .map(|ip| Self::Ip(canonical_ip(ip)))
                .map_err(|_| DestinationError::Ip {
                    value: value.into(),
                }),
            Kind::Cidr => {
                // A number with a leading zero (`010.0.0.0/8`, `/08`) reads
                // as octal to inet_aton, as decimal to ipnet: refused, as
                // `ip` refuses it.
                let padded = |n: &str| n.len() > 1 && n.starts_with('0');
                let (addr, len) = value.split_once('/').unwrap_or((value, ""));
                let dotted = addr.rsplit(':').next().unwrap_or(addr);
                if padded(len) || (dotted.contains('.') && dotted.split('.').any(padded)) {
                    return Err(DestinationError::Cidr {
                        value: value.into(),
                    });
                }
                let net = value.parse::<IpNet>().map_err(|_| DestinationError::Cidr {
                    value: value.into(),
                })?;
                if net.trunc() != net {
                    return Err(DestinationError::CidrHostBits {
                        value: value.into(),
                        canonical: net.trunc().to_string(),
                    });
                }
                Ok(Self::Cidr(canonical_net(net)))
            }
            Kind::Domain => Hostname::parse(value).map(Self::Domain).map_err(|reason| {
                DestinationError::Domain {
                    value: value.into(),
                    reason,
                }
            }),
            Kind::WildcardDomain => WildcardDomain::parse(value)
                .map(Self::WildcardDomain)
                .map_err(|reason| DestinationError::Wildcard {
                    value: value.into(),
                    reason,
                }),
        }
    }

    pub fn kind(&self) -> Kind {
        match self {
            Self::Ip(_) => Kind::Ip,
            Self::Cidr(_) => Kind::Cidr,
            Self::Domain(_) => Kind::Domain,
            Self::WildcardDomain(_) => Kind::WildcardDomain,
        }
    }

    /// The selector's value in normal form (`203.0.113.0/24`, `*.relay.example.test`).
    pub fn value(&self) -> String {
        match self {
            Self::Ip(ip) => ip.to_string(),
            Self::Cidr(net) => net.to_string(),
            Self::Domain(h) => h.to_string(),
            Self::WildcardDomain(w) => w.to_string(),
        }
    }

    /// Whether this destination names hosts (domain or wildcard) rather than addresses.
    pub fn is_name(&self) -> bool {
        matches!(self, Self::Domain(_) | Self::WildcardDomain(_))
    }
}

/// An IPv4-mapped IPv6 address (`::ffff:a.b.c.d`) *is* the IPv4 address.
pub(crate) fn canonical_ip(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => ip,
        },
        v4 => v4,
    }
}

/// `::ffff:0:0/104` is written `0.0.0.0/8`: the mapped range is the IPv4 range.
fn canonical_net(net: IpNet) -> IpNet {
    match net {
        IpNet::V6(v6) if v6.prefix_len() >= 96 => match v6.network().to_ipv4_mapped() {
            Some(v4) => ipnet::Ipv4Net::new(v4, v6.prefix_len() - 96)
                .map(IpNet::V4)
                .unwrap_or(net),
            None => net,
        },
        other => other,
    }
}

/// The IPv4 address an IPv6 address stands for, when it embeds one:
/// IPv4-mapped (`::ffff:a.b.c.d`) or NAT64 well-known prefix (`64:ff9b::/96`).
pub fn embedded_ipv4(ip: IpAddr) -> Option<Ipv4Addr> {
    let IpAddr::V6(v6) = ip else { return None };
    if let Some(v4) = v6.to_ipv4_mapped() {
        return Some(v4);
    }
    const NAT64: Ipv6Addr = Ipv6Addr::new(0x64, 0xff9b, 0, 0, 0, 0, 0, 0);
    let o = v6.octets();
    (o[..12] == NAT64.octets()[..12]).then(|| Ipv4Addr::new(o[12], o[13], o[14], o[15]))
}

impl fmt::Display for Destination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.kind(), self.value())
    }
}

impl Serialize for Destination {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(1))?;
        map.serialize_entry(self.kind().as_str(), &self.value())?;
        map.end()
    }
}

impl<'de> Deserialize<'de> for Destination {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(DestinationVisitor(ALL_KINDS))
    }
}

/// Reads `{"<kind>": "<value>"}` and nothing else, accepting only `.0`'s kinds.
struct DestinationVisitor(KindList);

impl<'de> Visitor<'de> for DestinationVisitor {
    type Value = Destination;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "an object with exactly one of {}", self.0)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Destination, A::Error> {
        let shape = || de::Error::custom(DestinationError::Shape { expected: self.0 });
        let key: String = map.next_key()?.ok_or_else(shape)?;
        let Some(kind) = Kind::from_key(&key) else {
            return Err(de::Error::custom(DestinationError::UnsupportedSelector {
                selector: key,
                expected: self.0,
            }));
        };
        if !self.0.contains(kind) {
            return Err(de::Error::custom(DestinationError::KindNotAccepted {
                kind,
                expected: self.0,
            }));
        }
        let value: String = map.next_value()?;
        if let Some(extra) = map.next_key::<String>()? {
            // A second key is either a duplicate or another selector (`port`,
            // a second kind): both are refused, never silently merged.
            return Err(match Kind::from_key(&extra) {
                Some(_) if extra == key => {
                    de::Error::custom(DestinationError::DuplicateKey { key: extra })
                }
                Some(_) => shape(),
                None => de::Error::custom(DestinationError::UnsupportedSelector {
                    selector: extra,
                    expected: self.0,
                }),
            });
        }
        Destination::parse(kind, &value).map_err(de::Error::custom)
    }
}

// === impl ProfileDestination / ExemptionDestination ===

macro_rules! restricted {
    ($ty:ident, $kinds:expr) => {
        impl $ty {
            pub fn get(&self) -> &Destination {
                &self.0
            }
            pub fn into_inner(self) -> Destination {
                self.0
            }
        }

        impl TryFrom<Destination> for $ty {
            type Error = DestinationError;
            fn try_from(d: Destination) -> Result<Self, DestinationError> {
                if $kinds.contains(d.kind()) {
                    Ok(Self(d))
                } else {
                    Err(DestinationError::KindNotAccepted {
                        kind: d.kind(),
                        expected: $kinds,
                    })
                }
            }
        }

        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                d.deserialize_map(DestinationVisitor($kinds)).map(Self)
            }
        }

        impl Serialize for $ty {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                self.0.serialize(s)
            }
        }
    };
}

restricted!(ProfileDestination, PROFILE_KINDS);
restricted!(ExemptionDestination, EXEMPTION_KINDS);

#[cfg(test)]
mod tests;
