//! Approvals: rules a gateway proposed from a sandbox's denials, approved
//! for a scope (the sandbox, its template within the tenant, or the whole
//! tenant) until revoked or until a time.
//!
//! An approval is laid over each sandbox it reaches the way composition is:
//! its rule is appended to `allow` (when not already there) and a
//! provenance entry names it (`{"source": "approval", "approval": <id>,
//! …}`). [`overlay`] is pure: it strips every rule an earlier overlay added
//! and adds those of the approvals in force now, so approving, revoking,
//! expiring, replacing a policy and creating a sandbox all converge on the
//! same policy. Each change of a sandbox's policy bumps its generation, and
//! the dispatcher pushes it like any other.

use egress_policy::{Policy, Rule};
use serde_json::{json, Value};
use sqlx::{PgConnection, PgPool};
use std::time::Duration;

pub use crate::state::Scope;
pub use crate::store::approvals::{in_force, Approval, NewApproval};
use crate::store::{self, Placement};

// === impl Approval ===

impl Approval {
    /// The API's document.
    pub fn document(&self) -> Value {
        json!({
            "id": self.id,
            "scope": self.scope,
            "target": self.target,
            "rule": self.rule,
            "principal": self.principal,
            "approved_at": self.approved_at,
            "until": self.until,
            "revoked_at": self.revoked_at,
            "removed_at": self.removed_at,
            "evidence": self.evidence,
        })
    }

    /// The rule as a sandbox's policy carries it: with the approval's
    /// `until`, so the gateway takes it out of force on time by itself
    /// (the controller's own sweep needs it running and the worker
    /// reachable).
    /// `None` when its `until` does not read as RFC 3339: pushed without
    /// it, the rule would never end on the gateway by itself, so it is not
    /// pushed at all (and said).
    fn pushed_rule(&self) -> Option<Rule> {
        let rfc3339 = time::format_description::well_known::Rfc3339;
        let until = match self.until.as_deref() {
            None => None,
            Some(u) => match time::OffsetDateTime::parse(u, &rfc3339) {
                Ok(t) => Some(t),
                Err(e) => {
                    tracing::error!(approval = %self.id, until = u, error = %e, "an approval's until does not read as RFC 3339: its rule is not laid over any sandbox");
                    return None;
                }
            },
        };
        Some(Rule {
            until,
            ..self.rule.clone()
        })
    }

    /// The provenance entry of the rule it added (`rule`: as pushed).
    fn provenance(&self, rule: &Rule) -> Value {
        json!({
            "list": "allow",
            "destination": self.rule.dest,
            "rule": rule,
            "source": "approval",
            "approval": self.id,
            "scope": self.scope,
            "principal": self.principal,
            "until": self.until,
        })
    }
}

/// Lays the approvals in force (`active`) over a sandbox's policy: takes out
/// the rules earlier overlays added (named in `provenance`), then appends
/// each active rule `allow` lacks, with its provenance entry. `true` when
/// the policy or its provenance changed.
pub fn overlay(policy: &mut Policy, provenance: &mut Vec<Value>, active: &[Approval]) -> bool {
    let before = (policy.allow.clone(), provenance.clone());
    let (added, kept): (Vec<Value>, Vec<Value>) = std::mem::take(provenance)
        .into_iter()
        .partition(|e| e.get("source") == Some(&json!("approval")));
    // Destinations whose added rule did not read: every entry for them is
    // out, and stays out (the entry is kept, marked `blocked`, whatever
    // build reads it next) until the policy is replaced; no approval is
    // laid over them meanwhile.
    let mut blocked = Vec::new();
    *provenance = kept;
    for mut entry in added {
        if let Some(dest) = strip_added(policy, &entry) {
            blocked.push(dest);
            entry["blocked"] = json!(true);
            provenance.push(entry);
        }
    }
    for a in active {
        let Some(rule) = a.pushed_rule() else {
            continue;
        };
        if blocked.iter().any(|b| overlaps(b, &rule.dest)) {
            continue;
        }
        // The tenant's own entry for the same destination covers it. For
        // a template or the tenant, any entry of the sandbox's own for the
        // destination decides, and so does one that the rule would lift
        // ([`lifts`]), in a sandbox the proposal did not come from. A
        // qualified rule (approved for a wider scope before that was
        // refused) is laid over none.
        let skip = match a.scope {
            Scope::Sandbox => policy.allow.contains(&a.rule) || policy.allow.contains(&rule),
            Scope::Template | Scope::Tenant if qualified(&rule) => {
                tracing::warn!(approval = %a.id, scope = a.scope.as_str(), "an approval of a rule qualified by http or streams for a template or the tenant is laid over no sandbox (approve it for its sandbox)");
                true
            }
            Scope::Template | Scope::Tenant => policy
                .allow
                .iter()
                .any(|r| r.dest == rule.dest || lifts(r, &rule.dest)),
        };
        if !skip {
            provenance.push(a.provenance(&rule));
            policy.allow.push(rule);
        }
    }
    before != (policy.allow.clone(), provenance.clone())
}

