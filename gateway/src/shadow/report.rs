//! A shadow's report: the flows and requests judged under the candidate,
//! and the differences by destination and verdict pair (count, first and
//! last seen, one example). Bounded: at most [`MAX_DIFFERENCES`] entries per
//! sandbox, and [`MAX_DIFFERENCES_PER_GATEWAY`] in all the gateway's
//! reports, the least recently seen of the report going first; what went
//! (or could not be kept) is counted as `evicted`, so a report that is not
//! whole says so. A sandbox that walks the whole address space cannot grow
//! the gateway's memory, nor can a tenant's shadows on many sandboxes. Time
//! is passed in, so the bound is tested without a clock.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex};

use serde_json::{json, Value};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

use super::{Judged, Outcome};

/// Entries (destination × verdict pair) a report keeps at most.
pub(crate) const MAX_DIFFERENCES: usize = 1_000;

/// Entries all of a gateway's reports keep at most (an entry is up to a
/// few KiB with its example): past it, a report's new difference takes the
/// place of its own least recently seen, or is counted only.
pub(crate) const MAX_DIFFERENCES_PER_GATEWAY: usize = 16_384;

/// Entries held by every report of the process.
static HELD: LazyLock<Arc<AtomicUsize>> = LazyLock::new(Arc::default);

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
    /// The entries held by every report this one is bounded with.
    held: Arc<AtomicUsize>,
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
        Self::held_in(HELD.clone())
    }
}

impl Drop for Report {
    fn drop(&mut self) {
        let d = self
            .differences
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.held.fetch_sub(d.entries.len(), Ordering::Relaxed);
    }
}

impl Report {
    /// A report whose entries count in `held` (the process's, but in tests).
    fn held_in(held: Arc<AtomicUsize>) -> Self {
        Self {
            flows: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
            started: OffsetDateTime::now_utc(),
            differences: Mutex::default(),
            held,
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
        let max = (MAX_DIFFERENCES, MAX_DIFFERENCES_PER_GATEWAY);
        self.note_bounded(destination, active, shadow, now, example, max);
    }

    fn note_bounded(
        &self,
        destination: String,
        active: Judged,
        shadow: Outcome,
        now: OffsetDateTime,
        example: impl FnOnce() -> Value,
        (max, max_held): (usize, usize),
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
        if let Some(e) = d.entries.get_mut(&key) {
            e.count += 1;
            e.last_seen = now;
            e.touched = touched;
            return;
        }
        if d.entries.len() >= max || self.held.load(Ordering::Relaxed) >= max_held {
            self.evicted.fetch_add(1, Ordering::Relaxed);
            // O(max) on a new entry past a bound only: a scan of 1,000 at most.
            let oldest = d.entries.iter().min_by_key(|(_, e)| e.touched);
            let Some(k) = oldest.map(|(k, _)| k.clone()) else {
                // Nothing of its own to give up: counted, not kept.
                return;
            };
            d.entries.remove(&k);
        } else {
            self.held.fetch_add(1, Ordering::Relaxed);
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
        let max = (3, usize::MAX);
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

    /// Every report's entries count toward one bound: a sandbox's report
    /// past it gives up its own least recently seen for a new difference,
    /// or (holding none) counts it only; a report dropped gives its
    /// entries back.
    #[test]
    fn bounded_across_reports() {
        let held = Arc::new(AtomicUsize::new(0));
        let deny = Outcome::Judged(DENY);
        let max = (3, 5);
        let note = |r: &Report, d: &str, t| {
            r.note_bounded(d.into(), ALLOW, deny, at(t), || json!({}), max)
        };
        let (a, b, c) = (
            Report::held_in(held.clone()),
            Report::held_in(held.clone()),
            Report::held_in(held.clone()),
        );
        for i in 0..3 {
            note(&a, &format!("a{i}"), i);
        }
        for i in 0..3 {
            note(&b, &format!("b{i}"), i);
        }
        assert_eq!(held.load(Ordering::Relaxed), 5, "b2 replaced b0");
        note(&c, "c0", 9);
        let count = |r: &Report, what: &str| r.json("s", "t")[what].clone();
        let rows = |r: &Report| count(r, "differences").as_array().map_or(0, Vec::len);
        assert_eq!((rows(&a), rows(&b), rows(&c)), (3, 2, 0));
        assert_eq!(
            (count(&b, "evicted"), count(&c, "evicted")),
            (json!(1), json!(1))
        );
        drop(a);
        assert_eq!(held.load(Ordering::Relaxed), 2, "a's entries given back");
        note(&c, "c1", 10);
        assert_eq!(rows(&c), 1);
    }
}
