//! What each sandbox's denials propose (`GET /v1/sandboxes/{id}/proposals`):
//! the flow stages and the per-request check hand every denial here, and
//! [`egress_policy::proposals`] merges them into proposed allow entries.
//!
//! Kept in memory only, per sandbox, bounded by
//! [`egress_policy::proposals::MAX_SEEN`] entries; a sandbox's proposals go
//! with it (delete, resync) and a restart forgets them all. A denial whose
//! reason proposes nothing returns before the lock, so only the denials
//! worth keeping pay for it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Mutex, PoisonError};
use std::time::SystemTime;

use egress_policy::proposals::{Denial, DeniedRequest, Proposal, Proposals, PROPOSED_REASONS};
use egress_policy::{Hostname, PlatformDenies, SandboxId};
use serde_json::{json, Value};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

/// Every sandbox's proposals.
#[derive(Debug, Default)]
pub(crate) struct Proposed {
    by_sandbox: Mutex<HashMap<SandboxId, Proposals>>,
}

/// What a denial says, borrowed from the stage that denied it.
pub(crate) struct Seen<'a> {
    pub(crate) dst: SocketAddr,
    pub(crate) sni: Option<&'a Hostname>,
    pub(crate) host: Option<&'a Hostname>,
    pub(crate) attributed: &'a [Hostname],
    pub(crate) reason: &'static str,
}

// === impl Proposed ===

impl Proposed {
    /// Records a denied flow or request of sandbox `id`, now.
    pub(crate) fn record(&self, id: &SandboxId, seen: Seen<'_>, request: Option<DeniedRequest>) {
        if !PROPOSED_REASONS.contains(&seen.reason) {
            return;
        }
        let denial = Denial {
            at: SystemTime::now(),
            dst: seen.dst,
            sni: seen.sni.cloned(),
            host: seen.host.cloned(),
            attributed: seen.attributed.to_vec(),
            reason: seen.reason,
            request,
        };
        self.lock().entry(id.clone()).or_default().record(denial);
    }

    /// The proposals of sandbox `id`, most recently seen first.
    pub(crate) fn list(&self, id: &SandboxId, platform: &PlatformDenies) -> Vec<Proposal> {
        self.lock()
            .get(id)
            .map(|p| p.list(platform))
            .unwrap_or_default()
    }

    /// Forgets sandbox `id`'s proposals.
    pub(crate) fn forget(&self, id: &SandboxId) {
        self.lock().remove(id);
    }

    /// Keeps only the sandboxes `live` names (after a resync).
    pub(crate) fn retain(&self, live: impl Fn(&SandboxId) -> bool) {
        self.lock().retain(|id, _| live(id));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SandboxId, Proposals>> {
        self.by_sandbox
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// The answer of `GET /v1/sandboxes/{id}/proposals`.
pub(crate) fn document(id: &str, list: &[Proposal]) -> Value {
    let proposals: Vec<Value> = list.iter().map(proposal_json).collect();
    json!({ "sandbox": id, "proposals": proposals })
}

fn proposal_json(p: &Proposal) -> Value {
    json!({
        "id": p.id,
        "rule": p.rule,
        "reasons": p.reasons,
        "count": p.count,
        "first_seen": rfc3339(p.first_seen),
        "last_seen": rfc3339(p.last_seen),
        "examples": p.examples.iter().map(example_json).collect::<Vec<_>>(),
    })
}

/// An example, in the flow log's words.
fn example_json(d: &Denial) -> Value {
    let mut v = json!({
        "ts": rfc3339(d.at),
        "dst": d.dst,
        "sni": d.sni.as_ref().map(Hostname::as_str),
        "host": d.host.as_ref().map(Hostname::as_str),
        "attributed": d.attributed.iter().map(Hostname::as_str).collect::<Vec<_>>(),
        "verdict": "deny",
        "reason": d.reason,
    });
    if let (Some(r), Some(obj)) = (&d.request, v.as_object_mut()) {
        obj.insert("method".into(), r.method.clone().into());
        obj.insert("path".into(), r.path.clone().into());
    }
    v
}

fn rfc3339(t: SystemTime) -> String {
    OffsetDateTime::from(t).format(&Rfc3339).unwrap_or_default()
}
