//! Warm-pool claims (docs/controller.md, "Warm pools"): a create that names
//! its template's pool in `X-Space-Warm-Pool` takes a sandbox the
//! dispatcher created ahead of time, instead of a new one. The selection
//! header is admitted exactly as for a create (by the caller, before the
//! claim), the claim is queued as an operation that composes the policy
//! and pushes it (`ops`), and idempotency keys replay it as they replay a
//! create. An empty pool answers `None`: the caller creates as usual
//! (`super::create` runs both paths).

use http::{HeaderMap, StatusCode};
use serde::Deserialize;
use serde_json::{json, Value};

use super::{db, error, json_reply, typed, Api, Reply};
use crate::config::Tenant;
use crate::metrics::OutcomeLabels;
use crate::state::OperationKind;
use crate::store::pool::{self as pools, Claim};
use crate::store::{self, NewOperation};

/// The header a create names its template's pool with.
pub(super) const POOL_HEADER: &str = "x-space-warm-pool";

/// The largest pool a template may keep.
const MAX_POOL: i32 = 10_000;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PoolBody {
    size: i32,
}

/// A claim's request: what the claim hands over, the queued payload, and
/// the idempotency key and fingerprint.
pub(super) struct ClaimRequest<'a> {
    pub claim: Claim<'a>,
    pub payload: &'a Value,
    pub key: Option<&'a str>,
    pub fingerprint: &'a str,
    /// Through `POST /v1/sandboxes`, whose answers always name their
    /// operation (an E2B create composed in its request has none).
    pub native: bool,
}

/// Whether a create names its template's pool: `X-Space-Warm-Pool` absent
/// (no), equal to `template` (yes), anything else `400` naming the header.
pub(super) fn named(headers: &HeaderMap, template: &str) -> Result<bool, Reply> {
    let mut values = headers.get_all(POOL_HEADER).iter();
    let (Some(v), None) = (values.next(), values.next()) else {
        return if headers.contains_key(POOL_HEADER) {
            Err(error(
                StatusCode::BAD_REQUEST,
                "X-Space-Warm-Pool: the header appears twice",
            ))
        } else {
            Ok(false)
        };
    };
    match v.to_str() {
        Ok(pool) if pool == template => Ok(true),
        _ => Err(error(
            StatusCode::BAD_REQUEST,
            &format!("X-Space-Warm-Pool: {v:?} is not the pool of the template {template:?}"),
        )),
    }
}

impl Api {
    /// The pool routes (admin): `PUT` or `GET /v1/templates/{id}/pool`.
    pub(super) async fn pools(
        &self,
        route: &str,
        id: &str,
        caller: &Tenant,
        req: http::Request<hyper::body::Incoming>,
    ) -> Result<Reply, Reply> {
        match route {
            _ if !caller.admin => Err(error(StatusCode::FORBIDDEN, "an admin token is required")),
            "template_pool_put" => self.put_pool(id, super::body(req).await).await,
            _ => self.get_pool(id).await,
        }
    }

    /// `PUT /v1/templates/{id}/pool` (admin): `{"size": N}`, 0 to stop refilling.
    pub(super) async fn put_pool(
        &self,
        id: &str,
        body: Result<Value, Reply>,
    ) -> Result<Reply, Reply> {
        let req: PoolBody = typed(body?)?;
        if !(0..=MAX_POOL).contains(&req.size) {
            return Err(error(
                StatusCode::BAD_REQUEST,
                &format!("size: {} is not within 0..={MAX_POOL}", req.size),
            ));
        }
        if !pools::put_size(&self.pool, id, req.size)
            .await
            .map_err(db)?
        {
            return Err(error(StatusCode::NOT_FOUND, &format!("no template {id:?}")));
        }
        self.get_pool(id).await
    }

    /// `GET /v1/templates/{id}/pool` (admin): the size, and how many
    /// sandboxes are ready to claim and still warming.
    pub(super) async fn get_pool(&self, id: &str) -> Result<Reply, Reply> {
        let (size, ready, warming) = pools::status(&self.pool, id)
            .await
            .map_err(db)?
            .ok_or_else(|| error(StatusCode::NOT_FOUND, &format!("no pool for {id:?}")))?;
        Ok(json_reply(
            StatusCode::OK,
            &json!({"template": id, "size": size, "ready": ready, "warming": warming}),
        ))
    }

    /// Claims a ready pooled sandbox and queues the claim: `(sandbox,
    /// operation)`, the original ones for a replayed idempotency key
    /// (another fingerprint: `409`; a key an E2B create composed in its
    /// request recorded, found empty the pool: no operation, as it first
    /// answered), `None` when the pool is empty.
    pub(super) async fn claim(
        &self,
        caller: &Tenant,
        req: &ClaimRequest<'_>,
    ) -> Result<Option<(String, Option<String>)>, Reply> {
        for _ in 0..2 {
            let mut tx = self.pool.begin().await.map_err(db)?;
            // A retry waits for the claim it retries, and then replays it.
            store::lock_tenant(&mut tx, &caller.tenant)
                .await
                .map_err(db)?;
            if let Some(key) = req.key {
                if let Some((sandbox, operation, claimed)) =
                    replayed(&mut tx, caller, key, req.fingerprint).await?
                {
                    if claimed {
                        self.count_claim("replayed");
                    }
                    let operation = (claimed || req.native).then_some(operation);
                    return Ok(Some((sandbox, operation)));
                }
            }
            super::create::within_quota(&mut tx, caller).await?;
            let Some(sandbox) = pools::claim(&mut tx, &req.claim).await.map_err(db)? else {
                self.count_claim("empty");
                return Ok(None);
            };
            let operation = crate::ids::new("op");
            let op = NewOperation {
                id: &operation,
                tenant: &caller.tenant,
                kind: OperationKind::Claim,
                sandbox: &sandbox,
                payload: req.payload,
                idempotency_key: req.key,
                fingerprint: Some(req.fingerprint),
            };
            match store::insert_operation(&mut tx, &op).await {
                Ok(()) => {}
                // A concurrent request with the same key won; the rollback
                // puts this sandbox back in the pool. Replay the winner.
                Err(sqlx::Error::Database(e)) if e.is_unique_violation() => continue,
                Err(e) => return Err(db(e)),
            }
            tx.commit().await.map_err(db)?;
            self.count_claim("claimed");
            return Ok(Some((sandbox, Some(operation))));
        }
        Err(error(
            StatusCode::CONFLICT,
            "Idempotency-Key is being used concurrently; retry",
        ))
    }

    fn count_claim(&self, outcome: &'static str) {
        self.metrics
            .pool_claims
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }
}

/// The `(sandbox, operation, whether it was a claim)` an idempotency key
/// already names with the same fingerprint (found the pool empty, a create
/// recorded it); another fingerprint is `409`.
async fn replayed(
    tx: &mut sqlx::PgConnection,
    caller: &Tenant,
    key: &str,
    fingerprint: &str,
) -> Result<Option<(String, String, bool)>, Reply> {
    match store::by_key(tx, &caller.tenant, key).await.map_err(db)? {
        None => Ok(None),
        Some(k) if k.fingerprint.as_deref() == Some(fingerprint) => {
            let claimed = k.kind == OperationKind::Claim.as_str();
            Ok(Some((k.sandbox, k.operation, claimed)))
        }
        Some(_) => Err(error(
            StatusCode::CONFLICT,
            "Idempotency-Key was used for a different request",
        )),
    }
}
