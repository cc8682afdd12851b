//! Machine egress: the L4 policy of user-mode VMs, whose traffic their QEMU
//! process re-originates. The gateway does not proxy it: each VM's policy is
//! compiled into nftables ([`nft`]) and the kernel enforces it,
//! TCP and UDP alike: one table for the node, a chain and sets per VM,
//! reached by a verdict-map lookup ([`nft::rules`]). The gateway keeps the
//! VMs, the node default and what the kernel refused ([`observed`]), serves
//! the VM-manager routes ([`api`]) and persists its state (one file per VM
//! under `state_dir/machines/`, [`store`]), so a restart re-installs the table before the gateway
//! reports ready.
//!
//! Every change is one transaction: the VMs it touches get their rules
//! replaced in one `nft -f`, then the state is made durable; if that fails
//! the previous rules are put back and the change is refused. Changes are
//! serialised.

pub mod api;
pub mod cgroups;
pub mod config;
pub mod conntrack;
pub mod counters;
pub mod events;
pub mod host;
pub mod metrics;
mod netlink;
pub mod nflog;
pub mod nft;
pub mod observed;
mod store;

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::SystemTime;

use egress_policy::machine::MachineEgress;
use serde::{Deserialize, Serialize};

use crate::config::{MachineEgressConfig, MachineLinkCheck, MachineObserve};
use nft::rules::{self, Layout, LinkCheck, Match, VmRules};
use nft::{Nft, NftError};

pub use store::{DIR as STATE_DIR, LEGACY_FILE};

/// Longest VM id.
const MAX_ID: usize = 64;

/// Most addresses one VM may hold: each one moved is a conntrack run made
/// under the state lock, and a 1 MiB body holds some 60,000.
const MAX_ADDRESSES: usize = 256;

/// Why a change was refused.
#[derive(Debug, thiserror::Error)]
pub enum MachineError {
    #[error("invalid VM id {0:?}: expected 1 to 64 letters, digits, '-', '_' or '.'")]
    Id(String),
    #[error("no VM {0:?}")]
    Missing(String),
    #[error("{0}")]
    Conflict(String),
    #[error("this gateway is handing over to its successor and takes no change: ask again (its successor answers on the same address)")]
    Sealed,
    #[error("VM {vm} lists address {address} twice")]
    DuplicateAddress { vm: String, address: IpAddr },
    #[error("a VM needs at least one address")]
    NoAddress,
    #[error("{field}: {message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
    #[error("{field}: {message}")]
    Taken {
        field: &'static str,
        message: String,
    },
    #[error("installing the rules failed (nothing changed): {0}")]
    Kernel(#[from] NftError),
    /// The transaction may have been committed (nft was killed at its time
    /// limit); the table is installed again from the state.
    #[error("installing the rules did not finish and may have taken effect: {0} (the next observer round installs the whole table again from the state, which does not have this change)")]
    KernelUnsure(NftError),
    #[error("{path}: {message} (the rules were put back; nothing changed)")]
    Persist { path: PathBuf, message: String },
    /// The stored state could not be read (at the start): no rule was
    /// changed to put back.
    #[error("reading the machine egress state: {path}: {message}")]
    Load { path: PathBuf, message: String },
    /// The state could not be written, and the rules it had could not be
    /// put back either: the kernel may enforce the change the state does
    /// not have until the table is installed again.
    #[error("{path}: {message} (the rules may not have been put back: {rollback}; the next observer round installs the whole table again from the state, which does not have this change)")]
    PersistUnsure {
        path: PathBuf,
        message: String,
        rollback: NftError,
    },
    /// No state was found, but the kernel's node table holds VMs' rules:
    /// the start would replace them with an empty table.
    #[error("machine egress: no state in {dir} (state_dir), but the kernel's table inet egress_machine holds VMs' chains ({chains}): starting would replace their rules with an empty table and forward their traffic unjudged. Restore the state directory, or remove the table (`nft delete table inet egress_machine`) to start with no VMs")]
    Orphaned { dir: PathBuf, chains: String },
    #[error("machine_egress.log_group {group}: {message}")]
    Log { group: u16, message: String },
    /// A stored VM registered under the other match mode: the rules of
    /// this mode would judge none of its traffic.
    #[error("machine egress: VM {vm} ({file}) {why}, but machine_egress.match is {now:?}: the node's rules would judge none of its traffic. Set machine_egress.match back, or remove the VM (its file, before the start) and register it again")]
    Mismatched {
        vm: String,
        file: PathBuf,
        why: &'static str,
        now: &'static str,
    },
}

/// One VM as the gateway keeps it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Vm {
    pub id: String,
    pub addresses: Vec<IpAddr>,
    /// The host side of the VM's link (address match): packets arriving on
    /// it from any other source are dropped as spoofed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link: Option<String>,
    /// The QEMU process's cgroup, relative to the cgroup v2 root (cgroup
    /// match).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<String>,
    /// Its own policy; `None`: it follows the node default.
    pub egress: Option<MachineEgress>,
    /// The policy installed: its own, or the node default as it was when
    /// the VM started (or was last brought in line with `apply_running`).
    pub effective: MachineEgress,
}

/// What `PUT /v1/vms/{id}` registers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Registration {
    pub addresses: Vec<IpAddr>,
    pub egress: Option<MachineEgress>,
    pub link: Option<String>,
    pub cgroup: Option<String>,
}

/// What machine egress needs from the rest of the node: the addresses its
/// sandboxes hold (a VM may not take one, nor a sandbox a VM's), and the
/// names the sandboxes' DNS answers gave an address (what an observation
/// is shown with). The gateway's registry and attribution cache answer it.
pub trait Neighbours: Send + Sync + std::fmt::Debug {
    /// Claims `addresses` for VM `vm` in place of its earlier claim;
    /// refused, with why, when a sandbox or another VM holds one.
    fn claim_for_vm(&self, vm: &str, addresses: &[IpAddr]) -> Result<(), String>;
    /// Gives up every address VM `vm` claimed.
    fn release_vm(&self, vm: &str);
    /// Names any sandbox on the node resolved to `addr`, each once, a few
    /// at most (a hint shown with an observation).
    fn names_for(&self, addr: IpAddr) -> Vec<String>;
}

impl Vm {
    fn rules(&self) -> VmRules<'_> {
        VmRules {
            id: &self.id,
            addresses: &self.addresses,
            link: self.link.as_deref(),
            cgroup: self.cgroup.as_deref(),
            policy: &self.effective,
        }
    }
}

/// The state: the node default and the VMs. Persisted one file per VM
/// ([`store`]); this whole document is the earlier layout's file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct State {
    version: u32,
    /// The node default; without one, `loopback` (nothing leaves).
    default: MachineEgress,
    /// Shared: a change clones the map, not the VMs it leaves alone.
    vms: BTreeMap<String, Arc<Vm>>,
}

impl State {
    /// No VM, and the node default `loopback`.
    fn empty() -> Self {
        Self {
            version: 1,
            default: MachineEgress::loopback(),
            vms: BTreeMap::new(),
        }
    }
}

/// Machine egress on this worker.
#[derive(Debug)]
pub struct Machines {
    nft: Nft,
    conntrack: conntrack::Conntrack,
    /// Changes whose addresses' open flows could not be deleted.
    conntrack_failed: AtomicU64,
    layout: Layout,
    store: store::Store,
    neighbours: Arc<dyn Neighbours>,
    state: Mutex<State>,
    /// `state` as last committed, for reads: a change holds `state` across
    /// nft and conntrack runs (up to their time limits), and a read on an
    /// async worker waiting for it would stall every flow on that worker.
    view: arc_swap::ArcSwap<State>,
    observed: Mutex<HashMap<String, observed::Store>>,
    /// Held across one read of a VM's observed set, its merge and the
    /// removals it asks (sampled).
    observing: Mutex<()>,
    /// Held across a read of the node table's counters and its accounting,
    /// and across a whole table installed and its counters' baselines
    /// reset: a read of the old table accounted after the reset (or of the
    /// new one before it) would be counted twice. Taken after `state`.
    accounting: Mutex<()>,
    /// Refused packets by VM id: the kernel's `refused` counter at the last
    /// read, and the total since the VM was registered (a replaced table
    /// starts its counter again; the total carries on).
    refused: Mutex<BTreeMap<String, Refused>>,
    /// Spoofed packets dropped on a VM's link, by VM id, likewise.
    spoofed: Mutex<BTreeMap<String, Refused>>,
    /// Observations evicted by the bound, over every VM ever registered.
    evictions: AtomicU64,
    /// Times the observer found the node table gone, incomplete or dirty
    /// and installed it again.
    restored: AtomicU64,
    /// The kernel may hold other rules than the state says: a change was
    /// applied and could not be put back, or an nft run was killed while
    /// it may have committed. The next change, or the observer's next
    /// round, installs the whole table from the state.
    dirty: std::sync::atomic::AtomicBool,
    /// Set under the state lock by [`Machines::seal`]: no change is made
    /// after, and the observer's rounds write nothing.
    sealed: std::sync::atomic::AtomicBool,
    /// The cgroup tree nft resolves paths in (`match = "cgroup"`).
    tree: cgroups::Tree,
    /// The inode each VM's cgroup element was loaded with.
    bound: Mutex<cgroups::Bound>,
    /// Times the observer found a VM's cgroup made again, gone or back, and
    /// bound the dispatch again.
    rebound: AtomicU64,
    /// The NFLOG socket (events), bound with the first VM, until the
    /// reader task takes it.
    log: Mutex<Option<rustix::fd::OwnedFd>>,
    /// The group is bound (the socket may already be with the reader).
    log_bound: std::sync::atomic::AtomicBool,
    /// Wakes the reader when the socket is there.
    log_ready: tokio::sync::Notify,
    /// Refused packets over a VM's log rate (`lost_<k>`), by VM id.
    unlogged: Mutex<BTreeMap<String, Refused>>,
    /// Events lost, every VM: over the rate, to a full socket buffer (gaps
    /// in the sequence), unreadable.
    lost: LostEvents,
}

/// Events that did not reach the record, by cause.
#[derive(Debug, Default)]
struct LostEvents {
    rate: AtomicU64,
    overrun: AtomicU64,
    unreadable: AtomicU64,
    /// The sequence number the next event should carry.
    next_seq: Mutex<Option<u32>>,
}

