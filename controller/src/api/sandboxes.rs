//! One sandbox: its document, network policy replacement (native and
//! E2B), lifecycle (stop/start, pause/resume, suspend/restore, rollback,
//! destroy) and forks.

use egress_policy::Policy;
use http::StatusCode;
use serde::Deserialize;
use serde_json::{json, Value};

use super::{db, error, json_reply, policy_field, typed, visible, visible_for_update, Api, Reply};
use crate::approvals::laid_over;
use crate::compose::effective;
use crate::config::Tenant;
use crate::e2b;
use crate::ids;
use crate::state::{OperationKind, SandboxState};
use crate::store::{self, NewOperation, NewSandbox, Placement, SandboxRow};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NetworkBody {
    #[serde(default)]
    policy: Option<Value>,
    #[serde(default)]
    inherit_template: bool,
}

impl Api {
    pub(super) async fn get(&self, caller: &Tenant, id: &str) -> Result<Reply, Reply> {
        let mut conn = self.pool.acquire().await.map_err(db)?;
        let row = visible(caller, store::sandbox(&mut conn, id).await.map_err(db)?, id)?;
        Ok(json_reply(StatusCode::OK, &row.document()))
    }

    /// `PUT /v1/sandboxes/{id}/network`: a new tenant base, or the template's default.
    pub(super) async fn network(
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
    pub(super) async fn e2b_network(
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
    pub(super) async fn replace_in(
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
        crate::api::pushable(&policy, &row.addresses)?;
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

    /// Stop/start, pause/resume, suspend/restore, rollback and destroy: the
    /// saved effective policy stays as it is.
    pub(super) async fn lifecycle(
        &self,
        caller: &Tenant,
        id: &str,
        action: &str,
    ) -> Result<Reply, Reply> {
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
    pub(super) async fn fork(
        &self,
        caller: &Tenant,
        id: &str,
        headers: &http::HeaderMap,
    ) -> Result<Reply, Reply> {
        let key = super::create::idempotency_key(headers)?;
        let mut conn = self.pool.acquire().await.map_err(db)?;
        let source = visible(caller, store::sandbox(&mut conn, id).await.map_err(db)?, id)?;
        let sandbox = ids::new("sb");
        let operation = ids::new("op");
        let payload = json!({"source": id});
        // The key replays a fork of the same sandbox, and only that.
        let fingerprint = ids::fingerprint(json!({"fork": id}).to_string().as_bytes());
        let op = NewOperation {
            id: &operation,
            tenant: &source.tenant,
            kind: OperationKind::Fork,
            sandbox: &sandbox,
            payload: &payload,
            idempotency_key: key,
            fingerprint: Some(&fingerprint),
        };
        // A retry is answered as the fork was, even once the source is gone.
        let native = (source.template.as_str(), super::create::Dialect::Native);
        let replay = super::create::replayed_op(&mut conn, &source.tenant, &op, native);
        if let Some(replayed) = replay.await? {
            return replayed;
        }
        if source.policy.is_none() || source.state == SandboxState::Destroyed {
            return Err(error(
                StatusCode::CONFLICT,
                &format!("sandbox {id} is {}", source.state),
            ));
        }
        drop(conn);
        let new = NewSandbox {
            id: &sandbox,
            tenant: &source.tenant,
            template: &source.template,
            egress_profiles: &source.egress_profiles,
            inherits_template: source.inherits_template,
        };
        // The copy is the source's tenant's: counted against its quota, not
        // the caller's (an admin forking another tenant's sandbox); a tenant
        // no token names any more has the default.
        let owner = Tenant {
            tenant: source.tenant.clone(),
            max_sandboxes: (self.tenants.max_sandboxes(&source.tenant))
                .unwrap_or(crate::config::DEFAULT_MAX_SANDBOXES),
            ..caller.clone()
        };
        self.enqueue(&owner, &new, &op).await
    }
}
