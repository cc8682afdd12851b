//! `egress-gateway policy …`: the policy crate, from the shell, with JSON on stdout.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use clap::{Args, Subcommand};
use egress_policy::{
    compose, resolve_saved, select, AttributionGap, CompiledPolicy, DeploymentExemptions, Hostname,
    OpaqueStreams, PlatformDenies, Policy, Profiles, StreamProtocol, EXEMPTIONS_ENV, PROFILES_ENV,
};
use serde_json::json;

use super::output::{CliError, Output};
use crate::decide::{explained, explained_request, judge_question, Claims};
use crate::doh::DohNames;
use egress_api::explain::{Explain, Question};

#[derive(Debug, Subcommand)]
pub(super) enum PolicyCommand {
    /// Validate SPACE_EGRESS_PROFILES and SPACE_TLS_INTERCEPTION_EXEMPTIONS from the
    /// environment, as the API and controller do at startup.
    CheckConfig,
    /// Choose profiles for a create from an X-Space-Egress-Profiles value.
    Select(SelectArgs),
    /// Compose an effective policy from a base policy and a saved profile selection.
    Compose(ComposeArgs),
    /// Show the verdict the gateway would give a flow under a policy.
    Explain(ExplainArgs),
}

#[derive(Debug, Args)]
pub(super) struct SelectArgs {
    /// The header's value; omit for an absent header. May begin with `-`.
    #[arg(long, allow_hyphen_values = true, value_name = "VALUE")]
    header: Option<String>,
    /// A non-federated create: the header is ignored and nothing is selected.
    #[arg(long)]
    non_federated: bool,
}

#[derive(Debug, Args)]
pub(super) struct ComposeArgs {
    /// The tenant base policy (JSON).
    #[arg(long, value_name = "FILE")]
    base: PathBuf,
    /// The saved selection, comma-separated (empty for none).
    #[arg(long, value_name = "A,B", default_value = "")]
    profiles: String,
    /// The base is an inherited template policy: report whether it becomes a sandbox override.
    #[arg(long)]
    inherited: bool,
}

#[derive(Debug, Args)]
pub(super) struct ExplainArgs {
    /// The effective policy (JSON).
    #[arg(long, value_name = "FILE")]
    policy: PathBuf,
    /// The original destination, `IP:PORT` (`[IPv6]:PORT`).
    #[arg(long, value_name = "IP:PORT")]
    dst: SocketAddr,
    /// The flow starts with a TLS ClientHello.
    #[arg(long)]
    tls: bool,
    /// The ClientHello carries `encrypted_client_hello` (with --tls; --sni is its outer name).
    #[arg(long, requires = "tls")]
    ech: bool,
    /// The ClientHello's server name (an IP literal counts as none).
    #[arg(long, value_name = "NAME")]
    sni: Option<String>,
    /// Without --tls and --host: the protocol the stream's first bytes name
    /// (`ssh`); omitted, an unreadable stream.
    #[arg(long, value_name = "PROTOCOL", value_parser = stream_protocol, conflicts_with_all = ["tls", "host"])]
    stream: Option<StreamProtocol>,
    /// The gateway's `policy.opaque_streams`.
    #[arg(long, value_name = "allow|deny", value_parser = opaque_streams, default_value = "allow")]
    opaque_streams: OpaqueStreams,
    /// The HTTP Host (plain HTTP, or a request on a terminated flow).
    #[arg(long, value_name = "NAME")]
    host: Option<String>,
    /// A name the sandbox resolved to the destination IP through the reserved resolvers.
    #[arg(long, value_name = "NAME")]
    attributed: Vec<String>,
    /// A request on the flow, judged by the per-request rules: its method (with --path).
    #[arg(long, value_name = "METHOD", requires = "path")]
    method: Option<String>,
    /// The request's target, `/path?query` (with --method).
    #[arg(long, value_name = "TARGET", requires = "method")]
    path: Option<String>,
}

fn stream_protocol(s: &str) -> Result<StreamProtocol, String> {
    StreamProtocol::ALL
        .into_iter()
        .find(|p| p.as_str() == s)
        .ok_or_else(|| format!("{s:?} is not a stream protocol the gateway names (ssh)"))
}

fn opaque_streams(s: &str) -> Result<OpaqueStreams, String> {
    [OpaqueStreams::Allow, OpaqueStreams::Deny]
        .into_iter()
        .find(|o| o.as_str() == s)
        .ok_or_else(|| format!("{s:?}: expected allow or deny"))
}

/// Reads an environment variable (injected so tests need not touch the process's).
pub(super) type Env<'a> = &'a dyn Fn(&str) -> Option<OsString>;

pub(super) fn run(cmd: PolicyCommand, env: Env<'_>) -> Result<Output, CliError> {
    match cmd {
        PolicyCommand::CheckConfig => check_config(env),
        PolicyCommand::Select(args) => select_cmd(&args, env),
        PolicyCommand::Compose(args) => compose_cmd(&args, env),
        PolicyCommand::Explain(args) => explain_cmd(&args),
    }
}

fn env_str(env: Env<'_>, name: &'static str) -> Result<Option<String>, CliError> {
    env(name)
        .map(|v| {
            v.into_string()
                .map_err(|_| CliError::Config(format!("{name}: not valid UTF-8")))
        })
        .transpose()
}

fn profiles_from(env: Env<'_>) -> Result<Profiles, CliError> {
    let text = env_str(env, PROFILES_ENV)?;
    Profiles::from_env_value(text.as_deref()).map_err(|e| CliError::Config(e.to_string()))
}

