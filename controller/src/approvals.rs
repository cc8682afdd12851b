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
use serde::Serialize;
use serde_json::{json, Value};
use sqlx::postgres::PgRow;
use sqlx::types::Json;
use sqlx::{PgConnection, PgPool, Row};

use crate::store::{self, Placement};

/// What an approval reaches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    Sandbox,
    Template,
    Tenant,
}

/// One approval row.
#[derive(Clone, Debug, PartialEq)]
pub struct Approval {
    pub id: String,
    pub tenant: String,
    pub scope: Scope,
    pub target: String,
    pub rule: Rule,
    pub principal: String,
    pub approved_at: String,
    pub until: Option<String>,
    pub revoked_at: Option<String>,
    pub removed_at: Option<String>,
    pub evidence: Value,
}

/// The columns, times as RFC 3339 text.
const COLUMNS: &str = "id, tenant, scope, target, rule, principal, \
    to_json(approved_at) #>> '{}' AS approved_at, to_json(until) #>> '{}' AS until, \
    to_json(revoked_at) #>> '{}' AS revoked_at, to_json(removed_at) #>> '{}' AS removed_at, evidence";

/// In force: neither revoked nor removed, and not past `until`.
const IN_FORCE: &str =
    "removed_at IS NULL AND revoked_at IS NULL AND (until IS NULL OR until > now())";

/// A query built only from this module's constants and fixed fragments,
/// never from input (every value is bound).
fn safe(sql: String) -> sqlx::AssertSqlSafe<String> {
    sqlx::AssertSqlSafe(sql)
}

// === impl Scope ===

impl Scope {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Sandbox => "sandbox",
            Self::Template => "template",
            Self::Tenant => "tenant",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "sandbox" => Some(Self::Sandbox),
            "template" => Some(Self::Template),
            "tenant" => Some(Self::Tenant),
            _ => None,
        }
    }
}

// === impl Approval ===

impl Approval {
    fn from_row(r: &PgRow) -> Result<Self, sqlx::Error> {
        let bad = |what: &str| sqlx::Error::Decode(format!("approval {what}").into());
        let scope: String = r.try_get("scope")?;
        let rule: Json<Value> = r.try_get("rule")?;
        Ok(Self {
            id: r.try_get("id")?,
            tenant: r.try_get("tenant")?,
            scope: Scope::parse(&scope).ok_or_else(|| bad("scope"))?,
            target: r.try_get("target")?,
            rule: serde_json::from_value(rule.0).map_err(|_| bad("rule"))?,
            principal: r.try_get("principal")?,
            approved_at: r.try_get("approved_at")?,
            until: r.try_get("until")?,
            revoked_at: r.try_get("revoked_at")?,
            removed_at: r.try_get("removed_at")?,
            evidence: r.try_get::<Json<Value>, _>("evidence")?.0,
        })
    }

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

