//! The node's machine egress table, `inet egress_machine`, as nft text,
//! and with the ingress link check the links' table, `netdev egress_machine`.
//!
//! One table holds every VM's policy. Its base chains dispatch a packet to its VM's
//! chain with one verdict-map lookup (by source address on the forward
//! hook, by the socket's cgroup on the output hook), so what a packet costs
//! does not depend on how many VMs there are. Each VM owns a chain, its
//! rule sets, an observed set and two counters, all named after the VM's
//! key ([`key`]); a change to one VM is one transaction that touches only
//! those objects and the dispatch elements of that VM:
//!
//! - the forward hook passes an open flow (either way) on its conntrack
//!   entry before any dispatch, unless it comes from a VM under `loopback`
//!   (those VMs' addresses are in `cut4`/`cut6`): no lookup a packet while
//!   no VM of its family is under `loopback`, one while some is
//!   ([`forward_rules`], rewritten with every change);
//! - `vm_<k>`: conntrack first (on the output hook, and not under
//!   `loopback`: the flows the VM opened), IPv6 to `v6_<k>`,
//!   then the rule sets `any_<k>`, `proto_<k>`, `port_<k>` (a set the
//!   policy leaves empty has no rule), then the record
//!   and the verdict, counted in `refused_<k>`. The record is a log rule
//!   (NFLOG group, rate-limited, the excess counted in `lost_<k>`) with
//!   `machine_egress.observe = "events"`, or an update of the observed set
//!   `obs_<k>` when sampled;
//! - `v6_<k>`: IPv6 has no rules: recorded (`obs6_<k>` when sampled), then
//!   refused (or, in `audit` and `open`, passed);
//! - `link_<k>`: anti-spoofing on the VM's link, before conntrack, for
//!   traffic through the node and to the host alike: a source that is not
//!   one of the VM's addresses (`src4_<k>`, `src6_<k>`) is counted in
//!   `spoofed_<k>` and dropped, whatever the mode. Where it runs is the
//!   layout's [`LinkCheck`]: a base chain on the link's own ingress hook, in
//!   the table `netdev egress_machine` with the VM's `src4`/`src6` sets and
//!   `spoofed` counter (only the link's packets pay for it), or a chain of
//!   the node table dispatched from its prerouting hook by interface name
//!   (one lookup for every packet the node receives).
//!
//! A policy change flushes the VM's chains and rule sets and fills them
//! again inside one transaction, so the VM never runs without a policy or
//! with half of one; its observed set and counters carry on.

use std::fmt::Write as _;
use std::net::IpAddr;
use std::time::Duration;

use egress_policy::machine::{KernelSets, MachineEgress, Mode};

use crate::nflog::{Outcome, COPY_RANGE, PREFIX};

/// The node's table.
pub const TABLE: &str = "egress_machine";

/// Deepest cgroup a VM may be registered with (one dispatch map a level).
pub const MAX_CGROUP_LEVEL: usize = 8;

/// How long an observed element lives in the kernel without packets.
pub const OBSERVED_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

/// How the node's VMs are told apart (`machine_egress.match`): by source
/// address on the forward hook, or by cgroup on the output hook.
pub use crate::config::MachineMatch as Match;

/// The node-wide settings the text depends on.
#[derive(Clone, Debug)]
pub struct Layout {
    pub matching: Match,
    /// Observed-set size per VM.
    pub capacity: usize,
    /// Where the cgroup v2 hierarchy is mounted, relative to
    /// `/sys/fs/cgroup` (nft resolves paths there): `""` on a unified
    /// host, `"unified"` on a hybrid one.
    pub cgroup_prefix: String,
    /// Refused packets as events on an NFLOG group (`None`: recorded in
    /// the observed sets and sampled).
    pub events: Option<Events>,
    /// Where a VM link's sources are checked.
    pub link_check: LinkCheck,
}

/// Where a VM link's sources are checked (`machine_egress.link_check`,
/// `auto` resolved at start).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkCheck {
    /// A base chain on the link's ingress hook, in `netdev egress_machine`;
    /// the kernel binds it by the link's name, so a link made again later
    /// is checked again.
    Ingress,
    /// The node table's prerouting hook, `iifname vmap @links`.
    Prerouting,
}

