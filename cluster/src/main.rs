//! `egress-cluster`: machine egress in the cluster (see the crate docs).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use egress_cluster::{reconcile, relay, resource, webhook, worker};

#[derive(Parser)]
#[command(
    name = "egress-cluster",
    version,
    about = "Machine egress in the cluster: CRD, node reconciler, admission webhook, console relay"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the Machine CRD (YAML), generated from the Rust type.
    Crd,
    /// Run the node reconciler: keep running VMs in line with spec.network.egress.
    Reconcile {
        /// This node's name: Machines labelled kairon.zyvor.dev/node=<node> are watched.
        #[arg(long, env = "NODE_NAME")]
        node: String,
        /// The worker's admin API (the gateway's admin listener).
        #[arg(long, default_value = "127.0.0.1:15000")]
        worker: SocketAddr,
        /// A file holding the worker's bearer token.
        #[arg(long)]
        worker_token_file: Option<PathBuf>,
        /// How often a converged Machine is checked again, in seconds (at
        /// least 1: 0 would reconcile every Machine again at once, forever).
        #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
        resync_secs: u64,
        /// Who reports the Events this reconciler publishes (their
        /// reportingInstance): the pod's name.
        #[arg(long, env = "POD_NAME")]
        instance: Option<String>,
    },
    /// Serve the admission webhook (AdmissionReview v1) over TLS.
    Webhook {
        #[arg(long, default_value = "0.0.0.0:8443")]
        listen: SocketAddr,
        #[arg(long)]
        cert: PathBuf,
        #[arg(long)]
        key: PathBuf,
        /// The node reconciler's user as the API server names it: its
        /// requests may change only the egress-managed annotation.
        #[arg(long, default_value = webhook::RECONCILER_USER)]
        reconciler_user: String,
    },
    /// Serve the console relay onto a worker's VM routes.
    Relay {
        #[arg(long, default_value = "127.0.0.1:15080")]
        listen: SocketAddr,
        #[arg(long, default_value = "127.0.0.1:15000")]
        worker: SocketAddr,
        /// Accepted caller tokens, one per line.
        #[arg(long)]
        tokens_file: PathBuf,
        /// A file holding the worker's bearer token.
        #[arg(long)]
        worker_token_file: Option<PathBuf>,
    },
}

/// A token file's token (surrounding white space dropped); an empty one
/// is refused: no Authorization header would be sent, and every call
/// would fail as unauthorized for as long as the process ran.
fn read_token(path: &std::path::Path) -> Result<String, String> {
    egress_api::file::warn_if_open("--worker-token-file", path);
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    match text.trim() {
        "" => Err(format!("{}: the token file is empty", path.display())),
        token => Ok(token.to_owned()),
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(Cli::parse().command).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("egress-cluster: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `egress-cluster reconcile`.
async fn run_reconciler(command: Command) -> Result<(), String> {
    let Command::Reconcile {
        node,
        worker,
        worker_token_file,
        resync_secs,
        instance,
    } = command
    else {
        return Err("not the reconciler's command".into());
    };
    let token = worker_token_file.as_deref().map(read_token).transpose()?;
    let client = kube::Client::try_default()
        .await
        .map_err(|e| format!("Kubernetes client: {e}"))?;
    let worker = worker::Worker {
        admin: worker,
        token,
        timeout: Duration::from_secs(10),
    };
    let resync = Duration::from_secs(resync_secs);
    let ctx = reconcile::Context::new(client, worker, resync, instance);
    reconcile::run(ctx, &node).await;
    Ok(())
}

async fn run(command: Command) -> Result<(), String> {
    match command {
        Command::Crd => {
            print!("{}", resource::crd_yaml().map_err(|e| e.to_string())?);
            Ok(())
        }
        reconcile @ Command::Reconcile { .. } => run_reconciler(reconcile).await,
        Command::Webhook {
            listen,
            cert,
            key,
            reconciler_user,
        } => {
            let tls = webhook::tls_config(&cert, &key).map_err(|e| e.to_string())?;
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .map_err(|e| format!("--listen {listen}: {e}"))?;
            tracing::info!(%listen, "admission webhook serving");
            webhook::serve_until(listener, tls, reconciler_user, stopped()).await;
            Ok(())
        }
        Command::Relay {
            listen,
            worker,
            tokens_file,
            worker_token_file,
        } => {
            let tokens = relay::load_tokens(&tokens_file).map_err(|e| e.to_string())?;
            let worker_token = worker_token_file.as_deref().map(read_token).transpose()?;
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .map_err(|e| format!("--listen {listen}: {e}"))?;
            tracing::info!(%listen, %worker, "console relay serving");
            let config = Arc::new(relay::RelayConfig {
                worker,
                worker_token,
                tokens,
                timeout: Duration::from_secs(10),
            });
            relay::serve_until(listener, config, stopped()).await;
            Ok(())
        }
    }
}

/// Completes at SIGTERM (what Kubernetes sends a pod it stops) or SIGINT.
async fn stopped() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "SIGTERM cannot be caught: stopping on SIGINT only");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
    tracing::info!("stop signal received");
}

#[cfg(test)]
mod tests {
    use super::read_token;

    #[test]
    fn an_empty_token_file_is_refused() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("token");
        for empty in ["", " \n", "\n\n"] {
            std::fs::write(&path, empty).expect("write");
            let e = read_token(&path).expect_err(empty);
            assert!(e.contains("the token file is empty"), "{e}");
        }
        std::fs::write(&path, "worker-token-0123456789\n").expect("write");
        assert_eq!(read_token(&path).expect("token"), "worker-token-0123456789");
    }
}
