//! Machine egress: the L4 policy of user-mode VMs, whose traffic their QEMU
//! process re-originates. The gateway does not proxy it: each VM's policy is
//! compiled into its own nftables table ([`nft`]) and the kernel enforces it,
//! TCP and UDP alike. The gateway keeps the VMs, the node default and what
//! the kernel refused ([`observed`]), serves the VM-manager routes
//! ([`api`]) and persists its state (`machines.json` in `state_dir`), so a
//! restart re-installs every table before the gateway reports ready.
//!
//! Every change is one transaction: the tables it touches are replaced in
//! one `nft -f`, then the state is made durable; if that fails the previous
//! tables are put back and the change is refused. Changes are serialised.

pub(crate) mod api;
pub mod nft;
pub mod observed;

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::SystemTime;

use egress_policy::machine::{MachineEgress, Mode};
use serde::{Deserialize, Serialize};

use crate::config::MachineEgressConfig;
use crate::registry::{Registry, RegistryError};
use nft::{Nft, NftError};

/// The file name under `state_dir`.
pub const STATE_FILE: &str = "machines.json";

/// Longest VM id.
const MAX_ID: usize = 64;

/// Why a change was refused.
#[derive(Debug, thiserror::Error)]
pub enum MachineError {
    #[error("invalid VM id {0:?}: expected 1 to 64 letters, digits, '-', '_' or '.'")]
    Id(String),
    #[error("no VM {0:?}")]
    Missing(String),
    #[error("{0}")]
    Conflict(#[from] RegistryError),
    #[error("VM {vm} lists address {address} twice")]
    DuplicateAddress { vm: String, address: IpAddr },
    #[error("a VM needs at least one address")]
    NoAddress,
    #[error("installing the rules failed (nothing changed): {0}")]
    Kernel(#[from] NftError),
    #[error("{path}: {message} (the rules were put back; nothing changed)")]
    Persist { path: PathBuf, message: String },
}

/// One VM as the gateway keeps it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Vm {
    pub id: String,
    pub addresses: Vec<IpAddr>,
    /// Its own policy; `None`: it follows the node default.
    pub egress: Option<MachineEgress>,
    /// The policy installed: its own, or the node default as it was when
    /// the VM started (or was last brought in line with `apply_running`).
    pub effective: MachineEgress,
}

/// The persisted state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct State {
    version: u32,
    /// The node default; without one, `loopback` (nothing leaves).
    default: MachineEgress,
    vms: BTreeMap<String, Vm>,
}

/// Machine egress on this worker.
#[derive(Debug)]
pub struct Machines {
    nft: Nft,
    capacity: usize,
    state_dir: PathBuf,
    registry: Arc<Registry>,
    state: Mutex<State>,
    observed: Mutex<HashMap<String, observed::Store>>,
    /// Refused packets by VM id: the kernel's `refused` counter at the last
    /// read, and the total since the VM was registered (a replaced table
    /// starts its counter again; the total carries on).
    refused: Mutex<BTreeMap<String, Refused>>,
    /// Observations evicted by the bound, over every VM ever registered.
    evictions: AtomicU64,
}

/// One VM's refused-packet count.
#[derive(Clone, Copy, Debug, Default)]
struct Refused {
    kernel: u64,
    total: u64,
}

impl Refused {
    /// Takes in a read of the kernel counter; true when it moved.
    fn account(&mut self, now: u64) -> bool {
        // Lower than last read: the table was replaced, all of it is new.
        let new = now.checked_sub(self.kernel).unwrap_or(now);
        self.total = self.total.saturating_add(new);
        let moved = now != self.kernel;
        self.kernel = now;
        moved
    }
}

/// A VM's policy as the API reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EgressView {
    pub policy: MachineEgress,
    /// The VM has its own policy (else it follows the node default).
    pub own: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A VM's addresses in canonical form (an IPv4-mapped IPv6 address is its
/// IPv4 address, as for sandboxes): at least one, none twice.
pub(crate) fn check_addresses(
    id: &str,
    addresses: Vec<IpAddr>,
) -> Result<Vec<IpAddr>, MachineError> {
    if addresses.is_empty() {
        return Err(MachineError::NoAddress);
    }
    let addresses: Vec<IpAddr> = addresses.into_iter().map(|a| a.to_canonical()).collect();
    let mut seen = std::collections::HashSet::new();
    if let Some(&address) = addresses.iter().find(|a| !seen.insert(**a)) {
        return Err(MachineError::DuplicateAddress {
            vm: id.to_owned(),
            address,
        });
    }
    Ok(addresses)
}

