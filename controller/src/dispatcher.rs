//! The dispatcher (cluster-controller). Every running replica works: the
//! workers are split into shards leased among them ([`crate::shard`]), and
//! each pushes to the gateways of the workers it holds, in change order,
//! and executes the queued operations that name those workers. Operations
//! that name none (most creates, forks) are claimed by whichever replica
//! comes first (`FOR UPDATE SKIP LOCKED`). Each runs in the transaction
//! that claimed it, so its effects commit once or not at all, even if the
//! replica dies mid-way. The holder of a second advisory lock also does
//! what must be done once: approval expiry, pruning, the queue metrics.
//! Each held worker's gateway is tended by a task of its own, so a slow or
//! unreachable gateway delays only its own sandboxes. A gateway is resynced
//! when its epoch changed (a restart) or, when the generation it reports
//! is not the one the store acknowledged, its list differs from the store
//! (drift); `plan` decides which, from the inputs the check gathers, with
//! no I/O. A failed push keeps a typed, bounded error
//! ([`crate::gateway_client::PushError`]).

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::task::AbortHandle;

use egress_policy::Policy;
use futures::StreamExt;
use http::{Method, StatusCode};
use serde_json::Value;
use sqlx::{Connection, PgConnection, PgPool};

use egress_api::body::MAX_BODY;
use egress_api::gateway::{PutSandbox, SandboxDoc};

use crate::config::Deployment;
use crate::gateway_client::{call, PushError};
use crate::metrics::{Metrics, OutcomeLabels};
use crate::ops;
use crate::shard::Leases;
use crate::state::OperationState;
use crate::store::{self, SandboxRow, WorkerRow};

mod plan;

use plan::{plan, Action, Cause, Known, Listed};

/// Pushes in flight to one gateway at once.
const PUSH_CONCURRENCY: usize = 32;

/// Workers whose gateways are pushed to (or checked, or resynced) at once.
/// Each worker has a task of its own, so a slow or unreachable gateway
/// holds up only its own pushes (and one of these).
const WORKERS_AT_ONCE: usize = 64;

/// Workers whose gateways did not answer last time that are tried at once,
/// apart from [`WORKERS_AT_ONCE`]: a lost zone of silent gateways, each
/// holding its try for the client's timeout, cannot take the permits of
/// the gateways that answer.
const SILENT_AT_ONCE: usize = 8;

/// A silent gateway's next try waits this long, doubled with each miss up
/// to [`SILENT_BACKOFF_MAX`].
const SILENT_BACKOFF_FIRST: Duration = Duration::from_millis(250);
const SILENT_BACKOFF_MAX: Duration = Duration::from_secs(30);

/// Gateways' lists fetched and compared at once by this dispatcher: after
/// a change every gateway's generation moves with (a template's shadow,
/// say), each worker's next check fetches its whole list.
static COMPARING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(4);

/// Push rounds a worker's task runs on one wake-up (one read of changes
/// each: [`UNPUSHED_READ`], [`UNPUSHED_BYTES`]).
const PUSH_ROUNDS: usize = 16;

/// Unpushed changes read at once, and the most policy they may hold as
/// stored (compressed, for a large one; the first is read whatever its
/// size): a policy is up to 1 MiB of text, so the count alone would let
/// each of the [`WORKERS_AT_ONCE`] tasks hold 256 MiB of them.
const UNPUSHED_READ: usize = 256;
const UNPUSHED_BYTES: i64 = 4 << 20;

/// Operations one dispatcher runs at once (each in its own transaction).
const EXECUTORS: usize = 4;

/// How often approvals past their `until` are looked for: an expired rule
/// is taken out within this (plus the push).
const EXPIRY_INTERVAL: Duration = Duration::from_millis(500);
/// How long one expiry sweep may go on beginning approvals: a burst of
/// tenant-wide approvals expiring together (each refreshing every sandbox
/// of its tenant) is spread over rounds, and the leases renewed between.
const EXPIRY_BUDGET: Duration = Duration::from_secs(2);

/// How often finished operations and idempotency keys are pruned, and how
/// many rows of each at most per round.
const PRUNE_INTERVAL: Duration = Duration::from_secs(1);
const PRUNE_BATCH: i64 = 1000;

/// The advisory lock key dispatchers of the single-leader kind (before
/// shards) hold exclusively to lead. Every sharded dispatcher holds it
/// *shared*: while one works, no older replica can lead, and while an older
/// one leads, sharded ones wait — through a rolling upgrade the two kinds
/// never push at once.
const LEADER_LOCK: i64 = 0x6567_7265_7373;

/// The advisory lock the dispatcher doing what must be done once holds.
const SINGLETON_LOCK: i64 = 0x6567_7265_7374;

/// The channel `0004_work_notify.sql`'s triggers notify on: an operation
/// was queued, or a sandbox's policy moved a generation.
const WORK_CHANNEL: &str = "egress_work";

/// With the notifications: the longest idle wait (what wakes the
/// dispatcher without one — a retry's `not_before`, the resync and expiry
/// rounds). Without them (the listener could not connect): the poll.
const IDLE_WAIT: Duration = Duration::from_millis(250);
const POLL: Duration = Duration::from_millis(50);

/// How often a dispatcher without its listener tries to LISTEN again, and
/// how long it gives a try (its round of work waits meanwhile).
const LISTEN_AGAIN: Duration = Duration::from_secs(5);
const LISTEN_TRY: Duration = Duration::from_millis(500);

/// Retry, pacing, lease and retention settings.
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
    /// How long a shard lease lasts unless renewed.
    pub lease_ttl: Duration,
    /// How long finished operations are kept.
    pub operation_retention: Duration,
    /// How long a finished operation's idempotency key is honoured (from
    /// when it was queued).
    pub idempotency_retention: Duration,
}

impl Default for Limits {
    /// The dispatcher's flags' defaults.
    fn default() -> Self {
        Self {
            attempts: 5,
            deadline: Duration::from_secs(300),
            backoff: Duration::from_secs(2),
            resync_interval: Duration::from_secs(5),
            lease_ttl: Duration::from_secs(15),
            operation_retention: Duration::from_secs(7 * 86_400),
            idempotency_retention: Duration::from_secs(86_400),
        }
    }
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
        Ok(Err(error)) => {
            tracing::debug!(%error, "the work listener failed; it reconnects");
            tokio::time::sleep(POLL).await
        }
        Err(_) => {}
    }
}

/// When the rounds besides operations and pushes last ran.
struct Rounds {
    expired: Instant,
    pruned: Instant,
    /// Approvals whose expiry failed lately, and when.
    expiry_failed: Vec<(String, Instant)>,
}

impl Dispatcher {
    /// Works until the process ends.
    pub async fn run(self) {
        self.run_until(std::future::pending()).await;
    }

    /// Works until `stop` completes, then gives its leases up so the other
    /// replicas take its shards at once.
    pub async fn run_until(self, stop: impl Future<Output = ()>) {
        let mut leases = Leases::new(crate::ids::new("d"), self.limits.lease_ttl);
        tracing::info!(dispatcher = %leases.id, "dispatcher started");
        let this = Arc::new(self);
        tokio::select! {
            () = this.serve(&mut leases) => {}
            () = stop => {}
        }
        if let Err(e) = leases.release(&this.pool).await {
            tracing::warn!(error = %e, "releasing the shard leases");
        }
        drop(this);
        tracing::info!(dispatcher = %leases.id, "dispatcher stopped; leases released");
    }

