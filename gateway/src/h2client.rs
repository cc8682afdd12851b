//! The origin side of an HTTP/2 client's requests: the `h2` crate's client,
//! driven from the request's own task.
//!
//! hyper's HTTP/2 client spawns a task for every request (to await the
//! response and hand it back over a channel), sized like its connection's
//! task, which holds the whole connection inline: per request an allocation
//! and two copies of that size, and two more wake-ups (benches/RESULTS.md,
//! "HTTP/2: flushes at the scheduler's turn, and the origin's side without a
//! task per request"). Here the request is sent, and its response awaited,
//! by the task that serves the client's stream; only the connection has a
//! task of its own, and a request body is piped by a task only while it is
//! still coming. A connection the origin has said GOAWAY on takes no new
//! request (the pool asks, without waiting, before it hands one out): the
//! next goes out on a new connection.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame};
use tokio::io::{AsyncRead, AsyncWrite};

/// The windows and buffers hyper's HTTP/2 client used: a stream may have
/// 2 MiB in flight, the connection 5 MiB; a stream queues at most 1 MiB to
/// send.
const STREAM_WINDOW: u32 = 2 * 1024 * 1024;
const CONNECTION_WINDOW: u32 = 5 * 1024 * 1024;
const SEND_BUFFER: usize = 1024 * 1024;
/// Largest response head (its header list, decoded) an origin may send on
/// a stream; a larger one fails the stream (`502` to the client). Without
/// it, `h2`'s default of 16 MiB applies: an origin could make each of a
/// connection's streams hold 16 MiB of headers from a few kilobytes of
/// HPACK (hyper's client, which this replaced, said 16 KiB).
pub(crate) const MAX_RESPONSE_HEAD: u32 = 64 * 1024;

/// A handle on an HTTP/2 connection to an origin; clones share it.
#[derive(Clone)]
pub(crate) struct H2Sender {
    send: h2::client::SendRequest<Bytes>,
    /// Set when the connection's task has ended.
    closed: Arc<AtomicBool>,
    /// The requests sent on it whose exchange has not ended (their response
    /// body not yet done with): at the origin's limit of concurrent
    /// streams, the next request goes on another connection instead of
    /// waiting in `h2`'s queue for one of these to end.
    in_flight: Arc<AtomicUsize>,
    /// Dropped with the last handle: tells the connection's task to end once
    /// its streams are done (`h2` does not wake a connection for that).
    _alive: Arc<tokio::sync::oneshot::Sender<()>>,
}

/// Makes an HTTP/2 connection over `io` (the TLS stream, ALPN `h2`) and
/// spawns its task.
pub(crate) async fn handshake<I>(io: I) -> Result<H2Sender, h2::Error>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (send, conn) = h2::client::Builder::new()
        .enable_push(false)
        .initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_send_buffer_size(SEND_BUFFER)
        .max_header_list_size(MAX_RESPONSE_HEAD)
        .handshake(io)
        .await?;
    let closed = Arc::new(AtomicBool::new(false));
    let (alive, dropped) = tokio::sync::oneshot::channel::<()>();
    let ended = closed.clone();
    tokio::spawn(async move {
        let mut conn = std::pin::pin!(conn);
        tokio::select! {
            _ = conn.as_mut() => {}
            _ = dropped => {
                // No handle left: polled again, the connection ends when
                // its last stream does.
                let _ = conn.await;
            }
        }
        ended.store(true, Ordering::Release);
    });
    Ok(H2Sender {
        send,
        closed,
        in_flight: Arc::default(),
        _alive: Arc::new(alive),
    })
}

impl H2Sender {
    /// Whether a new request can go out on it now: it is open
    /// ([`H2Sender::open`]) and below the origin's limit of concurrent
    /// streams.
    pub(crate) fn usable(&self) -> bool {
        self.open() && self.in_flight.load(Ordering::Acquire) < self.send.current_max_send_streams()
    }

