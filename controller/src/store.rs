//! The PostgreSQL store: schema by versioned migrations (sqlx's migrator,
//! applied at startup), and every statement the roles run. Statements are
//! static SQL with bound parameters.

use std::time::Duration;

use egress_policy::Policy;
use serde_json::{json, Value};
use sqlx::postgres::{PgPool, PgPoolOptions, PgRow};
use sqlx::types::Json;
use sqlx::{Connection, PgConnection, Row};

use crate::state::{OperationKind, OperationState, SandboxState};

pub mod alloc;
pub mod approvals;
pub mod leases;
pub mod list;
pub mod locks;
pub mod pool;
pub mod shadow;

/// The schema, embedded at build time from `controller/migrations/`.
/// Migrations a newer build applied and this one does not know are
/// ignored, not refused: in a rolling upgrade an old replica that restarts
/// must start against the new schema (migrations only add; see
/// docs/operations.md, "Fleet: the controller's PostgreSQL in production").
/// Under sqlx's migration lock, so replicas starting together apply each
/// migration once.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate::Migrator {
    ignore_missing: true,
    ..sqlx::migrate!("./migrations")
};

/// Connects (bounded waits) and brings the schema up to date. The pool's
/// connections end a statement after [`STATEMENT_TIMEOUT`] and a wait for a
/// lock after [`LOCK_TIMEOUT`] (an error: `503` on the API, a retry in the
/// dispatcher); the migrations run on a connection of their own without
/// them, since a replica waits there for another's migration to finish.
pub async fn connect(url: &str) -> Result<PgPool, String> {
    let cannot = |e: sqlx::Error| format!("DATABASE_URL: cannot connect: {e}");
    let options = connect_options(url).map_err(cannot)?;
    let mut migrating = tokio::time::timeout(CONNECT_TIMEOUT, PgConnection::connect_with(&options))
        .await
        .map_err(|_| format!("DATABASE_URL: cannot connect within {CONNECT_TIMEOUT:?}"))?
        .map_err(cannot)?;
    MIGRATOR
        .run(&mut migrating)
        .await
        .map_err(|e| format!("database migration failed: {e}"))?;
    drop(migrating);
    // Set on each new connection (`SET`, which PgBouncer in session mode
    // passes on, where it refuses such startup options).
    PgPoolOptions::new()
        .max_connections(16)
        .acquire_timeout(CONNECT_TIMEOUT)
        .after_connect(|conn, _| Box::pin(async move { bounded(conn).await }))
        .connect_with(options)
        .await
        .map_err(cannot)
}

/// The connection settings of `url`, without the `extra_float_digits`
/// startup parameter sqlx sends by default: PgBouncer refuses it (unless
/// told to ignore it), and no value here is read as text.
pub fn connect_options(url: &str) -> Result<sqlx::postgres::PgConnectOptions, sqlx::Error> {
    let options: sqlx::postgres::PgConnectOptions = url.parse()?;
    Ok(options.extra_float_digits(None))
}

