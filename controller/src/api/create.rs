//! Sandbox creates: `POST /v1/sandboxes` (native, queued; the dispatcher
//! composes and places it) and `POST /sandboxes` (an E2B body, translated
//! and composed here). Both admit the profile selection and may name the
//! template's warm pool ([`super::pool`]).

use egress_policy::select;
use http::{HeaderMap, StatusCode};
use serde::Deserialize;
use serde_json::{json, Value};

use super::{db, error, json_reply, policy_field, pool, typed, Api, Reply};
use crate::config::Tenant;
use crate::ops::{self, create_payload};
use crate::state::OperationKind;
use crate::store::{self, NewOperation, NewSandbox};
use crate::{e2b, ids};

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
    pub(super) async fn create(
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
    pub(super) async fn enqueue(
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
    pub(super) async fn e2b_create(
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
