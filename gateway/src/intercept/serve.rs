//! A client connection's HTTP server. Its first bytes say which version it
//! speaks: the HTTP/2 preface, or anything else for HTTP/1.1 (as hyper-util's
//! automatic server reads them). HTTP/2 is served to the end. HTTP/1.1 is
//! served with its parser and buffers set aside whenever the connection rests
//! between requests ("parked"), so an idle keep-alive connection holds its
//! TLS stream and socket and nothing of hyper's (benches/RESULTS.md, "Idle
//! intercepted connections: the HTTP/1.1 parser set aside").
//!
//! A connection rests when it has moved no byte for over a second (the
//! idle timer's tick after the lull that gave its upstream connection back,
//! so a client that pauses for less between requests keeps its parser and
//! pays nothing for parking) and nothing of HTTP is in flight on it: every
//! response it was sent has ended and been flushed, its last request's body
//! (if it had one) was read to its end (so the parser is not in it; a body
//! left unread keeps the connection unparked until its next request), and
//! no byte has come in since that response ended (so no part of a next head
//! is buffered). Bytes hyper did hold (a partial head pipelined behind the
//! last request) are read again by the next parser, and the connection
//! does not rest again before its next request. While parked, the limits
//! hyper would keep still hold: the idle timeout, the drain, and
//! `timeouts.request_head`, which hyper counts from the moment it waits for
//! a head (unparked, hyper's deadline is read at the watch's ticks:
//! [`crate::io::TickTimer`]).

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};

use super::charge::StreamCharge;
use super::{client_fault, connection_error, ended, Conn, Served, RELEASE_AFTER};
use crate::fault::Fault;
use crate::io::{Counts, Quiet, ReadLatch, Rewind, Watch};
use crate::pool::{Body, BoxError};

/// The first bytes of every HTTP/2 connection (RFC 9113, 3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Longest wait for a parked connection's TLS close when a drain ends it.
const CLOSE_WAIT: Duration = Duration::from_secs(1);

/// Runs the HTTP server over `io` until the client is done, idle, or gone.
pub(super) async fn serve<I>(conn: Arc<Conn>, io: I, activity: &Counts) -> Served
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let idle = conn.dp.config().timeouts.idle;
    let mut watch = Watch::new(activity, idle, RELEASE_AFTER);
    // Every read of the client's stream goes through the latch (the sniff,
    // hyper's, the parked wait): it spares them the reads that would find
    // nothing.
    let mut io = Rewind::new(Vec::new(), ReadLatch::new(io));
    // The preface, or a request's first bytes, within the head's time: one
    // sniff, not one a tick (a sniff dropped at a tick would lose what it
    // had read of a preface sent slowly).
    let head_by = tokio::time::Instant::now() + conn.dp.config().timeouts.request_head;
    let h2 = {
        let sniffing = sniff(&mut io);
        tokio::pin!(sniffing);
        loop {
            tokio::select! {
                biased;
                h2 = &mut sniffing => break h2,
                why = watch.next(|| conn.stopping()) => match why {
                    Quiet::Idle => return idle_timeout(&conn),
                    Quiet::Stop => return finish(&conn, conn.stop_cause()).await,
                    Quiet::Lull | Quiet::Rest => {}
                },
                () = tokio::time::sleep_until(head_by) => {
                    let timeout = ended(Fault::HEAD_TIMEOUT, "head_timeout".to_owned());
                    return conn.served(Some(timeout));
                }
            }
        }
    };
    match h2 {
        Ok(true) => serve_h2(conn, io, watch).await,
        Ok(false) => serve_h1(conn, io, watch).await,
        Err(e) => conn.served(Some(ended(client_fault(&e), e.to_string()))),
    }
}

/// Reads until the bytes are the HTTP/2 preface (true), differ from it, or
/// end (false); what was read is put back.
async fn sniff<I: AsyncRead + Unpin>(io: &mut Rewind<I>) -> io::Result<bool> {
    let mut read = [0u8; H2_PREFACE.len()];
    let mut len = 0;
    let h2 = loop {
        let n = io.read(&mut read[len..]).await?;
        let differs = read[len..len + n] != H2_PREFACE[len..len + n];
        len += n;
        if n == 0 || differs {
            break false;
        }
        if len == H2_PREFACE.len() {
            break true;
        }
    };
    io.unread(&read[..len]);
    Ok(h2)
}