/// Bounds a session's statements ([`STATEMENT_TIMEOUT`]), lock waits
/// ([`LOCK_TIMEOUT`]) and idle transactions ([`IDLE_IN_TRANSACTION`]),
/// and has the server probe its client ([`KEEPALIVES`]): a controller that
/// died or was cut off without a FIN (a crashed host, a partition) would
/// otherwise keep its locks, a transaction's rows and the dispatcher's
/// session lock, until the operating system's keepalive of two hours.
pub async fn bounded(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    let (idle, interval, count) = KEEPALIVES;
    let sql = format!(
        "SET statement_timeout = '{}ms'; SET lock_timeout = '{}ms'; \
         SET idle_in_transaction_session_timeout = '{}ms'; \
         SET tcp_keepalives_idle = {idle}; SET tcp_keepalives_interval = {interval}; \
         SET tcp_keepalives_count = {count}",
        STATEMENT_TIMEOUT.as_millis(),
        LOCK_TIMEOUT.as_millis(),
        IDLE_IN_TRANSACTION.as_millis(),
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(conn)
        .await?;
    Ok(())
}

/// The longest wait for a connection.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest statement on a pool connection.
pub const STATEMENT_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest wait for a row or advisory lock on a pool connection.
pub const LOCK_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest a transaction may sit idle: its longest legitimate pause is
/// one gateway call (5 s).
pub const IDLE_IN_TRANSACTION: Duration = Duration::from_secs(60);
/// The server's TCP keepalive on a session (seconds idle, seconds between
/// probes, probes): a client gone without a word is found in about 25 s.
/// Unix-socket sessions have none, and need none.
pub const KEEPALIVES: (u32, u32, u32) = (10, 5, 3);

/// A sandbox as stored.
#[derive(Clone, Debug)]
pub struct SandboxRow {
    pub id: String,
    pub tenant: String,
    pub template: String,
    pub egress_profiles: Vec<String>,
    pub policy: Option<Policy>,
    /// A policy is stored that this build cannot read (one a build of
    /// another version wrote): why it does not read; `policy` is `None`
    /// then.
    pub policy_unreadable: Option<String>,
    pub inherits_template: bool,
    pub provenance: Value,
    pub state: SandboxState,
    pub worker: Option<String>,
    pub addresses: Vec<String>,
    pub generation: i64,
}

impl SandboxRow {
    fn from_row(r: &PgRow) -> Result<Self, sqlx::Error> {
        let stored: Option<Json<Value>> = r.try_get("policy")?;
        let read = stored
            .as_ref()
            .map(|Json(v)| Policy::from_json(&v.to_string()));
        let (policy, policy_unreadable) = match read {
            Some(Ok(policy)) => (Some(policy), None),
            Some(Err(e)) => (None, Some(e.to_string())),
            None => (None, None),
        };
        Ok(Self {
            policy_unreadable,
            id: r.try_get("id")?,
            tenant: r.try_get("tenant")?,
            template: r.try_get("template")?,
            egress_profiles: r.try_get("egress_profiles")?,
            policy,
            inherits_template: r.try_get("inherits_template")?,
            provenance: r.try_get::<Json<Value>, _>("provenance")?.0,
            state: state(r)?,
            worker: r.try_get("worker")?,
            addresses: r.try_get("addresses")?,
            generation: r.try_get("generation")?,
        })
    }

    /// The API's document for this sandbox.
    pub fn document(&self) -> Value {
        json!({
            "id": self.id,
            "tenant": self.tenant,
            "template": self.template,
            "egress_profiles": self.egress_profiles,
            "policy": self.policy,
            "inherits_template": self.inherits_template,
            "provenance": self.provenance,
            "state": self.state,
            "worker": self.worker,
            "addresses": self.addresses,
        })
    }
}

/// The `state` column, checked: a value the code does not know is a
/// decode error, never a guess.
fn state(r: &PgRow) -> Result<SandboxState, sqlx::Error> {
    checked(r.try_get("state")?, "state")
}

/// `text` of `column` as its enum; a value the code does not know is a
/// decode error.
fn checked<T: std::str::FromStr<Err = String>>(
    text: String,
    column: &str,
) -> Result<T, sqlx::Error> {
    text.parse().map_err(|e: String| sqlx::Error::ColumnDecode {
        index: column.into(),
        source: e.into(),
    })
}

pub async fn sandbox(conn: &mut PgConnection, id: &str) -> Result<Option<SandboxRow>, sqlx::Error> {
    let row = sqlx::query(
        "SELECT id, tenant, template, egress_profiles, policy, inherits_template, provenance, state, worker, addresses, generation FROM sandboxes WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(&mut *conn)
    .await?;
    row.as_ref().map(SandboxRow::from_row).transpose()
}

/// As [`sandbox`], locking the row until the transaction ends.
pub async fn sandbox_for_update(
    conn: &mut PgConnection,
    id: &str,
) -> Result<Option<SandboxRow>, sqlx::Error> {
    let row = sqlx::query(
        "SELECT id, tenant, template, egress_profiles, policy, inherits_template, provenance, state, worker, addresses, generation FROM sandboxes WHERE id = $1 FOR UPDATE",
    )
    .bind(id)
    .fetch_optional(&mut *conn)
    .await?;
    row.as_ref().map(SandboxRow::from_row).transpose()
}

/// A new sandbox, `creating` until its create runs.
pub struct NewSandbox<'a> {
    pub id: &'a str,
    pub tenant: &'a str,
    pub template: &'a str,
    pub egress_profiles: &'a [String],
    pub inherits_template: bool,
}

/// Takes the tenant's lock, held to the end of the transaction. A create
/// holds it from its count until it commits (its sandbox's row, not yet
/// committed, invisible to others meanwhile); an approval's change takes it
/// before looking for the sandboxes it reaches, so it waits for such a
/// create and then sees its sandbox.
pub async fn lock_tenant(conn: &mut PgConnection, tenant: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_advisory_xact_lock(7311, hashtext($1))")
        .bind(tenant)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// The sandboxes `tenant` holds (neither destroyed nor failed), counted
/// under a lock on the tenant held to the end of the transaction: two
/// creates at once cannot both pass at its limit.
pub async fn held_by_tenant(conn: &mut PgConnection, tenant: &str) -> Result<i64, sqlx::Error> {
    lock_tenant(conn, tenant).await?;
    sqlx::query_scalar(
        "SELECT count(*) FROM sandboxes WHERE tenant = $1 AND state NOT IN ('destroyed', 'failed')",
    )
    .bind(tenant)
    .fetch_one(&mut *conn)
    .await
}

pub async fn insert_sandbox(
    conn: &mut PgConnection,
    s: &NewSandbox<'_>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO sandboxes (id, tenant, template, egress_profiles, inherits_template, state) VALUES ($1, $2, $3, $4, $5, 'creating')",
    )
    .bind(s.id)
    .bind(s.tenant)
    .bind(s.template)
    .bind(s.egress_profiles)
    .bind(s.inherits_template)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Saves a new effective policy (and, on a create, placement); the worker's
/// gateway sees it on the next push.
pub struct Placement<'a> {
    pub policy: &'a Policy,
    pub inherits_template: bool,
    pub provenance: Value,
    pub state: SandboxState,
    pub worker: Option<&'a str>,
    pub addresses: &'a [String],
}

pub async fn save_effective(
    conn: &mut PgConnection,
    id: &str,
    p: &Placement<'_>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE sandboxes SET policy = $2, inherits_template = $3, provenance = $4, state = $5, worker = COALESCE($6, worker), addresses = $7, generation = generation + 1, changed_at = now() WHERE id = $1",
    )
    .bind(id)
    .bind(Json(serde_json::to_value(p.policy).unwrap_or_default()))
    .bind(p.inherits_template)
    .bind(Json(&p.provenance))
    .bind(p.state.as_str())
    .bind(p.worker)
    .bind(p.addresses)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// A lifecycle state change; `destroyed` and `failed` also bump the
/// generation so the gateway is told to forget the sandbox (a failed claim
/// of a warm-pool sandbox is on its gateway already).
pub async fn set_state(
    conn: &mut PgConnection,
    id: &str,
    state: SandboxState,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE sandboxes SET state = $2, generation = generation + CASE WHEN $2 IN ('destroyed', 'failed') THEN 1 ELSE 0 END, changed_at = CASE WHEN $2 IN ('destroyed', 'failed') THEN now() ELSE changed_at END WHERE id = $1",
    )
    .bind(id)
    .bind(state.as_str())
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Marks a sandbox still being created failed (its create, fork or claim
/// failed for good); one in any other state is left as it is.
pub async fn fail_creating(conn: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE sandboxes SET state = 'failed', generation = generation + 1, changed_at = now() WHERE id = $1 AND state = 'creating'",
    )
    .bind(id)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

// === templates and workers ===

pub async fn put_template(pool: &PgPool, id: &str, policy: &Policy) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO templates (id, policy) VALUES ($1, $2) ON CONFLICT (id) DO UPDATE SET policy = EXCLUDED.policy, updated_at = now()",
    )
    .bind(id)
    .bind(Json(serde_json::to_value(policy).unwrap_or_default()))
    .execute(pool)
    .await?;
    Ok(())
}

