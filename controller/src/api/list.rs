//! Read-only routes for the operator console (docs/console.md), ordinary
//! API routes with the same bearer tokens and tenant scope as the rest:
//!
//! - `GET /v1/sandboxes?tenant=&state=&worker=&profile=&after=&limit=`: a
//!   keyset page in id order and the counts by state of the whole filter;
//!   a tenant's token sees its own tenant only.
//! - `GET /v1/workers` (admin): each worker's gateway, probed now
//!   (`/readyz`: ready, epoch, generation), and its push lag.
//! - `GET /v1/operations`: the queue depth and recent failures, the
//!   caller's tenant's (an admin's: all).
//! - `POST /v1/sandboxes/{id}/explain`: the sandbox's worker gateway's
//!   `POST /v1/explain`, asked for that sandbox only.

use std::time::Duration;

use egress_api::explain::Explain;
use egress_api::gateway::EXPLAIN;
use http::{Method, StatusCode};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::{db, error, json_reply, typed, visible, Api, Reply};
use crate::config::Tenant;
use crate::gateway_client::call;
use crate::state::{self, SandboxState};
use crate::store::list::{self, SandboxFilter};
use crate::store::{self, shadow as shadows};

/// Page sizes: the default and the most one page may hold.
const PAGE: i64 = 50;
const MAX_PAGE: i64 = 500;
/// The longest a worker's gateway may take to answer a console probe.
const PROBE: Duration = Duration::from_secs(2);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    tenant: Option<String>,
    state: Option<String>,
    worker: Option<String>,
    profile: Option<String>,
    after: Option<String>,
    limit: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OperationsQuery {
    limit: Option<String>,
}

/// The query string as a JSON object of strings (percent-decoded), so
/// [`typed`] refuses unknown keys and names the bad one.
fn query(raw: Option<&str>) -> Result<Value, Reply> {
    let mut out = Map::new();
    for pair in raw.unwrap_or_default().split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let k = decode(k).ok_or_else(|| bad_query(k))?;
        let v = decode(v).ok_or_else(|| bad_query(&k))?;
        if v.is_empty() {
            continue;
        }
        // Given twice, it could be read as either: refused, as a body's
        // key given twice is.
        if out.contains_key(&k) {
            let why = format!("query: {k:?} is given twice");
            return Err(error(StatusCode::BAD_REQUEST, &why));
        }
        out.insert(k, Value::String(v));
    }
    Ok(Value::Object(out))
}

fn bad_query(key: &str) -> Reply {
    error(
        StatusCode::BAD_REQUEST,
        &format!("query: {key:?} is not percent-encoded UTF-8"),
    )
}

/// `application/x-www-form-urlencoded` decoding; `None` when malformed.
fn decode(s: &str) -> Option<String> {
    let mut bytes = Vec::with_capacity(s.len());
    let mut it = s.bytes();
    while let Some(b) = it.next() {
        match b {
            b'+' => bytes.push(b' '),
            b'%' => {
                let hex = [it.next()?, it.next()?];
                let hex = std::str::from_utf8(&hex).ok()?;
                bytes.push(u8::from_str_radix(hex, 16).ok()?);
            }
            b => bytes.push(b),
        }
    }
    String::from_utf8(bytes).ok()
}

/// A `limit` parameter: 1 to `max`, `PAGE` when absent.
fn limit(raw: Option<&str>, max: i64) -> Result<i64, Reply> {
    let Some(raw) = raw else {
        return Ok(PAGE.min(max));
    };
    match raw.parse::<i64>() {
        Ok(n) if (1..=max).contains(&n) => Ok(n),
        _ => Err(error(
            StatusCode::BAD_REQUEST,
            &format!("limit: {raw:?} is not a number from 1 to {max}"),
        )),
    }
}

