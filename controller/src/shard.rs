//! Worker shards leased to dispatchers (migration `0005_shards_alloc.sql`).
//! Every running dispatcher holds a fair share of the 64 shards: it renews
//! its heartbeat and its leases every third of `--lease-ttl`, releases the
//! shards above its share when another dispatcher has joined, and claims
//! free or expired ones below it (a dispatcher that died stops renewing:
//! its shards are taken over once its leases expire). It acts on its shards
//! only while its last renewal, by its own clock, leaves more than a third
//! of the lease: a dispatcher that cannot renew stops well before another
//! may take its shards.

use std::time::{Duration, Instant};

use sqlx::PgPool;

use crate::store::leases;

/// Shards (rows of `dispatcher_shards`; `egress_worker_shard` hashes into them).
pub const SHARDS: i64 = 64;

/// One dispatcher's leases.
#[derive(Debug)]
pub struct Leases {
    /// This dispatcher's id (random per process).
    pub id: String,
    ttl: Duration,
    held: Vec<i32>,
    /// When the last successful renewal started (local clock).
    renewed: Option<Instant>,
}

impl Leases {
    pub fn new(id: String, ttl: Duration) -> Self {
        Self {
            id,
            ttl,
            held: Vec::new(),
            renewed: None,
        }
    }

    /// A renewal is due (every third of the lease).
    pub fn due(&self) -> bool {
        self.renewed.is_none_or(|r| r.elapsed() >= self.ttl / 3)
    }

    /// Until when what it holds may be acted on: a third of the lease
    /// before it would lapse without a renewal (none before the first).
    pub fn trusted_until(&self) -> Option<Instant> {
        self.renewed.map(|r| r + self.ttl * 2 / 3)
    }

    /// The shards this dispatcher may act on now: none once its last
    /// renewal leaves a third of the lease or less.
    pub fn held(&self) -> &[i32] {
        let valid = self
            .renewed
            .is_some_and(|r| r.elapsed() + self.ttl / 3 < self.ttl);
        if valid {
            &self.held
        } else {
            &[]
        }
    }

    /// Renews the heartbeat and the leases, and moves toward a fair share:
    /// releases the shards above it, claims free or expired ones below it.
    pub async fn renew(&mut self, pool: &PgPool) -> Result<(), sqlx::Error> {
        let started = Instant::now();
        let ttl = self.ttl.as_secs_f64();
        let mut tx = pool.begin().await?;
        leases::heartbeat(&mut tx, &self.id, ttl).await?;
        let alive = leases::alive(&mut tx).await?;
        let share = (SHARDS + alive.max(1) - 1) / alive.max(1);
        let mut held = leases::extend(&mut tx, &self.id, ttl).await?;
        held.sort_unstable();
        let count = i64::try_from(held.len()).unwrap_or(SHARDS);
        if count > share {
            let extra = held.split_off(usize::try_from(share).unwrap_or(0));
            leases::release(&mut tx, &self.id, &extra).await?;
        } else if count < share {
            held.extend(leases::claim(&mut tx, &self.id, ttl, share - count).await?);
            held.sort_unstable();
        }
        leases::prune(&mut tx).await?;
        tx.commit().await?;
        if held != self.held {
            tracing::info!(dispatcher = %self.id, shards = held.len(), alive, "shards rebalanced");
        }
        self.held = held;
        self.renewed = Some(started);
        Ok(())
    }

    /// Gives every lease up at once (a graceful stop): the others need not
    /// wait for them to expire.
    pub async fn release(&mut self, pool: &PgPool) -> Result<(), sqlx::Error> {
        self.held.clear();
        self.renewed = None;
        leases::leave(pool, &self.id).await
    }
}