fn exemptions_from(env: Env<'_>) -> Result<Option<DeploymentExemptions>, CliError> {
    let text = env_str(env, EXEMPTIONS_ENV)?;
    DeploymentExemptions::from_env_value(text.as_deref())
        .map_err(|e| CliError::Config(e.to_string()))
}

fn check_config(env: Env<'_>) -> Result<Output, CliError> {
    let profiles = profiles_from(env)?;
    let exemptions = exemptions_from(env)?;
    let names: Vec<&str> = profiles.iter().map(|(n, _)| n.as_str()).collect();
    let defaults: Vec<&str> = profiles.defaults().map(|n| n.as_str()).collect();
    Ok(Output {
        json: json!({
            "status": "ok",
            "profiles": {"enabled": profiles.is_enabled(), "names": names, "defaults": defaults},
            "tls_interception_exemptions": {
                "enabled": exemptions.is_some(),
                "destinations": exemptions,
            },
        }),
        failed: false,
    })
}

fn select_cmd(args: &SelectArgs, env: Env<'_>) -> Result<Output, CliError> {
    let profiles = profiles_from(env)?;
    Ok(
        match select(&profiles, args.header.as_deref(), !args.non_federated) {
            Ok(s) => Output {
                json: json!({"status": 200, "profiles": s.profiles, "admissions": s.admissions}),
                failed: false,
            },
            Err(e) => Output {
                json: json!({
                    "status": 400,
                    "reason": e.kind,
                    "error": e.to_string(),
                    "admissions": e.admissions,
                }),
                failed: true,
            },
        },
    )
}

fn read_policy(path: &PathBuf) -> Result<Policy, CliError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| CliError::Read {
        path: shown.clone(),
        source,
    })?;
    Policy::from_json(&text).map_err(|e| CliError::Parse {
        path: shown,
        message: e.to_string(),
    })
}

fn compose_cmd(args: &ComposeArgs, env: Env<'_>) -> Result<Output, CliError> {
    let profiles = profiles_from(env)?;
    let exemptions = exemptions_from(env)?;
    let base = read_policy(&args.base)?;
    let saved: Vec<&str> = args.profiles.split(',').filter(|s| !s.is_empty()).collect();
    let chosen = match resolve_saved(&profiles, &saved) {
        Ok(chosen) => chosen,
        Err(missing) => {
            return Ok(Output {
                json: json!({
                    "status": 503,
                    "error": missing.to_string(),
                    "missing": missing.missing,
                    "admissions": missing.admissions,
                }),
                failed: true,
            })
        }
    };
    let admissions: Vec<_> = chosen
        .iter()
        .map(|(name, _)| egress_policy::Admission::ready(name))
        .collect();
    let composed = compose(&base, chosen.iter().map(|(_, p)| *p), exemptions.as_ref());
    let mut out = json!({
        "status": 200,
        "policy": composed.policy,
        "changed": composed.changed,
        "admissions": admissions,
    });
    if args.inherited {
        // An inherited template policy is stored as a sandbox override only
        // when composition added something to it.
        out["override"] = json!(composed.changed);
    }
    Ok(Output {
        json: out,
        failed: false,
    })
}

/// `name`, given for `flag`, as a hostname.
fn hostname(flag: &'static str, name: &str) -> Result<Hostname, CliError> {
    Hostname::parse(name).map_err(|e| CliError::Arg {
        flag,
        message: format!("{name:?}: {e}"),
    })
}

/// The explain question the flags ask, read as the admin's `POST
/// /v1/explain` reads its body (the contract crate's reader): the same
/// refusals, named by flag.
fn question(args: &ExplainArgs) -> Result<Question, CliError> {
    let asked = Explain {
        sandbox: String::new(),
        dst: args.dst,
        tls: args.tls,
        ech: args.ech,
        sni: args.sni.clone(),
        host: args.host.clone(),
        stream: args.stream,
        method: args.method.clone(),
        path: args.path.clone(),
    };
    asked.question().map_err(|u| CliError::Arg {
        flag: match u.field {
            "sni" => "--sni",
            "host" => "--host",
            "path" => "--path",
            _ => "--method",
        },
        message: u.message,
    })
}

fn explain_cmd(args: &ExplainArgs) -> Result<Output, CliError> {
    let policy = read_policy(&args.policy)?;
    // Read as the dataplane reads it: an IP literal is no SNI; a name the
    // peek refuses is refused here.
    let Question {
        sni,
        host,
        address_host,
        request,
    } = question(args)?;
    let attributed = args
        .attributed
        .iter()
        .map(|n| hostname("--attributed", n))
        .collect::<Result<Vec<_>, _>>()?;
    let platform = PlatformDenies::builtin().with_opaque_streams(args.opaque_streams);
    let compiled = CompiledPolicy::new(policy, Arc::new(platform));
    let claims = Claims::asked(args.dst, args.tls, args.ech, sni.as_ref(), host.as_ref())
        .with_address_host(address_host)
        .with_stream(args.stream);
    // The built-in DoH names: the CLI reads no gateway configuration.
    let doh = DohNames::new(&[]);
    let verdict = judge_question(
        &compiled,
        &claims,
        &attributed,
        AttributionGap::NoDnsSeen,
        &doh,
    );
    let mut json = explained(&verdict, &compiled, &attributed);
    json["sni"] = json!(sni);
    if let Some((method, path)) = &request {
        if !verdict.is_deny() {
            let name = host.as_ref().or(sni.as_ref());
            json["request"] =
                explained_request(&compiled, args.tls, name, &attributed, method, path);
        }
    }
    Ok(Output {
        json,
        failed: false,
    })
}