/// A request's answer, as the services below make it.
type Answer<B> = Pin<Box<dyn Future<Output = Result<Response<B>, Infallible>> + Send>>;

/// The most streams an HTTP/2 client may have open at once on one
/// connection (hyper's default is 200).
const MAX_CLIENT_STREAMS: u32 = 100;

/// The most of a stream's answer held for a client that does not read it
/// (hyper's default is 400 KiB): past it the origin's side waits, so a
/// client that opens every stream it may and stops reading holds at most
/// this much each here.
const MAX_STREAM_SEND_BUF: usize = 64 * 1024;

/// HTTP/2, served to the end; a drain says GOAWAY and lets the streams in
/// flight finish.
async fn serve_h2<I>(conn: Arc<Conn>, io: Rewind<I>, mut watch: Watch<'_>) -> Served
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let config = conn.dp.config();
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .max_header_list_size(u32::try_from(config.limits.max_request_head).unwrap_or(u32::MAX))
        .max_concurrent_streams(MAX_CLIENT_STREAMS)
        .max_send_buf_size(MAX_STREAM_SEND_BUF);
    let serving = builder.serve_connection(TokioIo::new(io), h2_service(&conn));
    drop(builder);
    let mut serving = std::pin::pin!(serving);
    let mut stopping = None;
    let served = loop {
        let since = stopping;
        tokio::select! {
            biased;
            r = serving.as_mut() => break r,
            // Each stream in flight is judged again (an idle connection has
            // none: its next request is judged anyway).
            why = watch.next(|| since.map_or_else(|| conn.stopping_busy(true), |at| conn.must_end(at))) => match why {
                Quiet::Idle => return idle_timeout(&conn),
                Quiet::Stop if stopping.is_some() => return conn.served(conn.end_cause()),
                Quiet::Stop => {
                    stopping = Some(Instant::now());
                    serving.as_mut().graceful_shutdown();
                }
                Quiet::Lull => conn.release_upstream(),
                Quiet::Rest => {}
            },
        }
    };
    let error = served.err().map(|e| connection_error(&e));
    let error = error.or_else(|| stopping.and_then(|_| conn.stop_cause()));
    finish(&conn, error).await
}

/// The service of an HTTP/2 connection: each request through the stages.
fn h2_service(
    conn: &Arc<Conn>,
) -> impl hyper::service::Service<
    Request<Incoming>,
    Response = Response<H2Body>,
    Error = Infallible,
    Future = Answer<H2Body>,
> {
    let conn = conn.clone();
    // Boxed: hyper keeps a slot for the service's future for the whole
    // connection, sized for it; the request's future (~9 kB, the upstream
    // connect inline) then exists only while a request is in flight, and an
    // idle connection holds a pointer (benches/RESULTS.md, Scale).
    hyper::service::service_fn(move |req: Request<Incoming>| {
        let conn = conn.clone();
        // What the stream is let through on is judged again after a push
        // until the stream ends: its answer's body and its request's body
        // both dropped (an upload may run on past its answer), or the
        // request given up.
        let end = Arc::new(StreamEnd::new(&conn));
        let req = req.map(|inner| ClientBody {
            inner,
            end: None,
            charge: None,
            stream: Some(end.clone()),
        });
        Box::pin(async move {
            // Held until the answer's head: the request's head with it.
            let Ok(_place) = conn.dp.h2_requests.take(conn.src) else {
                conn.dp.metrics.requests_over_share.inc();
                let why = "too many requests in flight from this address; retry\n";
                let refused = crate::reply::text(http::StatusCode::SERVICE_UNAVAILABLE, why);
                return Ok(refused.map(|body| Tracked { body, _open: None }));
            };
            let resp = conn.handle(req).await;
            Ok(resp.map(|body| Tracked {
                body,
                _open: Some(end),
            }))
        }) as Answer<H2Body>
    })
}

