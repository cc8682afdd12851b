//! A template rollout's report: the reports of the sandboxes' gateways
//! (`GET /v1/sandboxes/{id}/shadow/report`, docs/api.md) merged into one.
//! Pure: the reports are fetched elsewhere.
//!
//! Differences are merged by destination and verdict pair: counts summed,
//! the earliest `first_seen` and the latest `last_seen` kept, and the
//! example of the earliest sighting (a gateway keeps its first example
//! too). Gateways write times as RFC 3339 in UTC (`Z`) with a varying
//! number of fraction digits, so times are compared on a key that pads the
//! fraction rather than as strings.
//!
//! A [`Rollup`] takes the reports one at a time, so the controller holds
//! one gateway's report and the merged entries, never every report at
//! once; at most [`MAX_MERGED`] entries are kept (a new destination and
//! verdict pair past that is counted in `left_out`).

use std::collections::BTreeMap;

use serde_json::{json, Value};

/// One merged entry.
struct Merged {
    destination: Value,
    active: Value,
    shadow: Value,
    count: u64,
    first_seen: String,
    last_seen: String,
    example: Value,
    sandboxes: u64,
}

/// A key ordering RFC 3339 UTC times: the seconds, then the fraction padded
/// to nanoseconds (`…:05Z` before `…:05.1Z`). Not a time: an unreadable
/// string sorts by its text.
fn time_key(ts: &str) -> (String, String) {
    let ts = ts.trim_end_matches('Z');
    match ts.split_once('.') {
        Some((secs, frac)) => (secs.to_owned(), format!("{frac:0<9}")),
        None => (ts.to_owned(), "0".repeat(9)),
    }
}

fn merge(into: &mut Merged, d: &Value) {
    into.count += d["count"].as_u64().unwrap_or(0);
    into.sandboxes += 1;
    let first = d["first_seen"].as_str().unwrap_or_default();
    if time_key(first) < time_key(&into.first_seen) {
        first.clone_into(&mut into.first_seen);
        into.example = d["example"].clone();
    }
    let last = d["last_seen"].as_str().unwrap_or_default();
    if time_key(last) > time_key(&into.last_seen) {
        last.clone_into(&mut into.last_seen);
    }
}

/// Merged entries kept at most, over a rollout's sandboxes (each gateway's
/// report holds at most 1,000).
pub const MAX_MERGED: usize = 10_000;

/// A rollout's reports merged as they come ([`Rollup::add`]).
#[derive(Default)]
pub struct Rollup {
    entries: BTreeMap<(String, String, String), Merged>,
    flows: u64,
    requests: u64,
    sandboxes: Vec<String>,
    /// Differences whose destination and verdict pair came past
    /// [`MAX_MERGED`], and those a gateway's report did not keep
    /// (its `evicted`): not kept.
    left_out: u64,
}

impl Rollup {
    /// Merges one sandbox's report (the gateway's document).
    pub fn add(&mut self, sandbox: String, r: &Value) {
        self.flows += r["flows"].as_u64().unwrap_or(0);
        self.requests += r["requests"].as_u64().unwrap_or(0);
        self.left_out += r["evicted"].as_u64().unwrap_or(0);
        self.sandboxes.push(sandbox);
        for d in r["differences"].as_array().into_iter().flatten() {
            let key = (
                d["destination"].to_string(),
                d["active"].to_string(),
                d["shadow"].to_string(),
            );
            if !self.entries.contains_key(&key) && self.entries.len() >= MAX_MERGED {
                self.left_out += 1;
                continue;
            }
            let e = self.entries.entry(key).or_insert_with(|| Merged {
                destination: d["destination"].clone(),
                active: d["active"].clone(),
                shadow: d["shadow"].clone(),
                count: 0,
                first_seen: d["first_seen"].as_str().unwrap_or_default().to_owned(),
                last_seen: d["last_seen"].as_str().unwrap_or_default().to_owned(),
                example: d["example"].clone(),
                sandboxes: 0,
            });
            merge(e, d);
        }
    }

    /// The merged report of `template`.
    pub fn finish(self, template: &str) -> Value {
        let left_out = self.left_out;
        let mut v = report(
            template,
            self.entries,
            (self.flows, self.requests),
            &self.sandboxes,
        );
        v["left_out"] = json!(left_out);
        v
    }
}