impl Api {
    /// `GET /v1/sandboxes`: one page and the counts.
    pub(super) async fn list_sandboxes(
        &self,
        caller: &Tenant,
        raw: Option<&str>,
    ) -> Result<Reply, Reply> {
        let q: ListQuery = typed(query(raw)?)?;
        let tenant = match (caller.admin, q.tenant) {
            (true, t) => t,
            (false, None) => Some(caller.tenant.clone()),
            (false, Some(t)) if t == caller.tenant => Some(t),
            (false, Some(t)) => {
                return Err(error(
                    StatusCode::FORBIDDEN,
                    &format!("tenant: {t:?}: a tenant's token lists its own tenant only"),
                ))
            }
        };
        let size = limit(q.limit.as_deref(), MAX_PAGE)?;
        let state = q
            .state
            .as_deref()
            .map(|s| {
                s.parse::<SandboxState>().map_err(|_| {
                    error(
                        StatusCode::BAD_REQUEST,
                        &format!("state: {s:?} is not one of {}", state::names()),
                    )
                })
            })
            .transpose()?;
        let mut filter = SandboxFilter {
            tenant,
            state,
            worker: q.worker,
            profile: q.profile,
            after: q.after,
            limit: size + 1,
        };
        let mut page = list::sandboxes(&self.pool, &filter).await.map_err(db)?;
        let next = if page.len() as i64 > size {
            page.truncate(size as usize);
            page.last().map(|s| s["id"].clone())
        } else {
            None
        };
        filter.after = None;
        let counts = list::sandbox_counts(&self.pool, &filter)
            .await
            .map_err(db)?;
        Ok(json_reply(
            StatusCode::OK,
            &json!({"sandboxes": page, "next": next, "counts": counts}),
        ))
    }

    /// `GET /v1/workers`: every worker, its gateway probed now.
    pub(super) async fn list_workers(&self) -> Result<Reply, Reply> {
        let workers = list::workers(&self.pool).await.map_err(db)?;
        let mut probes = tokio::task::JoinSet::new();
        for (i, w) in workers.iter().enumerate() {
            let (url, token) = (w.admin_url.clone(), w.token.clone());
            probes.spawn(async move { (i, probe(&url, &token).await) });
        }
        let shared = store::sharing_gateways(
            (workers.iter()).map(|w| (w.id.as_str(), w.admin_url.as_str())),
        );
        let mut docs: Vec<Value> = workers.into_iter().map(|w| w.document).collect();
        let group_of: std::collections::HashMap<&str, &Vec<String>> = (shared.iter())
            .flat_map(|g| g.iter().map(move |w| (w.as_str(), g)))
            .collect();
        for doc in &mut docs {
            let id = doc["id"].as_str().unwrap_or_default().to_owned();
            let group = group_of.get(id.as_str()).into_iter().flat_map(|g| g.iter());
            let others: Vec<&String> = group.filter(|w| **w != id).collect();
            doc["shares_gateway_with"] = json!(others);
        }
        while let Some(done) = probes.join_next().await {
            if let Ok((i, health)) = done {
                if let Some(doc) = docs.get_mut(i) {
                    doc["gateway"] = health;
                }
            }
        }
        Ok(json_reply(StatusCode::OK, &json!({ "workers": docs })))
    }

    /// `GET /v1/operations`: the queue and its failures.
    pub(super) async fn list_operations(
        &self,
        caller: &Tenant,
        raw: Option<&str>,
    ) -> Result<Reply, Reply> {
        let q: OperationsQuery = typed(query(raw)?)?;
        let size = limit(q.limit.as_deref(), MAX_PAGE)?;
        let tenant = (!caller.admin).then_some(caller.tenant.as_str());
        let mut doc = list::operations(&self.pool, tenant, size)
            .await
            .map_err(db)?;
        if caller.admin {
            let (_, _, lag) = store::backlog(&self.pool).await.map_err(db)?;
            doc["push_lag_s"] = json!(lag);
        }
        Ok(json_reply(StatusCode::OK, &doc))
    }