/// Checks a VM id: the same alphabet as sandbox ids, at most 64 characters.
pub fn valid_id(id: &str) -> Result<(), MachineError> {
    // The sandbox id's alphabet, shorter: an id becomes an nft table name.
    if id.len() <= MAX_ID && egress_policy::SandboxId::parse(id).is_ok() {
        Ok(())
    } else {
        Err(MachineError::Id(id.chars().take(MAX_ID + 1).collect()))
    }
}

impl Machines {
    /// Loads `machines.json` and installs every VM's table — before the
    /// gateway serves anything. Tables of VMs the state does not know are
    /// removed (the state is the record; a VM deleted while its table could
    /// not be removed is cleaned up here).
    pub fn start(
        config: &MachineEgressConfig,
        state_dir: &Path,
        registry: Arc<Registry>,
    ) -> Result<Arc<Self>, MachineError> {
        let path = state_dir.join(STATE_FILE);
        let loaded =
            match std::fs::read_to_string(&path) {
                Ok(text) => Some(serde_json::from_str::<State>(&text).map_err(|e| {
                    MachineError::Persist {
                        path: path.clone(),
                        message: format!("corrupt machine egress state: {e}; fix or remove it"),
                    }
                })?),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => {
                    return Err(MachineError::Persist {
                        path,
                        message: e.to_string(),
                    })
                }
            };
        let machines = Self {
            nft: Nft::new(config.nft.clone()),
            capacity: config.observed_capacity,
            state_dir: state_dir.to_owned(),
            registry,
            state: Mutex::new(State {
                version: 1,
                default: MachineEgress::loopback(),
                vms: BTreeMap::new(),
            }),
            observed: Mutex::new(HashMap::new()),
            refused: Mutex::new(BTreeMap::new()),
            evictions: AtomicU64::new(0),
        };
        if let Some(state) = loaded {
            for vm in state.vms.values() {
                machines.registry.claim_for_vm(&vm.id, &vm.addresses)?;
            }
            let text: String = state.vms.values().map(|vm| machines.ruleset(vm)).collect();
            if !text.is_empty() {
                machines.nft.apply(&text)?;
            }
            // Tables of VMs this state does not have.
            let known: Vec<String> = state.vms.keys().map(|id| nft::table_name(id)).collect();
            for table in machines.nft.tables()? {
                if !known.contains(&table) {
                    tracing::warn!(%table, "removing the table of a VM the gateway no longer has");
                    let text = format!("table inet {table}\ndelete table inet {table}\n");
                    machines.nft.apply(&text)?;
                }
            }
            if !state.vms.is_empty() {
                tracing::info!(vms = state.vms.len(), "re-installed machine egress tables");
            }
            *lock(&machines.state) = state;
        }
        Ok(Arc::new(machines))
    }

    fn ruleset(&self, vm: &Vm) -> String {
        nft::ruleset(&vm.id, &vm.addresses, &vm.effective, self.capacity)
    }

    /// Applies `next` in place of the current state for the VMs in `touched`
    /// (their tables replaced, or removed when `next` no longer has them):
    /// one nft transaction, then durable; otherwise rolled back.
    fn commit(
        &self,
        state: &mut State,
        next: State,
        touched: &[String],
    ) -> Result<(), MachineError> {
        self.keep_observed(state, touched);
        let forward = self.tables(&next, touched);
        if !forward.is_empty() {
            self.nft.apply(&forward)?;
        }
        if let Err(message) = save(&self.state_dir, &next) {
            let back = self.tables(state, touched);
            if let Err(e) = self.nft.apply(&back) {
                tracing::error!(error = %e, "could not put the previous machine egress rules back");
            }
            return Err(MachineError::Persist {
                path: self.state_dir.join(STATE_FILE),
                message,
            });
        }
        self.restart_refused(touched);
        *state = next;
        Ok(())
    }

    /// The nft text that makes the tables of `touched` what `s` says: each
    /// VM's table replaced, or removed when `s` does not have it.
    fn tables(&self, s: &State, touched: &[String]) -> String {
        touched
            .iter()
            .map(|id| match s.vms.get(id) {
                Some(vm) => self.ruleset(vm),
                None => {
                    let t = nft::table_name(id);
                    format!("table inet {t}\ndelete table inet {t}\n")
                }
            })
            .collect()
    }

