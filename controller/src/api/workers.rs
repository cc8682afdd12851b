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
        if let Some(why) = unusable_pool(&pool) {
            return Err(error(StatusCode::BAD_REQUEST, &format!("pool: {why}")));
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
        let put = store::put_worker(&self.pool, id, &req.admin_url, &req.token, &req.pool)
            .await
            .map_err(db)?;
        if let Err(other) = put {
            // Each worker's dispatcher task resyncs its gateway to that
            // worker's sandboxes alone: two on one gateway would each
            // undo the other's.
            let why = format!(
                "admin_url: {:?} is the gateway of worker {other:?}; one gateway serves one worker",
                req.admin_url
            );
            return Err(egress_api::reply::error(
                StatusCode::CONFLICT,
                &why,
                Some("admin_url"),
            ));
        }
        Ok(json_reply(
            StatusCode::OK,
            &json!({"id": id, "admin_url": req.admin_url, "pool": req.pool}),
        ))
    }
}

/// Why no sandbox address may come from `pool`: it overlaps a range the
/// gateway refuses ([`egress_api::gateway::sandbox_addresses`]).
fn unusable_pool(pool: &ipnet::IpNet) -> Option<String> {
    // The gateway reads an IPv4-mapped address as IPv4: their mapped forms
    // (`::ffff:169.254.0.0/112`) are refused the same.
    const REFUSED: [&str; 11] = [
        "0.0.0.0/32",
        "255.255.255.255/32",
        "224.0.0.0/4",
        "169.254.0.0/16",
        "::ffff:0.0.0.0/128",
        "::ffff:255.255.255.255/128",
        "::ffff:224.0.0.0/100",
        "::ffff:169.254.0.0/112",
        "::/128",
        "ff00::/8",
        "fe80::/10",
    ];
    let overlaps =
        |a: &ipnet::IpNet, b: &ipnet::IpNet| a.contains(&b.network()) || b.contains(&a.network());
    REFUSED
        .iter()
        .filter_map(|r| r.parse::<ipnet::IpNet>().ok())
        .find(|r| overlaps(pool, r))
        .map(|r| {
            let sample = [r.network()];
            let why = egress_api::gateway::sandbox_addresses(&sample)
                .err()
                .unwrap_or_default();
            format!("{pool} overlaps {r} ({why})")
        })
}
