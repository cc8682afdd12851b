//! Machine egress's metrics, read at scrape time from the VMs' records:
//! `egress_machine_vms{mode}`, `egress_machine_refused_packets_total{vm,outcome}`,
//! `egress_machine_spoofed_packets_total{vm}`,
//! `egress_machine_observed_evictions_total`, `egress_machine_observe_lost_total{cause}`,
//! `egress_machine_table_restored_total`, `egress_machine_cgroups_rebound_total`,
//! `egress_machine_conntrack_failures_total`
//! (the gateway's registry adds the `egress_` prefix).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use egress_policy::machine::Mode;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use crate::{lock, Machines};

/// The collector the gateway registers: machine egress's figures at each scrape.
pub fn collector(machines: Arc<Machines>) -> Box<dyn Collector> {
    Box::new(MachineSources { machines })
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModeLabels {
    mode: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VmLabels {
    vm: String,
    /// `refused` (dropped) or `would_refuse` (audit: recorded, passed).
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SpoofLabels {
    vm: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CauseLabels {
    cause: &'static str,
}

/// Machine egress's figures at one moment.
#[derive(Debug, Default)]
pub(crate) struct MachineCounts {
    /// VMs by the mode of the policy in force: (mode, VMs), every mode.
    by_mode: Vec<(&'static str, u64)>,
    /// (VM, audit, packets refused or would-be-refused).
    packets: Vec<(String, bool, u64)>,
    /// (VM, packets dropped on its link for a source not its own).
    spoofed: Vec<(String, u64)>,
    evictions: u64,
    /// Times the table was found gone or incomplete and installed again.
    restored: u64,
    /// Times a VM's cgroup was found made again, gone or back.
    rebound: u64,
    /// Changes whose addresses' open flows could not be deleted.
    conntrack_failed: u64,
    /// Events that never reached the record, by cause.
    lost: Vec<(&'static str, u64)>,
}

/// Machine egress, read at scrape time. The `vm` label is bounded by the
/// VMs on this worker; a removed VM's series goes with it.
#[derive(Debug)]
struct MachineSources {
    machines: Arc<Machines>,
}

impl Collector for MachineSources {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let f = self.machines.figures();
        totals(&mut encoder, &f)?;
        let gauge = ConstGauge::new(0i64);
        let mut family = encoder.encode_descriptor(
            "machine_vms",
            "VMs under machine egress, by the mode of the policy in force.",
            None,
            gauge.metric_type(),
        )?;
        for (mode, n) in f.by_mode {
            ConstGauge::new(i64::try_from(n).unwrap_or(i64::MAX))
                .encode(family.encode_family(&ModeLabels { mode })?)?;
        }
        let counter = ConstCounter::new(0u64);
        let mut family = encoder.encode_descriptor(
            "machine_refused_packets",
            "Packets from a VM its policy refused (dropped), or in audit mode would have refused (passed), by VM; read from the kernel's counters.",
            None,
            counter.metric_type(),
        )?;
        for (vm, audit, n) in f.packets {
            let outcome = if audit { "would_refuse" } else { "refused" };
            ConstCounter::new(n).encode(family.encode_family(&VmLabels { vm, outcome })?)?;
        }
        let mut family = encoder.encode_descriptor(
            "machine_spoofed_packets",
            "Packets dropped on a VM's link because their source is not an address of that VM, or because they would make the VM the node's router (router advertisements, redirects), by VM; read from the kernel's counters.",
            None,
            counter.metric_type(),
        )?;
        for (vm, n) in f.spoofed {
            ConstCounter::new(n).encode(family.encode_family(&SpoofLabels { vm })?)?;
        }
        let mut family = encoder.encode_descriptor(
            "machine_observe_lost",
            "Refused packets that never reached the observed record as events (machine_egress.observe = \"events\"): over a VM's log rate, dropped by a full socket buffer (overrun), or unreadable.",
            None,
            counter.metric_type(),
        )?;
        for (cause, n) in f.lost {
            ConstCounter::new(n).encode(family.encode_family(&CauseLabels { cause })?)?;
        }
        Ok(())
    }
}

/// The node-wide counters, one series each.
fn totals(encoder: &mut DescriptorEncoder<'_>, f: &MachineCounts) -> Result<(), std::fmt::Error> {
    for (name, help, n) in [
        (
            "machine_observed_evictions",
            "Observed destinations evicted by the per-VM bound (machine_egress.observed_capacity).",
            f.evictions,
        ),
        (
            "machine_table_restored",
            "Times the observer found the machine egress table gone or missing a VM's objects (another tool flushed the ruleset, say), or dirty after a change that failed half-way, and installed it again.",
            f.restored,
        ),
        (
            "machine_conntrack_failures",
            "Changes whose addresses (left a VM, or given to one) could not have their open flows deleted by machine_egress.conntrack: a VM at one of them may use another's flows until they time out.",
            f.conntrack_failed,
        ),
        (
            "machine_cgroups_rebound",
            "Times the observer found a VM's cgroup made again under its path (a restarted QEMU's scope), gone or back, and bound the cgroup dispatch again (match = \"cgroup\").",
            f.rebound,
        ),
    ] {
        let c = ConstCounter::new(n);
        c.encode(encoder.encode_descriptor(name, help, None, c.metric_type())?)?;
    }
    Ok(())
}

impl Machines {
    /// VMs by mode, refused packets by VM (and whether they were dropped
    /// or, in audit, only recorded), evictions.
    pub(crate) fn figures(&self) -> MachineCounts {
        let state = self.view.load();
        let refused = lock(&self.refused);
        let spoofed = lock(&self.spoofed);
        let mut by_mode: Vec<(&'static str, u64)> =
            Mode::ALL.iter().map(|m| (m.as_str(), 0)).collect();
        let mut packets = Vec::new();
        let mut spoofed_packets = Vec::new();
        for vm in state.vms.values() {
            if let Some(slot) = by_mode
                .iter_mut()
                .find(|(m, _)| *m == vm.effective.mode.as_str())
            {
                slot.1 += 1;
            }
            let n = refused.get(&vm.id).map_or(0, |r| r.total);
            let audit = vm.effective.mode == Mode::Audit;
            packets.push((vm.id.clone(), audit, n));
            if vm.link.is_some() {
                let n = spoofed.get(&vm.id).map_or(0, |r| r.total);
                spoofed_packets.push((vm.id.clone(), n));
            }
        }
        MachineCounts {
            by_mode,
            packets,
            spoofed: spoofed_packets,
            evictions: self.evictions.load(Ordering::Relaxed),
            restored: self.restored.load(Ordering::Relaxed),
            conntrack_failed: self.conntrack_failed.load(Ordering::Relaxed),
            rebound: self.rebound.load(Ordering::Relaxed),
            lost: vec![
                ("rate", self.lost.rate.load(Ordering::Relaxed)),
                ("overrun", self.lost.overrun.load(Ordering::Relaxed)),
                ("unreadable", self.lost.unreadable.load(Ordering::Relaxed)),
            ],
        }
    }
}
