//! What each sandbox's denials propose (`GET /v1/sandboxes/{id}/proposals`):
//! the flow stages and the per-request check hand every denial here, and
//! [`egress_policy::proposals`] merges them into proposed allow entries.
//!
//! Kept in memory only, per sandbox, bounded by
//! [`egress_policy::proposals::MAX_SEEN`] entries and over all sandboxes by
//! [`MAX_SEEN_PER_GATEWAY`] (the sandbox holding most gives up its least
//! recently seen entry); a sandbox's proposals go
//! with it (delete, resync) and a restart forgets them all. A denial whose
//! reason proposes nothing returns before the lock, so only the denials
//! worth keeping pay for it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Mutex, PoisonError};
use std::time::SystemTime;

use egress_policy::proposals::{
    Denial, DeniedRequest, Proposal, Proposals, MAX_SEEN_PER_GATEWAY, PROPOSED_REASONS,
};
use egress_policy::{Hostname, PlatformDenies, SandboxId};
use serde_json::{json, Value};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

/// Every sandbox's proposals.
#[derive(Debug, Default)]
pub(crate) struct Proposed {
    by_sandbox: Mutex<BySandbox>,
}

/// The sandboxes' proposals and the entries they hold together.
#[derive(Debug, Default)]
struct BySandbox {
    map: HashMap<SandboxId, Proposals>,
    entries: usize,
}

/// What a denial says, borrowed from the stage that denied it.
pub(crate) struct Seen<'a> {
    pub(crate) dst: SocketAddr,
    pub(crate) sni: Option<&'a Hostname>,
    pub(crate) host: Option<&'a Hostname>,
    pub(crate) attributed: &'a [Hostname],
    pub(crate) reason: &'static str,
}

/// Attributed names an example keeps (proposals and shadow reports).
pub(crate) const EXAMPLE_NAMES: usize = 4;

// === impl Proposed ===

impl Proposed {
    /// Records a denied flow or request of sandbox `id`, now, if `live`
    /// (asked under the lock [`Proposed::forget`] takes, so a flow judged
    /// before its sandbox was deleted does not bring its proposals back).
    pub(crate) fn record(
        &self,
        (id, live): (&SandboxId, impl FnOnce() -> bool),
        seen: Seen<'_>,
        request: Option<DeniedRequest>,
    ) {
        if !PROPOSED_REASONS.contains(&seen.reason) {
            return;
        }
        let denial = Denial {
            at: SystemTime::now(),
            dst: seen.dst,
            sni: seen.sni.cloned(),
            host: seen.host.cloned(),
            // Kept per example, and the sandbox chooses how many names
            // its address has: the first few (the first is what is proposed).
            attributed: seen
                .attributed
                .iter()
                .take(EXAMPLE_NAMES)
                .cloned()
                .collect(),
            reason: seen.reason,
            request,
        };
        let mut by_sandbox = self.lock();
        if live() {
            by_sandbox.record(id, denial, MAX_SEEN_PER_GATEWAY);
        }
    }

    /// Sandbox `id`'s proposals, most recently seen first, without what `allow` already covers and
    /// was denied only for an attribution gap ([`Proposals::list_except`]).
    pub(crate) fn list_except(
        &self,
        id: &SandboxId,
        platform: &PlatformDenies,
        allow: &[egress_policy::Rule],
    ) -> Vec<Proposal> {
        // A copy of the sandbox's entries, listed outside the lock every
        // denial's record takes.
        let held = self.lock().map.get(id).cloned();
        held.map(|p| p.list_except(platform, allow))
            .unwrap_or_default()
    }

    /// Forgets sandbox `id`'s proposals.
    pub(crate) fn forget(&self, id: &SandboxId) {
        let mut by_sandbox = self.lock();
        if let Some(p) = by_sandbox.map.remove(id) {
            by_sandbox.entries -= p.len();
        }
    }

