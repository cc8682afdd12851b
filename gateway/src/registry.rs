//! The sandboxes the gateway knows: source addresses → sandbox → compiled
//! policy. Readers take a lock-free snapshot per flow; writers swap a whole
//! new snapshot, so a flow sees one consistent state and a push applies
//! atomically.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use arc_swap::ArcSwap;
use dns_attrib::{Admit, QueryAdmission};
use egress_policy::SandboxId;
use egress_policy::{AttributionGap, CompiledPolicy, PlatformDenies, Policy, Protocol};

/// One sandbox: its addresses and its compiled effective policy.
#[derive(Debug)]
pub struct Sandbox {
    pub id: SandboxId,
    pub addresses: Vec<IpAddr>,
    pub policy: CompiledPolicy,
}

/// Why a change was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RegistryError {
    #[error("address {address} already belongs to sandbox {owner}")]
    AddressInUse { address: IpAddr, owner: String },
    #[error("sandbox {0} lists address {1} twice")]
    DuplicateAddress(String, IpAddr),
}

/// One consistent generation of the registry (not the snapshot file: see `persist`).
#[derive(Debug, Default)]
pub struct Generation {
    by_addr: HashMap<IpAddr, Arc<Sandbox>>,
    by_id: BTreeMap<SandboxId, Arc<Sandbox>>,
}

/// The registry; cheap to read from any task.
#[derive(Debug)]
pub struct Registry {
    snapshot: ArcSwap<Generation>,
    platform: Arc<PlatformDenies>,
    write: std::sync::Mutex<()>,
}

impl Registry {
    pub fn new(platform: Arc<PlatformDenies>) -> Self {
        Self {
            snapshot: ArcSwap::from_pointee(Generation::default()),
            platform,
            write: std::sync::Mutex::new(()),
        }
    }

    /// The sandbox a source address belongs to.
    pub fn lookup(&self, src: IpAddr) -> Option<Arc<Sandbox>> {
        let src = canonical(src);
        self.snapshot.load().by_addr.get(&src).cloned()
    }

    pub fn get(&self, id: &SandboxId) -> Option<Arc<Sandbox>> {
        self.snapshot.load().by_id.get(id).cloned()
    }

    pub fn ids(&self) -> Vec<SandboxId> {
        self.snapshot.load().by_id.keys().cloned().collect()
    }

    /// Every sandbox, by id.
    pub fn all(&self) -> Vec<Arc<Sandbox>> {
        self.snapshot.load().by_id.values().cloned().collect()
    }

    /// The current state, to restore if what follows a change fails.
    pub fn checkpoint(&self) -> Arc<Generation> {
        self.snapshot.load_full()
    }

    /// Puts back a state taken with [`Registry::checkpoint`].
    pub fn restore(&self, snapshot: Arc<Generation>) {
        self.snapshot.store(snapshot);
    }

    /// Adds or replaces one sandbox.
    pub fn put(
        &self,
        id: SandboxId,
        addresses: Vec<IpAddr>,
        policy: Policy,
    ) -> Result<(), RegistryError> {
        let _guard = self
            .write
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let current = self.snapshot.load();
        let mut entries: Vec<(SandboxId, Vec<IpAddr>, Arc<Sandbox>)> = current
            .by_id
            .iter()
            .filter(|(k, _)| **k != id)
            .map(|(k, s)| (k.clone(), s.addresses.clone(), s.clone()))
            .collect();
        let sandbox = Arc::new(self.compile(id.clone(), addresses, policy));
        entries.push((id, sandbox.addresses.clone(), sandbox));
        let next = build(entries)?;
        self.snapshot.store(Arc::new(next));
        Ok(())
    }

    /// Replaces every sandbox at once (the controller's resync).
    pub fn replace_all(
        &self,
        sandboxes: Vec<(SandboxId, Vec<IpAddr>, Policy)>,
    ) -> Result<(), RegistryError> {
        let _guard = self
            .write
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let entries = sandboxes
            .into_iter()
            .map(|(id, addrs, policy)| {
                let s = Arc::new(self.compile(id.clone(), addrs, policy));
                (id, s.addresses.clone(), s)
            })
            .collect();
        self.snapshot.store(Arc::new(build(entries)?));
        Ok(())
    }

    pub fn remove(&self, id: &SandboxId) -> bool {
        let _guard = self
            .write
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let current = self.snapshot.load();
        if !current.by_id.contains_key(id) {
            return false;
        }
        let entries = current
            .by_id
            .iter()
            .filter(|(k, _)| *k != id)
            .map(|(k, s)| (k.clone(), s.addresses.clone(), s.clone()))
            .collect();
        // Removing cannot create a conflict.
        if let Ok(next) = build(entries) {
            self.snapshot.store(Arc::new(next));
        }
        true
    }

    fn compile(&self, id: SandboxId, addresses: Vec<IpAddr>, policy: Policy) -> Sandbox {
        Sandbox {
            id,
            addresses: addresses.into_iter().map(canonical).collect(),
            policy: CompiledPolicy::new(policy, self.platform.clone()),
        }
    }
}

fn build(
    entries: Vec<(SandboxId, Vec<IpAddr>, Arc<Sandbox>)>,
) -> Result<Generation, RegistryError> {
    let mut snap = Generation::default();
    for (id, addrs, sandbox) in entries {
        for a in addrs {
            if let Some(owner) = snap.by_addr.get(&a) {
                return Err(if owner.id == id {
                    RegistryError::DuplicateAddress(id.to_string(), a)
                } else {
                    RegistryError::AddressInUse {
                        address: a,
                        owner: owner.id.to_string(),
                    }
                });
            }
            snap.by_addr.insert(a, sandbox.clone());
        }
        snap.by_id.insert(id, sandbox);
    }
    Ok(snap)
}

fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
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
            protocol: Protocol::Opaque,
            sni: None,
            host: None,
        };
        let verdict =
            crate::decide::judge(&sandbox.policy, &claims, &[], AttributionGap::NoDnsSeen);
        if verdict.is_deny() {
            Admit::Refused(sandbox.id.clone())
        } else {
            Admit::Allowed(sandbox.id.clone())
        }
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
        r.replace_all(vec![(
            SandboxId::new("c"),
            vec![ip("100.64.2.2")],
            Policy::default(),
        )])
        .expect("resync");
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
        assert_eq!(
            r.admit(ip("100.64.1.2"), g),
            Admit::Allowed(SandboxId::new("a"))
        );
        assert_eq!(
            r.admit(ip("100.64.1.3"), g),
            Admit::Refused(SandboxId::new("b"))
        );
        assert_eq!(r.admit(ip("100.64.1.4"), g), Admit::Unknown);
    }
}
