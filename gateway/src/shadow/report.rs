//! A shadow's report: the flows and requests judged under the candidate,
//! and the differences by destination and verdict pair (count, first and
//! last seen, one example). Bounded: at most [`MAX_DIFFERENCES`] entries per
//! sandbox, the least recently seen going first, so a sandbox that walks
//! the whole address space cannot grow the gateway's memory. Time is passed
//! in, so the bound is tested without a clock.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use serde_json::{json, Value};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

use super::{Judged, Outcome};

/// Entries (destination × verdict pair) a report keeps at most.
pub(crate) const MAX_DIFFERENCES: usize = 1_000;

#[derive(Debug, Default)]
pub(crate) struct Report {
    flows: AtomicU64,
    requests: AtomicU64,
    differences: Mutex<Differences>,
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

impl Report {
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
        self.note_bounded(destination, active, shadow, now, example, MAX_DIFFERENCES);
    }

    fn note_bounded(
        &self,
        destination: String,
        active: Judged,
        shadow: Outcome,
        now: OffsetDateTime,
        example: impl FnOnce() -> Value,
        max: usize,
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
        if d.entries.len() >= max {
            // O(max) on a new entry past the bound only: a rare scan of 1,000.
            let oldest = d.entries.iter().min_by_key(|(_, e)| e.touched);
            if let Some(k) = oldest.map(|(k, _)| k.clone()) {
                d.entries.remove(&k);
            }
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
            "flows": self.flows.load(Ordering::Relaxed),
            "requests": self.requests.load(Ordering::Relaxed),
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
        for i in 0..4 {
            r.note_bounded(format!("d{i}"), ALLOW, deny, at(i), || json!({}), 3);
        }
        // d1 seen again: d2 is now the least recently seen.
        r.note_bounded("d1".into(), ALLOW, deny, at(9), || json!({}), 3);
        r.note_bounded("d4".into(), ALLOW, deny, at(10), || json!({}), 3);
        let v = r.json("s", "t");
        let names: Vec<&str> = v["differences"]
            .as_array()
            .expect("list")
            .iter()
            .filter_map(|e| e["destination"].as_str())
            .collect();
        assert_eq!(names, ["d4", "d1", "d3"]);
    }
}
