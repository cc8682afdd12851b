//! The cgroups VMs are registered with, as the cgroup tree has them now
//! (`match = "cgroup"`).
//!
//! nft turns a cgroup path into the cgroup's inode when it loads a
//! transaction, and a dispatch element keeps that inode. A QEMU scope made
//! again under the same path (a restarted VM) is another cgroup, whose
//! packets no element matches: they would leave unjudged. So every
//! transaction rebuilds the dispatch maps whole from the cgroups the tree
//! has at that moment, leaving out a VM whose cgroup is not there (nft
//! refuses a path it cannot resolve, which would fail the whole
//! transaction), and the observer compares each VM's inode with the one it
//! was bound at and rebuilds the maps when one moved.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use crate::nft::rules::VmRules;

/// The inode each VM's cgroup was bound at, by VM id (a VM whose cgroup was
/// not in the tree is absent).
pub type Bound = BTreeMap<String, u64>;

/// The cgroup tree nft resolves paths in, as this gateway reads it.
#[derive(Clone, Debug)]
pub struct Tree {
    /// `machine_egress.cgroup_root` joined with `cgroup_prefix`.
    root: PathBuf,
}

impl Tree {
    pub fn new(root: PathBuf, prefix: &str) -> Self {
        let prefix = prefix.trim_matches('/');
        let root = match prefix {
            "" => root,
            prefix => root.join(prefix),
        };
        Self { root }
    }

    /// Where the tree is read (for messages).
    pub fn root(&self) -> &std::path::Path {
        &self.root
    }

    /// The inode of cgroup `path` (relative to the cgroup v2 root), or
    /// `None` when the tree has no such cgroup.
    pub fn inode(&self, path: &str) -> Option<u64> {
        let meta = std::fs::metadata(self.root.join(path.trim_matches('/'))).ok()?;
        meta.is_dir().then(|| meta.ino())
    }

    /// `vms` as nft can load them now: a VM whose cgroup is not in the tree
    /// has its cgroup left out (no dispatch element), and the inode every
    /// other one is bound at.
    pub fn bind<'a>(&self, vms: Vec<VmRules<'a>>) -> (Vec<VmRules<'a>>, Bound) {
        let mut bound = Bound::new();
        let vms = vms
            .into_iter()
            .map(|mut vm| {
                if let Some(path) = vm.cgroup {
                    match self.inode(path) {
                        Some(inode) => {
                            bound.insert(vm.id.to_owned(), inode);
                        }
                        None => vm.cgroup = None,
                    }
                }
                vm
            })
            .collect();
        (vms, bound)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use egress_policy::machine::MachineEgress;

    fn rules<'a>(id: &'a str, cgroup: &'a str, policy: &'a MachineEgress) -> VmRules<'a> {
        VmRules {
            id,
            addresses: &[],
            link: None,
            cgroup: Some(cgroup),
            policy,
        }
    }

    #[test]
    fn a_cgroup_made_again_is_bound_at_its_new_inode_and_a_missing_one_is_left_out() {
        let dir = tempfile::tempdir().expect("dir");
        let tree = Tree::new(dir.path().to_owned(), "unified");
        let scope = dir.path().join("unified/machine.slice/vm-q.scope");
        std::fs::create_dir_all(&scope).expect("scope");
        let policy: MachineEgress = serde_json::from_str(r#"{"mode": "loopback"}"#).expect("p");
        let vms = || {
            vec![
                rules("q", "machine.slice/vm-q.scope", &policy),
                rules("r", "/machine.slice/vm-r.scope/", &policy),
            ]
        };
        let (bound_vms, first) = tree.bind(vms());
        assert_eq!(bound_vms[0].cgroup, Some("machine.slice/vm-q.scope"));
        assert_eq!(bound_vms[1].cgroup, None, "r's scope is not in the tree");
        assert_eq!(first.keys().collect::<Vec<_>>(), ["q"]);

        // A placeholder keeps the old inode from being handed out again.
        let keep = dir.path().join("keep");
        std::fs::rename(&scope, &keep).expect("move");
        std::fs::create_dir(&scope).expect("made again");
        std::fs::create_dir(dir.path().join("unified/machine.slice/vm-r.scope")).expect("r");
        let (bound_vms, second) = tree.bind(vms());
        assert_ne!(first["q"], second["q"], "q's scope is another cgroup now");
        assert_eq!(bound_vms[1].cgroup, Some("/machine.slice/vm-r.scope/"));
        assert!(second.contains_key("r"));
        assert_eq!(tree.bind(vms()).1, second, "nothing moved since");
    }
}
