//! Shadow policies through the controller (docs/controller.md, "Shadows"):
//! a candidate tenant policy is validated and composed like a network
//! policy replacement and put as the shadow of the sandbox on its worker's
//! gateway (`PUT /v1/sandboxes/{id}/shadow` there), where every flow is
//! judged again under it; reports are read from that gateway. The store
//! keeps the candidate as given, so a promotion is a replacement of the
//! sandbox's policy with it (`PUT …/network`'s path), after which the
//! worker's shadow is dropped. A template rollout does the same for every
//! running sandbox that inherits the template, and merges their reports.
//!
//! The controller holds the sandbox's row lock while it talks to the
//! gateway, so a shadow put is ordered with the replacements of the same
//! sandbox; each gateway call is bounded (`gateway_client`).

use http::{Method, StatusCode};
use serde::Deserialize;
use serde_json::{json, Value};
use sqlx::PgConnection;

use super::{db, error, json_reply, policy_field, typed, visible, visible_for_update, Api, Reply};
use crate::approvals::laid_over;
use crate::compose::effective;
use crate::config::Tenant;
use crate::gateway_client::{call, GatewayError};
use crate::shadow_report::Rollup;
use crate::store::shadow::{self as shadows, Target};
use crate::store::{self, SandboxRow};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ShadowBody {
    policy: Value,
}

/// The gateway route of `t`'s shadow, `suffix` appended (`""`, `/report`).
async fn gateway(
    t: &Target,
    method: Method,
    suffix: &str,
    body: Option<&Value>,
) -> Result<(StatusCode, Value), GatewayError> {
    let path = format!("/v1/sandboxes/{}/shadow{suffix}", t.sandbox);
    call(&t.admin_url, &t.token, method, &path, body).await
}

fn refused(status: StatusCode, body: &Value) -> Reply {
    json_reply(
        StatusCode::BAD_GATEWAY,
        &json!({"error": format!("the worker's gateway answered {status}"), "gateway": body}),
    )
}

fn no_shadow(id: &str) -> Reply {
    error(
        StatusCode::NOT_FOUND,
        &format!("sandbox {id:?} has no shadow policy"),
    )
}

/// Where a sandbox's shadow lives: its worker's gateway, if it is on one.
async fn target(conn: &mut PgConnection, row: &SandboxRow) -> Result<Target, Reply> {
    let live = row.state.is_live() && row.policy.is_some();
    let not_placed = || {
        error(
            StatusCode::CONFLICT,
            &format!(
                "sandbox {} is {}: not on a worker's gateway",
                row.id, row.state
            ),
        )
    };
    let worker = row
        .worker
        .as_deref()
        .filter(|_| live)
        .ok_or_else(not_placed)?;
    let (admin_url, token) = shadows::gateway(conn, worker)
        .await
        .map_err(db)?
        .ok_or_else(not_placed)?;
    Ok(Target {
        sandbox: row.id.clone(),
        admin_url,
        token,
    })
}

/// Drops `t`'s shadow on its gateway; whether it had one.
async fn drop_on_gateway(t: &Target) -> Result<bool, String> {
    match gateway(t, Method::DELETE, "", None).await {
        Ok((s, _)) if s.is_success() => Ok(true),
        Ok((StatusCode::NOT_FOUND, _)) => Ok(false),
        Ok((s, body)) => Err(format!("answered {s}: {body}")),
        Err(e) => Err(e.to_string()),
    }
}

// === one sandbox ===

impl Api {
    /// `PUT /v1/sandboxes/{id}/shadow`: validated and composed like
    /// `PUT …/network`, put on the worker's gateway, kept in the store.
    pub(super) async fn put_shadow(
        &self,
        caller: &Tenant,
        id: &str,
        body: Result<Value, Reply>,
    ) -> Result<Reply, Reply> {
        let req: ShadowBody = typed(body?)?;
        let candidate = policy_field(&req.policy, "policy")?;
        let mut tx = self.pool.begin().await.map_err(db)?;
        let row = visible_for_update(&mut tx, caller, id).await?;
        let t = target(&mut tx, &row).await?;
        let eff = effective(&self.deployment, &candidate, &row.egress_profiles, false)
            .map_err(|m| self.unresolved(&m))?;
        // The approvals in force, laid over as a promotion would lay them:
        // without them, each destination an approval opens would show in
        // the report as a change the promotion does not make.
        let (laid, _) = laid_over(&mut tx, &row, &eff).await.map_err(db)?;
        // One a gateway would refuse (413, answered 502), or take but
        // never let be promoted: the caller's to make smaller.
        super::pushable(&laid, &row.addresses)?;
        let put = json!({ "policy": laid });
        let since = match gateway(&t, Method::PUT, "", Some(&put)).await {
            Ok((s, body)) if s.is_success() => body["since"].clone(),
            Ok((StatusCode::NOT_FOUND, _)) => {
                return Err(error(
                    StatusCode::CONFLICT,
                    &format!("sandbox {id} is not on its worker's gateway yet; retry"),
                ))
            }
            Ok((s, body)) => return Err(refused(s, &body)),
            Err(e) => return Err(super::unanswered(caller, &e)),
        };
        shadows::put(&mut tx, id, (&candidate, None), row.policy.as_ref())
            .await
            .map_err(db)?;
        tx.commit().await.map_err(db)?;
        Ok(json_reply(
            StatusCode::OK,
            &json!({"sandbox": id, "policy": candidate, "effective": laid,
                    "provenance": eff.provenance, "worker": row.worker, "since": since}),
        ))
    }

