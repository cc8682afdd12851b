//! Splice: copy bytes both ways between client and origin, propagating
//! half-close, counting bytes, and closing both sides after `idle` with no
//! bytes in either direction.
//!
//! Owned socket halves (no lock per operation) and one idle watchdog for the
//! flow (no timer per read): the path every exempted byte takes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

use crate::config::Timeouts;
use crate::fault::{Fault, Side};
use crate::io::{quiet_for, reset, Counts};
use crate::state::Dataplane;
use crate::upstream::connect_tcp;

/// What a splice moved.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Spliced {
    /// Client to origin.
    pub(crate) up: u64,
    /// Origin to client.
    pub(crate) down: u64,
    pub(crate) idle_timeout: bool,
    /// A side reset the flow while bytes moved.
    pub(crate) fault: Option<Fault>,
}

/// Connects to `dst`, sends the `peeked` bytes first, then joins the two
/// sockets as they are. The error names the step that failed (the client is
/// reset); the byte counts include the peeked bytes.
pub(crate) async fn splice_to(
    dp: &Dataplane,
    client: TcpStream,
    dst: std::net::SocketAddr,
    peeked: &[u8],
    timeouts: &Timeouts,
) -> Result<Spliced, String> {
    let mut origin = match connect_tcp(dst, timeouts.connect, &dp.metrics).await {
        Ok(o) => o,
        Err(e) => {
            reset(&client);
            dp.metrics.fault(Fault::connect(&e));
            return Err(format!("upstream_connect: {e}"));
        }
    };
    if let Err(e) = origin.write_all(peeked).await {
        reset(&client);
        dp.metrics
            .fault(Fault::io(Side::Upstream, &e).unwrap_or(Fault::UPSTREAM_HTTP));
        return Err(format!("upstream_write: {e}"));
    }
    let (client, origin) = match &dp.kernel {
        Some(kernel) => match crate::ksplice::splice(kernel, client, origin, timeouts.idle).await {
            Ok(moved) => {
                count(dp, "kernel");
                return Ok(moved);
            }
            Err((client, origin, e)) => {
                tracing::debug!(error = %e, "flow not joined to the kernel splice; copied");
                (client, origin)
            }
        },
        None => (client, origin),
    };
    let mut moved = splice(client, origin, timeouts.idle).await;
    count(dp, "user");
    moved.up += peeked.len() as u64;
    Ok(moved)
}

/// Counts an ended spliced flow by who moved its bytes.
fn count(dp: &Dataplane, path: &'static str) {
    dp.metrics
        .spliced
        .get_or_create(&crate::metrics::PathLabels { path })
        .inc();
}

/// Copies until both directions have closed, an error, or `idle` passes quietly.
pub(crate) async fn splice(client: TcpStream, origin: TcpStream, idle: Duration) -> Spliced {
    let (mut cr, mut cw) = client.into_split();
    let (mut or, mut ow) = origin.into_split();
    let counts = Counts::default();
    let both = async {
        tokio::join!(
            pump(
                &mut cr,
                &mut ow,
                &counts.read,
                (Side::Client, Side::Upstream)
            ),
            pump(
                &mut or,
                &mut cw,
                &counts.written,
                (Side::Upstream, Side::Client)
            )
        )
    };
    let (idle_timeout, fault) = tokio::select! {
        (up, down) = both => (false, up.or(down)),
        () = quiet_for(&counts, idle) => (true, Some(Fault::IDLE_TIMEOUT)),
    };
    Spliced {
        up: counts.read.load(Ordering::Relaxed),
        down: counts.written.load(Ordering::Relaxed),
        idle_timeout,
        fault,
    }
}

