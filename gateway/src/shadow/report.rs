//! A shadow's report: the flows and requests judged under the candidate,
//! and the differences by destination and verdict pair (count, first and
//! last seen, one example). Bounded: each report keeps a share of
//! [`MAX_DIFFERENCES_PER_GATEWAY`] among the gateway's reports, no more than
//! [`MAX_DIFFERENCES`] and no fewer than [`MIN_SHARE`], its least recently
//! seen going first, and all of them together never more than that bound
//! (a report below its share when the others hold it counts what it cannot
//! keep; one past its share gives an entry back at each note); what went is counted as `evicted`, so a report that is not whole
//! says so. A sandbox that walks the whole address space cannot grow the
//! gateway's memory, nor can a tenant's shadows on many sandboxes. Time is
//! passed in, so the bound is tested without a clock.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex};

use serde_json::{json, Value};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

use super::{Judged, Outcome};

/// Entries (destination × verdict pair) a report keeps at most.
pub(crate) const MAX_DIFFERENCES: usize = 1_000;

/// Entries the gateway's reports share (an entry is up to a few KiB with
/// its example): each report keeps this divided by the reports there are.
pub(crate) const MAX_DIFFERENCES_PER_GATEWAY: usize = 16_384;

/// The entries a report may keep however many reports share the gateway's.
pub(crate) const MIN_SHARE: usize = 16;

/// The reports of the process, and the entries they hold.
static SHARED: LazyLock<Arc<Shared>> = LazyLock::new(Arc::default);

/// What the reports bounded together count.
#[derive(Debug, Default)]
struct Shared {
    /// Reports.
    live: AtomicUsize,
    /// Entries, in all of them: never past the gateway's bound.
    held: AtomicUsize,
}

#[derive(Debug)]
pub(crate) struct Report {
    flows: AtomicU64,
    requests: AtomicU64,
    /// Differences not kept: evicted by a bound, or never stored.
    evicted: AtomicU64,
    /// When this report began counting (a restart, or a push that changed
    /// the active policy, begins a new one).
    started: OffsetDateTime,
    differences: Mutex<Differences>,
    /// How many reports share the bound with this one (itself included).
    shared: Arc<Shared>,
}

#[derive(Debug, Default)]
struct Differences {
    entries: HashMap<Key, Entry>,
    /// Bumped at every note: orders entries by when they were last seen.
    clock: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    destination: String,
    active: Judged,
    shadow: Outcome,
}

#[derive(Debug)]
struct Entry {
    count: u64,
    first_seen: OffsetDateTime,
    last_seen: OffsetDateTime,
    touched: u64,
    example: Value,
}

// === impl Report ===

impl Default for Report {
    fn default() -> Self {
        Self::sharing_with(SHARED.clone())
    }
}

