use super::*;
use egress_policy::machine::MachineEgress;

fn policy(text: &str) -> MachineEgress {
    MachineEgress::from_json(text).expect("valid policy")
}

fn addrs() -> Vec<IpAddr> {
    vec![
        "100.64.3.2".parse().expect("ip"),
        "2001:db8::2".parse().expect("ip"),
    ]
}

use rules::{Layout, LinkCheck, Match, VmRules};

fn layout(matching: Match) -> Layout {
    Layout {
        matching,
        capacity: 4096,
        cgroup_prefix: String::new(),
        events: None,
        link_check: LinkCheck::Prerouting,
    }
}

fn ingress() -> Layout {
    Layout {
        link_check: LinkCheck::Ingress,
        ..layout(Match::Address)
    }
}

fn vm<'a>(id: &'a str, addresses: &'a [IpAddr], policy: &'a MachineEgress) -> VmRules<'a> {
    VmRules {
        id,
        addresses,
        link: Some("vm1"),
        cgroup: None,
        policy,
    }
}

/// The rules of chain `chain` in a transaction text.
fn chain_rules(text: &str, chain: &str) -> Vec<String> {
    rules_in(text, "inet", chain)
}

/// The rules of chain `chain` of the table of `family`.
fn rules_in(text: &str, family: &str, chain: &str) -> Vec<String> {
    let prefix = format!("add rule {family} egress_machine {chain} ");
    text.lines()
        .filter_map(|l| l.strip_prefix(&prefix))
        .map(str::to_owned)
        .collect()
}

#[test]
fn keys_never_collide() {
    assert_eq!(rules::key("vm1"), "vm1");
    assert_eq!(rules::key("a-b"), "a_2db");
    assert_eq!(rules::key("a_b"), "a_5fb");
    assert_eq!(rules::key("a.b"), "a_2eb");
    assert_ne!(rules::key("a-b"), rules::key("a_b"));
}

/// An allowlist with a rule for each of the VM's rule sets.
const ALLOWLIST: &str = r#"{"mode": "allowlist", "rules": [
    {"cidr": "10.0.0.0/8", "proto": "tcp", "port": 5151},
    {"cidr": "91.189.88.0/21", "proto": "tcp"},
    {"cidr": "0.0.0.0/0", "proto": "udp", "port": 53},
    {"cidr": "198.51.100.7"}]}"#;

