//! The API service: sandbox creates (native, queued; E2B-style, composed
//! here), network policy replacement, lifecycle, forks, operations, and the
//! admin routes for templates and workers. Bearer tokens name tenants.
//!
//! Handlers return `Result<Reply, Reply>`: the error is the finished answer
//! (a 4xx/5xx), built once per request, so it is not boxed.
#![allow(clippy::result_large_err)]

use std::sync::Arc;

use egress_api::body::MAX_BODY;
pub(crate) use egress_api::reply::{json_reply, Reply};
use egress_policy::{select, Policy};
use http::{header, HeaderMap, Method, Request, StatusCode};
use hyper::body::Incoming;
use serde::Deserialize;
use serde_json::{json, Value};
use sqlx::PgPool;
use tokio::net::TcpListener;

use crate::approvals::laid_over;
use crate::compose::effective;
use crate::config::{Deployment, Tenant, Tenants};
use crate::metrics::{Metrics, RequestLabels};
use crate::ops::{self, create_payload};
use crate::state::{OperationKind, SandboxState};
use crate::store::{self, NewOperation, NewSandbox, Placement, SandboxRow};
use crate::{e2b, ids};

mod list;
mod pool;
mod shadow;

/// What the API serves from.
pub struct Api {
    pub pool: PgPool,
    pub deployment: Arc<Deployment>,
    pub tenants: Arc<Tenants>,
    pub metrics: Arc<Metrics>,
}

/// Serves on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, api: Arc<Api>) {
    accept(listener, move |req| {
        let api = api.clone();
        async move { api.handle(req).await }
    })
    .await;
}

/// Accepts connections on `listener` forever, answering each request with
/// `handle` (the contract crate's accept loop).
async fn accept<F, Fut>(listener: TcpListener, handle: F)
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Reply> + Send + 'static,
{
    egress_api::serve::serve(listener, "controller", handle).await;
}

/// A request's route name (a bounded metric label) and path segments.
fn route_of(method: &Method, segments: &[&str]) -> &'static str {
    match (method.as_str(), segments) {
        ("POST", ["v1", "sandboxes"]) => "create",
        ("POST", ["sandboxes"]) => "e2b_create",
        ("GET", ["v1", "sandboxes"]) => "list_sandboxes",
        ("GET", ["v1", "workers"]) => "workers",
        ("GET", ["v1", "operations"]) => "operations",
        ("POST", ["v1", "sandboxes", _, "explain"]) => "explain",
        ("GET", ["console", ..]) => "console",
        ("GET", ["v1", "sandboxes", _]) => "get_sandbox",
        ("DELETE", ["v1", "sandboxes", _]) => "destroy",
        ("PUT", ["v1", "sandboxes", _, "network"]) => "network",
        ("PUT", ["sandboxes", _, "network"]) => "e2b_network",
        ("PUT", ["v1", "sandboxes", _, "shadow"]) => "shadow_put",
        ("DELETE", ["v1", "sandboxes", _, "shadow"]) => "shadow_delete",
        ("GET", ["v1", "sandboxes", _, "shadow", "report"]) => "shadow_report",
        ("POST", ["v1", "sandboxes", _, "shadow", "promote"]) => "shadow_promote",
        ("PUT", ["v1", "templates", _, "shadow"]) => "template_shadow_put",
        ("DELETE", ["v1", "templates", _, "shadow"]) => "template_shadow_delete",
        ("GET", ["v1", "templates", _, "shadow", "report"]) => "template_shadow_report",
        ("PUT", ["v1", "templates", _, "pool"]) => "template_pool_put",
        ("GET", ["v1", "templates", _, "pool"]) => "template_pool",
        ("POST", ["v1", "sandboxes", _, "fork"]) => "fork",
        ("GET", ["v1", "sandboxes", _, "proposals"]) => "proposals",
        ("POST", ["v1", "sandboxes", _, "proposals", _, "approve"]) => "approve",
        ("GET", ["v1", "approvals"]) => "approvals",
        ("DELETE", ["v1", "approvals", _]) => "revoke",
        ("POST", ["v1", "sandboxes", _, _]) => "lifecycle",
        ("GET", ["v1", "operations", _]) => "operation",
        ("PUT", ["v1", "templates", _]) => "template",
        ("PUT", ["v1", "workers", _]) => "worker",
        ("GET", ["metrics"]) => "metrics",
        ("GET", ["healthz"]) => "healthz",
        _ => "other",
    }
}

