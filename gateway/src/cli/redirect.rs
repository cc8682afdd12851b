//! `egress-gateway redirect`: print, apply or remove the nftables table that
//! sends a sandbox interface's traffic to the gateway's listeners (attaching
//! the interface), or the fence that drops unattached sandbox interfaces.
//! The rules themselves are built in [`crate::redirect`]; this module only
//! reads the flags, the listener ports and the fence patterns.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;

use super::output::fail;
use crate::config::RedirectView;
use crate::redirect::{self, Ports};

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("what").required(true).args(["sandbox_iface", "fence"])))]
pub(super) struct RedirectArgs {
    /// The sandbox interface to attach (its table, and through the fence).
    #[arg(long, value_name = "IFACE")]
    sandbox_iface: Option<String>,
    /// The fence for `redirect.fence`'s patterns in the configuration
    /// (`--fence-pattern` overrides them): unattached sandbox interfaces are dropped.
    #[arg(long)]
    fence: bool,
    /// A fence pattern (an interface name or a prefix ending in `*`); repeatable.
    #[arg(long, value_name = "PATTERN", requires = "fence")]
    fence_pattern: Vec<String>,
    /// Apply with `nft -f -` instead of printing.
    #[arg(long, conflicts_with = "remove")]
    apply: bool,
    /// Detach the interface (its table deleted and the fence closed on it),
    /// or with `--fence` delete the fence.
    #[arg(long)]
    remove: bool,
    /// Take the listener ports and `[redirect]` from this configuration
    /// (default: the built-in ports); its other tables are not read.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
}

pub(super) fn run(args: &RedirectArgs) -> ExitCode {
    // Removing needs nothing of the file: a detach or the fence's removal
    // works whatever state the file is in.
    let result = match &args.sandbox_iface {
        _ if args.fence && args.remove => redirect::remove_fence(),
        Some(iface) if args.remove && !args.fence => redirect::remove(iface),
        _ => return install(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(e),
    }
}

/// Prints or applies the fence or an interface's table, from `[listen]`
/// and `[redirect]` of the file alone ([`RedirectView`]; the fence from
/// `[redirect]` alone).
fn install(args: &RedirectArgs) -> ExitCode {
    let load = match args.fence {
        true => RedirectView::load_fence,
        false => RedirectView::load,
    };
    let config = match args.config.as_deref().map(load).transpose() {
        Ok(c) => c.unwrap_or_default(),
        Err(e) => return fail(e),
    };
    let ports = Ports {
        transparent: config.listen.transparent.port(),
        dns: config.listen.dns.port(),
        dns_alt: config.listen.dns_alt.port(),
    };
    let tracked = redirect::Tracking::from(&config);
    let result = match &args.sandbox_iface {
        _ if args.fence => fence(args, &config),
        None => return fail("--sandbox-iface or --fence is required"),
        Some(iface) if args.apply => redirect::apply(iface, ports, tracked),
        Some(iface) => redirect::ruleset(iface, ports, tracked).map(|r| print!("{r}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(e),
    }
}

fn fence(args: &RedirectArgs, config: &RedirectView) -> Result<(), redirect::RedirectError> {
    let patterns = if args.fence_pattern.is_empty() {
        &config.redirect.fence
    } else {
        &args.fence_pattern
    };
    if args.apply && patterns.is_empty() {
        // The packaged unit is enabled everywhere; it fences nothing until
        // redirect.fence names the sandbox interfaces.
        eprintln!("egress-gateway: redirect.fence is empty: no fence installed");
        Ok(())
    } else if args.apply {
        redirect::apply_fence(patterns)
    } else {
        redirect::fence_ruleset(patterns).map(|r| print!("{r}"))
    }
}