/// HTTP/1.1, parked whenever it rests (the module's comment says when);
/// a drain closes it at its next request boundary.
async fn serve_h1<I>(conn: Arc<Conn>, mut io: Rewind<I>, mut watch: Watch<'_>) -> Served
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut stopping = None;
    loop {
        let rest_io = RestIo {
            io,
            conn: conn.clone(),
        };
        let mut serving = h1_server(&conn)
            .serve_connection(TokioIo::new(rest_io), h1_service(&conn))
            .with_upgrades();
        let parts = loop {
            let since = stopping;
            tokio::select! {
                biased;
                r = &mut serving => {
                    if let (Ok(()), Some(bridge)) = (&r, conn.take_bridge()) {
                        return super::bridge::bridged(&conn, bridge, &mut watch).await;
                    }
                    return finish(&conn, r.err().map(|e| connection_error(&e))).await;
                }
                why = watch.next(|| since.map_or_else(|| conn.stopping_busy(conn.rest.busy()), |at| conn.must_end(at))) => match why {
                    Quiet::Idle => return idle_timeout(&conn),
                    Quiet::Stop if stopping.is_some() => return conn.served(conn.end_cause()),
                    Quiet::Stop => {
                        stopping = Some(Instant::now());
                        Pin::new(&mut serving).graceful_shutdown();
                    }
                    Quiet::Lull => conn.release_upstream(),
                    Quiet::Rest => {
                        if stopping.is_none() && conn.rest.at_rest(&conn.budget.activity) {
                            break serving.into_parts();
                        }
                    }
                },
            }
        };
        // `None`: upgraded, so the connection's future had ended above.
        let Some(parts) = parts else {
            return finish(&conn, None).await;
        };
        let rests;
        (io, rests) = unparse(&conn, parts);
        if rests {
            if let Some(served) = park(&conn, &mut io, &mut watch).await {
                return served;
            }
        }
    }
}

/// The client stream of a parser taken apart, and whether the connection
/// rests: it does unless the parser held bytes it had read, part of a next
/// head behind the last request. Those are put back for the next parser,
/// and the connection does not rest before that request.
fn unparse<I, S>(
    conn: &Conn,
    parts: hyper::server::conn::http1::Parts<TokioIo<RestIo<I>>, S>,
) -> (Rewind<I>, bool) {
    let mut io = parts.io.into_inner().io;
    if parts.read_buf.is_empty() {
        return (io, true);
    }
    io.unread(&parts.read_buf);
    conn.rest.settle.unsettle();
    (io, false)
}

/// The HTTP/1.1 parser of a client connection: bounded request heads (a
/// larger one is answered 431 and never forwarded), each within
/// `timeouts.request_head` of the moment it is waited for (seen at the
/// watch's next tick, [`crate::io::TickTimer`]: [`serve_h1`] polls hyper's
/// connection and the watch in one task).
fn h1_server(conn: &Conn) -> hyper::server::conn::http1::Builder {
    let config = conn.dp.config();
    let mut builder = hyper::server::conn::http1::Builder::new();
    // A client that shuts its side after its request (`nc -N`, HTTP/1.0
    // scripts) still gets the answer: the idle and head timeouts bound it.
    builder
        .max_buf_size(config.limits.max_request_head)
        .half_close(true)
        .timer(crate::io::TickTimer)
        .header_read_timeout(config.timeouts.request_head);
    builder
}

/// The service of an HTTP/1.1 connection: [`h2_service`]'s, each exchange
/// counted open until its response has ended.
fn h1_service(
    conn: &Arc<Conn>,
) -> impl hyper::service::Service<
    Request<Incoming>,
    Response = Response<Tracked>,
    Error = Infallible,
    Future = Answer<Tracked>,
> {
    let conn = conn.clone();
    hyper::service::service_fn(move |req: Request<Incoming>| {
        // One exchange at a time: what the last one was judged on is this
        // one's from here, let through or not.
        conn.forget_opening();
        let has_body = !hyper::body::Body::is_end_stream(req.body());
        let (open, exchange) = Open::new(conn.clone(), has_body);
        let end = has_body.then(|| BodyEnd {
            conn: conn.clone(),
            exchange,
        });
        let req = req.map(|inner| ClientBody {
            inner,
            end,
            charge: None,
            stream: None,
        });
        Box::pin(async move {
            let resp = open.0.handle(req).await;
            Ok(resp.map(|body| Tracked { body, _open: open }))
        }) as Answer<Tracked>
    })
}