/// What `GET …/observed` reports of a VM.
#[derive(Debug, Default)]
pub struct ObservedView {
    /// Most recently seen first.
    pub entries: Vec<(observed::Key, observed::Seen)>,
    pub evictions: u64,
    /// Refused packets the log rate kept out of the record (events).
    pub lost: u64,
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
        self.add(now);
        let moved = now != self.kernel;
        self.kernel = now;
        moved
    }

    /// Adds what is new in a read of the kernel counter to the total, and
    /// returns it.
    fn add(&mut self, now: u64) -> u64 {
        // Lower than last read: the table was replaced, all of it is new.
        let new = now.checked_sub(self.kernel).unwrap_or(now);
        self.total = self.total.saturating_add(new);
        new
    }
}

/// A VM's policy as the API reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EgressView {
    pub policy: MachineEgress,
    /// The VM has its own policy (else it follows the node default).
    pub own: bool,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A VM's addresses in canonical form (an IPv4-mapped IPv6 address is its
/// IPv4 address, as for sandboxes): at least one, none twice.
pub fn check_addresses(id: &str, addresses: Vec<IpAddr>) -> Result<Vec<IpAddr>, MachineError> {
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

/// A VM's cgroup path: relative to the cgroup v2 root, plain names, at
/// most [`rules::MAX_CGROUP_LEVEL`] deep.
fn check_cgroup(path: &str) -> Result<(), MachineError> {
    let level = rules::cgroup_level(path);
    if !crate::config::is_cgroup_path(path) || path.starts_with('/') {
        let message = format!("{path:?}: expected a path relative to the cgroup v2 root, of names made of letters, digits and -_.@:");
        return Err(MachineError::Invalid {
            field: "cgroup",
            message,
        });
    }
    if level > rules::MAX_CGROUP_LEVEL {
        let message = format!(
            "{path:?} is {level} levels deep, more than {}",
            rules::MAX_CGROUP_LEVEL
        );
        return Err(MachineError::Invalid {
            field: "cgroup",
            message,
        });
    }
    Ok(())
}

/// A VM read back from the state directory, checked as its registration
/// was: its link and cgroup are written into nft's script text, and a
/// repeated address would fail the whole table at start.
pub(crate) fn check_stored(vm: &Vm) -> Result<(), MachineError> {
    if let Some(link) = vm
        .link
        .as_deref()
        .filter(|l| !crate::config::is_iface_name(l))
    {
        return Err(MachineError::Invalid {
            field: "link",
            message: format!("{link:?} is not an interface name"),
        });
    }
    if let Some(cgroup) = &vm.cgroup {
        check_cgroup(cgroup)?;
    } else {
        check_addresses(&vm.id, vm.addresses.clone())?;
    }
    Ok(())
}

/// A stored VM is one this match mode judges: by its addresses (no
/// cgroup), or by its cgroup (no link). `machine_egress.match` changed
/// across a restart would otherwise leave it to no rule at all.
fn fits(matching: Match, vm: &Vm, store: &store::Store) -> Result<(), MachineError> {
    let why = match matching {
        Match::Address if vm.cgroup.is_some() => Some("is matched by its cgroup"),
        Match::Address if vm.addresses.is_empty() => Some("has no address"),
        Match::Cgroup if vm.cgroup.is_none() => Some("is matched by its addresses"),
        Match::Cgroup if vm.link.is_some() => Some("has a link to check"),
        Match::Address | Match::Cgroup => None,
    };
    match why {
        Some(why) => Err(MachineError::Mismatched {
            vm: vm.id.clone(),
            file: store.vm_path(&vm.id),
            why,
            now: match matching {
                Match::Address => "address",
                Match::Cgroup => "cgroup",
            },
        }),
        None => Ok(()),
    }
}

/// At most [`MAX_ADDRESSES`] for a new registration only: a VM stored with
/// more (before the bound) still loads.
fn not_too_many(addresses: &[IpAddr]) -> Result<(), MachineError> {
    if addresses.len() <= MAX_ADDRESSES {
        return Ok(());
    }
    Err(MachineError::Invalid {
        field: "addresses",
        message: format!(
            "{} addresses, more than {MAX_ADDRESSES} for one VM",
            addresses.len()
        ),
    })
}

/// A link or cgroup another VM already has: `409`.
fn taken(state: &State, id: &str, r: &Registration) -> Result<(), MachineError> {
    for vm in state.vms.values().filter(|vm| vm.id != id) {
        if r.link.is_some() && vm.link == r.link {
            let message = format!("link {:?} already belongs to VM {}", vm.link, vm.id);
            return Err(MachineError::Taken {
                field: "link",
                message,
            });
        }
        let mine = r.cgroup.as_deref().map(|p| p.trim_end_matches('/'));
        let theirs = vm.cgroup.as_deref().map(|p| p.trim_end_matches('/'));
        // The path as nft reads it: `a/b/` is `a/b`.
        if mine.is_some() && theirs == mine {
            let message = format!("cgroup {:?} already belongs to VM {}", vm.cgroup, vm.id);
            return Err(MachineError::Taken {
                field: "cgroup",
                message,
            });
        }
    }
    Ok(())
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

/// The conntrack command of `config` ([`conntrack`]), tried once: one that
/// does not run is logged as an error, and the start goes on.
fn conntrack_of(config: &MachineEgressConfig) -> Result<conntrack::Conntrack, MachineError> {
    let argv = config
        .conntrack_argv()
        .map_err(|why| MachineError::Invalid {
            field: "machine_egress.conntrack",
            message: why,
        })?;
    let conntrack = conntrack::Conntrack::new(argv);
    if let Err(why) = conntrack.probe() {
        tracing::error!(%why, "machine_egress.conntrack does not run: the open flows of an address that leaves a VM cannot be deleted, and the next VM given it may use them");
    }
    Ok(conntrack)
}

/// The addresses of the VMs in `touched` that one holds in `before` and
/// not in `after`, or in `after` and not in `before`.
fn addresses_moved(before: &State, after: &State, touched: &[String]) -> Vec<IpAddr> {
    let held = |state: &State, id: &String| {
        state
            .vms
            .get(id)
            .map(|vm| vm.addresses.clone())
            .unwrap_or_default()
    };
    let mut moved = Vec::new();
    for id in touched {
        let (was, is) = (held(before, id), held(after, id));
        moved.extend(was.iter().filter(|a| !is.contains(a)));
        moved.extend(is.iter().filter(|a| !was.contains(a)));
    }
    moved
}

/// Reads the machine egress state under `state_dir` as [`Machines::start`]
/// does, and checks each VM fits `config`'s matching and claims its
/// addresses through `claim` as start does (in a scratch registry holding
/// the recovered sandboxes, say), but changes nothing here (no file, no
/// table): what a successor checks before it asks for a takeover. The
/// number of VMs.
pub fn check_state(
    config: &MachineEgressConfig,
    state_dir: &Path,
    claim: impl Fn(&str, &[IpAddr]) -> Result<(), String>,
) -> Result<usize, MachineError> {
    let store = store::Store::new(state_dir);
    let Some(state) = store.check(state_dir)? else {
        return Ok(0);
    };
    for vm in state.vms.values() {
        fits(config.matching, vm, &store)?;
        claim(&vm.id, &vm.addresses).map_err(MachineError::Conflict)?;
    }
    Ok(state.vms.len())
}

impl Machines {
    /// Loads the state ([`store`]) and installs the node table with every VM in
    /// it — before the gateway serves anything. Whatever the table held is
    /// replaced (the state is the record), and tables of the earlier
    /// one-table-per-VM layout are removed.
    pub fn start(
        config: &MachineEgressConfig,
        state_dir: &Path,
        neighbours: Arc<dyn Neighbours>,
    ) -> Result<Arc<Self>, MachineError> {
        let store = store::Store::new(state_dir);
        let nft = Nft::new(config.nft.clone());
        let conntrack = conntrack_of(config)?;
        let loaded = load(&store, &nft, state_dir)?;
        let link_check = link_check(&nft, config)?;
        let machines = Self {
            nft,
            conntrack,
            conntrack_failed: AtomicU64::new(0),
            layout: layout(config, link_check),
            store,
            neighbours,
            state: Mutex::new(State::empty()),
            view: arc_swap::ArcSwap::from_pointee(State::empty()),
            observed: Mutex::new(HashMap::new()),
            observing: Mutex::new(()),
            accounting: Mutex::new(()),
            refused: Mutex::new(BTreeMap::new()),
            spoofed: Mutex::new(BTreeMap::new()),
            evictions: AtomicU64::new(0),
            restored: AtomicU64::new(0),
            dirty: std::sync::atomic::AtomicBool::new(false),
            sealed: std::sync::atomic::AtomicBool::new(false),
            tree: cgroups::Tree::new(config.cgroup_root.clone(), &config.cgroup_prefix),
            bound: Mutex::new(cgroups::Bound::new()),
            rebound: AtomicU64::new(0),
            log: Mutex::new(None),
            log_bound: std::sync::atomic::AtomicBool::new(false),
            log_ready: tokio::sync::Notify::new(),
            unlogged: Mutex::new(BTreeMap::new()),
            lost: LostEvents::default(),
        };
        let state = loaded.unwrap_or_else(|| lock(&machines.state).clone());
        machines.take_in(config.matching, &state)?;
        if !state.vms.is_empty() {
            machines.ensure_log()?;
        }
        // The records exist before the rules do: their first events have a
        // place to go.
        for id in state.vms.keys() {
            machines.ensure_records(id);
        }
        let (vms, bound) = machines.bind(&state);
        machines.nft.apply(&rules::table(&machines.layout, &vms))?;
        *lock(&machines.bound) = bound;
        machines.here_for_events()?;
        machines.remove_legacy_tables()?;
        if !state.vms.is_empty() {
            tracing::info!(vms = state.vms.len(), "re-installed machine egress rules");
        }
        machines.view.store(Arc::new(state.clone()));
        *lock(&machines.state) = state;
        Ok(Arc::new(machines))
    }

    /// Checks the stored VMs against the match mode and claims their
    /// addresses, before any rule is installed.
    fn take_in(&self, matching: Match, state: &State) -> Result<(), MachineError> {
        for vm in state.vms.values() {
            fits(matching, vm, &self.store)?;
        }
        for vm in state.vms.values() {
            self.neighbours
                .claim_for_vm(&vm.id, &vm.addresses)
                .map_err(MachineError::Conflict)?;
        }
        Ok(())
    }

    /// With `observe = "events"`, whether nft works in this process's
    /// network namespace, where the NFLOG group is bound and the node
    /// table's rules and counters are read: a table of a name made for the
    /// occasion, holding one counter, added through nft, must show in the
    /// counter dump here (no other process touches it; the node table may
    /// be replaced meanwhile by another gateway starting). A
    /// `machine_egress.nft` that enters another namespace would leave every
    /// event unseen and the observer installing the table again each
    /// round, so the start stops, naming the key.
    fn here_for_events(&self) -> Result<(), MachineError> {
        use std::hash::{BuildHasher, Hasher};
        if self.layout.events.is_none() {
            return Ok(());
        }
        let mark = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        let probe = format!("egress_here_{mark:016x}");
        self.nft.apply(&format!(
            "table inet {probe} {{\n    counter here {{\n    }}\n}}\n"
        ))?;
        let seen = counters::read(&probe).map(|c| c.contains_key("here"));
        if let Err(e) = self.nft.apply(&format!("delete table inet {probe}\n")) {
            tracing::warn!(table = %probe, error = %e, "the table of the start's namespace check was left behind");
        }
        match seen {
            Ok(true) => Ok(()),
            seen => Err(MachineError::Invalid {
                field: "machine_egress.observe",
                message: format!(
                    "\"events\" reads the rules' events and counters in this gateway's network namespace, and machine_egress.nft does not write there ({}): set observe = \"sampled\" when nft governs another namespace",
                    seen.map_or_else(|e| e, |_| "a table added through nft does not show here".into())
                ),
            }),
        }
    }

    /// Removes the tables of the earlier one-table-per-VM layout.
    fn remove_legacy_tables(&self) -> Result<(), MachineError> {
        for table in self.nft.legacy_tables()? {
            tracing::warn!(%table, "removing a per-VM table of the earlier layout");
            self.nft
                .apply(&format!("table inet {table}\ndelete table inet {table}\n"))?;
        }
        Ok(())
    }

    /// No change after this returns, none in flight when it does: it waits
    /// for the change that holds the state (its nft and conntrack runs,
    /// its file, at most their time limits), and every later one is
    /// refused ([`MachineError::Sealed`]); the observer's rounds write
    /// nothing more. A gateway handing over calls it before it lets go of
    /// the state directory: its successor installs the table from the
    /// files, and a change finishing here after that would put its rules
    /// over the successor's and its file over what the successor
    /// acknowledged. Blocks: call it on a blocking thread.
    pub fn seal(&self) {
        let _state = lock(&self.state);
        self.sealed.store(true, Ordering::Release);
    }

    /// The state, for a change: once sealed, none.
    fn changing(&self) -> Result<MutexGuard<'_, State>, MachineError> {
        let state = lock(&self.state);
        match self.sealed.load(Ordering::Acquire) {
            true => Err(MachineError::Sealed),
            false => Ok(state),
        }
    }

    /// Applies `next` in place of the current state for the VMs in `touched`
    /// (their rules replaced, or removed when `next` no longer has them):
    /// one nft transaction, then durable; otherwise rolled back. While the
    /// kernel may not hold what `state` says ([`Machines::dirty`]), the
    /// transaction is the whole table of `next` instead.
    fn commit(
        &self,
        state: &mut State,
        next: State,
        touched: &[String],
    ) -> Result<(), MachineError> {
        let whole = self.dirty.load(Ordering::Acquire);
        let (forward, bound) = match whole {
            true => self.whole(&next),
            false => self.transition(state, &next, touched),
        };
        if !forward.is_empty() {
            let accounting = whole.then(|| lock(&self.accounting));
            self.apply(&forward).map_err(|e| match e.unsure {
                true => MachineError::KernelUnsure(e),
                false => MachineError::Kernel(e),
            })?;
            *lock(&self.bound) = bound;
            if whole {
                self.counters_restarted();
                self.dirty.store(false, Ordering::Release);
            }
            drop(accounting);
        }
        if let Err(e) = self.store.save(state, &next, touched) {
            return Err(self.put_back(state, &next, touched, e));
        }
        let moved = addresses_moved(state, &next, touched);
        self.view.store(Arc::new(next.clone()));
        *state = next;
        self.forget_flows(&moved);
        Ok(())
    }

    /// After the state could not be written (`failed`): the rules of
    /// `state` put back, by the opposite transaction or, if nft refused
    /// that, the whole table. If neither took, the table is marked dirty
    /// and the error says the rules may not be back.
    fn put_back(
        &self,
        state: &State,
        next: &State,
        touched: &[String],
        failed: MachineError,
    ) -> MachineError {
        let (back, bound) = self.transition(next, state, touched);
        let rollback = match self.apply(&back) {
            Ok(()) => {
                *lock(&self.bound) = bound;
                return failed;
            }
            Err(e) => e,
        };
        tracing::error!(error = %rollback, "could not put the previous machine egress rules back");
        self.dirty.store(true, Ordering::Release);
        // A refused transaction changed nothing, so the whole table is
        // worth one try now; one killed at its limit would likely hang again
        // with the state lock held: the observer tries instead.
        if !rollback.unsure && self.reinstall(state).is_ok() {
            return failed;
        }
        match failed {
            MachineError::Persist { path, message } => MachineError::PersistUnsure {
                path,
                message,
                rollback,
            },
            other => other,
        }
    }

    /// Applies a transaction; one that may have been committed although it
    /// failed marks the table dirty.
    fn apply(&self, text: &str) -> Result<(), NftError> {
        self.nft.apply(text).inspect_err(|e| {
            if e.unsure {
                self.dirty.store(true, Ordering::Release);
            }
        })
    }

    /// The whole table of `state`, replacing whatever the kernel holds,
    /// with the inodes it binds the VMs' cgroups at.
    fn whole(&self, state: &State) -> (String, cgroups::Bound) {
        let (vms, bound) = self.bind(state);
        (rules::table(&self.layout, &vms), bound)
    }

    /// Installs the whole table of `state` (under the state lock), which
    /// makes the table clean.
    fn reinstall(&self, state: &State) -> Result<(), NftError> {
        let (text, bound) = self.whole(state);
        let _accounting = lock(&self.accounting);
        self.apply(&text)?;
        self.counters_restarted();
        *lock(&self.bound) = bound;
        self.dirty.store(false, Ordering::Release);
        Ok(())
    }

    /// The whole table was installed: its refused, spoofed and lost
    /// counters start again at zero, and all they count next is new (a
    /// next read above the last one's would otherwise count only the
    /// difference).
    fn counters_restarted(&self) {
        for counts in [&self.refused, &self.spoofed, &self.unlogged] {
            for r in lock(counts).values_mut() {
                r.kernel = 0;
            }
        }
    }

    /// The nft text that takes the VMs of `touched` from what `from` says
    /// to what `to` says; nothing of any other VM is in it but the dispatch
    /// rebuilt whole, with the inodes it binds the VMs' cgroups at.
    fn transition(&self, from: &State, to: &State, touched: &[String]) -> (String, cgroups::Bound) {
        let changes: String = touched
            .iter()
            .map(|id| {
                let old = from.vms.get(id).map(|vm| vm.rules());
                let new = to.vms.get(id).map(|vm| vm.rules());
                rules::change(&self.layout, old.as_ref(), new.as_ref())
            })
            .collect();
        if changes.is_empty() {
            return (changes, cgroups::Bound::new());
        }
        let mut text = rules::unbind_cgroups(&self.layout) + &changes;
        let (vms, bound) = self.bind(to);
        text.push_str(&rules::forward_rules(&vms));
        text.push_str(&rules::output_dispatch(&self.layout, &vms));
        (text, bound)
    }

    /// The VMs of `state` as the rules load them now: a cgroup the tree
    /// does not have is left out of the dispatch ([`cgroups`]).
    fn bind<'a>(&self, state: &'a State) -> (Vec<VmRules<'a>>, cgroups::Bound) {
        let vms = state.vms.values().map(|vm| vm.rules()).collect();
        match self.layout.matching {
            Match::Cgroup => self.tree.bind(vms),
            Match::Address => (vms, cgroups::Bound::new()),
        }
    }

    /// Binds the cgroup dispatch again when a VM's cgroup is not the one
    /// its element was loaded with: made again under its path (a restarted
    /// QEMU's scope, whose packets matched nothing until now), gone, or
    /// back. One transaction rebuilds the maps; checked under the state
    /// lock, so no change is in flight.
    pub fn rebind(&self) {
        if self.layout.matching != Match::Cgroup {
            return;
        }
        let state = lock(&self.state);
        if self.sealed.load(Ordering::Acquire) {
            return;
        }
        let (vms, bound) = self.bind(&state);
        if *lock(&self.bound) == bound {
            return;
        }
        let text =
            rules::unbind_cgroups(&self.layout) + &rules::output_dispatch(&self.layout, &vms);
        match self.nft.apply(&text) {
            Ok(()) => {
                *lock(&self.bound) = bound;
                self.rebound.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    vms = vms.len(),
                    "a VM's cgroup was made again, went or came back; bound the cgroup dispatch again"
                );
            }
            Err(e) => {
                tracing::error!(error = %e, "binding the cgroup dispatch again failed");
            }
        }
    }

    /// Checks a registration against the match mode and the other VMs:
    /// the addresses in canonical form, a free link, a free cgroup.
    fn check_registration(
        &self,
        state: &State,
        id: &str,
        mut r: Registration,
    ) -> Result<Registration, MachineError> {
        let invalid = |field, message: &str| MachineError::Invalid {
            field,
            message: message.to_owned(),
        };
        not_too_many(&r.addresses)?;
        match self.layout.matching {
            Match::Address => {
                r.addresses = check_addresses(id, r.addresses)?;
                if r.cgroup.is_some() {
                    return Err(invalid(
                        "cgroup",
                        "only with machine_egress.match = \"cgroup\"",
                    ));
                }
            }
            Match::Cgroup => {
                if !r.addresses.is_empty() {
                    r.addresses = check_addresses(id, r.addresses)?;
                }
                if r.link.is_some() {
                    return Err(invalid(
                        "link",
                        "only with machine_egress.match = \"address\"",
                    ));
                }
                let Some(path) = &r.cgroup else {
                    return Err(invalid(
                        "cgroup",
                        "required with machine_egress.match = \"cgroup\"",
                    ));
                };
                check_cgroup(path)?;
                if self.tree.inode(path).is_none() {
                    let root = self.tree.root().display();
                    return Err(invalid(
                        "cgroup",
                        &format!("{path:?} is not in the cgroup tree at {root}: create it first"),
                    ));
                }
            }
        }
        if let Some(link) = &r.link {
            if !crate::config::is_iface_name(link) {
                return Err(invalid(
                    "link",
                    &format!("{link:?} is not an interface name"),
                ));
            }
        }
        taken(state, id, &r)?;
        Ok(r)
    }

    /// Registers (or re-registers) a VM by the addresses its QEMU process's
    /// traffic has (or its cgroup). Without `egress` a new VM follows the
    /// node default, and one registered before keeps its own policy (if it
    /// has one).
    pub fn put_vm(&self, id: &str, registration: Registration) -> Result<Vm, MachineError> {
        valid_id(id)?;
        let mut state = self.changing()?;
        let r = self.check_registration(&state, id, registration)?;
        self.ensure_log()?;
        let before = state.vms.get(id).map(|vm| vm.addresses.clone());
        // Its earlier addresses stay its own until the change is in: the
        // kernel's rules hold them until then, and no sandbox may take one
        // meanwhile. Once in (or failed), the claim is what holds.
        let mut during = before.clone().unwrap_or_default();
        for a in &r.addresses {
            if !during.contains(a) {
                during.push(*a);
            }
        }
        self.neighbours
            .claim_for_vm(id, &during)
            .map_err(MachineError::Conflict)?;
        let mut next = state.clone();
        // Re-registered without `egress` (new addresses, say), a VM keeps
        // the policy it has of its own; `DELETE …/network/egress` is the
        // way back to the node default, which may be `open`.
        let egress = r
            .egress
            .or_else(|| state.vms.get(id).and_then(|vm| vm.egress.clone()));
        let effective = egress.clone().unwrap_or_else(|| next.default.clone());
        let vm = Vm {
            id: id.to_owned(),
            addresses: r.addresses,
            link: r.link,
            cgroup: r.cgroup,
            egress,
            effective,
        };
        next.vms.insert(id.to_owned(), Arc::new(vm.clone()));
        // The records exist before the rules do: their first event has a
        // place to go.
        self.ensure_records(id);
        let held = vm.addresses.clone();
        if let Err(e) = self.commit(&mut state, next, &[id.to_owned()]) {
            match before {
                Some(addresses) => {
                    // Its earlier addresses were its own a moment ago.
                    if let Err(why) = self.neighbours.claim_for_vm(id, &addresses) {
                        tracing::warn!(vm = id, %why, "machine egress: restoring a VM's address claim");
                    }
                }
                None => {
                    self.neighbours.release_vm(id);
                    self.forget_records(id);
                }
            }
            return Err(e);
        }
        // A part of what it held during the change: it cannot conflict.
        if let Err(why) = self.neighbours.claim_for_vm(id, &held) {
            tracing::warn!(vm = id, %why, "machine egress: narrowing a VM's address claim");
        }
        Ok(vm)
    }

    /// The names the node's sandboxes resolved to `addr` (a hint shown
    /// with an observation, never a decision).
    pub fn names_for(&self, addr: IpAddr) -> Vec<String> {
        self.neighbours.names_for(addr)
    }

    /// Deletes the connection-tracking entries of addresses that left
    /// their VM or were given to one ([`conntrack`]); a failure is logged,
    /// naming them, and counted.
    fn forget_flows(&self, moved: &[IpAddr]) {
        if moved.is_empty() {
            return;
        }
        match self.conntrack.forget(moved) {
            Ok(n) => {
                tracing::debug!(addresses = ?moved, entries = n, "machine egress: forgot the open flows of addresses that moved")
            }
            Err(why) => {
                self.conntrack_failed.fetch_add(1, Ordering::Relaxed);
                tracing::error!(addresses = ?moved, %why, "machine egress: the open flows of addresses that left a VM or were given to one could not be deleted: a VM at one of them may use another's flows until they time out");
            }
        }
    }

    /// Removes a VM and its table.
    pub fn delete_vm(&self, id: &str) -> Result<(), MachineError> {
        let mut state = self.changing()?;
        if !state.vms.contains_key(id) {
            return Err(MachineError::Missing(id.to_owned()));
        }
        let mut next = state.clone();
        next.vms.remove(id);
        self.commit(&mut state, next, &[id.to_owned()])?;
        self.neighbours.release_vm(id);
        self.forget_records(id);
        Ok(())
    }

    /// The VM's observed record and counts, created empty where it has
    /// none, under the state lock as the VM is registered. Only here: the
    /// observer and the event reader update the records there are, so a
    /// round that read a VM just removed does not bring its records back.
    fn ensure_records(&self, id: &str) {
        lock(&self.observed)
            .entry(id.to_owned())
            .or_insert_with(|| observed::Store::new(self.layout.capacity));
        for counts in [&self.refused, &self.spoofed, &self.unlogged] {
            lock(counts).entry(id.to_owned()).or_default();
        }
    }

    /// Removes the VM's observed record and counts (it is gone).
    fn forget_records(&self, id: &str) {
        lock(&self.observed).remove(id);
        for counts in [&self.refused, &self.spoofed, &self.unlogged] {
            lock(counts).remove(id);
        }
    }

    pub fn vm(&self, id: &str) -> Result<Vm, MachineError> {
        self.view
            .load()
            .vms
            .get(id)
            .map(|vm| Vm::clone(vm))
            .ok_or_else(|| MachineError::Missing(id.to_owned()))
    }

    pub fn vms(&self) -> Vec<Arc<Vm>> {
        self.view.load().vms.values().cloned().collect()
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
        self.set_egress_from(id, policy, None)
    }

    /// [`Machines::set_egress`], only while the VM's installed policy is
    /// still `from` (a suggestion made from it): a policy set meanwhile is
    /// `409 … changed`, never overwritten by one built from the older.
    pub fn set_egress_from(
        &self,
        id: &str,
        policy: Option<MachineEgress>,
        from: Option<&MachineEgress>,
    ) -> Result<EgressView, MachineError> {
        let mut state = self.changing()?;
        if let Some(from) = from {
            let now = state.vms.get(id).map(|vm| &vm.effective);
            if now.is_some_and(|now| now != from) {
                return Err(MachineError::Taken {
                    field: "egress",
                    message: format!(
                        "VM {id}'s policy changed since the suggestion was made: ask again"
                    ),
                });
            }
        }
        let mut next = state.clone();
        let default = next.default.clone();
        let vm = next
            .vms
            .get_mut(id)
            .map(Arc::make_mut)
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
        self.view.load().default.clone()
    }

    /// Sets the node default. With `apply_running`, VMs that follow it take
    /// it at once (one transaction for all of them); without, only VMs
    /// registered afterwards. Returns the VMs that changed.
    pub fn set_default(
        &self,
        policy: MachineEgress,
        apply_running: bool,
    ) -> Result<Vec<String>, MachineError> {
        let mut state = self.changing()?;
        let mut next = state.clone();
        next.default = policy.clone();
        let mut touched = Vec::new();
        if apply_running {
            for vm in next.vms.values_mut() {
                if vm.egress.is_none() && vm.effective != policy {
                    let vm = Arc::make_mut(vm);
                    vm.effective = policy.clone();
                    touched.push(vm.id.clone());
                }
            }
        }
        self.commit(&mut state, next, &touched)?;
        Ok(touched)
    }

    /// The VM's record, most recently seen first, with the store's
    /// evictions and the events its log rate kept out. Sampled, the VM's
    /// observed sets are read from the kernel first.
    pub fn observed(&self, id: &str) -> Result<ObservedView, MachineError> {
        self.vm(id)?;
        if self.layout.events.is_none() {
            // What the kernel holds is merged into the record; a reading
            // that fails leaves the record as the last one left it, which
            // is served (the observer's next round reads it again).
            if let Err(e) = self.read_observed(id) {
                tracing::warn!(vm = id, error = %e, "machine egress: the observed set was not read; the record as it was is served");
            }
        }
        let lost = lock(&self.unlogged).get(id).map_or(0, |r| r.total);
        let stores = lock(&self.observed);
        Ok(stores
            .get(id)
            .map(|s| ObservedView {
                entries: s.entries(),
                evictions: s.evictions(),
                lost,
            })
            .unwrap_or_default())
    }

    /// Takes in one datagram of the log group: each event goes to its VM's
    /// record (one of a VM no longer registered is dropped); a gap in the
    /// sequence numbers and an unreadable message are counted as lost.
    pub(crate) fn take_events(&self, datagram: &[u8]) {
        let now = SystemTime::now();
        let mut stores = lock(&self.observed);
        for m in nflog::messages(datagram) {
            let e = match m {
                Ok(nflog::Message::Packet(e)) => e,
                Ok(nflog::Message::Ack(code)) if code != 0 => {
                    tracing::warn!(code, "the kernel reported an error on the NFLOG socket");
                    continue;
                }
                Ok(_) => continue,
                Err(why) => {
                    tracing::debug!(%why, "an unreadable NFLOG message");
                    self.lost.unreadable.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            };
            if let Some(seq) = e.seq {
                self.sequence(seq);
            }
            let before = stores.get(&e.vm).map(observed::Store::evictions);
            if let (Some(store), Some(before)) = (stores.get_mut(&e.vm), before) {
                store.record((e.addr, e.proto, e.port), e.time.unwrap_or(now));
                self.evictions
                    .fetch_add(store.evictions() - before, Ordering::Relaxed);
            }
        }
    }

    /// Checks an event's sequence number against the one expected: what
    /// lies between was dropped by the kernel (a full socket buffer).
    fn sequence(&self, seq: u32) {
        let mut next = lock(&self.lost.next_seq);
        if let Some(expected) = *next {
            let gap = seq.wrapping_sub(expected);
            // A gap past half the range is a reordering, not a loss.
            if gap != 0 && gap < 1 << 31 {
                self.lost
                    .overrun
                    .fetch_add(u64::from(gap), Ordering::Relaxed);
            }
        }
        *next = Some(seq.wrapping_add(1));
    }

    /// With events, binds the log group the first time a VM is about to
    /// get rules, before any rule logs to it: no event is ever sent to a
    /// group nobody reads, and a gateway without VMs holds no group (so
    /// several can run in one namespace, as the in-process tests do). A
    /// bind that fails refuses the change.
    fn ensure_log(&self) -> Result<(), MachineError> {
        let Some(events) = self.layout.events else {
            return Ok(());
        };
        let mut log = lock(&self.log);
        if self.log_bound.load(Ordering::Acquire) {
            return Ok(());
        }
        let group = events.group;
        let fd = events::bind(group).map_err(|message| MachineError::Log { group, message })?;
        *log = Some(fd);
        self.log_bound.store(true, Ordering::Release);
        self.log_ready.notify_one();
        Ok(())
    }

    /// Observing by events (the reader task is needed).
    pub fn observes_events(&self) -> bool {
        self.layout.events.is_some()
    }

    /// The NFLOG socket for the reader task, once it is bound.
    pub(crate) async fn bound_log(&self) -> rustix::fd::OwnedFd {
        loop {
            if let Some(fd) = lock(&self.log).take() {
                return fd;
            }
            // A permit is stored when nobody waits yet: no wake-up is lost.
            self.log_ready.notified().await;
        }
    }

    fn read_observed(&self, id: &str) -> Result<(), NftError> {
        // One read, merge and removal at a time: an older read merged after
        // a newer one would take counters lower than the last for sets made
        // again, and count them whole.
        let _one = lock(&self.observing);
        let kernel = self.nft.observed(id)?;
        let now = SystemTime::now();
        let forget = {
            let mut stores = lock(&self.observed);
            // A VM removed since it was read has no record to bring back.
            let Some(store) = stores.get_mut(id) else {
                return Ok(());
            };
            let before = store.evictions();
            let forget = store.merge(now, &kernel);
            self.evictions
                .fetch_add(store.evictions() - before, Ordering::Relaxed);
            forget
        };
        self.nft.forget(id, &forget)?;
        if let Some(store) = lock(&self.observed).get_mut(id) {
            store.forgotten(&forget);
        }
        Ok(())
    }

    /// One round of the observer: reads the node table's counters (one
    /// read for every VM), and, sampled, the observed sets of each VM whose
    /// `refused` counter moved.
    pub fn observe(&self) {
        if self.sealed.load(Ordering::Acquire) {
            return;
        }
        if self.dirty.load(Ordering::Acquire) {
            return self.restore_if_gone();
        }
        let vms = self.vms();
        if vms.is_empty() {
            return;
        }
        // The read and its accounting, with no whole table installed in
        // between (its counters start again at zero: `counters_restarted`).
        let accounting = lock(&self.accounting);
        let counters = match self.counters() {
            Ok(c)
                if complete(&c, vms.iter().map(|vm| vm.id.as_str()))
                    && self.rules_in_place()
                    && self.links_in_place(vms.iter().map(|vm| &**vm)) =>
            {
                c
            }
            Ok(_) => {
                drop(accounting);
                return self.restore_if_gone();
            }
            Err(e) => {
                drop(accounting);
                tracing::warn!(error = %e, "reading the machine egress counters failed");
                return self.restore_if_gone();
            }
        };
        let moved = self.account(&vms, &counters);
        // Their observed sets are read with the lock let go: two nft runs
        // each, which a change installing the whole table would wait on.
        drop(accounting);
        for id in moved {
            if let Err(e) = self.read_observed(&id) {
                tracing::warn!(vm = %id, error = %e, "reading observed destinations failed");
            }
        }
    }

    /// Takes in one read of the counters for the VMs `vms` (read before
    /// it). Only the records of VMs still registered are updated: one
    /// removed since has none ([`Machines::ensure_records`]). Returns the
    /// VMs whose observed sets are to be read (sampled: their `refused`
    /// counter moved).
    fn account(&self, vms: &[Arc<Vm>], counters: &BTreeMap<String, u64>) -> Vec<String> {
        let mut moved_vms = Vec::new();
        for vm in vms {
            let k = rules::key(&vm.id);
            if let Some(&n) = counters.get(&format!("spoofed_{k}")) {
                if let Some(r) = lock(&self.spoofed).get_mut(&vm.id) {
                    r.account(n);
                }
            }
            if let Some(&n) = counters.get(&format!("lost_{k}")) {
                if let Some(r) = lock(&self.unlogged).get_mut(&vm.id) {
                    let new = r.add(n);
                    r.kernel = n;
                    self.lost.rate.fetch_add(new, Ordering::Relaxed);
                }
            }
            let Some(&now) = counters.get(&format!("refused_{k}")) else {
                continue;
            };
            let moved = lock(&self.refused)
                .get_mut(&vm.id)
                .is_some_and(|r| r.account(now));
            if moved && self.layout.events.is_none() {
                moved_vms.push(vm.id.clone());
            }
        }
        moved_vms
    }

    /// Installs the whole table again, every VM in it, if it is gone or a
    /// VM's objects are (another tool flushed the ruleset, say), or it is
    /// dirty (a change that failed half-way): until then the VMs' packets
    /// pass unjudged, or judged by rules the state does not have, so the
    /// observer's round bounds how long that lasts. Checked again under the
    /// state lock first, so a change in flight is not taken for a loss.
    fn restore_if_gone(&self) {
        let state = lock(&self.state);
        if self.sealed.load(Ordering::Acquire) {
            return;
        }
        let dirty = self.dirty.load(Ordering::Acquire);
        let ids = state.vms.keys().map(String::as_str);
        if !dirty
            && self.counters().is_ok_and(|c| complete(&c, ids))
            && self.rules_in_place()
            && self.links_in_place(state.vms.values().map(|vm| &**vm))
        {
            return;
        }
        match self.reinstall(&state) {
            Ok(()) => {
                self.restored.fetch_add(1, Ordering::Relaxed);
                let why = match dirty {
                    true => "a change that failed half-way may have left other rules",
                    false => "the table was gone or incomplete",
                };
                tracing::error!(
                    vms = state.vms.len(),
                    "machine egress: {why}; installed the whole table again"
                );
            }
            Err(e) => {
                tracing::error!(error = %e, "the machine egress table could not be installed again");
            }
        }
    }

    /// Whether the node table's chains that judge the VMs' packets have
    /// their rules ([`enforcing_chains`]). A table flushed by another tool
    /// (`nft flush table`) keeps its chains, sets and counters, so the
    /// counters do not show it, while every VM's packets pass unjudged.
    /// Read over netlink with events (the rules in this namespace);
    /// sampled, `nft` would load every VM's sets to list one chain, so this
    /// says yes.
    fn rules_in_place(&self) -> bool {
        if self.layout.events.is_none() {
            return true;
        }
        let bound = !lock(&self.bound).is_empty();
        enforcing_chains(&self.layout, bound)
            .iter()
            .all(|chain| in_place(chain, counters::rules(rules::TABLE, chain)))
    }

    /// Whether every VM link's chain in the links' table (`netdev
    /// egress_machine`, with the ingress check) has its rules: `nft flush
    /// table netdev egress_machine` keeps the chains and counters but
    /// empties them, and every link's sources then pass unchecked. Read
    /// over netlink with events, one dump for every link; sampled, says yes
    /// (as [`Machines::rules_in_place`]).
    fn links_in_place<'a>(&self, vms: impl Iterator<Item = &'a Vm>) -> bool {
        if self.layout.events.is_none() || self.layout.link_check != LinkCheck::Ingress {
            return true;
        }
        let mut linked = vms.filter(|vm| vm.link.is_some()).peekable();
        if linked.peek().is_none() {
            return true;
        }
        match counters::link_rules(rules::TABLE) {
            Ok(chains) => linked.all(|vm| {
                let chain = format!("link_{}", rules::key(&vm.id));
                chains.get(&chain).is_some_and(|&n| n > 0)
            }),
            Err(e) => in_place("the links' table", Err(e)),
        }
    }

    /// The node table's counters: with events (the rules in this
    /// namespace), dumped over netlink ([`counters`]); sampled, through the
    /// configured `nft` command, which may govern another namespace.
    fn counters(&self) -> Result<BTreeMap<String, u64>, String> {
        if self.layout.events.is_some() {
            counters::read(rules::TABLE)
        } else {
            self.nft
                .counters(self.layout.families())
                .map_err(|e| e.to_string())
        }
    }

    /// Runs [`Machines::observe`] every `every`, and [`Machines::rebind`]
    /// every [`REBIND_EVERY`], until the task is dropped. Each on its own:
    /// a round of observing that takes long (its counters, the observed
    /// sets of every VM whose refusals moved) does not hold back the
    /// rebinding of a restarted QEMU's cgroup, whose packets match no VM
    /// until then.
    pub async fn observer(self: Arc<Self>, every: std::time::Duration) {
        let me = self.clone();
        let rebinding = every_while(REBIND_EVERY, move || me.rebind());
        let observing = every_while(every, move || self.observe());
        tokio::join!(rebinding, observing);
    }
}