    /// Replacing a table empties its observed set and restarts its
    /// counter: keep what they held for the VMs of `touched` that `state`
    /// has (the set is read only when the counter moved since the last
    /// read, as the observer does). A failed read is logged, not fatal.
    fn keep_observed(&self, state: &State, touched: &[String]) {
        let existing: Vec<&String> = touched
            .iter()
            .filter(|id| state.vms.contains_key(*id))
            .collect();
        if existing.is_empty() {
            return;
        }
        let counters = match self.nft.refused_counters() {
            Ok(counters) => counters,
            Err(e) => {
                tracing::warn!(error = %e, "reading refused counters before a change failed");
                return;
            }
        };
        for id in existing {
            let Some(&n) = counters.get(&nft::table_name(id)) else {
                continue;
            };
            let moved = lock(&self.refused)
                .entry(id.clone())
                .or_default()
                .account(n);
            if moved {
                if let Err(e) = self.read_observed(id) {
                    tracing::warn!(vm = %id, error = %e, "reading observed destinations before a change failed");
                }
            }
        }
    }

    /// The new tables of `touched` count from zero.
    fn restart_refused(&self, touched: &[String]) {
        let mut refused = lock(&self.refused);
        for id in touched {
            if let Some(r) = refused.get_mut(id) {
                r.kernel = 0;
            }
        }
    }

    /// Registers (or re-registers) a VM by the addresses its QEMU process's
    /// traffic has. Without `egress` it follows the node default.
    pub fn put_vm(
        &self,
        id: &str,
        addresses: Vec<IpAddr>,
        egress: Option<MachineEgress>,
    ) -> Result<Vm, MachineError> {
        valid_id(id)?;
        let addresses = check_addresses(id, addresses)?;
        let mut state = lock(&self.state);
        let before = state.vms.get(id).map(|vm| vm.addresses.clone());
        self.registry.claim_for_vm(id, &addresses)?;
        let mut next = state.clone();
        let effective = egress.clone().unwrap_or_else(|| next.default.clone());
        let vm = Vm {
            id: id.to_owned(),
            addresses,
            egress,
            effective,
        };
        next.vms.insert(id.to_owned(), vm.clone());
        if let Err(e) = self.commit(&mut state, next, &[id.to_owned()]) {
            match before {
                Some(addresses) => {
                    let _ = self.registry.claim_for_vm(id, &addresses);
                }
                None => self.registry.release_vm(id),
            }
            return Err(e);
        }
        Ok(vm)
    }

    /// Removes a VM and its table.
    pub fn delete_vm(&self, id: &str) -> Result<(), MachineError> {
        let mut state = lock(&self.state);
        if !state.vms.contains_key(id) {
            return Err(MachineError::Missing(id.to_owned()));
        }
        let mut next = state.clone();
        next.vms.remove(id);
        self.commit(&mut state, next, &[id.to_owned()])?;
        self.registry.release_vm(id);
        lock(&self.observed).remove(id);
        lock(&self.refused).remove(id);
        Ok(())
    }

    pub fn vm(&self, id: &str) -> Result<Vm, MachineError> {
        lock(&self.state)
            .vms
            .get(id)
            .cloned()
            .ok_or_else(|| MachineError::Missing(id.to_owned()))
    }

    pub fn vms(&self) -> Vec<Vm> {
        lock(&self.state).vms.values().cloned().collect()
    }

    pub fn egress(&self, id: &str) -> Result<EgressView, MachineError> {
        let vm = self.vm(id)?;
        Ok(EgressView {
            own: vm.egress.is_some(),
            policy: vm.effective,
        })
    }

    /// Sets a VM's own policy (`Some`) or clears it (`None`: it follows the
    /// node default from now on). The running VM takes it at once.
    pub fn set_egress(
        &self,
        id: &str,
        policy: Option<MachineEgress>,
    ) -> Result<EgressView, MachineError> {
        let mut state = lock(&self.state);
        let mut next = state.clone();
        let default = next.default.clone();
        let vm = next
            .vms
            .get_mut(id)
            .ok_or_else(|| MachineError::Missing(id.to_owned()))?;
        vm.effective = policy.clone().unwrap_or(default);
        vm.egress = policy;
        let view = EgressView {
            own: vm.egress.is_some(),
            policy: vm.effective.clone(),
        };
        self.commit(&mut state, next, &[id.to_owned()])?;
        Ok(view)
    }

    pub fn default_policy(&self) -> MachineEgress {
        lock(&self.state).default.clone()
    }

    /// Sets the node default. With `apply_running`, VMs that follow it take
    /// it at once (one transaction for all of them); without, only VMs
    /// registered afterwards. Returns the VMs that changed.
    pub fn set_default(
        &self,
        policy: MachineEgress,
        apply_running: bool,
    ) -> Result<Vec<String>, MachineError> {
        let mut state = lock(&self.state);
        let mut next = state.clone();
        next.default = policy.clone();
        let mut touched = Vec::new();
        if apply_running {
            for vm in next.vms.values_mut() {
                if vm.egress.is_none() && vm.effective != policy {
                    vm.effective = policy.clone();
                    touched.push(vm.id.clone());
                }
            }
        }
        self.commit(&mut state, next, &touched)?;
        Ok(touched)
    }

