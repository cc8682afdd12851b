//! `egress-gateway redirect`: the nftables rules that send sandbox
//! interfaces' traffic to the gateway — TCP to the transparent listener, DNS
//! to 8.8.8.8 and 1.1.1.1 to their DNS listeners — drop every other UDP
//! from them (QUIC falls back to TCP), and forward nothing of theirs (ICMP
//! and every other protocol stay on the worker).
//!
//! Two tables work together so that a sandbox never has a moment of egress
//! outside the gateway:
//!
//! - **The fence** (`inet egress_gw_fence`, from `redirect.fence` patterns
//!   such as `tap*`), installed once at boot before any sandbox exists: it
//!   drops everything arriving on an interface that matches a pattern and is
//!   not in its `attached` set. A sandbox interface that appears is fenced
//!   from its first packet.
//! - **One table per attached interface** (`inet egress_gw_<iface>`, the
//!   name as it is: `tap-1` and `tap_1` are two tables), made
//!   when the VM manager (or a udev rule) says the interface is there. The
//!   same nft transaction that makes the table adds the interface to the
//!   fence's set, and detaching deletes both in one transaction: at every
//!   instant the interface's traffic is either redirected or dropped.

use std::collections::HashSet;

/// Why rules could not be made or applied.
#[derive(Debug, thiserror::Error)]
pub enum RedirectError {
    #[error("--sandbox-iface {0:?}: expected 1 to 15 letters, digits, '-', '_' or '.'")]
    Iface(String),
    #[error("--sandbox-iface \"fence\": its table would be the fence's own ({FENCE_TABLE}); name the interface otherwise")]
    FenceName,
    #[error("redirect.fence: {0:?}: expected 1 to 15 letters, digits, '-', '_' or '.', optionally ending in '*'")]
    Pattern(String),
    #[error("redirect.fence is empty: name the sandbox interfaces to fence (e.g. [\"tap*\"])")]
    NoPatterns,
    #[error("nft: {0}")]
    Nft(String),
    /// What the fence keeper was doing when `source` failed.
    #[error("{doing}: {source}")]
    Keeping { doing: String, source: Box<Self> },
}

impl RedirectError {
    fn doing(self, doing: impl std::fmt::Display) -> Self {
        Self::Keeping {
            doing: doing.to_string(),
            source: Box::new(self),
        }
    }
}

/// The ports the rules redirect to.
#[derive(Clone, Copy, Debug)]
pub struct Ports {
    pub transparent: u16,
    pub dns: u16,
    pub dns_alt: u16,
}

/// The fence's table.
pub const FENCE_TABLE: &str = "egress_gw_fence";

/// The fence table and its set, declared idempotently: `nft` merges a
/// declaration into an existing table, so attaching works whether or not
/// the fence chain was installed (without it the set is only bookkeeping).
const FENCE_DECLARATION: &str =
    "table inet egress_gw_fence {\n    set attached {\n        type ifname\n    }\n}\n";

/// The table holding one interface's rules: the interface's name as it is
/// (nft takes `-` and `.` in a table's name), so no two interfaces share
/// one; `fence` is refused, the fence's own.
pub fn table_name(iface: &str) -> Result<String, RedirectError> {
    if !crate::config::is_iface_name(iface) {
        return Err(RedirectError::Iface(iface.to_owned()));
    }
    let table = format!("egress_gw_{iface}");
    match table == FENCE_TABLE {
        true => Err(RedirectError::FenceName),
        false => Ok(table),
    }
}

/// The table builds before 2026-12-05 made for `iface`: `-` and `.` became
/// `_`, so `tap-1`, `tap.1` and `tap_1` shared one, each applying deleting
/// the other's rules while both stayed let through the fence. A running
/// gateway moves such a table to its name ([`keep_fence`]).
fn legacy_table_name(iface: &str) -> String {
    format!("egress_gw_{}", iface.replace(['-', '.'], "_"))
}

/// Checks a fence pattern: an interface name, or a prefix ending in `*`.
pub fn check_pattern(p: &str) -> Result<(), RedirectError> {
    if crate::config::is_iface_pattern(p) {
        Ok(())
    } else {
        Err(RedirectError::Pattern(p.to_owned()))
    }
}

/// What an interface's table bounds in the host's connection tracking.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tracking {
    /// Open connections tracked for one source address at once
    /// (`redirect.max_tracked_connections`).
    pub connections: u32,
    /// Source addresses counted at once (`redirect.max_tracked_sources`):
    /// a new connection from one more is dropped.
    pub sources: u32,
    /// DNS datagrams one source may send a second (and at once), past
    /// which the kernel drops them: the most any policy's DNS budget gives
    /// (`dns.budget_max_qps`, or `dns.budget_qps` above it). The proxy
    /// would only answer those `REFUSED`, one at a time on one socket every
    /// sandbox shares: a flood from one would crowd out the others' queries.
    pub dns_qps: u32,
}

impl From<&crate::config::Config> for Tracking {
    fn from(c: &crate::config::Config) -> Self {
        Self {
            connections: c.redirect.max_tracked_connections,
            sources: c.redirect.max_tracked_sources,
            dns_qps: c.dns.budget_ceiling().0,
        }
    }
}

/// As [`Tracking::from`] a whole configuration: the same keys, as
/// `egress-gateway redirect` reads them.
impl From<&crate::config::RedirectView> for Tracking {
    fn from(c: &crate::config::RedirectView) -> Self {
        Self {
            connections: c.redirect.max_tracked_connections,
            sources: c.redirect.max_tracked_sources,
            dns_qps: c.dns.ceiling(),
        }
    }
}