/// A template's policy; `None`: no such template. One this build cannot
/// read (a newer build's, during a rolling upgrade) is a decode error,
/// which callers answer as a database error to retry (`503`, an
/// operation retried), not as a template that is not registered.
pub async fn template_policy(
    conn: &mut PgConnection,
    id: &str,
) -> Result<Option<Policy>, sqlx::Error> {
    let row = sqlx::query("SELECT policy FROM templates WHERE id = $1")
        .bind(id)
        .fetch_optional(&mut *conn)
        .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    let Json(v) = row.try_get::<Json<Value>, _>("policy")?;
    Policy::from_json(&v.to_string()).map(Some).map_err(|e| {
        sqlx::Error::Decode(
            format!("template {id:?}'s stored policy does not read here: {e}").into(),
        )
    })
}

/// A worker's gateway.
#[derive(Clone, Debug)]
pub struct WorkerRow {
    pub id: String,
    pub admin_url: String,
    pub token: String,
    pub pool: String,
    pub epoch: Option<String>,
    pub needs_resync: bool,
    /// The gateway generation the store last acknowledged (see
    /// `0005_shards_alloc.sql`); `None`: unknown.
    pub acked_generation: Option<i64>,
    /// How many times the worker was registered when the row was read: a
    /// resync clears `needs_resync` only if it is still the stored count
    /// ([`worker_seen`]).
    pub registrations: i64,
    /// The lease of the worker's shard the row was read under (by
    /// [`workers_in`]; not stored): what the dispatcher records of the
    /// worker's gateway is kept only while that lease holds
    /// ([`acknowledge`], [`worker_seen`]).
    pub lease: Option<Lease>,
}

/// Registers worker `id` (or changes it), its gateway flagged for a
/// resync; `Ok(Err(other))` when worker `other` is registered with the
/// same gateway ([`same_gateway`]), nothing written then. Registrations
/// take one lock, so two at once cannot both pass the check.
pub async fn put_worker(
    pool: &PgPool,
    id: &str,
    admin_url: &str,
    token: &str,
    addresses: &str,
) -> Result<Result<(), String>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(7313, 0)")
        .execute(&mut *tx)
        .await?;
    let others: Vec<(String, String)> =
        sqlx::query_as("SELECT id, admin_url FROM workers WHERE id <> $1 ORDER BY id")
            .bind(id)
            .fetch_all(&mut *tx)
            .await?;
    if let Some((other, _)) = others
        .into_iter()
        .find(|(_, url)| same_gateway(url, admin_url))
    {
        return Ok(Err(other));
    }
    sqlx::query(
        "INSERT INTO workers (id, admin_url, token, pool) VALUES ($1, $2, $3, $4) ON CONFLICT (id) DO UPDATE SET admin_url = EXCLUDED.admin_url, token = EXCLUDED.token, pool = EXCLUDED.pool, needs_resync = true, registrations = workers.registrations + 1, updated_at = now()",
    )
    .bind(id)
    .bind(admin_url)
    .bind(token)
    .bind(addresses)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Ok(()))
}

/// Whether two admin URLs name one gateway as written: the same address
/// (however written) or name (any case, a trailing dot or not), and port
/// (80 when none is written). Two names for one address are not found.
pub fn same_gateway(a: &str, b: &str) -> bool {
    gateway_of(a).is_some_and(|a| Some(a) == gateway_of(b))
}

/// The gateway an admin URL names, as [`same_gateway`] compares them: its
/// host (an address in standard notation, or a name in lower case without
/// a trailing dot) and port.
fn gateway_of(url: &str) -> Option<(String, u16)> {
    let uri: http::Uri = url.parse().ok()?;
    let authority = uri.authority()?;
    let host = authority.host();
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let host = match bare.parse::<std::net::IpAddr>() {
        Ok(ip) => ip.to_canonical().to_string(),
        Err(_) => host.trim_end_matches('.').to_ascii_lowercase(),
    };
    Some((host, authority.port_u16().unwrap_or(80)))
}