    /// Reads the VM's observed set from the kernel now, and returns the
    /// record, most recently seen first, with the store's evictions.
    pub fn observed(
        &self,
        id: &str,
    ) -> Result<(Vec<(observed::Key, observed::Seen)>, u64), MachineError> {
        self.vm(id)?;
        self.read_observed(id)?;
        let stores = lock(&self.observed);
        Ok(stores
            .get(id)
            .map(|s| (s.entries(), s.evictions()))
            .unwrap_or_default())
    }

    fn read_observed(&self, id: &str) -> Result<(), NftError> {
        let kernel = self.nft.observed(id)?;
        let now = SystemTime::now();
        let forget = {
            let mut stores = lock(&self.observed);
            let store = stores
                .entry(id.to_owned())
                .or_insert_with(|| observed::Store::new(self.capacity));
            let before = store.evictions();
            let forget = store.merge(now, &kernel);
            self.evictions
                .fetch_add(store.evictions() - before, Ordering::Relaxed);
            forget
        };
        self.nft.forget(id, &forget)
    }

    /// One round of the observer: reads every VM's `refused` counter, and
    /// the observed set of each VM whose counter moved.
    pub fn observe(&self) {
        let vms = self.vms();
        if vms.is_empty() {
            return;
        }
        let counters = match self.nft.refused_counters() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "reading the machine egress counters failed");
                return;
            }
        };
        for vm in vms {
            let Some(&now) = counters.get(&nft::table_name(&vm.id)) else {
                continue;
            };
            let moved = lock(&self.refused)
                .entry(vm.id.clone())
                .or_default()
                .account(now);
            if moved {
                if let Err(e) = self.read_observed(&vm.id) {
                    tracing::warn!(vm = %vm.id, error = %e, "reading observed destinations failed");
                }
            }
        }
    }

    /// Runs [`Machines::observe`] every `every` until the task is dropped.
    pub(crate) async fn observer(self: Arc<Self>, every: std::time::Duration) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let me = self.clone();
            let _ = tokio::task::spawn_blocking(move || me.observe()).await;
        }
    }
}

// === impl MachineFigures ===

impl crate::metrics::MachineFigures for Machines {
    /// VMs by mode, refused packets by VM (and whether they were dropped
    /// or, in audit, only recorded), evictions.
    fn figures(&self) -> crate::metrics::MachineCounts {
        let state = lock(&self.state);
        let refused = lock(&self.refused);
        let mut by_mode: Vec<(&'static str, u64)> =
            Mode::ALL.iter().map(|m| (m.as_str(), 0)).collect();
        let mut packets = Vec::new();
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
        }
        crate::metrics::MachineCounts {
            by_mode,
            packets,
            evictions: self.evictions.load(Ordering::Relaxed),
        }
    }
}

/// Writes the state (write, fsync, rename, like the snapshot).
fn save(dir: &Path, state: &State) -> Result<(), String> {
    let bytes = serde_json::to_vec_pretty(state).map_err(|e| e.to_string())?;
    crate::persist::write_atomically(dir, STATE_FILE, &bytes).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refused_counts_survive_a_replaced_table() {
        let mut r = Refused::default();
        assert!(r.account(5));
        assert!(!r.account(5), "no new packets");
        assert!(r.account(9));
        assert_eq!(r.total, 9);
        // The table was replaced: its counter starts again below the last read.
        assert!(r.account(2));
        assert_eq!(r.total, 11);
    }

    #[test]
    fn addresses_are_canonical_and_listed_once() {
        let ip = |s: &str| s.parse::<IpAddr>().expect("ip");
        assert_eq!(
            check_addresses("vm", vec![ip("::ffff:100.64.0.2")]).expect("valid"),
            [ip("100.64.0.2")]
        );
        // The same address twice, once IPv4-mapped: refused, as for sandboxes.
        let twice = check_addresses("vm", vec![ip("::ffff:100.64.0.2"), ip("100.64.0.2")]);
        assert!(
            matches!(twice, Err(MachineError::DuplicateAddress { .. })),
            "{twice:?}"
        );
        assert!(matches!(
            check_addresses("vm", vec![]),
            Err(MachineError::NoAddress)
        ));
        assert!(valid_id("vm-1.a_b").is_ok());
        for bad in ["", "a/b", "a b", &"a".repeat(65)] {
            assert!(valid_id(bad).is_err(), "{bad:?}");
        }
    }
}
