//! The dispatcher (cluster-controller): of all replicas, the one holding a
//! PostgreSQL advisory lock leads; the others wait for it. The leader claims
//! queued operations one at a time (`FOR UPDATE SKIP LOCKED`) and runs each
//! in the transaction that claimed it, so an operation's effects commit once
//! or not at all, even if the leader dies mid-way. It also pushes every
//! change to the worker's gateway, and resyncs a gateway whose epoch changed
//! (a restart) or whose sandboxes differ from the store (drift): each worker
//! in a task of its own, so a slow gateway delays only its own sandboxes.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use egress_policy::Policy;
use http::{Method, StatusCode};
use serde_json::{json, Value};
use sqlx::{Connection, PgConnection, PgPool};

use crate::config::Deployment;
use crate::gateway_client::call;
use crate::metrics::{Metrics, OutcomeLabels};
use crate::ops;
use crate::store::{self, SandboxRow, WorkerRow};

/// Pushes in flight to one gateway at once.
const PUSH_CONCURRENCY: usize = 32;

/// Workers whose gateways are pushed to (or compared, or resynced) at once.
/// Each worker has a task of its own, so a slow or unreachable gateway
/// holds up only its own pushes (and one of these).
const WORKERS_AT_ONCE: usize = 64;

/// Push rounds a worker's task runs on one wake-up (256 changes each).
const PUSH_ROUNDS: usize = 16;

/// How often approvals past their `until` are looked for: an expired rule
/// is taken out within this (plus the push).
const EXPIRY_INTERVAL: Duration = Duration::from_millis(500);

/// The advisory lock key leaders hold (any constant shared by the replicas).
const LEADER_LOCK: i64 = 0x6567_7265_7373;

/// The channel `0004_work_notify.sql`'s triggers notify on: an operation
/// was queued, or a sandbox's policy moved a generation.
const WORK_CHANNEL: &str = "egress_work";

/// With the notifications: the longest idle wait (what wakes the
/// dispatcher without one — a retry's `not_before`, the resync and expiry
/// rounds). Without them (the listener could not connect): the poll.
const IDLE_WAIT: Duration = Duration::from_millis(250);
const POLL: Duration = Duration::from_millis(50);

/// Retry and pacing settings.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Attempts an operation gets.
    pub attempts: i32,
    /// How long after it was queued an operation may still be retried.
    pub deadline: Duration,
    /// The wait before a retry.
    pub backoff: Duration,
    /// How often gateways are compared with the store.
    pub resync_interval: Duration,
}

pub struct Dispatcher {
    pub pool: PgPool,
    pub database_url: String,
    pub deployment: Arc<Deployment>,
    pub metrics: Arc<Metrics>,
    pub limits: Limits,
}

/// Idle: until a notification (then every one already buffered is taken:
/// one round serves them all), or [`IDLE_WAIT`]; without a listener, [`POLL`].
async fn wait_for_work(listener: &mut Option<sqlx::postgres::PgListener>) {
    let Some(l) = listener else {
        return tokio::time::sleep(POLL).await;
    };
    match tokio::time::timeout(IDLE_WAIT, l.recv()).await {
        Ok(Ok(_)) => while l.next_buffered().is_some() {},
        // The listener's connection failed (it reconnects on the next
        // call): wait as a poll would, never spin.
        Ok(Err(_)) => tokio::time::sleep(POLL).await,
        Err(_) => {}
    }
}

impl Dispatcher {
    /// Waits to lead, then leads until the lock's session is lost; forever.
    pub async fn run(self) {
        let this = Arc::new(self);
        this.run_shared().await;
    }

    async fn run_shared(self: &Arc<Self>) {
        loop {
            match self.acquire().await {
                Some(lock) => {
                    tracing::info!("leading: executing operations and pushing to gateways");
                    self.metrics.leader.set(1);
                    self.lead(lock).await;
                    self.metrics.leader.set(0);
                    tracing::warn!("lost the leader lock; standing by");
                }
                None => tokio::time::sleep(Duration::from_millis(250)).await,
            }
        }
    }

    /// A session holding the leader lock, if it is free.
    async fn acquire(&self) -> Option<PgConnection> {
        let mut conn = PgConnection::connect(&self.database_url).await.ok()?;
        let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(LEADER_LOCK)
            .fetch_one(&mut conn)
            .await
            .ok()?;
        got.then_some(conn)
    }