#[test]
fn an_allowlist_compiles_into_the_vms_own_sets_and_chain() {
    let p = policy(ALLOWLIST);
    let a = addrs();
    let r = rules::table(&layout(Match::Address), &[vm("vm1", &a, &p)]);
    assert!(r.contains("table inet egress_machine\ndelete table inet egress_machine\n"));
    assert!(r.contains("add element inet egress_machine src4_vm1 { 100.64.3.2 }"));
    assert!(r.contains("add element inet egress_machine src6_vm1 { 2001:db8::2 }"));
    assert!(r.contains("add element inet egress_machine any_vm1 { 198.51.100.7/32 . ipv4 }"));
    assert!(r.contains("91.189.88.0/21 . tcp"));
    assert!(r.contains("10.0.0.0/8 . tcp . 5151"));
    assert!(r.contains("0.0.0.0/0 . udp . 53"));
    assert!(r.contains("size 4096"));
    // Dispatch: one lookup by source, one by link.
    assert!(r.contains("add element inet egress_machine from4 { 100.64.3.2 : jump vm_vm1 }"));
    assert!(r.contains("add element inet egress_machine from6 { 2001:db8::2 : jump vm_vm1 }"));
    assert!(r.contains("add element inet egress_machine links { \"vm1\" : jump link_vm1 }"));
    let chain = chain_rules(&r, "vm_vm1");
    let pos = |rule: &str| {
        chain
            .iter()
            .position(|c| c.contains(rule))
            .unwrap_or_else(|| panic!("no `{rule}` in {chain:?}"))
    };
    // Open flows passed the forward hook before the dispatch (see
    // open_flows_pass_on_conntrack_alone_unless_a_vm_is_under_loopback):
    // IPv6 goes apart first, then the sets.
    assert_eq!(pos("goto v6_vm1"), 0);
    assert!(pos("goto v6_vm1") < pos("@any_vm1 accept"));
    // Recording comes before the drop, in its own rule.
    assert!(pos("update @obs_vm1") < pos("counter name refused_vm1 drop"));
    // IPv6 from the VM: rules are IPv4 only, so nothing passes; it is recorded.
    let v6 = chain_rules(&r, "v6_vm1");
    assert!(v6[0].contains("update @obs6_vm1"), "{v6:?}");
    assert_eq!(v6[1], "counter name refused_vm1 drop");
    // Anti-spoofing: only the VM's own sources pass its link.
    assert_eq!(
        chain_rules(&r, "link_vm1"),
        [
            "icmpv6 type 134 counter name spoofed_vm1 drop",
            "icmpv6 type 137-138 counter name spoofed_vm1 drop",
            "ip saddr @src4_vm1 return",
            "ip6 saddr @src6_vm1 return",
            "ip saddr 0.0.0.0 udp sport 68 udp dport 67 return",
            "ip6 saddr :: meta l4proto 58 return",
            "ip6 saddr fe80::/10 meta l4proto 58 return",
            "counter name spoofed_vm1 drop"
        ]
    );
    // The link is checked before conntrack, on every path: through the
    // node and to the host itself.
    let pre = r
        .split("chain prerouting {")
        .nth(1)
        .and_then(|c| c.split('}').next())
        .expect("a prerouting chain");
    assert!(pre.contains("hook prerouting priority raw - 10"), "{pre}");
    assert!(pre.contains("iifname vmap @links"), "{pre}");
    let forward = r.split("chain forward {").nth(1).expect("a forward chain");
    assert!(!forward.contains("@links"), "{forward}");
}

