//! Stream adapters: replaying peeked bytes, and counting bytes.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Reads `prefix` first, then the inner stream; writes go straight through.
#[derive(Debug)]
pub(crate) struct Rewind<S> {
    prefix: Vec<u8>,
    pos: usize,
    inner: S,
}

impl<S> Rewind<S> {
    pub(crate) fn new(prefix: Vec<u8>, inner: S) -> Self {
        Self {
            prefix,
            pos: 0,
            inner,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Rewind<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.pos < self.prefix.len() {
            let n = (self.prefix.len() - self.pos).min(buf.remaining());
            let start = self.pos;
            buf.put_slice(&self.prefix[start..start + n]);
            self.pos += n;
            if self.pos == self.prefix.len() {
                self.prefix = Vec::new();
                self.pos = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Rewind<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    // Forwarded, so TLS records queued together leave in one `writev`
    // (the default would write the first buffer only).
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Bytes read from and written to a stream.
#[derive(Debug, Default)]
pub(crate) struct Counts {
    pub(crate) read: AtomicU64,
    pub(crate) written: AtomicU64,
}

/// Counts what passes through the inner stream.
#[derive(Debug)]
pub(crate) struct Counted<S> {
    inner: S,
    counts: Arc<Counts>,
}

impl<S> Counted<S> {
    pub(crate) fn new(inner: S, counts: Arc<Counts>) -> Self {
        Self { inner, counts }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        let n = (buf.filled().len() - before) as u64;
        self.counts.read.fetch_add(n, Ordering::Relaxed);
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = r {
            self.counts.written.fetch_add(n as u64, Ordering::Relaxed);
        }
        r
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = r {
            self.counts.written.fetch_add(n as u64, Ordering::Relaxed);
        }
        r
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Completes once no byte has moved either way for `idle`.
pub(crate) async fn quiet_for(activity: &Counts, idle: Duration) {
    quiet_for_then(activity, idle, || {}).await;
}

/// [`quiet_for`], calling `on_lull` once each time the connection has been
/// quiet for a whole tick (1 s, or `idle` if shorter), so between one and
/// two ticks after its last byte, and again after the next burst.
pub(crate) async fn quiet_for_then(activity: &Counts, idle: Duration, mut on_lull: impl FnMut()) {
    let total = || activity.read.load(Ordering::Relaxed) + activity.written.load(Ordering::Relaxed);
    let tick = idle.min(Duration::from_secs(1));
    let mut last = total();
    let mut quiet_since = Instant::now();
    let mut lulled = false;
    loop {
        tokio::time::sleep(tick).await;
        let now = total();
        if now != last {
            last = now;
            quiet_since = Instant::now();
            lulled = false;
        } else if quiet_since.elapsed() >= idle {
            return;
        } else if !lulled {
            lulled = true;
            on_lull();
        }
    }
}

/// Closes with RST: the answer for denied flows that have no protocol to speak.
pub(crate) fn reset(stream: &tokio::net::TcpStream) {
    let _ = socket2::SockRef::from(stream).set_linger(Some(Duration::ZERO));
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn vectored_writes_pass_through_rewind_and_counted_and_are_counted() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let a = tokio::net::TcpStream::connect(l.local_addr().expect("addr"))
            .await
            .expect("connect");
        let (mut b, _) = l.accept().await.expect("accept");
        let counts = Arc::new(Counts::default());
        let mut s = Rewind::new(b"peeked".to_vec(), Counted::new(a, counts.clone()));
        assert!(s.is_write_vectored());
        let bufs = [
            io::IoSlice::new(b"one record, "),
            io::IoSlice::new(b"the next"),
        ];
        let n = s.write_vectored(&bufs).await.expect("writev");
        assert_eq!(n, 20, "both buffers in one call");
        assert_eq!(counts.written.load(Ordering::Relaxed), 20);
        let mut got = [0u8; 20];
        b.read_exact(&mut got).await.expect("read");
        assert_eq!(&got, b"one record, the next");
    }
}