    async fn lead(self: &Arc<Self>, mut lock: PgConnection) {
        let mut listener = self.listen().await;
        let mut tenders = Tenders::default();
        let mut expired = Instant::now() - EXPIRY_INTERVAL;
        loop {
            if sqlx::query("SELECT 1").execute(&mut lock).await.is_err() {
                return;
            }
            let mut worked = false;
            for _ in 0..64 {
                match self.execute_one().await {
                    Ok(true) => worked = true,
                    Ok(false) => break,
                    Err(e) => {
                        tracing::warn!(error = %e, "executing an operation");
                        break;
                    }
                }
            }
            if expired.elapsed() >= EXPIRY_INTERVAL {
                self.expire_approvals().await;
                expired = Instant::now();
            }
            self.wake_tenders(&mut tenders).await;
            self.observe_backlog().await;
            if !worked {
                wait_for_work(&mut listener).await;
            }
        }
    }

    /// Listens for work notifications on a connection of its own; `None`
    /// (logged) means polling instead.
    async fn listen(&self) -> Option<sqlx::postgres::PgListener> {
        let listening = async {
            let mut l = sqlx::postgres::PgListener::connect_with(&self.pool).await?;
            l.listen(WORK_CHANNEL).await?;
            Ok::<_, sqlx::Error>(l)
        };
        match listening.await {
            Ok(l) => Some(l),
            Err(e) => {
                tracing::warn!(error = %e, "no LISTEN {WORK_CHANNEL}: polling every {POLL:?}");
                None
            }
        }
    }

