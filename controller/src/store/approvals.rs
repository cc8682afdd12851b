//! Statements for approvals (`approvals`, and the sandboxes one reaches):
//! the rows as typed [`Approval`]s, times as RFC 3339 text. The logic —
//! laying approvals over a sandbox's policy — is `crate::approvals`.

use egress_policy::Rule;
use serde_json::Value;
use sqlx::postgres::PgRow;
use sqlx::types::Json;
use sqlx::{PgConnection, PgPool, Row};

use crate::state::Scope;

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

/// A new approval, as the API records it.
pub struct NewApproval<'a> {
    pub id: &'a str,
    pub tenant: &'a str,
    pub scope: Scope,
    pub target: &'a str,
    pub rule: &'a Rule,
    pub principal: &'a str,
    pub until: Option<&'a str>,
    /// The request named its `until` (a time, or `null` for none). One
    /// that did not, for a rule approved in force until a time, is refused
    /// rather than lift that end ([`in_force_for`]).
    pub until_named: bool,
    pub evidence: &'a Value,
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

// === impl Approval ===

impl Approval {
    fn from_row(r: &PgRow) -> Result<Self, sqlx::Error> {
        let bad = |what: &str| sqlx::Error::Decode(format!("approval {what}").into());
        let scope: String = r.try_get("scope")?;
        let rule: Json<Value> = r.try_get("rule")?;
        Ok(Self {
            id: r.try_get("id")?,
            tenant: r.try_get("tenant")?,
            scope: scope.parse().map_err(|_| bad("scope"))?,
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

/// The sandboxes an approval of `tenant` for `scope` and `target` reaches:
/// every one not failed or destroyed, those still being created included.
/// A create that read the approvals in force holds its sandbox's row until
/// it commits, and [`crate::approvals::refresh`] waits for that row: so a
/// revoke or an expiry that runs meanwhile takes the approval out of the
/// policy the create saves, instead of missing a sandbox with no policy yet.
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
        "SELECT id FROM sandboxes WHERE tenant = $1 AND {which} \
         AND state NOT IN ('failed', 'destroyed') ORDER BY id"
    );
    sqlx::query_scalar(safe(sql))
        .bind(tenant)
        .bind(target)
        .fetch_all(conn)
        .await
}

/// Takes the lock on `a`'s tenant, scope, target and rule, held to the end
/// of the transaction: two approvals of one rule at once, each with its own
/// `until`, would otherwise each miss the other's new row, and both stay
/// in force. (Revokes and expiries do not take it: no wait goes the other
/// way round.)
pub async fn lock_rule(conn: &mut PgConnection, a: &NewApproval<'_>) -> Result<(), sqlx::Error> {
    let rule = serde_json::to_string(a.rule).unwrap_or_default();
    let key = format!("{}\n{}\n{}\n{rule}", a.tenant, a.scope.as_str(), a.target);
    sqlx::query("SELECT pg_advisory_xact_lock(7312, hashtext($1))")
        .bind(key)
        .execute(conn)
        .await?;
    Ok(())
}

/// The approvals of `a`'s tenant in force for the same scope, target and
/// rule, each with whether its `until` is `a`'s (`true` first): the one to
/// return as it is when approving again, or the ones a new approval
/// replaces.
pub async fn in_force_for(
    conn: &mut PgConnection,
    a: &NewApproval<'_>,
) -> Result<Vec<(Approval, bool)>, sqlx::Error> {
    let sql = format!(
        "SELECT {COLUMNS}, until IS NOT DISTINCT FROM $5::timestamptz AS same FROM approvals \
         WHERE tenant = $1 AND scope = $2 AND target = $3 AND rule = $4 AND {IN_FORCE} \
         ORDER BY same DESC, approved_at, id"
    );
    let rows = sqlx::query(safe(sql))
        .bind(a.tenant)
        .bind(a.scope.as_str())
        .bind(a.target)
        .bind(Json(a.rule))
        .bind(a.until)
        .fetch_all(conn)
        .await?;
    rows.iter()
        .map(|r| Ok((Approval::from_row(r)?, r.try_get("same")?)))
        .collect()
}

/// Revokes every approval of `a`'s tenant in force for the same scope,
/// target and rule (another `until`): a new one replaces them, so approving
/// a rule again cannot pile up rows for the expiry sweep to take out one
/// by one, each refreshing every sandbox it reaches. How many.
pub async fn supersede(conn: &mut PgConnection, a: &NewApproval<'_>) -> Result<u64, sqlx::Error> {
    let sql = format!(
        "UPDATE approvals SET revoked_at = now(), removed_at = now() \
         WHERE tenant = $1 AND scope = $2 AND target = $3 AND rule = $4 AND {IN_FORCE}"
    );
    let done = sqlx::query(safe(sql))
        .bind(a.tenant)
        .bind(a.scope.as_str())
        .bind(a.target)
        .bind(Json(a.rule))
        .execute(conn)
        .await?;
    Ok(done.rows_affected())
}

/// Records an approval; the row.
pub async fn insert(conn: &mut PgConnection, a: &NewApproval<'_>) -> Result<Approval, sqlx::Error> {
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
        .fetch_one(conn)
        .await?;
    Approval::from_row(&row)
}

/// The newest `limit` approvals of `tenant` (every tenant's for `None`),
/// newest first.
pub async fn list(
    pool: &PgPool,
    tenant: Option<&str>,
    limit: i64,
) -> Result<Vec<Approval>, sqlx::Error> {
    let sql = format!(
        "SELECT {COLUMNS} FROM approvals WHERE $1::text IS NULL OR tenant = $1 \
         ORDER BY approved_at DESC, id LIMIT $2"
    );
    let rows = sqlx::query(safe(sql))
        .bind(tenant)
        .bind(limit)
        .fetch_all(pool)
        .await?;
    rows.iter().map(Approval::from_row).collect()
}

/// Marks approval `id` of `tenant` (any tenant's for `None`) revoked and
/// removed; `None` when there is no such approval.
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
    let row = sqlx::query(safe(sql))
        .bind(id)
        .bind(tenant)
        .fetch_optional(conn)
        .await?;
    row.as_ref().map(Approval::from_row).transpose()
}

/// Marks removed one approval past its `until` that no other transaction
/// holds (`SKIP LOCKED`) and is not in `skip`: its id, and the approval
/// (its row's reading, which can fail on its own).
pub async fn expire_one(
    conn: &mut PgConnection,
    skip: &[String],
) -> Result<Option<(String, Result<Approval, sqlx::Error>)>, sqlx::Error> {
    let sql = format!(
        "UPDATE approvals SET removed_at = now() WHERE id = (SELECT id FROM approvals \
         WHERE removed_at IS NULL AND until <= now() AND id <> ALL($1) \
         ORDER BY until LIMIT 1 FOR UPDATE SKIP LOCKED) RETURNING {COLUMNS}"
    );
    let Some(row) = sqlx::query(safe(sql))
        .bind(skip)
        .fetch_optional(conn)
        .await?
    else {
        return Ok(None);
    };
    let id: String = row.try_get("id")?;
    Ok(Some((id, Approval::from_row(&row))))
}
