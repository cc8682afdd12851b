//! Splice: copy bytes both ways between client and origin, propagating
//! half-close, counting bytes, and closing both sides after `idle` with no
//! bytes in either direction.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// What a splice moved.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Spliced {
    /// Client to origin.
    pub(crate) up: u64,
    /// Origin to client.
    pub(crate) down: u64,
    pub(crate) idle_timeout: bool,
}

/// Copies until both directions have closed, an error, or `idle` passes quietly.
pub(crate) async fn splice<C, O>(client: C, origin: O, idle: Duration) -> Spliced
where
    C: AsyncRead + AsyncWrite + Unpin,
    O: AsyncRead + AsyncWrite + Unpin,
{
    let (mut cr, mut cw) = tokio::io::split(client);
    let (mut or, mut ow) = tokio::io::split(origin);
    let start = Instant::now();
    let last = Arc::new(AtomicU64::new(0));
    let up = one_way(&mut cr, &mut ow, idle, start, &last);
    let down = one_way(&mut or, &mut cw, idle, start, &last);
    let ((up, up_idle), (down, down_idle)) = tokio::join!(up, down);
    Spliced {
        up,
        down,
        idle_timeout: up_idle || down_idle,
    }
}

async fn one_way<R, W>(
    r: &mut R,
    w: &mut W,
    idle: Duration,
    start: Instant,
    last: &AtomicU64,
) -> (u64, bool)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; 64 * 1024];
    let mut total = 0u64;
    loop {
        match tokio::time::timeout(idle, r.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => {
                if w.write_all(&buf[..n]).await.is_err() {
                    break;
                }
                total += n as u64;
                last.store(start.elapsed().as_millis() as u64, Ordering::Relaxed);
            }
            Err(_) => {
                // Quiet this way; the flow is idle only if the other way is too.
                let since = start.elapsed().as_millis() as u64 - last.load(Ordering::Relaxed);
                if since >= idle.as_millis() as u64 {
                    let _ = w.shutdown().await;
                    return (total, true);
                }
            }
        }
    }
    // Half-close: the other side learns that no more bytes come this way.
    let _ = w.shutdown().await;
    (total, false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::{TcpListener, TcpStream};

    async fn pair() -> (TcpStream, TcpStream) {
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
                idle_timeout: false
            }
        );
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
