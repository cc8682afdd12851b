//! `egress-ctlload`: the controller under load, in one process on loopback —
//! the API and a dispatcher on a fresh database of the PostgreSQL cluster
//! `DATABASE_URL` names, and a real gateway (its admin API on loopback) as
//! the push target. Sends `--count` native creates (`--concurrency` at a
//! time), then reports creates/s (API acknowledgement to every operation
//! succeeded) and push latency (API acknowledgement to the gateway holding
//! the sandbox) as JSON, with the five slowest creates and their place in
//! the sending order. `--warmup` creates go first and are not counted.
//! Bounded in count and time.
//!
//! `DATABASE_URL=… cargo run --release -p egress-benches --bin egress-ctlload -- --count 1000`

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use clap::Parser;
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

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 500)]
    count: usize,
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Space the creates this many milliseconds apart (0: as fast as the
    /// concurrency allows): an offered rate below capacity measures push
    /// latency without a backlog.
    #[arg(long, default_value_t = 0)]
    interval_ms: u64,
    /// Creates sent and enforced before the measured ones, not counted:
    /// the figures are of a controller in its steady state, its database
    /// connections open, its push task and its gateway connection up.
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 120)]
    limit_s: u64,
}

const TOKEN: &str = "load-token-0123456789";

async fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Value,
    headers: &[(&str, &str)],
) -> Result<(u16, Value), String> {
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "api")
        .header("authorization", format!("Bearer {TOKEN}"));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
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

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

#[tokio::main]
async fn main() -> Result<(), String> {
    let args = Args::parse();
    let url = std::env::var("DATABASE_URL")
        .map_err(|_| "DATABASE_URL is not set (eval \"$(.ci/pg.sh start)\")".to_owned())?;
    let url = fresh_database(&url).await?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let gw = start_gateway(dir.path()).await?;
    let (addr, dispatcher_metrics) = start_controller(&url).await?;
    seed(addr, &gw).await?;

    let limit = Duration::from_secs(args.limit_s);
    let watch = Watch::start(&gw);
    let warm = create_all(addr, &args, args.warmup).await?;
    watch.until_enforced(&warm, Instant::now(), limit).await?;
    let started = Instant::now();
    let acked = create_all(addr, &args, args.count).await?;
    let api_done = started.elapsed();
    watch.until_enforced(&acked, started, limit).await?;
    let total = started.elapsed();
    let claimed = claimed_after(&url, &acked).await?;
    let latencies = watch.stop(&acked, &claimed).await;
    report(&args, api_done, total, latencies, &dispatcher_metrics);
    Ok(())
}

/// Creates a database of its own on the cluster `url` names; its URL.
async fn fresh_database(url: &str) -> Result<String, String> {
    let db = egress_controller::ids::new("load").replace('-', "_");
    {
        use sqlx::{Connection, Executor};
        let mut admin = sqlx::PgConnection::connect(url)
            .await
            .map_err(|e| e.to_string())?;
        admin
            .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}")))
            .await
            .map_err(|e| e.to_string())?;
    }
    Ok(format!(
        "{}/{db}",
        url.rsplit_once('/').map_or(url, |(b, _)| b)
    ))
}

/// A gateway on loopback, its state in `state_dir`, flow log off.
async fn start_gateway(state_dir: &std::path::Path) -> Result<Gateway, String> {
    let toml = format!(
        "state_dir = \"{}\"\n[listen]\ntransparent = \"127.0.0.1:0\"\ndns = \"127.0.0.1:0\"\ndns_alt = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n[log]\nflow_log = \"off\"\n",
        state_dir.display()
    );
    let config =
        Config::parse(&toml, std::path::Path::new("load.toml")).map_err(|e| e.to_string())?;
    Gateway::start(config, Arc::new(SoOriginalDst), FlowLog::off())
        .await
        .map_err(|e| e.to_string())
}

