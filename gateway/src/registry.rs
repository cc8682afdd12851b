//! The sandboxes the gateway knows: source addresses → sandbox → compiled
//! policy. Readers take a lock-free snapshot per flow; writers swap a whole
//! new generation, so a flow sees one consistent state and a push applies
//! atomically. Generations are persistent maps (structural sharing): a push
//! copies O(log n) of the map, not the whole registry, so its cost does not
//! grow with the number of sandboxes.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use arc_swap::ArcSwap;
use dns_attrib::{Admit, QueryAdmission, QueryRules};
use egress_policy::SandboxId;
use egress_policy::{AttributionGap, CompiledPolicy, PlatformDenies, Policy, Protocol};

use crate::credentials::Credential;
use crate::shadow::{Shadow, ShadowDoc};
use crate::upstream_proxy::ProxyChoice;

/// One sandbox: its addresses, its compiled effective policy, its
/// host-bound credentials (references only; the values are in `Secrets`)
/// and its own way out, if it has one.
#[derive(Debug)]
pub struct Sandbox {
    pub id: SandboxId,
    pub addresses: Vec<IpAddr>,
    pub policy: Arc<CompiledPolicy>,
    pub credentials: Vec<Credential>,
    /// `direct` or a configured proxy; `None`: the worker's default.
    pub upstream_proxy: Option<ProxyChoice>,
    /// A candidate policy judged beside `policy`, never enforced ([`crate::shadow`]).
    pub shadow: Option<Arc<Shadow>>,
    /// Which registration of `id` this is: kept by every push that
    /// replaces it, new once it was deleted (or left out of a resync) and
    /// registered again. What a registration holds past its requests (its
    /// pooled upstream connections) is never another's of the same id.
    pub serial: u64,
    /// The writer's revision of it (the controller's generation), when the
    /// push named one: a push or delete below it is refused.
    pub revision: Option<u64>,
}

impl Sandbox {
    /// Whether `other` is this registration, enforced the same: the same
    /// serial, addresses, policy document, credentials and way out (its
    /// shadow is never enforced; a lapsed entry is compiled out of both).
    fn enforced_as(&self, other: &Self) -> bool {
        self.serial == other.serial
            && self.addresses == other.addresses
            && self.policy.policy() == other.policy.policy()
            && self.credentials == other.credentials
            && self.upstream_proxy == other.upstream_proxy
    }
}

/// The next [`Sandbox::serial`].
static SERIALS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// What a registration carries besides its addresses and policy.
#[derive(Debug, Default)]
pub struct Extras {
    pub credentials: Vec<Credential>,
    pub upstream_proxy: Option<ProxyChoice>,
    pub shadow: Option<ShadowDoc>,
    /// The writer's revision ([`Sandbox::revision`]).
    pub revision: Option<u64>,
}

/// Why a change was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RegistryError {
    #[error("address {address} already belongs to sandbox {owner}")]
    AddressInUse { address: IpAddr, owner: String },
    #[error("sandbox {0} lists address {1} twice")]
    DuplicateAddress(String, IpAddr),
    #[error("address {address} belongs to VM {vm}")]
    AddressOfVm { address: IpAddr, vm: String },
    #[error("the gateway holds its limit of {max} sandboxes (limits.max_sandboxes): {refused} not registered")]
    Full { max: usize, refused: String },
}

/// One consistent generation of the registry (not the snapshot file: see `persist`).
#[derive(Clone, Debug, Default)]
pub struct Generation {
    by_addr: imbl::HashMap<IpAddr, Arc<Sandbox>>,
    by_id: imbl::OrdMap<SandboxId, Arc<Sandbox>>,
    /// `by_addr`'s keys alone, for the platform denies: a copy costs
    /// nothing, and holds no sandbox (whose policy holds the platform).
    addrs: imbl::HashSet<IpAddr>,
}

/// The registry; cheap to read from any task.
#[derive(Debug)]
pub struct Registry {
    snapshot: ArcSwap<Generation>,
    platform: Arc<PlatformDenies>,
    /// Serialises writers, and holds the addresses VMs claim (machine
    /// egress): an address belongs to one sandbox or one VM, never both.
    write: std::sync::Mutex<VmClaims>,
    /// The most sandboxes a push or a resync may leave registered
    /// ([`Registry::set_max`]); none until set, so a recovery takes back
    /// whatever was acknowledged.
    max: std::sync::atomic::AtomicUsize,
    /// Addresses a successor registered for its sandboxes while this
    /// gateway drains ([`Registry::add_foreign`]), sorted: denied as
    /// destinations as this gateway's own sandboxes' are.
    foreign: ArcSwap<Vec<IpAddr>>,
}

