//! Running under systemd, and replacing the running gateway in place.
//!
//! - [`ready`]: tells systemd the gateway serves (`crate::systemd`).
//! - [`on_sigusr2`]: SIGUSR2 starts the binary at the path this one was
//!   started from (after a package upgrade, the new build) with the same
//!   arguments and `--take-over`. The successor takes the listeners, state
//!   and attribution through the handover socket, tells systemd it is the
//!   main process (before it serves; this one waits for that), and this
//!   one drains and exits. A successor that fails
//!   (refused, bad configuration) exits and this one goes on serving.

use std::ffi::OsString;

/// The gateway serves: `READY=1`, and this process is the service.
pub(super) fn ready() {
    crate::systemd::notify(&format!(
        "READY=1\nMAINPID={}\nSTATUS=serving",
        std::process::id()
    ));
}

/// On each SIGUSR2, starts a successor with `--take-over` (one at a time).
pub(super) async fn on_sigusr2(mut usr2: tokio::signal::unix::Signal, argv: Vec<OsString>) {
    while usr2.recv().await.is_some() {
        let (program, args) = successor_command(&argv);
        tracing::info!(program = ?program, "SIGUSR2: starting a successor to take over");
        let child = std::process::Command::new(&program).args(&args).spawn();
        let mut child = match child {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(error = %e, program = ?program, "SIGUSR2: cannot start the successor; serving on");
                continue;
            }
        };
        // Reaped by a thread of its own if it exits while this one still
        // runs (a refused takeover). Not a runtime task: this process must
        // be able to exit (and the successor be reparented) while it runs.
        let watcher = std::thread::Builder::new()
            .name("egress-successor".into())
            .spawn(move || match child.wait() {
                Ok(s) => tracing::warn!(status = %s, "SIGUSR2: the successor exited"),
                Err(e) => tracing::warn!(error = %e, "SIGUSR2: lost track of the successor"),
            });
        if let Err(e) = watcher {
            tracing::warn!(error = %e, "SIGUSR2: cannot watch the successor");
        }
    }
}

/// The successor's program and arguments: this process's own (the path it
/// was started by, so an upgraded binary at that path is the one started),
/// with `--take-over` added.
fn successor_command(argv: &[OsString]) -> (OsString, Vec<OsString>) {
    let program = argv
        .first()
        .cloned()
        .or_else(|| std::env::current_exe().ok().map(OsString::from))
        .unwrap_or_else(|| "egress-gateway".into());
    let mut args: Vec<OsString> = argv.iter().skip(1).cloned().collect();
    if !args.iter().any(|a| a == "--take-over") {
        args.push("--take-over".into());
    }
    (program, args)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_successor_runs_the_same_command_taking_over() {
        let argv: Vec<OsString> = ["/usr/bin/egress-gateway", "run", "--config", "/etc/gw.toml"]
            .iter()
            .map(OsString::from)
            .collect();
        let (program, args) = successor_command(&argv);
        assert_eq!(program, "/usr/bin/egress-gateway");
        assert_eq!(args, ["run", "--config", "/etc/gw.toml", "--take-over"]);
        // A successor of a successor does not say it twice.
        let mut again = argv;
        again.push("--take-over".into());
        assert_eq!(successor_command(&again).1.len(), 4);
    }
}
