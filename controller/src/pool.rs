//! Warm pools, the dispatcher's side (docs/controller.md, "Warm pools"):
//! keeps each template's pool at its size by queuing ordinary creates of
//! pooled sandboxes (tenant `''`, the template's policy, no profiles),
//! which the dispatcher composes, places and pushes like any create. A
//! claim takes them out of the pool (`api::pool`); this refills it.
//!
//! One refill round runs at a time across every replica: the round holds a
//! transaction-scoped advisory lock and skips when another holds it.

use std::time::Duration;

use sqlx::PgPool;

use crate::ops::create_payload;
use crate::state::OperationKind;
use crate::store::{self, pool as pools, NewOperation};

/// How often the pools are looked at.
pub const REFILL_INTERVAL: Duration = Duration::from_millis(500);

/// The most sandboxes one round queues for one pool.
const REFILL_BATCH: i64 = 64;

/// The advisory lock key a refill round holds (any constant shared by the
/// replicas, distinct from the leader's).
const REFILL_LOCK: i64 = 0x7761_726d_706f_6f6c;

/// Refills every pool every [`REFILL_INTERVAL`], forever.
pub async fn refill_forever(pool: PgPool) {
    loop {
        match refill(&pool).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(queued = n, "warm pools: creates queued"),
            Err(e) => tracing::warn!(error = %e, "warm pools: refill failed; will retry"),
        }
        tokio::time::sleep(REFILL_INTERVAL).await;
    }
}

/// One round: queues a create for each sandbox a pool is short (at most
/// [`REFILL_BATCH`] per pool); the number queued. 0 when another replica's
/// round holds the lock.
pub async fn refill(pool: &PgPool) -> Result<usize, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let locked = store::locks::try_for_transaction(&mut tx, REFILL_LOCK).await?;
    if !locked {
        return Ok(0);
    }
    pools::release_ended(&mut tx).await?;
    let payload = create_payload(None, None);
    let mut queued = 0;
    for (template, missing) in pools::shortfalls(&mut tx).await? {
        for _ in 0..missing.min(REFILL_BATCH) {
            let sandbox = crate::ids::new("sb");
            let operation = crate::ids::new("op");
            pools::insert_pooled(&mut tx, &sandbox, &template).await?;
            let op = NewOperation {
                id: &operation,
                tenant: "",
                kind: OperationKind::Create,
                sandbox: &sandbox,
                payload: &payload,
                idempotency_key: None,
                fingerprint: None,
            };
            store::insert_operation(&mut tx, &op).await?;
            queued += 1;
        }
    }
    tx.commit().await?;
    Ok(queued)
}
