//! `egress-replay --shadow CANDIDATE`: every decision of the flow log judged
//! again under a candidate policy, offline, by the gateway's own judge
//! (`egress_gateway::decide::judge`) on the evidence the line records (the
//! destination, SNI, `Host` and attributed names), and reported in the
//! shape of the gateway's shadow report (`GET …/shadow/report`): the
//! differences by destination and verdict pair with a count, first and
//! last seen (the lines' `ts`) and the first line as the example, plus how
//! many decisions did not change. The active side is the recorded verdict
//! and reason: what the gateway decided. No traffic is sent.
//!
//! A line is judged as the gateway judged its flow: by the protocol it
//! records (an older log without one: a line with an SNI or to port 443 is
//! TLS, one with a `Host` plain HTTP, anything else an unreadable stream);
//! a TLS flow by its ClientHello alone (the `Host` a line carries is its
//! last request's); the attribution's gap and ECH as its reason says.
//! Lines the policy never judged (refused before it: a peek that timed
//! out, an unknown sandbox, a malformed hello, or cut by a budget) are
//! counted apart, not compared. Requests are not in the log: a candidate's
//! per-request rules are not judged.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use egress_gateway::decide::{judge, Claims};
use egress_gateway::doh::DohNames;
use egress_gateway::not_judged_by_policy;
use egress_policy::{
    AttributionGap, CompiledPolicy, Hostname, PlatformDenies, Policy, Protocol, StreamProtocol,
};
use serde_json::{json, Value};

use super::Recorded;

/// One side's answer.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Judged {
    verdict: String,
    reason: String,
}

/// A difference: where, and the recorded and the candidate's answers.
type Key = (String, Judged, Judged);

struct Entry {
    count: u64,
    first_seen: Option<String>,
    last_seen: Option<String>,
    example: Value,
}

/// The candidate policy in `path`, compiled against the built-in platform denies.
pub(crate) fn candidate(path: &Path) -> Result<CompiledPolicy, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let policy = Policy::from_json(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(CompiledPolicy::new(
        policy,
        Arc::new(PlatformDenies::builtin()),
    ))
}

fn name(s: Option<&String>) -> Option<Hostname> {
    s.and_then(|s| s.parse().ok())
}

/// What the line's first bytes were, as it records them (or, in an older
/// log without `protocol`, as its fields suggest).
fn protocol(r: &Recorded, sni: bool, host: bool, dst: std::net::SocketAddr) -> Protocol {
    let stream = |n: &str| StreamProtocol::ALL.into_iter().find(|p| p.as_str() == n);
    match r.protocol.as_deref() {
        Some("tls") => Protocol::Tls,
        Some("http") => Protocol::Http,
        Some(other) => Protocol::Opaque(stream(other)),
        None if sni || dst.port() == 443 => Protocol::Tls,
        None if host => Protocol::Http,
        None => Protocol::Opaque(None),
    }
}

/// The candidate's answer to one recorded flow.
fn judged(policy: &CompiledPolicy, doh: &DohNames, r: &Recorded) -> Option<Judged> {
    let dst = r.dst?;
    let (sni, host) = (name(r.sni.as_ref()), name(r.host.as_ref()));
    let attributed: Vec<Hostname> = r.attributed.iter().filter_map(|n| n.parse().ok()).collect();
    let protocol = protocol(r, sni.is_some(), host.is_some(), dst);
    let reason = r.reason.as_deref().unwrap_or_default();
    let claims = Claims {
        dst,
        protocol,
        sni: sni.as_ref(),
        // A TLS flow is decided on its ClientHello: the `Host` its line
        // carries is its last request's.
        host: host.as_ref().filter(|_| protocol != Protocol::Tls),
        ech: reason == "ech",
    };
    let gap = match reason {
        "expired" => AttributionGap::Expired,
        "evicted" => AttributionGap::Evicted,
        _ if attributed.is_empty() => AttributionGap::NoDnsSeen,
        _ => AttributionGap::NoMatch,
    };
    let v = judge(policy, &claims, &attributed, gap, doh);
    Some(Judged {
        verdict: v.name().to_owned(),
        reason: v.code().to_owned(),
    })
}

/// The name (else the address) a difference is reported under, as the gateway does.
fn destination(r: &Recorded) -> String {
    r.sni
        .clone()
        .or_else(|| r.host.clone())
        .or_else(|| r.attributed.first().cloned())
        .or_else(|| r.dst.map(|d| d.ip().to_string()))
        .unwrap_or_default()
}

/// Differences a report keeps at most, as the gateway's own report.
const MAX_DIFFERENCES: usize = 1_000;

/// The report of `flows` under `policy`, for the sandbox `only` (every
/// line, if none).
pub(crate) fn report(policy: &CompiledPolicy, flows: &[Recorded], only: Option<&str>) -> Value {
    let doh = DohNames::new(&[]);
    let mut entries: HashMap<Key, Entry> = HashMap::new();
    let mut order = Vec::new();
    let (mut unchanged, mut partial, mut not_judged, mut others, mut left_out) = (0u64, 0, 0, 0, 0);
    for (i, r) in flows.iter().enumerate() {
        if only.is_some_and(|id| r.sandbox.as_deref() != Some(id)) {
            others += 1;
            continue;
        }
        // A line that lists only some of its names cannot be judged as the
        // gateway judged it: counted, not guessed.
        if r.attributed_left_out.is_some() {
            partial += 1;
            continue;
        }
        if not_judged_by_policy(r.reason.as_deref().unwrap_or_default()) {
            not_judged += 1;
            continue;
        }
        let active = Judged {
            verdict: r.verdict.clone(),
            reason: r.reason.clone().unwrap_or_default(),
        };
        let Some(shadow) = judged(policy, &doh, r) else {
            continue;
        };
        if shadow == active {
            unchanged += 1;
            continue;
        }
        let key = (destination(r), active, shadow);
        if !entries.contains_key(&key) && entries.len() >= MAX_DIFFERENCES {
            left_out += 1;
            continue;
        }
        let e = entries.entry(key.clone()).or_insert_with(|| {
            order.push(key);
            Entry {
                count: 0,
                first_seen: r.ts.clone(),
                last_seen: None,
                example: json!({"line": i + 1, "dst": r.dst, "sni": r.sni, "host": r.host,
                                "attributed": r.attributed, "ts": r.ts}),
            }
        });
        e.count += 1;
        e.last_seen.clone_from(&r.ts);
    }
    let differences = listed(&order, &entries);
    json!({
        "flows": flows.len(),
        "unchanged": unchanged,
        "partial": partial,
        "not_judged": not_judged,
        "other_sandboxes": others,
        "left_out": left_out,
        "differences": differences,
    })
}

/// Each difference kept, in the order first seen, as the report lists it.
fn listed(order: &[Key], entries: &HashMap<Key, Entry>) -> Vec<Value> {
    order
        .iter()
        .filter_map(|k| entries.get(k).map(|e| (k, e)))
        .map(|((destination, active, shadow), e)| {
            json!({
                "destination": destination,
                "active": {"verdict": active.verdict, "reason": active.reason},
                "shadow": {"verdict": shadow.verdict, "reason": shadow.reason},
                "count": e.count, "first_seen": e.first_seen, "last_seen": e.last_seen,
                "example": e.example,
            })
        })
        .collect()
}