impl Api {
    async fn handle(&self, req: Request<Incoming>) -> Reply {
        let path = req.uri().path().to_owned();
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        let route = route_of(req.method(), &segments);
        let reply = match route {
            "healthz" => json_reply(StatusCode::OK, &json!({"ok": true})),
            "metrics" => text(self.metrics.encode()),
            // Static assets only: every datum the console shows is an API call.
            "console" => crate::console::asset(&segments),
            _ => match self.caller(req.headers()) {
                Some(caller) => self.authorized(req, &segments, route, caller).await,
                None => error(StatusCode::UNAUTHORIZED, "missing or unknown bearer token"),
            },
        };
        let status = reply.status().as_u16();
        self.metrics
            .requests
            .get_or_create(&RequestLabels { route, status })
            .inc();
        reply
    }

    fn caller(&self, headers: &HeaderMap) -> Option<Tenant> {
        let token = headers
            .get(header::AUTHORIZATION)?
            .to_str()
            .ok()?
            .strip_prefix("Bearer ")?;
        self.tenants.get(token).cloned()
    }

    async fn authorized(
        &self,
        req: Request<Incoming>,
        segments: &[&str],
        route: &str,
        caller: Tenant,
    ) -> Reply {
        let id = segments.get(2).copied().unwrap_or_default().to_owned();
        let headers = req.headers().clone();
        let result = match route {
            "create" => self.create(&caller, &headers, body(req).await).await,
            "e2b_create" => self.e2b_create(&caller, &headers, body(req).await).await,
            "get_sandbox" => self.get(&caller, &id).await,
            "destroy" => self.lifecycle(&caller, &id, "destroy").await,
            "network" => self.network(&caller, &id, body(req).await).await,
            "e2b_network" => {
                let id = segments.get(1).copied().unwrap_or_default().to_owned();
                self.e2b_network(&caller, &id, body(req).await).await
            }
            "fork" => self.fork(&caller, &id).await,
            "proposals" => self.proposals(&caller, &id).await,
            "approve" => {
                let pid = segments.get(4).copied().unwrap_or_default().to_owned();
                self.approve(&caller, (&id, &pid), body(req).await).await
            }
            "approvals" => self.approvals(&caller).await,
            "revoke" => self.revoke(&caller, &id).await,
            "lifecycle" => {
                let action = segments.get(3).copied().unwrap_or_default().to_owned();
                self.lifecycle(&caller, &id, &action).await
            }
            "operation" => self.operation(&caller, &id).await,
            "list_sandboxes" => self.list_sandboxes(&caller, req.uri().query()).await,
            "operations" => self.list_operations(&caller, req.uri().query()).await,
            "explain" => self.explain(&caller, &id, body(req).await).await,
            "workers" if caller.admin => self.list_workers().await,
            "shadow_put" => self.put_shadow(&caller, &id, body(req).await).await,
            "shadow_delete" => self.delete_shadow(&caller, &id).await,
            "shadow_report" => self.shadow_report(&caller, &id).await,
            "shadow_promote" => self.promote_shadow(&caller, &id).await,
            "template" if caller.admin => self.template(&id, body(req).await).await,
            "worker" if caller.admin => self.worker(&id, body(req).await).await,
            "template_shadow_put" if caller.admin => {
                self.put_template_shadow(&id, body(req).await).await
            }
            "template_shadow_delete" if caller.admin => self.delete_template_shadow(&id).await,
            "template_shadow_report" if caller.admin => self.template_shadow_report(&id).await,
            "template_pool_put" | "template_pool" => self.pools(route, &id, &caller, req).await,
            "template"
            | "worker"
            | "workers"
            | "template_shadow_put"
            | "template_shadow_delete"
            | "template_shadow_report" => {
                Err(error(StatusCode::FORBIDDEN, "an admin token is required"))
            }
            _ => Err(error(StatusCode::NOT_FOUND, "no such route")),
        };
        result.unwrap_or_else(|reply| reply)
    }
}