#[test]
fn each_mode_has_its_verdict() {
    let a = addrs();
    let chain = |mode: &str| {
        let p = policy(&format!(r#"{{"mode": "{mode}"}}"#));
        let text = rules::change(&layout(Match::Address), None, Some(&vm("vm", &a, &p)));
        (chain_rules(&text, "vm_vm"), chain_rules(&text, "v6_vm"))
    };
    let (loopback, loopback6) = chain("loopback");
    assert!(
        !loopback.iter().any(|r| r.contains("accept")),
        "loopback cuts open flows too: {loopback:?}"
    );
    assert!(loopback.iter().any(|r| r.contains("update @obs_vm")));
    assert!(loopback6.iter().any(|r| r.contains("refused_vm drop")));
    let (open, open6) = chain("open");
    assert!(!open
        .iter()
        .any(|r| r.contains("drop") || r.contains("@obs")));
    assert_eq!(open6, ["accept"]);
    let (audit, audit6) = chain("audit");
    assert!(audit.iter().any(|r| r == "counter name refused_vm accept"));
    assert!(!audit.iter().chain(&audit6).any(|r| r.contains("drop")));
    assert!(audit6.iter().any(|r| r.contains("update @obs6_vm")));
}

/// An open flow passes the forward hook on its conntrack entry alone while
/// no VM of its family is under `loopback`, and on one more lookup while
/// some is: those VMs' addresses are in cut4/cut6, so their packets reach
/// their own chain, which has no such rule. The rules are rewritten with
/// every change, from all the VMs; the cut elements move with the VM.
#[test]
fn open_flows_pass_on_conntrack_alone_unless_a_vm_is_under_loopback() {
    let (a, v4): (Vec<IpAddr>, Vec<IpAddr>) = (addrs(), vec!["100.64.9.2".parse().expect("ip")]);
    let (lo, open) = (
        policy(r#"{"mode": "loopback"}"#),
        policy(r#"{"mode": "open"}"#),
    );
    let l = layout(Match::Address);
    // No error from one VM rides another VM's flow, whatever the rest.
    let guard = [
        "ct state related ip saddr @to4 ip daddr @to4 drop",
        "ct state related ip6 saddr @to6 ip6 daddr @to6 drop",
    ];
    let dispatch = [
        "ip daddr @to4 drop",
        "ip6 daddr @to6 drop",
        "ip saddr vmap @from4",
        "ip6 saddr vmap @from6",
    ];
    let forward = |vms: &[VmRules<'_>], first: &[&str]| {
        let text = rules::forward_rules(vms);
        let mut want = vec!["flush chain inet egress_machine forward".to_owned()];
        want.extend(
            guard
                .iter()
                .chain(first)
                .chain(&dispatch)
                .map(|r| format!("add rule inet egress_machine forward {r}")),
        );
        assert_eq!(text.lines().collect::<Vec<_>>(), want, "{text}");
    };
    forward(
        &[vm("vm", &a, &open), vm("v4", &v4, &open)],
        &["ct state established,related accept"],
    );
    forward(
        &[vm("vm", &a, &lo), vm("v4", &v4, &open)],
        &[
            "ct state established,related ip saddr != @cut4 accept",
            "ct state established,related ip6 saddr != @cut6 accept",
        ],
    );
    forward(
        &[vm("vm", &a, &open), vm("v4", &v4, &lo)],
        &[
            "ct state established,related ip saddr != @cut4 accept",
            "ct state established,related meta nfproto ipv6 accept",
        ],
    );
    // The whole table: the chain is declared empty, then filled.
    let table = rules::table(&l, &[vm("vm", &a, &open)]);
    assert!(table.contains("hook forward priority filter - 10; policy accept;\n    }"));
    assert!(table.contains(&rules::forward_rules(&[vm("vm", &a, &open)])));
    let cut = rules::change(&l, Some(&vm("vm", &a, &open)), Some(&vm("vm", &a, &lo)));
    let back = rules::change(&l, Some(&vm("vm", &a, &lo)), Some(&vm("vm", &a, &open)));
    for (text, line, present) in [
        (&table, "element inet egress_machine cut", false),
        (
            &cut,
            "add element inet egress_machine cut4 { 100.64.3.2 }",
            true,
        ),
        (
            &cut,
            "add element inet egress_machine cut6 { 2001:db8::2 }",
            true,
        ),
        (
            &back,
            "delete element inet egress_machine cut4 { 100.64.3.2 }",
            true,
        ),
        (&back, "add element inet egress_machine cut", false),
    ] {
        assert_eq!(text.contains(line), present, "`{line}` in:\n{text}");
    }
}

/// On the forward hook a VM's chain never sees an open flow (it passed
/// before the dispatch). On the output hook (`match = "cgroup"`) it does,
/// and passes on conntrack only a flow the VM opened: one opened from
/// outside to a QEMU socket (a port forward, a datagram to the port slirp
/// bound for the guest's DNS) is established in the reply direction, and
/// what the VM sends on it is judged by the rules, as a flow the VM opened
/// to that address would be, IPv6 included (the rule is before the jump to
/// `v6_<vm>`). Under loopback there is no such rule at all.
#[test]
fn on_the_output_hook_only_flows_the_vm_opened_pass_on_conntrack() {
    let a = addrs();
    let ct = "ct state established,related ct direction original accept";
    for (mode, matching, first) in [
        (r#"{"mode": "open"}"#, Match::Address, None),
        (ALLOWLIST, Match::Address, None),
        (r#"{"mode": "open"}"#, Match::Cgroup, Some(ct)),
        (r#"{"mode": "audit"}"#, Match::Cgroup, Some(ct)),
        (ALLOWLIST, Match::Cgroup, Some(ct)),
        (r#"{"mode": "loopback"}"#, Match::Cgroup, None),
    ] {
        let p = policy(mode);
        let mut v = vm("vm", &a, &p);
        v.cgroup = Some("vms/vm");
        let text = rules::change(&layout(matching), None, Some(&v));
        let chain = chain_rules(&text, "vm_vm");
        let conntrack: Vec<&String> = chain.iter().filter(|r| r.contains("ct ")).collect();
        match first {
            Some(rule) => {
                assert_eq!(
                    chain.first().map(String::as_str),
                    Some(rule),
                    "{mode}: {chain:?}"
                );
                assert_eq!(conntrack.len(), 1, "{mode}: {chain:?}");
                assert!(chain[1].contains("goto v6_vm"), "{mode}: {chain:?}");
            }
            None => assert!(conntrack.is_empty(), "{mode}: {chain:?}"),
        }
    }
}

/// A rule set the policy leaves empty gets no rule: it could match
/// nothing, and its lookup would cost every new flow.
#[test]
fn an_empty_rule_set_has_no_rule() {
    let a = addrs();
    let p = policy(r#"{"rules": [{"cidr": "10.0.0.0/8", "proto": "tcp", "port": 22}]}"#);
    let text = rules::change(&layout(Match::Address), None, Some(&vm("vm", &a, &p)));
    let chain = chain_rules(&text, "vm_vm");
    assert!(
        chain.iter().any(|r| r.contains("@port_vm accept")),
        "{chain:?}"
    );
    assert!(
        !chain
            .iter()
            .any(|r| r.contains("@any_vm") || r.contains("@proto_vm")),
        "{chain:?}"
    );
    // The sets are there all the same, for the next policy to fill.
    assert!(
        text.contains("add set inet egress_machine any_vm "),
        "{text}"
    );
}

/// A change to one VM names only that VM's objects and dispatch elements.
/// With the ingress check, each link has a base chain of its own in
/// `netdev egress_machine`, bound to it by name, with the VM's sources and
/// its `spoofed` counter; the node table has no prerouting hook at all.
#[test]
fn on_the_ingress_hook_each_link_has_a_chain_of_its_own() {
    let p = policy(ALLOWLIST);
    let a = addrs();
    let l = ingress();
    let r = rules::table(&l, &[vm("vm1", &a, &p)]);
    for family in ["inet", "netdev"] {
        let fresh =
            format!("table {family} egress_machine\ndelete table {family} egress_machine\n");
        assert!(r.contains(&fresh), "{r}");
    }
    assert!(!r.contains("prerouting") && !r.contains("links"), "{r}");
    assert!(r.contains(
        "add chain netdev egress_machine link_vm1 { type filter hook ingress device \"vm1\" priority -500; policy accept; }"
    ));
    assert!(r.contains("add element netdev egress_machine src4_vm1 { 100.64.3.2 }"));
    assert!(r.contains("add element netdev egress_machine src6_vm1 { 2001:db8::2 }"));
    assert!(r.contains("add counter netdev egress_machine spoofed_vm1"));
    assert!(!r.contains("add counter inet egress_machine spoofed_vm1"));
    assert_eq!(
        rules_in(&r, "netdev", "link_vm1"),
        [
            "icmpv6 type 134 counter name spoofed_vm1 drop",
            "icmpv6 type 137-138 counter name spoofed_vm1 drop",
            "ip saddr @src4_vm1 return",
            "ip6 saddr @src6_vm1 return",
            "ip saddr 0.0.0.0 udp sport 68 udp dport 67 return",
            "ip6 saddr :: meta l4proto 58 return",
            "ip6 saddr fe80::/10 meta l4proto 58 return",
            "meta protocol arp return",
            "counter name spoofed_vm1 drop"
        ]
    );
    // The same link again: the chain stays (the kernel keeps its binding).
    let same = rules::change(&l, Some(&vm("vm1", &a, &p)), Some(&vm("vm1", &a, &p)));
    assert!(!same.contains("delete chain"), "{same}");
    // Another link: the old chain goes before the new one is made.
    let moved = VmRules {
        link: Some("tap7"),
        ..vm("vm1", &a, &p)
    };
    let text = rules::change(&l, Some(&vm("vm1", &a, &p)), Some(&moved));
    let gone = text
        .find("delete chain netdev egress_machine link_vm1")
        .expect("the old link's chain goes");
    let made = text.find("device \"tap7\"").expect("the new link's chain");
    assert!(gone < made, "{text}");
    // No link: no chain, but the counter (the observer checks it is there).
    let unlinked = VmRules {
        link: None,
        ..vm("vm1", &a, &p)
    };
    let text = rules::change(&l, Some(&moved), Some(&unlinked));
    assert!(text.contains("delete chain netdev egress_machine link_vm1"));
    assert!(!text.contains("hook ingress"), "{text}");
    assert!(text.contains("add counter netdev egress_machine spoofed_vm1"));
    // Removed: every object in both tables.
    let removed = rules::change(&l, Some(&moved), None);
    for object in [
        "delete chain netdev egress_machine link_vm1",
        "delete set netdev egress_machine src4_vm1",
        "delete counter netdev egress_machine spoofed_vm1",
        "delete chain inet egress_machine vm_vm1",
        "delete counter inet egress_machine refused_vm1",
    ] {
        assert!(removed.contains(object), "no `{object}` in {removed}");
    }
}

#[test]
fn a_change_touches_only_its_vm() {
    let (a, b) = (addrs(), vec!["100.64.9.2".parse().expect("ip")]);
    let (p, q) = (
        policy(r#"{"mode": "open"}"#),
        policy(r#"{"rules": [{"cidr": "10.0.0.0/8"}]}"#),
    );
    let (one, two) = (vm("one", &a, &p), vm("two", &b, &q));
    let l = layout(Match::Address);
    let text = rules::change(&l, Some(&one), Some(&vm("one", &a, &q)));
    assert!(!text.contains("two"), "{text}");
    assert!(
        !text.contains("delete set") && !text.contains("flush set inet egress_machine obs_one"),
        "the record carries on: {text}"
    );
    let gone = rules::change(&l, Some(&two), None);
    assert!(!gone.contains("one"), "{gone}");
    assert!(gone.contains("delete element inet egress_machine from4 { 100.64.9.2 }"));
    assert!(gone.contains("delete chain inet egress_machine vm_two"));
}

#[test]
fn the_cgroup_variant_dispatches_on_output_by_level() {
    let p = policy(r#"{"mode": "loopback"}"#);
    let mut l = layout(Match::Cgroup);
    l.cgroup_prefix = "unified".into();
    let mut v = vm("q", &[], &p);
    v.link = None;
    v.cgroup = Some("machine.slice/vm-q.scope");
    let r = rules::table(&l, &[v]);
    assert!(r.contains("chain output {\n        type filter hook output priority filter - 10;"));
    assert!(r.contains(
        "add element inet egress_machine cg2 { \"unified/machine.slice/vm-q.scope\" : jump vm_q }"
    ));
    assert!(r.contains("add rule inet egress_machine output socket cgroupv2 level 2 vmap @cg2"));
    assert!(
        !r.contains("level 1 vmap"),
        "only levels in use are looked up"
    );
    assert!(
        !r.contains("from4 {") || !r.contains(": jump vm_q }\nadd element inet egress_machine to4")
    );
    // A VM's own change names no cgroup element: a cgroup made again since
    // it was loaded is another inode, which a `delete element` by path
    // would not find. The dispatch is rebuilt whole instead, from the
    // cgroups given (those the tree has).
    let gone = rules::change(&l, Some(&v), None);
    assert!(!gone.contains(" cg2 "), "{gone}");
    let d = rules::unbind_cgroups(&l);
    assert!(d.contains("flush map inet egress_machine cg2\n"), "{d}");
    assert!(!d.contains("add element"), "{d}");
    let d = rules::output_dispatch(&l, &[]);
    assert!(!d.contains("add element"), "{d}");
    assert!(!d.contains("socket cgroupv2"), "{d}");
    assert_eq!(rules::unbind_cgroups(&layout(Match::Address)), "");
}

#[test]
fn set_elements_are_read_from_nft_json() {
    let doc: serde_json::Value = serde_json::from_str(
        r#"{"nftables": [{"metainfo": {"version": "1.0.6"}}, {"set": {"family": "inet", "name": "observed",
        "table": "egress_vm_t", "elem": [
          {"elem": {"val": {"concat": ["198.51.100.4", "tcp", 80]}, "expires": 86390, "counter": {"packets": 7, "bytes": 420}}},
          {"elem": {"val": {"concat": ["203.0.113.9", "udp", 53]}, "expires": 86400, "counter": {"packets": 1, "bytes": 60}}},
          {"elem": {"val": {"concat": ["203.0.113.9", 6, 443]}, "counter": {"packets": 2, "bytes": 60}}},
          {"elem": {"val": {"concat": ["not an address", "udp", 53]}}}
        ]}}]}"#,
    )
    .expect("json");
    let got: Vec<KernelObserved> = items(&doc, "set")
        .filter_map(|s| s.get("elem")?.as_array())
        .flatten()
        .filter_map(element)
        .collect();
    assert_eq!(got.len(), 3);
    assert_eq!(got[0].addr, IpAddr::from([198, 51, 100, 4]));
    assert_eq!(
        (got[0].proto, got[0].port, got[0].packets),
        (Proto::Tcp, 80, 7)
    );
    assert_eq!(got[0].idle, Duration::from_secs(10));
    assert_eq!((got[1].proto, got[1].port), (Proto::Udp, 53));
    assert_eq!(got[2].proto, Proto::Tcp);
}

/// The kernel accepts what we write: `nft -c` checks the node table with a
/// VM in every mode, and changes to it (a policy swap, a removal).
#[test]
fn nft_accepts_every_mode() {
    if std::process::Command::new("nft")
        .arg("--version")
        .output()
        .is_err()
    {
        egress_testkit::skip("nft_accepts_every_mode", "no nft here");
        return;
    }
    let rules: Vec<String> = (0..256)
        .map(|i| {
            format!(
                r#"{{"cidr": "10.{i}.0.0/16", "proto": "tcp", "port": {}}}"#,
                1000 + i
            )
        })
        .collect();
    let big = format!(r#"{{"mode": "allowlist", "rules": [{}]}}"#, rules.join(","));
    let policies: Vec<MachineEgress> = [
        r#"{"mode": "loopback"}"#,
        r#"{"mode": "open"}"#,
        r#"{"mode": "audit", "rules": [{"cidr": "0.0.0.0/0", "proto": "udp", "port": 53}]}"#,
        r#"{"rules": [{"cidr": "10.0.0.0/8"}, {"cidr": "10.1.0.0/16", "proto": "udp"}, {"cidr": "10.1.2.0/24", "proto": "tcp", "port": 22}]}"#,
        &big,
    ]
    .iter()
    .map(|t| policy(t))
    .collect();
    let ids = ["m0", "m1", "m2", "m3", "m4"];
    let addresses: Vec<Vec<IpAddr>> = (0..5)
        .map(|i| vec![format!("100.64.{i}.2").parse().expect("ip")])
        .collect();
    let vms: Vec<VmRules<'_>> = (0..5)
        .map(|i| {
            let mut v = vm(ids[i], &addresses[i], &policies[i]);
            v.link = None;
            v
        })
        .collect();
    let l = layout(Match::Address);
    let mut text = rules::table(&l, &vms);
    text.push_str(&rules::change(
        &l,
        Some(&vms[4]),
        Some(&vm("m4", &addresses[4], &policies[0])),
    ));
    text.push_str(&rules::change(&l, Some(&vms[1]), None));
    // Out of loopback: its cut element goes.
    text.push_str(&rules::change(
        &l,
        Some(&vms[0]),
        Some(&VmRules {
            link: None,
            ..vm("m0", &addresses[0], &policies[1])
        }),
    ));
    // The forward chain rewritten without a VM under loopback, then with.
    text.push_str(&rules::forward_rules(&vms[1..]));
    text.push_str(&rules::forward_rules(&vms));
    check(&text);
    // The ingress check, on a link every namespace has: made, kept, moved
    // away and removed.
    let l = ingress();
    let linked = |i: usize, link| VmRules {
        link,
        ..vm(ids[i], &addresses[i], &policies[i])
    };
    let mut text = rules::table(&l, &[linked(0, Some("lo")), linked(1, None)]);
    text.push_str(&rules::change(
        &l,
        Some(&linked(0, Some("lo"))),
        Some(&linked(0, Some("lo"))),
    ));
    text.push_str(&rules::change(
        &l,
        Some(&linked(0, Some("lo"))),
        Some(&linked(0, None)),
    ));
    text.push_str(&rules::change(
        &l,
        Some(&linked(1, None)),
        Some(&linked(1, Some("lo"))),
    ));
    text.push_str(&rules::change(&l, Some(&linked(1, Some("lo"))), None));
    check(&text);
    // The output hook's (cgroup match), every mode; no cgroup element,
    // whose path nft would resolve.
    check(&rules::table(&layout(Match::Cgroup), &vms));
}

fn check(text: &str) {
    let out = std::process::Command::new("nft")
        .args(["-c", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            child
                .stdin
                .take()
                .expect("stdin")
                .write_all(text.as_bytes())?;
            child.wait_with_output()
        })
        .expect("nft runs");
    assert!(
        out.status.success(),
        "{}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn with_events_refused_packets_are_counted_rate_limited_and_logged() {
    let mut l = layout(Match::Address);
    l.events = Some(rules::Events {
        group: 7711,
        rate: 500,
    });
    let a = addrs();
    let p = policy(r#"{"mode": "allowlist", "rules": [{"cidr": "198.51.100.7"}]}"#);
    let r = rules::table(&l, &[vm("vm-1", &a, &p)]);
    let k = rules::key("vm-1");
    let chain = chain_rules(&r, &format!("vm_{k}"));
    let tail: Vec<&str> = chain
        .iter()
        .rev()
        .take(4)
        .rev()
        .map(String::as_str)
        .collect();
    assert_eq!(
        tail,
        [
            format!("counter name refused_{k}").as_str(),
            &format!("meta l4proto {{ tcp, udp }} limit name log_{k} counter name lost_{k} drop"),
            "meta l4proto { tcp, udp } log prefix \"egm r vm-1\" group 7711 snaplen 96 drop",
            "drop",
        ]
    );
    // IPv6 likewise; no observed sets, a `lost` counter.
    let v6 = chain_rules(&r, &format!("v6_{k}"));
    assert_eq!(v6.len(), 4, "{v6:?}");
    assert!(!r.contains("obs_") && !r.contains("obs6_"), "{r}");
    assert!(r.contains(&format!("add counter inet egress_machine lost_{k}")));
    // One bucket for both chains: the rate is the VM's, not each family's.
    let limit = format!(
        "add limit inet egress_machine log_{k} {{ rate over 500/second burst 500 packets; }}"
    );
    assert_eq!(r.matches(&limit).count(), 1, "{r}");
    assert!(
        v6.iter()
            .any(|l| l.contains(&format!("limit name log_{k} "))),
        "{v6:?}"
    );
    assert_eq!(r.matches("limit rate").count(), 0, "{r}");
    // Audit: would refuse, passed.
    let audit = policy(r#"{"mode": "audit"}"#);
    let r = rules::table(&l, &[vm("vm-1", &a, &audit)]);
    let chain = chain_rules(&r, &format!("vm_{k}"));
    assert!(
        chain
            .iter()
            .any(|c| c.ends_with("log prefix \"egm w vm-1\" group 7711 snaplen 96 accept")),
        "{chain:?}"
    );
    assert_eq!(chain.last().map(String::as_str), Some("accept"));
    // Removing the VM deletes its `lost` counter and no observed set.
    let gone = rules::change(&l, Some(&vm("vm-1", &a, &audit)), None);
    assert!(gone.contains(&format!("delete counter inet egress_machine lost_{k}")));
    assert!(
        !gone.contains("delete set inet egress_machine obs"),
        "{gone}"
    );
}

/// nft 1.0.x fetches the elements of every interval set that is not a
/// concatenation, named or anonymous, before each change to the table: one
/// dump per such set of every VM made a change's cost grow with the VMs.
/// So the table has none.
#[test]
fn every_interval_set_is_a_concatenation() {
    let p = policy(ALLOWLIST);
    let a = addrs();
    let layouts = [
        (Match::Address, LinkCheck::Prerouting),
        (Match::Address, LinkCheck::Ingress),
        (Match::Cgroup, LinkCheck::Prerouting),
    ];
    for (matching, link_check) in layouts {
        for events in [None, Some(rules::Events { group: 7, rate: 10 })] {
            let l = Layout {
                events,
                link_check,
                ..layout(matching)
            };
            let v = VmRules {
                cgroup: Some("machines/vm1"),
                ..vm("vm1", &a, &p)
            };
            let text = rules::table(&l, &[v]);
            for line in text.lines() {
                if line.contains("flags interval") {
                    let ty = line.split("type ").nth(1).and_then(|t| t.split(';').next());
                    assert!(ty.is_some_and(|t| t.contains(" . ")), "{line}");
                }
                if line.starts_with("add rule") {
                    // An anonymous set holding a prefix or a range is an interval set.
                    for set in line.split('{').skip(1) {
                        let set = set.split('}').next().unwrap_or_default();
                        assert!(!set.contains('/') && !set.contains('-'), "{line}");
                    }
                }
            }
        }
    }
}

/// An nft run that hangs is killed at its limit and fails, instead of
/// holding the state lock (every VM call, the observer) for good; one that
/// fails says what it printed; a large ruleset reaches it whole; one
/// killed by a signal may have committed.
#[test]
fn an_nft_run_is_bounded_in_time_and_reports_what_it_said() {
    let sh = |script: &str| Nft::new(vec!["sh".into(), "-c".into(), script.into(), "nft".into()]);
    let hung = sh("exec sleep 30").with_timeout(Duration::from_millis(300));
    let started = std::time::Instant::now();
    let e = hung.apply("flush ruleset\n").expect_err("killed");
    assert!(e.message.contains("did not finish within 300ms"), "{e}");
    assert!(e.unsure, "killed while it ran: it may have committed");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    let e = sh("echo 'Error: no such table' >&2; exit 1")
        .apply("x")
        .expect_err("fails");
    assert_eq!(e.message, "Error: no such table");
    assert!(!e.unsure, "nft said it failed");
    // 4 MiB, echoed back in full.
    let big = "add element inet t s { 1.2.3.4 }\n".repeat(128 * 1024);
    let out = sh("cat").run(&["-f", "-"], Some(&big)).expect("ran");
    assert_eq!(out.len(), big.len());
    // The input is whole before nft starts (not a pipe a gateway killed
    // halfway would cut short at a line's end): a file of its full size.
    let seen = sh("[ -p /dev/stdin ] && echo pipe; stat -L -c %s /dev/stdin")
        .run(&["-f", "-"], Some(&big))
        .expect("ran");
    assert_eq!(seen.trim(), big.len().to_string());
    // Killed by a signal, it never said how it ended: it may have
    // committed (the table is then installed again, whole).
    let e = sh("cat >/dev/null; kill -9 $$")
        .apply("flush ruleset\n")
        .expect_err("killed");
    assert!(e.unsure, "{e}");
    assert!(e.message.contains("killed by signal 9"), "{e}");
}
