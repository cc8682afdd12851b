//! The compiled matcher: one per pushed policy, queried once per flow (and
//! once per request on a terminated flow).
//!
//! Order of decision (docs/policy.md): platform denies, tenant denies, allows or
//! the default, then — for allowed TLS with interception on — exemption
//! (splice) or termination (intercept). Denies always win; an exemption never
//! grants access.
//!
//! Names reach a flow only as evidence (docs/evidence.md):
//! names attributed by DNS to the destination IP are facts; SNI and `Host`
//! are the client's claims, which count on their own only on a terminated
//! flow, where the gateway verifies the origin's certificate for the name.

mod ipset;
mod names;
mod query;
mod request;
mod streams;
mod verdict;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use crate::dest::{canonical_ip, embedded_ipv4, Destination};
use crate::name::Hostname;
use crate::policy::{DefaultAction, Policy, TlsInterception};
use crate::rule::Rule;
use crate::stream::{OpaqueStreams, StreamProtocol};
use time::OffsetDateTime;

use self::ipset::{IpSet, RuleIdx};
use self::names::NameSet;
pub use self::query::NameVerdict;
use self::request::RequestRules;
pub use self::request::{RequestCode, RequestDenial, RequestJudgement, RuleRef};
use self::streams::StreamSets;
pub use self::verdict::{Allowed, AttributionGap, Denied, Intercepted, Spliced, Verdict};

/// What the first bytes of a flow showed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// A TLS ClientHello (SNI, if any, in [`Flow::sni`]).
    Tls,
    /// An HTTP/1.x request line (`Host`, if any, in [`Flow::host`]).
    Http,
    /// Anything else: a stream the gateway cannot read, with the protocol
    /// its first bytes name (`None`: none it recognises).
    Opaque(Option<StreamProtocol>),
    /// A DNS query to a reserved resolver, which the gateway's own DNS proxy
    /// reads and answers (its admission).
    Dns,
}

impl Protocol {
    /// `tls`, `http`, `dns`, a stream protocol's name (`ssh`), or `opaque`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Tls => "tls",
            Self::Http => "http",
            Self::Dns => "dns",
            Self::Opaque(Some(p)) => p.as_str(),
            Self::Opaque(None) => "opaque",
        }
    }
}

/// A TLS flow that carries DNS the gateway would not otherwise see: the
/// gateway tells which (it keeps the list of well-known DoH servers), the
/// matcher decides what becomes of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EncryptedDns {
    /// To a reserved resolver's HTTPS port: DNS over HTTPS, answered by the
    /// gateway itself when interception is on; refused when it is off.
    ReservedDoh,
    /// DNS over TLS (port 853), to any address.
    Dot,
    /// A stream to port 53 that reached the transparent listener: DNS over
    /// TCP the DNS proxy never got (any protocol the peek reads there).
    TcpDns,
    /// To a well-known DoH server, by its SNI or an attributed name.
    KnownDoh,
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
    /// The flow is DNS the gateway would not see, and which.
    pub encrypted_dns: Option<EncryptedDns>,
    /// The ClientHello carries an `encrypted_client_hello` extension (real
    /// or GREASE: they look alike), so the name it is really for may be
    /// encrypted inside it. `sni` is then the outer name only, and no
    /// hostname exemption splices the flow.
    pub ech: bool,
}

/// Platform denies (gateway configuration), compiled once and shared.
#[derive(Debug)]
pub struct PlatformDenies {
    list: Vec<Destination>,
    /// The host's own addresses as the gateway last read them from the
    /// kernel ([`PlatformDenies::set_host`]), sorted: an address the host
    /// gains while the gateway runs (a renumbering, a new IPv6 temporary
    /// address) is denied from the next reading on.
    host: arc_swap::ArcSwap<Vec<IpAddr>>,
    /// Whether an address belongs to a sandbox or a VM on this gateway
    /// ([`PlatformDenies::set_registered`]): the gateway dials from the
    /// host, so one sandbox reaching another's address would reach it past
    /// both their policies.
    registered: arc_swap::ArcSwap<Registered>,
    /// Counts the changes of `host` and `registered`
    /// ([`PlatformDenies::changes`]).
    changes: std::sync::atomic::AtomicU64,
    rules: RuleSet,
    /// The gateway's `policy.opaque_streams`: a setting of the operator's,
    /// compiled into every sandbox's policy like the list.
    opaque_streams: OpaqueStreams,
}