/// The request body as JSON, within [`MAX_BODY`] (`413` beyond).
pub(crate) async fn body(req: Request<Incoming>) -> Result<Value, Reply> {
    let text = egress_api::body::text(req.into_body(), MAX_BODY).await?;
    serde_json::from_str(&text).map_err(|e| error(StatusCode::BAD_REQUEST, &format!("body: {e}")))
}

/// Parses `v` as `T`; the error names the field.
pub(crate) fn typed<T: for<'de> Deserialize<'de>>(v: Value) -> Result<T, Reply> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        error(
            StatusCode::BAD_REQUEST,
            &format!("{}: {}", e.path(), e.inner()),
        )
    })
}

/// A policy document in a body; the error names the field.
fn policy_field(v: &Value, field: &str) -> Result<Policy, Reply> {
    Policy::from_json(&v.to_string())
        .map_err(|e| error(StatusCode::BAD_REQUEST, &format!("{field}: {e}")))
}

/// `{"error": message}` (the contract crate's error, no field named).
pub(crate) fn error(status: StatusCode, message: &str) -> Reply {
    egress_api::reply::error(status, message, None)
}

fn text(body: String) -> Reply {
    egress_api::reply::openmetrics(body)
}

/// A database error: `503` with `Retry-After`, nothing changed (the
/// transaction, if any, rolls back); the client retries, with the same
/// `Idempotency-Key` for a create.
pub(crate) fn db(e: sqlx::Error) -> Reply {
    tracing::warn!(error = %e, "database error");
    let mut r = error(
        StatusCode::SERVICE_UNAVAILABLE,
        "the database is unavailable; retry",
    );
    r.headers_mut().insert(
        header::RETRY_AFTER,
        header::HeaderValue::from_static(RETRY_AFTER_SECONDS),
    );
    r
}

/// What `Retry-After` says while the database is unavailable.
const RETRY_AFTER_SECONDS: &str = "1";

/// A sandbox the caller may see (its tenant's, or any for an admin).
pub(crate) fn visible(
    caller: &Tenant,
    row: Option<SandboxRow>,
    id: &str,
) -> Result<SandboxRow, Reply> {
    match row {
        Some(r) if caller.admin || r.tenant == caller.tenant => Ok(r),
        _ => Err(error(StatusCode::NOT_FOUND, &format!("no sandbox {id:?}"))),
    }
}

/// The sandbox `id`, locked for update in `tx`, if the caller may see it.
pub(crate) async fn visible_for_update(
    tx: &mut sqlx::PgConnection,
    caller: &Tenant,
    id: &str,
) -> Result<SandboxRow, Reply> {
    visible(
        caller,
        store::sandbox_for_update(tx, id).await.map_err(db)?,
        id,
    )
}

// === creates ===

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateBody {
    template: String,
    #[serde(default)]
    policy: Option<Value>,
    #[serde(default)]
    worker: Option<String>,
}

impl Api {
    /// Admits the profile selection of a create (`X-Space-Egress-Profiles`).
    fn admit(&self, caller: &Tenant, headers: &HeaderMap) -> Result<Vec<String>, Reply> {
        let mut values = headers.get_all(egress_policy::PROFILES_HEADER).iter();
        let first = values.next();
        let header = match (first, values.next()) {
            (None, _) => None,
            (Some(v), None) => Some(
                v.to_str()
                    .map_err(|_| selection_error("malformed", "not ASCII"))?,
            ),
            (Some(_), Some(_)) => {
                return Err(selection_error("malformed", "the header appears twice"))
            }
        };
        match select(&self.deployment.profiles, header, caller.federated) {
            Ok(s) => {
                self.metrics.admitted(&s.admissions);
                Ok(s.profiles.iter().map(ToString::to_string).collect())
            }
            Err(e) => {
                self.metrics.admitted(&e.admissions);
                Err(selection_error(e.kind.as_str(), &e.to_string()))
            }
        }
    }

