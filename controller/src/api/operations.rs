//! One queued operation: `GET /v1/operations/{id}` (the caller's tenant's,
//! or any for an admin).

use http::StatusCode;

use super::{db, error, json_reply, Api, Reply};
use crate::config::Tenant;
use crate::store;

impl Api {
    /// `GET /v1/operations/{id}`: `{"state", "attempts", "error"}`.
    pub(super) async fn operation(&self, caller: &Tenant, id: &str) -> Result<Reply, Reply> {
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
}