/// One direction: read, write, count; on EOF or error, half-close the other side.
///
/// The buffer exists only while bytes flow: between bursts the pump waits
/// for readability without one, so idle spliced flows hold no copy buffers
/// (two 64 KiB buffers per flow would pin 1.3 GB for 10,000 idle flows).
/// A read that does not fill the buffer has drained the socket and clears
/// its readiness (tokio on epoll), so a small message costs one read and
/// one write — no extra read that would only say "would block".
/// `sides`: who is behind the reading and the writing half, to name a reset.
async fn pump(
    r: &mut OwnedReadHalf,
    w: &mut OwnedWriteHalf,
    moved: &AtomicU64,
    sides: (Side, Side),
) -> Option<Fault> {
    const BUF: usize = 64 * 1024;
    let mut fault = None;
    'flow: loop {
        if let Err(e) = r.readable().await {
            fault = Fault::io(sides.0, &e);
            break;
        }
        let mut buf: Vec<u8> = Vec::with_capacity(BUF);
        loop {
            buf.clear();
            match r.read_buf(&mut buf).await {
                Ok(0) => break 'flow,
                Err(e) => {
                    fault = Fault::io(sides.0, &e);
                    break 'flow;
                }
                Ok(n) => {
                    if let Err(e) = w.write_all(&buf[..n]).await {
                        fault = Fault::io(sides.1, &e);
                        break 'flow;
                    }
                    moved.fetch_add(n as u64, Ordering::Relaxed);
                    if n < BUF {
                        break; // drained: wait for more without the buffer
                    }
                }
            }
        }
    }
    // Half-close: the other side learns that no more bytes come this way.
    let _ = w.shutdown().await;
    fault
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use tokio::net::TcpListener;

    /// A connected pair of loopback sockets (the kernel path's tests use it too).
    pub(crate) async fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let a = TcpStream::connect(l.local_addr().expect("addr"))
            .await
            .expect("connect");
        let (b, _) = l.accept().await.expect("accept");
        (a, b)
    }

    #[tokio::test]
    async fn copies_both_ways_with_half_close_and_counts() {
        let (mut client, gw_client) = pair().await;
        let (gw_origin, mut origin) = pair().await;
        let task = tokio::spawn(splice(gw_client, gw_origin, Duration::from_secs(5)));
        client.write_all(b"hello origin").await.expect("write");
        client.shutdown().await.expect("half-close");
        let mut got = Vec::new();
        origin
            .read_to_end(&mut got)
            .await
            .expect("origin sees EOF after the bytes");
        assert_eq!(got, b"hello origin");
        origin.write_all(&vec![7u8; 100_000]).await.expect("write");
        origin.shutdown().await.expect("close");
        let mut back = Vec::new();
        client.read_to_end(&mut back).await.expect("read");
        assert_eq!(back.len(), 100_000);
        let s = task.await.expect("task");
        assert_eq!(
            s,
            Spliced {
                up: 12,
                down: 100_000,
                idle_timeout: false,
                fault: None,
            }
        );
    }

    #[tokio::test]
    async fn a_reset_is_counted_against_the_side_that_sent_it() {
        let (client, gw_client) = pair().await;
        let (gw_origin, mut origin) = pair().await;
        let task = tokio::spawn(splice(gw_client, gw_origin, Duration::from_secs(5)));
        origin.write_all(b"hello").await.expect("write");
        // The client goes away with a reset (SO_LINGER 0), not a FIN.
        socket2::SockRef::from(&client)
            .set_linger(Some(Duration::ZERO))
            .expect("linger");
        drop(client);
        let s = task.await.expect("task");
        assert_eq!(
            s.fault,
            Some(
                Fault::io(Side::Client, &std::io::ErrorKind::ConnectionReset.into())
                    .expect("a reset")
            )
        );
        assert!(!s.idle_timeout);
    }

    #[tokio::test]
    async fn idle_flows_are_closed_but_one_busy_direction_keeps_it_open() {
        let (_client, gw_client) = pair().await;
        let (gw_origin, mut origin) = pair().await;
        let task = tokio::spawn(splice(gw_client, gw_origin, Duration::from_millis(300)));
        // Downstream trickles every 100 ms for 600 ms: longer than the idle
        // timeout in total, but never quiet for that long.
        for _ in 0..6 {
            origin.write_all(b"x").await.expect("write");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(!task.is_finished(), "still open while bytes flow one way");
        let s = tokio::time::timeout(Duration::from_secs(3), task)
            .await
            .expect("closed when idle")
            .expect("task");
        assert!(s.idle_timeout);
        assert_eq!(s.down, 6);
    }
}