    /// What every create (native or E2B) reads first: whether it names
    /// the warm pool of `template`, and the admitted profile selection.
    fn admit_create(
        &self,
        caller: &Tenant,
        headers: &HeaderMap,
        template: &str,
    ) -> Result<(bool, Vec<String>), Reply> {
        let pooled = pool::named(headers, template)?;
        let names = self.admit(caller, headers)?;
        Ok((pooled, names))
    }

    /// `POST /v1/sandboxes`: queued; the dispatcher composes and places it.
    async fn create(
        &self,
        caller: &Tenant,
        headers: &HeaderMap,
        body: Result<Value, Reply>,
    ) -> Result<Reply, Reply> {
        let raw = body?;
        let req: CreateBody = typed(raw.clone())?;
        let policy = req
            .policy
            .as_ref()
            .map(|p| policy_field(p, "policy"))
            .transpose()?;
        let (pooled, names) = self.admit_create(caller, headers, &req.template)?;
        let key = headers.get("idempotency-key").and_then(|v| v.to_str().ok());
        let fingerprint = create_fingerprint(&req, &names, pooled);
        let payload = create_payload(policy.as_ref(), req.worker.as_deref());
        if pooled {
            let claim = pool::ClaimRequest {
                claim: store::pool::Claim {
                    template: &req.template,
                    tenant: &caller.tenant,
                    egress_profiles: &names,
                    inherits_template: policy.is_none(),
                    worker: req.worker.as_deref(),
                },
                payload: &payload,
                key,
                fingerprint: &fingerprint,
            };
            if let Some(reply) = self.native_claim(caller, &claim).await? {
                return Ok(reply);
            }
        }
        let sandbox = ids::new("sb");
        let operation = ids::new("op");
        let new = NewSandbox {
            id: &sandbox,
            tenant: &caller.tenant,
            template: &req.template,
            egress_profiles: &names,
            inherits_template: policy.is_none(),
        };
        let op = NewOperation {
            id: &operation,
            tenant: &caller.tenant,
            kind: OperationKind::Create,
            sandbox: &sandbox,
            payload: &payload,
            idempotency_key: key,
            fingerprint: Some(&fingerprint),
        };
        self.enqueue(caller, &new, &op).await
    }

    /// Inserts a sandbox and its operation, or replays the operation an
    /// idempotency key already names (same fingerprint) or refuses (409).
    async fn enqueue(
        &self,
        caller: &Tenant,
        new: &NewSandbox<'_>,
        op: &NewOperation<'_>,
    ) -> Result<Reply, Reply> {
        for _ in 0..2 {
            let mut tx = self.pool.begin().await.map_err(db)?;
            if let Some(key) = op.idempotency_key {
                if let Some((operation, sandbox, print)) =
                    store::by_key(&mut tx, &caller.tenant, key)
                        .await
                        .map_err(db)?
                {
                    return if print.as_deref() == op.fingerprint {
                        Ok(json_reply(
                            StatusCode::ACCEPTED,
                            &json!({"sandbox": sandbox, "operation": operation}),
                        ))
                    } else {
                        Err(error(
                            StatusCode::CONFLICT,
                            "Idempotency-Key was used for a different request",
                        ))
                    };
                }
            }
            registered(&mut tx, new.template, "template").await?;
            store::insert_sandbox(&mut tx, new).await.map_err(db)?;
            match store::insert_operation(&mut tx, op).await {
                Ok(()) => {}
                // A concurrent create with the same key won: replay it.
                Err(sqlx::Error::Database(e)) if e.is_unique_violation() => continue,
                Err(e) => return Err(db(e)),
            }
            tx.commit().await.map_err(db)?;
            return Ok(json_reply(
                StatusCode::ACCEPTED,
                &json!({"sandbox": new.id, "operation": op.id}),
            ));
        }
        Err(error(
            StatusCode::CONFLICT,
            "Idempotency-Key is being used concurrently; retry",
        ))
    }

