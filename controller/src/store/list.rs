//! Read-only statements for the listing routes the console reads
//! (`GET /v1/sandboxes`, `/v1/workers`, `/v1/operations`): keyset pages of
//! sandboxes by id, counts by state, the workers with their push lag, the
//! queue and its failures. `migrations/0007_console.sql` adds the indexes
//! they need at 100,000 sandboxes.

use serde_json::{json, Value};
use sqlx::postgres::PgRow;
use sqlx::{PgPool, Row};

use crate::state::SandboxState;

/// Which sandboxes a page holds: every filter optional, `after` the last
/// id of the page before (keyset: pages stay correct while rows come and go).
#[derive(Clone, Debug, Default)]
pub struct SandboxFilter {
    pub tenant: Option<String>,
    pub state: Option<SandboxState>,
    pub worker: Option<String>,
    pub profile: Option<String>,
    pub after: Option<String>,
    pub limit: i64,
}

const WHERE: &str = "($1::text IS NULL OR tenant = $1) AND ($2::text IS NULL OR state = $2) \
     AND ($3::text IS NULL OR worker = $3) AND ($4::text IS NULL OR $4 = ANY (egress_profiles))";

/// One page of sandboxes in id order, as short documents.
pub async fn sandboxes(pool: &PgPool, f: &SandboxFilter) -> Result<Vec<Value>, sqlx::Error> {
    let sql = format!(
        "SELECT id, tenant, template, egress_profiles, state, worker, generation, pushed_generation, \
         created_at::text AS created_at FROM sandboxes WHERE {WHERE} \
         AND ($5::text IS NULL OR id > $5) ORDER BY id LIMIT $6"
    );
    let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(&f.tenant)
        .bind(f.state.map(SandboxState::as_str))
        .bind(&f.worker)
        .bind(&f.profile)
        .bind(&f.after)
        .bind(f.limit)
        .fetch_all(pool)
        .await?;
    rows.iter().map(summary).collect()
}

fn summary(r: &PgRow) -> Result<Value, sqlx::Error> {
    let generation: i64 = r.try_get("generation")?;
    let pushed: i64 = r.try_get("pushed_generation")?;
    Ok(json!({
        "id": r.try_get::<String, _>("id")?,
        "tenant": r.try_get::<String, _>("tenant")?,
        "template": r.try_get::<String, _>("template")?,
        "egress_profiles": r.try_get::<Vec<String>, _>("egress_profiles")?,
        "state": r.try_get::<String, _>("state")?,
        "worker": r.try_get::<Option<String>, _>("worker")?,
        "pushed": generation <= pushed,
        "created_at": r.try_get::<String, _>("created_at")?,
    }))
}

/// How many sandboxes the filter (without the cursor) matches, by state.
pub async fn sandbox_counts(pool: &PgPool, f: &SandboxFilter) -> Result<Value, sqlx::Error> {
    let sql = format!(
        "SELECT state, count(*) AS n FROM sandboxes WHERE {WHERE} GROUP BY state ORDER BY state"
    );
    let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(&f.tenant)
        .bind(f.state.map(SandboxState::as_str))
        .bind(&f.worker)
        .bind(&f.profile)
        .fetch_all(pool)
        .await?;
    let mut counts = serde_json::Map::new();
    let mut total = 0i64;
    for r in &rows {
        let n: i64 = r.try_get("n")?;
        total += n;
        counts.insert(r.try_get("state")?, json!(n));
    }
    Ok(json!({"total": total, "by_state": counts}))
}

/// A worker as the console shows it: no token, the push state of its sandboxes.
#[derive(Clone, Debug)]
pub struct WorkerStatus {
    pub id: String,
    pub admin_url: String,
    pub token: String,
    pub document: Value,
}

