//! `PUT /v1/templates/{id}` (admin): a template's default effective
//! policy. Its warm pool is [`super::pool`], its shadow rollout
//! [`super::shadow`].

use http::StatusCode;
use serde::Deserialize;
use serde_json::{json, Value};

use super::{db, error, json_reply, policy_field, typed, Api, Reply};
use crate::store;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TemplateBody {
    policy: Value,
}

impl Api {
    /// `PUT /v1/templates/{id}`: `{"policy": <effective policy>}`.
    pub(super) async fn template(
        &self,
        id: &str,
        body: Result<Value, Reply>,
    ) -> Result<Reply, Reply> {
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
}
