//! Stream adapters: replaying peeked bytes, and counting bytes.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

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

    /// Puts `bytes` back, to be read before what is left of the prefix.
    pub(crate) fn unread(&mut self, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        let mut prefix = Vec::with_capacity(bytes.len() + self.prefix.len() - self.pos);
        prefix.extend_from_slice(bytes);
        prefix.extend_from_slice(&self.prefix[self.pos..]);
        self.prefix = prefix;
        self.pos = 0;
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

/// Writes go straight through to the stream's `inner`, vectored writes
/// included, so TLS records queued together leave in one `writev` (the
/// default would write the first buffer only).
macro_rules! write_through {
    ($t:ident) => {
        impl<S: AsyncWrite + Unpin> AsyncWrite for $t<S> {
            fn poll_write(
                mut self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                buf: &[u8],
            ) -> Poll<io::Result<usize>> {
                Pin::new(&mut self.inner).poll_write(cx, buf)
            }
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
            fn poll_shutdown(
                mut self: Pin<&mut Self>,
                cx: &mut Context<'_>,
            ) -> Poll<io::Result<()>> {
                Pin::new(&mut self.inner).poll_shutdown(cx)
            }
        }
    };
}

write_through!(Rewind);

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

/// What [`Coalesce`] holds before it writes through: a TLS record's worth.
const COALESCE_MAX: usize = 16 * 1024;

/// Lets an HTTP/2 connection's frames pile up before they are written.
///
/// The `h2` codec writes a DATA frame of 256 bytes or more on its own (its
/// payload chained, not copied), then flushes before it takes the next
/// frame: a `writev`, a TLS record and, on loopback or a veth, the
/// receiver's side of the delivery, per small response. This buffer takes
/// the writes instead (up to [`COALESCE_MAX`]; larger ones go straight
/// through), and a flush after a write waits for the scheduler's turn: until
/// its worker has run the tasks that were ready and polled for I/O once
/// ([`tokio::task::yield_now`]'s deferred wake). By then the streams' tasks
/// have queued their frames, and responses that arrived from the origin in
/// the meantime have been read and queued too; the flush writes them all
/// as one. With nothing else to do the wait is one `epoll_wait` that does
/// not sleep.
pub(crate) struct Coalesce<S> {
    inner: S,
    buf: Vec<u8>,
    /// Bytes of `buf` already written through.
    sent: usize,
    /// The flush waiting for the scheduler's turn, if one is.
    turn: Option<Arc<Flag>>,
    /// The flush has had its turn (and is writing through).
    yielded: bool,
}

impl<S> Coalesce<S> {
    pub(crate) fn new(inner: S) -> Self {
        Self {
            inner,
            buf: Vec::new(),
            sent: 0,
            turn: None,
            yielded: false,
        }
    }
}

/// A waker that raises a flag and passes the wake-up on to the task kept
/// last: a flush's wait for the scheduler's turn ([`Coalesce`]) and a
/// stream's readiness to be read again ([`ReadLatch`]) wake through it.
#[derive(Default)]
struct Flag {
    raised: std::sync::atomic::AtomicBool,
    task: std::sync::Mutex<Option<std::task::Waker>>,
}

impl std::task::Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.raised.store(true, Ordering::Release);
        let task = self
            .task
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(task) = task {
            task.wake();
        }
    }
}

impl Flag {
    /// Keeps `cx`'s waker as the one to wake (a clone only when it changed).
    fn keep(&self, cx: &Context<'_>) {
        let mut task = self
            .task
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !task.as_ref().is_some_and(|t| t.will_wake(cx.waker())) {
            *task = Some(cx.waker().clone());
        }
    }

    /// Asks the scheduler for a turn, the flag raised when it comes: woken
    /// by the scheduler, not by the next poll of the connection, which a
    /// stream's task queuing a frame causes sooner (outside a runtime the
    /// turn comes at once).
    fn ask_turn() -> Arc<Self> {
        let turn = Arc::new(Self::default());
        let waker = std::task::Waker::from(turn.clone());
        let mut yielding = std::pin::pin!(tokio::task::yield_now());
        // The first poll hands the waker to the scheduler and is pending.
        let _ = yielding.as_mut().poll(&mut Context::from_waker(&waker));
        turn
    }

    /// Whether the flag is raised; if not, `cx` is woken when it is.
    fn raised_or_keep(&self, cx: &Context<'_>) -> bool {
        if self.raised.load(Ordering::Acquire) {
            return true;
        }
        self.keep(cx);
        self.raised.load(Ordering::Acquire)
    }
}

