//! The compiled matcher: one per pushed policy, queried once per flow (and
//! once per request on a terminated flow).
//!
//! Order of decision (DESIGN.md): platform denies, tenant denies, allows or
//! the default, then — for allowed TLS with interception on — exemption
//! (splice) or termination (intercept). Denies always win; an exemption never
//! grants access.
//!
//! Names reach a flow only as evidence (DESIGN.md "How a name reaches a flow"):
//! names attributed by DNS to the destination IP are facts; SNI and `Host`
//! are the client's claims, which count on their own only on a terminated
//! flow, where the gateway verifies the origin's certificate for the name.

mod ipset;
mod names;
mod verdict;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use crate::dest::{canonical_ip, embedded_ipv4, Destination};
use crate::name::Hostname;
use crate::policy::{DefaultAction, Policy, TlsInterception};

use self::ipset::{IpSet, RuleIdx};
use self::names::NameSet;
pub use self::verdict::{Allowed, AttributionGap, Denied, Intercepted, Spliced, Verdict};

/// What the first bytes of a flow showed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// A TLS ClientHello (SNI, if any, in [`Flow::sni`]).
    Tls,
    /// An HTTP/1.x request line (`Host`, if any, in [`Flow::host`]).
    Http,
    /// Anything else.
    Opaque,
}

/// The facts of one flow the matcher decides on.
#[derive(Clone, Copy, Debug)]
pub struct Flow<'a> {
    /// The original destination.
    pub dst: SocketAddr,
    pub protocol: Protocol,
    /// A valid hostname from the ClientHello; an IP literal in SNI is `None`.
    pub sni: Option<&'a Hostname>,
    /// `Host` / `:authority` without port: the request's on a terminated
    /// flow, the request line's for plain HTTP.
    pub host: Option<&'a Hostname>,
    /// Unexpired names this sandbox resolved to `dst`'s IP through the reserved resolvers.
    pub attributed: &'a [Hostname],
    /// Why `attributed` is empty, when it is.
    pub attribution_gap: AttributionGap,
}

/// Platform denies (gateway configuration), compiled once and shared.
#[derive(Debug)]
pub struct PlatformDenies {
    list: Vec<Destination>,
    rules: RuleSet,
}

/// A policy compiled for lookups that never scan rules.
#[derive(Debug)]
pub struct CompiledPolicy {
    policy: Policy,
    platform: Arc<PlatformDenies>,
    deny: RuleSet,
    allow: RuleSet,
    exempt: RuleSet,
}

/// The address and name lookups of one destination list.
#[derive(Debug, Default)]
struct RuleSet {
    ips: IpSet,
    names: NameSet,
}

// === impl RuleSet ===

impl RuleSet {
    fn new(list: &[Destination]) -> Self {
        let mut names = NameSet::default();
        let mut nets = Vec::new();
        for (i, d) in list.iter().enumerate() {
            // A policy list longer than u32::MAX cannot be pushed (bodies are capped).
            let rule = RuleIdx::try_from(i).unwrap_or(RuleIdx::MAX);
            match d {
                Destination::Ip(ip) => nets.push((ipnet::IpNet::from(*ip), rule)),
                Destination::Cidr(net) => nets.push((*net, rule)),
                Destination::Domain(h) => names.insert_exact(h, rule),
                Destination::WildcardDomain(w) => names.insert_wildcard(w, rule),
            }
        }
        Self {
            ips: IpSet::new(nets),
            names,
        }
    }

    /// The rule covering the destination address or the IPv4 address it embeds.
    fn lookup_addr(&self, addrs: &Addrs) -> Option<RuleIdx> {
        self.ips
            .lookup(addrs.ip)
            .or_else(|| addrs.embedded.and_then(|v4| self.ips.lookup(v4)))
    }

    /// The rule matching any piece of name evidence: attributed names, SNI, Host.
    fn lookup_evidence(&self, flow: &Flow<'_>) -> Option<RuleIdx> {
        let evidence = flow.attributed.iter().chain(flow.sni).chain(flow.host);
        self.names.lookup_any(evidence).map(|(_, r)| r)
    }
}

/// The destination address in its canonical form, and the IPv4 address it embeds.
struct Addrs {
    ip: IpAddr,
    embedded: Option<IpAddr>,
}

impl Addrs {
    fn of(dst: SocketAddr) -> Self {
        let ip = canonical_ip(dst.ip());
        Self {
            ip,
            embedded: embedded_ipv4(ip).map(IpAddr::V4),
        }
    }
}

// === impl PlatformDenies ===

impl PlatformDenies {
    pub fn new(list: Vec<Destination>) -> Self {
        let rules = RuleSet::new(&list);
        Self { list, rules }
    }

    /// The built-in list: loopback, link-local and cloud metadata, private
    /// and shared ranges, `0/8`, multicast, `240/4`. The gateway adds its
    /// own addresses.
    pub fn builtin() -> Self {
        Self::new(crate::platform::default_denies())
    }

    pub fn list(&self) -> &[Destination] {
        &self.list
    }
}

// === impl CompiledPolicy ===