/// Takes out of `policy` the rule an earlier overlay added, named by its
/// provenance `entry`. One whose stored rule does not read as a rule (a
/// build that wrote it otherwise), or one already `blocked` so, is found by
/// its destination, returned: every entry for it goes, the sandbox's own
/// included, since a rule left in would let through what may have been
/// revoked (a replaced policy brings the sandbox's own back).
fn strip_added(policy: &mut Policy, entry: &Value) -> Option<egress_policy::Destination> {
    let rule = entry
        .get("rule")
        .filter(|_| entry.get("blocked") != Some(&json!(true)))
        .and_then(|r| serde_json::from_value::<Rule>(r.clone()).ok());
    if let Some(rule) = rule {
        if let Some(pos) = policy.allow.iter().position(|r| *r == rule) {
            policy.allow.remove(pos);
        }
        return None;
    }
    let dest = entry
        .get("destination")
        .and_then(|d| serde_json::from_value::<egress_policy::Destination>(d.clone()).ok());
    let approval = entry.get("approval").unwrap_or(&Value::Null);
    match dest {
        Some(dest) => {
            tracing::error!(%approval, destination = %dest.value(), "an approval's rule in a sandbox's provenance does not read: every allow entry for its destination is out until the sandbox's policy is replaced");
            policy.allow.retain(|r| r.dest != dest);
            Some(dest)
        }
        None => {
            tracing::error!(%approval, "an approval's rule and destination in a sandbox's provenance do not read: the rule it added stays until the sandbox's policy is replaced");
            None
        }
    }
}

/// Whether an entry limits which requests or streams it lets through.
fn qualified(rule: &Rule) -> bool {
    rule.http.is_some() || rule.streams.is_some()
}

/// Whether an open entry for `d` would lift what `own` restricts. Its
/// requests (`http`): where `own`'s level is at or above `d`'s for a name
/// (the most specific level decides a name's requests), so `own` for the
/// name or a wildcard over it. Its streams: wherever one flow can match
/// both (the sets of each kind fall through to wider entries), a name and
/// an address included, since a name may resolve to the address.
fn lifts(own: &Rule, d: &egress_policy::Destination) -> bool {
    let by_requests = own.http.is_some() && covers(&own.dest, d);
    let by_streams =
        own.streams.is_some() && (own.dest.is_name() != d.is_name() || overlaps(&own.dest, d));
    by_requests || by_streams
}

/// Whether every name `inner` matches, `outer` matches at the same level
/// or above it: the same name, or a wildcard over it (or over the
/// wildcard).
fn covers(outer: &egress_policy::Destination, inner: &egress_policy::Destination) -> bool {
    use egress_policy::Destination::{Domain, WildcardDomain};
    match (outer, inner) {
        (Domain(x), Domain(y)) => x == y,
        (WildcardDomain(w), Domain(n)) => w.matches(n),
        (WildcardDomain(x), WildcardDomain(y)) => x.suffix() == y.suffix() || x.matches(y.suffix()),
        _ => false,
    }
}