/// Of `workers` (id, admin URL), the groups registered with one gateway
/// ([`same_gateway`]), each in the order given: registrations are refused
/// that would make one, but a store written before they were may hold
/// some, and their resyncs undo each other's pushes.
pub fn sharing_gateways<'a>(
    workers: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Vec<Vec<String>> {
    let mut groups: Vec<Vec<String>> = Vec::new();
    let mut at: std::collections::HashMap<(String, u16), usize> = Default::default();
    for (id, url) in workers {
        let Some(gateway) = gateway_of(url) else {
            continue;
        };
        let i = *at.entry(gateway).or_insert_with(|| {
            groups.push(Vec::new());
            groups.len() - 1
        });
        groups[i].push(id.to_owned());
    }
    groups.retain(|g| g.len() > 1);
    groups
}

/// The workers registered with one gateway ([`sharing_gateways`]).
pub async fn workers_sharing_gateways(pool: &PgPool) -> Result<Vec<Vec<String>>, sqlx::Error> {
    let workers: Vec<(String, String)> =
        sqlx::query_as("SELECT id, admin_url FROM workers ORDER BY id")
            .fetch_all(pool)
            .await?;
    Ok(sharing_gateways(
        workers.iter().map(|(id, url)| (id.as_str(), url.as_str())),
    ))
}

/// One worker, by id.
pub async fn worker(pool: &PgPool, id: &str) -> Result<Option<WorkerRow>, sqlx::Error> {
    let row = sqlx::query(
        "SELECT id, admin_url, token, pool, epoch, needs_resync, acked_generation, registrations FROM workers WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(pool)
    .await?;
    row.as_ref().map(WorkerRow::from_row).transpose()
}

/// The workers of `shards` (those a dispatcher holds), each with the
/// lease of its shard as it is now.
pub async fn workers_in(pool: &PgPool, shards: &[i32]) -> Result<Vec<WorkerRow>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT w.id, w.admin_url, w.token, w.pool, w.epoch, w.needs_resync, w.acked_generation, w.registrations, d.holder, d.handovers FROM workers w JOIN dispatcher_shards d ON d.shard = egress_worker_shard(w.id) WHERE egress_worker_shard(w.id) = ANY($1) ORDER BY w.id",
    )
    .bind(shards)
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|r| {
            let lease = match r.try_get::<Option<String>, _>("holder")? {
                Some(holder) => Some(Lease {
                    holder,
                    term: r.try_get("handovers")?,
                }),
                None => None,
            };
            Ok(WorkerRow {
                lease,
                ..WorkerRow::from_row(r)?
            })
        })
        .collect()
}

impl WorkerRow {
    fn from_row(r: &PgRow) -> Result<Self, sqlx::Error> {
        Ok(Self {
            id: r.try_get("id")?,
            admin_url: r.try_get("admin_url")?,
            token: r.try_get("token")?,
            pool: r.try_get("pool")?,
            epoch: r.try_get("epoch")?,
            needs_resync: r.try_get("needs_resync")?,
            acked_generation: r.try_get("acked_generation")?,
            registrations: r.try_get("registrations")?,
            lease: None,
        })
    }
}

/// The gateway generation the store acknowledges for a worker: `Some` sets
/// it (after a resync or a list found in step), `None` adds `applied`
/// pushes to it.
pub async fn acknowledge(
    pool: &PgPool,
    id: &str,
    generation: Option<i64>,
    applied: i64,
    lease: Option<&Lease>,
) -> Result<(), sqlx::Error> {
    let sql = format!("UPDATE workers SET acked_generation = COALESCE($2, acked_generation + $3) WHERE id = $1 AND {HOLDS}");
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(id)
        .bind(generation)
        .bind(applied)
        .bind(lease.map(|l| l.holder.as_str()))
        .bind(lease.map(|l| l.term))
        .execute(pool)
        .await?;
    Ok(())
}

/// The lease of a worker's shard a dispatcher read the worker under: its
/// own id, and the shard's term then (`handovers`: one more each time the
/// shard changes hands, so a lease lost and taken back is another term).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    pub holder: String,
    pub term: i64,
}

/// The condition on a worker's row (`$1`) that the dispatcher `$4` still
/// holds the lease of its shard in the term `$5` (`$4` none: any). A
/// dispatcher whose lease lapsed during a slow call records nothing of what
/// it saw, even once it holds the shard again: another may have held it and
/// pushed since, and an acknowledgement of the late call's generation would
/// hide from it that the gateway moved.
const HOLDS: &str = "($4::text IS NULL OR EXISTS (SELECT 1 FROM dispatcher_shards d WHERE d.shard = egress_worker_shard($1) AND d.holder = $4 AND d.handovers = $5 AND d.expires > now()))";

/// Records what worker `w`'s gateway said: its epoch, whether it needs a
/// resync (`None`: the flag as it is stored, which a registration may
/// have raised since the row was read), and the last push error. A flag
/// is cleared only if the worker was not registered again since `w` was
/// read: a registration during a resync (the gateway moved, say) keeps it
/// raised for the next round.
pub async fn worker_seen(
    pool: &PgPool,
    w: &WorkerRow,
    (epoch, needs_resync, error): (Option<&str>, Option<bool>, Option<&str>),
) -> Result<(), sqlx::Error> {
    let sql = format!("UPDATE workers SET epoch = COALESCE($2, epoch), needs_resync = CASE WHEN NOT $3 AND registrations <> $7 THEN needs_resync ELSE COALESCE($3, needs_resync) END, last_error = $6, updated_at = now() WHERE id = $1 AND {HOLDS}");
    let lease = w.lease.as_ref();
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(&w.id)
        .bind(epoch)
        .bind(needs_resync)
        .bind(lease.map(|l| l.holder.as_str()))
        .bind(lease.map(|l| l.term))
        .bind(error)
        .bind(w.registrations)
        .execute(pool)
        .await?;
    Ok(())
}

