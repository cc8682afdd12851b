//! `egress-fleetload`: the controller at fleet scale, on loopback. Real
//! `egress-gateway` processes (`--gateways`, 50 by default) are the workers;
//! `--registered` sandboxes (100,000 by default, `--resync-size` of them on
//! the first worker) are in the store and on the gateways before anything
//! is measured; the API runs in this process and the dispatchers are
//! `egress-controller dispatcher` processes. In `--rounds` interleaved
//! rounds, for each dispatcher count of `--dispatchers` (1,2,4):
//!
//! - `--ops` creates are queued in one transaction (unnamed workers: the
//!   least loaded gets each) and the time until every one ran and reached
//!   its gateway gives the dispatchers' operations/s, with the CPU seconds
//!   PostgreSQL, the dispatchers, the gateways and this process spent;
//! - then `--api-creates` creates through the API (`--concurrency` at a
//!   time) while the dispatchers work: the API's p50/p99.
//!
//! Last, the first worker's gateway is SIGKILLed and restarted
//! (`--restarts` times): the time from its readiness to the store holding
//! its new epoch, resynced (the dispatchers compare every second).
//! Bounded by `--limit-s` per wait. Prints one JSON line per measurement.
//!
//! `eval "$(PGPORT_TEST=54339 .ci/pg.sh start)" && cargo build -p egress-gateway
//!  -p egress-controller -p egress-benches --bins && target/debug/egress-fleetload
//!  --gateway target/debug/egress-gateway --controller target/debug/egress-controller`

mod procs;
mod seed;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use egress_controller::api::Api;
use egress_controller::config::{Deployment, Tenants};
use egress_controller::metrics::Metrics;
use serde_json::json;
use sqlx::PgPool;

use procs::{Cpu, Dispatchers, Gw};

#[derive(Parser)]
pub(crate) struct Args {
    /// The gateway binary.
    #[arg(long)]
    gateway: PathBuf,
    /// The controller binary (its dispatcher role).
    #[arg(long)]
    controller: PathBuf,
    #[arg(long, default_value_t = 50)]
    gateways: usize,
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    dispatchers: Vec<usize>,
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Creates queued at once per measurement.
    #[arg(long, default_value_t = 2_000)]
    ops: usize,
    /// Creates through the API per measurement.
    #[arg(long, default_value_t = 400)]
    api_creates: usize,
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Sandboxes in the store (and on the gateways) before measuring.
    #[arg(long, default_value_t = 100_000)]
    registered: usize,
    /// Of those, on the first worker (the one restarted).
    #[arg(long, default_value_t = 5_000)]
    resync_size: usize,
    #[arg(long, default_value_t = 3)]
    restarts: usize,
    /// Longest wait for anything, in seconds.
    #[arg(long, default_value_t = 600)]
    limit_s: u64,
    /// Where state directories go.
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
    /// Where the dispatchers' logs go (appended; `info`); default: with the state.
    #[arg(long)]
    logs: Option<PathBuf>,
}

pub(crate) const TOKEN: &str = "load-token-0123456789";

#[tokio::main]
async fn main() -> Result<(), String> {
    let args = Args::parse();
    let url = std::env::var("DATABASE_URL")
        .map_err(|_| "DATABASE_URL is not set (eval \"$(.ci/pg.sh start)\")".to_owned())?;
    let url = seed::fresh_database(&url).await?;
    let dir = tempfile::tempdir_in(&args.dir).map_err(|e| e.to_string())?;
    let pool = egress_controller::store::connect(&url).await?;
    let api = start_api(pool.clone()).await?;
    let mut gws = Vec::new();
    for i in 0..args.gateways {
        gws.push(Gw::start(&args.gateway, &dir.path().join(format!("gw{i}"))).await?);
    }
    seed::register(&pool, api, &gws, &args).await?;
    let limit = Duration::from_secs(args.limit_s);
    let logs = args.logs.clone().unwrap_or_else(|| dir.path().to_owned());
    let env = procs::DispatcherEnv::new(&args.controller, &logs, &url)?;
    initial_resync(&pool, &env, &args, &gws, limit).await?;
    for round in 0..args.rounds {
        for &n in &args.dispatchers {
            measure(&pool, api, &env, &gws, (round, n), &args).await?;
        }
    }
    restarts(&pool, &env, &mut gws, &args, limit).await?;
    Ok(())
}

