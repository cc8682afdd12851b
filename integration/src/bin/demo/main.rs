//! `egress-demo`: the gateway's main job in one command, for a newcomer.
//!
//! As root, with `ip`, `nft`, `curl` and `dig` installed, it builds a
//! throwaway world on private ranges (a sandbox, the worker with the real
//! nftables redirect and a gateway on its defaults, a fake internet), pushes
//! a small policy and runs a scripted tour — an allowed intercepted request,
//! a denied one with its reason and the explain API's account, an exempt
//! name spliced after DNS, a credential injected for its host and refused
//! for another — printing a line per step. Then it tears everything down,
//! also on Ctrl-C or SIGTERM. Nothing leaves the machine: no namespace has a
//! route to the host's network, and the gateway's upstream resolver is the
//! fake internet's.
//!
//! Exit codes: 0 the tour went as described; 1 a step did not; 2 a
//! prerequisite is missing (named); 130/143 interrupted.

mod stage;
mod tour;

use std::process::{Command, ExitCode};
use std::sync::Arc;

use clap::Parser;

use crate::stage::{on_path, Bins, Stage, Teardown};

/// Shows the egress gateway's main job in a throwaway network (root).
#[derive(Parser)]
#[command(version)]
struct Args {}

fn main() -> ExitCode {
    Args::parse();
    let bins = match prerequisites() {
        Ok(bins) => bins,
        Err(missing) => {
            eprintln!("egress-demo: cannot run here; missing:");
            for m in missing {
                eprintln!("  - {m}");
            }
            return ExitCode::from(2);
        }
    };
    let teardown = Arc::new(Teardown::default());
    let tour = {
        let teardown = teardown.clone();
        std::thread::spawn(move || run(&bins, teardown))
    };
    let outcome = wait(tour);
    teardown.run();
    match outcome {
        Outcome::Done(Ok(())) => {
            println!("egress-demo: done; the namespaces, processes and files it made are gone.");
            ExitCode::SUCCESS
        }
        Outcome::Done(Err(e)) => {
            eprintln!("egress-demo: {e}\negress-demo: torn down.");
            ExitCode::FAILURE
        }
        Outcome::Signal(code, name) => {
            eprintln!("egress-demo: {name}: torn down.");
            ExitCode::from(code)
        }
    }
}

fn run(bins: &Bins, teardown: Arc<Teardown>) -> Result<(), String> {
    println!(
        "egress-demo: building a sandbox (100.64.1.2), a worker running the gateway behind the nftables redirect, and a fake internet (203.0.113.0/24), each in a network namespace of its own; nothing leaves this machine."
    );
    let stage = Stage::build(bins, teardown)?;
    println!("egress-demo: the gateway is ready; the sandbox's DNS to 8.8.8.8 and its TCP now reach only the gateway.");
    tour::run(&stage)
}

enum Outcome {
    Done(Result<(), String>),
    /// Interrupted: the exit code and the signal's name.
    Signal(u8, &'static str),
}

/// The tour's end, or SIGINT/SIGTERM, whichever comes first.
fn wait(tour: std::thread::JoinHandle<Result<(), String>>) -> Outcome {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => return Outcome::Done(Err(format!("a runtime for signals: {e}"))),
    };
    let outcome = runtime.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        let (Ok(mut int), Ok(mut term)) = (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) else {
            return Outcome::Done(Err("cannot listen for signals".to_owned()));
        };
        let done = tokio::task::spawn_blocking(move || tour.join());
        tokio::select! {
            joined = done => Outcome::Done(match joined {
                Ok(Ok(result)) => result,
                _ => Err("the tour stopped unexpectedly".to_owned()),
            }),
            _ = int.recv() => Outcome::Signal(130, "interrupted (SIGINT)"),
            _ = term.recv() => Outcome::Signal(143, "terminated (SIGTERM)"),
        }
    });
    // Dropping the runtime would wait for the tour's thread: on a signal it
    // may be mid-step, and the teardown must not wait for it.
    runtime.shutdown_background();
    outcome
}

/// Root, the four tools, and the two programs; else what is missing.
fn prerequisites() -> Result<Bins, Vec<String>> {
    let mut missing = Vec::new();
    let uid = Command::new("id").arg("-u").output();
    if !uid.is_ok_and(|o| o.stdout.starts_with(b"0\n")) {
        missing.push(
            "root (it makes network namespaces and nftables rules): run it with sudo".to_owned(),
        );
    }
    for (tool, package) in [
        ("ip", "iproute2"),
        ("nft", "nftables"),
        ("curl", "curl"),
        ("dig", "dnsutils"),
    ] {
        if on_path(tool).is_none() {
            missing.push(format!("{tool} (Debian: apt-get install {package})"));
        }
    }
    let bins = Bins::find().map_err(|m| missing.extend(m)).ok();
    match bins {
        Some(bins) if missing.is_empty() => Ok(bins),
        _ => Err(missing),
    }
}