impl<S: AsyncWrite + Unpin> Coalesce<S> {
    /// Writes what is buffered through to the inner stream, and frees it.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sent < self.buf.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.buf[self.sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        // Freed, not kept: an idle connection holds no buffer.
        self.buf = Vec::new();
        self.sent = 0;
        self.turn = None;
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Coalesce<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Coalesce<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[io::IoSlice::new(buf)])
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let len: usize = bufs.iter().map(|b| b.len()).sum();
        if self.buf.len() + len > COALESCE_MAX {
            ready!(self.poll_drain(cx))?;
            if len >= COALESCE_MAX {
                return Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
            }
        }
        for b in bufs {
            self.buf.extend_from_slice(b);
        }
        Poll::Ready(Ok(len))
    }
    fn is_write_vectored(&self) -> bool {
        true
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.buf.is_empty() && !self.yielded {
            let turn = self.turn.get_or_insert_with(Flag::ask_turn);
            if !turn.raised_or_keep(cx) {
                return Poll::Pending;
            }
            self.turn = None;
            self.yielded = true;
        }
        ready!(self.poll_drain(cx))?;
        self.yielded = false;
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_drain(cx))?;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Reads through `inner` only after a wake-up since it last said "pending".
///
/// hyper polls its connection's reads every time the connection's task
/// runs, whatever woke it (a request to send, a body taken, a response
/// handed over): through TLS down to the socket, each such poll learns again,
/// at a few hundred instructions, that nothing came (benches/RESULTS.md,
/// "Reads tried again only after a wake-up"). The latch hands `inner` a waker of
/// its own. Once `inner` has said "pending", a read is answered "pending" at
/// once until that waker fires, and the task's waker is kept so that the
/// wake-up still reaches it. Whatever `inner` registered that waker for
/// (readiness to read, or to write within a read) counts as a wake-up: at
/// worst a read is tried once too often, never once too few.
///
/// Only for a stream that nothing reads except through the latch.
pub(crate) struct ReadLatch<S> {
    inner: S,
    latch: Arc<Flag>,
    /// `latch` as a waker, made once.
    waker: std::task::Waker,
    /// `inner`'s last read said "pending".
    parked: bool,
}

impl<S> ReadLatch<S> {
    pub(crate) fn new(inner: S) -> Self {
        let latch = Arc::new(Flag::default());
        Self {
            inner,
            waker: std::task::Waker::from(latch.clone()),
            latch,
            parked: false,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for ReadLatch<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        // Kept before the wake-up is looked at: one that comes in between
        // wakes this task again.
        this.latch.keep(cx);
        // Cleared before `inner` is polled: a wake-up during the poll is seen.
        let woken = this.latch.raised.swap(false, Ordering::AcqRel);
        if this.parked && !woken {
            return Poll::Pending;
        }
        let polled =
            Pin::new(&mut this.inner).poll_read(&mut Context::from_waker(&this.waker), buf);
        this.parked = polled.is_pending();
        polled
    }
}

write_through!(ReadLatch);

/// Why [`quiet_for_then`] returned.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Quiet {
    /// No byte moved for the whole idle time.
    Idle,
    /// `stop` said so at a tick.
    Stop,
    /// Quiet for a whole short tick ([`Watch`] only).
    Lull,
    /// Still quiet at the (long) tick after the lull, so for over a second
    /// ([`Watch`] only).
    Rest,
}

/// Returns once no byte has moved either way for `idle` ([`Quiet::Idle`]),
/// calling `on_lull` once each time the connection has been
/// quiet for a whole short tick (`lull`, at most the tick), so between one
/// and two of them after its last byte, and again after the next burst; and
/// returning at the first tick at which `stop` is true. See [`Watch`].
pub(crate) async fn quiet_for_then(
    activity: &Counts,
    idle: Duration,
    lull: Duration,
    mut on_lull: impl FnMut(),
    stop: impl Fn() -> bool,
) -> Quiet {
    let mut watch = Watch::new(activity, idle, lull);
    loop {
        match watch.next(&stop).await {
            Quiet::Lull => on_lull(),
            Quiet::Rest => {}
            why => return why,
        }
    }
}