    /// `GET /v1/sandboxes/{id}/shadow/report`: the worker gateway's report.
    pub(super) async fn shadow_report(&self, caller: &Tenant, id: &str) -> Result<Reply, Reply> {
        let mut conn = self.pool.acquire().await.map_err(db)?;
        let row = visible(caller, store::sandbox(&mut conn, id).await.map_err(db)?, id)?;
        let t = target(&mut conn, &row).await?;
        drop(conn);
        match gateway(&t, Method::GET, "/report", None).await {
            Ok((s, body)) if s.is_success() => Ok(json_reply(StatusCode::OK, &body)),
            Ok((StatusCode::NOT_FOUND, _)) => Err(no_shadow(id)),
            Ok((s, body)) => Err(refused(s, &body)),
            Err(e) => Err(super::unanswered(caller, &e)),
        }
    }

    /// `DELETE /v1/sandboxes/{id}/shadow`: from the store and the gateway.
    pub(super) async fn delete_shadow(&self, caller: &Tenant, id: &str) -> Result<Reply, Reply> {
        let mut tx = self.pool.begin().await.map_err(db)?;
        let row = visible_for_update(&mut tx, caller, id).await?;
        let stored = shadows::delete(&mut tx, id).await.map_err(db)?;
        // A sandbox no gateway holds has no shadow there either.
        let on_gateway = match target(&mut tx, &row).await {
            Ok(t) => drop_on_gateway(&t)
                .await
                .map_err(|e| super::unanswered(caller, &e))?,
            Err(_) => false,
        };
        if !stored && !on_gateway {
            return Err(no_shadow(id));
        }
        tx.commit().await.map_err(db)?;
        Ok(json_reply(
            StatusCode::OK,
            &json!({"sandbox": id, "shadow": null}),
        ))
    }

    /// `POST /v1/sandboxes/{id}/shadow/promote`: the stored candidate
    /// replaces the tenant policy exactly as `PUT …/network` would
    /// (composition, provenance, generation, push), the stored candidate
    /// goes, and the worker's shadow is dropped (a push keeps a shadow, so
    /// it must be dropped explicitly). The drop happens under the row lock,
    /// before the commit, so a shadow put meanwhile is not the one dropped;
    /// until the push lands the sandbox runs its old policy with no shadow.
    /// A drop that fails promotes nothing.
    ///
    /// `409` when the sandbox's saved policy is no longer the one the
    /// shadow was put over (a replacement or an approval since): its report
    /// never judged that change, and the promotion would undo it.
    pub(super) async fn promote_shadow(&self, caller: &Tenant, id: &str) -> Result<Reply, Reply> {
        let mut tx = self.pool.begin().await.map_err(db)?;
        let row = visible_for_update(&mut tx, caller, id).await?;
        let stored = shadows::get(&mut tx, id)
            .await
            .map_err(db)?
            .ok_or_else(|| no_shadow(id))?;
        if let Some(template) = stored.template {
            return Err(error(
                StatusCode::CONFLICT,
                &format!("the shadow of sandbox {id} is template {template:?}'s rollout: put the template's policy, or put a shadow of the sandbox's own"),
            ));
        }
        let now = row
            .policy
            .as_ref()
            .and_then(|p| serde_json::to_value(p).ok());
        if stored.base.is_none() || stored.base != now {
            return Err(error(
                StatusCode::CONFLICT,
                &format!("the policy of sandbox {id} changed after its shadow was put (a replacement or an approval): put the shadow again, and read its report, before promoting it"),
            ));
        }
        let t = target(&mut tx, &row).await?;
        let promoted = self
            .replace_in(&mut tx, caller, id, Some(stored.policy))
            .await?;
        shadows::delete(&mut tx, id).await.map_err(db)?;
        if let Err(e) = drop_on_gateway(&t).await {
            tracing::warn!(sandbox = %id, error = %e, "not promoted: the worker's shadow was not dropped");
            return Err(super::unanswered(
                caller,
                &format!("not promoted: the worker's gateway did not drop the shadow: {e}"),
            ));
        }
        tx.commit().await.map_err(db)?;
        let mut doc = promoted.document();
        doc["shadow"] = Value::Null;
        Ok(json_reply(StatusCode::OK, &doc))
    }
}

// === template rollouts ===