    /// Whether it is the same connection as `other`.
    pub(crate) fn same(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.closed, &other.closed)
    }

    /// Whether it can take requests at all: not once the origin has said
    /// GOAWAY (its streams in flight may still be finishing) or the
    /// connection has ended. Asks without waiting.
    pub(crate) fn open(&self) -> bool {
        if self.closed.load(Ordering::Acquire) {
            return false;
        }
        let mut probe = self.send.clone();
        let mut cx = Context::from_waker(std::task::Waker::noop());
        if let Poll::Ready(Err(_)) = probe.poll_ready(&mut cx) {
            self.closed.store(true, Ordering::Release);
            return false;
        }
        true
    }

    /// Sends `req` (an absolute URI, no connection-specific header) and
    /// awaits the response's head; the body follows as it comes. A request
    /// body still coming is piped by a task of its own, which ends with the
    /// exchange: it is aborted when the response (or, before its head, this
    /// future) is dropped, so a client gone while the origin keeps its
    /// window shut leaves no task waiting on it.
    pub(crate) async fn send<B>(&self, req: Request<B>) -> Result<Response<Received>, h2::Error>
    where
        B: Body<Data = Bytes> + Send + Unpin + 'static,
        B::Error: Send,
    {
        let mut send = match self.send.clone().ready().await {
            Ok(send) => send,
            Err(e) => {
                self.closed.store(true, Ordering::Release);
                return Err(e);
            }
        };
        let (parts, body) = req.into_parts();
        let end = body.is_end_stream();
        let flight = InFlight::new(&self.in_flight);
        let (response, stream) = send.send_request(Request::from_parts(parts, ()), end)?;
        let pipe = Piping((!end).then(|| tokio::spawn(pipe(body, stream)).abort_handle()));
        let (parts, recv) = response.await?.into_parts();
        let body = Received {
            recv,
            data_done: false,
            _pipe: pipe,
            _flight: flight,
        };
        Ok(Response::from_parts(parts, body))
    }
}

/// A response body as the origin sends it; each chunk taken gives its
/// bytes back to the stream's window.
pub(crate) struct Received {
    recv: h2::RecvStream,
    data_done: bool,
    /// The request body's pipe, aborted with the response.
    _pipe: Piping,
    _flight: InFlight,
}

/// The task piping a request body (if any), aborted when dropped: its
/// `SendStream` goes with it, and `h2` resets a stream no handle holds.
struct Piping(Option<tokio::task::AbortHandle>);

/// One request counted in its connection's [`H2Sender::in_flight`] until
/// dropped (with its response body, or its failure).
struct InFlight(Arc<AtomicUsize>);