impl Drop for Report {
    fn drop(&mut self) {
        let d = self
            .differences
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.shared
            .held
            .fetch_sub(d.entries.len(), Ordering::Relaxed);
        self.shared.live.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Report {
    /// A report bounded with those of `shared` (the process's, but in
    /// tests).
    fn sharing_with(shared: Arc<Shared>) -> Self {
        shared.live.fetch_add(1, Ordering::Relaxed);
        Self {
            flows: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
            started: OffsetDateTime::now_utc(),
            differences: Mutex::default(),
            shared,
        }
    }

    pub(crate) fn flow_seen(&self) {
        self.flows.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn request_seen(&self) {
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one difference at `now`; the example is built only for a new entry.
    pub(crate) fn note(
        &self,
        destination: String,
        active: Judged,
        shadow: Outcome,
        now: OffsetDateTime,
        example: impl FnOnce() -> Value,
    ) {
        let bounds = (MAX_DIFFERENCES, MAX_DIFFERENCES_PER_GATEWAY, MIN_SHARE);
        self.note_bounded(destination, active, shadow, now, example, bounds);
    }

    fn note_bounded(
        &self,
        destination: String,
        active: Judged,
        shadow: Outcome,
        now: OffsetDateTime,
        example: impl FnOnce() -> Value,
        (max, max_shared, min): (usize, usize, usize),
    ) {
        let mut d = self
            .differences
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        d.clock += 1;
        let touched = d.clock;
        let key = Key {
            destination,
            active,
            shadow,
        };
        let share = self.share(max_shared, min.min(max)..=max);
        if let Some(e) = d.entries.get_mut(&key) {
            e.count += 1;
            e.last_seen = now;
            e.touched = touched;
            // Past its share (more reports came since), a report seeing
            // only what it holds gives one back at each note.
            if d.entries.len() > share {
                self.evict_oldest(&mut d);
            }
            return;
        }
        if !self.make_room(&mut d, share, max_shared) {
            return;
        }
        let entry = Entry {
            count: 1,
            first_seen: now,
            last_seen: now,
            touched,
            example: example(),
        };
        d.entries.insert(key, entry);
    }

    /// This report's share of `max_shared` among the reports, within
    /// `bounds`.
    fn share(&self, max_shared: usize, bounds: std::ops::RangeInclusive<usize>) -> usize {
        let reports = self.shared.live.load(Ordering::Relaxed).max(1);
        (max_shared / reports).clamp(*bounds.start(), *bounds.end())
    }

    /// Forgets the least recently seen entry (O(entries): 1,000 at most).
    fn evict_oldest(&self, d: &mut Differences) {
        let oldest = d.entries.iter().min_by_key(|(_, e)| e.touched);
        if let Some(k) = oldest.map(|(k, _)| k.clone()) {
            d.entries.remove(&k);
            self.evicted.fetch_add(1, Ordering::Relaxed);
            self.shared.held.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Room in `d` for a new entry, its place in the gateway's bound taken:
    /// at its `share`, the least recently seen goes for the new one; past
    /// it (more reports came since), two go, so the report gives back what
    /// the others' share needs as it goes on. `false`: below its share but
    /// the gateway's bound is reached (reports that filled before hold it):
    /// the difference is counted, not kept.
    fn make_room(&self, d: &mut Differences, share: usize, max_shared: usize) -> bool {
        let held = &self.shared.held;
        if d.entries.len() < share {
            // Taken in one step: reports noting at once never pass it.
            let took = held
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |h| {
                    (h < max_shared).then_some(h + 1)
                })
                .is_ok();
            if !took {
                self.evicted.fetch_add(1, Ordering::Relaxed);
            }
            return took;
        }
        for _ in 0..2 {
            if d.entries.len() < share {
                break;
            }
            self.evict_oldest(d);
        }
        held.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// The report document, the most recently seen first.
    pub(crate) fn json(&self, sandbox: &str, since: &str) -> Value {
        let d = self
            .differences
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut rows: Vec<(&Key, &Entry)> = d.entries.iter().collect();
        rows.sort_by_key(|(_, e)| std::cmp::Reverse(e.touched));
        let ts = |t: &OffsetDateTime| t.format(&Rfc3339).unwrap_or_default();
        let differences: Vec<Value> = rows
            .into_iter()
            .map(|(k, e)| {
                json!({
                    "destination": k.destination,
                    "active": k.active,
                    "shadow": k.shadow,
                    "count": e.count,
                    "first_seen": ts(&e.first_seen),
                    "last_seen": ts(&e.last_seen),
                    "example": e.example,
                })
            })
            .collect();
        json!({
            "sandbox": sandbox,
            "since": since,
            "counting_since": ts(&self.started),
            "flows": self.flows.load(Ordering::Relaxed),
            "requests": self.requests.load(Ordering::Relaxed),
            "evicted": self.evicted.load(Ordering::Relaxed),
            "differences": differences,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALLOW: Judged = Judged {
        verdict: "allow",
        reason: "allow_default",
    };
    const DENY: Judged = Judged {
        verdict: "deny",
        reason: "no_allow_match",
    };

    fn at(s: i64) -> OffsetDateTime {
        OffsetDateTime::UNIX_EPOCH + time::Duration::seconds(s)
    }

    #[test]
    fn counts_by_destination_and_pair_with_first_and_last_seen() {
        let r = Report::default();
        let deny = Outcome::Judged(DENY);
        r.note("a.example".into(), ALLOW, deny, at(1), || json!({"n": 1}));
        r.note("a.example".into(), ALLOW, deny, at(5), || json!({"n": 2}));
        r.note(
            "a.example".into(),
            ALLOW,
            Outcome::Unobservable,
            at(6),
            || json!({}),
        );
        let v = r.json("s", "t");
        let d = v["differences"].as_array().expect("list");
        assert_eq!(d.len(), 2);
        assert_eq!(d[0]["shadow"], "unobservable");
        assert_eq!(d[1]["count"], 2);
        assert_eq!(d[1]["first_seen"], "1970-01-01T00:00:01Z");
        assert_eq!(d[1]["last_seen"], "1970-01-01T00:00:05Z");
        assert_eq!(d[1]["example"]["n"], 1, "the first example is kept");
        assert_eq!(d[1]["shadow"]["verdict"], "deny");
    }

    #[test]
    fn bounded_the_least_recently_seen_going_first() {
        let r = Report::default();
        let deny = Outcome::Judged(DENY);
        let max = (3, usize::MAX, 1);
        for i in 0..4 {
            r.note_bounded(format!("d{i}"), ALLOW, deny, at(i), || json!({}), max);
        }
        // d1 seen again: d2 is now the least recently seen.
        r.note_bounded("d1".into(), ALLOW, deny, at(9), || json!({}), max);
        r.note_bounded("d4".into(), ALLOW, deny, at(10), || json!({}), max);
        let v = r.json("s", "t");
        assert_eq!(v["evicted"], 2, "d0 and d2 went");
        let names: Vec<&str> = v["differences"]
            .as_array()
            .expect("list")
            .iter()
            .filter_map(|e| e["destination"].as_str())
            .collect();
        assert_eq!(names, ["d4", "d1", "d3"]);
    }

    /// The reports share one bound: each keeps its share (no fewer than the
    /// floor), so a report that comes late still keeps its differences, and
    /// one that filled before gives its room back as it goes on; however
    /// many reports there are, all of them together hold no more than the
    /// bound.
    #[test]
    fn a_share_of_one_bound_for_each_report() {
        let shared = Arc::new(Shared::default());
        let deny = Outcome::Judged(DENY);
        let bounds = (10, 20, 2);
        let note = |r: &Report, d: String, t| {
            r.note_bounded(d, ALLOW, deny, at(t), || json!({}), bounds);
        };
        let rows = |r: &Report| {
            r.json("s", "t")["differences"]
                .as_array()
                .map_or(0, Vec::len)
        };
        let a = Report::sharing_with(shared.clone());
        let others: Vec<Report> = (0..3)
            .map(|_| Report::sharing_with(shared.clone()))
            .collect();
        for i in 0..8 {
            note(&a, format!("a{i}"), i);
        }
        assert_eq!(rows(&a), 5, "a share of 20 among 4");
        assert_eq!(a.json("s", "t")["evicted"], 3);
        let late: Vec<Report> = (0..6)
            .map(|_| Report::sharing_with(shared.clone()))
            .collect();
        note(&late[5], "late".into(), 9);
        assert_eq!(rows(&late[5]), 1, "a late report keeps its difference");
        note(&a, "a8".into(), 10);
        assert_eq!(rows(&a), 4, "past its share of 2, a gives back");
        drop(late);
        drop(others);
        for i in 9..20 {
            note(&a, format!("a{i}"), i);
        }
        assert_eq!(rows(&a), 10, "alone, up to its own bound");
        // A report past its share that sees only what it holds gives it
        // back as it goes on, so a later one finds room.
        let b = Report::sharing_with(shared.clone());
        for i in 0..10 {
            note(&b, format!("b{i}"), 40 + i);
        }
        assert_eq!(shared.held.load(Ordering::Relaxed), 20, "a and b fill it");
        let c = Report::sharing_with(shared.clone());
        note(&c, "c0".into(), 50);
        assert_eq!(rows(&c), 0, "the bound is held");
        for round in 0..4 {
            for i in 0..10 {
                note(&a, format!("a{}", 10 + i), 60 + round);
                note(&b, format!("b{i}"), 60 + round);
            }
        }
        note(&c, "c1".into(), 70);
        assert_eq!(rows(&c), 1, "a and b gave back what c's share needs");
        drop((b, c));
        // Many reports at the floor: together, never past the bound.
        let many: Vec<Report> = (0..40)
            .map(|_| Report::sharing_with(shared.clone()))
            .collect();
        for (i, r) in many.iter().enumerate() {
            for j in 0..3 {
                note(r, format!("m{i}-{j}"), 30);
            }
        }
        let total: usize = many.iter().map(rows).sum::<usize>() + rows(&a);
        assert!(total <= 20, "{total} entries past a bound of 20");
        assert_eq!(shared.held.load(Ordering::Relaxed), total);
        drop(many);
        drop(a);
        assert_eq!(shared.held.load(Ordering::Relaxed), 0, "given back");
    }
}