/// A connection's quiet, watched tick by tick: a lull once it has been
/// quiet for a whole short tick (`lull`, at most the tick), so between one
/// and two of them after its last byte, and again after the next burst; a
/// rest when it is still quiet at the tick after the lull; the idle time
/// passed with no byte moved; or `stop` true at a tick. The
/// connection is looked at every short tick while bytes move, and every
/// tick (1 s, or `idle` if shorter) once it is quiet: an idle connection
/// wakes once a second. What it has seen outlives each [`Watch::next`], so
/// the caller may stop waiting on it and come back.
pub(crate) struct Watch<'a> {
    activity: &'a Counts,
    idle: Duration,
    tick: Duration,
    short: Duration,
    last: u64,
    quiet_since: Instant,
    lulled: bool,
    rested: bool,
}

impl<'a> Watch<'a> {
    pub(crate) fn new(activity: &'a Counts, idle: Duration, lull: Duration) -> Self {
        let tick = idle.min(Duration::from_secs(1));
        let mut watch = Self {
            activity,
            idle,
            tick,
            short: lull.min(tick),
            last: 0,
            quiet_since: Instant::now(),
            lulled: false,
            rested: false,
        };
        watch.last = watch.total();
        watch
    }

    fn total(&self) -> u64 {
        self.activity.read.load(Ordering::Relaxed) + self.activity.written.load(Ordering::Relaxed)
    }

    /// When a byte was last seen to move, at a tick's granularity: the last
    /// byte moved at or before it.
    pub(crate) fn quiet_since(&self) -> Instant {
        self.quiet_since
    }

    /// The next lull or rest, the idle time passed, or a stop.
    pub(crate) async fn next(&mut self, stop: impl Fn() -> bool) -> Quiet {
        loop {
            tokio::time::sleep(if self.lulled { self.tick } else { self.short }).await;
            if stop() {
                return Quiet::Stop;
            }
            let now = self.total();
            if now != self.last {
                self.last = now;
                self.quiet_since = Instant::now();
                self.lulled = false;
                self.rested = false;
            } else if self.quiet_since.elapsed() >= self.idle {
                return Quiet::Idle;
            } else if !self.lulled {
                self.lulled = true;
                return Quiet::Lull;
            } else if !self.rested {
                self.rested = true;
                return Quiet::Rest;
            }
        }
    }
}

/// hyper's timer for the HTTP/1.1 head timeout, without tokio's timer
/// wheel: a deadline is read whenever hyper polls it, which it does each
/// time the connection's task runs while a head is awaited. The task of a
/// connection hyper serves also runs its [`Watch`], which wakes it at least
/// once a second, so a head timeout is seen at most a tick late. A deadline
/// costs a clock read per poll, where a tokio sleep registered a timer on
/// every request and removed it when the head came.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct TickTimer;

/// A [`TickTimer`] deadline. It never registers a waker: see [`TickTimer`].
struct Deadline(std::time::Instant);

