//! The snapshot of pushed state (write, fsync, rename): the compacted part
//! of the durable state, with the journal ([`crate::journal`]) holding the
//! changes since. Loaded at start before any flow is served, so a restart
//! enforces the last pushed policies with no window of open or closed traffic.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use egress_policy::SandboxId;
use serde::{Deserialize, Serialize};

use crate::registry::{Extras, Registry, Sandbox};

pub use egress_api::gateway::SandboxDoc;

/// The file name under `state_dir`.
pub const SNAPSHOT_FILE: &str = "snapshot.json";

/// The snapshot document.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotDoc {
    pub version: u32,
    /// The last journal sequence number this snapshot covers.
    #[serde(default)]
    pub seq: u64,
    pub sandboxes: Vec<SandboxDoc>,
}

impl From<&Sandbox> for SandboxDoc {
    fn from(s: &Sandbox) -> Self {
        Self {
            id: s.id.to_string(),
            addresses: s.addresses.clone(),
            policy: s.policy.policy().clone(),
            credentials: s.credentials.clone(),
            upstream_proxy: s.upstream_proxy.clone(),
            shadow: s.shadow.as_ref().map(|sh| Box::new(sh.doc())),
            revision: s.revision,
        }
    }
}

/// A sandbox's document as the state directory keeps it: without its
/// revision, which a build before revisions could not read back (a
/// rollback would not start). A restart forgets the revisions; the
/// controller's resync after it names them again.
pub(crate) fn stored(s: &Sandbox) -> SandboxDoc {
    SandboxDoc {
        revision: None,
        ..SandboxDoc::from(s)
    }
}

/// Compiles a pushed or persisted document for the registry (the id is
/// taken as it is: callers check it where it comes from outside).
pub fn prepare(doc: SandboxDoc, registry: &Registry) -> Arc<Sandbox> {
    registry.prepare_with(
        SandboxId::new(&doc.id),
        doc.addresses,
        doc.policy,
        Extras {
            credentials: doc.credentials,
            upstream_proxy: doc.upstream_proxy,
            shadow: doc.shadow.map(|b| *b),
            revision: doc.revision,
        },
    )
}

/// A recovered document as a push would take it now. An older build
/// accepted what a push refuses today: an address a push refuses is left
/// out (named in the log), so no flow from it is taken as the sandbox's; a
/// sandbox whose credentials a push refuses is left out whole, its traffic
/// denied until it is pushed again. Neither stops the start.
pub fn as_pushed_now(mut doc: SandboxDoc) -> Option<SandboxDoc> {
    doc.addresses.retain(|a| {
        let refused = egress_api::gateway::sandbox_addresses(std::slice::from_ref(a)).err();
        if let Some(why) = &refused {
            tracing::error!(sandbox = %doc.id, error = %why, "a recovered address is left out: a push refuses it");
        }
        refused.is_none()
    });
    match egress_api::gateway::credentials::validate(&doc.credentials) {
        Ok(()) => Some(doc),
        Err(why) => {
            tracing::error!(sandbox = %doc.id, error = %why, "a recovered sandbox is left out, its traffic denied: a push refuses its credentials");
            None
        }
    }
}

/// Why the snapshot could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: corrupt snapshot: {message}; fix or remove it (the gateway will not start with an empty policy set in its place)")]
    Corrupt { path: PathBuf, message: String },
    /// A journal record that is not a torn tail. Removing the journal would
    /// bring back what the snapshot had: sandboxes deleted since, older
    /// policies.
    #[error("{path}: corrupt journal: {message}. Do not remove the file: it holds the pushes acknowledged since the snapshot, and without it deleted sandboxes and older policies come back. Copy it aside, cut it at that offset (`truncate -s <offset>`), start, and have the controller resync this gateway")]
    CorruptJournal { path: PathBuf, message: String },
}

pub fn path(state_dir: &Path) -> PathBuf {
    state_dir.join(SNAPSHOT_FILE)
}

/// Reads the snapshot; `None` when there is none yet.
pub fn load(state_dir: &Path) -> Result<Option<SnapshotDoc>, PersistError> {
    let path = path(state_dir);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(PersistError::Io { path, source }),
    };
    let doc: SnapshotDoc = egress_policy::from_json(&text).map_err(|e| PersistError::Corrupt {
        path: path.clone(),
        message: e.to_string(),
    })?;
    if doc.version != 1 {
        return Err(PersistError::Corrupt {
            path,
            message: format!("version {} is not 1", doc.version),
        });
    }
    Ok(Some(doc))
}

/// The registry's state as a document, covering the journal up to `seq`.
pub fn document(registry: &Registry, seq: u64) -> SnapshotDoc {
    SnapshotDoc {
        version: 1,
        seq,
        sandboxes: registry.all().iter().map(|s| stored(s)).collect(),
    }
}

/// Writes the registry's state, covering the journal up to `seq`: a
/// temporary file, fsync, rename, fsync the directory. Returns its size.
pub fn save(state_dir: &Path, registry: &Registry, seq: u64) -> Result<u64, PersistError> {
    let path = path(state_dir);
    let io = |source| PersistError::Io {
        path: path.clone(),
        source,
    };
    let bytes = serde_json::to_vec(&document(registry, seq)).map_err(|e| io(e.into()))?;
    write_atomically(state_dir, SNAPSHOT_FILE, &bytes).map_err(io)?;
    Ok(bytes.len() as u64)
}

pub(crate) use egress_api::file::write_atomically;

/// Applies a loaded snapshot to the registry.
pub fn apply(
    registry: &Registry,
    doc: SnapshotDoc,
    state_dir: &Path,
) -> Result<usize, PersistError> {
    let n = doc.sandboxes.len();
    let prepared = doc
        .sandboxes
        .into_iter()
        .filter_map(as_pushed_now)
        .map(|d| prepare(d, registry))
        .collect();
    registry
        .replace_prepared(prepared)
        .map_err(|e| PersistError::Corrupt {
            path: path(state_dir),
            message: e.to_string(),
        })?;
    Ok(n)
}