/// The predicate of a worker's (`$1`) live sandboxes with a policy: the
/// index `sandboxes_worker_live`'s, word for word, so that the planner can
/// prove it covers each query that reads them.
macro_rules! worker_live {
    () => {
        "worker = $1 AND policy IS NOT NULL AND state NOT IN ('failed', 'destroyed')"
    };
}

/// A worker's live sandboxes with a policy, by id: what its gateway should
/// hold. Read through the index `sandboxes_worker_live` (migration 0011),
/// whose predicate is this query's.
pub const WORKER_SANDBOXES: &str = concat!(
    "SELECT id, tenant, template, egress_profiles, policy, inherits_template, provenance, state, worker, addresses, generation FROM sandboxes WHERE ",
    worker_live!(),
    " ORDER BY id"
);

/// About how many bytes the list of `worker`'s gateway is: the text of the
/// policies of [`WORKER_SANDBOXES`] and 512 bytes more for each (its id,
/// addresses, state). Read through the same index.
pub async fn listed_size(pool: &PgPool, worker: &str) -> Result<u64, sqlx::Error> {
    let size: i64 = sqlx::query_scalar(concat!(
        "SELECT COALESCE(sum(octet_length(policy::text) + 512), 0)::bigint FROM sandboxes WHERE ",
        worker_live!()
    ))
    .bind(worker)
    .fetch_one(pool)
    .await?;
    Ok(u64::try_from(size).unwrap_or(0))
}

/// A worker's sandboxes for the drift check ([`settled_sandboxes`]).
#[derive(Debug)]
pub struct Settled {
    /// Its live sandboxes whose every change the gateway acknowledged.
    pub rows: Vec<SandboxRow>,
    /// Its sandboxes with a change not acknowledged yet, live or not: the
    /// gateway may hold either side of the change.
    pub pending: std::collections::BTreeSet<String>,
}

/// The worker's live sandboxes, as a [`ResyncView`] has them, split into
/// those whose changes are all acknowledged and the ids of those with a
/// change still unacknowledged. Both are read in one snapshot, so a
/// sandbox placed between the two reads cannot pass for a settled one (a
/// list compared against it would look drifted).
pub async fn settled_sandboxes(pool: &PgPool, worker: &str) -> Result<Settled, sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        .execute(&mut *tx)
        .await?;
    let pending: Vec<String> = sqlx::query_scalar(
        "SELECT id FROM sandboxes WHERE worker = $1 AND generation > pushed_generation",
    )
    .bind(worker)
    .fetch_all(&mut *tx)
    .await?;
    let rows = sqlx::query(WORKER_SANDBOXES)
        .bind(worker)
        .fetch_all(&mut *tx)
        .await?;
    tx.commit().await?;
    let pending: std::collections::BTreeSet<String> = pending.into_iter().collect();
    let rows = rows
        .iter()
        .map(SandboxRow::from_row)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Settled {
        rows: rows
            .into_iter()
            .filter(|r| !pending.contains(&r.id))
            .collect(),
        pending,
    })
}

/// Changes a worker's gateway has not acknowledged yet, oldest first, but
/// for the generations `held` of those sandboxes (pushes the gateway
/// refused, held back a while): at most `limit` of them, and no more than
/// `max_bytes` of policy as stored but for the first ([`Unpushed`]). The
/// stored size (`pg_column_size`: compressed, for a large policy) is read
/// without reading the policy; its text may be several times larger.
pub async fn unpushed(
    pool: &PgPool,
    worker: &str,
    (limit, max_bytes): (i64, i64),
    (held, generations): (&[String], &[i64]),
) -> Result<Unpushed, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT * FROM (SELECT *, count(*) OVER () AS read, COALESCE(sum(pg_column_size(policy)) OVER (ORDER BY changed_at, id ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS before FROM (SELECT id, tenant, template, egress_profiles, policy, inherits_template, provenance, state, worker, addresses, generation, changed_at FROM sandboxes WHERE worker = $1 AND generation > pushed_generation AND (id, generation) NOT IN (SELECT h.id, h.generation FROM unnest($3::text[], $4::bigint[]) AS h(id, generation)) ORDER BY changed_at, id LIMIT $2) q) w WHERE before < GREATEST($5, 1) ORDER BY changed_at, id",
    )
    .bind(worker)
    .bind(limit)
    .bind(held)
    .bind(generations)
    .bind(max_bytes)
    .fetch_all(pool)
    .await?;
    let read: i64 = match rows.first() {
        Some(r) => r.try_get("read")?,
        None => 0,
    };
    let rows = rows
        .iter()
        .map(SandboxRow::from_row)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Unpushed {
        end: read < limit && rows.len() as i64 == read,
        rows,
    })
}

/// What [`unpushed`] read.
#[derive(Debug)]
pub struct Unpushed {
    pub rows: Vec<SandboxRow>,
    /// The read reached the end of the worker's queue: neither its count
    /// nor its bytes cut it short.
    pub end: bool,
}