impl InFlight {
    fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::AcqRel);
        Self(count.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drop for Piping {
    fn drop(&mut self) {
        if let Some(task) = &self.0 {
            task.abort();
        }
    }
}

impl Body for Received {
    type Data = Bytes;
    type Error = h2::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, h2::Error>>> {
        if !self.data_done {
            match ready!(self.recv.poll_data(cx)) {
                Some(Ok(data)) => {
                    let _ = self.recv.flow_control().release_capacity(data.len());
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Some(Err(e)) => return Poll::Ready(Some(Err(e))),
                None => self.data_done = true,
            }
        }
        match ready!(self.recv.poll_trailers(cx)) {
            Ok(Some(trailers)) => Poll::Ready(Some(Ok(Frame::trailers(trailers)))),
            Ok(None) => Poll::Ready(None),
            Err(e) => Poll::Ready(Some(Err(e))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.recv.is_end_stream()
    }
}

/// Sends a request body to the origin as the client sends it (its data; not
/// its trailers), within the stream's window. A client body that fails resets the stream; an origin
/// that resets it, or a connection that fails, stops the pipe.
async fn pipe<B: Body<Data = Bytes> + Unpin>(mut body: B, mut stream: h2::SendStream<Bytes>) {
    if let Err(Fail::Client) = pipe_body(&mut body, &mut stream).await {
        stream.send_reset(h2::Reason::CANCEL);
    }
}

/// Why a request body stopped short.
enum Fail {
    /// The client's body failed: the origin is told with a reset.
    Client,
    /// The origin's stream or connection did: nothing more to tell it.
    Origin,
}

impl From<h2::Error> for Fail {
    fn from(_: h2::Error) -> Self {
        Self::Origin
    }
}

async fn pipe_body<B: Body<Data = Bytes> + Unpin>(
    body: &mut B,
    stream: &mut h2::SendStream<Bytes>,
) -> Result<(), Fail> {
    loop {
        let frame = tokio::select! {
            frame = body.frame() => frame,
            _ = std::future::poll_fn(|cx| stream.poll_reset(cx)) => return Err(Fail::Origin),
        };
        let frame = match frame {
            None => return Ok(stream.send_data(Bytes::new(), true)?),
            Some(Err(_)) => return Err(Fail::Client),
            Some(Ok(frame)) => frame,
        };
        match frame.into_data() {
            Ok(data) => {
                // The last chunk ends the stream itself: no empty DATA frame after it.
                let end = body.is_end_stream();
                send_data(stream, data, end).await?;
                if end {
                    return Ok(());
                }
            }
            Err(frame) => {
                // A request's trailers are dropped, as over HTTP/1.1 (where
                // `Trailer` is hop-by-hop): no stage reads them, so none
                // carries a placeholder or a field past the checks.
                if frame.is_trailers() {
                    return Ok(stream.send_data(Bytes::new(), true)?);
                }
            }
        }
    }
}

/// Sends one chunk, in pieces as the stream's window allows; with `end`,
/// its last piece ends the stream.
async fn send_data(
    stream: &mut h2::SendStream<Bytes>,
    mut data: Bytes,
    end: bool,
) -> Result<(), Fail> {
    if data.is_empty() {
        if end {
            stream.send_data(data, true)?;
        }
        return Ok(());
    }
    while !data.is_empty() {
        stream.reserve_capacity(data.len());
        let granted = match std::future::poll_fn(|cx| stream.poll_capacity(cx)).await {
            Some(granted) => granted?,
            None => return Err(Fail::Origin),
        };
        if granted > 0 {
            let piece = data.split_to(granted.min(data.len()));
            stream.send_data(piece, end && data.is_empty())?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    /// A body that yields its frames, one per poll.
    struct Frames(VecDeque<Frame<Bytes>>);

    impl Body for Frames {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            Poll::Ready(self.0.pop_front().map(Ok))
        }

        fn is_end_stream(&self) -> bool {
            self.0.is_empty()
        }
    }

    #[tokio::test]
    async fn a_request_body_goes_on_without_its_trailers() {
        let (ours, theirs) = tokio::io::duplex(64 * 1024);
        let origin = tokio::spawn(async move {
            let mut conn = h2::server::handshake(theirs).await.expect("handshake");
            let (req, mut respond) = conn.accept().await.expect("a stream").expect("ok");
            let answered = tokio::spawn(async move {
                let mut body = req.into_body();
                let mut data = Vec::new();
                while let Some(chunk) = body.data().await {
                    let chunk = chunk.expect("data");
                    let _ = body.flow_control().release_capacity(chunk.len());
                    data.extend_from_slice(&chunk);
                }
                let trailers = body.trailers().await.expect("the end");
                let resp = http::Response::new(());
                respond.send_response(resp, true).expect("respond");
                (data, trailers)
            });
            while conn.accept().await.is_some() {}
            answered.await.expect("stream")
        });
        let sender = handshake(ours).await.expect("client");
        let mut trailers = http::HeaderMap::new();
        trailers.insert("x-placeholder", "{{secret}}".parse().expect("value"));
        let body = Frames(VecDeque::from([
            Frame::data(Bytes::from_static(b"hello")),
            Frame::trailers(trailers),
        ]));
        let req = Request::post("https://origin.test/up")
            .body(body)
            .expect("request");
        let resp = sender.send(req).await.expect("answer");
        assert_eq!(resp.status(), 200);
        // The client's connection ends with its last handle and stream.
        drop((resp, sender));
        let (data, trailers) = origin.await.expect("origin");
        assert_eq!(data, b"hello");
        assert_eq!(trailers, None, "the trailers stay behind");
    }
}
