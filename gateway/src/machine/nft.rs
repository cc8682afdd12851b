//! A VM's policy as an nftables table, and reading back what the kernel saw.
//!
//! Each VM has its own table `inet egress_vm_<id>`; a policy change replaces
//! it whole in one `nft -f` transaction (the file declares the table, deletes
//! it and declares it again), so the VM never runs without a policy and
//! never with half of one. The rules:
//!
//! - packets *from* the VM's addresses (forward hook) that open a flow are
//!   judged against the mode and the rule sets: `any` (interval CIDRs),
//!   `proto` (CIDR . protocol) and `port` (CIDR . protocol . port); packets
//!   of a flow already established pass on its conntrack entry first, so an open
//!   flow keeps the verdict it was accepted under (as a sandbox flow keeps
//!   its policy) — except under `loopback`, which cuts open flows too;
//! - refused packets (or, in audit, would-be-refused ones) update the dynamic
//!   set `observed` (destination . protocol . port, with a per-element
//!   counter and a timeout refreshed by each packet) and count in the named
//!   counter `refused`; the drop is a separate rule, so a full set never lets
//!   a packet through;
//! - packets *to* the VM's addresses pass only as replies (`ct state
//!   established,related`), as behind the user-mode network of a QEMU guest.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::net::{IpAddr, Ipv4Addr};
use std::process::{Command, Stdio};
use std::time::Duration;

use egress_policy::machine::{KernelSets, MachineEgress, Mode, Proto};

/// How long an observed element lives in the kernel without packets.
/// The gateway reads elements far more often; this only bounds how long a
/// destination nobody asks about occupies a slot.
const OBSERVED_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

/// Why nft failed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("nft: {0}")]
pub struct NftError(pub String);

/// The nftables command (`machine_egress.nft`).
#[derive(Clone, Debug)]
pub struct Nft {
    argv: Vec<String>,
}

/// One element of a VM's `observed` set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelObserved {
    pub addr: Ipv4Addr,
    pub proto: Proto,
    pub port: u16,
    /// Packets since the element was added.
    pub packets: u64,
    /// How long ago the last packet was (timeout minus time left).
    pub idle: Duration,
}

/// The table of a VM. Ids are `[A-Za-z0-9._-]`; everything but letters and
/// digits is escaped as `_xx` (hex), so two ids never share a table.
pub fn table_name(vm: &str) -> String {
    let mut name = String::from("egress_vm_");
    for b in vm.bytes() {
        if b.is_ascii_alphanumeric() {
            name.push(char::from(b));
        } else {
            let _ = write!(name, "_{b:02x}");
        }
    }
    name
}

/// The whole table for one VM; applying it replaces the previous one.
pub fn ruleset(vm: &str, addresses: &[IpAddr], policy: &MachineEgress, capacity: usize) -> String {
    let table = table_name(vm);
    let mut out = String::new();
    let _ = writeln!(out, "# egress-gateway: machine egress of VM {vm:?}");
    let _ = writeln!(out, "table inet {table}\ndelete table inet {table}");
    let _ = writeln!(out, "table inet {table} {{");
    let _ = writeln!(out, "    comment \"mode {}\"", policy.mode.as_str());
    let _ = writeln!(out, "    counter refused {{ }}");
    source_sets(&mut out, addresses);
    rule_sets(&mut out, &policy.kernel_sets());
    observed_set(&mut out, capacity);
    forward_chain(&mut out, policy.mode);
    egress_chains(&mut out, policy.mode);
    out.push_str("}\n");
    out
}

/// `src4` and `src6`: the VM's addresses, which the forward chain matches.
fn source_sets(out: &mut String, addresses: &[IpAddr]) {
    let (v4, v6): (Vec<IpAddr>, Vec<IpAddr>) = addresses.iter().partition(|a| a.is_ipv4());
    let ips = |v: &[IpAddr]| list(v.iter().map(ToString::to_string));
    set(out, "src4", "ipv4_addr", "", &ips(&v4));
    set(out, "src6", "ipv6_addr", "", &ips(&v6));
}

/// `any`, `proto` and `port`: the policy's rules, as the egress chains
/// look them up.
fn rule_sets(out: &mut String, sets: &KernelSets) {
    let interval = "flags interval; ";
    let any = list(sets.any.iter().map(ToString::to_string));
    let proto = list(sets.proto.iter().map(|(n, p)| format!("{n} . {p}")));
    let port = list(
        sets.port
            .iter()
            .map(|(n, p, port)| format!("{n} . {p} . {port}")),
    );
    set(out, "any", "ipv4_addr", interval, &any);
    set(out, "proto", "ipv4_addr . inet_proto", interval, &proto);
    set(
        out,
        "port",
        "ipv4_addr . inet_proto . inet_service",
        interval,
        &port,
    );
}