/// The interface's table, and the interface added to the fence's set, in
/// one transaction; idempotent to apply: it replaces the table whole.
/// `tracking` bounds the open connections the host tracks for each source
/// address on the interface at once, and the sources it counts.
pub fn ruleset(iface: &str, ports: Ports, tracking: Tracking) -> Result<String, RedirectError> {
    let table = table_name(iface)?;
    let Ports {
        transparent,
        dns,
        dns_alt,
    } = ports;
    let guards = guards(iface, tracking);
    Ok(format!(
        r#"# egress-gateway: redirect sandbox interface {iface}
table inet {table}
delete table inet {table}
table inet {table} {{
{guards}    chain to_gateway {{
        type nat hook prerouting priority dstnat; policy accept;
        iifname "{iface}" ip daddr 8.8.8.8 meta l4proto {{ tcp, udp }} th dport 53 redirect to :{dns}
        iifname "{iface}" ip daddr 1.1.1.1 meta l4proto {{ tcp, udp }} th dport 53 redirect to :{dns_alt}
        iifname "{iface}" meta l4proto tcp redirect to :{transparent}
    }}
    # What the redirect sends on is delivered to the gateway; anything else
    # (ICMP, other IP protocols, TCP conntrack calls invalid, which NAT
    # leaves alone) must not be routed past it, forwarding on or not.
    chain no_forward {{
        type filter hook forward priority filter - 20; policy accept;
        iifname "{iface}" counter drop
    }}
    # Delivered to the host itself, only what the redirect delivers and
    # ICMP: a tunnel packet (IPIP, GRE, IPv6-in-IPv4, ...) to one of the
    # host's addresses would be unwrapped by a tunnel device the host has
    # (Calico's tunl0, say), and its inner packet routed on from there,
    # past every rule of this interface. (58 is ICMPv6: by number, since a
    # name nft must look up in /etc/protocols, which an image may lack.)
    # Nor an ICMP error: one naming a connection of the host's (the DNS
    # proxy's upstream socket, say) would end it, whoever sent it, and a
    # sandbox on its own link has no error to report to the host.
    chain no_tunnels {{
        type filter hook input priority filter - 20; policy accept;
        iifname "{iface}" meta l4proto != {{ tcp, udp, icmp, 58 }} counter drop
        iifname "{iface}" icmp type {{ destination-unreachable, source-quench, time-exceeded, parameter-problem }} counter drop
        iifname "{iface}" icmpv6 type {{ destination-unreachable, packet-too-big, time-exceeded, parameter-problem }} counter drop
    }}
}}
# Through the fence (if one is installed), in the same transaction.
{FENCE_DECLARATION}add element inet {FENCE_TABLE} attached {{ "{iface}" }}
"#
    ))
}

/// The interface's chains before NAT: spoofed sources, UDP other than DNS
/// to the reserved resolvers, and connections past `tracking` dropped.
fn guards(iface: &str, tracking: Tracking) -> String {
    let Tracking {
        connections: max_tracked,
        sources,
        dns_qps,
    } = tracking;
    let udp_guard = udp_guard(iface, sources, dns_qps);
    format!(
        r#"    # Before anything, fragments: connection tracking reassembles them
    # (at priority -400) in memory the whole host shares, before any rule
    # below has looked at them. A sandbox's TCP is cut to its MSS and its
    # DNS queries are small; a fragment from it is a flood.
    chain no_fragments {{
        type filter hook prerouting priority -450; policy accept;
        iifname "{iface}" ip frag-off & 0x3fff != 0 counter drop
        iifname "{iface}" exthdr frag exists counter drop
    }}
    # First, a source the interface is not the way back to is someone
    # else's: a sandbox on its own interface cannot send as another (the
    # gateway knows a sandbox by its address). From :: and link-local
    # addresses, only what finds neighbours and joins groups (a sandbox
    # has any number of those addresses, so anything else from them would
    # escape the per-source bound below). Nor does a sandbox route for the
    # host: router advertisements and redirects are dropped.
    chain spoof_guard {{
        type filter hook prerouting priority mangle - 5; policy accept;
        iifname "{iface}" meta nfproto ipv4 fib saddr . iif oif missing counter drop
        iifname "{iface}" icmp type redirect counter drop
        iifname "{iface}" icmpv6 type {{ nd-router-advert, nd-redirect, router-renumbering }} counter drop
        iifname "{iface}" ip6 saddr {{ ::, fe80::/10 }} icmpv6 type {{ nd-router-solicit, nd-neighbor-solicit, nd-neighbor-advert, mld-listener-report, mld-listener-done, mld2-listener-report }} accept
        iifname "{iface}" ip6 saddr {{ ::, fe80::/10 }} counter drop
        iifname "{iface}" meta nfproto ipv6 fib saddr . iif oif missing counter drop
    }}
{udp_guard}    # Then, what passed: at most {max_tracked} open connections tracked for
    # each source address at once (closed ones do not count), so on a
    # bridge too each sandbox has its own. The host's table is every
    # sandbox's and the gateway's: one sandbox's flood fills its own share
    # of it, not the whole. A source the full set cannot take is not
    # counted, so its new connections are dropped too: each source
    # counts, or none passes.
    set tracked4 {{
        type ipv4_addr; size {sources}; flags dynamic;
    }}
    set tracked6 {{
        type ipv6_addr; size {sources}; flags dynamic;
    }}
    chain tracked {{
        type filter hook prerouting priority mangle + 1; policy accept;
        iifname "{iface}" ct state new add @tracked4 {{ ip saddr ct count over {max_tracked} }} counter drop
        iifname "{iface}" ct state new add @tracked6 {{ ip6 saddr ct count over {max_tracked} }} counter drop
        iifname "{iface}" ct state new meta nfproto ipv4 ip saddr != @tracked4 counter drop
        iifname "{iface}" ct state new meta nfproto ipv6 ip6 saddr != @tracked6 counter drop
    }}
"#
    )
}

