//! The dispatchers' heartbeats and shard leases (`dispatchers`,
//! `dispatcher_shards`); the fair-share logic is `crate::shard`'s.

use sqlx::{PgConnection, PgPool};

/// Records dispatcher `id` alive for `ttl` seconds more.
pub async fn heartbeat(conn: &mut PgConnection, id: &str, ttl: f64) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO dispatchers (id, expires) VALUES ($1, now() + make_interval(secs => $2)) ON CONFLICT (id) DO UPDATE SET expires = EXCLUDED.expires",
    )
    .bind(id)
    .bind(ttl)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// How many dispatchers are alive.
pub async fn alive(conn: &mut PgConnection) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM dispatchers WHERE expires > now()")
        .fetch_one(&mut *conn)
        .await
}

/// Extends `id`'s unexpired leases by `ttl` seconds; the shards it holds.
pub async fn extend(conn: &mut PgConnection, id: &str, ttl: f64) -> Result<Vec<i32>, sqlx::Error> {
    sqlx::query_scalar(
        "UPDATE dispatcher_shards SET expires = now() + make_interval(secs => $2) WHERE holder = $1 AND expires > now() RETURNING shard",
    )
    .bind(id)
    .bind(ttl)
    .fetch_all(&mut *conn)
    .await
}

/// Gives up `id`'s leases of `shards`.
pub async fn release(conn: &mut PgConnection, id: &str, shards: &[i32]) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE dispatcher_shards SET holder = NULL, expires = '-infinity' WHERE holder = $1 AND shard = ANY($2)",
    )
    .bind(id)
    .bind(shards)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Claims up to `n` shards nobody holds (released, or their lease expired).
pub async fn claim(
    conn: &mut PgConnection,
    id: &str,
    ttl: f64,
    n: i64,
) -> Result<Vec<i32>, sqlx::Error> {
    sqlx::query_scalar(
        "UPDATE dispatcher_shards SET holder = $1, expires = now() + make_interval(secs => $2), handovers = handovers + 1 WHERE shard IN (SELECT shard FROM dispatcher_shards WHERE holder IS NULL OR expires <= now() ORDER BY shard LIMIT $3 FOR UPDATE SKIP LOCKED) RETURNING shard",
    )
    .bind(id)
    .bind(ttl)
    .bind(n)
    .fetch_all(&mut *conn)
    .await
}

/// Forgets the dispatchers dead for an hour.
pub async fn prune(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM dispatchers WHERE expires < now() - interval '1 hour'")
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Gives every lease of `id` up and forgets it (a graceful stop).
pub async fn leave(pool: &PgPool, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE dispatcher_shards SET holder = NULL, expires = '-infinity' WHERE holder = $1",
    )
    .bind(id)
    .execute(pool)
    .await?;
    sqlx::query("DELETE FROM dispatchers WHERE id = $1")
        .bind(id)
        .execute(pool)
        .await?;
    Ok(())
}
