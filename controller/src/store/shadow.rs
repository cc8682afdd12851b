//! Statements for shadow policies (`migrations/0003_shadows.sql`): the
//! candidates as given, by sandbox and by template rollout, and the worker
//! gateway each sandbox's shadow lives on.

use egress_policy::Policy;
use serde_json::Value;
use sqlx::types::Json;
use sqlx::{PgConnection, Row};

use super::SandboxRow;

/// A sandbox whose shadow lives on a worker's gateway, and how to reach it.
#[derive(Clone, Debug)]
pub struct Target {
    pub sandbox: String,
    pub admin_url: String,
    pub token: String,
}

/// A sandbox's stored candidate, the template rollout that put it, and the
/// sandbox's saved effective policy when it was put (`None`: put before
/// that was kept).
#[derive(Clone, Debug)]
pub struct Stored {
    pub policy: Policy,
    pub template: Option<String>,
    pub base: Option<Value>,
}

/// The admin URL and token of a worker's gateway.
pub async fn gateway(
    conn: &mut PgConnection,
    worker: &str,
) -> Result<Option<(String, String)>, sqlx::Error> {
    let row = sqlx::query("SELECT admin_url, token FROM workers WHERE id = $1")
        .bind(worker)
        .fetch_optional(&mut *conn)
        .await?;
    row.map(|r| Ok((r.try_get("admin_url")?, r.try_get("token")?)))
        .transpose()
}

/// Keeps `policy` as the sandbox's candidate (replacing any), put by the
/// rollout of `template` if any, while the sandbox's saved effective policy
/// is `base`.
pub async fn put(
    conn: &mut PgConnection,
    sandbox: &str,
    (policy, template): (&Policy, Option<&str>),
    base: Option<&Policy>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO sandbox_shadows (sandbox, policy, template, base) VALUES ($1, $2, $3, $4) ON CONFLICT (sandbox) DO UPDATE SET policy = EXCLUDED.policy, template = EXCLUDED.template, base = EXCLUDED.base, created_at = now()",
    )
    .bind(sandbox)
    .bind(Json(serde_json::to_value(policy).unwrap_or_default()))
    .bind(template)
    .bind(base.and_then(|b| serde_json::to_value(b).ok()).map(Json))
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// A sandbox's stored candidate, if it has one.
pub async fn get(conn: &mut PgConnection, sandbox: &str) -> Result<Option<Stored>, sqlx::Error> {
    let row = sqlx::query("SELECT policy, template, base FROM sandbox_shadows WHERE sandbox = $1")
        .bind(sandbox)
        .fetch_optional(&mut *conn)
        .await?;
    let Some(r) = row else { return Ok(None) };
    let Json(v): Json<Value> = r.try_get("policy")?;
    let template: Option<String> = r.try_get("template")?;
    let base = r
        .try_get::<Option<Json<Value>>, _>("base")?
        .map(|Json(b)| b);
    // Stored only after it parsed: a row that no longer parses is no candidate.
    Ok(Policy::from_json(&v.to_string()).ok().map(|policy| Stored {
        policy,
        template,
        base,
    }))
}

/// Forgets a sandbox's candidate; whether there was one.
pub async fn delete(conn: &mut PgConnection, sandbox: &str) -> Result<bool, sqlx::Error> {
    let done = sqlx::query("DELETE FROM sandbox_shadows WHERE sandbox = $1")
        .bind(sandbox)
        .execute(&mut *conn)
        .await?;
    Ok(done.rows_affected() > 0)
}

/// Keeps `policy` as the template's candidate (replacing any).
pub async fn put_template(
    conn: &mut PgConnection,
    template: &str,
    policy: &Policy,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO template_shadows (template, policy) VALUES ($1, $2) ON CONFLICT (template) DO UPDATE SET policy = EXCLUDED.policy, created_at = now()",
    )
    .bind(template)
    .bind(Json(serde_json::to_value(policy).unwrap_or_default()))
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Whether the template has a rollout.
pub async fn template_exists(conn: &mut PgConnection, template: &str) -> Result<bool, sqlx::Error> {
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM template_shadows WHERE template = $1")
        .bind(template)
        .fetch_one(&mut *conn)
        .await?;
    Ok(n > 0)
}

/// Forgets a rollout (its sandboxes' rows go with it, by cascade).
pub async fn delete_template(conn: &mut PgConnection, template: &str) -> Result<bool, sqlx::Error> {
    let done = sqlx::query("DELETE FROM template_shadows WHERE template = $1")
        .bind(template)
        .execute(&mut *conn)
        .await?;
    Ok(done.rows_affected() > 0)
}

/// The running sandboxes that inherit `template` and are on a worker.
pub async fn inheriting(
    conn: &mut PgConnection,
    template: &str,
) -> Result<Vec<SandboxRow>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT id, tenant, template, egress_profiles, policy, inherits_template, provenance, state, worker, addresses, generation FROM sandboxes WHERE template = $1 AND inherits_template AND state = 'running' AND worker IS NOT NULL AND policy IS NOT NULL ORDER BY id",
    )
    .bind(template)
    .fetch_all(&mut *conn)
    .await?;
    rows.iter().map(SandboxRow::from_row).collect()
}

/// The sandboxes a rollout put its candidate on, with their gateways;
/// `inheriting`: only those that still inherit the template (a tenant's
/// own policy since is not the template's to judge).
pub async fn rollout(
    conn: &mut PgConnection,
    template: &str,
    inheriting: bool,
) -> Result<Vec<Target>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT s.id, w.admin_url, w.token FROM sandbox_shadows h JOIN sandboxes s ON s.id = h.sandbox JOIN workers w ON w.id = s.worker WHERE h.template = $1 AND (s.inherits_template OR NOT $2) ORDER BY s.id",
    )
    .bind(template)
    .bind(inheriting)
    .fetch_all(&mut *conn)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(Target {
                sandbox: r.try_get("id")?,
                admin_url: r.try_get("admin_url")?,
                token: r.try_get("token")?,
            })
        })
        .collect()
}