/// The interface's chain before NAT that lets through only DNS to the
/// reserved resolvers as UDP, at most `dns_qps` datagrams a second from
/// each of `sources` sources ([`guards`]).
fn udp_guard(iface: &str, sources: u32, dns_qps: u32) -> String {
    // nft finds no element of a set whose elements hold a limit, so the
    // sources counted are a set of their own, and the limits' set has
    // room for twice as many: it holds no source the first does not, and
    // its expired elements go only at its next clean-up.
    let limits = u64::from(sources) * 2;
    let dns = r#"iifname "IFACE" meta nfproto ipv4 udp dport 53 ip daddr { 8.8.8.8, 1.1.1.1 }"#
        .replace("IFACE", iface);
    format!(
        r#"    # Before NAT: only DNS to the reserved resolvers may leave as UDP, at
    # most {dns_qps} datagrams a second from each source (the most a DNS
    # budget gives); past that they are dropped here, not read and refused
    # one by one on the socket every sandbox shares. A source the full set
    # cannot take is not counted, so its DNS is dropped too.
    set dns_sources4 {{
        type ipv4_addr; size {sources}; flags dynamic,timeout; timeout 10s;
    }}
    set dns_rate4 {{
        type ipv4_addr; size {limits}; flags dynamic,timeout; timeout 10s;
    }}
    chain udp_guard {{
        type filter hook prerouting priority mangle; policy accept;
        {dns} update @dns_sources4 {{ ip saddr }}
        {dns} ip saddr != @dns_sources4 counter drop
        {dns} update @dns_rate4 {{ ip saddr limit rate over {dns_qps}/second burst {dns_qps} packets }} counter drop
        {dns} accept
        iifname "{iface}" meta l4proto udp counter drop
    }}
"#
    )
}

/// Detaching: the interface leaves the fence's set and its table goes, in
/// one transaction; idempotent (adding first makes the deletes valid when
/// the element or table is already gone).
pub fn removal(iface: &str) -> Result<String, RedirectError> {
    let table = table_name(iface)?;
    Ok(format!(
        "# egress-gateway: detach sandbox interface {iface}\n{FENCE_DECLARATION}\
add element inet {FENCE_TABLE} attached {{ \"{iface}\" }}\n\
delete element inet {FENCE_TABLE} attached {{ \"{iface}\" }}\n\
table inet {table}\ndelete table inet {table}\n"
    ))
}

/// The fence: every interface matching one of `patterns` that is not
/// attached is dropped before routing (priority raw), counted per pattern.
/// Its fragments are dropped earlier still (`fragments`, priority -450):
/// connection tracking reassembles them at -400, in memory the whole host
/// shares, before the fence would see them. Applying replaces the chains
/// and keeps the set, so re-applying never fences an attached sandbox.
pub fn fence_ruleset(patterns: &[String]) -> Result<String, RedirectError> {
    if patterns.is_empty() {
        return Err(RedirectError::NoPatterns);
    }
    let mut rules = String::new();
    for p in patterns {
        check_pattern(p)?;
        let unattached = format!("iifname \"{p}\" iifname != @attached");
        rules.push_str(&format!(
            "add rule inet {FENCE_TABLE} fence {unattached} counter drop\n\
add rule inet {FENCE_TABLE} fragments {unattached} ip frag-off & 0x3fff != 0 counter drop\n\
add rule inet {FENCE_TABLE} fragments {unattached} exthdr frag exists counter drop\n"
        ));
    }
    Ok(format!(
        "# egress-gateway: fence sandbox interfaces {patterns:?}\n{FENCE_DECLARATION}\
table inet {FENCE_TABLE} {{\n    chain fence {{\n        type filter hook prerouting priority raw; policy accept;\n    }}\n\
    chain fragments {{\n        type filter hook prerouting priority -450; policy accept;\n    }}\n}}\n\
flush chain inet {FENCE_TABLE} fence\nflush chain inet {FENCE_TABLE} fragments\n{rules}"
    ))
}

/// Applies the interface's ruleset with `nft -f -` (the same runner as machine egress).
pub fn apply(iface: &str, ports: Ports, tracking: Tracking) -> Result<(), RedirectError> {
    let _held = RulesLock::take(RulesLock::WAIT)?;
    run(&ruleset(iface, ports, tracking)?)
}

/// Detaches the interface: fenced again (if it matches the fence), its table gone.
pub fn remove(iface: &str) -> Result<(), RedirectError> {
    let _held = RulesLock::take(RulesLock::WAIT)?;
    run(&removal(iface)?)
}

/// Installs (or replaces) the fence. No lock: one transaction that keeps
/// the `attached` set, so it cannot undo an attach or a detach.
pub fn apply_fence(patterns: &[String]) -> Result<(), RedirectError> {
    run(&fence_ruleset(patterns)?)
}

/// Deletes the fence and its set (uninstalling; sandboxes are then only
/// as fenced as their own tables make them).
pub fn remove_fence() -> Result<(), RedirectError> {
    run(&format!(
        "table inet {FENCE_TABLE}\ndelete table inet {FENCE_TABLE}\n"
    ))
}