impl Api {
    /// Puts `candidate`, composed for `row` as its template default, as
    /// `row`'s shadow on its gateway.
    async fn put_inherited(
        &self,
        conn: &mut PgConnection,
        row: &SandboxRow,
        candidate: &egress_policy::Policy,
    ) -> Result<(), String> {
        let t = target(conn, row)
            .await
            .map_err(|_| format!("sandbox {} is not on a worker's gateway", row.id))?;
        let eff = effective(&self.deployment, candidate, &row.egress_profiles, true)
            .map_err(|m| m.to_string())?;
        let (laid, _) = laid_over(conn, row, &eff)
            .await
            .map_err(|e| e.to_string())?;
        if let Some(why) = crate::compose::oversized(&laid, &row.addresses) {
            return Err(format!("sandbox {}: {why}", row.id));
        }
        match gateway(&t, Method::PUT, "", Some(&json!({"policy": laid}))).await {
            Ok((s, _)) if s.is_success() => Ok(()),
            Ok((s, body)) => Err(format!("the worker's gateway answered {s}: {body}")),
            Err(e) => Err(e.to_string()),
        }
    }

    /// `PUT /v1/templates/{id}/shadow`: the candidate as the shadow of
    /// every running sandbox inheriting the template.
    pub(super) async fn put_template_shadow(
        &self,
        id: &str,
        body: Result<Value, Reply>,
    ) -> Result<Reply, Reply> {
        let req: ShadowBody = typed(body?)?;
        let candidate = policy_field(&req.policy, "policy")?;
        let mut tx = self.pool.begin().await.map_err(db)?;
        if store::template_policy(&mut tx, id)
            .await
            .map_err(db)?
            .is_none()
        {
            return Err(error(StatusCode::NOT_FOUND, &format!("no template {id:?}")));
        }
        shadows::put_template(&mut tx, id, &candidate)
            .await
            .map_err(db)?;
        let (mut put, mut failed) = (Vec::new(), Vec::new());
        for row in shadows::inheriting(&mut tx, id).await.map_err(db)? {
            match self.put_inherited(&mut tx, &row, &candidate).await {
                Ok(()) => {
                    shadows::put(
                        &mut tx,
                        &row.id,
                        (&candidate, Some(id)),
                        row.policy.as_ref(),
                    )
                    .await
                    .map_err(db)?;
                    put.push(row.id);
                }
                Err(e) => failed.push(json!({"sandbox": row.id, "error": e})),
            }
        }
        tx.commit().await.map_err(db)?;
        Ok(json_reply(
            StatusCode::OK,
            &json!({"template": id, "policy": candidate, "sandboxes": put, "failed": failed}),
        ))
    }

    /// `GET /v1/templates/{id}/shadow/report`: the rollout's sandboxes'
    /// reports, merged ([`crate::shadow_report`]).
    pub(super) async fn template_shadow_report(&self, id: &str) -> Result<Reply, Reply> {
        let mut conn = self.pool.acquire().await.map_err(db)?;
        if !shadows::template_exists(&mut conn, id).await.map_err(db)? {
            return Err(no_rollout(id));
        }
        let targets = shadows::rollout(&mut conn, id, true).await.map_err(db)?;
        drop(conn);
        // Merged as each comes: one gateway's report held at a time.
        let (mut rollup, mut missing) = (Rollup::default(), Vec::new());
        for t in targets {
            match gateway(&t, Method::GET, "/report", None).await {
                Ok((s, body)) if s.is_success() => rollup.add(t.sandbox, &body),
                Ok((s, body)) => {
                    missing.push(json!({"sandbox": t.sandbox, "error": format!("{s}: {body}")}))
                }
                Err(e) => missing.push(json!({"sandbox": t.sandbox, "error": e.to_string()})),
            }
        }
        let mut v = rollup.finish(id);
        v["missing"] = Value::Array(missing);
        Ok(json_reply(StatusCode::OK, &v))
    }

    /// `DELETE /v1/templates/{id}/shadow`: from every gateway, then the
    /// store; a gateway that cannot be reached keeps its row (and the
    /// rollout) for another `DELETE`.
    pub(super) async fn delete_template_shadow(&self, id: &str) -> Result<Reply, Reply> {
        let mut tx = self.pool.begin().await.map_err(db)?;
        if !shadows::template_exists(&mut tx, id).await.map_err(db)? {
            return Err(no_rollout(id));
        }
        let (mut removed, mut failed) = (Vec::new(), Vec::new());
        for t in shadows::rollout(&mut tx, id, false).await.map_err(db)? {
            match drop_on_gateway(&t).await {
                Ok(_) => {
                    shadows::delete(&mut tx, &t.sandbox).await.map_err(db)?;
                    removed.push(t.sandbox);
                }
                Err(_) => failed.push(t.sandbox),
            }
        }
        if failed.is_empty() {
            shadows::delete_template(&mut tx, id).await.map_err(db)?;
        }
        tx.commit().await.map_err(db)?;
        let status = if failed.is_empty() {
            StatusCode::OK
        } else {
            StatusCode::BAD_GATEWAY
        };
        Ok(json_reply(
            status,
            &json!({"template": id, "removed": removed, "failed": failed}),
        ))
    }
}

fn no_rollout(id: &str) -> Reply {
    error(
        StatusCode::NOT_FOUND,
        &format!("template {id:?} has no shadow policy"),
    )
}