async fn start_api(pool: PgPool) -> Result<SocketAddr, String> {
    let tenants = Tenants::parse(&format!(
        r#"{{"tokens": {{"{TOKEN}": {{"tenant": "t1", "federated": true, "admin": true}}}}}}"#
    ))?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let api = Arc::new(Api {
        pool,
        deployment: Arc::new(Deployment::default()),
        tenants: Arc::new(tenants),
        metrics: Arc::new(Metrics::new()),
        slots: Default::default(),
    });
    tokio::spawn(egress_controller::api::serve(listener, api));
    Ok(addr)
}

/// Every gateway given its share of the registered sandboxes (a resync each).
async fn initial_resync(
    pool: &PgPool,
    env: &procs::DispatcherEnv,
    args: &Args,
    gws: &[Gw],
    limit: Duration,
) -> Result<(), String> {
    let n = args.dispatchers.iter().copied().max().unwrap_or(1);
    let started = Instant::now();
    let ds = Dispatchers::start(env, n)?;
    seed::until(
        pool,
        "SELECT count(*) FROM workers WHERE needs_resync",
        limit,
    )
    .await?;
    let took = started.elapsed().as_secs_f64();
    ds.stop().await;
    let line = json!({"phase": "initial_resync", "dispatchers": n, "gateways": gws.len(),
        "sandboxes": args.registered, "seconds": took});
    println!("{line}");
    Ok(())
}

/// One measurement with `n` dispatchers: queued operations/s, then API latency.
async fn measure(
    pool: &PgPool,
    api: SocketAddr,
    env: &procs::DispatcherEnv,
    gws: &[Gw],
    (round, n): (usize, usize),
    args: &Args,
) -> Result<(), String> {
    let limit = Duration::from_secs(args.limit_s);
    let ds = Dispatchers::start(env, n)?;
    seed::until_holders(pool, n, limit).await?;
    let before = Cpu::sample(&ds, gws, env);
    let started = Instant::now();
    seed::queue(pool, &format!("r{round}n{n}"), args.ops).await?;
    seed::until(pool, seed::QUEUED, limit).await?;
    let executed = started.elapsed().as_secs_f64();
    seed::until(pool, seed::UNFINISHED, limit).await?;
    let took = started.elapsed().as_secs_f64();
    let cpu = Cpu::sample(&ds, gws, env).minus(&before);
    let mut lat = seed::api_creates(api, args.api_creates, args.concurrency).await?;
    seed::until(pool, seed::UNFINISHED, limit).await?;
    ds.stop().await;
    lat.sort_by(f64::total_cmp);
    let line = json!({"phase": "dispatch", "round": round, "dispatchers": n,
        "ops": args.ops, "executed_s": executed, "seconds": took, "ops_per_s": args.ops as f64 / took,
        "cpu_share": cpu.shares(took),
        "api_creates": lat.len(), "api_p50_ms": pct(&lat, 0.5) * 1e3, "api_p99_ms": pct(&lat, 0.99) * 1e3});
    println!("{line}");
    Ok(())
}

/// The first worker's gateway SIGKILLed and restarted; the time from its
/// readiness to the store holding its new epoch with nothing to resync.
async fn restarts(
    pool: &PgPool,
    env: &procs::DispatcherEnv,
    gws: &mut [Gw],
    args: &Args,
    limit: Duration,
) -> Result<(), String> {
    let ds = Dispatchers::start(env, 2)?;
    seed::until_holders(pool, 2, limit).await?;
    for i in 0..args.restarts {
        let Some(gw) = gws.first_mut() else { break };
        let (epoch, ready) = gw.restart(&args.gateway).await?;
        let sql = format!(
            "SELECT count(*) FROM workers WHERE id = 'w0' AND (needs_resync OR epoch IS DISTINCT FROM '{epoch}')"
        );
        seed::until(pool, &sql, limit).await?;
        let took = ready.elapsed().as_secs_f64();
        let line = json!({"phase": "restart_resync", "restart": i, "sandboxes": args.resync_size,
            "resync_interval_s": 1, "seconds_after_ready": took});
        println!("{line}");
    }
    ds.stop().await;
    Ok(())
}

pub(crate) fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}