/// Whether one flow can match both an entry for `a` and one for `b` (by
/// name: the same name, a wildcard over it, nested wildcards; by address:
/// the same address, a range holding it, nested ranges).
fn overlaps(a: &egress_policy::Destination, b: &egress_policy::Destination) -> bool {
    use egress_policy::Destination::{Cidr, Domain, Ip, WildcardDomain};
    match (a, b) {
        (Domain(x), Domain(y)) => x == y,
        (Domain(n), WildcardDomain(w)) | (WildcardDomain(w), Domain(n)) => w.matches(n),
        (WildcardDomain(x), WildcardDomain(y)) => {
            x.suffix() == y.suffix() || x.matches(y.suffix()) || y.matches(x.suffix())
        }
        (Ip(x), Ip(y)) => x == y,
        (Ip(ip), Cidr(net)) | (Cidr(net), Ip(ip)) => net.contains(ip),
        (Cidr(x), Cidr(y)) => x.contains(&y.network()) || y.contains(&x.network()),
        _ => false,
    }
}

/// Lays the approvals in force over sandbox `id`'s saved policy and saves
/// it (a new generation, pushed by the dispatcher) when that changed it.
/// `Ok(Err(why))`, nothing saved, when the policy would then be larger than
/// a gateway takes (only an approval adds: taking one out never does).
/// `taking_out`: the approval being taken out, if one is.
pub async fn refresh(
    conn: &mut PgConnection,
    id: &str,
    taking_out: Option<&str>,
) -> Result<Result<bool, String>, sqlx::Error> {
    let Some(row) = store::sandbox_for_update(conn, id).await? else {
        return Ok(Ok(false));
    };
    let Some(mut policy) = row.policy.clone() else {
        // One a build of another version wrote, which this one cannot
        // read: if it holds the rule of the approval taken out, taking the
        // approval out would leave the rule in force, unsaid. The caller
        // fails then (a revoke is `503`, an expiry tried again), and a
        // replica that reads it does it. Otherwise it is left as it is.
        let holds = |a: &str| provenance_names(&row.provenance, a);
        return match (row.policy_unreadable, taking_out) {
            (Some(why), Some(a)) if holds(a) => Err(sqlx::Error::Decode(
                format!("sandbox {id}: its stored policy does not read in this build: {why}")
                    .into(),
            )),
            _ => Ok(Ok(false)),
        };
    };
    let mut provenance = match row.provenance {
        Value::Array(v) => v,
        _ => Vec::new(),
    };
    let active = in_force(conn, &row.tenant, &row.template, id).await?;
    if !overlay(&mut policy, &mut provenance, &active) {
        return Ok(Ok(false));
    }
    if let Some(why) = crate::compose::oversized(&policy, &row.addresses) {
        return Ok(Err(format!("sandbox {id}: {why}")));
    }
    let placement = Placement {
        policy: &policy,
        inherits_template: row.inherits_template,
        provenance: Value::Array(provenance),
        state: row.state,
        worker: None,
        addresses: &row.addresses,
    };
    store::save_effective(conn, id, &placement).await?;
    Ok(Ok(true))
}

/// Whether `provenance` has an entry added by approval `id`.
fn provenance_names(provenance: &Value, id: &str) -> bool {
    let added_by = |e: &Value| {
        e.get("source") == Some(&json!("approval")) && e.get("approval") == Some(&json!(id))
    };
    provenance
        .as_array()
        .is_some_and(|entries| entries.iter().any(added_by))
}

/// `eff` (a replacement just composed for `row`) with the approvals in
/// force laid over it: the policy and the provenance to save.
pub async fn laid_over(
    conn: &mut PgConnection,
    row: &store::SandboxRow,
    eff: &crate::compose::Effective,
) -> Result<(Policy, Value), sqlx::Error> {
    let mut policy = eff.policy.clone();
    let mut provenance: Vec<Value> = eff
        .provenance
        .iter()
        .filter_map(|a| serde_json::to_value(a).ok())
        .collect();
    let active = in_force(conn, &row.tenant, &row.template, &row.id).await?;
    overlay(&mut policy, &mut provenance, &active);
    Ok((policy, Value::Array(provenance)))
}