    /// `POST /sandboxes`: an E2B body, translated and composed here.
    async fn e2b_create(
        &self,
        caller: &Tenant,
        headers: &HeaderMap,
        body: Result<Value, Reply>,
    ) -> Result<Reply, Reply> {
        let raw = body?;
        let create = e2b::parse(raw.to_string().as_bytes())
            .map_err(|e| error(StatusCode::BAD_REQUEST, &e.to_string()))?;
        let policy =
            e2b::translate(&create).map_err(|e| error(StatusCode::BAD_REQUEST, &e.to_string()))?;
        let (pooled, names) = self.admit_create(caller, headers, &create.template_id)?;
        if pooled {
            if let Some(reply) = self
                .e2b_claim(caller, headers, &raw, &names, &policy)
                .await?
            {
                return Ok(reply);
            }
        }
        let sandbox = ids::new("sb");
        let mut tx = self.pool.begin().await.map_err(db)?;
        registered(&mut tx, &create.template_id, "templateID").await?;
        let new = NewSandbox {
            id: &sandbox,
            tenant: &caller.tenant,
            template: &create.template_id,
            egress_profiles: &names,
            inherits_template: false,
        };
        store::insert_sandbox(&mut tx, &new).await.map_err(db)?;
        let payload = create_payload(Some(&policy), None);
        if let Err(f) =
            ops::create(&mut tx, &self.deployment, &self.metrics, &sandbox, &payload).await
        {
            let status = if f.retryable {
                StatusCode::SERVICE_UNAVAILABLE
            } else {
                StatusCode::BAD_REQUEST
            };
            return Err(error(status, &f.message));
        }
        tx.commit().await.map_err(db)?;
        Ok(json_reply(
            StatusCode::CREATED,
            &json!({"sandboxID": sandbox, "templateID": create.template_id}),
        ))
    }
}

/// `400` naming `field` unless `template` is registered.
async fn registered(tx: &mut sqlx::PgConnection, template: &str, field: &str) -> Result<(), Reply> {
    if store::template_policy(tx, template)
        .await
        .map_err(db)?
        .is_none()
    {
        return Err(error(
            StatusCode::BAD_REQUEST,
            &format!("{field}: {template:?} is not registered"),
        ));
    }
    Ok(())
}

/// A native create's idempotency fingerprint: the body, a nonempty
/// selection (an empty one keeps the fingerprint a create without profiles
/// had) and whether it names the warm pool.
fn create_fingerprint(req: &CreateBody, names: &[String], pooled: bool) -> String {
    let mut print = json!({"template": req.template, "policy": req.policy, "worker": req.worker});
    if !names.is_empty() {
        print["egress_profiles"] = json!(names);
    }
    if pooled {
        print["warm_pool"] = json!(true);
    }
    ids::fingerprint(print.to_string().as_bytes())
}

fn selection_error(reason: &str, message: &str) -> Reply {
    json_reply(
        StatusCode::BAD_REQUEST,
        &json!({"error": message, "reason": reason}),
    )
}

// === one sandbox ===

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NetworkBody {
    #[serde(default)]
    policy: Option<Value>,
    #[serde(default)]
    inherit_template: bool,
}

impl Api {
    async fn get(&self, caller: &Tenant, id: &str) -> Result<Reply, Reply> {
        let mut conn = self.pool.acquire().await.map_err(db)?;
        let row = visible(caller, store::sandbox(&mut conn, id).await.map_err(db)?, id)?;
        Ok(json_reply(StatusCode::OK, &row.document()))
    }

    async fn operation(&self, caller: &Tenant, id: &str) -> Result<Reply, Reply> {
        match store::operation(&self.pool, id).await.map_err(db)? {
            Some(op) if caller.admin || op.tenant == caller.tenant => {
                Ok(json_reply(StatusCode::OK, &op.document()))
            }
            _ => Err(error(
                StatusCode::NOT_FOUND,
                &format!("no operation {id:?}"),
            )),
        }
    }

