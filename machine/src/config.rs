//! The `[machine_egress]` section of the gateway's configuration, and the
//! names it and the VM routes accept (interfaces, cgroup paths) as nft can
//! quote them.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// An interface name as the kernel takes it and nft can quote: 1 to 15
/// letters, digits, `-`, `_` or `.`.
pub fn is_iface_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 15
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

/// A cgroup path as nft can quote it: components of letters, digits and
/// `-_.@:`, none of them `.` or `..`, separated by `/`.
pub fn is_cgroup_path(s: &str) -> bool {
    let s = s.trim_matches('/');
    !s.is_empty()
        && s.split('/').all(|c| {
            !c.is_empty()
                && c != "."
                && c != ".."
                && c.len() <= 255
                && c.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.@:".contains(&b))
        })
}

/// Machine egress: the L4 policy of user-mode VMs, enforced in nftables
/// (`docs/machine-egress.md`).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct MachineEgressConfig {
    /// The nftables command and any leading arguments, e.g.
    /// `["ip", "netns", "exec", "qemu", "nft"]` to govern another namespace.
    pub nft: Vec<String>,
    /// The conntrack command and any leading arguments, which must reach
    /// the namespace nft governs: the open flows of an address that left
    /// its VM are deleted with it. Unset: `nft`'s, its last word (`nft`)
    /// read `conntrack`.
    pub conntrack: Option<Vec<String>>,
    /// Refused (or, in audit, would-be-refused) destinations kept per VM;
    /// the oldest are evicted beyond it.
    pub observed_capacity: usize,
    /// How often the kernel's counters are read for new observations.
    #[serde(deserialize_with = "egress_policy::duration::deserialize")]
    pub observe_interval: Duration,
    /// How VMs are told apart: by source address on the forward hook (a
    /// network namespace per QEMU process), or by the QEMU process's cgroup
    /// on the output hook (QEMU in the host namespace).
    #[serde(rename = "match")]
    pub matching: MachineMatch,
    /// Where the cgroup v2 hierarchy is mounted, relative to
    /// `/sys/fs/cgroup`: `""` on a unified host, `"unified"` on a hybrid one.
    pub cgroup_prefix: String,
    /// Where this gateway reads the cgroup tree nft resolves paths in (its
    /// `/sys/fs/cgroup`): to leave out a VM whose cgroup is not there and
    /// to see a cgroup made again under its path. Absolute.
    pub cgroup_root: std::path::PathBuf,
    /// How refused packets reach the observed record: as events on an
    /// NFLOG group (exact), or sampled from the kernel's observed sets.
    pub observe: MachineObserve,
    /// The NFLOG group the rules log to (events): this gateway binds it in
    /// its own network namespace, which must be the rules' one.
    pub log_group: u16,
    /// Refused packets each VM may log per second (and in a burst); the
    /// rest are counted as lost, not logged.
    pub log_rate: u32,
    /// Where a VM link's sources are checked: on the link's own ingress
    /// hook, or on the node's prerouting hook (every packet, one lookup by
    /// interface name). `auto` takes the ingress hook when the kernel binds
    /// an ingress chain by the device's name (Linux 6.16 and later: a link
    /// created, or created again, later is checked from its first packet).
    pub link_check: MachineLinkCheck,
}

/// `machine_egress.link_check`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MachineLinkCheck {
    #[default]
    Auto,
    Ingress,
    Prerouting,
}

/// `machine_egress.observe`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MachineObserve {
    #[default]
    Events,
    Sampled,
}

/// `machine_egress.match`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MachineMatch {
    #[default]
    Address,
    Cgroup,
}

impl Default for MachineEgressConfig {
    fn default() -> Self {
        Self {
            nft: vec!["nft".into()],
            conntrack: None,
            observed_capacity: 4_096,
            observe_interval: Duration::from_secs(5),
            matching: MachineMatch::Address,
            cgroup_prefix: String::new(),
            cgroup_root: "/sys/fs/cgroup".into(),
            observe: MachineObserve::Events,
            log_group: 7711,
            log_rate: 1_000,
            link_check: MachineLinkCheck::Auto,
        }
    }
}

impl MachineEgressConfig {
    /// `conntrack`, or when unset `nft` with its last word `conntrack`: it
    /// must run where nft does, in the rules' namespace.
    pub fn conntrack_argv(&self) -> Result<Vec<String>, String> {
        if let Some(argv) = &self.conntrack {
            return match argv.first().is_none_or(|c| c.is_empty()) {
                true => Err("name the conntrack command".into()),
                false => Ok(argv.clone()),
            };
        }
        let mut argv = self.nft.clone();
        match argv.last_mut() {
            Some(last) if last == "nft" || last.ends_with("/nft") => {
                last.truncate(last.len() - "nft".len());
                last.push_str("conntrack");
                Ok(argv)
            }
            _ => Err(format!(
                "unset, and machine_egress.nft {:?} does not end in nft: name the conntrack command that runs in the same namespace",
                self.nft
            )),
        }
    }

    /// The first invalid field: its key and why.
    pub fn first_invalid(&self) -> Option<(&'static str, String)> {
        if self.nft.first().is_none_or(|c| c.is_empty()) {
            return Some(("machine_egress.nft", "name the nft command".into()));
        }
        if let Err(why) = self.conntrack_argv() {
            return Some(("machine_egress.conntrack", why));
        }
        if !(16..=65_536).contains(&self.observed_capacity) {
            let why = format!("{} is outside 16..=65536", self.observed_capacity);
            return Some(("machine_egress.observed_capacity", why));
        }
        if !(1..=100_000).contains(&self.log_rate) {
            let why = format!("{} is outside 1..=100000", self.log_rate);
            return Some(("machine_egress.log_rate", why));
        }
        if self.observe_interval < Duration::from_millis(100) {
            let why = format!("{:?} is shorter than 100ms", self.observe_interval);
            return Some(("machine_egress.observe_interval", why));
        }
        if self.observe_interval > Duration::from_secs(3_600) {
            let why = format!("{:?} is longer than 1h", self.observe_interval);
            return Some(("machine_egress.observe_interval", why));
        }
        if !self.cgroup_root.is_absolute() {
            let why = format!("{:?}: expected an absolute path", self.cgroup_root);
            return Some(("machine_egress.cgroup_root", why));
        }
        let prefix = self.cgroup_prefix.trim_matches('/');
        if !prefix.is_empty() && !is_cgroup_path(prefix) {
            let why = format!(
                "{:?}: expected a relative path of plain names",
                self.cgroup_prefix
            );
            return Some(("machine_egress.cgroup_prefix", why));
        }
        None
    }
}
