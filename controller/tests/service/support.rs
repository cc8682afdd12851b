//! A real PostgreSQL database per test, the API and dispatcher in-process on
//! loopback, real gateways (in-process `Gateway`s, their admin API on
//! loopback) as push targets, and an HTTP client.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use egress_controller::api::Api;
use egress_controller::config::{Deployment, Tenants};
use egress_controller::dispatcher::{Dispatcher, Limits};
use egress_controller::metrics::Metrics;
use egress_controller::store;
use egress_gateway::config::Config;
use egress_gateway::flowlog::FlowLog;
use egress_gateway::{Gateway, SoOriginalDst};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use sqlx::{Connection, Executor};

pub const ADMIN: &str = "admin-token-0123456789";
pub const FEDERATED: &str = "fed-token-0123456789ab";
pub const PLAIN: &str = "plain-token-0123456789";
/// Tenant `t3`, which may hold two sandboxes at once.
pub const QUOTA: &str = "quota-token-0123456789";
/// Tenant `t4`, which may hold three.
pub const QUOTA_RACE: &str = "quota-race-token-0123456789";

pub const PROFILES: &str = r#"{
    "audit": {"default": true, "allow": [{"domain": "audit.example.test"}]},
    "sensor": {"allow": [{"domain": "sensor.example.test"}, {"cidr": "198.51.100.0/24"}],
               "tls_interception_exemptions": [{"domain": "sensor.example.test"}]}
}"#;
pub const EXEMPTIONS: &str = r#"[{"wildcard_domain": "*.relay.example.test"}]"#;

pub fn tenants() -> Arc<Tenants> {
    Arc::new(
        Tenants::parse(&format!(
            r#"{{"tokens": {{
                "{ADMIN}": {{"tenant": "ops", "federated": true, "admin": true}},
                "{FEDERATED}": {{"tenant": "t1", "federated": true}},
                "{PLAIN}": {{"tenant": "t2", "federated": false}},
                "{QUOTA}": {{"tenant": "t3", "max_sandboxes": 2}},
                "{QUOTA_RACE}": {{"tenant": "t4", "max_sandboxes": 3}}
            }}}}"#
        ))
        .expect("tenants"),
    )
}

pub fn deployment(profiles: Option<&str>, exemptions: Option<&str>) -> Arc<Deployment> {
    Arc::new(Deployment::from_values(profiles, exemptions).expect("deployment"))
}

/// A fresh database on the test cluster (`DATABASE_URL`), or `None` when
/// there is no cluster here (CI sets `EGRESS_E2E_REQUIRED=1`: then it fails, see [`egress_testkit::skip`]).
pub async fn database() -> Option<String> {
    let Ok(url) = std::env::var("DATABASE_URL") else {
        egress_testkit::skip(
            "the service tests",
            "DATABASE_URL is not set (eval \"$(.ci/pg.sh start)\")",
        );
        return None;
    };
    let name = egress_controller::ids::new("t").replace('-', "_");
    let mut admin = sqlx::PgConnection::connect(&url)
        .await
        .expect("connect to DATABASE_URL");
    admin
        .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .await
        .expect("create database");
    let (base, _) = url.rsplit_once('/').expect("a database in the URL");
    Some(format!("{base}/{name}"))
}

/// Skips the test when there is no database here.
#[macro_export]
macro_rules! db {
    () => {
        match $crate::support::database().await {
            Some(url) => url,
            None => return,
        }
    };
}

