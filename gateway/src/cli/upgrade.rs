//! Running under systemd, and replacing the running gateway in place.
//!
//! - [`notify`]: the `sd_notify` protocol (a datagram to `$NOTIFY_SOCKET`),
//!   so `Type=notify` units know when the gateway serves (`READY=1`), when
//!   it stops (`STOPPING=1`), and which process is the service after a
//!   takeover (`MAINPID=`, which needs `NotifyAccess=all`).
//! - [`on_sigusr2`]: SIGUSR2 starts the binary at the path this one was
//!   started from (after a package upgrade, the new build) with the same
//!   arguments and `--take-over`. The successor takes the listeners, state
//!   and attribution through the handover socket, tells systemd it is the
//!   main process (before it serves; this one waits for that), and this
//!   one drains and exits. A successor that fails
//!   (refused, bad configuration) exits and this one goes on serving.

use std::ffi::OsString;
use std::os::unix::net::UnixDatagram;

/// Sends `state` to systemd's notify socket, if there is one; a failure is
/// logged, never fatal.
pub(crate) fn notify(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    if let Err(e) = send(&path, state) {
        tracing::warn!(error = %e, socket = ?path, "cannot notify systemd");
    }
}

fn send(path: &std::ffi::OsStr, state: &str) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let socket = UnixDatagram::unbound()?;
    let bytes = path.as_bytes();
    match bytes.strip_prefix(b"@") {
        // An abstract socket (systemd's own, in some versions).
        Some(name) => {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
            socket.send_to_addr(state.as_bytes(), &addr)?;
        }
        None => {
            socket.send_to(state.as_bytes(), path)?;
        }
    }
    Ok(())
}

/// The gateway serves: `READY=1`, and this process is the service.
pub(super) fn ready() {
    notify(&format!(
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

    #[test]
    fn notify_reaches_a_socket_at_a_path() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("notify");
        let listener = UnixDatagram::bind(&path).expect("bind");
        send(path.as_os_str(), "READY=1").expect("send");
        let mut buf = [0u8; 64];
        let n = listener.recv(&mut buf).expect("recv");
        assert_eq!(&buf[..n], b"READY=1");
    }
}