impl Layout {
    /// The table that holds the VMs' anti-spoofing objects.
    fn link_table(&self) -> String {
        match self.link_check {
            LinkCheck::Ingress => format!("netdev {TABLE}"),
            LinkCheck::Prerouting => format!("inet {TABLE}"),
        }
    }

    /// The table families whose counters the observer reads.
    pub fn families(&self) -> &'static [&'static str] {
        match self.link_check {
            LinkCheck::Ingress => &["inet", "netdev"],
            LinkCheck::Prerouting => &["inet"],
        }
    }
}

/// `machine_egress.observe = "events"`: the group the rules log to and
/// the rate each VM may log at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Events {
    pub group: u16,
    /// Logged packets per second per VM (and the burst); beyond it they are
    /// counted in `lost_<k>` instead.
    pub rate: u32,
}

/// One VM as the rules see it.
#[derive(Clone, Copy, Debug)]
pub struct VmRules<'a> {
    pub id: &'a str,
    pub addresses: &'a [IpAddr],
    pub link: Option<&'a str>,
    /// The QEMU process's cgroup, relative to the cgroup v2 root.
    pub cgroup: Option<&'a str>,
    pub policy: &'a MachineEgress,
}

/// A VM id as the suffix of its objects' names. Ids are
/// `[A-Za-z0-9._-]`; everything but letters and digits is escaped as `_xx`
/// (hex), so two ids never share a name.
pub fn key(vm: &str) -> String {
    let mut name = String::new();
    for b in vm.bytes() {
        if b.is_ascii_alphanumeric() {
            name.push(char::from(b));
        } else {
            let _ = write!(name, "_{b:02x}");
        }
    }
    name
}

/// The cgroup's level: how many components its path has.
pub fn cgroup_level(path: &str) -> usize {
    path.split('/').filter(|c| !c.is_empty()).count()
}