impl Future for Deadline {
    type Output = ();
    fn poll(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<()> {
        if std::time::Instant::now() >= self.0 {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

impl hyper::rt::Sleep for Deadline {}

impl hyper::rt::Timer for TickTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(Deadline(std::time::Instant::now() + duration))
    }

    fn sleep_until(&self, deadline: std::time::Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(Deadline(deadline))
    }

    fn reset(&self, sleep: &mut Pin<Box<dyn hyper::rt::Sleep>>, deadline: std::time::Instant) {
        match sleep.as_mut().downcast_mut_pin::<Deadline>() {
            Some(mut d) => d.0 = deadline,
            None => *sleep = self.sleep_until(deadline),
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

    #[test]
    fn a_tick_timer_deadline_is_ready_once_passed_and_moves_when_reset() {
        use hyper::rt::Timer;
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        let now = std::time::Instant::now();
        let mut sleep = TickTimer.sleep_until(now + Duration::from_secs(60));
        assert!(sleep.as_mut().poll(&mut cx).is_pending());
        TickTimer.reset(&mut sleep, now);
        assert!(sleep.as_mut().poll(&mut cx).is_ready());
        TickTimer.reset(&mut sleep, now + Duration::from_secs(60));
        assert!(sleep.as_mut().poll(&mut cx).is_pending());
        assert!(TickTimer
            .sleep(Duration::ZERO)
            .as_mut()
            .poll(&mut cx)
            .is_ready());
    }

    #[tokio::test]
    async fn vectored_writes_pass_through_rewind_and_counted_and_are_counted() {
        let (a, mut b) = pair().await;
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

    /// Records the size of every write that reaches the inner stream.
    struct Recorder<S> {
        inner: S,
        writes: Vec<usize>,
    }

    impl<S: AsyncWrite + Unpin> AsyncWrite for Recorder<S> {
        fn poll_write(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, buf))?;
            self.writes.push(n);
            Poll::Ready(Ok(n))
        }
        fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.inner).poll_flush(cx)
        }
        fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.inner).poll_shutdown(cx)
        }
    }

    async fn pair() -> (tokio::net::TcpStream, tokio::net::TcpStream) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let a = tokio::net::TcpStream::connect(l.local_addr().expect("addr"))
            .await
            .expect("connect");
        let (b, _) = l.accept().await.expect("accept");
        (a, b)
    }

    /// A stream that counts the reads it is asked for.
    struct Polls<S> {
        inner: S,
        reads: usize,
    }

    impl<S: AsyncRead + Unpin> AsyncRead for Polls<S> {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            self.reads += 1;
            Pin::new(&mut self.inner).poll_read(cx, buf)
        }
    }

    /// A waker that counts its wake-ups.
    #[derive(Default)]
    struct Wakes(AtomicU64);

    impl std::task::Wake for Wakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[tokio::test]
    async fn a_latched_read_goes_through_only_after_a_wake_up() {
        let (a, mut b) = pair().await;
        let mut s = ReadLatch::new(Polls { inner: a, reads: 0 });
        let wakes = Arc::new(Wakes::default());
        let waker = std::task::Waker::from(wakes.clone());
        let mut cx = Context::from_waker(&waker);
        let mut space = [0u8; 16];
        let mut read = |s: &mut ReadLatch<Polls<tokio::net::TcpStream>>| {
            let mut buf = ReadBuf::new(&mut space);
            match Pin::new(s).poll_read(&mut cx, &mut buf) {
                Poll::Ready(r) => Some(r.map(|()| buf.filled().to_vec())),
                Poll::Pending => None,
            }
        };
        assert!(read(&mut s).is_none(), "nothing sent yet");
        assert_eq!(s.inner.reads, 1);
        assert!(read(&mut s).is_none());
        assert!(read(&mut s).is_none());
        assert_eq!(
            s.inner.reads, 1,
            "no wake-up: the stream is not asked again"
        );
        b.write_all(b"hello").await.expect("write");
        let woken = async {
            while wakes.0.load(Ordering::SeqCst) == 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(5), woken)
            .await
            .expect("the bytes' arrival wakes the task that read last");
        let got = read(&mut s)
            .expect("ready after the wake-up")
            .expect("read");
        assert_eq!(got, b"hello");
        assert_eq!(s.inner.reads, 2);
        // A read that returned data leaves it unlatched: the next is tried.
        assert!(read(&mut s).is_none());
        assert_eq!(s.inner.reads, 3);
        drop(b);
        tokio::time::timeout(Duration::from_secs(5), async {
            while wakes.0.load(Ordering::SeqCst) < 2 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the peer's close wakes it too");
        let end = read(&mut s).expect("ready at the end").expect("read");
        assert!(end.is_empty(), "end of stream");
    }

    #[tokio::test]
    async fn coalesced_writes_leave_together_after_the_schedulers_turn() {
        let (a, mut b) = pair().await;
        let mut s = Coalesce::new(Recorder {
            inner: a,
            writes: Vec::new(),
        });
        for chunk in [&[1u8; 1024][..], &[2u8; 1024][..], &[3u8; 1024][..]] {
            let n = s
                .write_vectored(&[io::IoSlice::new(chunk)])
                .await
                .expect("write");
            assert_eq!(n, 1024);
        }
        assert!(s.inner.writes.is_empty(), "nothing written before a flush");
        let early = std::future::poll_fn(|cx| {
            let first = Pin::new(&mut s).poll_flush(cx);
            // Polled again before the scheduler has had its turn (as a
            // stream's task queuing a frame makes the connection's task).
            let again = Pin::new(&mut s).poll_flush(cx);
            Poll::Ready((first, again))
        })
        .await;
        assert!(early.0.is_pending(), "the first flush waits for the turn");
        assert!(early.1.is_pending(), "and so does a second poll before it");
        assert!(s.inner.writes.is_empty());
        s.flush().await.expect("flush");
        assert_eq!(
            s.inner.writes,
            vec![3 * 1024],
            "three writes, one write through"
        );
        assert_eq!(s.buf.capacity(), 0, "the buffer is freed once written");
        let mut got = vec![0u8; 3 * 1024];
        b.read_exact(&mut got).await.expect("read");
        assert!(got[..1024].iter().all(|&x| x == 1));
        assert!(got[2048..].iter().all(|&x| x == 3));
        s.flush().await.expect("flush");
        assert_eq!(s.inner.writes.len(), 1, "an empty flush writes nothing");
    }

    #[tokio::test]
    async fn a_write_too_large_to_buffer_goes_through_after_what_was_buffered() {
        let (a, mut b) = pair().await;
        let mut s = Coalesce::new(Recorder {
            inner: a,
            writes: Vec::new(),
        });
        s.write_all(b"head").await.expect("write");
        let big = vec![7u8; COALESCE_MAX + 1];
        s.write_all(&big).await.expect("write");
        assert_eq!(s.inner.writes.first(), Some(&4), "the buffered bytes first");
        assert_eq!(s.inner.writes.iter().sum::<usize>(), 4 + big.len());
        s.write_all(b"tail").await.expect("write");
        s.shutdown().await.expect("shutdown drains");
        let mut got = Vec::new();
        b.read_to_end(&mut got).await.expect("read");
        assert_eq!(got.len(), 8 + big.len());
        assert_eq!(&got[..4], b"head");
        assert_eq!(&got[got.len() - 4..], b"tail");
    }

    #[tokio::test(start_paused = true)]
    async fn a_lull_is_seen_within_two_short_ticks_of_the_last_byte() {
        let counts = Counts::default();
        let start = Instant::now();
        let lulls = std::sync::Mutex::new(Vec::new());
        let busy = async {
            // A byte every 100 ms for 600 ms, then nothing.
            for _ in 0..6 {
                tokio::time::sleep(Duration::from_millis(100)).await;
                counts.written.fetch_add(1, Ordering::Relaxed);
            }
        };
        let idle = Duration::from_secs(10);
        let on_lull = || lulls.lock().expect("lock").push(start.elapsed());
        let watch = quiet_for_then(&counts, idle, Duration::from_millis(250), on_lull, || false);
        let ((), why) = tokio::join!(busy, watch);
        assert_eq!(why, Quiet::Idle);
        let ended = start.elapsed();
        let lulls = lulls.into_inner().expect("lock");
        assert_eq!(lulls.len(), 1, "one lull for one burst: {lulls:?}");
        let lull = lulls[0];
        assert!(
            lull >= Duration::from_millis(850) && lull <= Duration::from_millis(1_100),
            "the lull came {lull:?} after the start, the last byte at 600 ms"
        );
        assert!(
            ended >= Duration::from_millis(10_600) && ended <= Duration::from_millis(12_000),
            "the idle timeout ended it at {ended:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_rest_follows_a_lull_at_the_next_tick_and_again_after_a_burst() {
        let counts = Counts::default();
        let start = Instant::now();
        let mut watch = Watch::new(&counts, Duration::from_secs(10), Duration::from_millis(250));
        let mut seen = Vec::new();
        for _ in 0..2 {
            seen.push((watch.next(|| false).await, start.elapsed()));
        }
        counts.read.fetch_add(1, Ordering::Relaxed);
        for _ in 0..2 {
            seen.push((watch.next(|| false).await, start.elapsed()));
        }
        let ms = Duration::from_millis;
        assert_eq!(
            seen,
            [
                (Quiet::Lull, ms(250)),
                (Quiet::Rest, ms(1_250)),
                // The byte is seen at the next tick, 2.25 s (a quiet
                // connection is looked at once a second): a lull a short
                // tick later.
                (Quiet::Lull, ms(2_500)),
                (Quiet::Rest, ms(3_500)),
            ]
        );
        assert_eq!(watch.quiet_since(), start + ms(2_250));
    }

    #[tokio::test(start_paused = true)]
    async fn a_stop_is_seen_at_the_next_tick() {
        let counts = Counts::default();
        let start = Instant::now();
        let stop_at = start + Duration::from_millis(2_600);
        let stop = || Instant::now() >= stop_at;
        let idle = Duration::from_secs(10);
        // Quiet from the start: a short tick (250 ms), then ticks of a
        // second, so the stop is seen at 3.25 s.
        let why = quiet_for_then(&counts, idle, Duration::from_millis(250), || {}, stop).await;
        assert_eq!(why, Quiet::Stop);
        assert_eq!(start.elapsed(), Duration::from_millis(3_250));
    }
}
