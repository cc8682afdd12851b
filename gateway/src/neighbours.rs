//! What machine egress asks of the gateway ([`egress_machine::Neighbours`]):
//! the registry holds the addresses sandboxes and VMs claim (one owner
//! each), the attribution cache the names sandboxes resolved.

use std::net::IpAddr;
use std::sync::Arc;

use dns_attrib::AttributionCache;

use crate::registry::Registry;

/// Names shown with one observation, at most.
const MAX_NAMES: usize = 8;

/// The gateway's registry and attribution cache, for machine egress.
#[derive(Debug)]
pub(crate) struct Neighbours {
    pub(crate) registry: Arc<Registry>,
    pub(crate) cache: Arc<AttributionCache>,
}

impl egress_machine::Neighbours for Neighbours {
    fn claim_for_vm(&self, vm: &str, addresses: &[IpAddr]) -> Result<(), String> {
        self.registry
            .claim_for_vm(vm, addresses)
            .map_err(|e| e.to_string())
    }

    fn release_vm(&self, vm: &str) {
        self.registry.release_vm(vm);
    }

    /// Over every sandbox on this worker, in the order found, each name
    /// once, [`MAX_NAMES`] at most: a hint for the operator, never a decision.
    fn names_for(&self, addr: IpAddr) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        for sandbox in self.registry.ids() {
            let found = self.cache.names_for(&sandbox, addr);
            for n in found.names().iter() {
                let n = n.to_string();
                if !names.contains(&n) {
                    names.push(n);
                }
            }
            if names.len() >= MAX_NAMES {
                break;
            }
        }
        // A sandbox's names come whole: no more than MAX_NAMES of them.
        names.truncate(MAX_NAMES);
        names
    }
}