    /// Claims and runs one operation; `false` when none is runnable.
    async fn execute_one(&self) -> Result<bool, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        let Some(op) = store::claim(&mut tx).await? else {
            return Ok(false);
        };
        let run = ops::execute(
            &mut tx,
            &self.deployment,
            &self.metrics,
            &op.kind,
            &op.sandbox,
            &op.payload,
        )
        .await;
        match run {
            Ok(()) => {
                store::succeed(&mut tx, &op.id).await?;
                tx.commit().await?;
                self.count("succeeded");
            }
            Err(failure) => {
                tx.rollback().await?;
                let limits = (
                    self.limits.attempts,
                    self.limits.deadline,
                    self.limits.backoff,
                );
                let state = store::attempt_failed(
                    &self.pool,
                    &op.id,
                    &failure.message,
                    failure.retryable,
                    limits,
                )
                .await?;
                tracing::info!(operation = %op.id, %state, error = %failure.message, "operation attempt failed");
                if state == "failed" {
                    let mut conn = self.pool.acquire().await?;
                    store::set_state(&mut conn, &op.sandbox, "failed").await?;
                    self.count("failed");
                } else {
                    self.count("retried");
                }
            }
        }
        Ok(true)
    }

    /// Takes the approvals past their `until` out of the sandboxes they
    /// reached; the new generations are pushed like any change.
    async fn expire_approvals(&self) {
        match crate::approvals::expire(&self.pool).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(expired = n, "approvals expired"),
            Err(e) => tracing::warn!(error = %e, "expiring approvals"),
        }
    }

    fn count(&self, outcome: &'static str) {
        self.metrics
            .operations
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }

    async fn observe_backlog(&self) {
        if let Ok((depth, oldest, lag)) = store::backlog(&self.pool).await {
            self.metrics.queue_depth.set(depth);
            self.metrics.queue_oldest_seconds.set(oldest);
            self.metrics.push_lag_seconds.set(lag);
        }
    }

    /// Wakes each worker's task (started on first sight) with the worker
    /// as stored now; a task busy with a slow gateway takes the latest
    /// when it is done.
    async fn wake_tenders(self: &Arc<Self>, tenders: &mut Tenders) {
        let read_at = Instant::now();
        let Ok(workers) = store::workers(&self.pool).await else {
            return;
        };
        for w in workers {
            let mut seen = (read_at, w);
            if let Some(tx) = tenders.workers.get(&seen.1.id) {
                match tx.send(seen) {
                    Ok(()) => continue,
                    // Its task ended (it cannot, short of a panic): start another.
                    Err(tokio::sync::watch::error::SendError(back)) => seen = back,
                }
            }
            let id = seen.1.id.clone();
            let (tx, rx) = tokio::sync::watch::channel(seen);
            let (this, permits) = (self.clone(), tenders.permits.clone());
            tenders
                .tasks
                .spawn(async move { this.tender(rx, permits).await });
            tenders.workers.insert(id, tx);
        }
    }

    /// One worker's task: on each wake-up, compares its gateway with the
    /// store when [`Limits::resync_interval`] has passed, then resyncs it or
    /// pushes its changes until none are left, in change order. A row read
    /// before this task's last resync ended is stale (its epoch and flag
    /// predate the resync): it is pushed from, not compared or resynced.
    async fn tender(&self, mut rx: Seen, permits: Arc<tokio::sync::Semaphore>) {
        let mut compared = Instant::now() - self.limits.resync_interval;
        let mut synced: Option<Instant> = None;
        while rx.changed().await.is_ok() {
            let (read_at, mut w) = rx.borrow_and_update().clone();
            let Ok(_permit) = permits.acquire().await else {
                return;
            };
            let stale = synced.is_some_and(|s| read_at < s);
            w.needs_resync &= !stale;
            if !stale && compared.elapsed() >= self.limits.resync_interval {
                w.needs_resync |= self.compare_gateway(&w).await;
                compared = Instant::now();
            }
            for _ in 0..PUSH_ROUNDS {
                let moved = if w.needs_resync {
                    let done = self.resync(&w).await;
                    w.needs_resync = !done;
                    synced = done.then(Instant::now).or(synced);
                    done
                } else {
                    self.push_changes(&w).await
                };
                if !moved {
                    break;
                }
            }
        }
    }

    /// Pushes a worker's unacknowledged changes, [`PUSH_CONCURRENCY`] at a
    /// time (the gateway commits concurrent pushes together); stops at the
    /// first failure, to retry on the next round.
    async fn push_changes(&self, w: &WorkerRow) -> bool {
        let Ok(changes) = store::unpushed(&self.pool, &w.id, 256).await else {
            return false;
        };
        let mut moved = false;
        for chunk in changes.chunks(PUSH_CONCURRENCY) {
            let mut pushes = tokio::task::JoinSet::new();
            for s in chunk {
                let (url, token) = (w.admin_url.clone(), w.token.clone());
                let (id, generation) = (s.id.clone(), s.generation);
                let (method, body) =
                    if s.state == "destroyed" || s.state == "failed" || s.policy.is_none() {
                        (Method::DELETE, None)
                    } else {
                        (
                            Method::PUT,
                            Some(json!({"addresses": s.addresses, "policy": s.policy})),
                        )
                    };
                pushes.spawn(async move {
                    let path = format!("/v1/sandboxes/{id}");
                    let outcome = call(&url, &token, method, &path, body.as_ref()).await;
                    (id, generation, outcome)
                });
            }
            let mut failed = None;
            while let Some(Ok((id, generation, outcome))) = pushes.join_next().await {
                match outcome {
                    Ok((status, _)) if status.is_success() || status == StatusCode::NOT_FOUND => {
                        if let Ok(lag) = store::pushed(&self.pool, &id, generation).await {
                            self.metrics.push_latency_seconds.observe(lag);
                        }
                        self.metrics
                            .pushes
                            .get_or_create(&OutcomeLabels { outcome: "applied" })
                            .inc();
                        moved = true;
                    }
                    Ok((status, body)) => failed = Some((id, format!("{status}: {body}"))),
                    Err(e) => failed = Some((id, e)),
                }
            }
            if let Some((id, error)) = failed {
                tracing::warn!(worker = %w.id, sandbox = %id, %error, "push failed; will retry");
                self.metrics
                    .pushes
                    .get_or_create(&OutcomeLabels { outcome: "failed" })
                    .inc();
                let _ = store::worker_seen(&self.pool, &w.id, None, false, Some(&error)).await;
                return moved;
            }
        }
        moved
    }

    /// Replaces everything the gateway knows with the store's view.
    async fn resync(&self, w: &WorkerRow) -> bool {
        let Ok(rows) = store::worker_sandboxes(&self.pool, &w.id).await else {
            return false;
        };
        // NDJSON, streamed by the gateway: no size bound on a resync.
        let mut ndjson = String::new();
        for s in &rows {
            let line = json!({"id": s.id, "addresses": s.addresses, "policy": s.policy});
            ndjson.push_str(&line.to_string());
            ndjson.push('\n');
        }
        match crate::gateway_client::resync(&w.admin_url, &w.token, ndjson).await {
            Ok((status, _)) if status.is_success() => {
                let epoch = self.epoch(w).await;
                let _ = store::worker_seen(&self.pool, &w.id, epoch.as_deref(), false, None).await;
                for s in &rows {
                    let _ = store::pushed(&self.pool, &s.id, s.generation).await;
                }
                self.mark_forgotten(w).await;
                tracing::info!(worker = %w.id, sandboxes = rows.len(), "resynced the gateway");
                self.metrics
                    .pushes
                    .get_or_create(&OutcomeLabels { outcome: "resync" })
                    .inc();
                true
            }
            outcome => {
                let error = match outcome {
                    Ok((status, body)) => format!("{status}: {body}"),
                    Err(e) => e,
                };
                tracing::warn!(worker = %w.id, %error, "resync failed; will retry");
                self.metrics
                    .pushes
                    .get_or_create(&OutcomeLabels { outcome: "failed" })
                    .inc();
                let _ = store::worker_seen(&self.pool, &w.id, None, true, Some(&error)).await;
                false
            }
        }
    }

    /// After a resync, destroyed and failed sandboxes are acknowledged too:
    /// the gateway no longer has them.
    async fn mark_forgotten(&self, w: &WorkerRow) {
        let _ = sqlx::query(
            "UPDATE sandboxes SET pushed_generation = generation WHERE worker = $1 AND state IN ('destroyed', 'failed')",
        )
        .bind(&w.id)
        .execute(&self.pool)
        .await;
    }

    async fn epoch(&self, w: &WorkerRow) -> Option<String> {
        let (_, body) = call(&w.admin_url, &w.token, Method::GET, "/v1/sandboxes", None)
            .await
            .ok()?;
        body.get("epoch").and_then(Value::as_str).map(str::to_owned)
    }

    /// Whether a worker's gateway restarted (a new epoch) or holds other
    /// sandboxes than the store says it acknowledged; if so it is flagged
    /// for resync.
    async fn compare_gateway(&self, w: &WorkerRow) -> bool {
        if w.needs_resync {
            return false;
        }
        let Ok((status, body)) =
            call(&w.admin_url, &w.token, Method::GET, "/v1/sandboxes", None).await
        else {
            return false;
        };
        if !status.is_success() {
            return false;
        }
        let epoch = body.get("epoch").and_then(Value::as_str);
        let restarted = epoch.is_some() && epoch != w.epoch.as_deref();
        // Changes still being pushed are not drift.
        let settled = store::unpushed(&self.pool, &w.id, 1)
            .await
            .is_ok_and(|u| u.is_empty());
        let drift = match store::worker_sandboxes(&self.pool, &w.id).await {
            Ok(rows) if settled => differs(&rows, &body),
            _ => false,
        };
        if restarted || drift {
            tracing::warn!(worker = %w.id, restarted, drift, "gateway out of step; resyncing");
            let _ = store::worker_seen(&self.pool, &w.id, None, true, None).await;
        }
        restarted || drift
    }
}