/// An API on loopback.
pub struct ApiProcess {
    pub addr: SocketAddr,
    pub metrics: Arc<Metrics>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ApiProcess {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub async fn api(url: &str, deployment: Arc<Deployment>) -> ApiProcess {
    let pool = store::connect(url).await.expect("store");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let metrics = Arc::new(Metrics::new());
    let api = Arc::new(Api {
        pool,
        deployment,
        tenants: tenants(),
        metrics: metrics.clone(),
        slots: Default::default(),
    });
    let task = tokio::spawn(egress_controller::api::serve(listener, api));
    ApiProcess {
        addr,
        metrics,
        task,
    }
}

pub fn limits(attempts: i32, deadline_ms: u64, backoff_ms: u64) -> Limits {
    Limits {
        attempts,
        deadline: Duration::from_millis(deadline_ms),
        backoff: Duration::from_millis(backoff_ms),
        resync_interval: Duration::from_millis(200),
        lease_ttl: Duration::from_secs(10),
        ..Limits::default()
    }
}

/// A dispatcher task (it leads once it holds the lock).
pub struct DispatcherTask {
    pub metrics: Arc<Metrics>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for DispatcherTask {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub async fn dispatcher(url: &str, deployment: Arc<Deployment>, limits: Limits) -> DispatcherTask {
    let pool = store::connect(url).await.expect("store");
    let metrics = Arc::new(Metrics::new());
    let d = Dispatcher {
        pool,
        database_url: url.to_owned(),
        deployment,
        metrics: metrics.clone(),
        limits,
    };
    DispatcherTask {
        metrics,
        task: tokio::spawn(d.run()),
    }
}

/// A real gateway whose admin API listens on `admin` (port 0: any).
pub async fn gateway(state: &std::path::Path, admin: &str) -> Gateway {
    gateway_with(state, admin, Arc::new(SoOriginalDst)).await
}

/// [`gateway`], reading each flow's destination from `orig_dst`.
pub async fn gateway_with(
    state: &std::path::Path,
    admin: &str,
    orig_dst: Arc<dyn egress_gateway::OriginalDst>,
) -> Gateway {
    let toml = format!(
        r#"
        state_dir = "{}"
        [listen]
        transparent = "127.0.0.1:0"
        dns = "127.0.0.1:0"
        dns_alt = "127.0.0.1:0"
        admin = "{admin}"
        "#,
        state.display()
    );
    let config = Config::parse(&toml, std::path::Path::new("test.toml")).expect("config");
    Gateway::start(config, orig_dst, FlowLog::off())
        .await
        .expect("gateway starts")
}

/// One request: status and JSON body.
pub async fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    headers: &[(&str, &str)],
    body: Option<Value>,
) -> (u16, Value) {
    let text = body.map(|b| b.to_string()).unwrap_or_default();
    call_text(addr, (method, path), token, headers, text).await
}

/// [`call`] with a body as written (a document `json!` cannot build).
pub async fn call_text(
    addr: SocketAddr,
    (method, path): (&str, &str),
    token: Option<&str>,
    headers: &[(&str, &str)],
    bytes: String,
) -> (u16, Value) {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .expect("http");
    tokio::spawn(conn);
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "127.0.0.1");
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = sender
        .send_request(req.body(Full::new(Bytes::from(bytes))).expect("request"))
        .await
        .expect("answer");
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    let json = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (status, json)
}

/// An API on `url` whose template `base` allows everything, with the
/// worker `w1` at `admin` and its address pool `pool`.
pub async fn allow_all_api(url: &str, admin: SocketAddr, pool: &str) -> ApiProcess {
    let api = api(url, deployment(None, None)).await;
    setup(&api, json!({"default": "allow"}), admin, pool).await;
    api
}

/// Registers the template `base` and the worker `w1` (the gateway at `gw`).
pub async fn setup(api: &ApiProcess, template_policy: Value, gw: SocketAddr, pool: &str) {
    let (s, b) = call(
        api.addr,
        "PUT",
        "/v1/templates/base",
        Some(ADMIN),
        &[],
        Some(json!({"policy": template_policy})),
    )
    .await;
    assert_eq!(s, 200, "{b}");
    let (s, b) = call(
        api.addr,
        "PUT",
        "/v1/workers/w1",
        Some(ADMIN),
        &[],
        Some(json!({"admin_url": format!("http://{gw}"), "token": "", "pool": pool})),
    )
    .await;
    assert_eq!(s, 200, "{b}");
}

/// Polls `GET /v1/operations/{id}` until it is no longer queued (≤ 30 s).
pub async fn settled(api: &ApiProcess, token: &str, op: &str) -> Value {
    for _ in 0..600 {
        let (_, v) = call(
            api.addr,
            "GET",
            &format!("/v1/operations/{op}"),
            Some(token),
            &[],
            None,
        )
        .await;
        if v["state"] == json!("succeeded") || v["state"] == json!("failed") {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("operation {op} did not finish");
}

/// Polls until the gateway holds sandbox `id` (≤ 30 s); its document there.
pub async fn on_gateway(gw: &Gateway, id: &str) -> Value {
    let sid = egress_policy::SandboxId::new(id);
    for _ in 0..600 {
        if let Some(s) = gw.registry().get(&sid) {
            return json!({"addresses": s.addresses, "policy": s.policy.policy()});
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the gateway never received sandbox {id}");
}

/// A gateway, an API and a leading dispatcher on one deployment, with the
/// template `base` (`template_policy`) and the worker `w1` registered.
pub struct World {
    pub gw: Gateway,
    pub api: ApiProcess,
    _dispatcher: DispatcherTask,
    _dir: tempfile::TempDir,
}

pub async fn world(url: &str, d: Arc<Deployment>, template_policy: Value) -> World {
    let dir = tempfile::tempdir().expect("dir");
    let gw = gateway(dir.path(), "127.0.0.1:0").await;
    let api = api(url, d.clone()).await;
    setup(&api, template_policy, gw.bound().admin, "100.64.10.0/24").await;
    let dispatcher = dispatcher(url, d, limits(5, 60_000, 100)).await;
    World {
        gw,
        api,
        _dispatcher: dispatcher,
        _dir: dir,
    }
}

// === dispatcher processes ===

pub const BIN: &str = env!("CARGO_BIN_EXE_egress-controller");

/// A loopback port nobody listens on right now, for a process started
/// later (below the ephemeral range: see `egress_testkit::spare_port`).
pub fn free_port() -> u16 {
    egress_testkit::spare_port()
}

/// A free port on loopback, as an address.
pub fn free_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}

/// A dispatcher process and its log (its stderr); SIGKILLed when dropped.
pub struct DispatcherProcess {
    child: std::process::Child,
    pub log: std::path::PathBuf,
}

impl Drop for DispatcherProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The tokens file of an admin token (`ADMIN`), in `dir`.
pub fn tenants_file(dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join("tenants.json");
    // Written whole and renamed into place: a process started a moment ago
    // may be reading it (truncated in place, it read an empty file and
    // refused to start).
    let body = format!(
        r#"{{"tokens": {{"{ADMIN}": {{"tenant": "ops", "federated": true, "admin": true}}}}}}"#
    );
    egress_api::file::write_atomically(dir, "tenants.json", body.as_bytes()).expect("write");
    path
}

/// `egress-controller dispatcher` on `url` with quick retries and leases of
/// 3 s (plus `extra` flags), its metrics on `metrics`, logging to
/// `dir/<name>.log`.
pub fn spawn_dispatcher(
    url: &str,
    dir: &std::path::Path,
    name: &str,
    metrics: SocketAddr,
    extra: &[&str],
) -> DispatcherProcess {
    let tenants = tenants_file(dir);
    let log = dir.join(format!("{name}.log"));
    let child = std::process::Command::new(BIN)
        .args(["dispatcher", "--tenants"])
        .arg(&tenants)
        .args([
            "--attempts",
            "5",
            "--retry-backoff",
            "100ms",
            "--lease-ttl",
            "3s",
        ])
        .args(extra)
        .arg("--metrics-listen")
        .arg(metrics.to_string())
        .env("DATABASE_URL", url)
        .env_remove("SPACE_EGRESS_PROFILES")
        .env_remove("SPACE_TLS_INTERCEPTION_EXEMPTIONS")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("spawn dispatcher");
    DispatcherProcess { child, log }
}

/// An E2B create of template `base` whose translation is larger than a
/// gateway takes: 62,000 addresses, under a MiB as E2B writes them, over
/// one in normal form.
pub fn oversized_e2b_create() -> Value {
    let allow: Vec<String> = (0..62_000u32)
        .map(|i| std::net::Ipv4Addr::from(0x6440_0000 + i).to_string())
        .collect();
    json!({"templateID": "base", "network": {"allowOut": allow, "denyOut": ["0.0.0.0/0", "::/0"]}})
}
