//! PostgreSQL advisory locks and session checks: the dispatcher's
//! leadership, the warm-pool refill round.

use std::future::Future;
use std::time::Duration;

use sqlx::PgConnection;

/// The longest a session check or lock attempt may take: a database that
/// stopped answering (a partition, a stall) is an error, not a wait for
/// TCP to give up.
const SESSION_CALL: Duration = Duration::from_secs(5);

async fn bounded<T>(call: impl Future<Output = Result<T, sqlx::Error>>) -> Result<T, sqlx::Error> {
    tokio::time::timeout(SESSION_CALL, call)
        .await
        .unwrap_or(Err(sqlx::Error::PoolTimedOut))
}

/// Takes advisory lock `key` shared for the session; whether it got it.
pub async fn try_shared(conn: &mut PgConnection, key: i64) -> Result<bool, sqlx::Error> {
    bounded(
        sqlx::query_scalar("SELECT pg_try_advisory_lock_shared($1)")
            .bind(key)
            .fetch_one(conn),
    )
    .await
}

/// Takes advisory lock `key` exclusively for the session; whether it got it.
pub async fn try_exclusive(conn: &mut PgConnection, key: i64) -> Result<bool, sqlx::Error> {
    bounded(
        sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(key)
            .fetch_one(conn),
    )
    .await
}

/// Takes advisory lock `key` until the transaction ends; whether it got it.
pub async fn try_for_transaction(conn: &mut PgConnection, key: i64) -> Result<bool, sqlx::Error> {
    bounded(
        sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1)")
            .bind(key)
            .fetch_one(conn),
    )
    .await
}

/// Whether the session still answers.
pub async fn alive(conn: &mut PgConnection) -> bool {
    bounded(sqlx::query("SELECT 1").execute(conn)).await.is_ok()
}