/// Most addresses a successor may add to [`Registry::add_foreign`].
pub const MAX_FOREIGN: usize = 1 << 20;

/// Address → the VM that claims it.
type VmClaims = std::collections::HashMap<IpAddr, String>;

impl Registry {
    pub fn new(platform: Arc<PlatformDenies>) -> Self {
        Self {
            snapshot: ArcSwap::from_pointee(Generation::default()),
            platform,
            write: std::sync::Mutex::new(VmClaims::new()),
            max: std::sync::atomic::AtomicUsize::new(usize::MAX),
            foreign: ArcSwap::default(),
        }
    }

    /// From now on, a push that would register one sandbox more than `max`,
    /// or a resync of more, is refused ([`RegistryError::Full`]); those
    /// already registered stay.
    pub fn set_max(&self, max: usize) {
        self.max.store(max, std::sync::atomic::Ordering::Relaxed);
    }

    /// The most sandboxes a push or a resync may leave registered.
    pub fn max(&self) -> usize {
        self.max.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn full(&self, count: usize, refused: &SandboxId) -> Result<(), RegistryError> {
        let max = self.max.load(std::sync::atomic::Ordering::Relaxed);
        if count > max {
            return Err(RegistryError::Full {
                max,
                refused: refused.to_string(),
            });
        }
        Ok(())
    }

    /// The platform denies every policy is compiled with.
    pub fn platform(&self) -> &PlatformDenies {
        &self.platform
    }

    /// The sandbox a source address belongs to.
    pub fn lookup(&self, src: IpAddr) -> Option<Arc<Sandbox>> {
        let src = src.to_canonical();
        self.snapshot.load().by_addr.get(&src).cloned()
    }

    /// Whether `src` still belongs to `sandbox`'s registration: a flow
    /// accepted for it runs while it does (a deleted sandbox, an address
    /// taken from it, or the id deleted and registered again, ends its
    /// open flows; a push that replaces it keeps its serial).
    pub fn holds(&self, src: IpAddr, sandbox: &Sandbox) -> bool {
        self.lookup(src)
            .is_some_and(|s| s.id == sandbox.id && s.serial == sandbox.serial)
    }

    pub fn get(&self, id: &SandboxId) -> Option<Arc<Sandbox>> {
        self.snapshot.load().by_id.get(id).cloned()
    }

    /// Whether `sandbox`'s registration is still the one its id names.
    pub fn is_current(&self, sandbox: &Sandbox) -> bool {
        self.snapshot
            .load()
            .by_id
            .get(&sandbox.id)
            .is_some_and(|now| now.serial == sandbox.serial)
    }

    pub fn ids(&self) -> Vec<SandboxId> {
        self.snapshot.load().by_id.keys().cloned().collect()
    }

    /// Every sandbox, by id.
    pub fn all(&self) -> Vec<Arc<Sandbox>> {
        self.snapshot.load().by_id.values().cloned().collect()
    }

    pub fn len(&self) -> usize {
        self.snapshot.load().by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The current state, to restore if what follows a change fails.
    pub fn checkpoint(&self) -> Arc<Generation> {
        self.snapshot.load_full()
    }

    /// Puts back a state taken with [`Registry::checkpoint`], under the
    /// writers' lock: a writer that read the state being undone (the
    /// lapse watch) cannot store it back after.
    pub fn restore(&self, snapshot: Arc<Generation>) {
        let claims = self.lock();
        self.publish(&claims, snapshot);
    }

    /// Stores `next` (under the writers' lock, `claims` its guard) and
    /// tells the platform denies which addresses are sandboxes' and VMs'
    /// now: no sandbox may reach another through the gateway.
    fn publish(&self, claims: &VmClaims, next: Arc<Generation>) {
        self.register_addresses(claims, &next);
        self.snapshot.store(next);
    }

    fn register_addresses(&self, claims: &VmClaims, generation: &Generation) {
        let sandboxes = generation.addrs.clone();
        let mut vms: Vec<IpAddr> = claims.keys().copied().collect();
        vms.sort_unstable();
        let foreign = self.foreign.load_full();
        self.platform.set_registered(move |ip| {
            sandboxes.contains(&ip)
                || vms.binary_search(&ip).is_ok()
                || foreign.binary_search(&ip).is_ok()
        });
    }

    /// Denies `addrs` as destinations from now on, as sandboxes' addresses
    /// are: a successor registered them while this gateway drains
    /// ([`crate::handover::changes`]). `false`, nothing added, past
    /// [`MAX_FOREIGN`].
    pub fn add_foreign(&self, addrs: &[IpAddr]) -> bool {
        let claims = self.lock();
        let mut all = (*self.foreign.load_full()).clone();
        all.extend(addrs.iter().map(|a| a.to_canonical()));
        // Sorted already but for the new ones: the stable sort merges the
        // runs in about linear time.
        all.sort();
        all.dedup();
        if all.len() > MAX_FOREIGN {
            return false;
        }
        self.foreign.store(Arc::new(all));
        self.register_addresses(&claims, &self.snapshot.load());
        true
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VmClaims> {
        self.write
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Adds or replaces one sandbox.
    pub fn put(
        &self,
        id: SandboxId,
        addresses: Vec<IpAddr>,
        policy: Policy,
    ) -> Result<(), RegistryError> {
        self.put_prepared(self.prepare(id, addresses, policy))
    }

    /// Compiles a sandbox for [`Registry::put_prepared`]: the costly part of
    /// a push, done before (and outside) the serialised swap.
    pub fn prepare(&self, id: SandboxId, addresses: Vec<IpAddr>, policy: Policy) -> Arc<Sandbox> {
        self.prepare_with(id, addresses, policy, Extras::default())
    }

    /// [`Registry::prepare`] for a sandbox with credentials or its own way out.
    pub fn prepare_with(
        &self,
        id: SandboxId,
        addresses: Vec<IpAddr>,
        policy: Policy,
        extras: Extras,
    ) -> Arc<Sandbox> {
        Arc::new(self.compile(id, addresses, policy, extras))
    }

    /// Adds or replaces a prepared sandbox.
    pub fn put_prepared(&self, sandbox: Arc<Sandbox>) -> Result<(), RegistryError> {
        let claims = self.lock();
        unclaimed(&claims, &sandbox)?;
        let mut next = (*self.snapshot.load_full()).clone();
        let sandbox = next.carry(sandbox);
        let id = sandbox.id.clone();
        let new = !next.by_id.contains_key(&id);
        next.insert(sandbox)?;
        if new {
            self.full(next.by_id.len(), &id)?;
        }
        self.publish(&claims, Arc::new(next));
        Ok(())
    }

    /// Replaces every sandbox with prepared ones (the controller's resync,
    /// a snapshot's restore).
    pub fn replace_prepared(&self, sandboxes: Vec<Arc<Sandbox>>) -> Result<(), RegistryError> {
        let claims = self.lock();
        let current = self.snapshot.load_full();
        let mut next = Generation::default();
        for s in sandboxes {
            let id = s.id.clone();
            next.insert(current.carry(s))?;
            self.full(next.by_id.len(), &id)?;
        }
        for s in next.by_id.values() {
            unclaimed(&claims, s)?;
        }
        self.publish(&claims, Arc::new(next));
        Ok(())
    }

    /// Gives `vm` exactly `addresses` (replacing what it claimed before);
    /// refused when a sandbox or another VM holds one of them.
    pub fn claim_for_vm(&self, vm: &str, addresses: &[IpAddr]) -> Result<(), RegistryError> {
        let mut claims = self.lock();
        let generation = self.snapshot.load();
        let addresses: Vec<IpAddr> = addresses
            .iter()
            .copied()
            .map(|a| a.to_canonical())
            .collect();
        for &a in &addresses {
            if let Some(owner) = generation.by_addr.get(&a) {
                return Err(RegistryError::AddressInUse {
                    address: a,
                    owner: owner.id.to_string(),
                });
            }
            match claims.get(&a) {
                Some(other) if other != vm => {
                    return Err(RegistryError::AddressOfVm {
                        address: a,
                        vm: other.clone(),
                    })
                }
                _ => {}
            }
        }
        claims.retain(|_, owner| owner != vm);
        for a in addresses {
            claims.insert(a, vm.to_owned());
        }
        self.register_addresses(&claims, &self.snapshot.load());
        Ok(())
    }

    /// Every address a VM claims.
    pub fn vm_claimed(&self) -> Vec<IpAddr> {
        self.lock().keys().copied().collect()
    }

    /// Releases every address `vm` claimed.
    pub fn release_vm(&self, vm: &str) {
        let mut claims = self.lock();
        claims.retain(|_, owner| owner != vm);
        self.register_addresses(&claims, &self.snapshot.load());
    }

    /// Compiles again every sandbox whose policy has an allow entry that
    /// lapsed by `now` ([`CompiledPolicy::next_expiry`]): the same
    /// registration (serial, addresses, shadow), its policy without the
    /// entry. One a push replaced meanwhile is left alone (the push
    /// compiled it anew). How many were compiled again.
    pub fn recompile_lapsed(&self, now: time::OffsetDateTime) -> usize {
        let due_at = |p: &CompiledPolicy| p.next_expiry().is_some_and(|at| at <= now);
        let lapsed = |s: &Sandbox| {
            due_at(&s.policy) || s.shadow.as_ref().is_some_and(|sh| due_at(&sh.policy))
        };
        let due: Vec<Arc<Sandbox>> = self
            .snapshot
            .load()
            .by_id
            .values()
            .filter(|s| lapsed(s))
            .cloned()
            .collect();
        if due.is_empty() {
            return 0;
        }
        // Compiled outside the writers' lock, like a push.
        let fresh: Vec<Sandbox> = due
            .iter()
            .map(|s| {
                let compiled = |p: &CompiledPolicy| {
                    Arc::new(self.compile_policy(p.policy().clone(), &s.credentials))
                };
                let shadow = s
                    .shadow
                    .as_ref()
                    .map(|sh| Arc::new(sh.recompiled(compiled(&sh.policy))));
                Sandbox {
                    policy: compiled(&s.policy),
                    ..s.with_shadow(shadow)
                }
            })
            .collect();
        let _claims = self.lock();
        let mut next = (*self.snapshot.load_full()).clone();
        let mut done = 0;
        for (old, new) in due.iter().zip(fresh) {
            let unchanged = next.by_id.get(&old.id).is_some_and(|s| Arc::ptr_eq(s, old));
            // The same addresses as the one it replaces: it cannot clash.
            if unchanged && next.insert(Arc::new(new)).is_ok() {
                done += 1;
            }
        }
        self.snapshot.store(Arc::new(next));
        done
    }

    pub fn remove(&self, id: &SandboxId) -> bool {
        let claims = self.lock();
        let mut next = (*self.snapshot.load_full()).clone();
        if !next.remove(id) {
            return false;
        }
        self.publish(&claims, Arc::new(next));
        true
    }

    fn compile(
        &self,
        id: SandboxId,
        addresses: Vec<IpAddr>,
        policy: Policy,
        Extras {
            credentials,
            upstream_proxy,
            shadow,
            revision,
        }: Extras,
    ) -> Sandbox {
        let shadow = shadow.map(|d| Arc::new(self.compile_shadow(d, &credentials)));
        Sandbox {
            id,
            addresses: addresses.into_iter().map(|a| a.to_canonical()).collect(),
            policy: Arc::new(self.compile_policy(policy, &credentials)),
            credentials,
            upstream_proxy,
            shadow,
            serial: SERIALS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            revision,
        }
    }

    /// Compiles `policy` for a sandbox with `credentials`.
    pub(crate) fn compile_policy(
        &self,
        policy: Policy,
        credentials: &[Credential],
    ) -> CompiledPolicy {
        let hosts = credentials.iter().map(|c| {
            let list = c.hosts.iter().map(|h| h.destination()).collect();
            (c.name.as_str(), list)
        });
        CompiledPolicy::with_credentials(policy, self.platform.clone(), hosts)
    }

    /// Compiles a candidate for a sandbox with `credentials`.
    pub fn compile_shadow(&self, doc: ShadowDoc, credentials: &[Credential]) -> Shadow {
        Shadow::new(
            Arc::new(self.compile_policy(doc.policy, credentials)),
            doc.since,
            doc.policy_changed,
        )
    }
}

// === impl Sandbox ===

impl Sandbox {
    /// This sandbox with another shadow (or none).
    pub fn with_shadow(&self, shadow: Option<Arc<Shadow>>) -> Self {
        Self {
            id: self.id.clone(),
            addresses: self.addresses.clone(),
            policy: self.policy.clone(),
            credentials: self.credentials.clone(),
            upstream_proxy: self.upstream_proxy.clone(),
            shadow,
            serial: self.serial,
            revision: self.revision,
        }
    }

    /// This sandbox with its shadow's candidate as its policy and no
    /// shadow; `None` without a shadow.
    pub fn promoted(&self) -> Option<Self> {
        let candidate = self.shadow.as_ref()?.policy.clone();
        let mut next = self.with_shadow(None);
        next.policy = candidate;
        Some(next)
    }
}

/// Refuses a sandbox holding an address a VM claims.
fn unclaimed(claims: &VmClaims, sandbox: &Sandbox) -> Result<(), RegistryError> {
    match sandbox
        .addresses
        .iter()
        .find_map(|a| Some((a, claims.get(a)?)))
    {
        Some((&address, vm)) => Err(RegistryError::AddressOfVm {
            address,
            vm: vm.clone(),
        }),
        None => Ok(()),
    }
}

impl Generation {
    /// The addresses this generation's sandboxes hold that `before`'s did
    /// not.
    pub fn registered_since(&self, before: &Self) -> Vec<IpAddr> {
        self.addrs
            .iter()
            .filter(|a| !before.addrs.contains(*a))
            .copied()
            .collect()
    }

    /// The ids of `before`'s sandboxes whose registration is not enforced
    /// the same in this generation: taken out (or registered anew), or
    /// pushed with other addresses, policy, credentials or way out. The
    /// same document pushed again (a resync after a restart) is the same;
    /// so is a recompile past a lapsed `until` or a shadow put.
    pub fn changed_since(&self, before: &Self) -> Vec<SandboxId> {
        before
            .by_id
            .iter()
            .filter(|(id, was)| {
                !self
                    .by_id
                    .get(*id)
                    .is_some_and(|now| Arc::ptr_eq(now, was) || now.enforced_as(was))
            })
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Adds or replaces `sandbox`; refuses an address another sandbox holds
    /// or one it lists twice.
    /// `sandbox` as it replaces this generation's sandbox of its id, if
    /// any: with that one's serial (a push is the same registration).
    fn carry(&self, sandbox: Arc<Sandbox>) -> Arc<Sandbox> {
        match self.by_id.get(&sandbox.id) {
            Some(old) if old.serial != sandbox.serial => {
                let mut same = sandbox.with_shadow(sandbox.shadow.clone());
                same.serial = old.serial;
                Arc::new(same)
            }
            _ => sandbox,
        }
    }

    fn insert(&mut self, sandbox: Arc<Sandbox>) -> Result<(), RegistryError> {
        let mut seen = HashSet::with_capacity(sandbox.addresses.len());
        for &a in &sandbox.addresses {
            if !seen.insert(a) {
                return Err(RegistryError::DuplicateAddress(sandbox.id.to_string(), a));
            }
            if let Some(owner) = self.by_addr.get(&a) {
                if owner.id != sandbox.id {
                    return Err(RegistryError::AddressInUse {
                        address: a,
                        owner: owner.id.to_string(),
                    });
                }
            }
        }
        self.remove(&sandbox.id);
        for &a in &sandbox.addresses {
            self.by_addr.insert(a, sandbox.clone());
            self.addrs.insert(a);
        }
        self.by_id.insert(sandbox.id.clone(), sandbox);
        Ok(())
    }

    fn remove(&mut self, id: &SandboxId) -> bool {
        let Some(old) = self.by_id.remove(id) else {
            return false;
        };
        for a in &old.addresses {
            self.by_addr.remove(a);
            self.addrs.remove(a);
        }
        true
    }
}

impl QueryRules for Sandbox {
    fn policy(&self) -> &CompiledPolicy {
        &self.policy
    }

    fn registration(&self) -> u64 {
        self.serial
    }
}

impl QueryAdmission for Registry {
    /// A DNS query is a flow to the resolver: the sandbox's policy must allow it.
    fn admit(&self, src: IpAddr, resolver: SocketAddr) -> Admit {
        let Some(sandbox) = self.lookup(src) else {
            return Admit::Unknown;
        };
        let claims = crate::decide::Claims {
            dst: resolver,
            // Read by the gateway's own DNS proxy: never an unreadable stream.
            protocol: Protocol::Dns,
            sni: None,
            host: None,
            ech: false,
        };
        // Opaque, so never encrypted DNS: no DoH names needed.
        let none = crate::doh::DohNames::empty();
        let verdict = crate::decide::judge(
            &sandbox.policy,
            &claims,
            &[],
            AttributionGap::NoDnsSeen,
            &none,
        );
        if verdict.is_deny() {
            Admit::Refused(sandbox.id.clone())
        } else {
            Admit::Allowed(sandbox.id.clone(), sandbox)
        }
    }

    fn holds(&self, src: IpAddr, sandbox: &SandboxId, registration: u64) -> bool {
        self.lookup(src)
            .is_some_and(|s| s.id == *sandbox && s.serial == registration)
    }

    fn registered(&self, sandbox: &SandboxId, registration: u64) -> bool {
        self.get(sandbox).is_some_and(|s| s.serial == registration)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg() -> Registry {
        Registry::new(Arc::new(PlatformDenies::builtin()))
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect(s)
    }

    fn policy(text: &str) -> Policy {
        Policy::from_json(text).expect(text)
    }

    /// `policy`'s verdict on an opaque flow to `dst` port 22, with no DNS seen.
    fn opaque_to(policy: &CompiledPolicy, dst: &str) -> egress_policy::Verdict {
        let claims = crate::decide::Claims {
            dst: SocketAddr::new(ip(dst), 22),
            protocol: Protocol::Opaque(None),
            sni: None,
            host: None,
            ech: false,
        };
        let doh = crate::doh::DohNames::empty();
        crate::decide::judge(policy, &claims, &[], AttributionGap::NoDnsSeen, &doh)
    }

    /// An allow entry past its `until` is compiled out by
    /// `recompile_lapsed`, with no push: the same registration (serial,
    /// addresses), the entry out of force, the others in it.
    #[test]
    fn an_allow_entry_lapses_without_a_push() {
        let r = reg();
        let id = SandboxId::new("a");
        let rfc3339 = time::format_description::well_known::Rfc3339;
        let soon = (time::OffsetDateTime::now_utc() + time::Duration::milliseconds(600))
            .format(&rfc3339)
            .expect("format");
        let text = format!(
            r#"{{"default": "deny", "allow": [{{"ip": "203.0.113.7", "until": "{soon}"}}, {{"ip": "203.0.113.8"}}]}}"#
        );
        let extras = Extras {
            shadow: Some(ShadowDoc {
                policy: policy(&text),
                since: "2026-12-05T00:00:00Z".into(),
                policy_changed: None,
            }),
            ..Extras::default()
        };
        let prepared = r.prepare_with(id.clone(), vec![ip("100.64.1.2")], policy(&text), extras);
        r.put_prepared(prepared).expect("put");
        let judged = |shadow: bool, dst: &str| {
            let s = r.lookup(ip("100.64.1.2")).expect("registered");
            let p = match (shadow, &s.shadow) {
                (true, Some(sh)) => sh.policy.clone(),
                _ => s.policy.clone(),
            };
            opaque_to(&p, dst).code()
        };
        let verdict = |dst: &str| judged(false, dst);
        let serial = r.get(&id).expect("a").serial;
        assert_eq!(verdict("203.0.113.7"), "allow_address");
        assert_eq!(r.recompile_lapsed(time::OffsetDateTime::now_utc()), 0);
        std::thread::sleep(std::time::Duration::from_millis(700));
        assert_eq!(r.recompile_lapsed(time::OffsetDateTime::now_utc()), 1);
        assert_eq!(verdict("203.0.113.7"), "no_allow_match");
        assert_eq!(verdict("203.0.113.8"), "allow_address");
        assert_eq!(
            judged(true, "203.0.113.7"),
            "no_allow_match",
            "the shadow's too"
        );
        assert_eq!(
            r.get(&id).expect("a").serial,
            serial,
            "the same registration"
        );
        assert_eq!(
            r.recompile_lapsed(time::OffsetDateTime::now_utc()),
            0,
            "once"
        );
    }

    /// What a flow or a DNS answer asks when it ends: whether its address
    /// still belongs to its sandbox. A push is the same registration; a
    /// delete ends it, and the id registered again is another (its pooled
    /// connections are not the first one's).
    #[test]
    fn an_address_is_held_by_its_sandbox_until_deleted_or_taken() {
        let r = reg();
        let (a, b) = (SandboxId::new("a"), SandboxId::new("b"));
        r.put(a.clone(), vec![ip("100.64.1.2")], Policy::default())
            .expect("put");
        let serial = |id: &SandboxId| r.get(id).map_or(0, |s| s.serial);
        let held = |id: &SandboxId, serial: u64| {
            QueryAdmission::holds(&r, ip("::ffff:100.64.1.2"), id, serial)
        };
        let first = serial(&a);
        assert!(held(&a, first));
        assert!(!held(&b, first));
        r.put(a.clone(), vec![ip("100.64.1.3")], Policy::default())
            .expect("moved");
        assert!(!held(&a, first), "the address taken from it");
        r.put(b.clone(), vec![ip("100.64.1.2")], Policy::default())
            .expect("put");
        let b_first = serial(&b);
        assert!(held(&b, b_first));
        assert!(r.remove(&b));
        assert!(!held(&b, b_first), "deleted");
        r.put(b.clone(), vec![ip("100.64.1.2")], Policy::default())
            .expect("registered again");
        assert!(!held(&b, b_first), "another registration of the id");
        assert!(held(&b, serial(&b)));
    }

    /// What a predecessor is told after a handover: a resync of the same
    /// documents changes nothing it enforces; one with another policy, or
    /// without a sandbox, changes those.
    #[test]
    fn a_resync_of_the_same_documents_changes_no_registration() {
        let r = reg();
        let open = r#"{"allow": [{"domain": "a.test"}]}"#;
        let docs = |second: &str| {
            vec![
                r.prepare(SandboxId::new("one"), vec![ip("100.64.0.2")], policy(open)),
                r.prepare(
                    SandboxId::new("two"),
                    vec![ip("100.64.0.3")],
                    policy(second),
                ),
            ]
        };
        r.replace_prepared(docs(open)).expect("resync");
        let had = r.checkpoint();
        r.replace_prepared(docs(open)).expect("resync");
        assert!(r.checkpoint().changed_since(&had).is_empty());
        r.replace_prepared(docs(r#"{"allow": []}"#))
            .expect("resync");
        assert_eq!(r.checkpoint().changed_since(&had), [SandboxId::new("two")]);
        let had = r.checkpoint();
        r.replace_prepared(docs(r#"{"allow": []}"#)[..1].to_vec())
            .expect("resync");
        assert_eq!(r.checkpoint().changed_since(&had), [SandboxId::new("two")]);
    }

    /// Past `set_max`, a push of one more sandbox and a resync of more are
    /// refused, naming the limit; a push replacing one registered is not,
    /// and once one is deleted another fits.
    #[test]
    fn no_more_sandboxes_than_the_limit_are_registered() {
        let r = reg();
        let open = || policy(r#"{"default": "allow"}"#);
        let put = |id: &str, addr: &str| r.put(SandboxId::new(id), vec![ip(addr)], open());
        r.set_max(2);
        put("a", "100.64.1.1").expect("a");
        put("b", "100.64.1.2").expect("b");
        let refused = put("c", "100.64.1.3").expect_err("c is one too many");
        assert_eq!(
            refused.to_string(),
            "the gateway holds its limit of 2 sandboxes (limits.max_sandboxes): c not registered"
        );
        assert!(r.lookup(ip("100.64.1.3")).is_none());
        put("a", "100.64.1.4").expect("a replaced");
        assert!(r.remove(&SandboxId::new("b")));
        put("c", "100.64.1.3").expect("room again");
        let three = ["x", "y", "z"]
            .iter()
            .zip(["100.64.2.1", "100.64.2.2", "100.64.2.3"])
            .map(|(id, a)| r.prepare(SandboxId::new(id), vec![ip(a)], open()))
            .collect();
        assert!(matches!(
            r.replace_prepared(three),
            Err(RegistryError::Full { max: 2, .. })
        ));
        assert_eq!(r.len(), 2, "a refused resync changes nothing");
    }

    #[test]
    fn a_registration_keeps_its_serial_until_deleted() {
        let r = reg();
        let a = SandboxId::new("a");
        let serial = || r.get(&a).expect("registered").serial;
        r.put(a.clone(), vec![ip("100.64.1.2")], Policy::default())
            .expect("put");
        let first = serial();
        r.put(
            a.clone(),
            vec![ip("100.64.1.3")],
            policy(r#"{"default": "allow"}"#),
        )
        .expect("pushed");
        assert_eq!(serial(), first, "a push");
        let again = r.prepare(a.clone(), vec![ip("100.64.1.3")], Policy::default());
        r.replace_prepared(vec![again]).expect("resync");
        assert_eq!(serial(), first, "a resync that keeps it");
        assert!(r.remove(&a));
        r.put(a.clone(), vec![ip("100.64.1.3")], Policy::default())
            .expect("put again");
        assert_ne!(serial(), first, "registered again after a delete");
    }

    #[test]
    fn lookup_put_replace_remove() {
        let r = reg();
        r.put(
            SandboxId::new("a"),
            vec![ip("100.64.1.2"), ip("fd00:64::2")],
            Policy::default(),
        )
        .expect("put");
        assert_eq!(
            r.lookup(ip("100.64.1.2")).expect("found").id,
            SandboxId::new("a")
        );
        assert_eq!(
            r.lookup(ip("::ffff:100.64.1.2")).expect("mapped").id,
            SandboxId::new("a")
        );
        assert!(r.lookup(ip("100.64.1.3")).is_none());
        let err = r
            .put(
                SandboxId::new("b"),
                vec![ip("100.64.1.2")],
                Policy::default(),
            )
            .expect_err("taken");
        assert_eq!(
            err,
            RegistryError::AddressInUse {
                address: ip("100.64.1.2"),
                owner: "a".into()
            }
        );
        r.put(
            SandboxId::new("a"),
            vec![ip("100.64.1.9")],
            Policy::default(),
        )
        .expect("re-put moves addresses");
        assert!(r.lookup(ip("100.64.1.2")).is_none());
        let c = r.prepare(
            SandboxId::new("c"),
            vec![ip("100.64.2.2")],
            Policy::default(),
        );
        r.replace_prepared(vec![c]).expect("resync");
        assert_eq!(r.ids(), [SandboxId::new("c")]);
        assert!(r.remove(&SandboxId::new("c")));
        assert!(!r.remove(&SandboxId::new("c")));
        assert!(r.lookup(ip("100.64.2.2")).is_none());
    }

    #[test]
    fn dns_admission_follows_the_policy() {
        let r = reg();
        r.put(
            SandboxId::new("a"),
            vec![ip("100.64.1.2")],
            policy(r#"{"allow": [{"ip": "8.8.8.8"}]}"#),
        )
        .expect("put");
        r.put(
            SandboxId::new("b"),
            vec![ip("100.64.1.3")],
            policy(r#"{"allow": [{"ip": "1.1.1.1"}]}"#),
        )
        .expect("put");
        let g: SocketAddr = "8.8.8.8:53".parse().expect("addr");
        match r.admit(ip("100.64.1.2"), g) {
            Admit::Allowed(id, rules) => {
                assert_eq!(id, SandboxId::new("a"));
                assert_eq!(rules.policy().policy().allow.len(), 1, "a's own policy");
            }
            other => panic!("a: {other:?}"),
        }
        assert!(
            matches!(r.admit(ip("100.64.1.3"), g), Admit::Refused(id) if id == SandboxId::new("b"))
        );
        assert!(matches!(r.admit(ip("100.64.1.4"), g), Admit::Unknown));
    }

    /// A sandbox's or a VM's address is a platform deny for every sandbox,
    /// whatever its policy allows (the gateway dials from the host: one
    /// sandbox would reach another past both policies), in every form that
    /// names it, from its registration until it goes.
    #[test]
    fn another_sandboxs_or_a_vms_address_is_a_platform_deny() {
        let r = Registry::new(Arc::new(PlatformDenies::new(Vec::new())));
        let open = || policy(r#"{"default": "allow"}"#);
        r.put(SandboxId::new("a"), vec![ip("2001:db8:1::2")], open())
            .expect("a");
        let verdict = |dst: &str| {
            let s = r.lookup(ip("2001:db8:1::2")).expect("a");
            let v = opaque_to(&s.policy, dst);
            (v.code(), v.describe(&s.policy))
        };
        assert_eq!(verdict("2001:db8:2::2").0, "allow_default");
        r.put(
            SandboxId::new("b"),
            vec![ip("2001:db8:2::2"), ip("198.51.100.2")],
            open(),
        )
        .expect("b");
        for dst in [
            "2001:db8:2::2",
            "198.51.100.2",
            "::ffff:198.51.100.2",
            "2001:db8:1::2",
        ] {
            let (code, why) = verdict(dst);
            assert_eq!(code, "platform_deny", "{dst}");
            assert!(why.contains("a sandbox or a VM on this gateway"), "{why}");
        }
        r.claim_for_vm("vm1", &[ip("198.51.100.9")]).expect("vm");
        assert_eq!(verdict("198.51.100.9").0, "platform_deny");
        assert!(r.remove(&SandboxId::new("b")));
        r.release_vm("vm1");
        for dst in ["2001:db8:2::2", "198.51.100.9"] {
            assert_eq!(
                verdict(dst).0,
                "allow_default",
                "{dst}: gone, no longer denied"
            );
        }
        // Addresses a successor registered while this gateway drains are
        // denied too, in every form, until the process ends.
        assert!(r.add_foreign(&[ip("::ffff:198.51.100.7"), ip("2001:db8:3::2")]));
        for dst in ["198.51.100.7", "::ffff:198.51.100.7", "2001:db8:3::2"] {
            assert_eq!(verdict(dst).0, "platform_deny", "{dst}: the successor's");
        }
        assert_eq!(verdict("198.51.100.8").0, "allow_default");
        let too_many: Vec<IpAddr> = (0..=MAX_FOREIGN as u32)
            .map(|i| IpAddr::V4(i.into()))
            .collect();
        assert!(!r.add_foreign(&too_many), "past the bound");
        assert_eq!(verdict("0.0.0.5").0, "allow_default", "nothing added");
        // What the platform denies keep of the registry holds no sandbox
        // (each of whose policies holds the platform): no cycle outlives it.
        let platform = r.platform.clone();
        drop(r);
        assert_eq!(Arc::strong_count(&platform), 1);
    }
}
