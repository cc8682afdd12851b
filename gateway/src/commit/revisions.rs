//! The writer's revisions: a push or a delete that names a revision (the
//! controller's generation of the sandbox) below the one the gateway
//! holds for that sandbox is stale, and refused. Arrival order
//! ([`crate::admin`]'s tickets) cannot tell it: a push held up on its way
//! (a controller whose lease lapsed while its call was in flight, a
//! gateway that stalled with the request unread) can arrive after a newer
//! one, and would put back a policy the sandbox no longer has.
//!
//! A live sandbox's revision is on its registration, in memory only: the
//! state directory keeps none, so a build from before revisions still
//! reads it (a rollback starts). After a restart or a handover nothing is
//! checked until the controller's resync (a new epoch has it resync)
//! names them again. A deleted sandbox's revision is kept here, for
//! [`KEPT`] and at most [`MAX_KEPT`] of them: a put of it below that
//! revision would register again a sandbox already deleted.
//!
//! `/readyz` says `revisions=1`: the controller names revisions only to a
//! gateway that says so, since one of an earlier build refuses a document
//! with the field (unknown fields are refused).

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use egress_policy::SandboxId;

/// How long a deleted sandbox's revision is kept: well past a
/// controller's lease (15 s by default) and its gateway timeout (5 s).
pub(crate) const KEPT: Duration = Duration::from_secs(600);

/// Deleted sandboxes' revisions kept at most; past it the oldest go.
pub(crate) const MAX_KEPT: usize = 65_536;

/// A change refused as stale: the revision held and the one it named.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stale {
    pub(crate) held: u64,
    pub(crate) named: u64,
}

/// Whether a change naming `named` is stale against `held`: only when both
/// are known. The same revision again is not (a push sent again).
pub(crate) fn stale(held: Option<u64>, named: Option<u64>) -> Option<Stale> {
    let (held, named) = (held?, named?);
    (named < held).then_some(Stale { held, named })
}

/// The revisions of the sandboxes deleted lately.
#[derive(Default)]
pub(crate) struct Deleted {
    by_id: HashMap<SandboxId, (u64, Instant)>,
    /// When each was noted, oldest first (an id noted again is here twice;
    /// only its last entry counts).
    order: VecDeque<(Instant, SandboxId)>,
}

impl Deleted {
    /// Notes that `id` was deleted at `revision` (the highest noted stays).
    pub(crate) fn note(&mut self, id: &SandboxId, revision: u64, now: Instant) {
        self.prune(now);
        let entry = self.by_id.entry(id.clone()).or_insert((revision, now));
        *entry = (entry.0.max(revision), now);
        self.order.push_back((now, id.clone()));
        while self.order.len() > MAX_KEPT {
            self.pop_oldest();
        }
    }

    /// The revision `id` was deleted at, if it was within [`KEPT`].
    pub(crate) fn revision(&mut self, id: &SandboxId, now: Instant) -> Option<u64> {
        self.prune(now);
        self.by_id.get(id).map(|e| e.0)
    }

    /// Forgets `id`: registered again (its registration holds its revision).
    pub(crate) fn forget(&mut self, id: &SandboxId) {
        self.by_id.remove(id);
    }

    fn prune(&mut self, now: Instant) {
        while self
            .order
            .front()
            .is_some_and(|(at, _)| now.saturating_duration_since(*at) >= KEPT)
        {
            self.pop_oldest();
        }
    }

    fn pop_oldest(&mut self) {
        let Some((at, id)) = self.order.pop_front() else {
            return;
        };
        // Only the id's last note removes it.
        if self.by_id.get(&id).is_some_and(|e| e.1 == at) {
            self.by_id.remove(&id);
        }
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.by_id.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_revision_below_the_one_held_is_stale() {
        assert_eq!(stale(Some(5), Some(4)), Some(Stale { held: 5, named: 4 }));
        assert_eq!(stale(Some(5), Some(5)), None, "the same push again");
        assert_eq!(stale(Some(5), Some(6)), None);
        assert_eq!(stale(None, Some(1)), None, "nothing held to compare");
        assert_eq!(stale(Some(5), None), None, "a push that names none");
    }

    #[test]
    fn a_deleted_revision_is_kept_for_a_while_and_a_bounded_number() {
        let (mut d, t0) = (Deleted::default(), Instant::now());
        let (a, b) = (SandboxId::new("a"), SandboxId::new("b"));
        d.note(&a, 7, t0);
        d.note(&a, 3, t0 + Duration::from_secs(1));
        assert_eq!(d.revision(&a, t0), Some(7), "the highest stays");
        d.note(&b, 1, t0 + Duration::from_secs(2));
        // a's first note expires, its second has not: still kept.
        let later = t0 + KEPT + Duration::from_millis(500);
        assert_eq!(d.revision(&a, later), Some(7));
        assert_eq!(d.revision(&a, t0 + KEPT + Duration::from_secs(1)), None);
        assert_eq!(d.revision(&b, t0 + KEPT + Duration::from_secs(1)), Some(1));
        d.forget(&b);
        assert_eq!(d.revision(&b, t0), None);
        // Bounded: the oldest go first.
        let mut d = Deleted::default();
        for i in 0..MAX_KEPT + 10 {
            d.note(&SandboxId::new(&format!("s{i}")), 1, t0);
        }
        assert_eq!(d.len(), MAX_KEPT);
        assert_eq!(d.revision(&SandboxId::new("s0"), t0), None);
        let last = SandboxId::new(&format!("s{}", MAX_KEPT + 9));
        assert_eq!(d.revision(&last, t0), Some(1));
    }
}
