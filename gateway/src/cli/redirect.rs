//! `egress-gateway redirect`: print, apply or remove the nftables table that
//! sends a sandbox interface's traffic to the gateway's listeners. The rules
//! themselves are built in [`crate::redirect`]; this module only reads the
//! flags and the listener ports.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;

use super::output::fail;
use crate::config::Config;
use crate::redirect::{self, Ports};

#[derive(Debug, Args)]
pub(super) struct RedirectArgs {
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
    config: Option<PathBuf>,
}

pub(super) fn run(args: &RedirectArgs) -> ExitCode {
    let config = match args.config.as_deref().map(Config::load).transpose() {
        Ok(c) => c.unwrap_or_default(),
        Err(e) => return fail(e),
    };
    let ports = Ports {
        transparent: config.listen.transparent.port(),
        dns: config.listen.dns.port(),
        dns_alt: config.listen.dns_alt.port(),
    };
    let iface = args.sandbox_iface.as_str();
    let result = if args.remove {
        redirect::remove(iface)
    } else if args.apply {
        redirect::apply(iface, ports)
    } else {
        redirect::ruleset(iface, ports).map(|r| print!("{r}"))
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(e),
    }
}