/// `observed`: the dynamic set refused packets update.
fn observed_set(out: &mut String, capacity: usize) {
    let _ = writeln!(
        out,
        "    set observed {{ type ipv4_addr . inet_proto . inet_service; size {capacity}; flags dynamic, timeout; timeout {}s; counter; }}",
        OBSERVED_TIMEOUT.as_secs()
    );
}

/// The `forward` chain: packets from the VM jump to its egress chain,
/// packets to it pass only as replies.
///
/// Before the usual filter priority, so other forward chains see only
/// what the VM's policy let through. An open flow keeps the verdict it
/// was accepted under, as sandbox flows do: its packets, both ways, pass
/// on the conntrack entry the kernel looked up anyway, before any set
/// lookup. Loopback has no such rule: it cuts open flows too.
fn forward_chain(out: &mut String, mode: Mode) {
    let _ = writeln!(
        out,
        "    chain forward {{\n        type filter hook forward priority filter - 10; policy accept;"
    );
    if mode != Mode::Loopback {
        let _ = writeln!(out, "        ct state established,related accept");
    }
    let _ = writeln!(out, "        ip saddr @src4 jump egress4");
    let _ = writeln!(out, "        ip6 saddr @src6 jump egress6");
    let _ = writeln!(
        out,
        "        ip daddr @src4 ct state established,related accept"
    );
    let _ = writeln!(out, "        ip daddr @src4 drop");
    let _ = writeln!(
        out,
        "        ip6 daddr @src6 ct state established,related accept"
    );
    let _ = writeln!(out, "        ip6 daddr @src6 drop\n    }}");
}

/// The `egress4` and `egress6` chains: the per-mode rules for a packet
/// the VM sends (IPv6 has no rule sets: it is refused, or passes in open
/// and audit).
fn egress_chains(out: &mut String, mode: Mode) {
    let judged = "        ip daddr @any accept\n        ip daddr . meta l4proto @proto accept\n        ip daddr . meta l4proto . th dport @port accept\n";
    let record = "        meta l4proto { tcp, udp } update @observed { ip daddr . meta l4proto . th dport }\n";
    let (egress4, egress6) = match mode {
        Mode::Open => ("        accept\n".to_owned(), "        accept\n"),
        Mode::Loopback => (
            format!("{record}        counter name refused drop\n"),
            "        counter name refused drop\n",
        ),
        Mode::Allowlist => (
            format!("{judged}{record}        counter name refused drop\n"),
            "        counter name refused drop\n",
        ),
        // Everything passes; what an allowlist would drop is recorded.
        Mode::Audit => (
            format!("{judged}{record}        counter name refused accept\n"),
            "        counter name refused accept\n",
        ),
    };
    let _ = writeln!(out, "    chain egress4 {{\n{egress4}    }}");
    let _ = writeln!(out, "    chain egress6 {{\n{egress6}    }}");
}

/// The elements of a set, as nft lists them.
fn list(items: impl Iterator<Item = String>) -> String {
    items.collect::<Vec<_>>().join(", ")
}

fn set(out: &mut String, name: &str, ty: &str, flags: &str, elements: &str) {
    let elements = if elements.is_empty() {
        String::new()
    } else {
        format!("elements = {{ {elements} }}; ")
    };
    let _ = writeln!(out, "    set {name} {{ type {ty}; {flags}{elements}}}");
}

impl Nft {
    pub fn new(argv: Vec<String>) -> Self {
        Self { argv }
    }

    /// Applies a ruleset in one transaction (`nft -f -`).
    pub fn apply(&self, ruleset: &str) -> Result<(), NftError> {
        self.run(&["-f", "-"], Some(ruleset)).map(drop)
    }

    /// Deletes a VM's table; a table already gone is not an error.
    pub fn delete(&self, vm: &str) -> Result<(), NftError> {
        let table = table_name(vm);
        let text = format!("table inet {table}\ndelete table inet {table}\n");
        self.apply(&text)
    }

    /// The tables of every VM installed now.
    pub fn tables(&self) -> Result<Vec<String>, NftError> {
        let out = self.run(&["-j", "list", "tables", "inet"], None)?;
        let doc: serde_json::Value = serde_json::from_str(&out)
            .map_err(|e| NftError(format!("unreadable `nft -j list tables`: {e}")))?;
        Ok(items(&doc, "table")
            .filter_map(|t| t.get("name")?.as_str())
            .filter(|n| n.starts_with("egress_vm_"))
            .map(str::to_owned)
            .collect())
    }

