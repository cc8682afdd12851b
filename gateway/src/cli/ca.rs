//! `egress-gateway ca …`: the interception CA, from the shell.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Subcommand;

use super::output::fail;

#[derive(Debug, Subcommand)]
pub(super) enum CaCommand {
    /// Create a CA (ECDSA P-256, ten years) in DIR and print the path of the
    /// certificate sandboxes must trust. Never overwrites an existing CA.
    Init {
        #[arg(long, value_name = "DIR")]
        dir: PathBuf,
    },
}

pub(super) fn run(cmd: CaCommand) -> ExitCode {
    match cmd {
        CaCommand::Init { dir } => match egress_certs::CertificateAuthority::create(&dir) {
            Ok(ca) => {
                println!("{}", ca.paths().cert.display());
                ExitCode::SUCCESS
            }
            Err(e) => fail(e),
        },
    }
}
