//! The pushes of one sandbox apply in the order they arrived in.
//!
//! A push is checked and compiled before it is queued for the commit
//! thread, and that can be slow: a large policy, a credential read from a
//! slow mount. A client that gave up on such a push (the controller waits
//! 5 s) sends the sandbox's next change, which can be queued first; the
//! first push would then apply last, putting back a policy the sandbox no
//! longer has, or registering again one just deleted. So each push takes a
//! ticket as it arrives, and is queued only if no change of its sandbox
//! that arrived later was queued first; otherwise it is superseded, not
//! applied. A resync holds every sandbox's newest state: a push that
//! arrived before a resync that was queued first is superseded too, and a
//! resync is itself superseded by a push that arrived after it and was
//! queued first (the client resyncs again).

use std::collections::HashMap;
use std::sync::Mutex;

use egress_policy::SandboxId;

/// The tickets handed out, and what each sandbox's latest queued one is.
#[derive(Default)]
pub(crate) struct Arrivals {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// The last ticket handed out.
    last: u64,
    /// Each sandbox with a push between its arrival and its end: the latest
    /// ticket of it queued, and how many of its pushes are under way.
    /// Bounded by the pushes in flight.
    ids: HashMap<SandboxId, (u64, usize)>,
    /// The latest ticket of any one sandbox's push queued.
    any_queued: u64,
    /// The latest resync's ticket queued.
    resync_queued: u64,
}

/// A change that arrived before another, which was queued first.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Superseded;

/// One push's place in the order; it leaves when dropped.
pub(crate) struct Ticket<'a> {
    arrivals: &'a Arrivals,
    /// `None`: a resync.
    id: Option<SandboxId>,
    n: u64,
}

impl Arrivals {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The ticket of a push of `id`, arriving now.
    pub(crate) fn arrive(&self, id: &SandboxId) -> Ticket<'_> {
        let mut s = self.state();
        s.last += 1;
        let n = s.last;
        s.ids.entry(id.clone()).or_insert((0, 0)).1 += 1;
        Ticket {
            arrivals: self,
            id: Some(id.clone()),
            n,
        }
    }

    /// The ticket of a resync, arriving now.
    pub(crate) fn arrive_resync(&self) -> Ticket<'_> {
        let mut s = self.state();
        s.last += 1;
        Ticket {
            arrivals: self,
            id: None,
            n: s.last,
        }
    }
}

impl Ticket<'_> {
    /// Queues the change with `queue` unless a change that arrived later
    /// was queued first (checked and queued under one lock, so the commit
    /// thread sees the changes in the order this lets through).
    pub(crate) fn queue<T, E>(
        &self,
        queue: impl FnOnce() -> Result<T, E>,
    ) -> Result<Result<T, E>, Superseded> {
        let mut s = self.arrivals.state();
        let later = match &self.id {
            Some(id) => s.resync_queued > self.n || s.ids.get(id).is_some_and(|e| e.0 > self.n),
            None => s.any_queued > self.n || s.resync_queued > self.n,
        };
        if later {
            return Err(Superseded);
        }
        // Only a change the commit queue took counts as queued.
        let queued = match queue() {
            Ok(queued) => queued,
            Err(refused) => return Ok(Err(refused)),
        };
        match &self.id {
            Some(id) => {
                s.any_queued = s.any_queued.max(self.n);
                if let Some(e) = s.ids.get_mut(id) {
                    e.0 = e.0.max(self.n);
                }
            }
            None => s.resync_queued = s.resync_queued.max(self.n),
        }
        Ok(Ok(queued))
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        let Some(id) = &self.id else {
            return;
        };
        let mut s = self.arrivals.state();
        if let Some(e) = s.ids.get_mut(id) {
            e.1 -= 1;
            if e.1 == 0 {
                s.ids.remove(id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queued(t: &Ticket<'_>) -> Result<Result<(), ()>, Superseded> {
        t.queue(|| Ok(()))
    }

    #[test]
    fn a_push_overtaken_by_a_later_one_of_its_sandbox_is_superseded() {
        let a = Arrivals::default();
        let (sb, other) = (SandboxId::new("sb"), SandboxId::new("other"));
        let first = a.arrive(&sb);
        let beside = a.arrive(&other);
        let second = a.arrive(&sb);
        assert_eq!(queued(&second), Ok(Ok(())));
        assert_eq!(queued(&first), Err(Superseded));
        // Another sandbox's push is not in the way.
        assert_eq!(queued(&beside), Ok(Ok(())));
        // In order, both go.
        let (third, fourth) = (a.arrive(&sb), a.arrive(&sb));
        assert_eq!((queued(&third), queued(&fourth)), (Ok(Ok(())), Ok(Ok(()))));
    }

    #[test]
    fn a_push_the_commit_queue_refused_does_not_supersede_an_earlier_one() {
        let a = Arrivals::default();
        let sb = SandboxId::new("sb");
        let (first, second) = (a.arrive(&sb), a.arrive(&sb));
        assert_eq!(second.queue(|| Err::<(), _>("full")), Ok(Err("full")));
        assert_eq!(queued(&first), Ok(Ok(())));
    }

    #[test]
    fn a_resync_and_a_push_each_supersede_the_other_that_arrived_first() {
        let a = Arrivals::default();
        let sb = SandboxId::new("sb");
        let push = a.arrive(&sb);
        let resync = a.arrive_resync();
        assert_eq!(queued(&resync), Ok(Ok(())));
        assert_eq!(queued(&push), Err(Superseded));
        let resync = a.arrive_resync();
        let push = a.arrive(&sb);
        assert_eq!(queued(&push), Ok(Ok(())));
        assert_eq!(queued(&resync), Err(Superseded));
    }

    #[test]
    fn a_sandbox_is_forgotten_once_its_pushes_end() {
        let a = Arrivals::default();
        let sb = SandboxId::new("sb");
        let (first, second) = (a.arrive(&sb), a.arrive(&sb));
        assert_eq!(queued(&first), Ok(Ok(())));
        drop(first);
        assert_eq!(a.state().ids.len(), 1, "one still under way");
        drop(second);
        assert!(a.state().ids.is_empty());
    }
}
