//! Splice: copy bytes both ways between client and origin, propagating
//! half-close, counting bytes, and closing both sides after `idle` with no
//! bytes in either direction.
//!
//! Owned socket halves (no lock per operation) and one idle watchdog for the
//! flow (no timer per read): the path every exempted byte takes.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

use crate::budget::Meter;
use crate::config::Config;
use crate::fault::{Fault, Side};
use crate::hello_retry::{Judged, Passed, RetryError};
use crate::io::{quiet_for_then, reset, Counts, Quiet};
use crate::metrics::SplicePath;
use crate::spliced::Spliced;
use crate::state::Dataplane;
use crate::upstream::connect_out;
use crate::upstream_proxy::Route;
use rustix::fd::OwnedFd;
use rustix::pipe::{PipeFlags, SpliceFlags};

/// Connects to `dst` the way `route` says (direct, or through the
/// operator's proxy), sends the `peeked` bytes first, then joins the two
/// sockets as they are; the peeked bytes are freed once sent, not held for
/// the flow's life. The error names the step that failed (the client is
/// reset); the byte counts include the peeked bytes. With a byte budget
/// (`meter`) the flow takes the gateway's copy, which charges every chunk
/// before writing it: neither the sockmap nor `splice(2)` could be cut at
/// the budget. Once `stop` names a fault (its sandbox is gone, or the
/// drain's time ran out), at a tick of the idle watch, the flow is cut
/// with it. A TLS flow (`hello`: what its ClientHello was judged on) is
/// read up to the server's first handshake message first, and past a
/// HelloRetryRequest up to the client's second ClientHello
/// ([`crate::hello_retry`]).
pub(crate) async fn splice_to(
    dp: &Dataplane,
    mut client: TcpStream,
    (dst, route): (std::net::SocketAddr, &Route),
    (peeked, hello): (Vec<u8>, Option<Judged<'_>>),
    (config, meter): (&Config, Option<Meter>),
    stop: impl Fn() -> Option<Fault> + Sync,
) -> Result<Spliced, String> {
    let timeouts = &config.timeouts;
    let ends = (&stop as &(dyn Fn() -> Option<Fault> + Sync), meter.as_ref());
    let begun = begin(
        dp,
        &mut client,
        (dst, route),
        (peeked, hello),
        (config, ends),
    );
    let (origin, sent, passed) = match begun.await? {
        Ok(begun) => begun,
        Err(cut) => return Ok(cut),
    };
    let peeked_len = sent + passed.up;
    let kernel = dp.kernel.as_ref().filter(|_| meter.is_none());
    let (client, origin) = match kernel {
        Some(kernel) => {
            let ends = (timeouts.idle, &stop as &(dyn Fn() -> Option<Fault> + Sync));
            match crate::ksplice::splice(kernel, (client, origin, peeked_len), ends).await {
                Ok(moved) => {
                    dp.metrics.spliced(SplicePath::Kernel);
                    return Ok(moved);
                }
                Err((client, origin, e)) => {
                    tracing::debug!(error = %e, "flow not joined to the kernel splice; copied");
                    (client, origin)
                }
            }
        }
        None => (client, origin),
    };
    let (pipes, path) = pipes_for(config, meter.is_some());
    let ends = (timeouts.idle, stop);
    let mut moved = splice(client, origin, ends, pipes, meter.as_ref()).await;
    dp.metrics.spliced(path);
    moved.up += peeked_len;
    moved.down += passed.down;
    Ok(moved)
}

/// The start of a splice, before the bytes run unread: the origin's
/// socket with the first bytes sent on it (a TLS flow's first hello; the
/// rest waits for the server's answer, [`crate::hello_retry`]), and, for
/// TLS, what passed until the server's first message (and a second hello)
/// had gone through. `Ok(Err)`: the flow was cut meanwhile (`stop`, the
/// byte budget), both sides reset.
async fn begin(
    dp: &Dataplane,
    client: &mut TcpStream,
    connect: (std::net::SocketAddr, &Route),
    (peeked, hello): (Vec<u8>, Option<Judged<'_>>),
    (config, (stop, meter)): (&Config, Begun<'_>),
) -> Result<Result<(TcpStream, u64, Passed), Spliced>, String> {
    let first = match hello {
        // Found: the flow was classified TLS on these very bytes.
        Some(_) => crate::peek::client_hello_end(&peeked).unwrap_or(peeked.len()),
        None => peeked.len(),
    };
    let timeout = config.timeouts.connect;
    let mut origin = open_origin(dp, client, connect, &peeked[..first], timeout).await?;
    let sent = first as u64;
    if let Some(fault) = stop() {
        // Cut while connecting (up to `timeouts.connect`): the first bytes,
        // what was judged, went out; nothing more does.
        reset(client);
        reset(&origin);
        return Ok(Err(Spliced::cut(sent, 0, fault)));
    }
    let after = peeked[first..].to_vec();
    drop(peeked);
    let Some(judged) = hello else {
        return Ok(Ok((origin, sent, Passed::default())));
    };
    let sockets = (client, &mut origin);
    Ok(
        match hello_watched(dp, config, sockets, (judged, after), (meter, stop)).await? {
            Ok(passed) => Ok((origin, sent, passed)),
            Err(cut) => Err(Spliced { up: sent, ..cut }),
        },
    )
}

/// What may end a splice before it begins: its stop, its byte budget.
type Begun<'a> = (&'a (dyn Fn() -> Option<Fault> + Sync), Option<&'a Meter>);

/// Pipes for `splice(2)` when `splice.kernel = "pipe"` and no meter must
/// see the bytes (`metered`), and the path the bytes then take.
fn pipes_for(config: &Config, metered: bool) -> (Option<Pipes>, SplicePath) {
    let pipes = match config.splice.kernel {
        crate::config::KernelSplice::Pipe if !metered => match Pipes::new() {
            Ok(p) => Some(p),
            Err(e) => {
                tracing::debug!(error = %e, "no pipes for splice(2); copied");
                None
            }
        },
        _ => None,
    };
    let path = match pipes {
        Some(_) => SplicePath::Pipe,
        None => SplicePath::User,
    };
    (pipes, path)
}

/// The start of a TLS flow read ([`crate::hello_retry::watch`]), every
/// write charged to `meter` first, and none made once `stop` names a fault
/// (the flow was cut while it waited, for up to `timeouts.tls_handshake`
/// a step, on the server's first message or the client's second hello):
/// what was passed on; `Ok(Err)`, the flow cut at its byte budget or by
/// `stop` (both sides reset; the counts are of what the client got);
/// `Err`, why both sides were reset.
async fn hello_watched(
    dp: &Dataplane,
    config: &Config,
    (client, origin): (&mut TcpStream, &mut TcpStream),
    (judged, after): (Judged<'_>, Vec<u8>),
    (meter, stop): (Option<&Meter>, &(dyn Fn() -> Option<Fault> + Sync)),
) -> Result<Result<Passed, Spliced>, String> {
    let bounds = (config.limits.peek_bytes, config.timeouts.tls_handshake);
    let stopped = std::sync::OnceLock::new();
    let spend = |n: usize| match stop() {
        Some(fault) => {
            let _ = stopped.set(fault);
            false
        }
        None => n == 0 || meter.is_none_or(|m| m.spend(n)),
    };
    let watched = crate::hello_retry::watch((client, origin), judged, after, bounds, &spend).await;
    let e = match watched {
        Ok(passed) => return Ok(Ok(passed)),
        Err(e) => e,
    };
    reset(client);
    reset(origin);
    let fault = match e {
        RetryError::Origin(_) => Fault::UPSTREAM_TLS,
        RetryError::Client(_) => Fault::HELLO_RETRY,
        // A client that went away (or took nothing within the handshake's
        // time) is the client's fault: a reset, or its TLS start failing;
        // not a second ClientHello refused.
        RetryError::ClientGone(ref io) => Fault::io(Side::Client, io).unwrap_or(Fault::CLIENT_TLS),
        RetryError::Budget { down } => {
            if let Some(&fault) = stopped.get() {
                return Ok(Err(Spliced::cut(0, down, fault)));
            }
            return Ok(Err(Spliced {
                up: 0,
                down,
                idle_timeout: false,
                fault: None,
                budget_cut: meter.map(Meter::describe),
            }));
        }
    };
    dp.metrics.fault(fault);
    Err(format!("tls_hello: {e}"))
}

/// The origin's socket, with `peeked` sent on it first (then freed), or
/// the step that failed (the client is reset).
async fn open_origin(
    dp: &Dataplane,
    client: &TcpStream,
    (dst, route): (std::net::SocketAddr, &Route),
    peeked: &[u8],
    connect_timeout: Duration,
) -> Result<TcpStream, String> {
    // Boxed: the connect's future (about 1.8 kB) would be the largest state
    // of the flow's task, which lives as long as the flow.
    let connect = Box::pin(connect_out(route, dst, connect_timeout, &dp.metrics));
    let mut origin = match connect.await {
        Ok(o) => o,
        Err(e) => {
            reset(client);
            dp.metrics.fault(e.fault());
            return Err(e.log());
        }
    };
    // Before the idle watch starts: an origin that opens no window would
    // hold the flow here.
    let written = tokio::time::timeout(connect_timeout, origin.write_all(peeked)).await;
    let failed = match written {
        Ok(Ok(())) => return Ok(origin),
        Ok(Err(e)) => (
            Fault::io(Side::Upstream, &e).unwrap_or(Fault::UPSTREAM_HTTP),
            format!("upstream_write: {e}"),
        ),
        Err(_) => (Fault::IDLE_TIMEOUT, "upstream_write: timed out".to_owned()),
    };
    // The origin took part of the first bytes at most: a FIN after them
    // would read as a whole message.
    reset(&origin);
    reset(client);
    dp.metrics.fault(failed.0);
    Err(failed.1)
}

/// One pipe per direction for `splice(2)`, made before the flow starts so a
/// lack of descriptors falls back to the copy instead of failing mid-flow.
pub(crate) struct Pipes {
    up: (OwnedFd, OwnedFd),
    down: (OwnedFd, OwnedFd),
}

impl Pipes {
    pub(crate) fn new() -> std::io::Result<Self> {
        let flags = PipeFlags::NONBLOCK | PipeFlags::CLOEXEC;
        Ok(Self {
            up: rustix::pipe::pipe_with(flags)?,
            down: rustix::pipe::pipe_with(flags)?,
        })
    }
}

/// Copies until both directions have closed, an error, or `idle` passes
/// quietly; with `pipes`, each direction moves socket → pipe → socket by
/// `splice(2)`, inside the kernel, else through a buffer of the gateway's.
/// A `meter` is charged for every chunk the copy moves (give it no pipes):
/// the first that does not fit resets both sides instead of moving. Once
/// `stop` names a fault, at a tick of the idle watch, both sides are reset.
pub(crate) async fn splice(
    client: TcpStream,
    origin: TcpStream,
    (idle, stop): (Duration, impl Fn() -> Option<Fault>),
    pipes: Option<Pipes>,
    meter: Option<&Meter>,
) -> Spliced {
    let (mut cr, mut cw) = client.into_split();
    let (mut or, mut ow) = origin.into_split();
    let counts = Counts::default();
    // Per direction: bytes taken from its source not yet all written.
    let pending = [AtomicBool::new(false), AtomicBool::new(false)];
    let both = both_ways(
        (&mut cr, &mut cw),
        (&mut or, &mut ow),
        &pipes,
        (&counts, &pending),
        meter,
    );
    let cut = cut_of(meter);
    let (idle_timeout, fault, broke) = tokio::select! {
        ended = both => match ended {
            Ok(()) => (false, None, false),
            // A direction broke on an error that names no fault (a timed-out
            // retransmission, say): reset as any break, and said so.
            Err(fault) => (false, Some(fault.unwrap_or(Fault::SPLICE_BROKEN)), true),
        },
        why = quiet_for_then(&counts, idle, Duration::MAX, || {}, || stop().is_some()) => match why {
            Quiet::Stop => (false, Some(stop().unwrap_or(Fault::SANDBOX_REMOVED)), true),
            // Cut with bytes read from one side that have not reached the
            // other: reset, so neither takes the end for a complete stream.
            // Idle with nothing held: closed, as before.
            _ => {
                let stuck = pending.iter().any(|p| p.load(Ordering::Relaxed));
                (true, Some(Fault::IDLE_TIMEOUT), stuck)
            }
        },
        () = cut => (false, None, false),
    };
    let budget_cut = meter.filter(|m| m.crossed()).map(Meter::describe);
    if budget_cut.is_some() || broke {
        // Cut or broken, not closed: neither side may take the end for a
        // complete transfer.
        reset(cr.as_ref());
        reset(or.as_ref());
        // Dropping a write half shuts it down: a FIN ahead of the RST, which
        // a client reads as the end of the stream (curl: "transfer closed").
        cw.forget();
        ow.forget();
    }
    Spliced {
        up: counts.read.load(Ordering::Relaxed),
        down: counts.written.load(Ordering::Relaxed),
        idle_timeout,
        fault,
        budget_cut,
    }
}

/// The meter's signal that a chunk did not fit; with no meter, never.
async fn cut_of(meter: Option<&Meter>) {
    match meter {
        Some(m) => m.cut().await,
        None => std::future::pending().await,
    }
}

/// Both directions of the copy (see [`until_broken`]): through `pipes`, or
/// the gateway's buffer charged to `meter`.
async fn both_ways(
    (cr, cw): (&mut OwnedReadHalf, &mut OwnedWriteHalf),
    (or, ow): (&mut OwnedReadHalf, &mut OwnedWriteHalf),
    pipes: &Option<Pipes>,
    (counts, [up, down]): (&Counts, &[AtomicBool; 2]),
    meter: Option<&Meter>,
) -> Ended {
    let up_sides = (Side::Client, Side::Upstream);
    let down_sides = (Side::Upstream, Side::Client);
    match pipes {
        Some(p) => {
            until_broken(
                pipe_pump(cr, ow, &p.up, (&counts.read, up), up_sides),
                pipe_pump(or, cw, &p.down, (&counts.written, down), down_sides),
            )
            .await
        }
        None => {
            until_broken(
                pump(cr, ow, (&counts.read, up, meter), up_sides),
                pump(or, cw, (&counts.written, down, meter), down_sides),
            )
            .await
        }
    }
}

/// How a direction ended: `Ok` at the source's EOF (passed on as a
/// half-close), `Err` at an error, with the fault it names if any (the flow
/// is broken: it is reset, not half-closed).
type Ended = Result<(), Option<Fault>>;

/// Both directions until both reached EOF, or the first error: a direction
/// that broke ends the flow at once, so the other side is not left waiting
/// for bytes that cannot come.
async fn until_broken(
    a: impl std::future::Future<Output = Ended>,
    b: impl std::future::Future<Output = Ended>,
) -> Ended {
    tokio::pin!(a, b);
    let (mut a_done, mut b_done) = (false, false);
    while !(a_done && b_done) {
        tokio::select! {
            ended = &mut a, if !a_done => { ended?; a_done = true; }
            ended = &mut b, if !b_done => { ended?; b_done = true; }
        }
    }
    Ok(())
}

/// One direction: read, write, count; at EOF, half-close the other side.
///
/// The buffer exists only while bytes flow: between bursts the pump waits
/// for readability without one, so idle spliced flows hold no copy buffers
/// (two 64 KiB buffers per flow would pin 1.3 GB for 10,000 idle flows).
/// A read that does not fill the buffer has drained the socket and clears
/// its readiness (tokio on epoll), so a small message costs one read and
/// one write — no extra read that would only say "would block".
/// `sides`: who is behind the reading and the writing half, to name a reset.
/// With a meter, each chunk is charged before it is written; one that does
/// not fit ends the pump at once, without a half-close (the flow is cut).
async fn pump(
    r: &mut OwnedReadHalf,
    w: &mut OwnedWriteHalf,
    (moved, pending, meter): (&AtomicU64, &AtomicBool, Option<&Meter>),
    sides: (Side, Side),
) -> Ended {
    const BUF: usize = 64 * 1024;
    'flow: loop {
        if let Err(e) = r.readable().await {
            return Err(Fault::io(sides.0, &e));
        }
        let mut buf: Vec<u8> = Vec::with_capacity(BUF);
        loop {
            buf.clear();
            match r.read_buf(&mut buf).await {
                Ok(0) => break 'flow,
                Err(e) => return Err(Fault::io(sides.0, &e)),
                Ok(n) => {
                    if meter.is_some_and(|m| !m.spend(n)) {
                        // Cut: `splice` ends the flow at the meter's signal.
                        return std::future::pending().await;
                    }
                    // Counted as it goes: a reader slow but alive keeps the
                    // flow from looking idle.
                    pending.store(true, Ordering::Relaxed);
                    let mut at = 0;
                    while at < n {
                        match w.write(&buf[at..n]).await {
                            Ok(0) => {
                                let e = std::io::Error::from(std::io::ErrorKind::WriteZero);
                                return Err(Fault::io(sides.1, &e));
                            }
                            Ok(k) => {
                                at += k;
                                moved.fetch_add(k as u64, Ordering::Relaxed);
                            }
                            Err(e) => return Err(Fault::io(sides.1, &e)),
                        }
                    }
                    pending.store(false, Ordering::Relaxed);
                    if n < BUF {
                        break; // drained: wait for more without the buffer
                    }
                }
            }
        }
    }
    // Half-close: the other side learns that no more bytes come this way.
    let _ = w.shutdown().await;
    Ok(())
}

/// Most bytes one `splice(2)` moves into the pipe: its default capacity,
/// so the pipe is always empty before a fill and a fill never blocks on it.
const PIPE_CHUNK: usize = 64 * 1024;

/// One direction by `splice(2)`: socket → pipe, then pipe → socket until
/// the pipe is empty; at EOF, half-close the other side. A fill
/// shorter than [`PIPE_CHUNK`] drained the socket, so its readiness is
/// cleared then (as tokio's own reads do), saving a call that would only
/// say "would block". TCP's back-pressure holds: nothing more is taken from
/// the source while the pipe is being emptied into a destination that is
/// behind.
async fn pipe_pump(
    r: &OwnedReadHalf,
    w: &OwnedWriteHalf,
    (pipe_r, pipe_w): &(OwnedFd, OwnedFd),
    (moved, pending): (&AtomicU64, &AtomicBool),
    sides: (Side, Side),
) -> Ended {
    let flags = SpliceFlags::MOVE | SpliceFlags::NONBLOCK;
    let (src, dst): (&TcpStream, &TcpStream) = (r.as_ref(), w.as_ref());
    loop {
        let filled = match fill_pipe(src, pipe_w, flags).await {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) => return Err(Fault::io(sides.0, &e)),
        };
        pending.store(true, Ordering::Relaxed);
        if let Err(e) = drain_pipe(dst, pipe_r, filled, flags, moved).await {
            return Err(Fault::io(sides.1, &e));
        }
        pending.store(false, Ordering::Relaxed);
    }
    // Half-close: the other side learns that no more bytes come this way.
    let _ = socket2::SockRef::from(dst).shutdown(std::net::Shutdown::Write);
    Ok(())
}

/// Socket → pipe: one `splice(2)` of up to [`PIPE_CHUNK`] once `src` is
/// readable; the bytes moved, 0 at EOF. Only the kernel's "would block"
/// clears the socket's readiness: a short fill is no sign the socket is
/// drained (a pipe holds 16 buffers, not 64 KiB: small segments fill it
/// before the bytes run out), and readiness is edge-triggered, so bytes
/// left behind would wait for the next ones to arrive.
async fn fill_pipe(
    src: &TcpStream,
    pipe_w: &OwnedFd,
    flags: SpliceFlags,
) -> std::io::Result<usize> {
    loop {
        src.readable().await?;
        let got = src.try_io(Interest::READABLE, || {
            Ok(rustix::pipe::splice(
                src, None, pipe_w, None, PIPE_CHUNK, flags,
            )?)
        });
        match got {
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
}

/// Pipe → socket: the `left` bytes the pipe holds, into `dst` as it
/// becomes writable, each counted in `moved` as it goes.
async fn drain_pipe(
    dst: &TcpStream,
    pipe_r: &OwnedFd,
    mut left: usize,
    flags: SpliceFlags,
    moved: &AtomicU64,
) -> std::io::Result<()> {
    while left > 0 {
        dst.writable().await?;
        let sent = dst.try_io(Interest::WRITABLE, || {
            Ok(rustix::pipe::splice(pipe_r, None, dst, None, left, flags)?)
        });
        match sent {
            Ok(n) => {
                left -= n;
                moved.fetch_add(n as u64, Ordering::Relaxed);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
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

    /// Both ways of moving bytes: through the gateway's buffer, and by
    /// `splice(2)` through pipes.
    fn ways() -> [Option<Pipes>; 2] {
        [None, Some(Pipes::new().expect("pipes"))]
    }

    #[tokio::test]
    async fn copies_both_ways_with_half_close_and_counts() {
        for pipes in ways() {
            copies_both_ways(pipes).await;
        }
    }

    async fn copies_both_ways(pipes: Option<Pipes>) {
        let (mut client, gw_client) = pair().await;
        let (gw_origin, mut origin) = pair().await;
        let task = tokio::spawn(splice(
            gw_client,
            gw_origin,
            (Duration::from_secs(5), || None),
            pipes,
            None,
        ));
        hello_then_half_close(&mut client, &mut origin).await;
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
                budget_cut: None,
            }
        );
    }

    #[tokio::test]
    async fn a_reset_is_counted_against_the_side_that_sent_it() {
        for pipes in ways() {
            reset_is_counted(pipes).await;
        }
    }

    async fn reset_is_counted(pipes: Option<Pipes>) {
        let (client, gw_client) = pair().await;
        let (gw_origin, mut origin) = pair().await;
        let task = tokio::spawn(splice(
            gw_client,
            gw_origin,
            (Duration::from_secs(5), || None),
            pipes,
            None,
        ));
        origin.write_all(b"hello").await.expect("write");
        // The client goes away with a reset (SO_LINGER 0), not a FIN.
        socket2::SockRef::from(&client)
            .set_linger(Some(Duration::ZERO))
            .expect("linger");
        drop(client);
        let s = task.await.expect("task");
        assert_eq!(s.fault, client_reset());
        assert!(!s.idle_timeout);
        sees_a_reset(&mut origin).await;
    }

    /// The far end of a broken flow learns it from a reset: a FIN would let
    /// it take what it got for the whole stream.
    pub(crate) async fn sees_a_reset<S: tokio::io::AsyncRead + Unpin>(s: &mut S) {
        let mut rest = Vec::new();
        let got = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest))
            .await
            .expect("the flow ends");
        let e = got.expect_err("a reset, not the end of the stream");
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}");
    }

    /// The client sends 12 bytes and its FIN; the origin reads exactly
    /// those, then EOF (both splice paths; `up` counts 12).
    pub(crate) async fn hello_then_half_close(client: &mut TcpStream, origin: &mut TcpStream) {
        client.write_all(b"hello origin").await.expect("write");
        client.shutdown().await.expect("half-close");
        let mut got = Vec::new();
        origin
            .read_to_end(&mut got)
            .await
            .expect("origin sees EOF after the bytes");
        assert_eq!(got, b"hello origin");
    }

    /// The fault a reset from the client leaves (both splice paths).
    pub(crate) fn client_reset() -> Option<Fault> {
        Some(Fault::io(Side::Client, &std::io::ErrorKind::ConnectionReset.into()).expect("a reset"))
    }

    #[tokio::test]
    async fn idle_flows_are_closed_but_one_busy_direction_keeps_it_open() {
        for pipes in ways() {
            idle_flows_are_closed(pipes).await;
        }
    }

    async fn idle_flows_are_closed(pipes: Option<Pipes>) {
        let (mut client, gw_client) = pair().await;
        let (gw_origin, mut origin) = pair().await;
        let task = tokio::spawn(splice(
            gw_client,
            gw_origin,
            (TRICKLE_IDLE, || None),
            pipes,
            None,
        ));
        trickles_then_closes_as_idle(task, &mut client, &mut origin).await;
    }

    /// The idle timeout [`trickles_then_closes_as_idle`] wants its flow spliced at.
    pub(crate) const TRICKLE_IDLE: Duration = Duration::from_secs(1);

    /// With `task` splicing at [`TRICKLE_IDLE`]: the origin trickles a byte,
    /// and sends the next only once the client has read it and a tenth of
    /// the timeout has passed, until bytes have flowed for twice the timeout.
    /// The flow is busy one way for longer than the timeout in total, never
    /// quiet for more than a tenth of it and one byte's trip (however loaded
    /// the machine, the wait for each byte is what is measured, and a late
    /// byte only makes the flow busy for longer), so every byte arrives and
    /// the flow is open after the last. Then, quiet, it is closed as idle,
    /// with every byte counted (both splice paths).
    pub(crate) async fn trickles_then_closes_as_idle(
        task: tokio::task::JoinHandle<Spliced>,
        client: &mut TcpStream,
        origin: &mut TcpStream,
    ) {
        let started = std::time::Instant::now();
        let mut sent = 0u64;
        while started.elapsed() < 2 * TRICKLE_IDLE {
            tokio::time::sleep(TRICKLE_IDLE / 10).await;
            origin.write_all(b"x").await.expect("write");
            let mut b = [0u8; 1];
            client
                .read_exact(&mut b)
                .await
                .expect("each byte arrives while the flow is busy one way");
            sent += 1;
        }
        assert!(!task.is_finished(), "still open while bytes flow one way");
        let s = tokio::time::timeout(30 * TRICKLE_IDLE, task)
            .await
            .expect("closed when idle")
            .expect("task");
        assert!(s.idle_timeout);
        assert_eq!(s.down, sent);
    }

    /// Through pipes, TCP's back-pressure holds both ways: a destination
    /// that stops reading stops its source after a few socket buffers, with
    /// the other direction half-closed or not, and nothing is lost.
    #[tokio::test]
    async fn pipes_keep_tcp_back_pressure_and_lose_nothing() {
        let (mut client, gw_client) = pair().await;
        let (gw_origin, mut origin) = pair().await;
        let pipes = Pipes::new().expect("pipes");
        let task = tokio::spawn(splice(
            gw_client,
            gw_origin,
            (Duration::from_secs(10), || None),
            Some(pipes),
            None,
        ));
        // The origin does not read: the client can write only so much.
        let chunk = vec![1u8; 64 * 1024];
        let mut sent = 0usize;
        while let Ok(Ok(n)) =
            tokio::time::timeout(Duration::from_millis(200), client.write(&chunk)).await
        {
            sent += n;
            assert!(sent < 64 << 20, "no back-pressure: {sent} bytes taken");
        }
        // The client half-closes and stops reading; the origin streams.
        client.shutdown().await.expect("half-close");
        let mut streamed = 0usize;
        while let Ok(Ok(n)) =
            tokio::time::timeout(Duration::from_millis(200), origin.write(&chunk)).await
        {
            streamed += n;
            assert!(
                streamed < 64 << 20,
                "no back-pressure: {streamed} bytes taken"
            );
        }
        // Every byte the client sent reaches the origin, then its EOF.
        let mut got = Vec::new();
        origin.read_to_end(&mut got).await.expect("read");
        assert_eq!(got.len(), sent);
        // And every byte the origin streamed reaches the client.
        origin.shutdown().await.expect("close");
        let mut back = Vec::new();
        client.read_to_end(&mut back).await.expect("read");
        assert_eq!(back.len(), streamed);
        let moved = task.await.expect("task");
        assert_eq!((moved.up, moved.down), (sent as u64, streamed as u64));
        assert_eq!(moved.fault, None);
    }
}
