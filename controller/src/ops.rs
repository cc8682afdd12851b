//! What a queued operation does, run inside the transaction that claimed it
//! (so its effects and its `succeeded` commit together, or not at all): a
//! create or a fork composes the effective policy, picks the worker and the
//! address, and saves them; the push to the gateway follows.

use egress_policy::Policy;
use serde_json::{json, Value};
use sqlx::PgConnection;

use crate::compose::{effective, Effective};
use crate::config::Deployment;
use crate::metrics::Metrics;
use crate::state::{OperationKind, SandboxState};
use crate::store::{self, Placement};

/// Why an operation did not complete.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct Failure {
    pub message: String,
    /// Worth another attempt (a missing profile definition, no free address).
    pub retryable: bool,
    /// Saved names no longer configured (the API answers 503 with them).
    pub missing_profiles: Vec<String>,
}

impl Failure {
    pub fn fatal(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            retryable: false,
            missing_profiles: Vec::new(),
        }
    }

    pub fn retry(message: impl Into<String>) -> Self {
        Self {
            retryable: true,
            ..Self::fatal(message)
        }
    }
}

impl From<sqlx::Error> for Failure {
    fn from(e: sqlx::Error) -> Self {
        Self::retry(format!("database: {e}"))
    }
}

/// The payload of a queued create: the tenant policy (absent: inherit the
/// template's) and the worker asked for. The names are on the sandbox row.
pub fn create_payload(policy: Option<&Policy>, worker: Option<&str>) -> Value {
    json!({ "policy": policy, "worker": worker })
}

/// Runs one claimed operation.
pub async fn execute(
    conn: &mut PgConnection,
    deployment: &Deployment,
    metrics: &Metrics,
    kind: &str,
    sandbox: &str,
    payload: &Value,
) -> Result<(), Failure> {
    // A kind this build does not know fails the operation, never the queue.
    match kind.parse().map_err(Failure::fatal)? {
        OperationKind::Create => create(conn, deployment, metrics, sandbox, payload).await,
        OperationKind::Fork => fork(conn, deployment, sandbox, payload).await,
        OperationKind::Claim => claim(conn, deployment, metrics, sandbox, payload).await,
    }
}

/// Composes a created sandbox's policy from its saved names, resolved now.
pub async fn create(
    conn: &mut PgConnection,
    deployment: &Deployment,
    metrics: &Metrics,
    sandbox: &str,
    payload: &Value,
) -> Result<(), Failure> {
    let row = store::sandbox_for_update(conn, sandbox)
        .await?
        .ok_or_else(|| Failure::fatal(format!("sandbox {sandbox} is gone")))?;
    still_creating(&row)?;
    let eff = compose_create(conn, deployment, metrics, &row, payload).await?;
    let worker = payload.get("worker").and_then(Value::as_str);
    place(conn, sandbox, worker, &eff, Value::Array(vec![])).await
}

/// A claimed warm-pool sandbox (docs/controller.md, "Warm pools"): its
/// policy composed exactly like a create's, from the names admitted at the
/// claim; it keeps the worker and the address it was placed on.
async fn claim(
    conn: &mut PgConnection,
    deployment: &Deployment,
    metrics: &Metrics,
    sandbox: &str,
    payload: &Value,
) -> Result<(), Failure> {
    let row = store::sandbox_for_update(conn, sandbox)
        .await?
        .ok_or_else(|| Failure::fatal(format!("sandbox {sandbox} is gone")))?;
    still_creating(&row)?;
    let worker = row
        .worker
        .clone()
        .ok_or_else(|| Failure::fatal(format!("pooled sandbox {sandbox} has no worker")))?;
    let eff = compose_create(conn, deployment, metrics, &row, payload).await?;
    let placed = (worker.as_str(), row.addresses.as_slice());
    save_placed(conn, sandbox, &eff, Value::Array(vec![]), placed).await
}

/// The effective policy of a create: the payload's tenant policy (or the
/// template's default) with the row's saved names resolved now.
async fn compose_create(
    conn: &mut PgConnection,
    deployment: &Deployment,
    metrics: &Metrics,
    row: &store::SandboxRow,
    payload: &Value,
) -> Result<Effective, Failure> {
    let tenant_policy = match payload.get("policy") {
        None | Some(Value::Null) => None,
        Some(p) => Some(
            Policy::from_json(&p.to_string())
                .map_err(|e| Failure::fatal(format!("stored policy: {e}")))?,
        ),
    };
    let inherit = tenant_policy.is_none();
    let base = match tenant_policy {
        Some(p) => p,
        None => store::template_policy(conn, &row.template)
            .await?
            .ok_or_else(|| {
                Failure::fatal(format!("template {:?} is not registered", row.template))
            })?,
    };
    effective(deployment, &base, &row.egress_profiles, inherit).map_err(|m| {
        metrics.admitted(&m.admissions);
        Failure {
            message: format!("{m} (503)"),
            retryable: true,
            missing_profiles: m.admissions.iter().map(|a| a.profile.clone()).collect(),
        }
    })
}