/// Marks `generation` of a sandbox acknowledged; returns the seconds since the change.
pub async fn pushed(pool: &PgPool, id: &str, generation: i64) -> Result<f64, sqlx::Error> {
    let lag: Option<f64> = sqlx::query_scalar(
        "UPDATE sandboxes SET pushed_generation = GREATEST(pushed_generation, $2) WHERE id = $1 RETURNING extract(epoch FROM now() - changed_at)::float8",
    )
    .bind(id)
    .bind(generation)
    .fetch_optional(pool)
    .await?;
    Ok(lag.unwrap_or(0.0))
}

/// What a resync of a worker's gateway sends and what it settles, read in
/// one snapshot: the live sandboxes, as the gateway's resync document (a
/// `creating` sandbox with a policy is a claimed warm-pool sandbox: its
/// gateway keeps the template's policy until the claim's push), and the
/// destroyed or failed ones not yet acknowledged, each with the generation read.
#[derive(Debug)]
pub struct ResyncView {
    pub live: Vec<SandboxRow>,
    pub forgotten: Vec<(String, i64)>,
}

/// The [`ResyncView`] of `worker`'s sandboxes now.
pub async fn resync_view(pool: &PgPool, worker: &str) -> Result<ResyncView, sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        .execute(&mut *tx)
        .await?;
    let rows = sqlx::query(WORKER_SANDBOXES)
        .bind(worker)
        .fetch_all(&mut *tx)
        .await?;
    let forgotten: Vec<(String, i64)> = sqlx::query_as(
        "SELECT id, generation FROM sandboxes WHERE worker = $1 AND state IN ('destroyed', 'failed') AND generation > pushed_generation ORDER BY id",
    )
    .bind(worker)
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    let live = rows
        .iter()
        .map(SandboxRow::from_row)
        .collect::<Result<_, _>>()?;
    Ok(ResyncView { live, forgotten })
}

/// After a resync, the destroyed and failed sandboxes of its
/// [`ResyncView`] count as pushed at the generation read then: the gateway
/// no longer has them. One destroyed after that read has a later
/// generation and stays to be pushed (the resync may have sent it live).
pub async fn mark_forgotten(pool: &PgPool, forgotten: &[(String, i64)]) -> Result<(), sqlx::Error> {
    let (ids, generations): (Vec<&str>, Vec<i64>) =
        forgotten.iter().map(|(id, g)| (id.as_str(), *g)).unzip();
    sqlx::query(
        "UPDATE sandboxes SET pushed_generation = GREATEST(pushed_generation, f.generation) FROM unnest($1::text[], $2::bigint[]) AS f(id, generation) WHERE sandboxes.id = f.id",
    )
    .bind(ids)
    .bind(generations)
    .execute(pool)
    .await?;
    Ok(())
}

/// Marks each `(id, generation)` not pushed (its gateway no longer holds
/// it), unless the sandbox has changed since: that change is unpushed
/// already.
pub async fn unsettle(pool: &PgPool, rows: &[(String, i64)]) -> Result<(), sqlx::Error> {
    if rows.is_empty() {
        return Ok(());
    }
    let (ids, generations): (Vec<&str>, Vec<i64>) =
        rows.iter().map(|(id, g)| (id.as_str(), *g)).unzip();
    sqlx::query(
        "UPDATE sandboxes SET pushed_generation = LEAST(pushed_generation, f.generation - 1) FROM unnest($1::text[], $2::bigint[]) AS f(id, generation) WHERE sandboxes.id = f.id AND sandboxes.generation = f.generation",
    )
    .bind(ids)
    .bind(generations)
    .execute(pool)
    .await?;
    Ok(())
}

/// Whether `e` is PostgreSQL's refusal of a value (SQLSTATE class 22, a
/// data exception): the input's fault, not the database's.
pub fn is_data_exception(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|code| code.starts_with("22"))
}

/// Whether `time` (RFC 3339) is later than the database's now; an error
/// when it does not parse as a time.
pub async fn is_future(pool: &PgPool, time: &str) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT $1::timestamptz > now()")
        .bind(time)
        .fetch_one(pool)
        .await
}

// === operations ===

/// A queued operation.
#[derive(Clone, Debug)]
pub struct OperationRow {
    pub id: String,
    pub tenant: String,
    pub kind: String,
    pub sandbox: String,
    pub payload: Value,
    pub state: OperationState,
    pub attempts: i32,
    pub last_error: Option<String>,
}

impl OperationRow {
    fn from_row(r: &PgRow) -> Result<Self, sqlx::Error> {
        Ok(Self {
            id: r.try_get("id")?,
            tenant: r.try_get("tenant")?,
            kind: r.try_get("kind")?,
            sandbox: r.try_get("sandbox")?,
            payload: r.try_get::<Json<Value>, _>("payload")?.0,
            state: checked(r.try_get("state")?, "state")?,
            attempts: r.try_get("attempts")?,
            last_error: r.try_get("last_error")?,
        })
    }

    pub fn document(&self) -> Value {
        json!({
            "id": self.id,
            "kind": self.kind,
            "sandbox": self.sandbox,
            "state": self.state,
            "attempts": self.attempts,
            "error": self.last_error,
        })
    }
}

/// A new queued operation.
pub struct NewOperation<'a> {
    pub id: &'a str,
    pub tenant: &'a str,
    pub kind: OperationKind,
    pub sandbox: &'a str,
    pub payload: &'a Value,
    pub idempotency_key: Option<&'a str>,
    pub fingerprint: Option<&'a str>,
}

pub async fn insert_operation(
    conn: &mut PgConnection,
    op: &NewOperation<'_>,
) -> Result<(), sqlx::Error> {
    insert_op(conn, op, "INSERT INTO operations (id, tenant, kind, sandbox, payload, idempotency_key, fingerprint) VALUES ($1, $2, $3, $4, $5, $6, $7)").await
}