/// The document of merged `entries`.
fn report(
    template: &str,
    entries: BTreeMap<(String, String, String), Merged>,
    (flows, requests): (u64, u64),
    sandboxes: &[String],
) -> Value {
    let mut merged: Vec<Merged> = entries.into_values().collect();
    merged.sort_by_key(|m| std::cmp::Reverse(time_key(&m.last_seen)));
    let differences: Vec<Value> = merged
        .into_iter()
        .map(|m| {
            json!({
                "destination": m.destination, "active": m.active, "shadow": m.shadow,
                "count": m.count, "first_seen": m.first_seen, "last_seen": m.last_seen,
                "example": m.example, "sandboxes": m.sandboxes,
            })
        })
        .collect();
    json!({
        "template": template,
        "sandboxes": sandboxes,
        "flows": flows,
        "requests": requests,
        "differences": differences,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `reports` (sandbox id, the gateway's report document) merged for `template`.
    fn aggregate(template: &str, reports: &[(String, Value)]) -> Value {
        let mut rollup = Rollup::default();
        for (id, r) in reports {
            rollup.add(id.clone(), r);
        }
        rollup.finish(template)
    }

    fn diff(dest: &str, count: u64, first: &str, last: &str, n: u64) -> Value {
        json!({"destination": dest, "active": {"verdict": "deny", "reason": "no_allow_match"},
               "shadow": {"verdict": "allow", "reason": "allow_match"}, "count": count,
               "first_seen": first, "last_seen": last, "example": {"n": n}})
    }

    #[test]
    fn sums_counts_keeps_earliest_first_latest_last_and_one_example() {
        let a = json!({"flows": 3, "requests": 1, "differences": [
            diff("x.test", 2, "2026-01-01T00:00:05.5Z", "2026-01-01T00:00:09Z", 1),
            diff("y.test", 1, "2026-01-01T00:00:01Z", "2026-01-01T00:00:01Z", 2)]});
        let b = json!({"flows": 4, "requests": 0, "evicted": 6, "differences": [
            diff("x.test", 5, "2026-01-01T00:00:05Z", "2026-01-01T00:00:09.25Z", 3)]});
        let v = aggregate("base", &[("sb-a".into(), a), ("sb-b".into(), b)]);
        assert_eq!(v["left_out"], 6, "what a gateway's report did not keep");
        assert_eq!(v["flows"], 7);
        assert_eq!(v["requests"], 1);
        assert_eq!(v["sandboxes"], json!(["sb-a", "sb-b"]));
        let d = v["differences"].as_array().expect("list");
        assert_eq!(d.len(), 2);
        assert_eq!(
            d[0]["destination"], "x.test",
            "the most recently seen first"
        );
        assert_eq!(d[0]["count"], 7);
        assert_eq!(d[0]["first_seen"], "2026-01-01T00:00:05Z", "05 before 05.5");
        assert_eq!(d[0]["last_seen"], "2026-01-01T00:00:09.25Z");
        assert_eq!(d[0]["example"]["n"], 3, "the earliest sighting's example");
        assert_eq!(d[0]["sandboxes"], 2);
        assert_eq!(d[1]["count"], 1);
    }

    #[test]
    fn at_most_max_merged_entries_are_kept_and_the_rest_counted() {
        let many = |from: usize, n: usize| {
            let d: Vec<Value> = (from..from + n)
                .map(|i| {
                    diff(
                        &format!("n{i}.test"),
                        1,
                        "2026-01-01T00:00:01Z",
                        "2026-01-01T00:00:01Z",
                        1,
                    )
                })
                .collect();
            json!({"flows": n, "requests": 0, "differences": d})
        };
        let mut rollup = Rollup::default();
        rollup.add("sb-a".into(), &many(0, MAX_MERGED - 1));
        // One more new pair fits; an entry already kept still merges.
        rollup.add("sb-b".into(), &many(MAX_MERGED - 2, 5));
        let v = rollup.finish("base");
        assert_eq!(v["differences"].as_array().map(Vec::len), Some(MAX_MERGED));
        assert_eq!(v["left_out"], 3);
        assert_eq!(v["flows"], MAX_MERGED as u64 + 4);
    }

    #[test]
    fn different_verdict_pairs_stay_apart() {
        let mut other = diff(
            "x.test",
            1,
            "2026-01-01T00:00:01Z",
            "2026-01-01T00:00:01Z",
            9,
        );
        other["shadow"] = json!("unobservable");
        let a = json!({"flows": 1, "requests": 0, "differences": [
            diff("x.test", 1, "2026-01-01T00:00:01Z", "2026-01-01T00:00:01Z", 1), other]});
        let v = aggregate("base", &[("sb-a".into(), a)]);
        assert_eq!(v["differences"].as_array().map(Vec::len), Some(2));
    }
}