/// A fork target: the source's names (copied at admission) and its
/// effective policy, with the deployment exemptions composed like a create.
async fn fork(
    conn: &mut PgConnection,
    deployment: &Deployment,
    sandbox: &str,
    payload: &Value,
) -> Result<(), Failure> {
    let source_id = payload
        .get("source")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let source = store::sandbox(conn, source_id)
        .await?
        .ok_or_else(|| Failure::fatal(format!("fork source {source_id:?} is gone")))?;
    let base = source
        .policy
        .ok_or_else(|| Failure::retry(format!("fork source {source_id} has no policy yet")))?;
    // The source's policy already holds its profiles' rules: only the
    // deployment's exemptions are composed again.
    let eff = effective(deployment, &base, &[], source.inherits_template)
        .map_err(|m| Failure::fatal(m.to_string()))?;
    let row = store::sandbox_for_update(conn, sandbox)
        .await?
        .ok_or_else(|| Failure::fatal(format!("sandbox {sandbox} is gone")))?;
    still_creating(&row)?;
    place(conn, sandbox, None, &eff, source.provenance).await
}

/// A create or fork runs only on a sandbox still being created: one
/// destroyed while its operation was queued stays destroyed (placed, it
/// came back running, on an address, its policy pushed).
fn still_creating(row: &store::SandboxRow) -> Result<(), Failure> {
    if row.state == SandboxState::Creating {
        return Ok(());
    }
    Err(Failure::fatal(format!(
        "sandbox {} is {}: not created",
        row.id, row.state
    )))
}

/// Picks the worker and a free address, and saves the sandbox as running.
async fn place(
    conn: &mut PgConnection,
    sandbox: &str,
    worker: Option<&str>,
    eff: &Effective,
    inherited_provenance: Value,
) -> Result<(), Failure> {
    let (worker, address) = pick_and_allocate(conn, worker).await?;
    let addresses = [address.to_string()];
    save_placed(
        conn,
        sandbox,
        eff,
        inherited_provenance,
        (&worker, &addresses),
    )
    .await
}

/// Most workers one unnamed placement tries for a free address.
const PLACEMENT_TRIES: usize = 8;

/// The worker (the named one, or the least loaded with a free address:
/// a full pool sends the placement on to the next, at most
/// [`PLACEMENT_TRIES`]) and the address there.
async fn pick_and_allocate(
    conn: &mut PgConnection,
    named: Option<&str>,
) -> Result<(String, std::net::IpAddr), Failure> {
    let mut tried: Vec<String> = Vec::new();
    let mut full: Vec<String> = Vec::new();
    while tried.len() < PLACEMENT_TRIES {
        let Some((worker, pool)) = store::alloc::pick_worker(conn, named, &tried).await? else {
            break;
        };
        if let Some(address) = store::alloc::allocate(conn, &worker, &pool).await? {
            return Ok((worker, address));
        }
        full.push(format!("worker {worker}: no free address in {pool}"));
        if named.is_some() {
            break;
        }
        tried.push(worker);
    }
    Err(Failure::retry(match (named, full.is_empty()) {
        (_, false) => full.join("; "),
        (Some(w), true) => format!("worker {w:?} is not registered"),
        (None, true) => "no worker is registered".to_owned(),
    }))
}

/// Saves a placed sandbox as running: its composed policy with the
/// approvals in force laid over it, on `placed` (worker, addresses).
async fn save_placed(
    conn: &mut PgConnection,
    sandbox: &str,
    eff: &Effective,
    inherited_provenance: Value,
    placed: (&str, &[String]),
) -> Result<(), Failure> {
    let mut provenance = match inherited_provenance {
        Value::Array(v) => v,
        _ => Vec::new(),
    };
    provenance.extend(
        eff.provenance
            .iter()
            .filter_map(|a| serde_json::to_value(a).ok()),
    );
    // The approvals of its template and tenant (and, for a fork, none of
    // the source's own: they are taken out) reach a new sandbox too.
    let mut policy = eff.policy.clone();
    if let Some(row) = store::sandbox(conn, sandbox).await? {
        let active = crate::approvals::in_force(conn, &row.tenant, &row.template, sandbox).await?;
        crate::approvals::overlay(&mut policy, &mut provenance, &active);
    }
    // What a gateway cannot take is refused here, not acknowledged and then
    // dropped by the dispatcher (the sandbox would run with nothing).
    if let Some(why) = crate::compose::oversized(&policy, placed.1) {
        return Err(Failure::fatal(why));
    }
    store::save_effective(
        conn,
        sandbox,
        &Placement {
            policy: &policy,
            inherits_template: eff.inherits_template,
            provenance: Value::Array(provenance),
            state: SandboxState::Running,
            worker: Some(placed.0),
            addresses: placed.1,
        },
    )
    .await?;
    Ok(())
}