    /// The provenance entry of the rule it added.
    fn provenance(&self) -> Value {
        json!({
            "list": "allow",
            "destination": self.rule.dest,
            "rule": self.rule,
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
    for entry in added {
        let rule = entry
            .get("rule")
            .and_then(|r| serde_json::from_value::<Rule>(r.clone()).ok());
        if let Some(pos) = rule.and_then(|rule| policy.allow.iter().position(|r| *r == rule)) {
            policy.allow.remove(pos);
        }
    }
    *provenance = kept;
    for a in active {
        if !policy.allow.contains(&a.rule) {
            policy.allow.push(a.rule.clone());
            provenance.push(a.provenance());
        }
    }
    before != (policy.allow.clone(), provenance.clone())
}

/// The approvals in force for sandbox `id` of `tenant` made from `template`.
pub async fn in_force(
    conn: &mut PgConnection,
    tenant: &str,
    template: &str,
    id: &str,
) -> Result<Vec<Approval>, sqlx::Error> {
    let sql = format!(
        "SELECT {COLUMNS} FROM approvals WHERE tenant = $1 AND {IN_FORCE} AND \
         ((scope = 'sandbox' AND target = $3) OR (scope = 'template' AND target = $2) OR scope = 'tenant') \
         ORDER BY approved_at, id"
    );
    let rows = sqlx::query(safe(sql))
        .bind(tenant)
        .bind(template)
        .bind(id)
        .fetch_all(conn)
        .await?;
    rows.iter().map(Approval::from_row).collect()
}

/// Lays the approvals in force over sandbox `id`'s saved policy and saves
/// it (a new generation, pushed by the dispatcher) when that changed it.
pub async fn refresh(conn: &mut PgConnection, id: &str) -> Result<bool, sqlx::Error> {
    let Some(row) = store::sandbox_for_update(conn, id).await? else {
        return Ok(false);
    };
    let Some(mut policy) = row.policy.clone() else {
        return Ok(false);
    };
    let mut provenance = match row.provenance {
        Value::Array(v) => v,
        _ => Vec::new(),
    };
    let active = in_force(conn, &row.tenant, &row.template, id).await?;
    if !overlay(&mut policy, &mut provenance, &active) {
        return Ok(false);
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
    Ok(true)
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

/// The live sandboxes an approval of `tenant` for `scope` and `target` reaches.
pub async fn reached(
    conn: &mut PgConnection,
    tenant: &str,
    scope: Scope,
    target: &str,
) -> Result<Vec<String>, sqlx::Error> {
    let which = match scope {
        Scope::Sandbox => "id = $2",
        Scope::Template => "template = $2",
        Scope::Tenant => "$2 = $1",
    };
    let sql = format!(
        "SELECT id FROM sandboxes WHERE tenant = $1 AND {which} AND policy IS NOT NULL \
         AND state NOT IN ('creating', 'failed', 'destroyed') ORDER BY id"
    );
    sqlx::query_scalar(safe(sql))
        .bind(tenant)
        .bind(target)
        .fetch_all(conn)
        .await
}

/// A new approval, as the API records it.
pub struct NewApproval<'a> {
    pub id: &'a str,
    pub tenant: &'a str,
    pub scope: Scope,
    pub target: &'a str,
    pub rule: &'a Rule,
    pub principal: &'a str,
    pub until: Option<&'a str>,
    pub evidence: &'a Value,
}

/// Records an approval and lays it over every sandbox it reaches; the row.
pub async fn approve(
    conn: &mut PgConnection,
    a: &NewApproval<'_>,
) -> Result<Approval, sqlx::Error> {
    let sql = format!(
        "INSERT INTO approvals (id, tenant, scope, target, rule, principal, until, evidence) \
         VALUES ($1, $2, $3, $4, $5, $6, $7::timestamptz, $8) RETURNING {COLUMNS}"
    );
    let row = sqlx::query(safe(sql))
        .bind(a.id)
        .bind(a.tenant)
        .bind(a.scope.as_str())
        .bind(a.target)
        .bind(Json(a.rule))
        .bind(a.principal)
        .bind(a.until)
        .bind(Json(a.evidence))
        .fetch_one(&mut *conn)
        .await?;
    let approval = Approval::from_row(&row)?;
    for id in reached(conn, a.tenant, a.scope, a.target).await? {
        refresh(conn, &id).await?;
    }
    Ok(approval)
}

/// The approvals of `tenant` (every tenant's for `None`), newest first.
pub async fn list(pool: &PgPool, tenant: Option<&str>) -> Result<Vec<Approval>, sqlx::Error> {
    let sql = format!(
        "SELECT {COLUMNS} FROM approvals WHERE $1::text IS NULL OR tenant = $1 \
         ORDER BY approved_at DESC, id"
    );
    let rows = sqlx::query(safe(sql)).bind(tenant).fetch_all(pool).await?;
    rows.iter().map(Approval::from_row).collect()
}

/// Revokes approval `id` of `tenant` (any tenant's for `None`) and takes its
/// rule out where it was added; `None` when there is no such approval.
pub async fn revoke(
    conn: &mut PgConnection,
    id: &str,
    tenant: Option<&str>,
) -> Result<Option<Approval>, sqlx::Error> {
    let sql = format!(
        "UPDATE approvals SET revoked_at = COALESCE(revoked_at, now()), \
         removed_at = COALESCE(removed_at, now()) \
         WHERE id = $1 AND ($2::text IS NULL OR tenant = $2) RETURNING {COLUMNS}"
    );
    let Some(row) = sqlx::query(safe(sql))
        .bind(id)
        .bind(tenant)
        .fetch_optional(&mut *conn)
        .await?
    else {
        return Ok(None);
    };
    let approval = Approval::from_row(&row)?;
    take_out(conn, &approval).await?;
    Ok(Some(approval))
}

/// Removes the approvals past their `until` from every sandbox they reach
/// (the dispatcher calls it periodically); how many expired.
pub async fn expire(pool: &PgPool) -> Result<usize, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let sql = format!(
        "UPDATE approvals SET removed_at = now() WHERE id IN (SELECT id FROM approvals \
         WHERE removed_at IS NULL AND until <= now() FOR UPDATE SKIP LOCKED) RETURNING {COLUMNS}"
    );
    let rows = sqlx::query(safe(sql)).fetch_all(&mut *tx).await?;
    for row in &rows {
        take_out(&mut tx, &Approval::from_row(row)?).await?;
    }
    tx.commit().await?;
    Ok(rows.len())
}

/// Refreshes every sandbox `a` reached, now that it is no longer in force.
async fn take_out(conn: &mut PgConnection, a: &Approval) -> Result<(), sqlx::Error> {
    for id in reached(conn, &a.tenant, a.scope, &a.target).await? {
        refresh(conn, &id).await?;
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
}