/// Records `op` as done already (a create the API ran in its request): for
/// its idempotency key only, never picked up by a dispatcher.
pub async fn insert_finished_operation(
    conn: &mut PgConnection,
    op: &NewOperation<'_>,
) -> Result<(), sqlx::Error> {
    // Finished: its payload (the whole policy) is not kept, as for one run.
    let none = serde_json::json!({});
    let kept = NewOperation {
        payload: &none,
        ..*op
    };
    insert_op(conn, &kept, "INSERT INTO operations (id, tenant, kind, sandbox, payload, idempotency_key, fingerprint, state, finished_at) VALUES ($1, $2, $3, $4, $5, $6, $7, 'succeeded', now())").await
}

/// `op`'s row by `sql`, whose parameters are its fields in order.
async fn insert_op(
    conn: &mut PgConnection,
    op: &NewOperation<'_>,
    sql: &'static str,
) -> Result<(), sqlx::Error> {
    sqlx::query(sql)
        .bind(op.id)
        .bind(op.tenant)
        .bind(op.kind.as_str())
        .bind(op.sandbox)
        .bind(Json(op.payload))
        .bind(op.idempotency_key)
        .bind(op.fingerprint)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

pub async fn operation(pool: &PgPool, id: &str) -> Result<Option<OperationRow>, sqlx::Error> {
    let row = sqlx::query(
        "SELECT id, tenant, kind, sandbox, payload, state, attempts, last_error FROM operations WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(pool)
    .await?;
    row.as_ref().map(OperationRow::from_row).transpose()
}

/// The operation an idempotency key already names: (operation, sandbox, fingerprint).
pub async fn by_key(
    conn: &mut PgConnection,
    tenant: &str,
    key: &str,
) -> Result<Option<Keyed>, sqlx::Error> {
    let row = sqlx::query(
        "SELECT id, sandbox, fingerprint, kind FROM operations WHERE tenant = $1 AND idempotency_key = $2",
    )
    .bind(tenant)
    .bind(key)
    .fetch_optional(&mut *conn)
    .await?;
    row.map(|r| {
        Ok(Keyed {
            operation: r.try_get("id")?,
            sandbox: r.try_get("sandbox")?,
            fingerprint: r.try_get("fingerprint")?,
            kind: r.try_get("kind")?,
        })
    })
    .transpose()
}

/// The operation an idempotency key names.
#[derive(Debug)]
pub struct Keyed {
    pub operation: String,
    pub sandbox: String,
    pub fingerprint: Option<String>,
    /// `create`, `fork` or `claim` ([`OperationKind::as_str`]).
    pub kind: String,
}

/// Claims the oldest runnable operation for this transaction: locked, and
/// skipped by every other executor, until the transaction ends. One that
/// names a worker is claimed only by the holder of the worker's shard (one
/// of `shards`), so a worker's operations run in order on one dispatcher.
pub async fn claim(
    conn: &mut PgConnection,
    shards: &[i32],
) -> Result<Option<OperationRow>, sqlx::Error> {
    let row = sqlx::query(
        "SELECT id, tenant, kind, sandbox, payload, state, attempts, last_error FROM operations WHERE state = 'queued' AND not_before <= now() AND (payload->>'worker' IS NULL OR egress_worker_shard(payload->>'worker') = ANY($1)) ORDER BY created_at LIMIT 1 FOR UPDATE SKIP LOCKED",
    )
    .bind(shards)
    .fetch_optional(&mut *conn)
    .await?;
    row.as_ref().map(OperationRow::from_row).transpose()
}

/// Marks a claimed operation done, in the transaction that did its work.
pub async fn succeed(conn: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
    // The payload (a create's whole policy) is for running it: not kept.
    sqlx::query("UPDATE operations SET state = 'succeeded', attempts = attempts + 1, last_error = NULL, finished_at = now(), payload = '{}' WHERE id = $1")
        .bind(id)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Counts a failed attempt: queued again after `backoff`, or failed for good
/// once `attempts` are used or the retry would pass `deadline` after the
/// operation was queued. Returns the new state.
pub async fn attempt_failed(
    conn: &mut PgConnection,
    id: &str,
    error: &str,
    retryable: bool,
    limits: (i32, Duration, Duration),
) -> Result<OperationState, sqlx::Error> {
    let (attempts, deadline, backoff) = limits;
    let state: String = sqlx::query_scalar(
        "UPDATE operations SET attempts = attempts + 1, last_error = $2, \
         state = CASE WHEN NOT $3 OR attempts + 1 >= $4 OR now() + make_interval(secs => $5) > created_at + make_interval(secs => $6) THEN 'failed' ELSE 'queued' END, \
         not_before = now() + make_interval(secs => $5), \
         finished_at = CASE WHEN NOT $3 OR attempts + 1 >= $4 OR now() + make_interval(secs => $5) > created_at + make_interval(secs => $6) THEN now() END, \
         payload = CASE WHEN NOT $3 OR attempts + 1 >= $4 OR now() + make_interval(secs => $5) > created_at + make_interval(secs => $6) THEN '{}' ELSE payload END \
         WHERE id = $1 AND state = 'queued' RETURNING state",
    )
    .bind(id)
    .bind(error)
    .bind(retryable)
    .bind(attempts)
    .bind(backoff.as_secs_f64())
    .bind(deadline.as_secs_f64())
    .fetch_one(&mut *conn)
    .await?;
    checked(state, "state")
}

/// Queue depth, the age of the oldest queued operation (s), and the age of
/// the oldest change no gateway has acknowledged (s).
pub async fn backlog(pool: &PgPool) -> Result<(i64, f64, f64), sqlx::Error> {
    let row = sqlx::query(
        "SELECT (SELECT count(*) FROM operations WHERE state = 'queued') AS depth, \
         (SELECT COALESCE(max(extract(epoch FROM now() - created_at)), 0)::float8 FROM operations WHERE state = 'queued') AS oldest, \
         (SELECT COALESCE(max(extract(epoch FROM now() - changed_at)), 0)::float8 FROM sandboxes WHERE generation > pushed_generation AND worker IS NOT NULL) AS lag",
    )
    .fetch_one(pool)
    .await?;
    Ok((
        row.try_get("depth")?,
        row.try_get("oldest")?,
        row.try_get("lag")?,
    ))
}

/// Bounded growth: forgets the idempotency keys of finished operations
/// queued more than `keys` ago (a replay then creates anew), deletes
/// finished operations that finished more than `operations` ago (their
/// `GET /v1/operations/{id}` is then 404), and drops the policy and
/// provenance of sandboxes destroyed or failed more than `operations` ago
/// whose gateway has forgotten them (a tenant creating and destroying
/// sandboxes of large policies would otherwise keep each policy for good).
/// At most `batch` rows of each per call; returns (keys forgotten,
/// operations deleted, ended sandboxes' policies and shadows dropped).
pub async fn prune(
    pool: &PgPool,
    operations: Duration,
    keys: Duration,
    batch: i64,
) -> Result<(u64, u64, u64), sqlx::Error> {
    let forgotten = prune_one(
        pool,
        "UPDATE operations SET idempotency_key = NULL, fingerprint = NULL WHERE id IN (SELECT id FROM operations WHERE idempotency_key IS NOT NULL AND created_at < now() - make_interval(secs => $1) AND state IN ('succeeded', 'failed') LIMIT $2)",
        (keys, batch),
    )
    .await?;
    let deleted = prune_one(
        pool,
        "DELETE FROM operations WHERE id IN (SELECT id FROM operations WHERE finished_at IS NOT NULL AND finished_at < now() - make_interval(secs => $1) AND state IN ('succeeded', 'failed') LIMIT $2)",
        (operations, batch),
    )
    .await?;
    let ended = prune_one(
        pool,
        "UPDATE sandboxes SET policy = NULL, provenance = '[]' WHERE id IN (SELECT id FROM sandboxes WHERE state IN ('destroyed', 'failed') AND generation <= pushed_generation AND (policy IS NOT NULL OR provenance <> '[]'::jsonb) AND changed_at < now() - make_interval(secs => $1) LIMIT $2)",
        (operations, batch),
    )
    .await?;
    // Their shadows too (a candidate and the policy it was put over).
    let shadows = prune_one(
        pool,
        "DELETE FROM sandbox_shadows WHERE sandbox IN (SELECT s.id FROM sandbox_shadows sh JOIN sandboxes s ON s.id = sh.sandbox WHERE s.state IN ('destroyed', 'failed') AND s.generation <= s.pushed_generation AND s.changed_at < now() - make_interval(secs => $1) LIMIT $2)",
        (operations, batch),
    )
    .await?;
    Ok((forgotten, deleted, ended + shadows))
}

/// One of [`prune`]'s statements, its age (`$1`, seconds) and batch (`$2`)
/// bound: the rows it changed.
async fn prune_one(
    pool: &PgPool,
    sql: &'static str,
    (age, batch): (Duration, i64),
) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(sql)
        .bind(age.as_secs_f64())
        .bind(batch)
        .execute(pool)
        .await?;
    Ok(done.rows_affected())
}

#[cfg(test)]
mod tests {
    use super::same_gateway;

    #[test]
    fn one_gateway_is_found_however_its_url_is_written() {
        for (a, b, same) in [
            ("http://gw-1:9000", "http://gw-1:9000/", true),
            ("http://GW-1:9000", "http://gw-1:9000", true),
            ("http://gw-1", "http://gw-1:80", true),
            ("http://[2001:db8::1]:9", "http://[2001:db8:0:0::1]:9", true),
            ("http://[::ffff:127.0.0.1]:9", "http://127.0.0.1:9", true),
            ("http://gw-1.:9000", "http://gw-1:9000", true),
            (
                "http://[2001:db8::1]:9000",
                "http://[2001:DB8::1]:9000/v1",
                true,
            ),
            ("http://gw-1:9000", "http://gw-1:9001", false),
            ("http://gw-1:9000", "http://gw-2:9000", false),
            ("not a url", "not a url", false),
        ] {
            assert_eq!(same_gateway(a, b), same, "{a} {b}");
        }
    }

    #[test]
    fn workers_on_one_gateway_are_grouped_in_their_order() {
        let workers = [
            ("w1", "http://gw-1:9000"),
            ("w2", "http://gw-2:9000"),
            ("w3", "http://GW-1:9000/"),
            ("w4", "not a url"),
            ("w5", "not a url"),
            ("w6", "http://[::ffff:127.0.0.1]:9"),
            ("w7", "http://127.0.0.1:9"),
            ("w8", "http://gw-1.:9000"),
        ];
        assert_eq!(
            super::sharing_gateways(workers),
            [vec!["w1", "w3", "w8"], vec!["w6", "w7"]]
        );
    }
}