/// Runs `f` on a blocking thread every `period` (a run that takes longer
/// delays the next), until the task is dropped.
async fn every_while(period: std::time::Duration, f: impl Fn() + Send + Sync + 'static) {
    let f = Arc::new(f);
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let f = f.clone();
        let _ = tokio::task::spawn_blocking(move || f()).await;
    }
}

/// How often the observer looks for a VM's cgroup made again (a stat of
/// each VM's cgroup): a restarted QEMU's packets match no VM until then.
pub const REBIND_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// Whether `counters` holds the `refused` and `spoofed` counters of every
/// VM in `ids`: each VM's objects are in the tables (the node table, and
/// `netdev egress_machine` with the ingress check).
fn complete<'a>(counters: &BTreeMap<String, u64>, mut ids: impl Iterator<Item = &'a str>) -> bool {
    ids.all(|id| {
        let k = rules::key(id);
        counters.contains_key(&format!("refused_{k}"))
            && counters.contains_key(&format!("spoofed_{k}"))
    })
}

/// The node table's base chains that judge the VMs' packets, each of
/// which has rules while it does: with the address match the forward
/// chain, and the prerouting chain that sends a link's packets to their
/// anti-spoofing check; with the cgroup match the output chain, whose
/// rules are one lookup for each level a bound cgroup is at (none while
/// no VM's cgroup is in the tree, `cgroups_bound` false).
fn enforcing_chains(layout: &Layout, cgroups_bound: bool) -> Vec<&'static str> {
    match layout.matching {
        Match::Address if layout.link_check == LinkCheck::Prerouting => {
            vec!["forward", "prerouting"]
        }
        Match::Address => vec!["forward"],
        Match::Cgroup if cgroups_bound => vec!["output"],
        Match::Cgroup => Vec::new(),
    }
}

