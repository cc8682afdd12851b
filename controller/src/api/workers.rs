//! `PUT /v1/workers/{id}` (admin): a worker gateway's admin URL, token and
//! address pool. The listing is [`super::list`].

use http::StatusCode;
use serde::Deserialize;
use serde_json::{json, Value};

use super::{db, error, json_reply, typed, Api, Reply};
use crate::store;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WorkerBody {
    admin_url: String,
    #[serde(default)]
    token: String,
    pool: String,
}

impl Api {
    /// `PUT /v1/workers/{id}`: `{"admin_url": "http://…", "token", "pool": <CIDR>}`.
    pub(super) async fn worker(
        &self,
        id: &str,
        body: Result<Value, Reply>,
    ) -> Result<Reply, Reply> {
        let req: WorkerBody = typed(body?)?;
        let Ok(pool) = req.pool.parse::<ipnet::IpNet>() else {
            return Err(error(
                StatusCode::BAD_REQUEST,
                &format!("pool: {:?} is not a CIDR", req.pool),
            ));
        };
        // Its first and last addresses stand for the range: every address
        // handed out from it is one the gateway takes.
        let ends = [pool.network(), pool.broadcast()];
        if let Err(e) = egress_api::gateway::sandbox_addresses(&ends) {
            return Err(error(StatusCode::BAD_REQUEST, &format!("pool: {e}")));
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