/// Waits, parked, for the client's next bytes: `None` once they came (put
/// back for the next parser), or how the connection ended while parked.
async fn park<I>(conn: &Conn, io: &mut Rewind<I>, watch: &mut Watch<'_>) -> Option<Served>
where
    I: AsyncRead + AsyncWrite + Unpin,
{
    // hyper counts the head timeout from the end of the last response: the
    // last byte that moved, at or before the watch saw it.
    let head_by = watch.quiet_since() + conn.dp.config().timeouts.request_head;
    let parked = &conn.dp.metrics.parked;
    parked.inc();
    let mut first = [0u8; 64];
    let woke = loop {
        tokio::select! {
            biased;
            read = io.read(&mut first) => break Ok(read),
            why = watch.next(|| conn.stopping()) => match why {
                Quiet::Idle => break Err(idle_timeout(conn)),
                Quiet::Stop => {
                    let _ = tokio::time::timeout(CLOSE_WAIT, io.shutdown()).await;
                    break Err(finish(conn, conn.stop_cause()).await);
                }
                Quiet::Lull | Quiet::Rest => {}
            },
            () = tokio::time::sleep_until(head_by) => {
                let timeout = ended(Fault::HEAD_TIMEOUT, "head_timeout".to_owned());
                break Err(finish(conn, Some(timeout)).await);
            }
        }
    };
    parked.dec();
    match woke {
        Ok(Ok(0)) => Some(finish(conn, None).await),
        Ok(Ok(n)) => {
            io.unread(&first[..n]);
            None
        }
        Ok(Err(e)) => Some(finish(conn, Some(ended(client_fault(&e), e.to_string()))).await),
        Err(served) => Some(served),
    }
}

/// A connection's end: its upstream connection back to the pool, and its
/// flow's report, with `error` or else the last refused request's reason.
pub(super) async fn finish(conn: &Conn, error: Option<super::Ended>) -> Served {
    if let Some((key, sender)) = conn.upstream.lock().await.take() {
        conn.up.pool.put(key, sender);
    }
    let refused = conn.tally().refused.clone();
    conn.served(
        error.or_else(|| refused.map(|r| ended(Fault::BAD_REQUEST, format!("bad_request: {r}")))),
    )
}

/// A connection that moved no byte for `timeouts.idle`.
fn idle_timeout(conn: &Conn) -> Served {
    conn.served(Some(ended(Fault::IDLE_TIMEOUT, "idle_timeout".into())))
}

/// What says whether an HTTP/1.1 connection rests: nothing of HTTP in
/// flight on it (the module's comment).
#[derive(Debug, Default)]
pub(super) struct Rest {
    /// Exchanges whose responses have not ended (hyper serves one at a time).
    open: AtomicU32,
    /// Whether the parser may be inside a request: see [`Settle`].
    settle: Settle,
    /// A write went in since the last flush that completed.
    unflushed: AtomicBool,
    /// The client's bytes read when the last response ended.
    read_mark: AtomicU64,
}

impl Rest {
    /// An exchange is open: a request's response has not ended, or its
    /// body is still being read (it may run on past its response).
    pub(super) fn busy(&self) -> bool {
        self.open.load(Ordering::Relaxed) > 0 || !self.settle.settled()
    }

    fn at_rest(&self, activity: &Counts) -> bool {
        self.open.load(Ordering::Relaxed) == 0
            && self.settle.settled()
            && !self.unflushed.load(Ordering::Relaxed)
            && activity.read.load(Ordering::Relaxed) == self.read_mark.load(Ordering::Relaxed)
    }
}

/// The number of the last exchange, shifted left by one, and [`UNSETTLED`]
/// while its request's body has not been read to its end or bytes were read
/// that made no request yet: not at rest before that body's end or the next
/// request. One word, so that a body ending late (piped on after its
/// response) never settles a later exchange.
#[derive(Debug, Default)]
struct Settle(AtomicU64);

/// The bit of [`Settle`] that says the parser may be inside a request.
const UNSETTLED: u64 = 1;

impl Settle {
    /// A head came: the next exchange's number, unsettled if it has a body.
    fn open(&self, has_body: bool) -> u64 {
        let exchange = (self.0.load(Ordering::Relaxed) >> 1) + 1;
        self.0
            .store(exchange << 1 | u64::from(has_body), Ordering::Relaxed);
        exchange
    }

    /// `exchange`'s body ended: settled, unless a later head came since.
    fn settle(&self, exchange: u64) {
        let open = exchange << 1 | UNSETTLED;
        let _ = self.0.compare_exchange(
            open,
            open & !UNSETTLED,
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
    }

    /// Bytes were read that made no request yet.
    fn unsettle(&self) {
        self.0.fetch_or(UNSETTLED, Ordering::Relaxed);
    }

    fn settled(&self) -> bool {
        self.0.load(Ordering::Relaxed) & UNSETTLED == 0
    }
}

/// An HTTP/1.1 exchange, open from its request's head until its response
/// has ended (or either was dropped).
struct Open(Arc<Conn>);

impl Open {
    /// The exchange opened, and its number. hyper reads one request at a
    /// time on a connection, so the number counts heads in order.
    fn new(conn: Arc<Conn>, has_body: bool) -> (Self, u64) {
        let rest = &conn.rest;
        rest.open.fetch_add(1, Ordering::Relaxed);
        let exchange = rest.settle.open(has_body);
        (Self(conn), exchange)
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        let rest = &self.0.rest;
        rest.open.fetch_sub(1, Ordering::Relaxed);
        let read = self.0.budget.activity.read.load(Ordering::Relaxed);
        rest.read_mark.store(read, Ordering::Relaxed);
    }
}

/// A response body that keeps its exchange open until hyper drops it (at
/// its end, or with the connection): an HTTP/1.1 exchange ([`Open`]), an
/// HTTP/2 stream ([`StreamEnd`]).
struct Tracked<G = Open> {
    body: Body,
    _open: G,
}

/// An HTTP/2 answer's body, its stream in flight until it drops.
type H2Body = Tracked<Option<Arc<StreamEnd>>>;

/// An HTTP/2 stream in flight: what it was let through on is forgotten
/// when this drops ([`Conn::forget_stream`]). It does not keep the
/// connection: a body an origin never reads may outlive it.
pub(super) struct StreamEnd(std::sync::Weak<Conn>, u64);

impl StreamEnd {
    fn new(conn: &Arc<Conn>) -> Self {
        let token = conn.streams.fetch_add(1, Ordering::Relaxed) + 1;
        Self(Arc::downgrade(conn), token)
    }
}

impl Drop for StreamEnd {
    fn drop(&mut self) {
        if let Some(conn) = self.0.upgrade() {
            conn.forget_stream(self.1);
        }
    }
}

impl<G: Unpin> hyper::body::Body for Tracked<G> {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }
    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }
    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A request body as the stages read it. On HTTP/1.1 it settles its
/// exchange once hyper has given all of it: the parser is then past the
/// body, at the next head. A body left unread keeps the connection from
/// resting until the next request (hyper drains or closes it). On HTTP/2
/// under budgets, its data is charged to its stream as it is taken.
pub(super) struct ClientBody {
    inner: Incoming,
    end: Option<BodyEnd>,
    charge: Option<Arc<StreamCharge>>,
    /// An HTTP/2 stream's: in flight while its body is read too.
    stream: Option<Arc<StreamEnd>>,
}

/// Whose exchange a request body settles when it ends.
struct BodyEnd {
    conn: Arc<Conn>,
    exchange: u64,
}

impl ClientBody {
    /// The HTTP/2 stream's number on its connection (none on HTTP/1.1).
    pub(super) fn stream(&self) -> Option<u64> {
        self.stream.as_ref().map(|s| s.1)
    }

    /// From here on, its data is charged to `charge`.
    pub(super) fn charge_to(&mut self, charge: Arc<StreamCharge>) {
        self.charge = Some(charge);
    }

    fn settled(&mut self) {
        if let Some(end) = self.end.take() {
            end.conn.rest.settle.settle(end.exchange);
        }
    }
}

impl hyper::body::Body for ClientBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let (Some(charge), Poll::Ready(Some(Ok(frame)))) = (&self.charge, &polled) {
            charge.charge(frame.data_ref().map_or(0, Bytes::len));
        }
        // The end, or the last frame of a body of known length: hyper's
        // decoder has read every byte of it.
        let ended = match &polled {
            Poll::Ready(None) => true,
            Poll::Ready(Some(Ok(_))) => self.inner.is_end_stream(),
            _ => false,
        };
        if ended {
            self.settled();
        }
        polled
    }
    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The client stream under an HTTP/1.1 parser, noting whether every write