/// Whether a chain whose rule dump gave `read` is in place: it has rules
/// (a deleted chain's dump is empty). A dump that fails says nothing is in
/// place either: the whole table is installed again, which replaces
/// whatever is there, rather than leave the VMs unjudged unseen.
fn in_place(chain: &str, read: Result<usize, String>) -> bool {
    match read {
        Ok(n) => n > 0,
        Err(e) => {
            tracing::warn!(chain, error = %e, "reading a machine egress chain failed");
            false
        }
    }
}

/// The state on disk, `None` when there is none. With none, a node table
/// holding VMs' chains is refused rather than replaced: the state directory
/// was lost or moved while the VMs run, and an empty table would let their
/// traffic through unjudged.
fn load(store: &store::Store, nft: &Nft, state_dir: &Path) -> Result<Option<State>, MachineError> {
    let loaded = store.load(state_dir)?;
    let chains = match loaded {
        Some(_) => return Ok(loaded),
        None => nft.vm_chains()?,
    };
    if chains.is_empty() {
        return Ok(None);
    }
    let mut listed = chains
        .iter()
        .take(8)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if chains.len() > 8 {
        listed.push_str(&format!(" and {} more", chains.len() - 8));
    }
    Err(MachineError::Orphaned {
        dir: state_dir.to_owned(),
        chains: listed,
    })
}