    /// Keeps only the sandboxes `live` names (after a resync).
    pub(crate) fn retain(&self, live: impl Fn(&SandboxId) -> bool) {
        let mut by_sandbox = self.lock();
        by_sandbox.map.retain(|id, _| live(id));
        by_sandbox.entries = by_sandbox.map.values().map(Proposals::len).sum();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BySandbox> {
        self.by_sandbox
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

// === impl BySandbox ===

impl BySandbox {
    /// Records `denial` for `id`; past `cap` entries over all sandboxes,
    /// `id` gives up its oldest when it holds at least its average share
    /// (a scanner recording new keys pays at once, with no scan of every
    /// sandbox under the lock), else the sandbox holding most does.
    fn record(&mut self, id: &SandboxId, denial: Denial, cap: usize) {
        let proposals = self.map.entry(id.clone()).or_default();
        let before = proposals.len();
        proposals.record(denial);
        self.entries = self.entries + proposals.len() - before;
        if proposals.is_empty() {
            self.map.remove(id);
        }
        while self.entries > cap {
            let (n, entries) = (self.map.len(), self.entries);
            let own = self
                .map
                .get(id)
                .is_some_and(|p| p.len().saturating_mul(n) >= entries);
            let most = match own {
                true => self.map.get_mut(id),
                false => self.map.values_mut().max_by_key(|p| p.len()),
            };
            let Some(most) = most else {
                break;
            };
            most.evict();
            self.entries -= 1;
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// An example keeps the first few names of its address, however many
    /// the sandbox had attributed there; the first is what is proposed.
    #[test]
    fn an_example_keeps_a_few_names() {
        let names: Vec<Hostname> = (0..40)
            .map(|i| Hostname::parse(&format!("n{i}.test")).expect("name"))
            .collect();
        let proposed = Proposed::default();
        let id = SandboxId::new("a");
        let seen = || Seen {
            dst: "203.0.113.7:443".parse().expect("dst"),
            sni: None,
            host: None,
            attributed: &names,
            reason: "no_allow_match",
        };
        proposed.record((&id, || true), seen(), None);
        // A sandbox gone since its flow was judged proposes nothing.
        let gone = SandboxId::new("gone");
        proposed.record((&gone, || false), seen(), None);
        assert!(proposed
            .list_except(&gone, &PlatformDenies::builtin(), &[])
            .is_empty());
        let list = proposed.list_except(&id, &PlatformDenies::builtin(), &[]);
        let doc = document("a", &list);
        let p = &doc["proposals"][0];
        assert_eq!(p["rule"], json!({"domain": "n0.test"}), "{doc}");
        let example = &p["examples"][0];
        assert_eq!(
            example["attributed"].as_array().map(Vec::len),
            Some(EXAMPLE_NAMES),
            "{doc}"
        );
    }

    /// Past the gateway's bound, the sandbox holding most gives entries up
    /// (a scanner, not the quiet sandbox beside it), and the count follows
    /// a sandbox's removal.
    #[test]
    fn the_gateways_bound_takes_from_the_sandbox_holding_most() {
        let denial = |i: u32| Denial {
            at: SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(u64::from(i)),
            dst: SocketAddr::from(([203, 0, 113, (i % 200) as u8], 443)),
            sni: Some(Hostname::parse(&format!("n{i}.test")).expect("name")),
            host: None,
            attributed: Vec::new(),
            reason: "no_allow_match",
            request: None,
        };
        let (scanner, quiet) = (SandboxId::new("scanner"), SandboxId::new("quiet"));
        let mut all = BySandbox::default();
        all.record(&quiet, denial(0), 10);
        all.record(&quiet, denial(1), 10);
        for i in 2..40 {
            all.record(&scanner, denial(i), 10);
            assert!(all.entries <= 10, "{} entries", all.entries);
        }
        assert_eq!(all.map[&quiet].len(), 2, "the quiet sandbox keeps its own");
        assert_eq!(all.map[&scanner].len(), 8);
        let kept = all.map[&scanner].list(&PlatformDenies::builtin());
        let doc = document("scanner", &kept);
        assert_eq!(
            doc["proposals"][0]["rule"],
            json!({"domain": "n39.test"}),
            "{doc}"
        );
        assert!(
            kept.iter().all(|p| p.last_seen >= denial(32).at),
            "the newest are kept"
        );
        let proposed = Proposed::default();
        *proposed.lock() = all;
        proposed.forget(&scanner);
        assert_eq!(proposed.lock().entries, 2);
        proposed.retain(|_| false);
        assert_eq!(proposed.lock().entries, 0);
    }
}