/// Why an approval was not recorded.
#[derive(Debug)]
pub enum NotApproved {
    /// A sandbox it reaches would then have a policy larger than a gateway
    /// takes (which would forget the sandbox, denying all its traffic).
    TooLarge(String),
    /// The rule is approved in force until a time, and the request named
    /// no `until`: approving it so would lift that end unsaid. The
    /// approval's id and its end.
    EndsInForce { id: String, until: String },
}

/// Records approval `a` and lays its rule over every sandbox it reaches;
/// the approval, and whether it is new. One in force for the same scope,
/// target, rule and `until` is returned as it is: approving again adds no row.
/// One with another `until` is revoked, replaced by this one (the latest
/// word on the rule wins), but an end in force is lifted only by a request
/// that names its `until` (`null` for none): a request without one, as the
/// console's Approve sends after a reload, is refused
/// ([`NotApproved::EndsInForce`]) rather than make a bounded approval
/// lasting.
/// `Ok(Err(_))`: nothing is approved, and the caller rolls the transaction
/// back.
pub async fn approve(
    conn: &mut PgConnection,
    a: &NewApproval<'_>,
) -> Result<Result<(Approval, bool), NotApproved>, sqlx::Error> {
    store::approvals::lock_rule(conn, a).await?;
    let mut in_force = store::approvals::in_force_for(conn, a)
        .await?
        .into_iter()
        .peekable();
    if let Some((same, _)) = in_force.next_if(|(_, same)| *same) {
        return Ok(Ok((same, false)));
    }
    let ended = in_force.find(|(e, _)| e.until.is_some());
    if let (false, Some((ended, _))) = (a.until_named, ended) {
        let until = ended.until.unwrap_or_default();
        return Ok(Err(NotApproved::EndsInForce {
            id: ended.id,
            until,
        }));
    }
    store::approvals::supersede(conn, a).await?;
    let approval = store::approvals::insert(conn, a).await?;
    store::lock_tenant(conn, a.tenant).await?;
    for id in store::approvals::reached(conn, a.tenant, a.scope, a.target).await? {
        if let Err(why) = refresh(conn, &id, None).await? {
            return Ok(Err(NotApproved::TooLarge(format!("not approved: {why}"))));
        }
    }
    Ok(Ok((approval, true)))
}

/// The approvals a listing shows at most, newest first.
pub const MAX_LISTED: i64 = 1_000;

/// The newest approvals of `tenant` (every tenant's for `None`), newest
/// first, and whether there are more than [`MAX_LISTED`].
pub async fn list(
    pool: &PgPool,
    tenant: Option<&str>,
) -> Result<(Vec<Approval>, bool), sqlx::Error> {
    let mut list = store::approvals::list(pool, tenant, MAX_LISTED + 1).await?;
    let more = list.len() as i64 > MAX_LISTED;
    list.truncate(MAX_LISTED as usize);
    Ok((list, more))
}

/// Revokes approval `id` of `tenant` (any tenant's for `None`) and takes its
/// rule out where it was added; `None` when there is no such approval.
pub async fn revoke(
    conn: &mut PgConnection,
    id: &str,
    tenant: Option<&str>,
) -> Result<Option<Approval>, sqlx::Error> {
    let Some(approval) = store::approvals::revoke(conn, id, tenant).await? else {
        return Ok(None);
    };
    take_out(conn, &approval).await?;
    Ok(Some(approval))
}

/// Most approvals one sweep expires (the next sweep, half a second later,
/// goes on).
const EXPIRE_PER_SWEEP: usize = 256;

/// How long an approval whose expiry failed is left out of the sweeps.
const EXPIRE_RETRY: Duration = Duration::from_secs(10);

