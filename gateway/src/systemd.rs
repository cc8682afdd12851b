//! The `sd_notify` protocol: a datagram to `$NOTIFY_SOCKET`, so a
//! `Type=notify` unit knows when the gateway serves (`READY=1`), when it
//! stops (`STOPPING=1`), and which process is the service after a takeover
//! (`MAINPID=`, which needs `NotifyAccess=all`).

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

#[cfg(test)]
mod tests {
    use super::*;

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
