//! Shadow policies: a candidate policy judged beside the active one. Every
//! flow and every request on a terminated flow is decided by the active
//! policy; where the sandbox has a shadow, the same evidence (attribution,
//! SNI, `Host`, method and path) is judged again under the candidate by the
//! same [`crate::decide::judge`], and a difference is counted
//! (`egress_shadow_diff_total`), written to the flow log and kept in the
//! sandbox's bounded [`Report`]. The shadow's answer never reaches the
//! enforcement: it is computed after the active verdict and only read.
//!
//! Where the candidate needs what the active flow cannot show (a spliced
//! flow whose requests a qualified entry or a credential of the candidate
//! would judge), the answer is [`Outcome::Unobservable`], never a guess.
//!
//! The shadow lives in its [`crate::registry::Sandbox`] and is persisted
//! with it (journal and snapshot); its report is in memory only and starts
//! again after a restart.

#[doc(hidden)]
pub mod bench;
mod report;

use std::sync::Arc;

use egress_policy::{CompiledPolicy, Hostname, Protocol, Verdict};
use serde::{Serialize, Serializer};
use serde_json::{json, Value};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use crate::decide::{judge, request_names, Claims, Decided};
use crate::doh::DohNames;
use crate::metrics::ShadowLabels;
use crate::proposed::EXAMPLE_NAMES;

pub(crate) use report::Report;

/// A sandbox's candidate policy, compiled, and what it has seen.
#[derive(Debug)]
pub struct Shadow {
    pub policy: Arc<CompiledPolicy>,
    /// RFC 3339, when the candidate was put.
    pub since: String,
    /// RFC 3339, when a push last changed the active policy under it: the
    /// report counts from then, and the candidate is not promoted.
    pub policy_changed: Option<String>,
    /// Shared with a copy compiled again when an entry lapsed
    /// ([`Shadow::recompiled`]): the report goes on.
    pub(crate) report: Arc<Report>,
}

pub use egress_api::gateway::ShadowDoc;

/// What judging under a shadow reads besides the policy (the dataplane's,
/// passed apart so this module needs no more of it).
pub(crate) struct Judge<'a> {
    pub(crate) doh: &'a DohNames,
    pub(crate) diffs: &'a Family<ShadowLabels, Counter>,
}

/// One side's answer: a verdict and its reason code (bounded sets both).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Judged {
    pub verdict: &'static str,
    pub reason: &'static str,
}

/// The candidate's answer for a flow or a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    Judged(Judged),
    /// The candidate would judge requests the active flow does not show.
    Unobservable,
}

// === impl Shadow ===

impl Shadow {
    pub(crate) fn new(
        policy: Arc<CompiledPolicy>,
        since: String,
        policy_changed: Option<String>,
    ) -> Self {
        Self {
            policy,
            since,
            policy_changed,
            report: Arc::default(),
        }
    }

    /// The same shadow over `policy` (its own candidate compiled again),
    /// its report carried on.
    pub(crate) fn recompiled(&self, policy: Arc<CompiledPolicy>) -> Self {
        Self {
            policy,
            since: self.since.clone(),
            policy_changed: self.policy_changed.clone(),
            report: self.report.clone(),
        }
    }

    /// The same candidate over a policy a push has just changed: a new
    /// report, and no promotion until it is put again.
    pub(crate) fn over_changed_policy(&self, policy: Arc<CompiledPolicy>) -> Self {
        Self::new(policy, self.since.clone(), Some(now()))
    }

    pub fn doc(&self) -> ShadowDoc {
        ShadowDoc {
            policy: self.policy.policy().clone(),
            since: self.since.clone(),
            policy_changed: self.policy_changed.clone(),
        }
    }

    /// The `GET …/shadow` document.
    pub(crate) fn json(&self, sandbox: &str) -> Value {
        let mut doc =
            json!({ "sandbox": sandbox, "policy": self.policy.policy(), "since": self.since });
        if let Some(changed) = &self.policy_changed {
            doc["policy_changed"] = json!(changed);
        }
        doc
    }

    /// The `GET …/shadow/report` document.
    pub(crate) fn report_json(&self, sandbox: &str) -> Value {
        let mut doc = self.report.json(sandbox, &self.since);
        if let Some(changed) = &self.policy_changed {
            doc["policy_changed"] = json!(changed);
        }
        doc
    }
}

/// Now, RFC 3339 UTC.
pub(crate) fn now() -> String {
    use time::format_description::well_known::Rfc3339;
    time::OffsetDateTime::now_utc()
        .format(&Rfc3339)
        .unwrap_or_default()
}

// === impl Outcome ===

impl Outcome {
    fn verdict(&self) -> &'static str {
        match self {
            Self::Judged(j) => j.verdict,
            Self::Unobservable => "unobservable",
        }
    }

    fn reason(&self) -> &'static str {
        match self {
            Self::Judged(j) => j.reason,
            Self::Unobservable => "request_rules",
        }
    }
}

impl Serialize for Outcome {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Judged(j) => j.serialize(s),
            Self::Unobservable => s.serialize_str("unobservable"),
        }
    }
}

