//! Verdicts and their reasons.
//!
//! Every verdict names the layer that decided it and, where a rule did, the
//! rule (an index into the list it came from). [`Verdict::code`] gives a
//! bounded label for metrics; [`Verdict::describe`] the readable reason for
//! the flow log and the explain API.

use super::ipset::RuleIdx;
use super::{CompiledPolicy, RuleList, RuleRef};
use crate::stream::{OpaqueStreams, StreamProtocol};

/// What happens to a flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Refused: a `403` after termination, `REFUSED` for DNS, a reset otherwise.
    Deny(Denied),
    /// Allowed plain HTTP or opaque bytes, passed through as they are.
    Allow(Allowed),
    /// Allowed TLS, passed through encrypted end-to-end.
    Splice(Allowed, Spliced),
    /// Allowed TLS, terminated with a minted certificate; HTTP policy applies per request.
    Intercept(Allowed, Intercepted),
}

/// Why a flow was denied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Denied {
    /// A platform deny (gateway configuration), by index into its list.
    Platform(RuleIdx),
    /// A tenant deny, by index into `deny`.
    Tenant(RuleIdx),
    /// `Host` / `:authority` differs from the SNI on a terminated flow (`421`).
    Misdirected,
    /// No allow rule matched and the default is deny.
    NotAllowed(AttributionGap),
    /// The flow's requests cannot be seen (spliced with interception off,
    /// or not HTTP), and a rule or credential for its name needs them.
    Unseen(RuleRef),
    /// DNS over TLS, or DNS over HTTPS the gateway cannot answer (interception
    /// off, or another resolver not allowed by name): the names it would
    /// resolve would never be attributed.
    EncryptedDns,
    /// An opaque stream (of the protocol named, `None`: unreadable) that
    /// `Allowed` would let out, had it been TLS or HTTP: the entry's
    /// `streams` do not name it, or it has none and the gateway's
    /// `opaque_streams` is `deny`.
    Stream(Allowed, Option<StreamProtocol>),
}

/// Why a flow was allowed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Allowed {
    /// An IP or CIDR allow covers the destination, by index into `allow`.
    Address(RuleIdx),
    /// The destination IP is attributed to an allowed name.
    AttributedName(RuleIdx),
    /// The SNI (or `Host` without SNI) names an allowed domain: holds only
    /// once the origin's certificate verifies for that name, so only on a
    /// terminated flow.
    VerifiedName(RuleIdx),
    /// The policy's default is allow.
    Default,
}

/// Why allowed TLS was spliced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spliced {
    /// `tls_interception` is `off`.
    InterceptionOff,
    /// An exemption matched, by index into `tls_interception_exemptions`.
    Exempt(RuleIdx),
}

/// Why allowed TLS was terminated rather than spliced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Intercepted {
    /// No exemption matches the destination or its names.
    NotExempt,
    /// A hostname exemption could have matched but the attribution it needs is missing.
    NoAttribution(AttributionGap),
    /// The flow is allowed only by its SNI/Host claim, which termination verifies.
    NeedsVerification,
    /// An exemption would splice it, but per-request rules or credentials
    /// for its name need its requests.
    RequestRules(RuleRef),
    /// DNS over HTTPS to a reserved resolver: the gateway answers it through
    /// its DNS proxy, and nothing of it is forwarded.
    ReservedResolver,
    /// A hostname exemption (by index into `tls_interception_exemptions`)
    /// matches the outer name, but the ClientHello carries
    /// `encrypted_client_hello`: the name the flow is for may be another.
    Ech(RuleIdx),
}

/// Why name evidence was missing or did not fit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttributionGap {
    /// Nothing matched; attribution was not the issue.
    NoMatch,
    /// This sandbox never resolved a name to this IP through the reserved resolvers.
    #[default]
    NoDnsSeen,
    /// It did, but the answer's TTL has run out.
    Expired,
    /// It did, but the entry was evicted from the bounded cache.
    Evicted,
    /// Names are attributed, but the SNI (or, without one, the `Host`) is not one of them.
    SniMismatch,
}

// === impl Verdict ===