/// Held while an interface is attached or detached, and while the fence
/// keeper acts on what it read of the tables and the `attached` set (a
/// detach and attach between its read and its act would otherwise have it
/// fence the interface just attached again). Installing the fence takes
/// none: it keeps the set, and nothing may stand in its way. An abstract
/// Unix socket's name, which belongs to the network namespace (so a pod's
/// containers share it, and namespaces apart do not) and goes with the
/// process that bound it, whatever way it ends. Any process of the
/// namespace could bind the name first: attaching then fails after
/// [`RulesLock::WAIT`] (fail closed), and the keeper still installs a
/// missing fence.
struct RulesLock {
    _bound: std::os::unix::net::UnixListener,
}

impl RulesLock {
    const NAME: &'static [u8] = b"egress-gateway/redirect-rules";
    /// The longest wait of an attach or detach for another holder (an
    /// `nft` run takes a few ms; after an nftables reload every instance
    /// applies again at once).
    const WAIT: std::time::Duration = std::time::Duration::from_secs(60);
    /// The keeper's: it looks again within [`FENCE_CHECK_EVERY`].
    const KEEPER_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

    fn take(wait: std::time::Duration) -> Result<Self, RedirectError> {
        use std::os::linux::net::SocketAddrExt;
        let failed = |e: std::io::Error| {
            RedirectError::Nft(format!(
                "the lock of this network namespace's redirect rules: {e} (another `egress-gateway redirect`, the gateway's fence keeper, or a process binding @{} held it for {wait:?})",
                String::from_utf8_lossy(Self::NAME)
            ))
        };
        let addr =
            std::os::unix::net::SocketAddr::from_abstract_name(Self::NAME).map_err(failed)?;
        let deadline = std::time::Instant::now() + wait;
        loop {
            match std::os::unix::net::UnixListener::bind_addr(&addr) {
                Ok(l) => return Ok(Self { _bound: l }),
                Err(e)
                    if e.kind() == std::io::ErrorKind::AddrInUse
                        && std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                Err(e) => return Err(failed(e)),
            }
        }
    }
}

/// How often a running gateway looks at the fence ([`keep_fence`]).
pub const FENCE_CHECK_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// Whether the fence is in place: its chain holds a rule for each pattern,
/// and its `fragments` chain two (read over netlink, a few rules). Gone
/// (another tool flushed the ruleset or deleted the table) or emptied
/// (`nft flush table`), every interface it fenced is open until it is
/// installed again; without `fragments` (an older build's fence), it is
/// installed again whole.
pub fn fence_in_place(patterns: &[String]) -> bool {
    let holds = |chain: &str, n: usize| {
        egress_machine::counters::rules(FENCE_TABLE, chain).is_ok_and(|have| have >= n)
    };
    holds("fence", patterns.len()) && holds("fragments", 2 * patterns.len())
}

/// What the fence keeper does with an attached interface.
#[derive(Debug, PartialEq, Eq)]
enum Keep {
    /// Its own table redirects it.
    Redirected,
    /// Its rules are made again in its own table, replaced whole: it is on
    /// the table an older build named (`-` and `.` made `_`), its own table
    /// is one an older build named for another attached interface, whose
    /// rules it may hold, or its own table lacks rules this build writes
    /// (an older build's `tracked` chain let a source the full set could not
    /// take through uncounted).
    Rebuild,
    /// Nothing redirects it (its table gone or emptied by another tool):
    /// its rules are made again, as attaching makes them.
    Restore,
    /// Its name is not one this build attaches: fenced again.
    Fence,
}

/// The fence keeper's plan for the `attached` interfaces, given which
/// tables hold the redirects (`redirected`), which hold every rule this
/// build writes (`current`) and which interfaces this process has made
/// again already (`rebuilt`); and the older build's tables to delete once
/// it is carried out (none is another's own).
fn keep_plan(
    attached: &[String],
    (redirected, current): (impl Fn(&str) -> bool, impl Fn(&str) -> bool),
    rebuilt: &HashSet<String>,
) -> (Vec<(String, Keep)>, Vec<String>) {
    // The older build's table of each attached interface whose name it
    // changed.
    let old: Vec<(&str, String)> = attached
        .iter()
        .map(|i| (i.as_str(), legacy_table_name(i)))
        .filter(|(i, t)| table_name(i).is_ok_and(|n| n != *t) && t != FENCE_TABLE)
        .collect();
    let anothers_old = |me: &str, table: &str| old.iter().any(|(i, t)| *i != me && t == table);
    let plan = |iface: &String| {
        let Ok(own) = table_name(iface) else {
            return Keep::Fence;
        };
        let on_old = old
            .iter()
            .find(|(i, _)| *i == iface.as_str())
            .is_some_and(|(_, t)| redirected(t));
        match redirected(&own) {
            true if rebuilt.contains(iface) => Keep::Redirected,
            true if !anothers_old(iface, &own) && current(&own) => Keep::Redirected,
            true => Keep::Rebuild,
            false if on_old => Keep::Rebuild,
            false => Keep::Restore,
        }
    };
    let keep = attached.iter().map(|i| (i.clone(), plan(i))).collect();
    let owned = |t: &str| attached.iter().any(|i| table_name(i).is_ok_and(|n| n == t));
    let mut gone: Vec<String> = old
        .iter()
        .filter(|(_, t)| !owned(t) && redirected(t))
        .map(|(_, t)| t.clone())
        .collect();
    gone.sort();
    gone.dedup();
    (keep, gone)
}