    /// The `refused` counter of every VM table: table → packets.
    pub fn refused_counters(&self) -> Result<BTreeMap<String, u64>, NftError> {
        let out = self.run(&["-j", "list", "counters"], None)?;
        let doc: serde_json::Value = serde_json::from_str(&out)
            .map_err(|e| NftError(format!("unreadable `nft -j list counters`: {e}")))?;
        Ok(items(&doc, "counter")
            .filter(|c| c.get("name").and_then(|n| n.as_str()) == Some("refused"))
            .filter_map(|c| {
                let table = c.get("table")?.as_str()?;
                table.starts_with("egress_vm_").then_some(())?;
                Some((table.to_owned(), c.get("packets")?.as_u64()?))
            })
            .collect())
    }

    /// The elements of a VM's `observed` set.
    pub fn observed(&self, vm: &str) -> Result<Vec<KernelObserved>, NftError> {
        let table = table_name(vm);
        let out = self.run(&["-j", "list", "set", "inet", &table, "observed"], None)?;
        let doc: serde_json::Value = serde_json::from_str(&out)
            .map_err(|e| NftError(format!("unreadable `nft -j list set`: {e}")))?;
        Ok(items(&doc, "set")
            .filter_map(|s| s.get("elem")?.as_array())
            .flatten()
            .filter_map(element)
            .collect())
    }

    /// Removes elements from a VM's `observed` set (evicted by the gateway).
    pub fn forget(&self, vm: &str, keys: &[(Ipv4Addr, Proto, u16)]) -> Result<(), NftError> {
        if keys.is_empty() {
            return Ok(());
        }
        let table = table_name(vm);
        let mut text = String::new();
        for chunk in keys.chunks(512) {
            let list: Vec<String> = chunk
                .iter()
                .map(|(a, p, port)| format!("{a} . {p} . {port}"))
                .collect();
            let _ = writeln!(
                text,
                "delete element inet {table} observed {{ {} }}",
                list.join(", ")
            );
        }
        self.apply(&text)
    }

    fn run(&self, args: &[&str], stdin: Option<&str>) -> Result<String, NftError> {
        let (program, lead) = self
            .argv
            .split_first()
            .ok_or_else(|| NftError("machine_egress.nft is empty".into()))?;
        let mut child = Command::new(program)
            .args(lead)
            .args(args)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| NftError(format!("cannot run {program}: {e}")))?;
        if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
            pipe.write_all(text.as_bytes())
                .map_err(|e| NftError(e.to_string()))?;
        }
        let out = child
            .wait_with_output()
            .map_err(|e| NftError(e.to_string()))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(NftError(
                String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            ))
        }
    }
}

/// The objects of one kind in `nft -j` output: `{"nftables": [{kind: {..}}]}`.
fn items<'a>(
    doc: &'a serde_json::Value,
    kind: &'a str,
) -> impl Iterator<Item = &'a serde_json::Value> + 'a {
    doc.get("nftables")
        .and_then(|v| v.as_array())
        .into_iter()
        .flatten()
        .filter_map(move |o| o.get(kind))
}

/// One set element: `{"elem": {"val": {"concat": [addr, proto, port]},
/// "expires": s, "counter": {"packets": n}}}`.
fn element(e: &serde_json::Value) -> Option<KernelObserved> {
    let elem = e.get("elem")?;
    let concat = elem.get("val")?.get("concat")?.as_array()?;
    let [addr, proto, port] = concat.as_slice() else {
        return None;
    };
    let addr: Ipv4Addr = addr.as_str()?.parse().ok()?;
    let proto = match proto {
        serde_json::Value::String(s) => s.parse().ok()?,
        serde_json::Value::Number(n) => match n.as_u64()? {
            6 => Proto::Tcp,
            17 => Proto::Udp,
            _ => return None,
        },
        _ => return None,
    };
    let port = u16::try_from(port.as_u64()?).ok()?;
    let packets = elem
        .get("counter")
        .and_then(|c| c.get("packets"))
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(0);
    let expires = elem
        .get("expires")
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(OBSERVED_TIMEOUT.as_secs());
    let idle = OBSERVED_TIMEOUT.saturating_sub(Duration::from_secs(expires));
    Some(KernelObserved {
        addr,
        proto,
        port,
        packets,
        idle,
    })
}

#[cfg(test)]
mod tests;