impl Verdict {
    /// Every code [`Verdict::code`] returns: the bounded label set.
    pub const CODES: &'static [&'static str] = &[
        "platform_deny",
        "tenant_deny",
        "misdirected",
        "no_allow_match",
        "no_dns_seen",
        "expired",
        "evicted",
        "sni_mismatch",
        "allow_address",
        "allow_attributed_name",
        "allow_verified_name",
        "allow_default",
        "interception_off",
        "exempt",
        "not_exempt",
        "needs_verification",
        "needs_interception",
        "request_rules",
        "encrypted_dns",
        "doh_answered",
        "ech",
        "unreadable_stream",
    ];

    /// `deny`, `allow`, `splice` or `intercept`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Deny(_) => "deny",
            Self::Allow(_) => "allow",
            Self::Splice(..) => "splice",
            Self::Intercept(..) => "intercept",
        }
    }

    pub fn is_deny(&self) -> bool {
        matches!(self, Self::Deny(_))
    }

    /// The index of the entry that denied, in its list (platform, `deny`,
    /// `allow` or the credentials), when an entry did.
    pub fn deny_rule(&self) -> Option<RuleIdx> {
        match self {
            Self::Deny(Denied::Platform(super::HOST_ADDRESS | super::REGISTERED_ADDRESS)) => None,
            Self::Deny(Denied::Platform(r) | Denied::Tenant(r)) => Some(*r),
            Self::Deny(Denied::Unseen(r)) => Some(r.index()),
            Self::Deny(Denied::Stream(a, _)) => a.rule(),
            _ => None,
        }
    }

    /// A bounded reason label for metrics and logs.
    pub fn code(&self) -> &'static str {
        match self {
            Self::Deny(Denied::Platform(_)) => "platform_deny",
            Self::Deny(Denied::Tenant(_)) => "tenant_deny",
            Self::Deny(Denied::Misdirected) => "misdirected",
            Self::Deny(Denied::Unseen(_)) => "needs_interception",
            Self::Deny(Denied::EncryptedDns) => "encrypted_dns",
            Self::Deny(Denied::Stream(..)) => "unreadable_stream",
            Self::Deny(Denied::NotAllowed(gap)) => match gap {
                AttributionGap::NoMatch => "no_allow_match",
                g => g.code(),
            },
            Self::Allow(a) => a.code(),
            Self::Splice(_, Spliced::InterceptionOff) => "interception_off",
            Self::Splice(_, Spliced::Exempt(_)) => "exempt",
            Self::Intercept(_, Intercepted::NotExempt) => "not_exempt",
            Self::Intercept(_, Intercepted::NoAttribution(gap)) => gap.code(),
            Self::Intercept(_, Intercepted::NeedsVerification) => "needs_verification",
            Self::Intercept(_, Intercepted::RequestRules(_)) => "request_rules",
            Self::Intercept(_, Intercepted::ReservedResolver) => "doh_answered",
            Self::Intercept(_, Intercepted::Ech(_)) => "ech",
        }
    }

    /// The readable reason, naming the rule that decided.
    pub fn describe(&self, policy: &CompiledPolicy) -> String {
        let rule = |list, idx| {
            policy
                .rule(list, idx)
                .unwrap_or_else(|| format!("rule #{idx}"))
        };
        match *self {
            Self::Deny(Denied::Platform(r)) => {
                format!("platform deny: {}", rule(RuleList::Platform, r))
            }
            Self::Deny(Denied::Tenant(r)) => format!("tenant deny: {}", rule(RuleList::Deny, r)),
            Self::Deny(Denied::Misdirected) => {
                "misdirected: Host does not match the TLS server name".into()
            }
            Self::Deny(Denied::Unseen(r)) => format!(
                "{} needs the requests, which this flow does not show (TLS interception off, or not HTTP)",
                policy.describe_rule(r)
            ),
            Self::Deny(Denied::EncryptedDns) => {
                "encrypted DNS (DNS over TLS, or DNS over HTTPS to a resolver the gateway does not answer) that no allow names".into()
            }
            Self::Deny(Denied::NotAllowed(gap)) => match gap {
                AttributionGap::NoMatch => "no allow rule matches and the default is deny".into(),
                g => format!("no allow rule matches: {}", g.describe()),
            },
            Self::Deny(Denied::Stream(a, kind)) => describe_stream(policy, a, kind),
            Self::Allow(a) => a.describe(policy),
            Self::Splice(a, Spliced::InterceptionOff) => {
                format!("{}; TLS interception is off", a.describe(policy))
            }
            Self::Splice(a, Spliced::Exempt(r)) => format!(
                "{}; exempt from interception by {}",
                a.describe(policy),
                rule(RuleList::Exemption, r)
            ),
            Self::Intercept(a, Intercepted::RequestRules(r)) => format!(
                "{}; intercepted, not spliced: {} needs the requests",
                a.describe(policy),
                policy.describe_rule(r)
            ),
            Self::Intercept(a, Intercepted::Ech(r)) => format!(
                "{}; intercepted, not spliced: exemption not applied: ech (the ClientHello \
                 carries encrypted_client_hello; {} matches only its outer name)",
                a.describe(policy),
                rule(RuleList::Exemption, r)
            ),
            Self::Intercept(a, why) => {
                format!("{}; intercepted: {}", a.describe(policy), why.describe())
            }
        }
    }
}

/// An opaque stream refused: what it is, what would have allowed it, and why
/// that does not let it through.
fn describe_stream(policy: &CompiledPolicy, a: Allowed, kind: Option<StreamProtocol>) -> String {
    let what = match kind {
        Some(p) => format!("an {p} stream"),
        None => "a stream that is not TLS, HTTP or a protocol the gateway can name".into(),
    };
    let named = a
        .rule()
        .and_then(|r| policy.policy().allow.get(usize::try_from(r).ok()?))
        .and_then(|rule| rule.streams.as_ref());
    let why: &str = match (named, policy.platform().opaque_streams()) {
        (Some(_), _) => "its streams do not name it",
        (None, OpaqueStreams::Deny) => "the gateway's opaque_streams is deny",
        // The sets let every stream through an entry without streams here.
        (None, OpaqueStreams::Allow) => "no entry lets it through",
    };
    format!(
        "unreadable stream: {what}; {}, but {why}",
        a.describe(policy)
    )
}

