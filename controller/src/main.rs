//! `egress-controller api` and `egress-controller dispatcher`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use egress_controller::api::Api;
use egress_controller::config::{Deployment, Tenants};
use egress_controller::dispatcher::{Dispatcher, Limits};
use egress_controller::metrics::Metrics;
use egress_controller::store;

#[derive(Parser)]
#[command(
    name = "egress-controller",
    version,
    about = "Sandbox egress API service and dispatcher"
)]
struct Cli {
    #[command(subcommand)]
    role: Role,
}

/// What both roles need.
#[derive(clap::Args)]
struct Common {
    /// PostgreSQL, e.g. postgres://user@127.0.0.1:5432/egress
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    /// `{"tokens": {"<token>": {"tenant", "federated", "admin"}}}`
    #[arg(long, value_name = "FILE")]
    tenants: PathBuf,
}

#[derive(Subcommand)]
enum Role {
    /// The HTTP API.
    Api {
        #[command(flatten)]
        common: Common,
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: SocketAddr,
    },
    /// Executes queued operations and pushes to gateways; the workers are
    /// split among the running replicas.
    Dispatcher {
        #[command(flatten)]
        common: Common,
        /// Attempts an operation gets.
        #[arg(long, default_value_t = 5)]
        attempts: i32,
        /// How long after it was queued an operation may still run.
        #[arg(long, default_value = "5m", value_parser = duration)]
        deadline: Duration,
        /// The wait before a retry.
        #[arg(long, default_value = "2s", value_parser = duration)]
        retry_backoff: Duration,
        /// How often each gateway is compared with the store.
        #[arg(long, default_value = "5s", value_parser = duration)]
        resync_interval: Duration,
        /// How long a worker shard's lease lasts unless renewed (renewed
        /// every third of it; a dead replica's shards move after it).
        #[arg(long, default_value = "15s", value_parser = duration)]
        lease_ttl: Duration,
        /// How long finished operations are kept (then `GET
        /// /v1/operations/{id}` is 404).
        #[arg(long, default_value = "7d", value_parser = duration)]
        operation_retention: Duration,
        /// How long after it was queued a finished operation's
        /// `Idempotency-Key` still replays it.
        #[arg(long, default_value = "24h", value_parser = duration)]
        idempotency_retention: Duration,
        /// Where /metrics is served.
        #[arg(long, default_value = "127.0.0.1:9090")]
        metrics_listen: SocketAddr,
    },
}

/// The dispatcher's limits, checked together; errors name the flag and value.
/// The longest any duration flag may be.
const MAX_FLAG_DURATION: Duration = Duration::from_secs(365 * 86_400);

fn checked(limits: Limits) -> Result<Limits, String> {
    let shown = |d: Duration| format!("{}ms", d.as_millis());
    if limits.attempts < 1 {
        return Err(format!(
            "--attempts {}: must be at least 1",
            limits.attempts
        ));
    }
    for (flag, d) in [
        ("--deadline", limits.deadline),
        ("--resync-interval", limits.resync_interval),
    ] {
        if d < Duration::from_millis(100) {
            return Err(format!("{flag} {}: must be at least 100ms", shown(d)));
        }
    }
    if limits.lease_ttl < Duration::from_secs(1) {
        return Err(format!(
            "--lease-ttl {}: must be at least 1s",
            shown(limits.lease_ttl)
        ));
    }
    for (flag, d) in [
        ("--operation-retention", limits.operation_retention),
        ("--idempotency-retention", limits.idempotency_retention),
    ] {
        if d < Duration::from_secs(1) {
            return Err(format!("{flag} {}: must be at least 1s", shown(d)));
        }
    }
    // Past a year a value means nothing an operator wants, and far past
    // it the clock arithmetic it feeds (and PostgreSQL's intervals) fails.
    for (flag, d) in [
        ("--deadline", limits.deadline),
        ("--retry-backoff", limits.backoff),
        ("--resync-interval", limits.resync_interval),
        ("--lease-ttl", limits.lease_ttl),
        ("--operation-retention", limits.operation_retention),
        ("--idempotency-retention", limits.idempotency_retention),
    ] {
        if d > MAX_FLAG_DURATION {
            return Err(format!("{flag} {}: longer than 365d", shown(d)));
        }
    }
    if limits.idempotency_retention > limits.operation_retention {
        return Err(format!(
            "--idempotency-retention {}: longer than --operation-retention {} (a key goes with its operation)",
            shown(limits.idempotency_retention),
            shown(limits.operation_retention)
        ));
    }
    Ok(limits)
}