/// A worker's row as the leader last read it, and when it read it.
type Seen = tokio::sync::watch::Receiver<(Instant, WorkerRow)>;

/// The leader's per-worker tasks ([`Dispatcher::tender`]): how to wake
/// each, and the bound on how many work at once. Dropped (the tasks
/// aborted) when leadership ends.
struct Tenders {
    workers: std::collections::HashMap<String, tokio::sync::watch::Sender<(Instant, WorkerRow)>>,
    tasks: tokio::task::JoinSet<()>,
    permits: Arc<tokio::sync::Semaphore>,
}

impl Default for Tenders {
    fn default() -> Self {
        Self {
            workers: Default::default(),
            tasks: tokio::task::JoinSet::new(),
            permits: Arc::new(tokio::sync::Semaphore::new(WORKERS_AT_ONCE)),
        }
    }
}

/// Whether the gateway's list differs from the store's rows.
fn differs(rows: &[SandboxRow], gateway: &Value) -> bool {
    let theirs: BTreeMap<&str, (Vec<String>, Option<Policy>)> = gateway
        .get("sandboxes")
        .and_then(Value::as_array)
        .map(|list| {
            list.iter()
                .filter_map(|s| {
                    let id = s.get("id")?.as_str()?;
                    let addresses = s
                        .get("addresses")?
                        .as_array()?
                        .iter()
                        .filter_map(|a| a.as_str().map(str::to_owned))
                        .collect();
                    let policy = s
                        .get("policy")
                        .and_then(|p| Policy::from_json(&p.to_string()).ok());
                    Some((id, (addresses, policy)))
                })
                .collect()
        })
        .unwrap_or_default();
    let ours: BTreeMap<&str, (Vec<String>, Option<Policy>)> = rows
        .iter()
        .map(|s| (s.id.as_str(), (s.addresses.clone(), s.policy.clone())))
        .collect();
    theirs != ours
}