    /// `PUT /v1/sandboxes/{id}/network`: a new tenant base, or the template's default.
    async fn network(
        &self,
        caller: &Tenant,
        id: &str,
        body: Result<Value, Reply>,
    ) -> Result<Reply, Reply> {
        let req: NetworkBody = typed(body?)?;
        let base = match (req.policy, req.inherit_template) {
            (Some(p), false) => Some(policy_field(&p, "policy")?),
            (None, true) => None,
            _ => {
                return Err(error(
                    StatusCode::BAD_REQUEST,
                    "give either policy or inherit_template: true",
                ))
            }
        };
        self.replace(caller, id, base).await
    }

    /// `PUT /sandboxes/{id}/network`: an E2B network body, translated.
    async fn e2b_network(
        &self,
        caller: &Tenant,
        id: &str,
        body: Result<Value, Reply>,
    ) -> Result<Reply, Reply> {
        let policy = e2b::translate_network(&body?)
            .map_err(|e| error(StatusCode::BAD_REQUEST, &e.to_string()))?;
        self.replace(caller, id, Some(policy)).await
    }

    /// Replaces the effective policy: `base` (or the template's default)
    /// composed with the saved names resolved now; a missing name is `503`
    /// and nothing changes.
    async fn replace(
        &self,
        caller: &Tenant,
        id: &str,
        base: Option<Policy>,
    ) -> Result<Reply, Reply> {
        let mut tx = self.pool.begin().await.map_err(db)?;
        let row = self.replace_in(&mut tx, caller, id, base).await?;
        tx.commit().await.map_err(db)?;
        Ok(json_reply(StatusCode::OK, &row.document()))
    }

    /// [`Self::replace`] inside `tx` (which the caller commits); the
    /// sandbox as saved.
    async fn replace_in(
        &self,
        tx: &mut sqlx::PgConnection,
        caller: &Tenant,
        id: &str,
        base: Option<Policy>,
    ) -> Result<SandboxRow, Reply> {
        let row = visible_for_update(tx, caller, id).await?;
        if !row.state.is_live() {
            return Err(error(
                StatusCode::CONFLICT,
                &format!("sandbox {id} is {}", row.state),
            ));
        }
        let inherit = base.is_none();
        let base = match base {
            Some(b) => b,
            None => store::template_policy(tx, &row.template)
                .await
                .map_err(db)?
                .ok_or_else(|| {
                    error(StatusCode::CONFLICT, "the template is no longer registered")
                })?,
        };
        let eff = effective(&self.deployment, &base, &row.egress_profiles, inherit)
            .map_err(|m| self.unresolved(&m))?;
        let (policy, provenance) = laid_over(tx, &row, &eff).await.map_err(db)?;
        let placement = Placement {
            policy: &policy,
            inherits_template: eff.inherits_template,
            provenance,
            state: row.state,
            worker: None,
            addresses: &row.addresses,
        };
        store::save_effective(tx, id, &placement)
            .await
            .map_err(db)?;
        store::sandbox(tx, id)
            .await
            .map_err(db)?
            .ok_or_else(|| error(StatusCode::NOT_FOUND, &format!("no sandbox {id:?}")))
    }

    /// A saved profile name this process no longer configures: `503` with
    /// the missing names (counted as admissions).
    fn unresolved(&self, m: &egress_policy::MissingProfile) -> Reply {
        self.metrics.admitted(&m.admissions);
        let missing: Vec<&str> = m.admissions.iter().map(|a| a.profile.as_str()).collect();
        json_reply(
            StatusCode::SERVICE_UNAVAILABLE,
            &json!({"error": m.to_string(), "missing_profiles": missing}),
        )
    }

    /// Stop/start, pause/resume, suspend/restore, rollback and destroy: the
    /// saved effective policy stays as it is.
    async fn lifecycle(&self, caller: &Tenant, id: &str, action: &str) -> Result<Reply, Reply> {
        let mut tx = self.pool.begin().await.map_err(db)?;
        let row = visible_for_update(&mut tx, caller, id).await?;
        let next = row.state.after(action).ok_or_else(|| {
            error(
                StatusCode::CONFLICT,
                &format!("cannot {action} a sandbox that is {}", row.state),
            )
        })?;
        store::set_state(&mut tx, id, next).await.map_err(db)?;
        let row = store::sandbox(&mut tx, id).await.map_err(db)?;
        tx.commit().await.map_err(db)?;
        Ok(json_reply(
            StatusCode::OK,
            &row.map(|r| r.document()).unwrap_or_default(),
        ))
    }