impl Allowed {
    /// The index of the allow entry, when an entry allowed.
    pub fn rule(&self) -> Option<RuleIdx> {
        match self {
            Self::Address(r) | Self::AttributedName(r) | Self::VerifiedName(r) => Some(*r),
            Self::Default => None,
        }
    }

    fn code(&self) -> &'static str {
        match self {
            Self::Address(_) => "allow_address",
            Self::AttributedName(_) => "allow_attributed_name",
            Self::VerifiedName(_) => "allow_verified_name",
            Self::Default => "allow_default",
        }
    }

    fn describe(&self, policy: &CompiledPolicy) -> String {
        let rule = |idx| {
            policy
                .rule(RuleList::Allow, idx)
                .unwrap_or_else(|| format!("rule #{idx}"))
        };
        match *self {
            Self::Address(r) => format!("allowed by {}", rule(r)),
            Self::AttributedName(r) => format!("allowed by {} (DNS attribution)", rule(r)),
            Self::VerifiedName(r) => {
                format!("allowed by {} (server name, verified upstream)", rule(r))
            }
            Self::Default => "allowed by default".into(),
        }
    }
}

impl Intercepted {
    fn describe(&self) -> String {
        match self {
            Self::NotExempt => "no exemption matches".into(),
            Self::NoAttribution(gap) => format!("no exemption applies: {}", gap.describe()),
            Self::NeedsVerification => {
                "allowed only by the server name, which termination verifies".into()
            }
            Self::RequestRules(r) => format!("{} needs the requests", r.label()),
            Self::ReservedResolver => {
                "DNS over HTTPS to a reserved resolver, answered by the gateway's DNS proxy".into()
            }
            Self::Ech(r) => format!("exemption not applied: ech (exemption #{r})"),
        }
    }
}

impl AttributionGap {
    /// A bounded label: `no_match`, `no_dns_seen`, `expired`, `evicted`, `sni_mismatch`.
    pub fn code(&self) -> &'static str {
        match self {
            Self::NoMatch => "no_match",
            Self::NoDnsSeen => "no_dns_seen",
            Self::Expired => "expired",
            Self::Evicted => "evicted",
            Self::SniMismatch => "sni_mismatch",
        }
    }

    fn describe(&self) -> &'static str {
        match self {
            Self::NoMatch => "no rule matches",
            Self::NoDnsSeen => {
                "no DNS answer through the reserved resolvers attributes a name to this address"
            }
            Self::Expired => "the DNS attribution for this address has expired",
            Self::Evicted => "the DNS attribution for this address was evicted",
            Self::SniMismatch => {
                "the server name is not one of the names attributed to this address"
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_lists_every_code_once() {
        let gaps = [
            AttributionGap::NoMatch,
            AttributionGap::NoDnsSeen,
            AttributionGap::Expired,
            AttributionGap::Evicted,
            AttributionGap::SniMismatch,
        ];
        let allowed = [
            Allowed::Address(0),
            Allowed::AttributedName(0),
            Allowed::VerifiedName(0),
            Allowed::Default,
        ];
        let mut all: Vec<Verdict> = vec![
            Verdict::Deny(Denied::Platform(0)),
            Verdict::Deny(Denied::Tenant(0)),
            Verdict::Deny(Denied::Misdirected),
            Verdict::Splice(Allowed::Default, Spliced::InterceptionOff),
            Verdict::Splice(Allowed::Default, Spliced::Exempt(0)),
            Verdict::Intercept(Allowed::Default, Intercepted::NotExempt),
            Verdict::Intercept(Allowed::Default, Intercepted::NeedsVerification),
            Verdict::Deny(Denied::Unseen(RuleRef::Allow(0))),
            Verdict::Deny(Denied::EncryptedDns),
            Verdict::Intercept(Allowed::Default, Intercepted::ReservedResolver),
            Verdict::Intercept(
                Allowed::Default,
                Intercepted::RequestRules(RuleRef::Deny(0)),
            ),
            Verdict::Intercept(Allowed::Default, Intercepted::Ech(0)),
            Verdict::Deny(Denied::Stream(Allowed::Address(0), None)),
        ];
        all.extend(gaps.map(|g| Verdict::Deny(Denied::NotAllowed(g))));
        all.extend(
            gaps[1..]
                .iter()
                .map(|g| Verdict::Intercept(Allowed::Default, Intercepted::NoAttribution(*g))),
        );
        all.extend(allowed.map(Verdict::Allow));
        let mut seen: Vec<&str> = all.iter().map(Verdict::code).collect();
        seen.sort_unstable();
        seen.dedup();
        let mut listed = Verdict::CODES.to_vec();
        listed.sort_unstable();
        assert_eq!(seen, listed);
    }
}
