//! The store's side: a database of its own, the workers and the registered
//! sandboxes, queued creates, creates through the API, and waits.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::procs::Gw;
use crate::{Args, TOKEN};

/// Operations queued.
pub(crate) const QUEUED: &str = "SELECT count(*) FROM operations WHERE state = 'queued'";

/// Operations queued, or changes not yet on their gateway.
pub(crate) const UNFINISHED: &str = "SELECT (SELECT count(*) FROM operations WHERE state = 'queued') + (SELECT count(*) FROM sandboxes WHERE generation > pushed_generation)";

/// Creates a database of its own on the cluster `url` names; its URL.
pub(crate) async fn fresh_database(url: &str) -> Result<String, String> {
    use sqlx::{Connection, Executor};
    let db = egress_controller::ids::new("fleet").replace('-', "_");
    let mut admin = sqlx::PgConnection::connect(url)
        .await
        .map_err(|e| e.to_string())?;
    admin
        .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}")))
        .await
        .map_err(|e| e.to_string())?;
    Ok(format!(
        "{}/{db}",
        url.rsplit_once('/').map_or(url, |(b, _)| b)
    ))
}

const REGISTER: &str = "INSERT INTO sandboxes (id, tenant, template, egress_profiles, policy, inherits_template, state, worker, addresses, generation, pushed_generation) SELECT 'sb-bg-' || $1 || '-' || g, 't1', 'base', '{}', jsonb_build_object('default', 'allow'), true, 'running', $1, ARRAY[host(network(w.pool::cidr) + g)], 1, 1 FROM workers w, generate_series(1, $2::bigint) g WHERE w.id = $1";

/// The template, one worker per gateway (`w0` … with a /16 each), and the
/// registered sandboxes written straight to the store (`--resync-size` on
/// `w0`, the rest spread), as running and pushed: each gateway gets its
/// share by the first resync.
pub(crate) async fn register(
    pool: &PgPool,
    api: SocketAddr,
    gws: &[Gw],
    args: &Args,
) -> Result<(), String> {
    let policy = json!({"policy": {"default": "allow"}});
    expect_ok(call(api, "PUT", "/v1/templates/base", &policy).await?)?;
    for (i, gw) in gws.iter().enumerate() {
        let body = json!({"admin_url": format!("http://{}", gw.admin), "token": "",
            "pool": format!("100.{}.0.0/16", 64 + i)});
        expect_ok(call(api, "PUT", &format!("/v1/workers/w{i}"), &body).await?)?;
    }
    let others = gws.len().saturating_sub(1).max(1);
    let rest = args.registered.saturating_sub(args.resync_size);
    for i in 0..gws.len() {
        let n = if i == 0 {
            args.resync_size
        } else {
            rest / others
        };
        sqlx::query(REGISTER)
            .bind(format!("w{i}"))
            .bind(n as i64)
            .execute(pool)
            .await
            .map_err(|e| format!("registering sandboxes: {e}"))?;
    }
    // The cursors start past the addresses written here.
    sqlx::query("UPDATE address_cursors c SET pool = w.pool, next = c.live FROM workers w WHERE w.id = c.worker")
        .execute(pool)
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}

fn expect_ok((status, body): (u16, Value)) -> Result<(), String> {
    (status == 200)
        .then_some(())
        .ok_or(format!("{status}: {body}"))
}

const QUEUE: &str = "WITH s AS (INSERT INTO sandboxes (id, tenant, template, egress_profiles, inherits_template, state) SELECT 'sb-' || $1 || '-' || g, 't1', 'base', '{}', true, 'creating' FROM generate_series(1, $2::bigint) g RETURNING id) INSERT INTO operations (id, tenant, kind, sandbox, payload) SELECT 'op-' || s.id, 't1', 'create', s.id, jsonb_build_object('policy', NULL, 'worker', NULL) FROM s";

/// `n` creates queued in one transaction (the dispatchers wake at commit).
pub(crate) async fn queue(pool: &PgPool, tag: &str, n: usize) -> Result<(), String> {
    sqlx::query(QUEUE)
        .bind(tag)
        .bind(n as i64)
        .execute(pool)
        .await
        .map_err(|e| format!("queueing: {e}"))?;
    Ok(())
}

/// Polls `sql` (a count) every 50 ms until it is 0, within `limit`.
pub(crate) async fn until(pool: &PgPool, sql: &str, limit: Duration) -> Result<(), String> {
    let started = Instant::now();
    loop {
        let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .fetch_one(pool)
            .await
            .map_err(|e| e.to_string())?;
        if n == 0 {
            return Ok(());
        }
        if started.elapsed() > limit {
            return Err(format!("still {n} after {limit:?}: {sql}"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Until `n` dispatchers hold the 64 shards between them.
pub(crate) async fn until_holders(pool: &PgPool, n: usize, limit: Duration) -> Result<(), String> {
    let sql = format!(
        "SELECT CASE WHEN count(DISTINCT holder) = {n} AND count(*) = 64 THEN 0 ELSE 1 END::bigint FROM dispatcher_shards WHERE holder IS NOT NULL AND expires > now()"
    );
    until(pool, &sql, limit).await
}

/// `n` creates through the API, `concurrency` at a time: each one's seconds.
pub(crate) async fn api_creates(
    api: SocketAddr,
    n: usize,
    concurrency: usize,
) -> Result<Vec<f64>, String> {
    let mut out = Vec::with_capacity(n);
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        if tasks.len() >= concurrency {
            if let Some(r) = tasks.join_next().await {
                out.push(r.map_err(|e| e.to_string())??);
            }
        }
        tasks.spawn(async move {
            let started = Instant::now();
            let (s, v) = call(api, "POST", "/v1/sandboxes", &json!({"template": "base"})).await?;
            if s != 202 {
                return Err(format!("create {i}: {s}: {v}"));
            }
            Ok::<_, String>(started.elapsed().as_secs_f64())
        });
    }
    while let Some(r) = tasks.join_next().await {
        out.push(r.map_err(|e| e.to_string())??);
    }
    Ok(out)
}

async fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &Value,
) -> Result<(u16, Value), String> {
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "api")
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| e.to_string())?;
    let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    ))
}
