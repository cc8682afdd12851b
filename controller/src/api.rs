//! The API service: routing, bearer tokens (they name tenants), and the
//! helpers every handler shares (bodies, typed fields, errors, the
//! database's `503`, visibility). The handlers live by resource:
//!
//! - `create`: sandbox creates, native (queued) and E2B (composed here),
//!   one path after translation; warm-pool claims in `pool`.
//! - `sandboxes`: one sandbox: its document, network policy replacement,
//!   lifecycle (destroy included), forks.
//! - `operations`: one queued operation.
//! - `approvals`: a sandbox's proposals, approving, listing, revoking.
//! - `shadow`: shadow policies of a sandbox or a template rollout.
//! - `templates`, `workers` (admin): registering them; `pool`: warm
//!   pools; `list`: the read-only listings and explain.
//!
//! Handlers return `Result<Reply, Reply>`: the error is the finished answer
//! (a 4xx/5xx), built once per request, so it is not boxed.
#![allow(clippy::result_large_err)]

use std::sync::Arc;

use egress_api::body::MAX_BODY;
pub(crate) use egress_api::reply::{json_reply, Reply};
use egress_policy::Policy;
use http::{header, HeaderMap, Method, Request, StatusCode};
use hyper::body::Incoming;
use serde::Deserialize;
use serde_json::{json, Value};
use sqlx::PgPool;
use tokio::net::TcpListener;

use crate::config::{Deployment, Tenant, Tenants};
use crate::metrics::{Metrics, RequestLabels};
use crate::store::{self, SandboxRow};

mod approvals;
mod create;
mod list;
mod operations;
mod pool;
mod sandboxes;
mod shadow;
pub mod slots;
mod templates;
mod workers;

/// What the API serves from.
pub struct Api {
    pub pool: PgPool,
    pub deployment: Arc<Deployment>,
    pub tenants: Arc<Tenants>,
    pub metrics: Arc<Metrics>,
    /// Each tenant's requests in flight, bounded ([`slots`]).
    pub slots: slots::TenantSlots,
}

/// Serves on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, api: Arc<Api>) {
    serve_until(listener, api, std::future::pending()).await;
}

/// [`serve`] until `stop` completes, then the requests in flight are
/// answered (up to the contract crate's `STOP_GRACE`) and the listener
/// closes: a rolling update resets no create in the middle.
pub async fn serve_until(
    listener: TcpListener,
    api: Arc<Api>,
    stop: impl std::future::Future<Output = ()>,
) {
    let handle = move |req| {
        let api = api.clone();
        async move { api.handle(req).await }
    };
    egress_api::serve::serve_until(listener, "controller", handle, stop).await;
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

/// The actions of `POST /v1/sandboxes/{id}/{action}`; any other is `404`
/// (`POST …/shadow` for `PUT …/shadow`, say, was a lifecycle action before,
/// and answered a misleading `409`). Destroy is `DELETE /v1/sandboxes/{id}`.
const LIFECYCLE: &[&str] = &[
    "stop", "start", "pause", "resume", "suspend", "restore", "rollback",
];

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
        ("POST", ["v1", "sandboxes", _, action]) if LIFECYCLE.contains(action) => "lifecycle",
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
                Some(caller) => self.within_share(req, &segments, route, caller).await,
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

    /// A tenant's request, once one of its places is free (an admin's at
    /// once); `503` when none came free within [`slots::WAIT`].
    async fn within_share(
        &self,
        req: Request<Incoming>,
        segments: &[&str],
        route: &'static str,
        caller: Tenant,
    ) -> Reply {
        if caller.admin {
            return self.authorized(req, segments, route, caller).await;
        }
        let Some(_place) = self.slots.take(&caller.tenant).await else {
            let why = format!(
                "tenant {:?} has {} requests in flight, none of which ended within {}s; retry",
                caller.tenant,
                slots::PER_TENANT,
                slots::WAIT.as_secs()
            );
            return error(StatusCode::SERVICE_UNAVAILABLE, &why);
        };
        self.authorized(req, segments, route, caller).await
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
            "fork" => self.fork(&caller, &id, &headers).await,
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

/// The request body as JSON, within [`MAX_BODY`] (`413` beyond); a key
/// twice in one object is `400` (the value would keep only the last).
pub(crate) async fn body(req: Request<Incoming>) -> Result<Value, Reply> {
    let text = egress_api::body::text(req.into_body(), MAX_BODY).await?;
    egress_policy::json_value(&text)
        .map_err(|e| error(StatusCode::BAD_REQUEST, &format!("body: {e}")))
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
/// `502` for a worker's gateway that gave no answer: an admin reads why
/// (its admin URL included); a tenant reads only that it did not answer,
/// and the log keeps the rest (the URL is the one the controller reaches
/// with the worker's token).
fn unanswered(caller: &Tenant, why: &dyn std::fmt::Display) -> Reply {
    if caller.admin {
        return error(
            StatusCode::BAD_GATEWAY,
            &format!("the worker's gateway: {why}"),
        );
    }
    tracing::warn!(tenant = %caller.tenant, error = %why, "a worker's gateway did not answer");
    error(
        StatusCode::BAD_GATEWAY,
        "the worker's gateway did not answer; retry",
    )
}

fn policy_field(v: &Value, field: &str) -> Result<Policy, Reply> {
    let policy = Policy::from_json(&v.to_string())
        .map_err(|e| error(StatusCode::BAD_REQUEST, &format!("{field}: {e}")))?;
    not_too_large(policy, field)
}

/// `policy` when its normal form is within [`MAX_POLICY`], else `400`
/// naming `field` and the size.
fn not_too_large(policy: Policy, field: &str) -> Result<Policy, Reply> {
    let bytes = serde_json::to_vec(&policy).map_or(usize::MAX, |b| b.len());
    if bytes > MAX_POLICY {
        return Err(error(
            StatusCode::BAD_REQUEST,
            &format!("{field}: {bytes} bytes in normal form, more than the {MAX_POLICY} a policy may have (a gateway takes a sandbox's document of at most {MAX_BODY} bytes)"),
        ));
    }
    Ok(policy)
}

/// The largest policy the API takes, in normal form: a gateway takes a
/// sandbox's document (addresses and the effective policy) of at most
/// [`MAX_BODY`] bytes, and composition adds to the policy.
const MAX_POLICY: usize = MAX_BODY - 16 * 1024;

/// Refuses an effective `policy` whose push to a gateway, with `addresses`,
/// would be larger than a gateway takes.
pub(crate) fn pushable(policy: &Policy, addresses: &[String]) -> Result<(), Reply> {
    match crate::compose::oversized(policy, addresses) {
        Some(why) => Err(error(StatusCode::BAD_REQUEST, &why)),
        None => Ok(()),
    }
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
    let locked = e
        .as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|code| code == "55P03");
    let why = match &e {
        // A value stored by a build of another version (a rolling upgrade).
        sqlx::Error::Decode(what) => {
            format!("{what}; retry (on a replica of the build that wrote it, during an upgrade)")
        }
        _ if locked => "a row this change needs is held by another; retry".to_owned(),
        _ => "the database is unavailable; retry".to_owned(),
    };
    let mut r = error(StatusCode::SERVICE_UNAVAILABLE, &why);
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

impl Api {
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