/// The index of a platform deny of one of the host's own addresses: they
/// are read from the kernel while the gateway runs, not listed.
pub(crate) const HOST_ADDRESS: RuleIdx = RuleIdx::MAX;

/// The index of a platform deny of a sandbox's or a VM's address on this
/// gateway: registered while it runs, not listed.
pub(crate) const REGISTERED_ADDRESS: RuleIdx = RuleIdx::MAX - 1;

/// Which addresses belong to sandboxes or VMs on this gateway (its registry
/// answers; nothing is registered by default).
pub(crate) struct Registered(Box<dyn Fn(IpAddr) -> bool + Send + Sync>);

impl std::fmt::Debug for Registered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Registered")
    }
}

/// A policy compiled for lookups that never scan rules.
#[derive(Debug)]
pub struct CompiledPolicy {
    policy: Policy,
    platform: Arc<PlatformDenies>,
    /// Unqualified denies (a qualified one denies requests, not flows).
    deny: RuleSet,
    allow: RuleSet,
    /// The allows for a flow whose requests cannot be seen: without the
    /// entries whose qualifier is enforced. `None`: the same as `allow`.
    allow_unseen: Option<RuleSet>,
    /// The allows for opaque streams, by kind; `None`: the same as the
    /// allows for a flow whose requests cannot be seen.
    streams: Option<Box<StreamSets>>,
    exempt: RuleSet,
    /// Qualified entries and credential hosts; `None` when there are none.
    requests: Option<Box<RequestRules>>,
    /// The names of the sandbox's credentials, by index.
    credentials: Vec<String>,
    /// When the next allow entry in force lapses (its `until`): the policy
    /// is to be compiled again then.
    next_expiry: Option<OffsetDateTime>,
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
        Self::of(list.iter().enumerate())
    }

    /// The entries of `list` in force at `now` that `keep` keeps, by their
    /// index in `list`.
    fn rules(list: &[Rule], now: OffsetDateTime, keep: impl Fn(&Rule) -> bool) -> Self {
        Self::of(
            list.iter()
                .enumerate()
                .filter(|(_, r)| r.in_force(now) && keep(r))
                .map(|(i, r)| (i, &r.dest)),
        )
    }

    fn of<'a>(list: impl Iterator<Item = (usize, &'a Destination)>) -> Self {
        let mut names = NameSet::default();
        let mut nets = Vec::new();
        for (i, d) in list {
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
        Self {
            list,
            host: arc_swap::ArcSwap::default(),
            registered: arc_swap::ArcSwap::from_pointee(Registered(Box::new(|_| false))),
            changes: std::sync::atomic::AtomicU64::new(0),
            rules,
            opaque_streams: OpaqueStreams::default(),
        }
    }

    /// The host's own addresses now: each is denied as a destination, in
    /// every form that names it (an IPv4-mapped or NAT64 one too).
    pub fn set_host(&self, addrs: impl IntoIterator<Item = IpAddr>) {
        let mut addrs: Vec<IpAddr> = addrs.into_iter().map(canonical_ip).collect();
        addrs.sort_unstable();
        addrs.dedup();
        if **self.host.load() != addrs {
            self.host.store(Arc::new(addrs));
            self.changed();
        }
    }

    /// Which addresses are sandboxes' or VMs' on this gateway now (the
    /// registry sets it with each change of its addresses): each is denied
    /// as a destination, in every form that names it. `holds` is asked
    /// with canonical addresses.
    pub fn set_registered(&self, holds: impl Fn(IpAddr) -> bool + Send + Sync + 'static) {
        self.registered.store(Arc::new(Registered(Box::new(holds))));
        self.changed();
    }

    /// How many times the addresses denied while the gateway runs (the
    /// host's, the sandboxes' and VMs') have been set anew: a flow judged
    /// once and left running (a splice) is judged again when it moves,
    /// since its destination may have become one of them.
    pub fn changes(&self) -> u64 {
        self.changes.load(std::sync::atomic::Ordering::Acquire)
    }

    fn changed(&self) {
        self.changes
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    }

    fn is_registered(&self, addrs: &Addrs) -> bool {
        let registered = self.registered.load();
        [Some(addrs.ip), addrs.embedded]
            .into_iter()
            .flatten()
            .any(|ip| (registered.0)(ip))
    }

    /// The host's own addresses as last set.
    pub fn host(&self) -> Vec<IpAddr> {
        self.host.load().to_vec()
    }

    fn is_host(&self, addrs: &Addrs) -> bool {
        let host = self.host.load();
        [Some(addrs.ip), addrs.embedded]
            .into_iter()
            .flatten()
            .any(|ip| host.binary_search(&ip).is_ok())
    }

    /// With the gateway's setting for streams it cannot read.
    pub fn with_opaque_streams(mut self, opaque_streams: OpaqueStreams) -> Self {
        self.opaque_streams = opaque_streams;
        self
    }

    pub fn opaque_streams(&self) -> OpaqueStreams {
        self.opaque_streams
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
        Self::with_credentials(policy, platform, std::iter::empty())
    }

    /// Compiles a policy for a sandbox with credentials: `(name, hosts)` in
    /// the order the sandbox lists them. Their hosts are never spliced.
    pub fn with_credentials<'a>(
        policy: Policy,
        platform: Arc<PlatformDenies>,
        credentials: impl IntoIterator<Item = (&'a str, Vec<&'a Destination>)>,
    ) -> Self {
        let mut names = Vec::new();
        let mut hosts = Vec::new();
        for (i, (name, list)) in credentials.into_iter().enumerate() {
            names.push(name.to_owned());
            let i = RuleIdx::try_from(i).unwrap_or(RuleIdx::MAX);
            hosts.extend(list.into_iter().map(|d| (i, d)));
        }
        // An entry past its `until` is compiled as if it were not there;
        // the registry compiles the policy again when the next one lapses.
        let now = OffsetDateTime::now_utc();
        let requests = RequestRules::new(&policy.allow, &policy.deny, hosts, now).map(Box::new);
        let allow_unseen = policy
            .allow
            .iter()
            .any(Rule::enforced_http)
            .then(|| RuleSet::rules(&policy.allow, now, |r| !r.enforced_http()));
        let streams = StreamSets::new(&policy.allow, platform.opaque_streams, now).map(Box::new);
        let next_expiry = policy
            .allow
            .iter()
            .filter_map(|r| r.until)
            .filter(|u| *u > now)
            .min();
        Self {
            deny: RuleSet::rules(&policy.deny, now, |r| r.http.is_none()),
            allow: RuleSet::rules(&policy.allow, now, |_| true),
            next_expiry,
            allow_unseen,
            streams,
            exempt: RuleSet::new(&policy.tls_interception_exemptions),
            requests,
            credentials: names,
            platform,
            policy,
        }
    }

    /// When the next allow entry in force lapses: compile the policy again
    /// then ([`Rule::until`]).
    pub fn next_expiry(&self) -> Option<OffsetDateTime> {
        self.next_expiry
    }

    /// Whether any entry is qualified or the sandbox has credentials: only
    /// then does [`CompiledPolicy::judge_request`] have anything to say.
    pub fn has_request_rules(&self) -> bool {
        self.requests.is_some()
    }

    /// Judges one request on a flow the gateway sees the requests of:
    /// `names` is the request's name, or every name its destination may be
    /// when the name is not verified; `target` the request target as sent.
    pub fn judge_request(
        &self,
        names: &[&Hostname],
        method: &str,
        target: &str,
    ) -> RequestJudgement {
        match &self.requests {
            None => RequestJudgement::default(),
            Some(r) => r.judge(&self.policy.allow, &self.policy.deny, names, method, target),
        }
    }

    /// Whether a qualified entry (enforced or audited) or a credential for
    /// any of `names` needs the requests of a flow to them: what a shadow
    /// cannot judge on a flow whose bytes the gateway does not see.
    pub fn needs_requests_of<'n>(&self, names: impl Iterator<Item = &'n Hostname> + Clone) -> bool {
        self.requests
            .as_deref()
            .is_some_and(|r| r.needs_requests(names, true, false).is_some())
    }

    /// The rule that needs the requests of a flow with this evidence
    /// (enforced ones only, or any with `audit`); `named`: the flow is a
    /// stream an entry's `streams` names.
    fn needs_requests(&self, flow: &Flow<'_>, audit: bool, named: bool) -> Option<RuleRef> {
        let r = self.requests.as_deref()?;
        let names = flow.attributed.iter().chain(flow.sni).chain(flow.host);
        r.needs_requests(names, audit, named)
    }

    /// Whether an allow entry whose `streams` names the flow's protocol
    /// covers the flow (by address, or by an attributed name).
    fn stream_named(&self, flow: &Flow<'_>, addrs: &Addrs) -> bool {
        let (Some(streams), Protocol::Opaque(Some(kind))) = (&self.streams, flow.protocol) else {
            return false;
        };
        self.allowed(flow, addrs, false, streams.named(kind), false)
            .is_ok()
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
        if self.platform.is_host(&addrs) {
            return Verdict::Deny(Denied::Platform(HOST_ADDRESS));
        }
        if self.platform.is_registered(&addrs) {
            return Verdict::Deny(Denied::Platform(REGISTERED_ADDRESS));
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
        // Requests are seen on plain HTTP and terminated TLS, never on
        // spliced or opaque bytes: rules that need them cannot hold there.
        let seen = flow.protocol == Protocol::Http || terminating;
        if !seen {
            let named = self.stream_named(flow, &addrs);
            if let Some(r) = self.needs_requests(flow, false, named) {
                return Verdict::Deny(Denied::Unseen(r));
            }
        }
        if terminating {
            if let (Some(sni), Some(host)) = (flow.sni, flow.host) {
                if sni != host {
                    return Verdict::Deny(Denied::Misdirected);
                }
            }
        }
        let (allow, default_ok) = self.allows_for(flow.protocol, seen);
        let allowed = match self.allowed(flow, &addrs, terminating, allow, default_ok) {
            Ok(a) => a,
            Err(gap) => return Verdict::Deny(self.not_allowed(flow, &addrs, seen, gap)),
        };
        if let Some(verdict) = encrypted_dns(flow.encrypted_dns, allowed, terminating) {
            return verdict;
        }
        match (flow.protocol, terminating) {
            (Protocol::Http | Protocol::Opaque(_) | Protocol::Dns, _) => Verdict::Allow(allowed),
            (Protocol::Tls, false) => Verdict::Splice(allowed, Spliced::InterceptionOff),
            (Protocol::Tls, true) => self.exemption(flow, &addrs, allowed),
        }
    }

    /// The allows a flow of `protocol` is judged by, and whether `default:
    /// allow` lets it through: an opaque stream by the entries that let its
    /// kind through, a flow whose requests are not `seen` by the entries
    /// without enforced per-request rules, others by every allow.
    fn allows_for(&self, protocol: Protocol, seen: bool) -> (&RuleSet, bool) {
        match (&self.streams, protocol) {
            (Some(streams), Protocol::Opaque(kind)) => (streams.get(kind), streams.default),
            _ => (self.allows_unseen(seen), true),
        }
    }

    fn allows_unseen(&self, seen: bool) -> &RuleSet {
        match &self.allow_unseen {
            Some(unseen) if !seen => unseen,
            _ => &self.allow,
        }
    }

    /// Why nothing allowed the flow: an opaque stream that an allow (or the
    /// default) covers, only not for its kind, is refused as a stream;
    /// otherwise the attribution gap.
    fn not_allowed(
        &self,
        flow: &Flow<'_>,
        addrs: &Addrs,
        seen: bool,
        gap: AttributionGap,
    ) -> Denied {
        let (Some(_), Protocol::Opaque(kind)) = (&self.streams, flow.protocol) else {
            return Denied::NotAllowed(gap);
        };
        match self.allowed(flow, addrs, false, self.allows_unseen(seen), true) {
            Ok(a) => Denied::Stream(a, kind),
            Err(gap) => Denied::NotAllowed(gap),
        }
    }

    /// Step 4: the allow rule in `allow` (or the default, where
    /// `default_ok`) that lets the flow out.
    fn allowed(
        &self,
        flow: &Flow<'_>,
        addrs: &Addrs,
        terminating: bool,
        allow: &RuleSet,
        default_ok: bool,
    ) -> Result<Allowed, AttributionGap> {
        if let Some(r) = allow.lookup_addr(addrs) {
            return Ok(Allowed::Address(r));
        }
        let names = &allow.names;
        let attributed_allowed = names.lookup_any(flow.attributed);
        let claim = match flow.protocol {
            // Without an SNI a terminated request's Host is the claim: it
            // must be attributed too, or any name the address serves a
            // certificate for would pass on another name's attribution.
            Protocol::Tls => flow.sni.or(flow.host),
            Protocol::Http => flow.host,
            Protocol::Opaque(_) | Protocol::Dns => None,
        };
        let claim_attributed = claim.is_none_or(|c| flow.attributed.contains(c));
        let by_attribution = match claim {
            // The name the client gives (the SNI, else the Host) must itself
            // be allowed, and attributed to the address. Another allowed
            // name on the same address is no evidence for it: on a shared
            // CDN address, any name the sandbox resolved there would pass
            // on the allowed one's attribution, and the CDN route by it.
            Some(c) if claim_attributed => names.lookup(c),
            Some(_) => None,
            // No name given (opaque, or TLS without an SNI before its
            // requests): an attributed name is allowed.
            None => attributed_allowed.map(|(_, r)| r),
        };
        if let Some(r) = by_attribution {
            return Ok(Allowed::AttributedName(r));
        }
        if default_ok && self.policy.default == DefaultAction::Allow {
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

    /// Step 5: splice an exempted stream, else terminate it; a stream to a
    /// name with per-request rules or credentials is terminated all the
    /// same, since those need its requests.
    fn exemption(&self, flow: &Flow<'_>, addrs: &Addrs, allowed: Allowed) -> Verdict {
        let verdict = self.exempt_or_not(flow, addrs, allowed);
        if let Verdict::Splice(allowed, _) = verdict {
            if let Some(r) = self.needs_requests(flow, true, false) {
                return Verdict::Intercept(allowed, Intercepted::RequestRules(r));
            }
        }
        verdict
    }

    fn exempt_or_not(&self, flow: &Flow<'_>, addrs: &Addrs, allowed: Allowed) -> Verdict {
        if let Allowed::VerifiedName(_) = allowed {
            // Only termination verifies the claim; splicing would trust it.
            return Verdict::Intercept(allowed, Intercepted::NeedsVerification);
        }
        // An address exemption trusts the address, whatever name the
        // stream is for, so ECH hides nothing it judged (docs/evidence.md).
        if let Some(r) = self.exempt.lookup_addr(addrs) {
            return Verdict::Splice(allowed, Spliced::Exempt(r));
        }
        match self.exempt_by_name(flow, allowed) {
            // A hostname exemption was granted to the outer name; the
            // encrypted inner name could be any other.
            Verdict::Splice(allowed, Spliced::Exempt(r)) if flow.ech => {
                Verdict::Intercept(allowed, Intercepted::Ech(r))
            }
            verdict => verdict,
        }
    }

    /// A hostname exemption: an attributed name matches it, and the SNI, if
    /// any, is attributed and matches too.
    fn exempt_by_name(&self, flow: &Flow<'_>, allowed: Allowed) -> Verdict {
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

    /// The entry a rule index refers to, for reasons and logs.
    pub(crate) fn rule(&self, list: RuleList, idx: RuleIdx) -> Option<String> {
        let i = usize::try_from(idx).ok()?;
        let text = match list {
            RuleList::Platform if idx == HOST_ADDRESS => "the gateway host's own address".into(),
            RuleList::Platform if idx == REGISTERED_ADDRESS => {
                "the address of a sandbox or a VM on this gateway".into()
            }
            RuleList::Platform => self.platform.list.get(i)?.to_string(),
            RuleList::Deny => self.policy.deny.get(i)?.to_string(),
            RuleList::Allow => self.policy.allow.get(i)?.to_string(),
            RuleList::Exemption => self.policy.tls_interception_exemptions.get(i)?.to_string(),
            RuleList::Credential => format!("credential {:?}", self.credentials.get(i)?),
        };
        Some(text)
    }

    /// The entry `r` refers to, readable (`deny[0] domain a.test http POST /x`).
    pub fn describe_rule(&self, r: RuleRef) -> String {
        let (list, idx) = match r {
            RuleRef::Allow(i) => (RuleList::Allow, i),
            RuleRef::Deny(i) => (RuleList::Deny, i),
            RuleRef::Credential(i) => (RuleList::Credential, i),
        };
        match self.rule(list, idx) {
            Some(text) => format!("{} {text}", r.label()),
            None => r.label(),
        }
    }

    /// The readable reason for a refused request.
    pub fn describe_request(&self, d: &RequestDenial) -> String {
        let why = match d.code {
            RequestCode::HttpDeny => "denied by",
            RequestCode::HttpNotAllowed => {
                "not covered by the qualified allow entries of its name, first"
            }
            RequestCode::AmbiguousPath => "the path reads two ways, and a rule needs it:",
        };
        format!("{why} {}", self.describe_rule(d.rule))
    }
}

/// Which list a rule index points into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RuleList {
    Platform,
    Deny,
    Allow,
    Exemption,
    Credential,
}

#[cfg(test)]
mod tests;

/// Step 4b, for encrypted DNS that step 4 allowed: DoH to a reserved
/// resolver is answered by the gateway (terminated, never forwarded) or,
/// with interception off, refused; DoT and DoH to another resolver leave
/// only when an allow names them (an address allow or the default is not
/// enough: the names they resolve would never be attributed). `None`: the
/// flow goes on to the exemption step.
fn encrypted_dns(
    kind: Option<EncryptedDns>,
    allowed: Allowed,
    terminating: bool,
) -> Option<Verdict> {
    let by_name = matches!(
        allowed,
        Allowed::AttributedName(_) | Allowed::VerifiedName(_)
    );
    match kind? {
        EncryptedDns::ReservedDoh if terminating => {
            Some(Verdict::Intercept(allowed, Intercepted::ReservedResolver))
        }
        EncryptedDns::ReservedDoh => Some(Verdict::Deny(Denied::EncryptedDns)),
        EncryptedDns::Dot | EncryptedDns::KnownDoh | EncryptedDns::TcpDns if !by_name => {
            Some(Verdict::Deny(Denied::EncryptedDns))
        }
        EncryptedDns::Dot | EncryptedDns::KnownDoh | EncryptedDns::TcpDns => None,
    }
}