    /// `POST /v1/sandboxes/{id}/explain`: asked of the sandbox's gateway.
    pub(super) async fn explain(
        &self,
        caller: &Tenant,
        id: &str,
        body: Result<Value, Reply>,
    ) -> Result<Reply, Reply> {
        let question = explain_question(body?, id)?;
        let mut conn = self.pool.acquire().await.map_err(db)?;
        let row = visible(caller, store::sandbox(&mut conn, id).await.map_err(db)?, id)?;
        let not_placed = || {
            error(
                StatusCode::CONFLICT,
                &format!("sandbox {id} is {}: not on a worker's gateway", row.state),
            )
        };
        let worker = row.worker.as_deref().ok_or_else(not_placed)?;
        let (url, token) = shadows::gateway(&mut conn, worker)
            .await
            .map_err(db)?
            .ok_or_else(not_placed)?;
        drop(conn);
        match call(&url, &token, Method::POST, EXPLAIN, Some(&question)).await {
            Ok((StatusCode::OK, v)) => Ok(json_reply(StatusCode::OK, &v)),
            Ok((StatusCode::BAD_REQUEST, v)) => Err(json_reply(StatusCode::BAD_REQUEST, &v)),
            Ok((StatusCode::NOT_FOUND, _)) => Err(not_placed()),
            Ok((s, v)) => Err(error(
                StatusCode::BAD_GATEWAY,
                &format!("worker {worker} answered {s}: {v}"),
            )),
            Err(e) => Err(super::unanswered(caller, &format!("worker {worker}: {e}"))),
        }
    }
}

/// A gateway's `/readyz`, bounded by [`PROBE`]: `{"ready", "detail"}`.
async fn probe(url: &str, token: &str) -> Value {
    let answer = tokio::time::timeout(PROBE, call(url, token, Method::GET, "/readyz", None)).await;
    match answer {
        Ok(Ok((s, body))) => {
            let detail = body.as_str().unwrap_or_default().trim().to_owned();
            json!({"ready": s == StatusCode::OK, "status": s.as_u16(), "detail": detail})
        }
        Ok(Err(e)) => json!({"ready": false, "status": null, "detail": e.to_string()}),
        Err(_) => {
            json!({"ready": false, "status": null, "detail": format!("no answer within {PROBE:?}")})
        }
    }
}

/// The explain question of a console request, for sandbox `id` (the path
/// names it; the body may not): read by the contract crate's reader, so it
/// is refused here with the words the gateway would use.
fn explain_question(mut body: Value, id: &str) -> Result<Value, Reply> {
    let Some(fields) = body.as_object_mut() else {
        return Err(error(StatusCode::BAD_REQUEST, "body: expected an object"));
    };
    if fields.contains_key("sandbox") {
        let why = "sandbox: the path names the sandbox; the body may not";
        return Err(error(StatusCode::BAD_REQUEST, why));
    }
    fields.insert("sandbox".into(), json!(id));
    let asked: Explain = typed(body)?;
    if let Err(u) = asked.question() {
        return Err(egress_api::reply::error(
            StatusCode::BAD_REQUEST,
            &u.message,
            Some(u.field),
        ));
    }
    Ok(json!(asked))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_decode_and_refuse_malformed_escapes() {
        let v = query(Some("tenant=t%31&state=run+ning&after=")).expect("decodes");
        assert_eq!(v, json!({"tenant": "t1", "state": "run ning"}));
        assert!(query(Some("tenant=%zz")).is_err());
        assert!(query(Some("tenant=%e2%28")).is_err());
        assert!(typed::<ListQuery>(json!({"colour": "red"})).is_err());
        // A key given twice could be read as either value: refused.
        assert!(query(Some("state=running&state=failed")).is_err());
        assert!(query(Some("state=running&st%61te=failed")).is_err());
        assert!(
            query(Some("state=&state=failed")).is_ok(),
            "an empty one is none"
        );
    }

    #[test]
    fn limits_are_bounded() {
        assert_eq!(limit(None, MAX_PAGE).ok(), Some(PAGE));
        assert_eq!(limit(Some("500"), MAX_PAGE).ok(), Some(500));
        assert!(limit(Some("0"), MAX_PAGE).is_err());
        assert!(limit(Some("501"), MAX_PAGE).is_err());
        assert!(limit(Some("ten"), MAX_PAGE).is_err());
    }
}