/// `500ms`, `30s`, `5m`, `1h`, `7d`.
fn duration(s: &str) -> Result<Duration, String> {
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: u64 = n
        .parse()
        .map_err(|_| format!("invalid duration {s:?}: expected e.g. 500ms, 30s, 5m"))?;
    let scale = match unit {
        "ms" => return Ok(Duration::from_millis(n)),
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => {
            return Err(format!(
                "invalid duration {s:?}: the unit must be ms, s, m, h or d"
            ))
        }
    };
    n.checked_mul(scale)
        .map(Duration::from_secs)
        .ok_or_else(|| format!("invalid duration {s:?}: too long"))
}

fn fail(e: impl std::fmt::Display) -> ExitCode {
    eprintln!("egress-controller: {e}");
    ExitCode::FAILURE
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    // Configuration first: a bad one stops every role, a standby included,
    // before it touches the database or tries to lead.
    let deployment = match Deployment::from_env() {
        Ok(d) => Arc::new(d),
        Err(e) => return fail(e),
    };
    let common = match &cli.role {
        Role::Api { common, .. } | Role::Dispatcher { common, .. } => common,
    };
    let tenants = match Tenants::load(&common.tenants) {
        Ok(t) => Arc::new(t),
        Err(e) => return fail(e),
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => return fail(format_args!("cannot start the runtime: {e}")),
    };
    runtime.block_on(run(cli.role, deployment, tenants))
}

async fn run(role: Role, deployment: Arc<Deployment>, tenants: Arc<Tenants>) -> ExitCode {
    let metrics = Arc::new(Metrics::new());
    match role {
        Role::Api { common, listen } => {
            let pool = match store::connect(&common.database_url).await {
                Ok(p) => p,
                Err(e) => return fail(e),
            };
            let listener = match tokio::net::TcpListener::bind(listen).await {
                Ok(l) => l,
                Err(e) => return fail(format_args!("--listen {listen}: {e}")),
            };
            tracing::info!(%listen, profiles = deployment.profiles.len(), "API serving");
            let api = Arc::new(Api {
                pool,
                deployment,
                tenants,
                metrics,
                slots: Default::default(),
            });
            egress_controller::api::serve_until(listener, api, stopped()).await;
            tracing::info!("API stopped");
        }
        Role::Dispatcher {
            common,
            attempts,
            deadline,
            retry_backoff,
            resync_interval,
            lease_ttl,
            operation_retention,
            idempotency_retention,
            metrics_listen,
        } => {
            let limits = checked(Limits {
                attempts,
                deadline,
                backoff: retry_backoff,
                resync_interval,
                lease_ttl,
                operation_retention,
                idempotency_retention,
            });
            let limits = match limits {
                Ok(l) => l,
                Err(e) => return fail(e),
            };
            return dispatch(common, limits, metrics_listen, deployment, metrics).await;
        }
    }
    ExitCode::SUCCESS
}

async fn dispatch(
    common: Common,
    limits: Limits,
    metrics_listen: SocketAddr,
    deployment: Arc<Deployment>,
    metrics: Arc<Metrics>,
) -> ExitCode {
    let pool = match store::connect(&common.database_url).await {
        Ok(p) => p,
        Err(e) => return fail(e),
    };
    let listener = match tokio::net::TcpListener::bind(metrics_listen).await {
        Ok(l) => l,
        Err(e) => return fail(format_args!("--metrics-listen {metrics_listen}: {e}")),
    };
    warn_of_shared_gateways(&pool).await;
    tokio::spawn(egress_controller::api::serve_metrics(
        listener,
        metrics.clone(),
    ));
    // Warm pools refill beside the dispatchers (one round at a time).
    tokio::spawn(egress_controller::pool::refill_forever(pool.clone()));
    let d = Dispatcher {
        pool,
        database_url: common.database_url,
        deployment,
        metrics,
        limits,
    };
    d.run_until(stopped()).await;
    ExitCode::SUCCESS
}

/// Warns of each group of workers registered with one gateway: a store
/// written before registrations were checked may hold some, and their
/// resyncs undo each other's pushes.
async fn warn_of_shared_gateways(pool: &sqlx::PgPool) {
    match store::workers_sharing_gateways(pool).await {
        Ok(groups) => {
            for workers in groups {
                tracing::warn!(
                    ?workers,
                    "these workers are registered with one gateway, and each one's resyncs undo the others' pushes: register all but one of them with another admin_url (GET /v1/workers shows shares_gateway_with)"
                );
            }
        }
        Err(e) => tracing::warn!(error = %e, "could not read the workers to check their gateways"),
    }
}

/// SIGTERM or SIGINT (a signal handler that cannot be installed: never).
async fn stopped() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