/// Removes the approvals past their `until` from every sandbox they reach
/// (the dispatcher calls it periodically), each in a transaction of its
/// own: one that fails (a sandbox row locked past `lock_timeout`, a rule
/// that no longer reads) is logged, noted in `failed` and left out of the
/// sweeps for [`EXPIRE_RETRY`], and the others expire. No approval is
/// begun once `budget` has passed (the first always is): each may refresh
/// every sandbox of its tenant, and the dispatcher's round, its lease
/// renewals with it, waits for the sweep. (Without `failed`, one that
/// failed slowly would be the first of every sweep, and the only one.)
/// How many expired, and how many failed.
pub async fn expire(
    pool: &PgPool,
    budget: Duration,
    failed: &mut Vec<(String, std::time::Instant)>,
) -> Result<(usize, usize), sqlx::Error> {
    let started = std::time::Instant::now();
    failed.retain(|(_, at)| at.elapsed() < EXPIRE_RETRY);
    let mut skip: Vec<String> = failed.iter().map(|(id, _)| id.clone()).collect();
    let (mut expired, mut failures) = (0, 0);
    while expired + failures < EXPIRE_PER_SWEEP
        && (expired + failures == 0 || started.elapsed() < budget)
    {
        let mut tx = pool.begin().await?;
        let Some((id, approval)) = store::approvals::expire_one(&mut tx, &skip).await? else {
            break;
        };
        let taken = match approval {
            Ok(a) => take_out(&mut tx, &a).await,
            Err(e) => Err(e),
        };
        match taken {
            Ok(()) => {
                tx.commit().await?;
                expired += 1;
            }
            Err(error) => {
                drop(tx);
                tracing::warn!(approval = %id, %error, "an approval past its until could not be taken out; tried again in 10 s");
                failed.push((id.clone(), std::time::Instant::now()));
                skip.push(id);
                failures += 1;
            }
        }
    }
    Ok((expired, failures))
}

