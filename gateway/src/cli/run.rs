//! `egress-gateway run`: start, say where everything is, serve until a signal.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use clap::Args;
use tokio::signal::unix::Signal;

use super::output::fail;
use crate::config::Config;
use crate::flowlog::FlowLog;
use crate::{Gateway, SoOriginalDst};

// The doc comments are `--help` text, where `[listen]` names the TOML table.
#[allow(rustdoc::broken_intra_doc_links)]
#[derive(Debug, Args)]
pub(super) struct RunArgs {
    /// TOML configuration; every key has a default, so this is optional.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Replace the gateway running on the same state_dir without a window:
    /// take over its listening sockets, its pushed state and its DNS
    /// attribution; it then drains and exits. Same [listen] required.
    #[arg(long, conflicts_with = "check")]
    take_over: bool,
    /// Only read and check the configuration (every table of it, as a
    /// start would), say so, and exit: 0 when it loads, 1 naming the bad
    /// key otherwise. Nothing is started or touched.
    #[arg(long, requires = "config")]
    check: bool,
}

pub(super) fn run(args: &RunArgs) -> ExitCode {
    let config_path = args.config.as_deref();
    init_logging();

    let config = match config_path.map_or_else(|| Ok(Config::default()), Config::load) {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    if args.check {
        let path = config_path
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        println!("{path}: the configuration loads");
        return ExitCode::SUCCESS;
    }
    open_files(&config);
    let runtime = match runtime(&config.limits) {
        Ok(rt) => rt,
        Err(e) => return fail(format_args!("cannot start the runtime: {e}")),
    };
    runtime.block_on(async move {
        // Signal handlers before anything else: a SIGHUP or SIGTERM during
        // startup is then handled, not the default "terminate".
        let (hup, term, usr2) = match signals() {
            Ok(s) => s,
            Err(e) => return fail(format_args!("cannot install signal handlers: {e}")),
        };
        let flow_log = match FlowLog::open(&config.log.flow_log, config.log.flow_log_max_bytes) {
            Ok(l) => l,
            Err(e) => {
                return fail(format_args!("log.flow_log: {}: {e}", config.log.flow_log));
            }
        };
        if config.dns.upstreams.is_empty() {
            tracing::warn!("dns.upstreams is empty: every DNS query will be answered SERVFAIL");
        }
        let gateway = match start(config, flow_log, args.take_over).await {
            Ok(g) => g,
            Err(e) => return fail(e),
        };
        announce(&gateway);
        super::upgrade::ready();
        let upgrader = tokio::spawn(super::upgrade::on_sigusr2(
            usr2,
            std::env::args_os().collect(),
        ));
        let reloader = tokio::spawn(reload_on_sighup(
            hup,
            gateway.dataplane().clone(),
            gateway.ca_reloader(),
            config_path.map(Path::to_owned),
        ));
        let dp = gateway.dataplane().clone();
        let stopped = gateway.run(shutdown_signal(term, dp)).await;
        reloader.abort();
        upgrader.abort();
        exit_code(&stopped)
    })
}

/// Logs how the gateway stopped; a failure exits so, for a supervisor
/// (systemd's `Restart=on-failure`, a kubelet) to start it again.
fn exit_code(stopped: &crate::gateway::Stopped) -> ExitCode {
    match stopped.left {
        0 if stopped.cut_short => tracing::warn!(
            "stopped; the flows still draining were cut before the drain's deadline: the successor stopped telling this gateway which sandboxes change"
        ),
        0 => tracing::info!("stopped; every flow finished"),
        n => tracing::warn!(
            open_flows = n,
            "stopped at the drain deadline with flows still open"
        ),
    }
    match stopped.failed {
        Some(_) => ExitCode::FAILURE,
        None => ExitCode::SUCCESS,
    }
}

/// SIGHUP (reload), SIGTERM (drain) and SIGUSR2 (a successor takes over).
fn signals() -> std::io::Result<(Signal, Signal, Signal)> {
    use tokio::signal::unix::{signal, SignalKind};
    Ok((
        signal(SignalKind::hangup())?,
        signal(SignalKind::terminate())?,
        signal(SignalKind::user_defined2())?,
    ))
}

/// Starts the gateway, or takes over from the one running on its state
/// directory once everything a takeover cannot undo has been checked.
async fn start(config: Config, flow_log: FlowLog, take_over: bool) -> Result<Gateway, String> {
    let orig_dst = Arc::new(SoOriginalDst);
    if !take_over {
        return Gateway::start(config, orig_dst, flow_log)
            .await
            .map_err(|e| e.to_string());
    }
    let asked = config.clone();
    let taken = tokio::task::spawn_blocking(move || {
        crate::preflight(&asked).map_err(|e| e.to_string())?;
        crate::handover::take_over(&asked).map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| e.to_string())??;
    tracing::info!(
        sockets = taken.sockets.len(),
        attributed = taken.attribution.len(),
        "took over the running gateway's listeners; it drains its open flows"
    );
    Gateway::take_over(config, orig_dst, flow_log, taken)
        .await
        .map_err(|e| e.to_string())
}

/// The runtime: `limits.worker_threads` workers (one per CPU with 0); with
/// `limits.thread_per_core`, one thread for the control API, the signals and
/// the drain (the worker threads bring runtimes of their own).
fn runtime(limits: &crate::config::Limits) -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if limits.thread_per_core {
        builder.worker_threads(1);
    } else if limits.worker_threads > 0 {
        builder.worker_threads(limits.worker_threads);
    }
    builder.enable_all().build()
}

/// Logs to stderr, filtered by `RUST_LOG` (default `info`).
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

/// What an operator needs to know once the gateway listens.
fn announce(gateway: &Gateway) {
    let b = gateway.bound();
    let limits = &gateway.dataplane().config().limits;
    if limits.thread_per_core {
        tracing::info!(
            "thread per core: {} worker threads, each with its own runtime, upstream pool and transparent and DNS listeners (SO_REUSEPORT); the control API on a thread of its own",
            limits.threads()
        );
    }
    let ca = gateway.ca();
    let ca = &ca.paths().cert;
    tracing::info!("transparent TCP on {}, DNS for 8.8.8.8 on {} and for 1.1.1.1 on {} (UDP and TCP), admin on http://{}/healthz", b.transparent, b.dns, b.dns_alt, b.admin);
    tracing::info!(subject = %gateway.ca().subject(), sha256 = %gateway.ca().fingerprint(), "sandboxes must trust the interception CA {} (a worker intermediate: the fleet root above it)", ca.display());
    tracing::info!(
        "redirect a sandbox interface IFACE with nftables: tcp -> :{}, udp/tcp 53 to 8.8.8.8 -> :{}, to 1.1.1.1 -> :{}; drop other udp",
        b.transparent.port(),
        b.dns.port(),
        b.dns_alt.port()
    );
    // After recovery: a restart with pushed state has sandboxes already.
    if gateway.registry().is_empty() {
        tracing::info!(
            "no sandboxes are registered yet: every flow is denied until policies are pushed"
        );
    }
}

/// SIGHUP: read the credential values, the interception CA's files and the
/// configuration file again; a bad CA or configuration keeps the running one.
async fn reload_on_sighup(
    mut hup: tokio::signal::unix::Signal,
    dp: Arc<crate::Dataplane>,
    ca: crate::CaReloader,
    path: Option<PathBuf>,
) {
    while hup.recv().await.is_some() {
        // Off the async workers: reading files blocks.
        let reading = dp.clone();
        let _ = tokio::task::spawn_blocking(move || reading.reload_secrets()).await;
        tracing::info!("SIGHUP: credential values read again");
        // Logged and counted inside: the CA in service stays on an error.
        // Off the async workers too: it reads files and makes a leaf key.
        let reloading = ca.clone();
        let _ = tokio::task::spawn_blocking(move || reloading.reload()).await;
        let Some(path) = &path else {
            tracing::info!("SIGHUP: running on built-in defaults, no configuration file to reload");
            continue;
        };
        match Config::load(path) {
            Ok(next) => {
                let restart = dp.reload(&next);
                if restart.is_empty() {
                    tracing::info!(path = %path.display(), "configuration reloaded");
                } else {
                    tracing::warn!(path = %path.display(), needs_restart = ?restart, "configuration reloaded; these changes take effect only after a restart");
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "configuration reload failed; keeping the running configuration")
            }
        }
    }
}

async fn shutdown_signal(mut term: tokio::signal::unix::Signal, dp: Arc<crate::Dataplane>) {
    let term = async move {
        term.recv().await;
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = term => {}
    }
    // The drain (reloadable) with the flow lines' few seconds after it and
    // the state's writing: a unit's stop timeout shorter than that would
    // kill the drain before the budgets are written.
    let drain = dp.config().timeouts.drain;
    crate::systemd::notify(&stopping(drain));
    tracing::info!("shutting down: no new flows; draining open ones");
}

/// The stop notice: `STOPPING=1`, and as long again as the drain and its
/// aftermath may take (`EXTEND_TIMEOUT_USEC`, systemd 236 and later).
fn stopping(drain: std::time::Duration) -> String {
    let more = drain + std::time::Duration::from_secs(15);
    format!("STOPPING=1\nEXTEND_TIMEOUT_USEC={}", more.as_micros())
}

/// Raises the soft limit on open files to the hard one (a container
/// runtime may hand the process 1,024, where every accept would fail past
/// a few hundred flows), and says so, naming both numbers, when even that
/// is below what `limits.max_connections` needs: about three descriptors a
/// flow (six when spliced through pipes), and the upstream pool's.
fn open_files(config: &Config) {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let now = getrlimit(Resource::Nofile);
    let mut soft = now.current;
    if now.current.is_some() && now.current != now.maximum {
        let raised = Rlimit {
            current: now.maximum,
            maximum: now.maximum,
        };
        match setrlimit(Resource::Nofile, raised) {
            Ok(()) => soft = now.maximum,
            Err(e) => {
                tracing::warn!(error = %e, "cannot raise the open-file limit to its hard limit")
            }
        }
    }
    let per_flow = match config.splice.kernel {
        crate::config::KernelSplice::Pipe => 6,
        _ => 3,
    };
    let needed = (config.limits.max_connections as u64)
        .saturating_mul(per_flow)
        .saturating_add(8_192);
    if let Some(open_files) = soft.filter(|s| *s < needed) {
        tracing::error!(open_files, needed, "the open-file limit is below what limits.max_connections needs: past it every accept fails for every sandbox; raise it (LimitNOFILE=, the container runtime's nofile) or lower limits.max_connections");
    }
}