    /// `POST /v1/sandboxes/{id}/fork`: a queued create of a copy carrying the
    /// names and the effective policy.
    async fn fork(&self, caller: &Tenant, id: &str) -> Result<Reply, Reply> {
        let mut conn = self.pool.acquire().await.map_err(db)?;
        let source = visible(caller, store::sandbox(&mut conn, id).await.map_err(db)?, id)?;
        if source.policy.is_none() || source.state == SandboxState::Destroyed {
            return Err(error(
                StatusCode::CONFLICT,
                &format!("sandbox {id} is {}", source.state),
            ));
        }
        drop(conn);
        let sandbox = ids::new("sb");
        let operation = ids::new("op");
        let payload = json!({"source": id});
        let new = NewSandbox {
            id: &sandbox,
            tenant: &source.tenant,
            template: &source.template,
            egress_profiles: &source.egress_profiles,
            inherits_template: source.inherits_template,
        };
        let op = NewOperation {
            id: &operation,
            tenant: &source.tenant,
            kind: OperationKind::Fork,
            sandbox: &sandbox,
            payload: &payload,
            idempotency_key: None,
            fingerprint: None,
        };
        self.enqueue(caller, &new, &op).await
    }
}

// === admin ===

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TemplateBody {
    policy: Value,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WorkerBody {
    admin_url: String,
    #[serde(default)]
    token: String,
    pool: String,
}

impl Api {
    async fn template(&self, id: &str, body: Result<Value, Reply>) -> Result<Reply, Reply> {
        let req: TemplateBody = typed(body?)?;
        let policy = policy_field(&req.policy, "policy")?;
        egress_policy::SandboxId::parse(id)
            .map_err(|e| error(StatusCode::BAD_REQUEST, &format!("template id: {e}")))?;
        store::put_template(&self.pool, id, &policy)
            .await
            .map_err(db)?;
        Ok(json_reply(
            StatusCode::OK,
            &json!({"id": id, "policy": policy}),
        ))
    }

    async fn worker(&self, id: &str, body: Result<Value, Reply>) -> Result<Reply, Reply> {
        let req: WorkerBody = typed(body?)?;
        if req.pool.parse::<ipnet::IpNet>().is_err() {
            return Err(error(
                StatusCode::BAD_REQUEST,
                &format!("pool: {:?} is not a CIDR", req.pool),
            ));
        }
        let uri: http::Uri = req.admin_url.parse().map_err(|_| {
            error(
                StatusCode::BAD_REQUEST,
                &format!("admin_url: {:?} is not a URL", req.admin_url),
            )
        })?;
        if uri.scheme_str() != Some("http") || uri.authority().is_none() {
            return Err(error(
                StatusCode::BAD_REQUEST,
                &format!("admin_url: {:?}: expected http://host:port", req.admin_url),
            ));
        }
        store::put_worker(&self.pool, id, &req.admin_url, &req.token, &req.pool)
            .await
            .map_err(db)?;
        Ok(json_reply(
            StatusCode::OK,
            &json!({"id": id, "admin_url": req.admin_url, "pool": req.pool}),
        ))
    }
}

/// The dispatcher's listener: `/metrics` and `/healthz` only.
pub async fn serve_metrics(listener: TcpListener, metrics: Arc<Metrics>) {
    accept(listener, move |req: Request<Incoming>| {
        let reply = match req.uri().path() {
            "/metrics" => text(metrics.encode()),
            "/healthz" => json_reply(StatusCode::OK, &json!({"ok": true})),
            _ => error(StatusCode::NOT_FOUND, "no such route"),
        };
        async move { reply }
    })
    .await;
}
