//! `egress-gateway machine-egress …`: the machine (L4) egress policy from the
//! shell — the same check the admin API and the admission webhook apply.

use std::io::Read;
use std::path::PathBuf;

use clap::{Args, Subcommand};

use super::output::{CliError, Output};

#[derive(Debug, Subcommand)]
pub(super) enum MachineCommand {
    /// Validate a policy (`spec.network.egress` as JSON) and print its normal
    /// form, or every error with the index of the rule it concerns.
    Check(CheckArgs),
}

#[derive(Debug, Args)]
pub(super) struct CheckArgs {
    /// The policy file; `-` or nothing reads standard input.
    #[arg(value_name = "FILE|-")]
    file: Option<PathBuf>,
}

pub(super) fn run(cmd: MachineCommand) -> Result<Output, CliError> {
    let MachineCommand::Check(args) = cmd;
    let text = read(args.file.as_ref())?;
    let (valid, json) = egress_policy::machine::check(&text);
    Ok(Output {
        json,
        failed: !valid,
    })
}

fn read(file: Option<&PathBuf>) -> Result<String, CliError> {
    match file {
        Some(path) if path.as_os_str() != "-" => {
            std::fs::read_to_string(path).map_err(|source| CliError::Read {
                path: path.display().to_string(),
                source,
            })
        }
        _ => {
            let mut text = String::new();
            std::io::stdin()
                .read_to_string(&mut text)
                .map_err(|source| CliError::Read {
                    path: "stdin".into(),
                    source,
                })?;
            Ok(text)
        }
    }
}