impl Judged {
    pub(crate) fn of(v: &Verdict) -> Self {
        Self {
            verdict: v.name(),
            reason: v.code(),
        }
    }
}

/// Whether the gateway reads the requests of a flow so decided.
fn sees_requests(v: &Verdict, protocol: Protocol) -> bool {
    match v {
        Verdict::Intercept(..) => true,
        Verdict::Allow(_) => protocol == Protocol::Http,
        Verdict::Deny(_) | Verdict::Splice(..) => false,
    }
}

/// The name (else the address) a difference is reported under.
fn destination(claims: &Claims<'_>, attributed: &[Hostname]) -> String {
    match claims.sni.or(claims.host).or(attributed.first()) {
        Some(n) => n.to_string(),
        None => claims.dst.ip().to_string(),
    }
}

/// Judges a flow under the sandbox's candidate on the evidence the active
/// policy was judged on; counts and reports a difference. Returns the
/// candidate's answer for the flow log.
pub(crate) fn flow(
    j: &Judge<'_>,
    shadow: &Shadow,
    claims: &Claims<'_>,
    decided: &Decided,
    src: Option<std::net::SocketAddr>,
) -> Outcome {
    let names = decided.lookup.names();
    let candidate = judge(&shadow.policy, claims, &names, decided.lookup.gap(), j.doh);
    let hidden = !sees_requests(&decided.verdict, claims.protocol)
        && sees_requests(&candidate, claims.protocol)
        && shadow
            .policy
            .needs_requests_of(names.iter().chain(claims.sni).chain(claims.host));
    let outcome = if hidden {
        Outcome::Unobservable
    } else {
        Outcome::Judged(Judged::of(&candidate))
    };
    shadow.report.flow_seen();
    let active = Judged::of(&decided.verdict);
    if outcome != Outcome::Judged(active) {
        let example = || {
            json!({
                "src": src, "dst": claims.dst, "sni": claims.sni, "host": claims.host,
                "attributed": &names[..names.len().min(EXAMPLE_NAMES)],
                "protocol": claims.protocol.as_str(),
                "verdict": active.verdict, "reason": active.reason,
            })
        };
        differs(
            j,
            shadow,
            destination(claims, &names),
            active,
            outcome,
            example,
        );
    }
    outcome
}

/// One request as both policies see it.
pub(crate) struct Request<'a> {
    pub(crate) claims: Claims<'a>,
    pub(crate) tls: bool,
    pub(crate) attributed: &'a [Hostname],
    pub(crate) gap: egress_policy::AttributionGap,
    pub(crate) method: &'a str,
    /// The methods its overrides name ([`crate::decide::method_overrides`]).
    pub(crate) overrides: &'a [String],
    pub(crate) target: &'a str,
}

/// Judges a request under the candidate as the active path judged it (the
/// flow's rules with the request's name, then the per-request rules);
/// counts and reports a difference from `active`.
pub(crate) fn request(j: &Judge<'_>, shadow: &Shadow, req: &Request<'_>, active: Judged) {
    shadow.report.request_seen();
    let policy = &shadow.policy;
    let verdict = judge(policy, &req.claims, req.attributed, req.gap, j.doh);
    let candidate = if verdict.is_deny() {
        Judged::of(&verdict)
    } else {
        let names = request_names(req.tls, req.claims.host, req.attributed);
        let methods = (req.method, req.overrides);
        match crate::decide::judge_methods(policy, &names, methods, req.target)
            .0
            .deny
        {
            Some(d) => Judged {
                verdict: "deny",
                reason: d.code.as_str(),
            },
            None => allowed(&verdict),
        }
    };
    if candidate != active {
        let example = || {
            // Kept per difference: cut, as the flow log cuts it.
            let path: String = req
                .target
                .split('?')
                .next()
                .unwrap_or("")
                .chars()
                .take(256)
                .collect();
            json!({
                "dst": req.claims.dst, "sni": req.claims.sni, "host": req.claims.host,
                "attributed": &req.attributed[..req.attributed.len().min(EXAMPLE_NAMES)],
                "method": req.method.chars().take(egress_policy::http::MAX_METHOD_LEN).collect::<String>(), "path": path,
                "verdict": active.verdict, "reason": active.reason,
            })
        };
        let to = destination(&req.claims, req.attributed);
        differs(j, shadow, to, active, Outcome::Judged(candidate), example);
    }
}

/// A request let through: `allow`, with the code of the flow-level verdict
/// its name was judged on.
pub(crate) fn allowed(v: &Verdict) -> Judged {
    Judged {
        verdict: "allow",
        reason: v.code(),
    }
}

fn differs(
    j: &Judge<'_>,
    shadow: &Shadow,
    destination: String,
    active: Judged,
    outcome: Outcome,
    example: impl FnOnce() -> Value,
) {
    j.diffs
        .get_or_create(&ShadowLabels {
            active: active.verdict,
            shadow: outcome.verdict(),
            reason: outcome.reason(),
        })
        .inc();
    shadow.report.note(
        destination,
        active,
        outcome,
        time::OffsetDateTime::now_utc(),
        example,
    );
}
