//! Command-line interface: the clap definitions and the dispatch, nothing else.
//!
//! Each command lives in its own module and owns its flags (`run`, `policy`,
//! `redirect`, `ca`, `machine-egress`). They share one module, `output`: the document a command
//! prints, its errors and how both reach stdout, stderr and the exit code.
//! `output` imports no other command module and no command imports another, so
//! the modules form a tree rooted here rather than a circle.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod ca;
mod machine;
mod output;
mod policy;
mod redirect;
mod run;
mod upgrade;

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
    Run(run::RunArgs),
    /// Validate, select, compose and explain policies as the API, controller and gateway do.
    #[command(subcommand)]
    Policy(policy::PolicyCommand),
    /// Print (or apply, or remove) the nftables rules that redirect a sandbox interface.
    Redirect(redirect::RedirectArgs),
    /// Manage the interception CA.
    #[command(subcommand)]
    Ca(ca::CaCommand),
    /// The machine (L4) egress policy of user-mode VMs.
    #[command(subcommand, name = "machine-egress")]
    MachineEgress(machine::MachineCommand),
}

/// Runs the CLI with the process's arguments and environment.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Run(args) => run::run(&args),
        Command::Policy(cmd) => output::finish(policy::run(cmd, &|name| std::env::var_os(name))),
        Command::Redirect(args) => redirect::run(&args),
        Command::Ca(cmd) => ca::run(cmd),
        Command::MachineEgress(cmd) => output::finish(machine::run(cmd)),
    }
}