/// The controller's API and a dispatcher on the database at `url`: the
/// API's address and the dispatcher's metrics.
async fn start_controller(url: &str) -> Result<(SocketAddr, Arc<Metrics>), String> {
    let deployment = Arc::new(Deployment::from_values(
        Some(r#"{"sensor": {"default": true, "allow": [{"domain": "sensor.example.test"}]}}"#),
        None,
    )?);
    let tenants = Arc::new(Tenants::parse(&format!(
        r#"{{"tokens": {{"{TOKEN}": {{"tenant": "load", "federated": true, "admin": true, "max_sandboxes": 1000000}}}}}}"#
    ))?);
    let pool = store::connect(url).await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let api = Arc::new(Api {
        pool: pool.clone(),
        deployment: deployment.clone(),
        tenants,
        metrics: Arc::new(Metrics::new()),
        slots: Default::default(),
    });
    tokio::spawn(egress_controller::api::serve(listener, api));
    let limits = Limits {
        attempts: 5,
        deadline: Duration::from_secs(300),
        backoff: Duration::from_millis(200),
        resync_interval: Duration::from_secs(5),
        ..Limits::default()
    };
    let dispatcher_metrics = Arc::new(Metrics::new());
    tokio::spawn(
        Dispatcher {
            pool,
            database_url: url.to_owned(),
            deployment,
            metrics: dispatcher_metrics.clone(),
            limits,
        }
        .run(),
    );
    Ok((addr, dispatcher_metrics))
}

/// The template the creates name, and the gateway as the one worker.
async fn seed(addr: SocketAddr, gw: &Gateway) -> Result<(), String> {
    call(
        addr,
        "PUT",
        "/v1/templates/base",
        json!({"policy": {"default": "deny", "tls_interception": "on"}}),
        &[],
    )
    .await?;
    let admin_url = format!("http://{}", gw.bound().admin);
    call(
        addr,
        "PUT",
        "/v1/workers/w1",
        json!({"admin_url": admin_url, "pool": "100.64.0.0/14"}),
        &[],
    )
    .await?;
    Ok(())
}

/// Sends `count` creates, `--concurrency` at a time, `--interval-ms`
/// apart: when the API acknowledged each sandbox, and its place in the
/// sending order.
async fn create_all(addr: SocketAddr, args: &Args, count: usize) -> Result<Acked, String> {
    let gate = Arc::new(tokio::sync::Semaphore::new(args.concurrency.max(1)));
    let mut tasks = Vec::with_capacity(count);
    for _ in 0..count {
        if args.interval_ms > 0 {
            tokio::time::sleep(Duration::from_millis(args.interval_ms)).await;
        }
        let gate = gate.clone();
        tasks.push(tokio::spawn(async move {
            let _permit = gate.acquire_owned().await;
            let (status, v) = call(
                addr,
                "POST",
                "/v1/sandboxes",
                json!({"template": "base"}),
                &[],
            )
            .await?;
            if status != 202 {
                return Err(format!("create: {status} {v}"));
            }
            Ok((
                v["sandbox"].as_str().unwrap_or_default().to_owned(),
                Instant::now(),
                SystemTime::now(),
            ))
        }));
    }
    let mut acked = HashMap::new();
    for (i, t) in tasks.into_iter().enumerate() {
        let (id, at, wall) = t.await.map_err(|e| e.to_string())??;
        acked.insert(id, (i, at, wall));
    }
    Ok(acked)
}

/// Each acknowledged create: its place in the sending order, and when the
/// API answered (monotonic, and by the wall clock the database shares).
type Acked = HashMap<String, (usize, Instant, SystemTime)>;

/// One create's push latency, its place in the sending order, and how much
/// of the latency passed before the dispatcher claimed its operation.
struct Latency {
    ms: f64,
    create: usize,
    claimed_ms: f64,
}

/// When the dispatcher claimed each acknowledged create's operation, as
/// milliseconds after the API's answer: the operation's `finished_at`,
/// which is the start of the transaction that ran it.
async fn claimed_after(url: &str, acked: &Acked) -> Result<HashMap<String, f64>, String> {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(url)
        .await
        .map_err(|e| e.to_string())?;
    let ids: Vec<String> = acked.keys().cloned().collect();
    let rows: Vec<(String, f64)> = sqlx::query_as(
        "SELECT sandbox, extract(epoch FROM finished_at)::float8 FROM operations WHERE sandbox = ANY($1) AND finished_at IS NOT NULL",
    )
    .bind(&ids)
    .fetch_all(&mut conn)
    .await
    .map_err(|e| e.to_string())?;
    let mut out = HashMap::new();
    for (id, finished) in rows {
        if let Some((_, _, wall)) = acked.get(&id) {
            let acked_s = wall
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            out.insert(id, (finished - acked_s) * 1000.0);
        }
    }
    Ok(out)
}

/// When each sandbox first appears on the gateway, watched from the start.
struct Watch {
    seen: Arc<std::sync::Mutex<HashMap<String, Instant>>>,
    watching: Arc<std::sync::atomic::AtomicBool>,
    watcher: tokio::task::JoinHandle<()>,
}

impl Watch {
    /// Polls the gateway's sandboxes every millisecond.
    fn start(gw: &Gateway) -> Self {
        let seen: Arc<std::sync::Mutex<HashMap<String, Instant>>> = Arc::default();
        let watching = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let watcher = {
            let (seen, watching, registry) =
                (seen.clone(), watching.clone(), gw.registry().clone());
            tokio::spawn(async move {
                while watching.load(std::sync::atomic::Ordering::Relaxed) {
                    let now = Instant::now();
                    let ids = registry.ids();
                    {
                        let mut seen = seen
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner);
                        for id in ids {
                            seen.entry(id.to_string()).or_insert(now);
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            })
        };
        Self {
            seen,
            watching,
            watcher,
        }
    }

    /// Waits until every acknowledged sandbox reached the gateway, or
    /// `limit` after `started`.
    async fn until_enforced(
        &self,
        acked: &Acked,
        started: Instant,
        limit: Duration,
    ) -> Result<(), String> {
        loop {
            if started.elapsed() > limit {
                return Err(format!(
                    "not every sandbox reached the gateway within {limit:?}"
                ));
            }
            let done = {
                let seen = self
                    .seen
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                acked.keys().all(|id| seen.contains_key(id))
            };
            if done {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Stops watching: the push latency of each acknowledged sandbox seen,
    /// in milliseconds, with the create's place in the sending order.
    async fn stop(self, acked: &Acked, claimed: &HashMap<String, f64>) -> Vec<Latency> {
        self.watching
            .store(false, std::sync::atomic::Ordering::Relaxed);
        let _ = self.watcher.await;
        let mut latencies = Vec::with_capacity(acked.len());
        let seen = self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for (id, (i, at, _)) in acked {
            if let Some(t) = seen.get(id) {
                latencies.push(Latency {
                    ms: t.saturating_duration_since(*at).as_secs_f64() * 1000.0,
                    create: *i,
                    claimed_ms: claimed.get(id).copied().unwrap_or(f64::NAN),
                });
            }
        }
        latencies
    }
}

/// The dispatcher's metrics on stderr if `CTLLOAD_METRICS` is set; the
/// figures as one JSON line on stdout.
fn report(
    args: &Args,
    api_done: Duration,
    total: Duration,
    mut latencies: Vec<Latency>,
    dispatcher_metrics: &Metrics,
) {
    if std::env::var_os("CTLLOAD_METRICS").is_some() {
        eprintln!("{}", dispatcher_metrics.encode());
    }
    latencies.sort_by(|a, b| a.ms.total_cmp(&b.ms));
    // The slowest five with their place in the sending order (whether the
    // tail is the first creates or spread) and when they were claimed
    // (whether they waited in the queue or after it).
    let slowest: Vec<Value> = latencies
        .iter()
        .rev()
        .take(5)
        .map(|l| json!({"create": l.create, "ms": l.ms, "claimed_ms": l.claimed_ms}))
        .collect();
    let mut claimed: Vec<f64> = latencies.iter().map(|l| l.claimed_ms).collect();
    claimed.sort_by(f64::total_cmp);
    let mut after: Vec<f64> = latencies.iter().map(|l| l.ms - l.claimed_ms).collect();
    after.sort_by(f64::total_cmp);
    let latencies: Vec<f64> = latencies.into_iter().map(|l| l.ms).collect();
    let spread = |v: &[f64]| json!({"p50": percentile(v, 0.5), "p90": percentile(v, 0.9), "p99": percentile(v, 0.99)});
    println!(
        "{}",
        json!({
            "creates": args.count,
            "warmup": args.warmup,
            "concurrency": args.concurrency,
            "interval_ms": args.interval_ms,
            "api_creates_per_s": args.count as f64 / api_done.as_secs_f64(),
            "enforced_per_s": args.count as f64 / total.as_secs_f64(),
            "push_latency_ms": spread(&latencies),
            "acked_to_claimed_ms": spread(&claimed),
            "claimed_to_enforced_ms": spread(&after),
            "slowest": slowest,
        })
    );
}
