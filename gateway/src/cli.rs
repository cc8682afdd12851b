//! Command-line interface.

use std::io::Write;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::policy_cmd::{self, PolicyCommand};

#[derive(Debug, Parser)]
#[command(
    name = "egress-gateway",
    version,
    about = "Transparent TLS-intercepting egress gateway for sandboxes"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the gateway: the transparent listener, the DNS listeners and the admin listener.
    Run {
        /// TOML configuration; every key has a default, so this is optional.
        #[arg(long, value_name = "FILE")]
        config: Option<std::path::PathBuf>,
    },
    /// Validate, select, compose and explain policies as the API, controller and gateway do.
    #[command(subcommand)]
    Policy(PolicyCommand),
    /// Print (or apply, or remove) the nftables rules that redirect a sandbox interface.
    Redirect {
        #[arg(long, value_name = "IFACE")]
        sandbox_iface: String,
        /// Apply with `nft -f -` instead of printing.
        #[arg(long, conflicts_with = "remove")]
        apply: bool,
        /// Delete the interface's table.
        #[arg(long)]
        remove: bool,
        /// Take the listener ports from this configuration (default: the built-in ports).
        #[arg(long, value_name = "FILE")]
        config: Option<std::path::PathBuf>,
    },
    /// Manage the interception CA.
    #[command(subcommand)]
    Ca(CaCommand),
}

#[derive(Debug, Subcommand)]
enum CaCommand {
    /// Create a CA (ECDSA P-256, ten years) in DIR and print the path of the
    /// certificate sandboxes must trust. Never overwrites an existing CA.
    Init {
        #[arg(long, value_name = "DIR")]
        dir: std::path::PathBuf,
    },
}

/// What a command prints and how it exits.
#[derive(Debug)]
pub(crate) struct Output {
    /// A JSON document for stdout.
    pub(crate) json: serde_json::Value,
    /// Exit 1 (the document still describes the failure).
    pub(crate) failed: bool,
}

/// A command that could not produce its document (bad input files, bad environment).
#[derive(Debug, thiserror::Error)]
pub(crate) enum CliError {
    #[error("{0}")]
    Config(String),
    #[error("{path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: String, message: String },
    #[error("{flag}: {message}")]
    Arg { flag: &'static str, message: String },
}

/// Runs the CLI with the process's arguments and environment.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run { config } => return crate::run_cmd::run(config.as_deref()),
        Command::Redirect {
            sandbox_iface,
            apply,
            remove,
            config,
        } => return redirect_cmd(&sandbox_iface, apply, remove, config.as_deref()),
        Command::Policy(cmd) => policy_cmd::run(cmd, &|name| std::env::var_os(name)),
        Command::Ca(CaCommand::Init { dir }) => {
            return match egress_certs::CertificateAuthority::create(&dir) {
                Ok(ca) => {
                    println!("{}", ca.paths().cert.display());
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("egress-gateway: {e}");
                    ExitCode::FAILURE
                }
            };
        }
    };
    match result {
        Ok(out) => {
            let mut stdout = std::io::stdout().lock();
            let written = serde_json::to_writer(&mut stdout, &out.json)
                .map_err(std::io::Error::from)
                .and_then(|()| writeln!(stdout));
            if let Err(e) = written {
                eprintln!("egress-gateway: writing output: {e}");
                return ExitCode::FAILURE;
            }
            if out.failed {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(e) => {
            eprintln!("egress-gateway: {e}");
            ExitCode::FAILURE
        }
    }
}

fn redirect_cmd(
    iface: &str,
    apply: bool,
    remove: bool,
    config: Option<&std::path::Path>,
) -> ExitCode {
    use crate::redirect::{self, Ports};
    let config = match config.map(crate::config::Config::load).transpose() {
        Ok(c) => c.unwrap_or_default(),
        Err(e) => {
            eprintln!("egress-gateway: {e}");
            return ExitCode::FAILURE;
        }
    };
    let ports = Ports {
        transparent: config.listen.transparent.port(),
        dns: config.listen.dns.port(),
        dns_alt: config.listen.dns_alt.port(),
    };
    let result = if remove {
        redirect::remove(iface)
    } else if apply {
        redirect::apply(iface, ports)
    } else {
        redirect::ruleset(iface, ports).map(|r| print!("{r}"))
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("egress-gateway: {e}");
            ExitCode::FAILURE
        }
    }
}