impl CompiledPolicy {
    pub fn new(policy: Policy, platform: Arc<PlatformDenies>) -> Self {
        Self {
            deny: RuleSet::new(&policy.deny),
            allow: RuleSet::new(&policy.allow),
            exempt: RuleSet::new(&policy.tls_interception_exemptions),
            platform,
            policy,
        }
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    pub fn platform(&self) -> &PlatformDenies {
        &self.platform
    }

    /// Decides one flow. On a terminated flow the gateway asks again per
    /// request with `host` set; any verdict but `Deny` then lets the request through.
    pub fn decide(&self, flow: &Flow<'_>) -> Verdict {
        let addrs = Addrs::of(flow.dst);
        if let Some(r) = self.platform.rules.lookup_addr(&addrs) {
            return Verdict::Deny(Denied::Platform(r));
        }
        if let Some(r) = self.platform.rules.lookup_evidence(flow) {
            return Verdict::Deny(Denied::Platform(r));
        }
        if let Some(r) = self.deny.lookup_addr(&addrs) {
            return Verdict::Deny(Denied::Tenant(r));
        }
        if let Some(r) = self.deny.lookup_evidence(flow) {
            return Verdict::Deny(Denied::Tenant(r));
        }
        let terminating =
            flow.protocol == Protocol::Tls && self.policy.tls_interception == TlsInterception::On;
        if terminating {
            if let (Some(sni), Some(host)) = (flow.sni, flow.host) {
                if sni != host {
                    return Verdict::Deny(Denied::Misdirected);
                }
            }
        }
        let allowed = match self.allowed(flow, &addrs, terminating) {
            Ok(a) => a,
            Err(gap) => return Verdict::Deny(Denied::NotAllowed(gap)),
        };
        match (flow.protocol, terminating) {
            (Protocol::Http | Protocol::Opaque, _) => Verdict::Allow(allowed),
            (Protocol::Tls, false) => Verdict::Splice(allowed, Spliced::InterceptionOff),
            (Protocol::Tls, true) => self.exemption(flow, &addrs, allowed),
        }
    }

    /// Step 4: the allow rule (or default) that lets the flow out.
    fn allowed(
        &self,
        flow: &Flow<'_>,
        addrs: &Addrs,
        terminating: bool,
    ) -> Result<Allowed, AttributionGap> {
        if let Some(r) = self.allow.lookup_addr(addrs) {
            return Ok(Allowed::Address(r));
        }
        let names = &self.allow.names;
        let attributed_allowed = names.lookup_any(flow.attributed);
        let claim = match flow.protocol {
            Protocol::Tls => flow.sni,
            Protocol::Http => flow.host,
            Protocol::Opaque => None,
        };
        let claim_attributed = claim.is_none_or(|c| flow.attributed.contains(c));
        let by_attribution = match (flow.protocol, claim) {
            // Plain HTTP: the Host itself must be allowed and attributed.
            (Protocol::Http, Some(host)) if claim_attributed => names.lookup(host),
            (Protocol::Http, Some(_)) => None,
            // Spliced, opaque, or TLS before termination: an attributed name
            // is allowed, and the SNI is one of the attributed names.
            _ if claim_attributed => attributed_allowed.map(|(_, r)| r),
            _ => None,
        };
        if let Some(r) = by_attribution {
            return Ok(Allowed::AttributedName(r));
        }
        if self.policy.default == DefaultAction::Allow {
            return Ok(Allowed::Default);
        }
        if terminating {
            // The claim stands once the upstream certificate verifies for it.
            let claimed = flow.sni.or(flow.host);
            if let Some(r) = claimed.and_then(|n| names.lookup(n)) {
                return Ok(Allowed::VerifiedName(r));
            }
        }
        Err(if names.is_empty() {
            AttributionGap::NoMatch
        } else if flow.attributed.is_empty() {
            flow.attribution_gap
        } else if attributed_allowed.is_some() && !claim_attributed {
            AttributionGap::SniMismatch
        } else {
            AttributionGap::NoMatch
        })
    }

    /// Step 5: splice an exempted stream, else terminate it.
    fn exemption(&self, flow: &Flow<'_>, addrs: &Addrs, allowed: Allowed) -> Verdict {
        if let Allowed::VerifiedName(_) = allowed {
            // Only termination verifies the claim; splicing would trust it.
            return Verdict::Intercept(allowed, Intercepted::NeedsVerification);
        }
        if let Some(r) = self.exempt.lookup_addr(addrs) {
            return Verdict::Splice(allowed, Spliced::Exempt(r));
        }
        let names = &self.exempt.names;
        if names.is_empty() {
            return Verdict::Intercept(allowed, Intercepted::NotExempt);
        }
        let Some((_, rule)) = names.lookup_any(flow.attributed) else {
            let sni_could_match = flow.sni.is_none_or(|s| names.lookup(s).is_some());
            let why = if flow.attributed.is_empty() && sni_could_match {
                Intercepted::NoAttribution(flow.attribution_gap)
            } else {
                Intercepted::NotExempt
            };
            return Verdict::Intercept(allowed, why);
        };
        let sni_ok = flow
            .sni
            .is_none_or(|s| flow.attributed.contains(s) && names.lookup(s).is_some());
        if sni_ok {
            Verdict::Splice(allowed, Spliced::Exempt(rule))
        } else {
            Verdict::Intercept(
                allowed,
                Intercepted::NoAttribution(AttributionGap::SniMismatch),
            )
        }
    }

    /// The destination a rule index refers to, for reasons and logs.
    pub(crate) fn rule(&self, list: RuleList, idx: RuleIdx) -> Option<&Destination> {
        let list = match list {
            RuleList::Platform => &self.platform.list,
            RuleList::Deny => &self.policy.deny,
            RuleList::Allow => &self.policy.allow,
            RuleList::Exemption => &self.policy.tls_interception_exemptions,
        };
        list.get(usize::try_from(idx).ok()?)
    }
}

/// Which list a rule index points into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RuleList {
    Platform,
    Deny,
    Allow,
    Exemption,
}

#[cfg(test)]
mod tests;
