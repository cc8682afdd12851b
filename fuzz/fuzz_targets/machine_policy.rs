//! `egress_policy::machine::check` — the validation report the CLI, the
//! worker API and the admission webhook share — on arbitrary text, and the
//! kernel sets of what it accepts.
//!
//! Input: the policy text (UTF-8); its bytes, read 7 at a time, are also
//! sampled as (address, protocol, port) probes, besides the edges of every
//! rule's network and port.
//!
//! Properties:
//!
//! - `check` never panics, and `valid` says which report it gave;
//! - a valid report's policy, checked again, is valid with the same normal form;
//! - `kernel_sets()` allows exactly what `rules_allow` allows, for every probe;
//! - within the kernel sets no entry is made redundant by another (so the
//!   interval sets nft is given never overlap), and no network carries more
//!   than `MAX_ENTRIES_PER_NETWORK` distinct entries, inherited ones included;
//! - `passes` follows the mode; the node's nftables table is written for it.
#![no_main]

use std::net::{IpAddr, Ipv4Addr};

use egress_machine::nft::rules::{self, Layout, Match, VmRules};
use egress_policy::machine::{
    check, Entry, KernelSets, MachineEgress, Mode, Proto, MAX_ENTRIES_PER_NETWORK,
};
use ipnet::Ipv4Net;
use libfuzzer_sys::fuzz_target;

/// Probes from the input bytes, at most this many.
const MAX_PROBES: usize = 64;

fn kernel_allows(sets: &KernelSets, addr: Ipv4Addr, proto: Proto, port: u16) -> bool {
    sets.any.iter().any(|n| n.contains(&addr))
        || sets
            .proto
            .iter()
            .any(|(n, p)| n.contains(&addr) && *p == proto)
        || sets
            .port
            .iter()
            .any(|(n, p, q)| n.contains(&addr) && *p == proto && *q == port)
}

fn kernel_entries(sets: &KernelSets) -> Vec<(Ipv4Net, Entry)> {
    let any = sets.any.iter().map(|n| (*n, Entry::Any));
    let proto = sets.proto.iter().map(|(n, p)| (*n, Entry::Proto(*p)));
    let port = sets.port.iter().map(|(n, p, q)| (*n, Entry::Port(*p, *q)));
    any.chain(proto).chain(port).collect()
}

fn probes(policy: &MachineEgress, bytes: &[u8]) -> Vec<(Ipv4Addr, Proto, u16)> {
    let mut out = Vec::new();
    for r in &policy.rules {
        let port = r.port.unwrap_or(443);
        for addr in [
            r.net.network(),
            r.net.broadcast(),
            Ipv4Addr::from(u32::from(r.net.network()).wrapping_sub(1)),
            Ipv4Addr::from(u32::from(r.net.broadcast()).wrapping_add(1)),
        ] {
            for proto in Proto::ALL {
                for p in [port, port.wrapping_add(1), port.wrapping_sub(1)] {
                    out.push((addr, proto, p));
                }
            }
        }
    }
    for c in bytes.chunks_exact(7).take(MAX_PROBES) {
        let addr = Ipv4Addr::new(c[0], c[1], c[2], c[3]);
        let proto = Proto::ALL[usize::from(c[4] & 1)];
        out.push((addr, proto, u16::from_be_bytes([c[5], c[6]])));
    }
    out
}

fuzz_target!(|input: &[u8]| {
    let Ok(text) = std::str::from_utf8(input) else {
        return;
    };
    let (valid, report) = check(text);
    assert_eq!(report["valid"].as_bool(), Some(valid), "{report}");
    let parsed = MachineEgress::from_json(text);
    assert_eq!(parsed.is_ok(), valid);
    let Ok(policy) = parsed else {
        let errors = report["errors"].as_array().map_or(0, Vec::len);
        assert!(errors > 0, "refused without an error: {report}");
        return;
    };

    let normal = report["policy"].to_string();
    let (again_valid, again) = check(&normal);
    assert!(again_valid, "normal form {normal} refused: {again}");
    assert_eq!(again["policy"], report["policy"], "normal form not stable");
    assert_eq!(
        MachineEgress::from_json(&normal).as_ref(),
        Ok(&policy),
        "{normal}"
    );

    let sets = policy.kernel_sets();
    for (addr, proto, port) in probes(&policy, input) {
        let kernel = kernel_allows(&sets, addr, proto, port);
        let rules = policy.rules_allow(addr, proto, port);
        assert_eq!(kernel, rules, "{addr} {proto}/{port}: kernel sets {sets:?}");
        let passes = match policy.mode {
            Mode::Loopback => false,
            Mode::Open | Mode::Audit => true,
            Mode::Allowlist => rules,
        };
        assert_eq!(policy.passes(addr, proto, port), passes);
    }

    let entries = kernel_entries(&sets);
    for (i, &(n, e)) in entries.iter().enumerate() {
        for (j, &(m, f)) in entries.iter().enumerate() {
            assert!(
                i == j || !(m.contains(&n) && f.covers(e)),
                "kernel entry {n} {e} is redundant with {m} {f}"
            );
        }
        let mut inherited: Vec<Entry> = entries
            .iter()
            .filter(|(m, _)| m.contains(&n))
            .map(|(_, f)| *f)
            .collect();
        inherited.sort_unstable();
        inherited.dedup();
        assert!(
            inherited.len() <= MAX_ENTRIES_PER_NETWORK,
            "{n} carries {inherited:?}"
        );
    }

    let addresses = [IpAddr::V4(Ipv4Addr::new(100, 64, 0, 2))];
    let layout = Layout {
        matching: Match::Address,
        capacity: 1024,
        cgroup_prefix: String::new(),
        events: None,
        link_check: rules::LinkCheck::Ingress,
    };
    let vm = VmRules {
        id: "fuzz-vm",
        addresses: &addresses,
        link: None,
        cgroup: None,
        policy: &policy,
    };
    let table = rules::table(&layout, &[vm]);
    for (n, e) in &entries {
        assert!(
            table.contains(&n.to_string()),
            "{n} {e} missing from the table"
        );
    }
});