/// `machine_egress.link_check` resolved: `auto` is the ingress hook when
/// the kernel binds an ingress chain by name ([`Nft::binds_ingress_by_name`]),
/// the prerouting hook otherwise; `ingress` on a kernel that does not is
/// an error, since a link made again would lose its check.
fn link_check(nft: &Nft, config: &MachineEgressConfig) -> Result<LinkCheck, MachineError> {
    let wanted = config.link_check;
    if wanted == MachineLinkCheck::Prerouting {
        return Ok(LinkCheck::Prerouting);
    }
    let probe = nft.binds_ingress_by_name();
    let check = match (&probe, wanted) {
        (Ok(()), _) => LinkCheck::Ingress,
        (Err(e), MachineLinkCheck::Ingress) => {
            return Err(MachineError::Invalid {
                field: "machine_egress.link_check",
                message: format!(
                    "\"ingress\" needs a kernel that binds an ingress chain to a link by its name (Linux 6.16 or later); here: {e}"
                ),
            })
        }
        (Err(_), _) => LinkCheck::Prerouting,
    };
    tracing::info!(
        check = ?check,
        probe = probe.err().map(|e| e.to_string()),
        "machine egress: where VM links' sources are checked"
    );
    Ok(check)
}

/// The node-wide settings of the rules, from the configuration.
fn layout(config: &MachineEgressConfig, link_check: LinkCheck) -> Layout {
    let events = (config.observe == MachineObserve::Events).then_some(rules::Events {
        group: config.log_group,
        rate: config.log_rate,
    });
    Layout {
        matching: config.matching,
        capacity: config.observed_capacity,
        cgroup_prefix: config.cgroup_prefix.clone(),
        events,
        link_check,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No sandbox on the node.
    #[derive(Debug)]
    struct NoNeighbours;

    impl Neighbours for NoNeighbours {
        fn claim_for_vm(&self, _: &str, _: &[IpAddr]) -> Result<(), String> {
            Ok(())
        }
        fn release_vm(&self, _: &str) {}
        fn names_for(&self, _: IpAddr) -> Vec<String> {
            Vec::new()
        }
    }

    /// Machine egress over a stand-in for nft that takes every transaction
    /// and lists no table (this test reads the state, not the kernel; the
    /// namespace suite runs the real nft).
    fn machines(dir: &Path) -> Arc<Machines> {
        let script = r#"case "$*" in *-f*) cat > /dev/null ;; *) echo '{"nftables": []}' ;; esac"#;
        machines_over(dir, script)
    }

    /// A stand-in for conntrack that appends what it is asked to delete to
    /// `dir/conntrack.log` and deletes nothing (as conntrack says it).
    fn conntrack_in(dir: &Path) -> Option<Vec<String>> {
        let log = dir.join("conntrack.log");
        let script = format!(
            r#"[ "$1" = --version ] && exit 0; echo "$*" >> '{}'; echo 'conntrack v1.4.7 (conntrack-tools): 0 flow entries have been deleted.' >&2; exit 1"#,
            log.display()
        );
        Some(vec!["sh".into(), "-c".into(), script, "conntrack".into()])
    }

    /// Machine egress over the nft stand-in `script` (run by `sh -c`).
    fn machines_over(dir: &Path, script: &str) -> Arc<Machines> {
        let config = config_over(dir, script);
        Machines::start(&config, dir, Arc::new(NoNeighbours)).expect("start")
    }

    /// The configuration of [`machines_over`]: sampled, checked at
    /// prerouting, conntrack's stand-in logging in `dir`.
    fn config_over(dir: &Path, script: &str) -> MachineEgressConfig {
        MachineEgressConfig {
            nft: vec!["sh".into(), "-c".into(), script.into(), "nft".into()],
            conntrack: conntrack_in(dir),
            observe: crate::config::MachineObserve::Sampled,
            link_check: crate::config::MachineLinkCheck::Prerouting,
            ..MachineEgressConfig::default()
        }
    }

    /// With no state on disk, a node table holding a VM's chains refuses
    /// the start (which would replace it with an empty table and let the
    /// VM's traffic through unjudged), naming the state directory; with the
    /// state, or without such chains, the start goes on.
    #[test]
    fn a_table_with_vms_and_no_state_refuses_the_start() {
        let dir = tempfile::tempdir().expect("dir");
        let chains = r#"{"nftables": [{"chain": {"family": "inet", "table": "egress_machine", "name": "forward"}}, {"chain": {"family": "inet", "table": "egress_machine", "name": "vm_vm1"}}, {"chain": {"family": "inet", "table": "other", "name": "vm_x"}}]}"#;
        let script = format!(
            r#"case "$*" in *-f*) cat > /dev/null ;; *"list chains"*) echo '{chains}' ;; *) echo '{{"nftables": []}}' ;; esac"#
        );
        let config = config_over(dir.path(), &script);
        let refused = Machines::start(&config, dir.path(), Arc::new(NoNeighbours)).err();
        let Some(MachineError::Orphaned { dir: named, chains }) = &refused else {
            panic!("started: {refused:?}");
        };
        assert_eq!((named.as_path(), chains.as_str()), (dir.path(), "vm_vm1"));
        assert!(refused.is_some_and(|e| e
            .to_string()
            .contains("nft delete table inet egress_machine")));
        // Without VMs' chains the start goes on, and with a state on disk
        // the table is replaced from it whatever it holds.
        let m = machines(dir.path());
        let registration = Registration {
            addresses: vec!["100.64.4.2".parse().expect("ip")],
            ..Registration::default()
        };
        m.put_vm("vm1", registration).expect("registered");
        drop(m);
        Machines::start(&config, dir.path(), Arc::new(NoNeighbours)).expect("state on disk");
    }

    /// Records every claim a VM makes.
    #[derive(Debug, Default)]
    struct Recorded(Mutex<Vec<Vec<IpAddr>>>);

    impl Neighbours for Recorded {
        fn claim_for_vm(&self, _: &str, addrs: &[IpAddr]) -> Result<(), String> {
            lock(&self.0).push(addrs.to_vec());
            Ok(())
        }
        fn release_vm(&self, _: &str) {}
        fn names_for(&self, _: IpAddr) -> Vec<String> {
            Vec::new()
        }
    }

    /// A re-registration holds the VM's earlier addresses with its new ones
    /// while its change goes in (no sandbox may take one the kernel's rules
    /// still give the VM), then the new ones alone; or, failed, the earlier
    /// ones. Before, the earlier ones were let go before the change.
    #[test]
    fn a_reregistration_holds_both_addresses_while_it_goes_in() {
        let dir = tempfile::tempdir().expect("dir");
        let recorded = Arc::new(Recorded::default());
        let fail = dir.path().join("fail");
        let script = format!(
            r#"case "$*" in *-f*) cat > /dev/null; [ -e '{}' ] && exit 1; exit 0 ;; *) echo '{{"nftables": []}}' ;; esac"#,
            fail.display()
        );
        let config = config_over(dir.path(), &script);
        let m = Machines::start(&config, dir.path(), recorded.clone()).expect("start");
        let ip = |s: &str| s.parse::<IpAddr>().expect("ip");
        let at = |a: &str| Registration {
            addresses: vec![ip(a)],
            ..Registration::default()
        };
        m.put_vm("vm1", at("100.64.4.2")).expect("registered");
        m.put_vm("vm1", at("100.64.4.3")).expect("moved");
        std::fs::write(&fail, "").expect("fail");
        assert!(m.put_vm("vm1", at("100.64.4.4")).is_err(), "nft failed");
        let claims = lock(&recorded.0).clone();
        let (a, b, c) = (ip("100.64.4.2"), ip("100.64.4.3"), ip("100.64.4.4"));
        let tail = &claims[claims.len() - 4..];
        assert_eq!(tail, [vec![a, b], vec![b], vec![b, c], vec![b]]);
    }

    /// A reading of the observed sets that fails serves the record as it
    /// was, and says so in the log: before, `GET …/observed` answered `500`
    /// "installing the rules failed".
    #[test]
    fn an_observed_set_that_cannot_be_read_serves_the_record() {
        let dir = tempfile::tempdir().expect("dir");
        let script = r#"case "$*" in *-f*) cat > /dev/null ;; *"list set"*) echo 'Error: busy' >&2; exit 1 ;; *) echo '{"nftables": []}' ;; esac"#;
        let m = machines_over(dir.path(), script);
        let registration = Registration {
            addresses: vec!["100.64.4.2".parse().expect("ip")],
            ..Registration::default()
        };
        m.put_vm("vm1", registration).expect("registered");
        let seen = m.observed("vm1").expect("the record, though unread");
        assert!(seen.entries.is_empty());
        assert!(matches!(m.observed("vm2"), Err(MachineError::Missing(_))));
    }

    /// Machine egress over the nft stand-in of [`machines`], matching by
    /// `matching`, with a cgroup tree at `cgroups` that holds
    /// `machine.slice/vm-17.scope`.
    fn start_matching(
        dir: &Path,
        cgroups: &Path,
        matching: Match,
    ) -> Result<Arc<Machines>, MachineError> {
        std::fs::create_dir_all(cgroups.join("machine.slice/vm-17.scope")).expect("mkdir");
        let script = r#"case "$*" in *-f*) cat > /dev/null ;; *) echo '{"nftables": []}' ;; esac"#;
        let config = MachineEgressConfig {
            nft: vec!["sh".into(), "-c".into(), script.into(), "nft".into()],
            conntrack: conntrack_in(dir),
            observe: crate::config::MachineObserve::Sampled,
            link_check: crate::config::MachineLinkCheck::Prerouting,
            matching,
            cgroup_root: cgroups.to_owned(),
            ..MachineEgressConfig::default()
        };
        Machines::start(&config, dir, Arc::new(NoNeighbours))
    }

    /// A registration of more than 256 addresses is refused naming the
    /// field; a VM stored with more (before the bound) still loads.
    #[test]
    fn a_vm_holds_at_most_256_addresses_when_registered() {
        let dir = tempfile::tempdir().expect("dir");
        let many = |n: u32| -> Vec<IpAddr> {
            (0..n)
                .map(|i| IpAddr::from(std::net::Ipv4Addr::from(0x6440_0000 + i)))
                .collect()
        };
        {
            let m = machines(dir.path());
            let put = |n| {
                let r = Registration {
                    addresses: many(n),
                    ..Registration::default()
                };
                m.put_vm("vm1", r)
            };
            let refused = put(257);
            assert!(
                matches!(&refused, Err(MachineError::Invalid { field: "addresses", message }) if message.starts_with("257 addresses")),
                "{refused:?}"
            );
            put(256).expect("256 addresses");
        }
        let file = dir.path().join("machines/vm-vm1.json");
        let mut stored: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&file).expect("read")).expect("json");
        stored["addresses"] = serde_json::json!(many(300));
        std::fs::write(&file, stored.to_string()).expect("write");
        let m = machines(dir.path());
        assert_eq!(m.vm("vm1").expect("loaded").addresses.len(), 300);
    }

    /// A cgroup is one VM's however its path is written (`a/b/` is `a/b`
    /// to nft): `409` naming the field, not a transaction nft refuses.
    #[test]
    fn a_cgroup_another_vm_has_is_taken_with_or_without_a_trailing_slash() {
        let dir = tempfile::tempdir().expect("dir");
        let cgroups = tempfile::tempdir().expect("cgroup root");
        let m = start_matching(dir.path(), cgroups.path(), Match::Cgroup).expect("start");
        let by = |path: &str| Registration {
            cgroup: Some(path.into()),
            ..Registration::default()
        };
        m.put_vm("vm1", by("machine.slice/vm-17.scope"))
            .expect("registered");
        for path in ["machine.slice/vm-17.scope", "machine.slice/vm-17.scope/"] {
            let taken = m.put_vm("vm2", by(path));
            assert!(
                matches!(
                    taken,
                    Err(MachineError::Taken {
                        field: "cgroup",
                        ..
                    })
                ),
                "{path}: {taken:?}"
            );
        }
    }

    /// A VM registered under one match mode stops a start under the other,
    /// naming it, its file and `machine_egress.match`: none of the other
    /// mode's rules would judge its traffic. Back under its own mode, the
    /// start goes on.
    #[test]
    fn a_vm_of_the_other_match_mode_refuses_the_start() {
        let dir = tempfile::tempdir().expect("dir");
        let cgroups = tempfile::tempdir().expect("cgroup root");
        let start = |matching| start_matching(dir.path(), cgroups.path(), matching);
        let by_cgroup = Registration {
            cgroup: Some("machine.slice/vm-17.scope".into()),
            ..Registration::default()
        };
        let by_address = Registration {
            addresses: vec!["100.64.4.2".parse().expect("ip")],
            ..Registration::default()
        };
        for (registered, other, r, why) in [
            (
                Match::Cgroup,
                Match::Address,
                by_cgroup,
                "is matched by its cgroup",
            ),
            (
                Match::Address,
                Match::Cgroup,
                by_address,
                "is matched by its addresses",
            ),
        ] {
            let m = start(registered).expect("start");
            m.put_vm("vm1", r).expect("registered");
            drop(m);
            let refused = start(other).err();
            let Some(MachineError::Mismatched {
                vm,
                file,
                why: said,
                ..
            }) = &refused
            else {
                panic!("started under {other:?}: {refused:?}");
            };
            assert_eq!((vm.as_str(), *said), ("vm1", why));
            assert!(file.ends_with("machines/vm-vm1.json"), "{}", file.display());
            let text = refused.expect("refused").to_string();
            assert!(text.contains("machine_egress.match"), "{text}");
            let m = start(registered).expect("under its own mode");
            m.delete_vm("vm1").expect("removed");
        }
    }

    /// The addresses a VM no longer holds (registered again without them,
    /// or removed), and those given to it, have their open flows forgotten
    /// at either end; the addresses it keeps, and a change of its policy,
    /// forget nothing.
    #[test]
    fn addresses_that_leave_or_join_a_vm_have_their_flows_forgotten() {
        let dir = tempfile::tempdir().expect("dir");
        let m = machines(dir.path());
        let mut seen = 0;
        let mut asked = || {
            let all = std::fs::read_to_string(dir.path().join("conntrack.log")).unwrap_or_default();
            let new: Vec<String> = all.lines().skip(seen).map(str::to_owned).collect();
            seen += new.len();
            new.join(", ")
        };
        assert_eq!(asked(), "", "the start asked for its version only");
        let at = |ips: &[&str]| Registration {
            addresses: ips.iter().map(|ip| ip.parse().expect("ip")).collect(),
            ..Registration::default()
        };
        m.put_vm("vm1", at(&["100.64.4.2", "2001:db8::2"]))
            .expect("registered");
        let given = "-D -s 100.64.4.2, -D -d 100.64.4.2, -D -s 2001:db8::2, -D -d 2001:db8::2";
        assert_eq!(asked(), given, "what the addresses opened while no VM's");
        m.put_vm("vm2", at(&["100.64.4.6"])).expect("registered");
        assert_eq!(asked(), "-D -s 100.64.4.6, -D -d 100.64.4.6");
        m.put_vm("vm1", at(&["100.64.4.2", "100.64.4.3"]))
            .expect("again");
        let moved = "-D -s 2001:db8::2, -D -d 2001:db8::2, -D -s 100.64.4.3, -D -d 100.64.4.3";
        assert_eq!(asked(), moved, "the one it left, the one it took");
        let loopback = MachineEgress::from_json(r#"{"mode": "loopback"}"#).expect("policy");
        m.set_egress("vm1", Some(loopback)).expect("set");
        assert_eq!(asked(), "", "a policy moves no address");
        m.delete_vm("vm1").expect("removed");
        let removed = "-D -s 100.64.4.2, -D -d 100.64.4.2, -D -s 100.64.4.3, -D -d 100.64.4.3";
        assert_eq!(asked(), removed, "the removed VM's addresses, vm2's kept");
        assert_eq!(m.conntrack_failed.load(Ordering::Relaxed), 0);
    }

    /// The conntrack command is nft's with its last word read `conntrack`
    /// (so it runs in the rules' namespace), or named; one that cannot be
    /// told is refused, naming the key.
    #[test]
    fn the_conntrack_command_runs_where_nft_does() {
        let with = |nft: &[&str], conntrack: Option<Vec<String>>| MachineEgressConfig {
            nft: nft.iter().map(|w| (*w).to_owned()).collect(),
            conntrack,
            ..MachineEgressConfig::default()
        };
        let argv = |c: MachineEgressConfig| c.conntrack_argv().map(|a| a.join(" "));
        assert_eq!(argv(MachineEgressConfig::default()), Ok("conntrack".into()));
        let netns = with(&["ip", "netns", "exec", "vms", "nft"], None);
        assert_eq!(argv(netns), Ok("ip netns exec vms conntrack".into()));
        assert_eq!(
            argv(with(&["/usr/sbin/nft"], None)),
            Ok("/usr/sbin/conntrack".into())
        );
        let wrapped = with(&["/usr/local/bin/nft-in-vms"], None);
        assert_eq!(
            wrapped.first_invalid().map(|(k, _)| k),
            Some("machine_egress.conntrack")
        );
        let named = with(
            &["/usr/local/bin/nft-in-vms"],
            Some(vec!["ct-in-vms".into()]),
        );
        assert_eq!(argv(named), Ok("ct-in-vms".into()));
        let empty = with(&["nft"], Some(Vec::new()));
        assert!(empty.first_invalid().is_some_and(
            |(k, why)| k == "machine_egress.conntrack" && why == "name the conntrack command"
        ));
    }

    /// A suggestion applied after the VM's policy changed is refused, not
    /// written over the newer policy with one built from the older.
    #[test]
    fn a_suggestion_from_an_older_policy_does_not_overwrite_a_newer_one() {
        let dir = tempfile::tempdir().expect("dir");
        let m = machines(dir.path());
        let audit = MachineEgress::from_json(r#"{"mode": "audit"}"#).expect("policy");
        let registration = Registration {
            addresses: vec!["100.64.4.2".parse().expect("ip")],
            egress: Some(audit),
            ..Registration::default()
        };
        m.put_vm("vm1", registration).expect("registered");
        let seen = m.vm("vm1").expect("vm").effective;
        let loopback = MachineEgress::from_json(r#"{"mode": "loopback"}"#).expect("policy");
        m.set_egress("vm1", Some(loopback.clone())).expect("set");
        let suggested =
            MachineEgress::from_json(r#"{"mode": "allowlist", "rules": []}"#).expect("policy");
        let late = m.set_egress_from("vm1", Some(suggested.clone()), Some(&seen));
        assert!(
            matches!(
                late,
                Err(MachineError::Taken {
                    field: "egress",
                    ..
                })
            ),
            "{late:?}"
        );
        assert_eq!(m.vm("vm1").expect("vm").effective, loopback);
        // From the policy it has now, it applies.
        let now = m.vm("vm1").expect("vm").effective;
        m.set_egress_from("vm1", Some(suggested.clone()), Some(&now))
            .expect("applied");
        assert_eq!(m.vm("vm1").expect("vm").effective, suggested);
    }

    /// A VM removed between the observer's read of the VMs and its update
    /// of their counts leaves no record behind (they would stay for good,
    /// and a VM registered again under the id would start from the old
    /// counts); a VM still registered is counted.
    #[test]
    fn a_vm_removed_during_an_observer_round_leaves_no_records() {
        let dir = tempfile::tempdir().expect("dir");
        let m = machines(dir.path());
        for (id, ip) in [("gone", "100.64.4.2"), ("kept", "100.64.4.6")] {
            let registration = Registration {
                addresses: vec![ip.parse().expect("ip")],
                ..Registration::default()
            };
            m.put_vm(id, registration).expect("registered");
        }
        let read = m.vms();
        m.delete_vm("gone").expect("removed");
        let counters: BTreeMap<String, u64> = ["refused", "spoofed", "lost"]
            .into_iter()
            .flat_map(|c| [format!("{c}_gone"), format!("{c}_kept")])
            .map(|name| (name, 7))
            .collect();
        m.account(&read, &counters);
        m.read_observed("gone").expect("read");
        for (what, counts) in [
            ("refused", &m.refused),
            ("spoofed", &m.spoofed),
            ("unlogged", &m.unlogged),
        ] {
            let counts = lock(counts);
            assert!(!counts.contains_key("gone"), "{what}: {counts:?}");
            assert_eq!(counts.get("kept").map(|r| r.total), Some(7), "{what}");
        }
        assert!(!lock(&m.observed).contains_key("gone"));
        assert!(lock(&m.observed).contains_key("kept"));
    }

    /// [`machines`] with VM `vm1` registered at 100.64.4.2.
    fn with_vm1(dir: &Path) -> Arc<Machines> {
        let m = machines(dir);
        let registration = Registration {
            addresses: vec!["100.64.4.2".parse().expect("ip")],
            ..Registration::default()
        };
        m.put_vm("vm1", registration).expect("registered");
        m
    }

    /// Reads (the API's, `/metrics`') do not wait for a change in flight,
    /// which holds the state across nft and conntrack runs: they see the
    /// state as last committed.
    #[test]
    fn reads_do_not_wait_for_a_change_in_flight() {
        let dir = tempfile::tempdir().expect("dir");
        let m = with_vm1(dir.path());
        let held = lock(&m.state);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::scope(|s| {
            s.spawn(|| {
                let read = (
                    m.vms().len(),
                    m.vm("vm1").is_ok(),
                    m.default_policy(),
                    m.figures(),
                );
                let _ = tx.send((read.0, read.1, read.2));
            });
            let read = rx.recv_timeout(std::time::Duration::from_secs(5));
            drop(held);
            let (vms, found, default) = read.expect("read while a change holds the state");
            assert_eq!((vms, found, default), (1, true, MachineEgress::loopback()));
        });
    }

    /// Sealing waits for the change that holds the state (a handover's
    /// successor would otherwise find its rules and its file replaced by a
    /// change of this process finishing late), then refuses every change;
    /// the observer's rounds install nothing after it either, not even
    /// over a table they find dirty.
    #[test]
    fn sealed_it_waits_for_the_change_in_flight_and_makes_none_after() {
        let dir = tempfile::tempdir().expect("dir");
        let log = dir.path().join("nft.log");
        let script = format!(
            r#"case "$*" in *-f*) cat >> '{}' ;; *) echo '{{"nftables": []}}' ;; esac"#,
            log.display()
        );
        let m = machines_over(dir.path(), &script);
        let registration = |a: &str| Registration {
            addresses: vec![a.parse().expect("ip")],
            ..Registration::default()
        };
        m.put_vm("vm1", registration("100.64.4.2"))
            .expect("registered");
        let held = lock(&m.state);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::scope(|s| {
            s.spawn(|| {
                m.seal();
                let _ = tx.send(());
            });
            let early = rx.recv_timeout(std::time::Duration::from_millis(200));
            assert!(early.is_err(), "sealed with a change in flight");
            drop(held);
            let sealed = rx.recv_timeout(std::time::Duration::from_secs(5));
            sealed.expect("sealed once it is done");
        });
        let files = || {
            let dir = dir.path().join(store::DIR);
            let mut names: Vec<_> = std::fs::read_dir(&dir)
                .expect("machines")
                .map(|e| e.expect("entry").file_name())
                .collect();
            names.sort();
            let read = |n: &std::ffi::OsString| std::fs::read(dir.join(n)).expect("file");
            names
                .iter()
                .map(|n| (n.clone(), read(n)))
                .collect::<Vec<_>>()
        };
        let (rules, state) = (std::fs::read(&log).expect("log"), files());
        let refused = [
            m.put_vm("vm2", registration("100.64.4.3")).err(),
            m.delete_vm("vm1").err(),
            m.set_egress("vm1", Some(MachineEgress::loopback())).err(),
            m.set_default(MachineEgress::loopback(), true).err(),
        ];
        for (i, e) in refused.iter().enumerate() {
            assert!(matches!(e, Some(MachineError::Sealed)), "change {i}: {e:?}");
        }
        m.dirty.store(true, Ordering::Release);
        m.observe();
        m.rebind();
        assert!(std::fs::read(&log).expect("log") == rules, "nft ran");
        assert!(files() == state, "a file changed");
        assert_eq!(m.vms().len(), 1);
    }

    /// The counts carry on across a whole table installed again: what its
    /// counters count from zero is all new, though the next read is above
    /// the last one before it.
    #[test]
    fn counts_carry_on_across_the_table_installed_again() {
        let dir = tempfile::tempdir().expect("dir");
        let m = with_vm1(dir.path());
        let read = |n| -> BTreeMap<String, u64> {
            ["refused", "spoofed", "lost"]
                .into_iter()
                .map(|c| (format!("{c}_vm1"), n))
                .collect()
        };
        m.account(&m.vms(), &read(100));
        m.reinstall(&lock(&m.state)).expect("installed again");
        m.account(&m.vms(), &read(150));
        for (what, counts) in [
            ("refused", &m.refused),
            ("spoofed", &m.spoofed),
            ("unlogged", &m.unlogged),
        ] {
            let total = lock(counts).get("vm1").map(|r| r.total);
            assert_eq!(total, Some(250), "{what}");
        }
    }

    /// The observer looks at the chains that enforce for the match in use
    /// (the output chain with cgroups, not the forward chain that holds no
    /// VM there), and a chain it cannot read is not in place, so the table
    /// is installed again.
    #[test]
    fn the_chains_that_enforce_are_the_ones_checked_and_unreadable_is_missing() {
        let layout = |matching, link_check| Layout {
            matching,
            capacity: 16,
            cgroup_prefix: String::new(),
            events: None,
            link_check,
        };
        for (matching, check, bound, want) in [
            (Match::Address, LinkCheck::Ingress, false, &["forward"][..]),
            (
                Match::Address,
                LinkCheck::Prerouting,
                false,
                &["forward", "prerouting"],
            ),
            (Match::Cgroup, LinkCheck::Ingress, true, &["output"]),
            (Match::Cgroup, LinkCheck::Prerouting, true, &["output"]),
            (Match::Cgroup, LinkCheck::Ingress, false, &[]),
        ] {
            let got = enforcing_chains(&layout(matching, check), bound);
            assert_eq!(got, want, "{matching:?} {check:?} bound={bound}");
        }
        assert!(in_place("forward", Ok(5)));
        assert!(!in_place("forward", Ok(0)), "flushed");
        let failed = Err("the kernel refused the rule dump of egress_machine forward: No such file or directory (os error 2)".to_owned());
        assert!(!in_place("forward", failed), "unreadable");
    }

    /// A stand-in for nft that keeps each transaction it takes (`last`,
    /// and all of them in `all`), refuses the runs whose numbers `fail`
    /// lists, and lists vm1's counters (so the table looks whole).
    fn recording_nft(dir: &Path) -> String {
        let d = dir.display();
        format!(
            r#"case "$*" in
              *-f*) n=$(( $(cat {d}/runs 2>/dev/null || echo 0) + 1 )); echo $n > {d}/runs
                    if grep -qx "$n" {d}/fail 2>/dev/null; then cat > /dev/null; echo 'Error: refused' >&2; exit 1; fi
                    cat > {d}/last; cat {d}/last >> {d}/all ;;
              *counters*) echo '{{"nftables": [{{"counter": {{"table": "egress_machine", "name": "refused_vm1", "packets": 0}}}}, {{"counter": {{"table": "egress_machine", "name": "spoofed_vm1", "packets": 0}}}}]}}' ;;
              *) echo '{{"nftables": []}}' ;;
            esac"#
        )
    }

    /// A change whose state cannot be written and whose rules cannot be
    /// put back leaves the kernel with rules the state does not have: the
    /// error says so, and the next observer round installs the whole
    /// table from the state (once). When only the opposite transaction is
    /// refused, the whole table puts the rules back at once.
    #[test]
    fn rules_that_could_not_be_put_back_are_installed_again_from_the_state() {
        let (dir, nft) = (
            tempfile::tempdir().expect("dir"),
            tempfile::tempdir().expect("dir"),
        );
        let m = machines_over(dir.path(), &recording_nft(nft.path()));
        let audit = MachineEgress::from_json(r#"{"mode": "audit"}"#).expect("policy");
        let registration = Registration {
            addresses: vec!["100.64.4.2".parse().expect("ip")],
            egress: Some(audit.clone()),
            ..Registration::default()
        };
        m.put_vm("vm1", registration).expect("registered");
        // vm1's file cannot be replaced: a directory that is not empty.
        let file = dir.path().join(STATE_DIR).join("vm-vm1.json");
        std::fs::remove_file(&file).expect("file");
        std::fs::create_dir_all(file.join("x")).expect("in the way");
        let read = |name: &str| std::fs::read_to_string(nft.path().join(name)).unwrap_or_default();
        let runs = || read("runs").trim().parse::<u32>().expect("runs");
        let open = MachineEgress::from_json(r#"{"mode": "open"}"#).expect("policy");
        // The change, then its opposite and the whole table are refused.
        let n = runs();
        std::fs::write(nft.path().join("fail"), format!("{}\n{}\n", n + 2, n + 3)).expect("fail");
        let e = m
            .set_egress("vm1", Some(open.clone()))
            .expect_err("not written");
        assert!(e.to_string().contains("may not have been put back"), "{e}");
        assert!(matches!(e, MachineError::PersistUnsure { .. }), "{e}");
        assert_eq!(m.vm("vm1").expect("vm").effective, audit);
        let whole = "table inet egress_machine\ndelete table inet egress_machine\n";
        m.observe();
        assert_eq!(runs(), n + 4, "the observer installed the table");
        assert!(read("last").contains(whole), "{}", read("last"));
        assert!(
            read("last").contains("counter name refused_vm1 accept"),
            "audit again"
        );
        m.observe();
        assert_eq!(runs(), n + 4, "clean again: nothing more to install");
        // Only the opposite transaction refused: the whole table puts the
        // rules back before the answer, which says so.
        std::fs::write(nft.path().join("fail"), format!("{}\n", n + 6)).expect("fail");
        let e = m.set_egress("vm1", Some(open)).expect_err("not written");
        assert!(matches!(e, MachineError::Persist { .. }), "{e}");
        assert_eq!(runs(), n + 7);
        assert!(read("last").contains(whole), "{}", read("last"));
        m.observe();
        assert_eq!(runs(), n + 7, "already clean");
    }

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