/// The whole table with every VM in it; applying it replaces whatever
/// was there (used at start).
pub fn table(layout: &Layout, vms: &[VmRules<'_>]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# egress-gateway: machine egress of the node");
    // Both families go, whichever check is in use: a start with the other
    // check leaves nothing of the earlier one.
    for family in ["inet", "netdev"] {
        let _ = writeln!(out, "table {family} {TABLE}\ndelete table {family} {TABLE}");
    }
    base(&mut out, layout);
    for vm in vms {
        out.push_str(&change(layout, None, Some(vm)));
    }
    out.push_str(&forward_rules(vms));
    if layout.matching == Match::Cgroup {
        out.push_str(&output_dispatch(layout, vms));
    }
    out
}

/// The base: dispatch maps and chains, no VM.
fn base(out: &mut String, layout: &Layout) {
    if layout.link_check == LinkCheck::Ingress {
        let _ = writeln!(out, "table netdev {TABLE} {{\n}}");
    }
    let _ = writeln!(out, "table inet {TABLE} {{");
    let _ = writeln!(out, "    map from4 {{ type ipv4_addr : verdict; }}");
    let _ = writeln!(out, "    map from6 {{ type ipv6_addr : verdict; }}");
    let _ = writeln!(out, "    set to4 {{ type ipv4_addr; }}");
    let _ = writeln!(out, "    set to6 {{ type ipv6_addr; }}");
    let _ = writeln!(out, "    set cut4 {{ type ipv4_addr; }}");
    let _ = writeln!(out, "    set cut6 {{ type ipv6_addr; }}");
    // Spoofed sources first, before conntrack and on every path (through
    // the node or to the host itself): an established flow of another VM's
    // address must not carry them through, and nothing the host serves
    // may take them for another VM. On the ingress hook each link has a
    // chain of its own (`declare`).
    if layout.link_check == LinkCheck::Prerouting {
        let _ = writeln!(out, "    map links {{ type ifname : verdict; }}");
        let _ = writeln!(
            out,
            "    chain prerouting {{\n        type filter hook prerouting priority raw - 10; policy accept;\n        iifname vmap @links\n    }}"
        );
    }
    // Its rules are written by `forward_rules`, for the VMs there are.
    let _ = writeln!(
        out,
        "    chain forward {{\n        type filter hook forward priority filter - 10; policy accept;\n    }}"
    );
    if layout.matching == Match::Cgroup {
        for level in 1..=MAX_CGROUP_LEVEL {
            let _ = writeln!(out, "    map cg{level} {{ type cgroupsv2 : verdict; }}");
        }
        let _ = writeln!(
            out,
            "    chain output {{\n        type filter hook output priority filter - 10; policy accept;\n    }}"
        );
    }
    let _ = writeln!(out, "}}");
}

/// The forward chain's rules for the VMs `vms` (replaces the chain's
/// rules; part of every transaction). An open flow keeps the verdict it
/// was accepted under, both ways, on its conntrack entry alone, unless it
/// comes from a VM under `loopback`, which cuts open flows too: while some
/// VM of a family is under `loopback` (its addresses in `cut4`/`cut6`),
/// that family's open flows take one lookup in the cut set first, and
/// while none is, no lookup at all. What is left for a VM's address is a
/// new flow to it (an open one passed: its source is not a VM under
/// loopback, which the dispatch would have taken): dropped, before the
/// dispatch, whatever the sending VM's policy lets out.
pub fn forward_rules(vms: &[VmRules<'_>]) -> String {
    let cut = |v4: bool| {
        vms.iter().any(|vm| {
            vm.policy.mode == Mode::Loopback && vm.addresses.iter().any(|a| a.is_ipv4() == v4)
        })
    };
    // An ICMP error is `related` to the flow it names, whoever sends it.
    // From a VM to another VM it would reach that VM on its flow (a port
    // unreachable, a smaller path MTU) though no flow between two VMs
    // ever opens: dropped first. Only a related packet pays the lookups.
    let mut rules: Vec<String> = [
        "ct state related ip saddr @to4 ip daddr @to4 drop",
        "ct state related ip6 saddr @to6 ip6 daddr @to6 drop",
    ]
    .map(str::to_owned)
    .into();
    rules.extend(match (cut(true), cut(false)) {
        (false, false) => vec!["ct state established,related accept".to_owned()],
        (cut4, cut6) => [(cut4, "ip", "cut4", "ipv4"), (cut6, "ip6", "cut6", "ipv6")]
            .into_iter()
            .map(|(cut, ip, set, family)| match cut {
                true => format!("ct state established,related {ip} saddr != @{set} accept"),
                false => format!("ct state established,related meta nfproto {family} accept"),
            })
            .collect(),
    });
    // The guard comes before the dispatch: a VM's own chain ends in its
    // verdict, so after it a VM whose policy lets the address out (`open`,
    // `audit`, an allowlist covering it) would open flows to another VM.
    rules.extend(
        [
            "ip daddr @to4 drop",
            "ip6 daddr @to6 drop",
            "ip saddr vmap @from4",
            "ip6 saddr vmap @from6",
        ]
        .map(str::to_owned),
    );
    let mut out = format!("flush chain inet {TABLE} forward\n");
    for rule in rules {
        let _ = writeln!(out, "add rule inet {TABLE} forward {rule}");
    }
    out
}

/// Empties the `cgN` maps: the start of every cgroup-mode transaction
/// after the table's first, before any VM chain an element jumps to goes.
/// [`output_dispatch`] fills them again at its end.
pub fn unbind_cgroups(layout: &Layout) -> String {
    let mut out = String::new();
    if layout.matching == Match::Cgroup {
        for level in 1..=MAX_CGROUP_LEVEL {
            let _ = writeln!(out, "flush map inet {TABLE} cg{level}");
        }
    }
    out
}

/// The cgroup dispatch, whole: the `cgN` maps' elements, one for each VM
/// with a cgroup, and the output chain's rules, one cgroup lookup for each
/// level some VM is at, the deepest first (fills the maps [`unbind_cgroups`]
/// emptied and replaces the chain's rules; part of every cgroup-mode
/// transaction). nft resolves each path to the cgroup's inode as it loads
/// the text, so a cgroup made again under its path since the last
/// transaction is bound again here ([`crate::cgroups`]); `vms` holds only
/// cgroups the tree has, since nft refuses a path it cannot resolve. A
/// process in a VM's cgroup nested in another VM's is that inner VM's:
/// looked up shallowest first, the outer VM's verdict would end the chain.
pub fn output_dispatch(layout: &Layout, vms: &[VmRules<'_>]) -> String {
    if layout.matching != Match::Cgroup {
        return String::new();
    }
    let mut out = String::new();
    for vm in vms {
        let Some(path) = vm.cgroup else { continue };
        let (level, full, k) = (cgroup_level(path), cgroup_path(layout, path), key(vm.id));
        if (1..=MAX_CGROUP_LEVEL).contains(&level) {
            let _ = writeln!(
                out,
                "add element inet {TABLE} cg{level} {{ \"{full}\" : jump vm_{k} }}"
            );
        }
    }
    let mut levels: Vec<usize> = vms
        .iter()
        .filter_map(|v| v.cgroup)
        .map(cgroup_level)
        .filter(|l| (1..=MAX_CGROUP_LEVEL).contains(l))
        .collect();
    levels.sort_unstable_by(|a, b| b.cmp(a));
    levels.dedup();
    let _ = writeln!(out, "flush chain inet {TABLE} output");
    for l in levels {
        let _ = writeln!(
            out,
            "add rule inet {TABLE} output socket cgroupv2 level {l} vmap @cg{l}"
        );
    }
    out
}

/// The transaction text that turns VM `old` into `new` (`None`: absent),
/// touching only that VM's objects and its dispatch elements.
pub fn change(layout: &Layout, old: Option<&VmRules<'_>>, new: Option<&VmRules<'_>>) -> String {
    let mut out = String::new();
    if let Some(old) = old {
        dispatch(&mut out, layout, old, "delete");
    }
    match new {
        Some(new) => {
            if let Some(old) = old {
                unlink(&mut out, layout, old, new.link);
            }
            declare(&mut out, layout, new);
            fill(&mut out, layout, new);
            dispatch(&mut out, layout, new, "add");
        }
        None => {
            if let Some(old) = old {
                remove(&mut out, layout, old);
            }
        }
    }
    out
}

/// Whether the VM has a `link_<k>` chain: on the prerouting hook every VM
/// has one (dispatched only from its link), on the ingress hook a VM with
/// a link has one, bound to it.
fn has_link_chain(layout: &Layout, vm: &VmRules<'_>) -> bool {
    layout.link_check == LinkCheck::Prerouting || vm.link.is_some()
}

/// On the ingress hook, the chain of a link the VM no longer has goes (its
/// new one, if any, is declared afresh, bound to the new link).
fn unlink(out: &mut String, layout: &Layout, old: &VmRules<'_>, link: Option<&str>) {
    if layout.link_check == LinkCheck::Ingress && old.link.is_some() && old.link != link {
        let (lt, k) = (layout.link_table(), key(old.id));
        let _ = writeln!(out, "flush chain {lt} link_{k}\ndelete chain {lt} link_{k}");
    }
}

/// The VM's dispatch elements: its addresses (as sources to judge and
/// destinations to guard), its link and its cgroup.
fn dispatch(out: &mut String, layout: &Layout, vm: &VmRules<'_>, verb: &str) {
    let k = key(vm.id);
    let with_verdict = verb == "add";
    let jump = |target: &str| {
        if with_verdict {
            format!(" : jump {target}")
        } else {
            String::new()
        }
    };
    if layout.matching == Match::Address {
        for a in vm.addresses {
            let (from, to) = if a.is_ipv4() {
                ("from4", "to4")
            } else {
                ("from6", "to6")
            };
            let j = jump(&format!("vm_{k}"));
            let _ = writeln!(out, "{verb} element inet {TABLE} {from} {{ {a}{j} }}");
            let _ = writeln!(out, "{verb} element inet {TABLE} {to} {{ {a} }}");
            if vm.policy.mode == Mode::Loopback {
                let cut = if a.is_ipv4() { "cut4" } else { "cut6" };
                let _ = writeln!(out, "{verb} element inet {TABLE} {cut} {{ {a} }}");
            }
        }
        if let (Some(link), LinkCheck::Prerouting) = (vm.link, layout.link_check) {
            let j = jump(&format!("link_{k}"));
            let _ = writeln!(out, "{verb} element inet {TABLE} links {{ \"{link}\"{j} }}");
        }
    }
}

/// The path nft resolves under `/sys/fs/cgroup`.
fn cgroup_path(layout: &Layout, path: &str) -> String {
    let path = path.trim_matches('/');
    match layout.cgroup_prefix.trim_matches('/') {
        "" => path.to_owned(),
        prefix => format!("{prefix}/{path}"),
    }
}

/// The VM's objects, created if missing (`add` leaves existing ones, with
/// their elements and counts, alone).
fn declare(out: &mut String, layout: &Layout, vm: &VmRules<'_>) {
    let k = key(vm.id);
    let (t, lt) = (format!("inet {TABLE}"), layout.link_table());
    for c in ["vm", "v6"] {
        let _ = writeln!(out, "add chain {t} {c}_{k}");
    }
    match (layout.link_check, vm.link) {
        (LinkCheck::Prerouting, _) => {
            let _ = writeln!(out, "add chain {t} link_{k}");
        }
        (LinkCheck::Ingress, Some(link)) => {
            let _ = writeln!(
                out,
                "add chain {lt} link_{k} {{ type filter hook ingress device \"{link}\" priority -500; policy accept; }}"
            );
        }
        (LinkCheck::Ingress, None) => {}
    }
    for c in counters(layout) {
        let _ = writeln!(out, "add counter {t} {c}_{k}");
    }
    if let Some(events) = layout.events {
        // One bucket for both of the VM's chains (IPv4 and IPv6).
        let rate = events.rate;
        let _ = writeln!(
            out,
            "add limit {t} log_{k} {{ rate over {rate}/second burst {rate} packets; }}"
        );
    }
    let _ = writeln!(out, "add counter {lt} spoofed_{k}");
    for (name, ty) in [("src4", "ipv4_addr"), ("src6", "ipv6_addr")] {
        let _ = writeln!(out, "add set {lt} {name}_{k} {{ type {ty}; }}");
    }
    let interval = "flags interval; ";
    for (name, ty, flags) in [
        // The address alone, joined to the family (always IPv4 in the VM's
        // chain): nft 1.0.x fetches the elements of every interval set that
        // is not a concatenation in the table before each change, which
        // made a change's cost grow with the VMs (1,000 dumps at 500 VMs).
        ("any", "ipv4_addr . nf_proto", interval),
        ("proto", "ipv4_addr . inet_proto", interval),
        ("port", "ipv4_addr . inet_proto . inet_service", interval),
    ] {
        let _ = writeln!(out, "add set {t} {name}_{k} {{ type {ty}; {flags}}}");
    }
    let (cap, timeout) = (layout.capacity, OBSERVED_TIMEOUT.as_secs());
    for (name, addr) in observed_sets(layout) {
        let _ = writeln!(
            out,
            "add set {t} {name}_{k} {{ type {addr} . inet_proto . inet_service; size {cap}; flags dynamic, timeout; timeout {timeout}s; counter; }}"
        );
    }
}

/// The VM's named counters in the node table (`spoofed_<k>` is with its
/// link's objects): with events, `lost_<k>` counts what the rate kept out
/// of the log.
fn counters(layout: &Layout) -> &'static [&'static str] {
    match layout.events {
        Some(_) => &["refused", "lost"],
        None => &["refused"],
    }
}

/// The VM's observed sets: only when sampled.
fn observed_sets(layout: &Layout) -> &'static [(&'static str, &'static str)] {
    match layout.events {
        Some(_) => &[],
        None => &[("obs", "ipv4_addr"), ("obs6", "ipv6_addr")],
    }
}

/// Empties the VM's chains and rule sets and fills them from its policy.
fn fill(out: &mut String, layout: &Layout, vm: &VmRules<'_>) {
    let k = key(vm.id);
    let (t, lt) = (format!("inet {TABLE}"), layout.link_table());
    for c in ["vm", "v6"] {
        let _ = writeln!(out, "flush chain {t} {c}_{k}");
    }
    let link = has_link_chain(layout, vm);
    if link {
        let _ = writeln!(out, "flush chain {lt} link_{k}");
    }
    for s in ["src4", "src6"] {
        let _ = writeln!(out, "flush set {lt} {s}_{k}");
    }
    for s in ["any", "proto", "port"] {
        let _ = writeln!(out, "flush set {t} {s}_{k}");
    }
    let (v4, v6): (Vec<&IpAddr>, Vec<&IpAddr>) = vm.addresses.iter().partition(|a| a.is_ipv4());
    elements(out, &lt, &k, "src4", v4.iter().map(ToString::to_string));
    elements(out, &lt, &k, "src6", v6.iter().map(ToString::to_string));
    let sets: KernelSets = vm.policy.kernel_sets();
    let any = sets.any.iter().map(|n| format!("{n} . ipv4"));
    elements(out, &t, &k, "any", any);
    let proto = sets.proto.iter().map(|(n, p)| format!("{n} . {p}"));
    elements(out, &t, &k, "proto", proto);
    let port = sets
        .port
        .iter()
        .map(|(n, p, port)| format!("{n} . {p} . {port}"));
    elements(out, &t, &k, "port", port);
    for rule in vm_chain(layout, vm.id, vm.policy.mode, &sets) {
        let _ = writeln!(out, "add rule {t} vm_{k} {rule}");
    }
    for rule in v6_chain(layout, vm.id, vm.policy.mode) {
        let _ = writeln!(out, "add rule {t} v6_{k} {rule}");
    }
    if link {
        for rule in link_chain(layout, &k) {
            let _ = writeln!(out, "add rule {lt} link_{k} {rule}");
        }
    }
}

/// Anti-spoofing on the VM's link: its own sources pass; so do the two
/// kinds of packet a host sends before it has an address, which never
/// leave the link (a DHCP request from `0.0.0.0`, and neighbour discovery
/// from `::` or a link-local address: the kernel forwards neither source);
/// everything else is counted and dropped. First, whatever its source, what
/// would make the VM the node's router is counted and dropped: a router
/// advertisement (ICMPv6 134), which a node taking them (`accept_ra`, the
/// kernel's default where IPv6 is not forwarded) would make a default route
/// through the VM of, a redirect or a router renumbering (137, 138). The
/// sandbox interfaces' guard drops the same (`gateway/src/redirect.rs`).
///
/// No anonymous interval set (`{ ::, fe80::/10 }`): nft would fetch its
/// elements, and every other VM's, before each change (see `declare`).
///
/// On the ingress hook the chain sees every frame of the link, not only
/// IPv4 and IPv6: ARP passes (as it does on the prerouting hook, which
/// never sees it), and any other protocol is counted and dropped with the
/// spoofed sources. ICMPv6 is protocol 58, by number: a name nft must look
/// up in /etc/protocols, which a container image may not have.
fn link_chain(layout: &Layout, k: &str) -> Vec<String> {
    let mut rules = vec![
        format!("icmpv6 type 134 counter name spoofed_{k} drop"),
        format!("icmpv6 type 137-138 counter name spoofed_{k} drop"),
        format!("ip saddr @src4_{k} return"),
        format!("ip6 saddr @src6_{k} return"),
        "ip saddr 0.0.0.0 udp sport 68 udp dport 67 return".to_owned(),
        "ip6 saddr :: meta l4proto 58 return".to_owned(),
        "ip6 saddr fe80::/10 meta l4proto 58 return".to_owned(),
    ];
    if layout.link_check == LinkCheck::Ingress {
        rules.push("meta protocol arp return".to_owned());
    }
    rules.push(format!("counter name spoofed_{k} drop"));
    rules
}

/// Adds `items` to the VM's set `set` in `table` (`inet egress_machine`).
fn elements(
    out: &mut String,
    table: &str,
    k: &str,
    set: &str,
    items: impl Iterator<Item = String>,
) {
    let items: Vec<String> = items.collect();
    // Large sets go in slices, to keep each line short.
    for chunk in items.chunks(256) {
        let _ = writeln!(
            out,
            "add element {table} {set}_{k} {{ {} }}",
            chunk.join(", ")
        );
    }
}

/// The VM's own chain, for the packets it sends: on the output hook a
/// flow the VM opened keeps the verdict it was accepted under (except
/// under `loopback`, which cuts open flows too; on the forward hook the
/// open flows that keep theirs passed before the dispatch), IPv6 goes to
/// `v6_<k>`, IPv4 is judged by the mode. A rule
/// set that is empty has no rule (it could match nothing, and each lookup
/// costs a new flow).
fn vm_chain(layout: &Layout, vm: &str, mode: Mode, sets: &KernelSets) -> Vec<String> {
    let k = key(vm);
    let mut rules = Vec::new();
    // On the forward hook an open flow never gets here: it passed before
    // the dispatch, or it is from a VM under `loopback` (which cuts it).
    // On the output hook only a flow the VM opened passes on conntrack: a
    // flow opened from outside to a QEMU socket (a port forward, a datagram
    // to the port slirp bound for the guest) is established in the reply
    // direction, and what the VM sends on it is judged as a new flow there
    // would be. Otherwise any host that reached the socket would have a
    // two-way channel with the VM that no rule judged; on the forward hook
    // such flows never open (`to4`/`to6`).
    if mode != Mode::Loopback && layout.matching == Match::Cgroup {
        rules.push("ct state established,related ct direction original accept".to_owned());
    }
    rules.push(format!("meta nfproto ipv6 goto v6_{k}"));
    let judged = [
        (
            sets.any.is_empty(),
            format!("ip daddr . meta nfproto @any_{k} accept"),
        ),
        (
            sets.proto.is_empty(),
            format!("ip daddr . meta l4proto @proto_{k} accept"),
        ),
        (
            sets.port.is_empty(),
            format!("ip daddr . meta l4proto . th dport @port_{k} accept"),
        ),
    ]
    .into_iter()
    .filter_map(|(empty, rule)| (!empty).then_some(rule));
    match mode {
        Mode::Open => rules.push("accept".to_owned()),
        Mode::Loopback => rules.extend(refuse(layout, vm, false, mode)),
        Mode::Allowlist | Mode::Audit => {
            rules.extend(judged);
            // In audit everything passes; what an allowlist would drop is recorded.
            rules.extend(refuse(layout, vm, false, mode));
        }
    }
    rules
}

/// IPv6 from the VM: the policy's rules are IPv4 only, so it is refused
/// under `loopback` and `allowlist` (and would be under `audit`), recorded
/// either way; `open` passes it.
fn v6_chain(layout: &Layout, vm: &str, mode: Mode) -> Vec<String> {
    match mode {
        Mode::Open => vec!["accept".to_owned()],
        _ => refuse(layout, vm, true, mode),
    }
}

/// The end of a VM's chain: what reaches it is refused (dropped, or in
/// audit passed). Sampled: the destination updates the observed set, and
/// the verdict is counted. With events: counted, then every TCP and UDP
/// packet is logged to the group with a prefix naming the outcome and the
/// VM, at most `rate` a second (`log_<k>`, one bucket for its IPv4 and its
/// IPv6 chain); what is over the rate is counted in
/// `lost_<k>` and not logged. The verdict is a rule of its own, so neither a
/// full set nor a failed log lets a packet through.
fn refuse(layout: &Layout, vm: &str, v6: bool, mode: Mode) -> Vec<String> {
    let k = key(vm);
    let verdict = if mode == Mode::Audit {
        "accept"
    } else {
        "drop"
    };
    let l4 = "meta l4proto { tcp, udp }";
    let Some(events) = layout.events else {
        let (set, ip) = if v6 { ("obs6", "ip6") } else { ("obs", "ip") };
        return vec![
            format!("{l4} update @{set}_{k} {{ {ip} daddr . meta l4proto . th dport }}"),
            format!("counter name refused_{k} {verdict}"),
        ];
    };
    let letter = match mode {
        Mode::Audit => Outcome::WouldRefuse,
        _ => Outcome::Refused,
    }
    .letter();
    let group = events.group;
    vec![
        format!("counter name refused_{k}"),
        format!("{l4} limit name log_{k} counter name lost_{k} {verdict}"),
        format!("{l4} log prefix \"{PREFIX} {letter} {vm}\" group {group} snaplen {COPY_RANGE} {verdict}"),
        verdict.to_owned(),
    ]
}

/// Removes the VM's objects (its dispatch elements went first).
fn remove(out: &mut String, layout: &Layout, vm: &VmRules<'_>) {
    let k = key(vm.id);
    let (t, lt) = (format!("inet {TABLE}"), layout.link_table());
    // A chain must be empty to go, and unreferenced: vm_ jumps to v6_.
    let mut chains = vec![(&t, "vm"), (&t, "v6")];
    if has_link_chain(layout, vm) {
        chains.push((&lt, "link"));
    }
    for (table, c) in &chains {
        let _ = writeln!(out, "flush chain {table} {c}_{k}");
    }
    for (table, c) in &chains {
        let _ = writeln!(out, "delete chain {table} {c}_{k}");
    }
    let observed = observed_sets(layout).iter().map(|(s, _)| *s);
    for s in ["any", "proto", "port"].into_iter().chain(observed) {
        let _ = writeln!(out, "delete set {t} {s}_{k}");
    }
    for s in ["src4", "src6"] {
        let _ = writeln!(out, "delete set {lt} {s}_{k}");
    }
    for c in counters(layout) {
        let _ = writeln!(out, "delete counter {t} {c}_{k}");
    }
    if layout.events.is_some() {
        let _ = writeln!(out, "delete limit {t} log_{k}");
    }
    let _ = writeln!(out, "delete counter {lt} spoofed_{k}");
}