    async fn serve(self: &Arc<Self>, leases: &mut Leases) {
        let mut told = false;
        loop {
            match self.session().await {
                Ok(Some(session)) => {
                    self.work(session, leases).await;
                    self.metrics.leader.set(0);
                    self.metrics.shards.set(0);
                    tracing::warn!("lost the database session; connecting again");
                }
                Ok(None) if !told => {
                    tracing::info!("standing by: a single-leader dispatcher leads");
                    told = true;
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(error = %e, "no database session; retrying"),
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// A session holding [`LEADER_LOCK`] shared (none while an older
    /// dispatcher leads with it).
    async fn session(&self) -> Result<Option<PgConnection>, sqlx::Error> {
        let options = store::connect_options(&self.database_url)?;
        let connect = PgConnection::connect_with(&options);
        let mut conn = tokio::time::timeout(store::CONNECT_TIMEOUT, connect)
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)??;
        store::bounded(&mut conn).await?;
        let got = store::locks::try_shared(&mut conn, LEADER_LOCK).await?;
        Ok(got.then_some(conn))
    }

    /// Takes [`SINGLETON_LOCK`] on `session` if it is free.
    async fn try_lead(&self, session: &mut PgConnection) -> bool {
        let got = store::locks::try_exclusive(session, SINGLETON_LOCK)
            .await
            .unwrap_or(false);
        if got {
            tracing::info!("leading: approval expiry, pruning and the queue metrics");
            self.metrics.leader.set(1);
        }
        got
    }

    /// Works while `session` lives; the workers' tasks end with it.
    async fn work(self: &Arc<Self>, mut session: PgConnection, leases: &mut Leases) {
        let mut listener = self.listen().await;
        let mut tenders = Tenders::default();
        let long_ago = Instant::now() - EXPIRY_INTERVAL.max(PRUNE_INTERVAL);
        let mut rounds = Rounds {
            expired: long_ago,
            pruned: long_ago,
            expiry_failed: Vec::new(),
        };
        let mut leader = false;
        let mut listened = Instant::now();
        loop {
            if !store::locks::alive(&mut session).await {
                return;
            }
            if listener.is_none() && listened.elapsed() >= LISTEN_AGAIN {
                // Briefly: the round of work waits for it.
                let again = tokio::time::timeout(LISTEN_TRY, self.listen()).await;
                (listener, listened) = (again.ok().flatten(), Instant::now());
            }
            leader = leader || self.try_lead(&mut session).await;
            let before = leases.held().to_vec();
            self.renew(leases).await;
            let shards = leases.held().to_vec();
            // Shards given back (or trust lapsed): their workers' tasks are
            // stopped before the operations run, not after.
            if before.iter().any(|s| !shards.contains(s)) {
                self.wake_tenders(&mut tenders, leases).await;
            }
            let worked = self.execute_some(&shards).await;
            // Again before waking the pushers, should the work above have
            // been long; the pushers first, the rounds for all after.
            self.renew(leases).await;
            self.wake_tenders(&mut tenders, leases).await;
            if leader {
                self.singletons(&mut rounds).await;
            }
            if !worked {
                wait_for_work(&mut listener).await;
            }
        }
    }

    async fn renew(&self, leases: &mut Leases) {
        if !leases.due() {
            return;
        }
        if let Err(e) = leases.renew(&self.pool).await {
            tracing::warn!(error = %e, "renewing the shard leases");
        }
        self.metrics
            .shards
            .set(i64::try_from(leases.held().len()).unwrap_or(0));
    }

    /// Up to 64 operations, [`EXECUTORS`] at a time; `true` if any ran.
    async fn execute_some(&self, shards: &[i32]) -> bool {
        let ran = futures::stream::iter(0..EXECUTORS)
            .map(|_| async {
                let mut worked = false;
                for _ in 0..64 / EXECUTORS {
                    match self.execute_one(shards).await {
                        Ok(true) => worked = true,
                        Ok(false) => break,
                        Err(e) => {
                            tracing::warn!(error = %e, "executing an operation");
                            break;
                        }
                    }
                }
                worked
            })
            .buffer_unordered(EXECUTORS)
            .collect::<Vec<bool>>()
            .await;
        ran.contains(&true)
    }

    /// What one dispatcher does for all: approval expiry, pruning, the
    /// queue metrics.
    async fn singletons(&self, rounds: &mut Rounds) {
        if rounds.expired.elapsed() >= EXPIRY_INTERVAL {
            self.expire_approvals(&mut rounds.expiry_failed).await;
            rounds.expired = Instant::now();
        }
        if rounds.pruned.elapsed() >= PRUNE_INTERVAL {
            self.prune().await;
            rounds.pruned = Instant::now();
        }
        self.observe_backlog().await;
    }

    async fn prune(&self) {
        let l = &self.limits;
        let pruned = store::prune(
            &self.pool,
            l.operation_retention,
            l.idempotency_retention,
            PRUNE_BATCH,
        )
        .await;
        match pruned {
            Ok((0, 0, 0)) => {}
            Ok((keys, operations, ended)) => {
                tracing::info!(
                    keys,
                    operations,
                    ended_policies_and_shadows = ended,
                    "pruned"
                );
            }
            Err(e) => tracing::warn!(error = %e, "pruning"),
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
    async fn execute_one(&self, shards: &[i32]) -> Result<bool, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        let Some(op) = store::claim(&mut tx, shards).await? else {
            return Ok(false);
        };
        // The effects under a savepoint: a failed attempt undoes them and is
        // recorded while the operation is still locked, so no other
        // executor runs the same attempt again.
        let mut effects = tx.begin().await?;
        let run = ops::execute(
            &mut effects,
            &self.deployment,
            &self.metrics,
            &op.kind,
            &op.sandbox,
            &op.payload,
        )
        .await;
        let Err(failure) = run else {
            effects.commit().await?;
            store::succeed(&mut tx, &op.id).await?;
            tx.commit().await?;
            self.count("succeeded");
            return Ok(true);
        };
        effects.rollback().await?;
        let limits = (
            self.limits.attempts,
            self.limits.deadline,
            self.limits.backoff,
        );
        let state =
            store::attempt_failed(&mut tx, &op.id, &failure.message, failure.retryable, limits)
                .await?;
        if state == OperationState::Failed {
            // A sandbox destroyed meanwhile stays destroyed.
            store::fail_creating(&mut tx, &op.sandbox).await?;
        }
        tx.commit().await?;
        tracing::info!(operation = %op.id, %state, error = %failure.message, "operation attempt failed");
        self.count(if state == OperationState::Failed {
            "failed"
        } else {
            "retried"
        });
        Ok(true)
    }

    /// Takes the approvals past their `until` out of the sandboxes they
    /// reached; the new generations are pushed like any change.
    async fn expire_approvals(&self, failed: &mut Vec<(String, Instant)>) {
        match crate::approvals::expire(&self.pool, EXPIRY_BUDGET, failed).await {
            Ok((0, _)) => {}
            Ok((n, _)) => tracing::info!(expired = n, "approvals expired"),
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
        let backlog = read(
            store::backlog(&self.pool).await,
            "reading the queue",
            "backlog",
        );
        if let Some((depth, oldest, lag)) = backlog {
            self.metrics.queue_depth.set(depth);
            self.metrics.queue_oldest_seconds.set(oldest);
            self.metrics.push_lag_seconds.set(lag);
        }
    }

    /// Wakes the task of each worker of the held shards (started on first
    /// sight) with the worker as stored now and how long the leases are
    /// trusted; a task busy with a slow gateway takes the latest when it is
    /// done. The tasks of workers no longer held are stopped at once.
    async fn wake_tenders(self: &Arc<Self>, tenders: &mut Tenders, leases: &Leases) {
        let read_at = Instant::now();
        let held = leases.held();
        let workers = match (held.is_empty(), leases.trusted_until()) {
            (false, Some(until)) => {
                let rows = store::workers_in(&self.pool, held).await;
                let Some(rows) = read(rows, "reading the held workers", "shards") else {
                    return;
                };
                // Read under this dispatcher's lease: a row whose shard
                // another holds now (taken over since the renewal) records
                // nothing.
                let mine = |l: &store::Lease| l.holder == leases.id;
                rows.into_iter()
                    .map(|w| {
                        let lease = w.lease.clone().filter(mine).or_else(|| {
                            Some(store::Lease {
                                holder: leases.id.clone(),
                                term: -1,
                            })
                        });
                        (store::WorkerRow { lease, ..w }, until)
                    })
                    .collect()
            }
            _ => Vec::new(),
        };
        let ids: std::collections::HashSet<String> =
            workers.iter().map(|(w, _)| w.id.clone()).collect();
        tenders.workers.retain(|id, (_, task)| {
            let keep = ids.contains(id);
            if !keep {
                task.abort();
            }
            keep
        });
        // Tasks stopped (here or at an earlier lapse of trust) are reaped:
        // the set holds only the running ones.
        while tenders.tasks.try_join_next().is_some() {}
        for (w, until) in workers {
            let mut seen = (read_at, w, until);
            if let Some((tx, _)) = tenders.workers.get(&seen.1.id) {
                match tx.send(seen) {
                    Ok(()) => continue,
                    // Its task ended (it cannot, short of a panic): start another.
                    Err(tokio::sync::watch::error::SendError(back)) => seen = back,
                }
            }
            let id = seen.1.id.clone();
            let (tx, rx) = tokio::sync::watch::channel(seen);
            let (this, permits) = (self.clone(), tenders.permits.clone());
            let task = tenders
                .tasks
                .spawn(async move { this.tender(rx, permits).await });
            tenders.workers.insert(id, (tx, task));
        }
    }

    /// One worker's task: on each wake-up, checks its gateway when
    /// [`Limits::resync_interval`] has passed, then resyncs it or pushes its
    /// changes until none are left, in change order, while the leases are
    /// trusted. A row read before this task's last resync ended is stale
    /// (its epoch and flag predate the resync): it is pushed from, not
    /// checked or resynced.
    async fn tender(&self, mut rx: Seen, permits: Permits) {
        let mut t = Tending::new(self.limits.resync_interval);
        while rx.changed().await.is_ok() {
            if let Some(at) = t.silence.next_try() {
                tokio::time::sleep_until(at.into()).await;
            }
            let pool = match t.silence.misses {
                0 => &permits.answering,
                _ => &permits.silent,
            };
            let Ok(_permit) = pool.acquire().await else {
                return;
            };
            // Taken once the permit is: a long wait for it does not use up
            // the trust in the leases the row was read under.
            let (read_at, w, until) = rx.borrow_and_update().clone();
            let heard = self.tend(&mut t, read_at, w, until).await;
            t.silence.note(heard);
        }
    }

    /// One wake-up of a worker's task (holding its permit): what it heard
    /// from the gateway.
    async fn tend(
        &self,
        t: &mut Tending,
        read_at: Instant,
        mut w: WorkerRow,
        until: Instant,
    ) -> Heard {
        let stale = t.synced.is_some_and(|s| read_at < s);
        w.needs_resync &= !stale;
        let mut heard = Heard::Nothing;
        if !stale && !w.needs_resync && t.compared.elapsed() >= self.limits.resync_interval {
            t.compared = Instant::now();
            match self.check_gateway(&w).await {
                // Nothing to push to: the changes wait for the next try.
                Checked::Silent => return Heard::Silent,
                Checked::Answered { resync, revisions } => {
                    (w.needs_resync, heard) = (resync, Heard::Answered);
                    t.revisions = revisions;
                }
            }
        }
        for _ in 0..PUSH_ROUNDS {
            if Instant::now() >= until {
                break;
            }
            let due = t
                .refused
                .is_none_or(|r| r.elapsed() >= self.limits.resync_interval);
            let round = if w.needs_resync && due {
                match self.resync(&w).await {
                    Resynced::Done => {
                        (w.needs_resync, t.synced, t.refused) = (false, Some(Instant::now()), None);
                        Round::Moved
                    }
                    Resynced::Refused => {
                        t.refused = Some(Instant::now());
                        self.push_changes(&w, until, &mut t.held, t.revisions).await
                    }
                    Resynced::Failed => Round::Silent,
                }
            } else {
                self.push_changes(&w, until, &mut t.held, t.revisions).await
            };
            match round {
                Round::Moved => heard = Heard::Answered,
                Round::Still => break,
                Round::Silent => return Heard::Silent,
            }
        }
        heard
    }

    /// Pushes a worker's unacknowledged changes, [`PUSH_CONCURRENCY`] at a
    /// time (the gateway commits concurrent pushes together), but those
    /// `held` back. A push the gateway refuses as the sandbox's is held
    /// back ([`HeldPushes`]) and the rest go on; any other failure stops
    /// the round, to retry on the next.
    async fn push_changes(
        &self,
        w: &WorkerRow,
        until: Instant,
        held: &mut HeldPushes,
        revisions: bool,
    ) -> Round {
        let (ids, generations) = held.pairs();
        let held_back = (&ids[..], &generations[..]);
        let bounds = (UNPUSHED_READ as i64, UNPUSHED_BYTES);
        let changes = store::unpushed(&self.pool, &w.id, bounds, held_back).await;
        let Some(store::Unpushed { rows: changes, end }) =
            read(changes, "reading the changes to push", &w.id)
        else {
            return Round::Still;
        };
        // A read that reached the end of the queue: those held go again,
        // once an interval has passed since they were.
        if end {
            held.release(self.limits.resync_interval);
        }
        let (mut moved, mut silent) = (false, false);
        for chunk in changes.chunks(PUSH_CONCURRENCY) {
            if Instant::now() >= until {
                break;
            }
            let (applied, failed) = self.push_chunk(w, chunk, revisions).await;
            moved |= applied > 0;
            silent |= failed
                .iter()
                .any(|(_, e)| matches!(e, PushError::Unanswered(_)));
            // Each applied push moved the gateway's generation by one (none:
            // nothing to write).
            if applied > 0 {
                let acked =
                    store::acknowledge(&self.pool, &w.id, None, applied, w.lease.as_ref()).await;
                logged(acked, "acknowledging the pushes", &w.id);
            }
            let (noted, stop) = self.failures(w, &failed, held).await;
            moved |= noted;
            if stop {
                break;
            }
        }
        match (moved, silent) {
            (true, _) => Round::Moved,
            (false, true) => Round::Silent,
            (false, false) => Round::Still,
        }
    }

    /// Records what `w`'s gateway said ([`store::worker_seen`], under the
    /// lease `w` was read with); a failure to is logged with `what`.
    async fn seen(
        &self,
        w: &WorkerRow,
        said: (Option<&str>, Option<bool>, Option<&str>),
        what: &str,
    ) {
        let seen = store::worker_seen(&self.pool, w, said).await;
        logged(seen, what, &w.id);
    }

    /// Logs and notes a chunk's `failed` pushes: whether one was noted as
    /// a refusal (the queue moved on as if it were pushed), and whether the
    /// round stops (a failure that is not the sandbox's). A push refused
    /// as stale has the worker flagged for resync.
    async fn failures(
        &self,
        w: &WorkerRow,
        failed: &[((String, i64), PushError)],
        held: &mut HeldPushes,
    ) -> (bool, bool) {
        let (mut noted, mut stop) = (false, false);
        for (id, error) in failed {
            tracing::warn!(worker = %w.id, sandbox = %id.0, %error, "push failed; will retry");
            self.count_push("failed");
            let refusal = held.hold(id, error);
            noted |= refusal.is_some();
            stop |= refusal.is_none();
        }
        if let Some((_, error)) = failed.last() {
            self.note_push_failure(w, error).await;
        }
        // The gateway holds a later revision than the store: only a
        // resync sets the store's view on it again.
        let stale = failed
            .iter()
            .find(|(_, e)| matches!(e, PushError::Stale { .. }));
        if let Some((_, error)) = stale {
            let error = error.to_string();
            self.seen(w, (None, Some(true), Some(&error)), "flagging the resync")
                .await;
        }
        (noted, stop)
    }

    /// Records a push's failure on the worker's row, its resync flag left
    /// as it is stored: pushes also run while a refused resync waits to be
    /// tried again, and a registration (`PUT /v1/workers`) may have raised
    /// the flag since the row was read.
    async fn note_push_failure(&self, w: &WorkerRow, error: &PushError) {
        let error = error.to_string();
        self.seen(w, (None, None, Some(&error)), "recording the push failure")
            .await;
    }

    /// Pushes `chunk` concurrently: how many the gateway applied, and the failures.
    async fn push_chunk(
        &self,
        w: &WorkerRow,
        chunk: &[SandboxRow],
        revisions: bool,
    ) -> (i64, Vec<((String, i64), PushError)>) {
        let mut pushes = tokio::task::JoinSet::new();
        let (mut applied, mut failed) = (0, Vec::new());
        for s in chunk {
            let (url, token) = (w.admin_url.clone(), w.token.clone());
            let (id, generation) = (s.id.clone(), s.generation);
            let (method, path, body) = match request(s, revisions) {
                Ok(request) => request,
                Err(e) => {
                    failed.push(((id, generation), PushError::Unsendable(e)));
                    continue;
                }
            };
            let unreadable = unreadable(s).map(str::to_owned);
            pushes.spawn(async move {
                // A DELETE of a sandbox the gateway does not have is done;
                // a PUT answered 404 (by something else at the URL) is not.
                let gone = method == Method::DELETE;
                let outcome = call(&url, &token, method, &path, body.as_ref()).await;
                (id, generation, (gone, unreadable), outcome)
            });
        }
        while let Some(Ok((id, generation, (gone, unreadable), outcome))) = pushes.join_next().await
        {
            match outcome {
                // Forgotten by its gateway (its traffic denied), but not
                // pushed: a build that reads the policy pushes it.
                Ok((status, _))
                    if unreadable.is_some()
                        && (status.is_success() || status == StatusCode::NOT_FOUND) =>
                {
                    applied += i64::from(status.is_success());
                    let why = unreadable_left(&id, unreadable.as_deref().unwrap_or_default());
                    failed.push(((id, generation), PushError::Unsendable(why)));
                }
                Ok((status, _))
                    if status.is_success() || (gone && status == StatusCode::NOT_FOUND) =>
                {
                    match store::pushed(&self.pool, &id, generation).await {
                        Ok(lag) => self.metrics.push_latency_seconds.observe(lag),
                        Err(e) => logged::<()>(Err(e), "marking a sandbox pushed", &id),
                    }
                    self.count_push("applied");
                    applied += i64::from(status.is_success());
                }
                Ok((status, body)) => {
                    failed.push(((id, generation), PushError::refused(status, &body)));
                }
                Err(e) => failed.push(((id, generation), e.into())),
            }
        }
        (applied, failed)
    }

    fn count_push(&self, outcome: &'static str) {
        self.metrics
            .pushes
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }

    /// Replaces everything the gateway knows with the store's view.
    async fn resync(&self, w: &WorkerRow) -> Resynced {
        let view = store::resync_view(&self.pool, &w.id).await;
        let Some(view) = read(view, "reading the sandboxes to resync", &w.id) else {
            return Resynced::Failed;
        };
        let rows = &view.live;
        // The epoch before and after: the same one means the same process
        // took the resync (one that restarted meanwhile has another). The
        // one before also says whether it takes revisions.
        let before = self.gateway_state(w).await;
        let revisions = before.as_ref().is_some_and(|r| r.revisions);
        // NDJSON, streamed by the gateway: no size bound on a resync.
        let mut ndjson = String::new();
        for s in rows {
            match resync_line(s, revisions) {
                Ok(Some(line)) => ndjson.push_str(&line),
                Ok(None) => continue,
                // Left out (its traffic denied), not in the way of every
                // other sandbox of the worker: a resync refused here for
                // one row would leave the gateway on its old state for all.
                Err(error) => {
                    tracing::warn!(worker = %w.id, sandbox = %s.id, %error, "left out of the resync: the gateway forgets the sandbox, and its traffic is denied");
                    continue;
                }
            }
            ndjson.push('\n');
        }
        match crate::gateway_client::resync(&w.admin_url, &w.token, ndjson).await {
            Ok((status, body)) if status.is_success() => {
                let committed = body.get("generation").and_then(Value::as_i64);
                match self.resynced(w, &view, (before, committed)).await {
                    true => Resynced::Done,
                    false => Resynced::Failed,
                }
            }
            outcome => {
                let refused = matches!(&outcome, Ok((status, _)) if status.is_client_error());
                let error = match outcome {
                    Ok((status, body)) => PushError::refused(status, &body),
                    Err(e) => PushError::from(e),
                }
                .to_string();
                tracing::warn!(worker = %w.id, %error, "resync failed; will retry");
                self.count_push("failed");
                self.seen(
                    w,
                    (None, Some(true), Some(&error)),
                    "recording the resync failure",
                )
                .await;
                match refused {
                    true => Resynced::Refused,
                    false => Resynced::Failed,
                }
            }
        }
    }

    /// Records a resync the gateway answered: its epoch and generation, and
    /// every resynced sandbox pushed. If the epoch it reports now is not the
    /// one it reported before the resync (`before`; one missing and the
    /// other not counts), the answer may have come from a process that has
    /// since stopped: nothing is recorded but the flag, and the next round
    /// resyncs again. The generation acknowledged is the one the answer
    /// says the resync was committed at (`committed`): the one reported
    /// now may count another client's change since, which would then never
    /// be compared. A gateway of an earlier build says none: the one
    /// reported now.
    async fn resynced(
        &self,
        w: &WorkerRow,
        view: &store::ResyncView,
        (before, committed): (Option<Ready>, Option<i64>),
    ) -> bool {
        let ready = self.gateway_state(w).await;
        let epoch = ready.as_ref().map(|r| r.epoch.as_str());
        // Neither reading with an epoch (a gateway that reports none) is
        // no evidence of a restart: recorded as it was.
        if epoch != before.as_ref().map(|r| r.epoch.as_str()) {
            tracing::warn!(worker = %w.id, "the gateway restarted around its resync; resyncing again");
            self.seen(
                w,
                (None, Some(true), None),
                "flagging the gateway for resync",
            )
            .await;
            return false;
        }
        self.seen(w, (epoch, Some(false), None), "recording the resync")
            .await;
        let generation = committed.or(ready.as_ref().map(|r| r.generation));
        let acked = store::acknowledge(&self.pool, &w.id, generation, 0, w.lease.as_ref()).await;
        logged(acked, "acknowledging the resync", &w.id);
        // One whose policy does not read here was left out: not pushed.
        for s in view.live.iter().filter(|s| unreadable(s).is_none()) {
            let pushed = store::pushed(&self.pool, &s.id, s.generation).await;
            logged(pushed, "marking a resynced sandbox pushed", &s.id);
        }
        let marked = store::mark_forgotten(&self.pool, &view.forgotten).await;
        logged(marked, "marking the forgotten sandboxes pushed", &w.id);
        // Those left out for a policy that does not read here are gone from
        // the gateway now, even one a newer build had pushed: queued again,
        // for that build to push.
        let left_out: Vec<(String, i64)> = (view.live.iter())
            .filter(|s| unreadable(s).is_some())
            .map(|s| (s.id.clone(), s.generation))
            .collect();
        let queued = store::unsettle(&self.pool, &left_out).await;
        logged(queued, "queueing again the sandboxes left out", &w.id);
        tracing::info!(worker = %w.id, sandboxes = view.live.len(), "resynced the gateway");
        self.count_push("resync");
        true
    }

    /// The gateway's epoch and generation (`GET /readyz`); `None` while it
    /// is unreachable or not ready.
    async fn gateway_state(&self, w: &WorkerRow) -> Option<Ready> {
        self.readyz(w).await.ok().flatten()
    }

    /// The gateway's `/readyz`: `Err` when it did not answer, `Ok(None)`
    /// when it answered but is not ready (or said nothing readable).
    async fn readyz(&self, w: &WorkerRow) -> Result<Option<Ready>, ()> {
        let answer = call(&w.admin_url, &w.token, Method::GET, "/readyz", None).await;
        let (status, body) = answer.map_err(|error| {
            tracing::debug!(worker = %w.id, %error, "gateway not reachable");
        })?;
        if !status.is_success() {
            return Ok(None);
        }
        Ok(body.as_str().and_then(parse_ready))
    }

    /// Checks a gateway: its `/readyz`, and its list when the generation it
    /// reports is not the one acknowledged; [`plan`] decides. `true` when it
    /// is flagged for resync (it restarted, or its list drifted); a list
    /// found in step has its generation acknowledged.
    async fn check_gateway(&self, w: &WorkerRow) -> Checked {
        let Ok(state) = self.readyz(w).await else {
            return Checked::Silent;
        };
        let reported = state.as_ref().map(|r| (r.epoch.as_str(), r.generation));
        let known = Known {
            epoch: w.epoch.as_deref(),
            acknowledged: w.acked_generation,
        };
        let mut action = plan(known, reported, Listed::NotFetched);
        if action == Action::Compare {
            action = plan(known, reported, self.compare_list(w).await);
        }
        if let Some(outcome) = action.label() {
            self.count_compare(outcome);
        }
        let resync = match action {
            Action::Wait | Action::PushChanges | Action::Compare => false,
            Action::Acknowledge(generation) => {
                if generation.is_some() {
                    let acked =
                        store::acknowledge(&self.pool, &w.id, generation, 0, w.lease.as_ref())
                            .await;
                    logged(acked, "acknowledging the listed generation", &w.id);
                }
                false
            }
            Action::Resync(cause) => {
                let (restarted, drift) = (cause == Cause::Restarted, cause == Cause::Drift);
                tracing::warn!(worker = %w.id, restarted, drift, "gateway out of step; resyncing");
                self.seen(
                    w,
                    (None, Some(true), None),
                    "flagging the gateway for resync",
                )
                .await;
                true
            }
        };
        let revisions = state.is_some_and(|r| r.revisions);
        Checked::Answered { resync, revisions }
    }

    /// Compares the gateway's list with the store's rows.
    async fn compare_list(&self, w: &WorkerRow) -> Listed {
        // A few lists at once: each may be large, read whole and parsed.
        // Not waited for while this task holds its worker's permit (the
        // pushes of others would wait behind it): no verdict this time, the
        // next check compares.
        let Ok(_comparing) = COMPARING.try_acquire() else {
            return Listed::Inconclusive;
        };
        let size = store::listed_size(&self.pool, &w.id).await;
        let Some(size) = read(size, "reckoning the size of the gateway's list", &w.id) else {
            return Listed::Inconclusive;
        };
        let answer = crate::gateway_client::list(&w.admin_url, &w.token, size).await;
        let (status, body) = match answer {
            Ok(answer) => answer,
            Err(error) => {
                tracing::debug!(worker = %w.id, %error, "gateway list not fetched");
                return Listed::Inconclusive;
            }
        };
        if !status.is_success() {
            return Listed::Inconclusive;
        }
        // Read after the list: a row settled then was pushed (by this task)
        // before the list was fetched. Sandboxes with a change still being
        // pushed are left out of both sides: the gateway may hold either
        // side of the change. The rest is compared, so a worker whose
        // changes never stop is still checked; while any is pending, a
        // match says nothing of the generation.
        let settled = store::settled_sandboxes(&self.pool, &w.id).await;
        let Some(settled) = read(settled, "reading the sandboxes to compare", &w.id) else {
            return Listed::Inconclusive;
        };
        // A sandbox whose policy does not read here is not judged: a
        // newer build may have pushed it, and calling it drift would have
        // the resync drop it from its gateway.
        let mut unjudged = settled.pending.clone();
        unjudged.extend(
            settled
                .rows
                .iter()
                .filter(|s| unreadable(s).is_some())
                .map(|s| s.id.clone()),
        );
        if differs(&settled.rows, &body, &unjudged) {
            return Listed::Differs;
        }
        if !settled.pending.is_empty() {
            return Listed::Inconclusive;
        }
        Listed::Matches(body.get("generation").and_then(Value::as_i64))
    }

    fn count_compare(&self, outcome: &'static str) {
        self.metrics
            .compares
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }
}

/// Pushes a gateway refused as a sandbox's (`400`, `409`, `413`, `422`: a
/// sandbox past its `limits.max_sandboxes`, an address another still
/// holds, a row it cannot read), by sandbox and generation. Refused once,
/// a push is tried again in the next round (the address it waited for may
/// be free by then); refused twice, it is held back: left out of the
/// worker's pushes until a read reaches the end of its queue and an
/// interval has passed, so that many of them at the front do not stop
/// every change behind them, nor are sent again at every wake-up. A later
/// change of the sandbox (a destroy) is not held. Bounded by the worker's
/// sandboxes.
#[derive(Default)]
struct HeldPushes {
    /// The generation refused, and whether it is held back (a push that
    /// cannot be sent at all, [`PushError::Unsendable`], is held back at
    /// its first refusal: trying again cannot help).
    pushes: std::collections::HashMap<String, Refused>,
    /// When the first of them was held.
    since: Option<Instant>,
}

impl HeldPushes {
    /// Notes the refusal of `(id, generation)` when `error` refuses that
    /// sandbox: `true` (the queue moved on as if it were pushed); `None`
    /// for a failure that is the gateway's, the network's or the token's
    /// (the round stops).
    fn hold(&mut self, (id, generation): &(String, i64), error: &PushError) -> Option<bool> {
        let refused = match error {
            PushError::Refused { status, .. } => {
                matches!(status.as_u16(), 400 | 409 | 413 | 422)
            }
            PushError::Unsendable(_) | PushError::Stale { .. } => true,
            PushError::Unanswered(_) => false,
        };
        if !refused {
            return None;
        }
        let before = self.pushes.get(id).filter(|r| r.generation == *generation);
        let held = matches!(error, PushError::Unsendable(_)) || before.is_some();
        let refused = Refused {
            generation: *generation,
            held,
            this_pass: true,
        };
        self.pushes.insert(id.clone(), refused);
        if held {
            self.since.get_or_insert_with(Instant::now);
        }
        Some(true)
    }

    /// At the end of a pass (a read that reached the end of the queue,
    /// before its pushes go): forgets the refusals not held back that were
    /// not refused in the pass before (their pushes went again and were
    /// taken), and lets every held one go, to be tried again, once
    /// `interval` has passed since the first was held back.
    fn release(&mut self, interval: std::time::Duration) {
        self.pushes.retain(|_, r| r.held || r.this_pass);
        self.pushes.values_mut().for_each(|r| r.this_pass = false);
        let none_held = !self.pushes.values().any(|r| r.held);
        if none_held || self.since.is_some_and(|t| t.elapsed() >= interval) {
            self.pushes.retain(|_, r| !r.held);
            self.since = None;
        }
    }

    /// The pushes held back, as the store's query takes them.
    fn pairs(&self) -> (Vec<String>, Vec<i64>) {
        self.pushes
            .iter()
            .filter(|(_, r)| r.held)
            .map(|(id, r)| (id.clone(), r.generation))
            .unzip()
    }
}

/// A refused push of a sandbox ([`HeldPushes`]).
struct Refused {
    generation: i64,
    held: bool,
    /// Refused since the last [`HeldPushes::release`]: once refused, a
    /// push goes again in the next pass, and is held back if refused again.
    this_pass: bool,
}

/// How a resync ended.
enum Resynced {
    Done,
    /// The gateway answered with a refusal (`4xx`): it will not take one
    /// of the sandboxes as they stand.
    Refused,
    /// No answer, another failure, or a restart around it: tried again.
    Failed,
}

/// What a check of a gateway found.
enum Checked {
    /// No answer (its `/readyz` was not reached or timed out).
    Silent,
    /// An answer; `resync`: it is flagged for resync; `revisions`: its
    /// pushes may name a revision ([`Ready::revisions`]).
    Answered { resync: bool, revisions: bool },
}

/// How a push round (or a resync) ended.
enum Round {
    /// The gateway took something: go on.
    Moved,
    /// Nothing moved, the gateway answering (or nothing to push).
    Still,
    /// Nothing moved, the gateway silent (or the resync failed).
    Silent,
}

/// What one wake-up of a worker's task heard from its gateway.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Heard {
    Answered,
    Silent,
    /// Nothing asked of it.
    Nothing,
}

/// A worker task's own state between wake-ups.
struct Tending {
    compared: Instant,
    synced: Option<Instant>,
    /// A resync the gateway refused (a sandbox it will not take): tried
    /// again once per interval, the changes pushed meanwhile, so one
    /// sandbox does not hold up every other change of the worker.
    refused: Option<Instant>,
    /// Pushes the gateway refused as the sandbox's, held back a while
    /// ([`HeldPushes`]): the changes behind them go meanwhile.
    held: HeldPushes,
    silence: Silence,
    /// Its gateway's pushes may name a revision, as its last check said.
    revisions: bool,
}

impl Tending {
    fn new(resync_interval: Duration) -> Self {
        Self {
            compared: Instant::now() - resync_interval,
            synced: None,
            refused: None,
            held: HeldPushes::default(),
            silence: Silence::default(),
            revisions: false,
        }
    }
}

/// Misses in a row of a gateway that does not answer, and when the last
/// was: it is tried again after a backoff, under [`SILENT_AT_ONCE`].
#[derive(Debug, Default)]
struct Silence {
    misses: u32,
    last: Option<Instant>,
}

impl Silence {
    /// When a silent gateway may be tried again (`None`: now).
    fn next_try(&self) -> Option<Instant> {
        let wait = SILENT_BACKOFF_FIRST
            .saturating_mul(1 << self.misses.saturating_sub(1).min(16))
            .min(SILENT_BACKOFF_MAX);
        self.last.map(|at| at + wait)
    }

    fn note(&mut self, heard: Heard) {
        match heard {
            Heard::Answered => *self = Self::default(),
            Heard::Silent => {
                self.misses = self.misses.saturating_add(1);
                self.last = Some(Instant::now());
            }
            Heard::Nothing => {}
        }
    }
}

/// The permits of the workers' tasks: [`WORKERS_AT_ONCE`] for gateways
/// that answer, [`SILENT_AT_ONCE`] for those that did not last time.
#[derive(Clone)]
struct Permits {
    answering: Arc<tokio::sync::Semaphore>,
    silent: Arc<tokio::sync::Semaphore>,
}

/// A worker's row as last read: when it was read, the row, and until when
/// the leases it was read under are trusted.
type Wake = (Instant, WorkerRow, Instant);
type Seen = tokio::sync::watch::Receiver<Wake>;

/// The per-worker tasks ([`Dispatcher::tender`]): how to wake each (and
/// stop it), and the bound on how many work at once. Dropped (the tasks
/// aborted) when the session ends.
struct Tenders {
    workers: std::collections::HashMap<String, (tokio::sync::watch::Sender<Wake>, AbortHandle)>,
    tasks: tokio::task::JoinSet<()>,
    permits: Permits,
}

impl Default for Tenders {
    fn default() -> Self {
        Self {
            workers: Default::default(),
            tasks: tokio::task::JoinSet::new(),
            permits: Permits {
                answering: Arc::new(tokio::sync::Semaphore::new(WORKERS_AT_ONCE)),
                silent: Arc::new(tokio::sync::Semaphore::new(SILENT_AT_ONCE)),
            },
        }
    }
}

/// A store write whose failure the next round repairs (a push or resync
/// is retried until acknowledged): logged with what failed and for which
/// worker or sandbox, never dropped silently.
fn logged<T>(result: Result<T, sqlx::Error>, what: &str, subject: &str) {
    if let Err(error) = result {
        tracing::warn!(%subject, %error, "{what} failed; the next round retries");
    }
}

/// A store read whose failure skips what needed it this round (the next
/// round reads again): logged with what failed, never dropped silently.
fn read<T>(result: Result<T, sqlx::Error>, what: &str, subject: &str) -> Option<T> {
    match result {
        Ok(value) => Some(value),
        Err(error) => {
            tracing::warn!(%subject, %error, "{what} failed; the next round retries");
            None
        }
    }
}

/// Whether a live sandbox's stored policy is one this build cannot read
/// (a newer build wrote it, during a rolling upgrade). Its gateway is made
/// to forget it, as for any row that cannot be sent, but the change is not
/// marked pushed: a dispatcher of the build that wrote it pushes it.
/// Why a live sandbox's stored policy does not read in this build, if it
/// does not.
fn unreadable(s: &SandboxRow) -> Option<&str> {
    s.policy_unreadable
        .as_deref()
        .filter(|_| !s.state.is_ended())
}

/// Why a sandbox whose policy does not read here (`why`) stays unpushed.
fn unreadable_left(id: &str, why: &str) -> String {
    format!("sandbox {id}: its stored policy does not read in this build ({why}; a newer build may have written it): its gateway forgot it, and a dispatcher of a build that reads it pushes it")
}

/// What a sandbox row is on its gateway: `PUT /v1/sandboxes/{id}`'s body
/// (the contract's [`PutSandbox`]), or `None` for one the gateway must
/// forget. A row the contract cannot carry (an address that does not
/// parse) is an error, never sent. Its size is judged with its revision,
/// which it names only for a gateway that takes one (`revisions`): a
/// gateway takes the same sandboxes whichever build it is.
fn put_body(s: &SandboxRow, revisions: bool) -> Result<Option<Value>, String> {
    let Some(policy) = s.policy.clone().filter(|_| !s.state.is_ended()) else {
        return Ok(None);
    };
    let addresses = addresses(s)?;
    if !taken(s, &addresses) {
        return Ok(None);
    }
    let mut doc = PutSandbox {
        addresses,
        policy,
        credentials: Vec::new(),
        upstream_proxy: None,
        revision: revision(s),
    };
    let bytes = serde_json::to_vec(&doc).map_err(|e| e.to_string())?;
    if !fits(s, bytes.len()) {
        // Forgotten, not left under the policy the gateway last took: its
        // traffic is denied, and the pushes queued behind it go on.
        return Ok(None);
    }
    doc.revision = doc.revision.filter(|_| revisions);
    serde_json::to_value(doc)
        .map(Some)
        .map_err(|e| e.to_string())
}

/// The request that pushes a sandbox row: a `PUT` of [`put_body`], or a
/// `DELETE`, which names the revision to a gateway that takes one.
fn request(s: &SandboxRow, revisions: bool) -> Result<(Method, String, Option<Value>), String> {
    let path = egress_api::gateway::sandbox(&s.id);
    if let Some(body) = put_body(s, revisions)? {
        return Ok((Method::PUT, path, Some(body)));
    }
    let path = match revision(s).filter(|_| revisions) {
        Some(r) => format!("{path}?{}={r}", egress_api::gateway::REVISION),
        None => path,
    };
    Ok((Method::DELETE, path, None))
}

/// Whether a sandbox's document of `bytes` is one a gateway takes (a push
/// or a resync line, at most [`MAX_BODY`]); one larger is logged here.
/// The API refuses such a policy when it is written; composition (an
/// approval, a profile) can still grow one past it.
fn fits(s: &SandboxRow, bytes: usize) -> bool {
    let fits = bytes <= MAX_BODY;
    if !fits {
        tracing::warn!(sandbox = %s.id, bytes, max = MAX_BODY, "the sandbox's effective policy is larger than a gateway takes: the gateway forgets the sandbox, and its traffic is denied");
    }
    fits
}

/// Whether a gateway takes the sandbox's `addresses` (the contract's
/// [`egress_api::gateway::sandbox_addresses`]: a link-local one is refused,
/// as a worker's pool registered before the controller refused such pools
/// can still hold); one it refuses is logged here. Such a sandbox is
/// forgotten by a push and left out of a resync, which the gateway would
/// otherwise refuse whole for every other sandbox of the worker.
fn taken(s: &SandboxRow, addresses: &[std::net::IpAddr]) -> bool {
    let Err(why) = egress_api::gateway::sandbox_addresses(addresses) else {
        return true;
    };
    say_refused(s, &why);
    false
}

fn say_refused(s: &SandboxRow, why: &str) {
    tracing::warn!(sandbox = %s.id, %why, "a gateway refuses the sandbox's address: the gateway forgets the sandbox, and its traffic is denied");
}

/// Why a sandbox row is not sent to its gateway ([`line_of`]).
enum LeftOut {
    /// Its stored policy does not read.
    NoPolicy,
    /// The contract cannot carry it (an address that does not parse).
    Unsendable(String),
    /// The gateway refuses an address ([`taken`]).
    Refused(String),
    /// Its document is larger than a gateway takes ([`fits`]).
    TooLarge(usize),
}

/// A sandbox row as one line of a streamed resync (the contract's
/// [`SandboxDoc`]), or why a gateway is not sent it: what [`resync_line`]
/// sends and what the drift check expects a gateway to hold ([`sent`]).
/// Its size is judged with its revision, named only for a gateway that
/// takes one (`revisions`), as [`put_body`]'s.
fn line_of(s: &SandboxRow, revisions: bool) -> Result<String, LeftOut> {
    let policy = s.policy.clone().ok_or(LeftOut::NoPolicy)?;
    let addresses = addresses(s).map_err(LeftOut::Unsendable)?;
    egress_api::gateway::sandbox_addresses(&addresses).map_err(LeftOut::Refused)?;
    let mut doc = doc_of(s, addresses, policy);
    let unsendable = |e: serde_json::Error| LeftOut::Unsendable(e.to_string());
    let line = serde_json::to_string(&doc).map_err(unsendable)?;
    if line.len() > MAX_BODY {
        return Err(LeftOut::TooLarge(line.len()));
    }
    if revisions {
        return Ok(line);
    }
    doc.revision = None;
    serde_json::to_string(&doc).map_err(unsendable)
}

/// Whether a gateway is sent the row ([`line_of`]), without a warning.
fn sent(s: &SandboxRow) -> bool {
    line_of(s, true).is_ok()
}

/// The contract's document of a sandbox row.
fn doc_of(s: &SandboxRow, addresses: Vec<std::net::IpAddr>, policy: Policy) -> SandboxDoc {
    SandboxDoc {
        id: s.id.clone(),
        addresses,
        policy,
        credentials: Vec::new(),
        upstream_proxy: None,
        shadow: None,
        revision: revision(s),
    }
}

/// The revision a gateway is sent with a sandbox: its generation, which
/// every change the gateway must see moves up. A push held up on its way
/// that arrives after a later one is refused by it.
fn revision(s: &SandboxRow) -> Option<u64> {
    u64::try_from(s.generation).ok()
}

/// A sandbox row as one line of a streamed resync ([`line_of`]); `None`,
/// said here, for one too large for a gateway, at an address a gateway
/// refuses or without a policy (one stored that no longer reads), left out
/// as [`put_body`] forgets it (the gateway does not know it: its traffic
/// is denied).
fn resync_line(s: &SandboxRow, revisions: bool) -> Result<Option<String>, String> {
    match line_of(s, revisions) {
        Ok(line) => Ok(Some(line)),
        Err(LeftOut::Unsendable(e)) => Err(e),
        Err(LeftOut::NoPolicy) => {
            tracing::warn!(sandbox = %s.id, "the sandbox has no policy that reads: left out of the resync, its traffic is denied");
            Ok(None)
        }
        Err(LeftOut::Refused(why)) => {
            say_refused(s, &why);
            Ok(None)
        }
        Err(LeftOut::TooLarge(bytes)) => {
            let _said = fits(s, bytes);
            Ok(None)
        }
    }
}

fn addresses(s: &SandboxRow) -> Result<Vec<std::net::IpAddr>, String> {
    s.addresses
        .iter()
        .map(|a| {
            a.parse()
                .map_err(|_| format!("sandbox {}: address {a:?} is not an IP address", s.id))
        })
        .collect()
}

/// What a gateway's `GET /readyz` says: `ready epoch=… generation=…`,
/// and `revisions=1` from a build that takes a push's revision.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Ready {
    epoch: String,
    generation: i64,
    /// Its pushes may name a revision: a gateway of an earlier build
    /// refuses a document with the field.
    revisions: bool,
}

fn parse_ready(text: &str) -> Option<Ready> {
    let (mut epoch, mut generation, mut revisions) = (None, None, false);
    for word in text.split_whitespace() {
        if let Some(e) = word.strip_prefix("epoch=") {
            epoch = Some(e.to_owned());
        } else if let Some(g) = word.strip_prefix("generation=") {
            generation = g.parse().ok();
        } else if word == "revisions=1" {
            revisions = true;
        }
    }
    Some(Ready {
        epoch: epoch?,
        generation: generation?,
        revisions,
    })
}

/// Whether the gateway's list differs from the store's rows, the
/// sandboxes in `pending` left out of its side (the rows hold none).
fn differs(
    rows: &[SandboxRow],
    gateway: &Value,
    pending: &std::collections::BTreeSet<String>,
) -> bool {
    let theirs: BTreeMap<&str, (Vec<String>, Option<Policy>)> = gateway
        .get("sandboxes")
        .and_then(Value::as_array)
        .map(|list| {
            list.iter()
                .filter_map(|s| {
                    let id = s.get("id")?.as_str()?;
                    if pending.contains(id) {
                        return None;
                    }
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
    // Only what a gateway is sent: one left out never shows there.
    let ours: BTreeMap<&str, (Vec<String>, Option<Policy>)> = rows
        .iter()
        .filter(|s| sent(s))
        .map(|s| (s.id.as_str(), (s.addresses.clone(), s.policy.clone())))
        .collect();
    theirs != ours
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::SandboxState;

    fn conflict() -> PushError {
        PushError::refused(StatusCode::CONFLICT, &Value::Null)
    }

    /// Passes over a short queue (each read reaches its end): a push
    /// refused twice in a row is held back until the interval passes.
    /// Before, the start of the second pass forgot the first refusal, so
    /// such a push was never held: it went again at every round.
    #[test]
    fn a_push_refused_twice_over_a_short_queue_is_held_back() {
        let mut held = HeldPushes::default();
        let a = ("sb-a".to_owned(), 3);
        let hour = Duration::from_secs(3600);
        held.release(hour);
        assert_eq!(held.hold(&a, &conflict()), Some(true));
        assert!(held.pairs().0.is_empty(), "once refused: tried again");
        held.release(hour);
        assert!(held.pairs().0.is_empty());
        held.hold(&a, &conflict());
        assert_eq!(held.pairs(), (vec!["sb-a".to_owned()], vec![3]));
        held.release(hour);
        assert_eq!(held.pairs().0.len(), 1, "held until the interval passes");
        held.release(Duration::ZERO);
        assert!(held.pairs().0.is_empty(), "let go once it passed");
        // One taken on its second try is forgotten.
        let b = ("sb-b".to_owned(), 1);
        held.hold(&b, &conflict());
        held.release(hour);
        held.release(hour);
        assert!(held.pushes.is_empty());
    }

    /// A row that cannot be sent at all is held back at once.
    #[test]
    fn an_unsendable_push_is_held_back_at_its_first_refusal() {
        let mut held = HeldPushes::default();
        let a = ("sb-a".to_owned(), 3);
        held.hold(&a, &PushError::Unsendable("unreadable".into()));
        assert_eq!(held.pairs(), (vec!["sb-a".to_owned()], vec![3]));
    }

    /// A policy of at least `bytes` in normal form: allows of numbered names.
    pub(crate) fn policy_of(bytes: usize) -> Policy {
        let entries: Vec<String> = (0..bytes / 30 + 1)
            .map(|i| format!(r#"{{"domain": "n{i}.example.test"}}"#))
            .collect();
        Policy::from_json(&format!(r#"{{"allow": [{}]}}"#, entries.join(","))).expect("policy")
    }

    fn row(policy: Policy) -> SandboxRow {
        SandboxRow {
            id: "sb-1".into(),
            tenant: "t".into(),
            template: "base".into(),
            egress_profiles: Vec::new(),
            policy: Some(policy),
            policy_unreadable: None,
            inherits_template: false,
            provenance: Value::Null,
            state: SandboxState::Running,
            worker: Some("w1".into()),
            addresses: vec!["100.64.1.2".into()],
            generation: 1,
        }
    }

    /// A sandbox whose document a gateway would refuse (`413`) is neither
    /// left under the policy the gateway last took nor in the way of the
    /// pushes behind it: the gateway is told to forget it, and a resync
    /// leaves it out.
    #[test]
    fn a_sandbox_too_large_for_a_gateway_is_forgotten_there() {
        let small = row(policy_of(100));
        assert!(put_body(&small, true).expect("sendable").is_some(), "a PUT");
        assert!(resync_line(&small, true).expect("sendable").is_some());
        let large = row(policy_of(MAX_BODY));
        assert_eq!(put_body(&large, true).expect("sendable"), None, "a DELETE");
        assert_eq!(
            resync_line(&large, true).expect("sendable"),
            None,
            "left out"
        );
    }

    /// A push and a resync line name the sandbox's generation as its
    /// revision only to a gateway that takes one: an earlier build refuses
    /// a document with the field.
    #[test]
    fn a_revision_is_named_only_to_a_gateway_that_takes_one() {
        let mut r = row(policy_of(100));
        r.generation = 7;
        let put = |revisions| put_body(&r, revisions).expect("sendable").expect("a PUT");
        assert_eq!(put(true)["revision"], 7);
        assert_eq!(put(false).get("revision"), None);
        let line = |revisions| {
            resync_line(&r, revisions)
                .expect("sendable")
                .expect("a line")
        };
        let (with, without): (Value, Value) = (
            serde_json::from_str(&line(true)).expect("json"),
            serde_json::from_str(&line(false)).expect("json"),
        );
        assert_eq!(
            (with["revision"].clone(), without.get("revision")),
            (serde_json::json!(7), None)
        );
    }

    /// A row whose stored policy no longer reads (`None`) is forgotten by a
    /// push and left out of a resync, as one too large is: never a resync
    /// refused for the whole worker, whose other changes would then never go.
    #[test]
    fn a_sandbox_without_a_policy_that_reads_is_left_out_of_a_resync() {
        let mut unreadable = row(policy_of(100));
        unreadable.policy = None;
        assert_eq!(put_body(&unreadable, true), Ok(None), "a DELETE");
        assert_eq!(resync_line(&unreadable, true), Ok(None), "left out");
    }

    /// A sandbox at an address a gateway refuses (link-local, from a pool
    /// registered before such pools were refused) is forgotten by a push
    /// and left out of a resync: the gateway refuses a resync whole for
    /// one such line, and the worker's other sandboxes would then never
    /// get their changes.
    #[test]
    fn a_sandbox_at_an_address_a_gateway_refuses_is_left_out_of_a_resync() {
        for refused in [
            &["169.254.1.2"][..],
            &["100.64.1.2", "fe80::2"],
            &["0.0.0.0"],
        ] {
            let mut at = row(policy_of(100));
            at.addresses = refused.iter().map(|a| (*a).to_owned()).collect();
            assert_eq!(put_body(&at, true), Ok(None), "a DELETE for {refused:?}");
            assert_eq!(resync_line(&at, true), Ok(None), "left out for {refused:?}");
        }
        let mut fine = row(policy_of(100));
        fine.addresses = vec!["100.64.1.2".into(), "2001:db8::2".into()];
        assert!(put_body(&fine, true).expect("sendable").is_some());
        assert!(resync_line(&fine, true).expect("sendable").is_some());
    }

    /// The drift check's side of the store holds only what a gateway is
    /// sent: a sandbox left out (at an address a gateway refuses, too
    /// large, its policy unreadable) missing from the gateway's list is no
    /// drift.
    #[test]
    fn sandboxes_left_out_are_not_drift() {
        let listed = |rows: &[&SandboxRow]| {
            let list: Vec<Value> = rows
                .iter()
                .map(|r| serde_json::json!({"id": r.id, "addresses": r.addresses, "policy": r.policy}))
                .collect();
            serde_json::json!({ "sandboxes": list })
        };
        let fine = row(policy_of(100));
        let mut linked = row(policy_of(100));
        linked.id = "sb-2".into();
        linked.addresses = vec!["169.254.1.2".into()];
        let mut large = row(policy_of(MAX_BODY));
        large.id = "sb-3".into();
        let mut unreadable = row(policy_of(100));
        unreadable.id = "sb-4".into();
        unreadable.policy = None;
        let none = std::collections::BTreeSet::new();
        let rows = [fine.clone(), linked, large, unreadable];
        assert!(!differs(&rows, &listed(&[&fine]), &none));
        assert!(
            differs(&rows, &listed(&[]), &none),
            "the one sent is missing"
        );
    }

    #[test]
    fn readiness_line() {
        let ready = |revisions| {
            Some(Ready {
                epoch: "0a1b".to_owned(),
                generation: 42,
                revisions,
            })
        };
        assert_eq!(
            parse_ready("ready epoch=0a1b generation=42\n"),
            ready(false)
        );
        assert_eq!(
            parse_ready("ready epoch=0a1b generation=42 revisions=1\n"),
            ready(true)
        );
        assert_eq!(parse_ready("ready epoch=0a1b\n"), None);
        assert_eq!(parse_ready("ready epoch=0a1b generation=x\n"), None);
        assert_eq!(parse_ready("not ready\n"), None);
    }
}
