//! The NFLOG socket of machine egress (`machine_egress.observe =
//! "events"`): bound to the log group before the first VM gets rules, then
//! read by a task that hands each datagram to
//! [`super::Machines::take_events`].
//!
//! One group per network namespace can have one reader, so binding fails
//! (`EBUSY`) when another process holds it; the VM's registration (or, with
//! VMs in the state, the gateway's start) is then refused rather than run
//! with a log nobody reads. The socket's receive
//! buffer is 4 MiB; when it overflows the kernel drops messages, and the
//! gaps in the group's sequence numbers count them.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use rustix::fd::OwnedFd;
use rustix::net::{self, sockopt, RecvFlags, SendFlags};
use tokio::io::unix::AsyncFd;

use super::nflog::{self, Message};
use super::Machines;

/// Largest datagram read at once: the kernel batches messages up to its
/// netlink buffer size (a page or two).
const DATAGRAM: usize = 64 * 1024;

/// The kernel sends what it holds after this many packets…
const QTHRESH: u32 = 32;
/// …or after this many hundredths of a second: an event is at most 10 ms
/// older than its time of arrival.
const FLUSH: u32 = 1;

/// Opens a netlink socket and binds `group` to it, waiting (at most 2 s)
/// for the kernel's answer.
pub(crate) fn bind(group: u16) -> Result<OwnedFd, String> {
    let fd = crate::netlink::socket()?;
    // Not fatal: without the force (no CAP_NET_ADMIN) the default stays.
    if sockopt::set_socket_recv_buffer_size_force(&fd, 4 << 20).is_err() {
        let _ = sockopt::set_socket_recv_buffer_size(&fd, 4 << 20);
    }
    net::send(
        &fd,
        &nflog::bind_group(group, 1, QTHRESH, FLUSH),
        SendFlags::empty(),
    )
    .map_err(|e| format!("sending the bind: {e}"))?;
    acknowledged(&fd, group)?;
    rustix::io::ioctl_fionbio(&fd, true).map_err(|e| format!("non-blocking: {e}"))?;
    Ok(fd)
}

/// The kernel's answer to the bind: `0`, or the errno it refused with.
fn acknowledged(fd: &OwnedFd, group: u16) -> Result<(), String> {
    let mut buf = vec![0u8; DATAGRAM];
    // Bounded: a packet message may come first once bound; the ack is
    // among the first datagrams.
    for _ in 0..16 {
        let (n, _) = net::recv(fd, &mut buf[..], RecvFlags::empty())
            .map_err(|e| format!("waiting for the kernel to bind group {group}: {e}"))?;
        for m in nflog::messages(&buf[..n.min(buf.len())]) {
            match m {
                Ok(Message::Ack(0)) => return Ok(()),
                Ok(Message::Ack(e)) => {
                    let why = io::Error::from_raw_os_error(-e);
                    return Err(format!(
                        "the kernel refused to bind NFLOG group {group}: {why} (another program reads it?)"
                    ));
                }
                _ => {}
            }
        }
    }
    Err(format!("no answer to binding NFLOG group {group}"))
}

/// Waits for the group to be bound (with the first VM), then reads it
/// until the task is dropped (the socket closes with it).
pub async fn read(machines: Arc<Machines>) {
    let fd = machines.bound_log().await;
    // `AsyncFd::new` is deprecated for types whose descriptor can be closed
    // behind the reactor's back; here the AsyncFd owns the OwnedFd, which
    // closes only when the AsyncFd drops (`register`, its replacement, is
    // `unsafe`, and this crate forbids unsafe code).
    #[allow(deprecated)]
    let fd = match AsyncFd::new(fd) {
        Ok(fd) => fd,
        Err(e) => {
            tracing::error!(error = %e, "the NFLOG socket cannot be polled; machine egress events stop");
            // Serving goes on without events (the observer's rounds still
            // read the counters): the gateway supervises this task, and an
            // end would stop it.
            return std::future::pending().await;
        }
    };
    let mut buf = vec![0u8; DATAGRAM];
    loop {
        let mut ready = match fd.readable().await {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, "polling the NFLOG socket failed; machine egress events stop");
                return std::future::pending().await;
            }
        };
        let got = ready.try_io(|s| {
            net::recv(s.get_ref(), &mut buf[..], RecvFlags::empty()).map_err(io::Error::from)
        });
        match got {
            Ok(Ok((n, _))) => machines.take_events(&buf[..n.min(DATAGRAM)]),
            // The buffer overflowed: the sequence gap counts what was lost.
            Ok(Err(e)) if e.raw_os_error() == Some(rustix::io::Errno::NOBUFS.raw_os_error()) => {}
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "reading the NFLOG socket failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(_would_block) => {}
        }
    }
}