/// Every worker with its sandboxes, the changes its gateway has not
/// acknowledged, and the age of the oldest of them (push lag, s).
pub async fn workers(pool: &PgPool) -> Result<Vec<WorkerStatus>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT w.id, w.admin_url, w.token, w.pool, w.epoch, w.needs_resync, w.last_error, \
         w.updated_at::text AS seen_at, \
         count(s.id) FILTER (WHERE s.state <> 'destroyed') AS sandboxes, \
         count(s.id) FILTER (WHERE s.generation > s.pushed_generation) AS unpushed, \
         COALESCE(max(extract(epoch FROM now() - s.changed_at)) \
           FILTER (WHERE s.generation > s.pushed_generation), 0)::float8 AS push_lag_s \
         FROM workers w LEFT JOIN sandboxes s ON s.worker = w.id GROUP BY w.id ORDER BY w.id",
    )
    .fetch_all(pool)
    .await?;
    rows.iter().map(worker_status).collect()
}

fn worker_status(r: &PgRow) -> Result<WorkerStatus, sqlx::Error> {
    let id: String = r.try_get("id")?;
    let admin_url: String = r.try_get("admin_url")?;
    let document = json!({
        "id": id,
        "admin_url": admin_url,
        "pool": r.try_get::<String, _>("pool")?,
        "epoch": r.try_get::<Option<String>, _>("epoch")?,
        "needs_resync": r.try_get::<bool, _>("needs_resync")?,
        "last_error": r.try_get::<Option<String>, _>("last_error")?,
        "seen_at": r.try_get::<String, _>("seen_at")?,
        "sandboxes": r.try_get::<i64, _>("sandboxes")?,
        "unpushed": r.try_get::<i64, _>("unpushed")?,
        "push_lag_s": r.try_get::<f64, _>("push_lag_s")?,
    });
    Ok(WorkerStatus {
        id,
        admin_url,
        token: r.try_get("token")?,
        document,
    })
}

/// The queue as `tenant` (all tenants: `None`) sees it: operations by
/// state (queued, failed; one being run is still queued, its row locked),
/// the age of the oldest queued one, and
/// the most recent failures and retries with their errors.
pub async fn operations(
    pool: &PgPool,
    tenant: Option<&str>,
    limit: i64,
) -> Result<Value, sqlx::Error> {
    let counts = sqlx::query(
        "SELECT (SELECT count(*) FROM operations WHERE state = 'queued' AND ($1::text IS NULL OR tenant = $1)) AS queued, \
         (SELECT count(*) FROM operations WHERE state = 'failed' AND ($1::text IS NULL OR tenant = $1)) AS failed, \
         (SELECT COALESCE(max(extract(epoch FROM now() - created_at)), 0)::float8 FROM operations \
            WHERE state = 'queued' AND ($1::text IS NULL OR tenant = $1)) AS oldest_queued_s",
    )
    .bind(tenant)
    .fetch_one(pool)
    .await?;
    let rows = sqlx::query(
        "SELECT id, tenant, kind, sandbox, state, attempts, last_error, created_at::text AS created_at \
         FROM operations WHERE last_error IS NOT NULL AND state IN ('failed', 'queued') \
         AND ($1::text IS NULL OR tenant = $1) ORDER BY created_at DESC LIMIT $2",
    )
    .bind(tenant)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    let failures = rows.iter().map(failure).collect::<Result<Vec<_>, _>>()?;
    Ok(json!({
        "queued": counts.try_get::<i64, _>("queued")?,
        "failed": counts.try_get::<i64, _>("failed")?,
        "oldest_queued_s": counts.try_get::<f64, _>("oldest_queued_s")?,
        "failures": failures,
    }))
}

fn failure(r: &PgRow) -> Result<Value, sqlx::Error> {
    Ok(json!({
        "id": r.try_get::<String, _>("id")?,
        "tenant": r.try_get::<String, _>("tenant")?,
        "kind": r.try_get::<String, _>("kind")?,
        "sandbox": r.try_get::<String, _>("sandbox")?,
        "state": r.try_get::<String, _>("state")?,
        "attempts": r.try_get::<i32, _>("attempts")?,
        "error": r.try_get::<Option<String>, _>("last_error")?,
        "created_at": r.try_get::<String, _>("created_at")?,
    }))
}
