//! Statements for warm pools (`migrations/0006_warm_pools.sql`): a
//! template's pool size, the pooled sandboxes (tenant `''`, `warm_pool` =
//! the template) the dispatcher creates ahead of time, and the claim that
//! hands one to a tenant.

use sqlx::{PgConnection, PgPool, Row};

/// Sets (or, with 0, empties) a template's pool size. `false`: the
/// template is not registered.
pub async fn put_size(pool: &PgPool, template: &str, size: i32) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "INSERT INTO template_pools (template, size) SELECT id, $2 FROM templates WHERE id = $1 \
         ON CONFLICT (template) DO UPDATE SET size = EXCLUDED.size, updated_at = now()",
    )
    .bind(template)
    .bind(size)
    .execute(pool)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// A template's pool: its size, how many sandboxes are ready to claim and
/// how many are still being created.
pub async fn status(pool: &PgPool, template: &str) -> Result<Option<(i32, i64, i64)>, sqlx::Error> {
    let row = sqlx::query(
        "SELECT p.size, \
         (SELECT count(*) FROM sandboxes s WHERE s.warm_pool = p.template AND s.state = 'running' AND s.pushed_generation >= s.generation) AS ready, \
         (SELECT count(*) FROM sandboxes s WHERE s.warm_pool = p.template AND (s.state = 'creating' OR (s.state = 'running' AND s.pushed_generation < s.generation))) AS warming \
         FROM template_pools p WHERE p.template = $1",
    )
    .bind(template)
    .fetch_optional(pool)
    .await?;
    row.map(|r| {
        Ok((
            r.try_get("size")?,
            r.try_get("ready")?,
            r.try_get("warming")?,
        ))
    })
    .transpose()
}

/// What a claim hands over: the tenant, the admitted names, whether the
/// sandbox keeps inheriting its template, and the worker asked for.
pub struct Claim<'a> {
    pub template: &'a str,
    pub tenant: &'a str,
    pub egress_profiles: &'a [String],
    pub inherits_template: bool,
    pub worker: Option<&'a str>,
}

/// Takes one ready pooled sandbox of the template (on the worker asked
/// for, if any) for the claim's tenant: `creating` until the queued claim
/// composes its policy. Concurrent claims skip each other's locked rows
/// (`FOR UPDATE SKIP LOCKED`), so no two get the same sandbox. `None`: the
/// pool is empty. The pooled policy is taken away at once (its gateway is
/// told to forget the sandbox): until the claim's own policy is pushed the
/// sandbox is unknown there, so denied, never judged by a policy its new
/// tenant did not ask for.
pub async fn claim(conn: &mut PgConnection, c: &Claim<'_>) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar(
        "UPDATE sandboxes SET tenant = $2, egress_profiles = $3, inherits_template = $4, warm_pool = NULL, state = 'creating', \
         policy = NULL, generation = generation + 1 \
         WHERE id = (SELECT id FROM sandboxes WHERE warm_pool = $1 AND state = 'running' AND pushed_generation >= generation \
         AND ($5::text IS NULL OR worker = $5) ORDER BY created_at LIMIT 1 FOR UPDATE SKIP LOCKED) RETURNING id",
    )
    .bind(c.template)
    .bind(c.tenant)
    .bind(c.egress_profiles)
    .bind(c.inherits_template)
    .bind(c.worker)
    .fetch_optional(&mut *conn)
    .await
}

/// How long a pooled sandbox whose create failed keeps its place in the
/// pool: a pool that cannot be filled (no worker, no free address, a
/// policy a gateway refuses) is tried again at this pace, not at every
/// round.
pub const FAILED_HOLDS_ITS_PLACE_SECS: i64 = 60;

/// Each pool's shortfall: (template, sandboxes to create), for pools with
/// fewer unclaimed sandboxes (creating or running, or failed in the last
/// [`FAILED_HOLDS_ITS_PLACE_SECS`]) than their size.
pub async fn shortfalls(conn: &mut PgConnection) -> Result<Vec<(String, i64)>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT p.template, p.size - (SELECT count(*) FROM sandboxes s WHERE s.warm_pool = p.template AND (s.state IN ('creating', 'running') \
         OR (s.state = 'failed' AND s.changed_at > now() - make_interval(secs => $1)))) AS missing \
         FROM template_pools p ORDER BY p.template",
    )
    .bind(FAILED_HOLDS_ITS_PLACE_SECS as f64)
    .fetch_all(&mut *conn)
    .await?;
    let mut out = Vec::new();
    for r in rows {
        let missing: i64 = r.try_get("missing")?;
        if missing > 0 {
            out.push((r.try_get("template")?, missing));
        }
    }
    Ok(out)
}

/// Takes pooled sandboxes that ended (destroyed, or failed longer than
/// [`FAILED_HOLDS_ITS_PLACE_SECS`] ago) out of their pool, at most 1,000 a
/// round: a pool that cannot be filled fails its size again every minute,
/// and the rows it left behind would otherwise be counted by every round
/// and walked past by every claim, without end. The number taken out.
pub async fn release_ended(conn: &mut PgConnection) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE sandboxes SET warm_pool = NULL WHERE id IN (SELECT id FROM sandboxes WHERE warm_pool IS NOT NULL \
         AND (state = 'destroyed' OR (state = 'failed' AND changed_at <= now() - make_interval(secs => $1))) LIMIT 1000)",
    )
    .bind(FAILED_HOLDS_ITS_PLACE_SECS as f64)
    .execute(&mut *conn)
    .await?;
    Ok(done.rows_affected())
}

/// A pooled sandbox, `creating` until its queued create places it.
pub async fn insert_pooled(
    conn: &mut PgConnection,
    id: &str,
    template: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO sandboxes (id, tenant, template, egress_profiles, inherits_template, state, warm_pool) VALUES ($1, '', $2, '{}', true, 'creating', $2)",
    )
    .bind(id)
    .bind(template)
    .execute(&mut *conn)
    .await?;
    Ok(())
}