/// The interfaces this process made again ([`Keep::Rebuild`]): their own
/// tables hold their own rules, whatever an older build named them.
static REBUILT: std::sync::Mutex<Option<HashSet<String>>> = std::sync::Mutex::new(None);

/// The fence's `attached` interfaces at the keeper's last look.
static SEEN_ATTACHED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// Interfaces attached at the keeper's last look that a fence installed
/// again no longer lets through: attached again at its next look under the
/// lock (this one's, unless the lock was not to be had).
static LOST: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

fn locked<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What the fence keeper mended, as it tells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mended<'a> {
    /// The fence was gone or emptied: installed again.
    Fence,
    /// An interface lost its redirect (its table gone or emptied, or the
    /// fence installed again without it): attached again.
    Redirect(&'a str),
    /// An interface lost its redirect and could not be attached again (or
    /// its name is not one this build attaches): fenced again.
    Fenced(&'a str),
}

/// Keeps the fence of `redirect.fence` in place while the gateway runs:
/// missing, it is installed again (`told` [`Mended::Fence`]), and the
/// interfaces it let through at the last look are attached again (their
/// tables may have gone with the ruleset too) once they exist; until then
/// they are fenced, so what they send is dropped or judged, never routed
/// past the gateway. In place, every interface it lets through must still
/// have its redirect ([`keep_plan`]): one on an older build's table, or
/// whose own table an older build named for another, has its rules made
/// again (`ports`, `tracking`); one whose table is gone or emptied (its
/// traffic would go on unredirected, past the fence) is attached again,
/// and fenced again if that fails. Each interface is seen to even when
/// another's failed; returns the first failure.
pub fn keep_fence(
    patterns: &[String],
    rules: (Ports, Tracking),
    told: impl Fn(Mended<'_>),
) -> Result<(), RedirectError> {
    if patterns.is_empty() {
        return Ok(());
    }
    if !fence_in_place(patterns) {
        run(&fence_ruleset(patterns)?).map_err(|e| {
            e.doing(format_args!(
                "installing the fence {patterns:?}, which is gone or emptied"
            ))
        })?;
        told(Mended::Fence);
        let seen = std::mem::take(&mut *locked(&SEEN_ATTACHED));
        locked(&LOST).extend(seen);
    }
    let _held = RulesLock::take(RulesLock::KEEPER_WAIT)
        .map_err(|e| e.doing("looking at the attached interfaces' redirects"))?;
    let attached = nft().set_names(FENCE_TABLE, "attached").map_err(|e| {
        RedirectError::Nft(e.message).doing("reading the fence's attached interfaces")
    })?;
    let lost = std::mem::take(&mut *locked(&LOST));
    let lost = lost_to_attach(lost, &attached, |i| {
        std::path::Path::new("/sys/class/net").join(i).exists()
    });
    let mut first_error = keep_attached(&attached, rules, &told).err();
    let mut now_attached = attached;
    for iface in lost {
        match let_through_again(&iface, rules, &told) {
            Ok(()) => now_attached.push(iface),
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    *locked(&SEEN_ATTACHED) = now_attached;
    first_error.map_or(Ok(()), Err)
}

/// Whether `table` redirects (the rules of its `to_gateway` chain).
fn redirects(table: &str) -> bool {
    egress_machine::counters::rules(table, "to_gateway").is_ok_and(|n| n >= REDIRECTS)
}

/// Whether `table` holds every rule this build writes (an older build
/// wrote fewer in two chains).
fn current(table: &str) -> bool {
    egress_machine::counters::rules(table, "tracked").is_ok_and(|n| n >= TRACKED)
        && egress_machine::counters::rules(table, "udp_guard").is_ok_and(|n| n >= UDP_GUARD)
}

/// An interface of `lost` let through the fence again: its own table, if
/// it holds every rule, is kept as it is (deleting the fence alone
/// leaves the interfaces' tables, their counts with them), and made again
/// otherwise ([`Keep::Restore`]).
fn let_through_again(
    iface: &str,
    rules: (Ports, Tracking),
    told: &impl Fn(Mended<'_>),
) -> Result<(), RedirectError> {
    let intact = table_name(iface).is_ok_and(|t| redirects(&t) && current(&t));
    if !intact {
        return keep_one(iface, Keep::Restore, rules, told);
    }
    let element = element(iface);
    run(&format!(
        "{FENCE_DECLARATION}add element inet {FENCE_TABLE} attached {element}\n"
    ))
    .map_err(|e| e.doing(format_args!("letting {iface} through the fence again")))?;
    tracing::warn!(%iface, "let a sandbox interface whose redirect was in place through the fence installed again");
    Ok(())
}

/// The interfaces of `lost` to attach again: not attached meanwhile (by
/// their unit, say), named as this build attaches, and still there
/// (`exists`); each once.
fn lost_to_attach(
    mut lost: Vec<String>,
    attached: &[String],
    exists: impl Fn(&str) -> bool,
) -> Vec<String> {
    lost.sort();
    lost.dedup();
    lost.retain(|i| !attached.contains(i) && table_name(i).is_ok() && exists(i));
    lost
}

/// The keeper's plan for the `attached` interfaces carried out (with the
/// lock held), and an older build's tables deleted after.
fn keep_attached(
    attached: &[String],
    (ports, tracking): (Ports, Tracking),
    told: &impl Fn(Mended<'_>),
) -> Result<(), RedirectError> {
    let rebuilt = REBUILT
        .lock()
        .map(|r| r.clone().unwrap_or_default())
        .unwrap_or_default();
    let (keep, gone) = keep_plan(attached, (redirects, current), &rebuilt);
    let mut first_error = None;
    for (iface, keep) in keep {
        if let Err(e) = keep_one(&iface, keep, (ports, tracking), told) {
            first_error.get_or_insert(e);
        }
    }
    if first_error.is_none() {
        for table in gone {
            if let Err(e) = run(&format!("table inet {table}\ndelete table inet {table}\n")) {
                first_error.get_or_insert(
                    e.doing(format_args!("deleting an older build's table {table}")),
                );
            }
        }
    }
    first_error.map_or(Ok(()), Err)
}

/// What the keeper's plan says for one interface, carried out.
fn keep_one(
    iface: &str,
    keep: Keep,
    rules: (Ports, Tracking),
    told: &impl Fn(Mended<'_>),
) -> Result<(), RedirectError> {
    let fenced = || fence_again(iface).map(|()| told(Mended::Fenced(iface)));
    match keep {
        Keep::Redirected => Ok(()),
        Keep::Rebuild => rebuild(iface, rules)
            .map_err(|e| {
                e.doing(format_args!(
                    "making {iface}'s redirect again (it is fenced again)"
                ))
            })
            .or_else(|e| fenced().and(Err(e))),
        Keep::Restore => run(&ruleset(iface, rules.0, rules.1)?)
            .map(|()| told(Mended::Redirect(iface)))
            .map_err(|e| {
                e.doing(format_args!(
                    "attaching {iface} again, which lost its redirect (it is fenced again)"
                ))
            })
            .or_else(|e| fenced().and(Err(e))),
        Keep::Fence => fenced().map_err(|e| {
            e.doing(format_args!(
                "fencing {iface} again: its name is not one this build attaches"
            ))
        }),
    }
}

/// `iface`'s rules made again in its own table, replaced whole.
fn rebuild(iface: &str, (ports, tracking): (Ports, Tracking)) -> Result<(), RedirectError> {
    run(&ruleset(iface, ports, tracking)?)?;
    if let Ok(mut r) = REBUILT.lock() {
        r.get_or_insert_with(HashSet::new).insert(iface.to_owned());
    }
    tracing::info!(%iface, table = %table_name(iface)?, "made a sandbox interface's redirect again in its own table, as this build writes it (an older build named tables with '-' and '.' made '_', so two interfaces could share one, and let a source its full set of counted sources could not take through uncounted)");
    Ok(())
}

/// `iface` taken out of the fence's set: fenced again (idempotent: added
/// first, so the delete holds when it is not in the set).
fn fence_again(iface: &str) -> Result<(), RedirectError> {
    let element = element(iface);
    run(&format!(
        "{FENCE_DECLARATION}add element inet {FENCE_TABLE} attached {element}\n\
delete element inet {FENCE_TABLE} attached {element}\n"
    ))
}

/// `iface` as an element of the fence's set in an nft script (its name is
/// checked before; a quote or backslash could not reach the script anyway).
fn element(iface: &str) -> String {
    format!("{{ \"{}\" }}", iface.replace(['"', '\\'], ""))
}

/// The rules of an attached interface's `to_gateway` chain ([`ruleset`]).
const REDIRECTS: usize = 3;

/// The rules of its `tracked` chain: fewer, and an older build wrote it.
const TRACKED: usize = 4;

/// The rules of its `udp_guard` chain: fewer, and an older build wrote it
/// (one without the DNS rate).
const UDP_GUARD: usize = 5;

fn nft() -> egress_machine::nft::Nft {
    egress_machine::nft::Nft::new(vec!["nft".into()])
}

fn run(script: &str) -> Result<(), RedirectError> {
    nft()
        .apply(script)
        .map_err(|e| RedirectError::Nft(e.message))
}
#[cfg(test)]
mod tests {
    use super::*;

    /// The rules' lock is one holder's at a time, and free again once its
    /// holder lets go (here a thread of this process, as another process's
    /// would be).
    #[test]
    fn the_rules_lock_waits_for_its_holder() {
        let held = RulesLock::take(RulesLock::KEEPER_WAIT).expect("free");
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = std::thread::spawn(move || {
            let second = RulesLock::take(RulesLock::WAIT);
            let _ = tx.send(());
            second.map(drop)
        });
        assert!(
            rx.recv_timeout(std::time::Duration::from_millis(300))
                .is_err(),
            "taken while held"
        );
        drop(held);
        rx.recv_timeout(std::time::Duration::from_secs(5))
            .expect("taken once let go");
        waiter.join().expect("waiter").expect("taken");
    }

    const PORTS: Ports = Ports {
        transparent: 15001,
        dns: 15053,
        dns_alt: 15054,
    };

    const TRACKING: Tracking = Tracking {
        connections: 16_384,
        sources: 1_000,
        dns_qps: 5_000,
    };

    #[test]
    fn ruleset_names_the_interface_and_ports() {
        let r = ruleset("tap-sb1", PORTS, TRACKING).expect("valid");
        assert!(r.contains("table inet egress_gw_tap-sb1 {"));
        assert!(r.contains(r#"iifname "tap-sb1" meta l4proto tcp redirect to :15001"#));
        assert!(
            r.contains("ip daddr 8.8.8.8 meta l4proto { tcp, udp } th dport 53 redirect to :15053")
        );
        assert!(
            r.contains("ip daddr 1.1.1.1 meta l4proto { tcp, udp } th dport 53 redirect to :15054")
        );
        assert!(r.contains(r#"iifname "tap-sb1" meta l4proto udp counter drop"#));
        // DNS at most 5,000 datagrams a second from a source, one the set
        // cannot take dropped.
        let dns =
            r#"iifname "tap-sb1" meta nfproto ipv4 udp dport 53 ip daddr { 8.8.8.8, 1.1.1.1 }"#;
        let guard = [
            "update @dns_sources4 { ip saddr }",
            "ip saddr != @dns_sources4 counter drop",
            "update @dns_rate4 { ip saddr limit rate over 5000/second burst 5000 packets } counter drop",
            "accept",
        ]
        .map(|rule| format!("{dns} {rule}"))
        .join("\n        ");
        assert!(r.contains(&guard), "{r}");
        assert!(r.contains("set dns_sources4 {\n        type ipv4_addr; size 1000;"));
        assert!(r.contains("set dns_rate4 {\n        type ipv4_addr; size 2000;"));
        // Fragments before reassembly; ICMP errors to the host.
        assert!(r.contains("type filter hook prerouting priority -450; policy accept;\n        iifname \"tap-sb1\" ip frag-off & 0x3fff != 0 counter drop\n        iifname \"tap-sb1\" exthdr frag exists counter drop"), "{r}");
        assert!(r.contains(r#"iifname "tap-sb1" icmpv6 type { destination-unreachable, packet-too-big, time-exceeded, parameter-problem } counter drop"#));
        for family in ["4 { ip", "6 { ip6"] {
            let rule = format!("iifname \"tap-sb1\" ct state new add @tracked{family} saddr ct count over 16384 }} counter drop");
            assert!(r.contains(&rule), "{rule}\n{r}");
        }
        // A source the full set cannot take is dropped, after the counts.
        for (family, set, addr) in [("ipv4", "tracked4", "ip"), ("ipv6", "tracked6", "ip6")] {
            let rule = format!("iifname \"tap-sb1\" ct state new meta nfproto {family} {addr} saddr != @{set} counter drop");
            let at = r.find(&rule).expect(&rule);
            assert!(at > r.find(&format!("add @{set}")).expect("count"), "{r}");
            assert!(
                r.contains(&format!(
                    "set {set} {{\n        type {family}_addr; size 1000;"
                )),
                "{r}"
            );
        }
        assert!(r.contains(
            r#"iifname "tap-sb1" meta nfproto ipv4 fib saddr . iif oif missing counter drop"#
        ));
        assert!(r.contains("type filter hook forward priority filter - 20; policy accept;\n        iifname \"tap-sb1\" counter drop"), "{r}");
        assert!(r.contains("type filter hook input priority filter - 20; policy accept;\n        iifname \"tap-sb1\" meta l4proto != { tcp, udp, icmp, 58 } counter drop"), "{r}");
        // DNS redirects come before the catch-all TCP redirect.
        assert!(
            r.find("dport 53 redirect").expect("dns")
                < r.find("tcp redirect to :15001").expect("tcp")
        );
    }

    #[test]
    fn interface_names_are_checked() {
        for bad in [
            "",
            "a b",
            "x\"; flush ruleset",
            "averyveryverylongname",
            "eth0\n",
        ] {
            assert!(
                matches!(ruleset(bad, PORTS, TRACKING), Err(RedirectError::Iface(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn attaching_and_detaching_go_through_the_fence_in_one_transaction() {
        let r = ruleset("tap-sb1", PORTS, TRACKING).expect("valid");
        // The table first, then the interface let through the fence.
        let table = r.find("table inet egress_gw_tap-sb1 {").expect("table");
        let element = r
            .find(r#"add element inet egress_gw_fence attached { "tap-sb1" }"#)
            .expect("element");
        assert!(table < element);
        let d = removal("tap-sb1").expect("valid");
        let gone = d
            .find(r#"delete element inet egress_gw_fence attached { "tap-sb1" }"#)
            .expect("element deleted");
        assert!(
            gone < d
                .find("delete table inet egress_gw_tap-sb1")
                .expect("table")
        );
        assert!(matches!(removal("a b"), Err(RedirectError::Iface(_))));
    }

    #[test]
    fn no_two_interfaces_share_a_table_and_none_takes_the_fences() {
        let names: Vec<String> = ["tap-1", "tap.1", "tap_1", "tap1"]
            .iter()
            .map(|i| table_name(i).expect("valid"))
            .collect();
        for (i, a) in names.iter().enumerate() {
            assert!(!names[i + 1..].contains(a), "{a} twice in {names:?}");
        }
        assert!(matches!(table_name("fence"), Err(RedirectError::FenceName)));
        assert!(matches!(
            ruleset("fence", PORTS, TRACKING),
            Err(RedirectError::FenceName)
        ));
        assert!(table_name("fence0").is_ok());
    }

    /// The keeper's plan, on tables that hold the redirects (`tables`),
    /// each with every rule of this build, this process having made again
    /// `rebuilt`.
    fn plan(
        attached: &[&str],
        tables: &[&str],
        rebuilt: &[&str],
    ) -> (Vec<(String, Keep)>, Vec<String>) {
        plan_with(attached, (tables, tables), rebuilt)
    }

    /// [`plan`], with the tables holding every rule of this build apart.
    fn plan_with(
        attached: &[&str],
        (tables, current): (&[&str], &[&str]),
        rebuilt: &[&str],
    ) -> (Vec<(String, Keep)>, Vec<String>) {
        let attached: Vec<String> = attached.iter().map(|a| (*a).to_owned()).collect();
        let rebuilt = rebuilt.iter().map(|r| (*r).to_owned()).collect();
        let holds = (
            |t: &str| tables.contains(&t),
            |t: &str| current.contains(&t),
        );
        keep_plan(&attached, holds, &rebuilt)
    }

    #[test]
    fn the_keeper_makes_an_older_builds_tables_again_and_attaches_again_what_lost_its_own() {
        use Keep::*;
        let own = |i: &str, k: Keep| (i.to_owned(), k);
        let none: Vec<String> = Vec::new();
        // Each on its own table; one without: attached again. One whose
        // name this build would not attach (the fence's own table): fenced.
        assert_eq!(
            plan(&["fence"], &["egress_gw_fence"], &[]),
            (vec![own("fence", Fence)], none.clone())
        );
        assert_eq!(
            plan(&["tap-1", "tap2"], &["egress_gw_tap-1"], &[]),
            (
                vec![own("tap-1", Redirected), own("tap2", Restore)],
                none.clone()
            )
        );
        // Attached by an older build (its table under the old name): made
        // again in its own, the old one deleted after.
        assert_eq!(
            plan(
                &["tap-1", "tap.2"],
                &["egress_gw_tap_1", "egress_gw_tap-2"],
                &[]
            ),
            (
                vec![own("tap-1", Rebuild), own("tap.2", Restore)],
                vec!["egress_gw_tap_1".to_owned()]
            )
        );
        // Two that shared the old table: each made again in its own.
        assert_eq!(
            plan(&["tap-1", "tap.1"], &["egress_gw_tap_1"], &[]),
            (
                vec![own("tap-1", Rebuild), own("tap.1", Rebuild)],
                vec!["egress_gw_tap_1".to_owned()]
            )
        );
        // tap_1's own table is tap-1's old one: tap-1's rules may be in it,
        // whether or not tap-1 has a table of its own yet. Both made again
        // (tap-1 into its own); the old table is tap_1's own, kept.
        assert_eq!(
            plan(&["tap-1", "tap_1"], &["egress_gw_tap_1"], &[]),
            (
                vec![own("tap-1", Rebuild), own("tap_1", Rebuild)],
                none.clone()
            )
        );
        let both = ["egress_gw_tap_1", "egress_gw_tap-1"];
        assert_eq!(
            plan(&["tap-1", "tap_1"], &both, &[]),
            (
                vec![own("tap-1", Redirected), own("tap_1", Rebuild)],
                none.clone()
            )
        );
        // Once made again by this process, it is its own.
        assert_eq!(
            plan(&["tap-1", "tap_1"], &both, &["tap_1"]),
            (
                vec![own("tap-1", Redirected), own("tap_1", Redirected)],
                none.clone()
            )
        );
        // Its own table, written by an older build (its `tracked` chain
        // without the drop of a source the full set cannot take): made
        // again, once.
        let mine = ["egress_gw_tap-1"];
        assert_eq!(
            plan_with(&["tap-1"], (&mine, &[]), &[]),
            (vec![own("tap-1", Rebuild)], none.clone())
        );
        assert_eq!(
            plan_with(&["tap-1"], (&mine, &[]), &["tap-1"]),
            (vec![own("tap-1", Redirected)], none)
        );
    }

    #[test]
    fn the_fence_drops_unattached_interfaces_and_keeps_the_set() {
        let f = fence_ruleset(&["tap*".into(), "vm-1".into()]).expect("valid");
        assert!(f.contains(
            r#"add rule inet egress_gw_fence fence iifname "tap*" iifname != @attached counter drop"#
        ));
        assert!(f.contains(r#"iifname "vm-1" iifname != @attached"#));
        assert!(f.contains("type filter hook prerouting priority raw; policy accept;"));
        // Fragments go before connection tracking would reassemble them.
        assert!(f.contains("type filter hook prerouting priority -450; policy accept;"));
        assert!(f.contains(
            r#"add rule inet egress_gw_fence fragments iifname "tap*" iifname != @attached ip frag-off & 0x3fff != 0 counter drop"#
        ));
        assert!(f.contains(
            r#"add rule inet egress_gw_fence fragments iifname "vm-1" iifname != @attached exthdr frag exists counter drop"#
        ));
        // Re-applying flushes the chains, never the set of attached interfaces.
        assert!(f.contains("flush chain inet egress_gw_fence fence"));
        assert!(f.contains("flush chain inet egress_gw_fence fragments"));
        assert!(!f.contains("delete table") && !f.contains("flush set"));
        for bad in ["", "*", "t*p", "tap**", "a\"b*", "averyveryverylong*"] {
            assert!(
                matches!(fence_ruleset(&[bad.into()]), Err(RedirectError::Pattern(_))),
                "{bad:?}"
            );
        }
        assert!(matches!(fence_ruleset(&[]), Err(RedirectError::NoPatterns)));
    }

    /// After the fence was installed again, the interfaces it let through
    /// before are attached again: each once, not those attached meanwhile,
    /// gone, or named as no interface this build attaches.
    #[test]
    fn what_a_fence_installed_again_lost_is_attached_again_if_still_there() {
        let lost: Vec<String> = ["tap2", "tap1", "tap-gone", "tap1", "fence", "tap3"]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
        let attached = vec!["tap3".to_owned()];
        let got = lost_to_attach(lost, &attached, |i| i != "tap-gone");
        assert_eq!(got, ["tap1", "tap2"]);
    }
}