/// has been flushed (hyper flushes after each message it writes).
struct RestIo<I> {
    io: Rewind<I>,
    conn: Arc<Conn>,
}

impl<I: AsyncRead + Unpin> AsyncRead for RestIo<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for RestIo<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.conn.rest.unflushed.store(true, Ordering::Relaxed);
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.conn.rest.unflushed.store(true, Ordering::Relaxed);
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let flushed = Pin::new(&mut self.io).poll_flush(cx);
        if matches!(flushed, Poll::Ready(Ok(()))) {
            self.conn.rest.unflushed.store(false, Ordering::Relaxed);
        }
        flushed
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_body_settles_only_its_own_exchange() {
        let s = Settle::default();
        assert!(s.settled(), "a new connection is settled");
        let first = s.open(true);
        assert!(!s.settled(), "a body is coming");
        let second = s.open(true);
        assert_eq!(second, first + 1);
        s.settle(first);
        assert!(
            !s.settled(),
            "a late body leaves a later exchange unsettled"
        );
        s.settle(second);
        assert!(s.settled());
        s.settle(second);
        assert!(s.settled(), "settling twice changes nothing");
        let third = s.open(false);
        assert!(
            s.settled(),
            "a request without a body is settled at its head"
        );
        s.unsettle();
        assert!(!s.settled(), "bytes of a next head");
        s.settle(second);
        assert!(!s.settled(), "an older body does not settle them");
        assert_eq!(s.open(false), third + 1);
        assert!(s.settled(), "the next head settles them");
    }

    /// What `sniff` says of `chunks` written one by one, and the bytes read
    /// after it: all of them, none lost.
    async fn sniffed(chunks: &[&'static [u8]]) -> (bool, Vec<u8>) {
        let (ours, mut theirs) = tokio::io::duplex(1024);
        let chunks = chunks.to_vec();
        let writer = tokio::spawn(async move {
            for c in chunks {
                theirs.write_all(c).await.expect("write");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        });
        let mut io = Rewind::new(Vec::new(), ours);
        let h2 = sniff(&mut io).await.expect("sniff");
        writer.await.expect("writer");
        let mut all = Vec::new();
        io.read_to_end(&mut all).await.expect("read");
        (h2, all)
    }

    #[tokio::test]
    async fn the_http2_preface_is_told_from_http1_and_every_byte_is_read_again() {
        let (h2, bytes) = sniffed(&[b"PRI * HTTP/2.0\r\n", b"\r\nSM\r\n\r\n", b"frames"]).await;
        assert!(h2, "the preface, in two reads");
        assert_eq!(bytes, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\nframes");
        let (h2, bytes) = sniffed(&[b"PRI * HTTP/1.1\r\n\r\n"]).await;
        assert!(!h2, "differs from the preface");
        assert_eq!(bytes, b"PRI * HTTP/1.1\r\n\r\n");
        let (h2, bytes) = sniffed(&[b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"]).await;
        assert!(!h2);
        assert_eq!(bytes, b"GET / HTTP/1.1\r\nHost: a\r\n\r\n");
        let (h2, bytes) = sniffed(&[b"PRI"]).await;
        assert!(!h2, "ends inside the preface");
        assert_eq!(bytes, b"PRI");
    }
}