/// Refreshes every sandbox `a` reached, now that it is no longer in force:
/// under the tenant's lock, so a create that read `a` in force and has not
/// committed is waited for, and its sandbox refreshed too.
async fn take_out(conn: &mut PgConnection, a: &Approval) -> Result<(), sqlx::Error> {
    store::lock_tenant(conn, &a.tenant).await?;
    for id in store::approvals::reached(conn, &a.tenant, a.scope, &a.target).await? {
        // Taking a rule out makes no policy larger.
        if let Err(why) = refresh(conn, &id, Some(&a.id)).await? {
            tracing::error!(%why, "a sandbox's policy is larger than a gateway takes after an approval was taken out");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn approval(id: &str, rule: &str) -> Approval {
        Approval {
            id: id.into(),
            tenant: "t1".into(),
            scope: Scope::Sandbox,
            target: "sb".into(),
            rule: serde_json::from_str(rule).expect(rule),
            principal: "alice".into(),
            approved_at: String::new(),
            until: None,
            revoked_at: None,
            removed_at: None,
            evidence: Value::Null,
        }
    }

    /// An approval's rule goes out with its `until`, for the gateway to
    /// close it on time by itself; taken out as it went in.
    #[test]
    fn an_approved_rule_carries_its_until() {
        let mut policy = Policy::from_json(r#"{"allow": []}"#).expect("policy");
        let mut prov = Vec::new();
        let mut a = approval("ap-1", r#"{"domain": "new.test"}"#);
        a.until = Some("2999-01-01T10:00:00.123456+00:00".into());
        assert!(overlay(&mut policy, &mut prov, std::slice::from_ref(&a)));
        let pushed = serde_json::to_value(&policy.allow[0]).expect("ser");
        assert_eq!(
            pushed,
            json!({"domain": "new.test", "until": "2999-01-01T10:00:00.123456Z"})
        );
        assert_eq!(prov[0]["rule"], pushed);
        assert!(!overlay(&mut policy, &mut prov, &[a]), "idempotent");
        assert!(overlay(&mut policy, &mut prov, &[]));
        assert!(policy.allow.is_empty());
        // The tenant's own entry for it: nothing added.
        let mut policy =
            Policy::from_json(r#"{"allow": [{"domain": "new.test"}]}"#).expect("policy");
        let mut a = approval("ap-2", r#"{"domain": "new.test"}"#);
        a.until = Some("2999-01-01T10:00:00+00:00".into());
        assert!(!overlay(&mut policy, &mut Vec::new(), &[a]));
    }

    #[test]
    fn overlay_adds_once_names_the_approval_and_takes_out_only_its_own() {
        let mut policy =
            Policy::from_json(r#"{"allow": [{"domain": "kept.test"}]}"#).expect("policy");
        let mut prov = vec![json!({"source": "profile:sensor"})];
        let a = approval("ap-1", r#"{"domain": "new.test"}"#);
        let same = approval("ap-2", r#"{"domain": "kept.test"}"#);
        assert!(overlay(&mut policy, &mut prov, &[a.clone(), same]));
        assert_eq!(
            policy.allow.len(),
            2,
            "the tenant's own rule is not added twice"
        );
        assert_eq!(prov.len(), 2);
        assert_eq!(prov[1]["approval"], "ap-1");
        assert_eq!(prov[1]["source"], "approval");
        assert!(!overlay(&mut policy, &mut prov, &[a]), "idempotent");
        assert!(overlay(&mut policy, &mut prov, &[]));
        let left: Vec<String> = policy.allow.iter().map(|r| r.dest.value()).collect();
        assert_eq!(left, ["kept.test"]);
        assert_eq!(prov, [json!({"source": "profile:sensor"})]);
    }

    /// A provenance entry whose stored rule no longer reads as a rule (a
    /// build that wrote it otherwise) still takes out what it added: every
    /// entry for its destination, the sandbox's own included, and keeps
    /// them out (no wider approval laid over it either) until the policy
    /// is replaced, which brings the sandbox's own back.
    #[test]
    fn an_added_rule_whose_stored_form_does_not_read_keeps_its_destination_out() {
        let own =
            r#"{"allow": [{"domain": "kept.test"}, {"domain": "x.test", "http": "read_only"}]}"#;
        let mut policy = Policy::from_json(own).expect("policy");
        let mut prov = Vec::new();
        let mine = approval("ap-1", r#"{"domain": "x.test"}"#);
        assert!(overlay(&mut policy, &mut prov, &[mine]));
        assert_eq!(policy.allow.len(), 3);
        prov[0]["rule"] = json!("not a rule");
        // Revoked; a template approval of the destination is in force.
        let mut wider = approval("ap-2", r#"{"domain": "x.test"}"#);
        wider.scope = Scope::Template;
        let left = |p: &Policy| -> Vec<String> { p.allow.iter().map(|r| r.dest.value()).collect() };
        assert!(overlay(
            &mut policy,
            &mut prov,
            std::slice::from_ref(&wider)
        ));
        assert_eq!(left(&policy), ["kept.test"]);
        assert_eq!(prov.len(), 1, "the entry kept");
        assert!(
            !overlay(&mut policy, &mut prov, std::slice::from_ref(&wider)),
            "the same on the next refresh"
        );
        assert_eq!(left(&policy), ["kept.test"]);
        assert_eq!(prov[0]["blocked"], json!(true));
        // Read by a build that reads the rule: still blocked.
        prov[0]["rule"] = json!({"domain": "x.test"});
        overlay(&mut policy, &mut prov, std::slice::from_ref(&wider));
        assert_eq!(left(&policy), ["kept.test"], "a build that reads it");
        assert_eq!(prov.len(), 1);
        // Replaced: the sandbox's own entry back, and it keeps the wider
        // approval off.
        let mut policy = Policy::from_json(own).expect("policy");
        assert!(!overlay(&mut policy, &mut Vec::new(), &[wider]));
        assert_eq!(left(&policy), ["kept.test", "x.test"]);
    }

    /// For a template or the tenant, a sandbox's own entry for the
    /// destination decides, whatever it restricts: an open rule beside a
    /// `read_only` one would lift it. For the sandbox itself, the approved
    /// rule joins its entry (what the proposal asked for).
    #[test]
    fn a_wider_approval_leaves_a_sandboxs_own_entry_for_the_destination() {
        let own = r#"{"allow": [{"domain": "api.test", "http": "read_only"}]}"#;
        for (scope, added) in [
            (Scope::Tenant, false),
            (Scope::Template, false),
            (Scope::Sandbox, true),
        ] {
            let mut policy = Policy::from_json(own).expect("policy");
            let mut a = approval("ap-1", r#"{"domain": "api.test"}"#);
            a.scope = scope;
            assert_eq!(
                overlay(&mut policy, &mut Vec::new(), &[a]),
                added,
                "{scope:?}"
            );
            assert_eq!(policy.allow.len(), 1 + usize::from(added), "{scope:?}");
        }
        // A qualified entry of its own over the name (a read_only wildcard)
        // decides too: an open rule for the name would lift it. An open
        // wildcard does not; nor a qualified entry for another name.
        for (own, added) in [
            (
                r#"{"wildcard_domain": "*.test", "http": "read_only"}"#,
                false,
            ),
            // An address's streams: the name may resolve to it.
            (r#"{"cidr": "203.0.113.0/24", "streams": ["ssh"]}"#, false),
            (r#"{"wildcard_domain": "*.test"}"#, true),
            (r#"{"domain": "other.test", "http": "read_only"}"#, true),
        ] {
            let mut policy = Policy::from_json(&format!(r#"{{"allow": [{own}]}}"#)).expect(own);
            let mut a = approval("ap-4", r#"{"domain": "api.test"}"#);
            a.scope = Scope::Tenant;
            assert_eq!(overlay(&mut policy, &mut Vec::new(), &[a]), added, "{own}");
        }
        let mut policy =
            Policy::from_json(r#"{"allow": [{"cidr": "203.0.113.0/24", "streams": ["ssh"]}]}"#)
                .expect("policy");
        let mut a = approval("ap-5", r#"{"ip": "203.0.113.7"}"#);
        a.scope = Scope::Template;
        assert!(
            !overlay(&mut policy, &mut Vec::new(), &[a]),
            "a range over it"
        );
        // A narrower name's read_only entry keeps its own level: a
        // wildcard over it is laid over (it lifts nothing there).
        let mut policy =
            Policy::from_json(r#"{"allow": [{"domain": "api.test", "http": "read_only"}]}"#)
                .expect("policy");
        let mut a = approval("ap-7", r#"{"wildcard_domain": "*.test"}"#);
        a.scope = Scope::Tenant;
        assert!(
            overlay(&mut policy, &mut Vec::new(), &[a]),
            "a wider wildcard"
        );
        // A name's streams, and an approval of an address it may resolve to.
        let mut policy =
            Policy::from_json(r#"{"allow": [{"domain": "git.test", "streams": ["ssh"]}]}"#)
                .expect("policy");
        let mut a = approval("ap-8", r#"{"ip": "203.0.113.7"}"#);
        a.scope = Scope::Tenant;
        assert!(
            !overlay(&mut policy, &mut Vec::new(), &[a]),
            "a name's streams"
        );
        // A qualified rule approved for the tenant (before that was
        // refused) is laid over none.
        let mut policy = Policy::from_json(r#"{"allow": []}"#).expect("policy");
        let mut a = approval("ap-6", r#"{"domain": "api.test", "http": "read_only"}"#);
        a.scope = Scope::Tenant;
        assert!(!overlay(&mut policy, &mut Vec::new(), &[a]));
        // An until that does not read: nothing added (it would never end).
        let mut policy = Policy::from_json(r#"{"allow": []}"#).expect("policy");
        let mut a = approval("ap-3", r#"{"domain": "api.test"}"#);
        a.until = Some("2999-01-01 10:00:00".into());
        assert!(!overlay(&mut policy, &mut Vec::new(), &[a]));
        assert!(policy.allow.is_empty());
        // Where it has none, a tenant's approval is added.
        let mut policy = Policy::from_json(r#"{"allow": []}"#).expect("policy");
        let mut a = approval("ap-2", r#"{"domain": "api.test"}"#);
        a.scope = Scope::Tenant;
        assert!(overlay(&mut policy, &mut Vec::new(), &[a]));
    }
}
