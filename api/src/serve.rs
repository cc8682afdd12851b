//! The accept loop every listener of this project runs.

use std::future::Future;
use std::time::Duration;

use http::Request;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpListener;

use crate::reply::Reply;

/// How long a client has to send a request head (HTTP/1.1) before its
/// connection is closed: an idle or trickling client holds no task forever.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(10);

/// HTTP/2 streams one connection may have open at once (hyper's default is
/// 200): what one client can ask at once stays small.
pub const MAX_STREAMS: u32 = 64;

/// The HTTP/2 flow-control window each stream starts with: RFC 9113's
/// default, 65,535 bytes.
pub const H2_WINDOW: u32 = 65_535;
/// The HTTP/2 connection's window: room for a few streams' bodies waiting
/// for their handler (a stream's unread body holds the connection's window
/// until it is read), and no more than a peer may leave unread in the
/// server per connection (hyper's default is 1 MiB).
pub const H2_CONNECTION_WINDOW: u32 = 256 * 1024;

/// How long a connection may go without a request in flight before it is
/// closed (an HTTP/2 connection holds no request head to time out, and an
/// idle one would keep its slot of [`MAX_CONNECTIONS`] for good). Until its
/// first request, a connection has [`HEAD_TIMEOUT`] at most: one that says
/// nothing (or only the HTTP/2 preface) holds a slot no longer than one that
/// trickles a head. The project's own clients open a connection per call.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a connection closed for idleness has to finish: it has no
/// request in flight, so this is only its goodbye.
const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// How long the loop waits after accepting failed (out of descriptors,
/// say) before it tries again, rather than spinning.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Connections one listener serves at once. Past it a new connection is
/// closed at once: its descriptors are the process's, which on a gateway
/// the data path needs.
pub const MAX_CONNECTIONS: usize = 512;

/// Serves HTTP/1.1 and HTTP/2 on `listener` until the task is dropped,
/// answering each request with `handle`, at most [`MAX_CONNECTIONS`] at
/// once. `name` says which listener in the logs.
pub async fn serve<F, Fut>(listener: TcpListener, name: &'static str, handle: F)
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Reply> + Send + 'static,
{
    serve_at_most(listener, (name, MAX_CONNECTIONS, IDLE_TIMEOUT), handle).await;
}

/// How long a graceful stop ([`serve_until`]) lets the requests in flight
/// finish.
pub const STOP_GRACE: Duration = Duration::from_secs(20);

/// [`serve`] until `stop` completes; then no connection is taken, each one
/// served is closed once its requests in flight are answered (HTTP/2 with
/// a `GOAWAY`), and those still open after [`STOP_GRACE`] are dropped. A
/// rolling update then loses no answer: a create committed in the store is
/// answered rather than reset.
pub async fn serve_until<F, Fut>(
    listener: TcpListener,
    name: &'static str,
    handle: F,
    stop: impl Future<Output = ()>,
) where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Reply> + Send + 'static,
{
    let (stopping, told) = tokio::sync::watch::channel(false);
    let limits = (name, MAX_CONNECTIONS, IDLE_TIMEOUT);
    let mut connections = tokio::task::JoinSet::new();
    tokio::select! {
        () = accept_into(listener, limits, handle, (&mut connections, Some(told))) => {}
        () = stop => {}
    }
    tracing::info!(
        listener = name,
        open = connections.len(),
        "stopping: answering the requests in flight"
    );
    let _ = stopping.send(true);
    let drained = async { while connections.join_next().await.is_some() {} };
    if tokio::time::timeout(STOP_GRACE, drained).await.is_err() {
        tracing::warn!(
            listener = name,
            open = connections.len(),
            "stopped with connections still open"
        );
    }
}

/// A connection's requests in flight, and when the last one ended.
struct Activity {
    since: std::time::Instant,
    /// Whether a request has begun on it.
    asked: std::sync::atomic::AtomicBool,
    busy: std::sync::atomic::AtomicUsize,
    /// Milliseconds after `since`.
    last: std::sync::atomic::AtomicU64,
}

/// A request in flight; its end is the connection's last activity.
struct Busy(std::sync::Arc<Activity>);

impl Drop for Busy {
    fn drop(&mut self) {
        let ms = u64::try_from(self.0.since.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.0.last.store(ms, std::sync::atomic::Ordering::Relaxed);
        self.0
            .busy
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Activity {
    fn new() -> std::sync::Arc<Self> {
        std::sync::Arc::new(Self {
            since: std::time::Instant::now(),
            asked: Default::default(),
            busy: Default::default(),
            last: Default::default(),
        })
    }

    fn begin(self: &std::sync::Arc<Self>) -> Busy {
        self.asked.store(true, std::sync::atomic::Ordering::Relaxed);
        self.busy.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Busy(self.clone())
    }

    /// How long no request has been in flight (`None`: one is).
    fn idle_for(&self) -> Option<Duration> {
        if self.busy.load(std::sync::atomic::Ordering::Relaxed) > 0 {
            return None;
        }
        let last = Duration::from_millis(self.last.load(std::sync::atomic::Ordering::Relaxed));
        Some(self.since.elapsed().saturating_sub(last))
    }

    /// Ends once no request has been in flight for `limit` ([`HEAD_TIMEOUT`]
    /// at most before the first request).
    async fn idle(&self, limit: Duration) {
        loop {
            let limit = match self.asked.load(std::sync::atomic::Ordering::Relaxed) {
                true => limit,
                false => limit.min(HEAD_TIMEOUT),
            };
            match self.idle_for() {
                Some(d) if d >= limit => return,
                Some(d) => tokio::time::sleep(limit - d).await,
                None => tokio::time::sleep(limit).await,
            }
        }
    }
}

/// [`serve`], with at most `max` connections at once, each closed after
/// `idle` without a request in flight. The connections are the loop's
/// own: when its future is dropped (the task aborted, as a gateway's drain
/// or handover does), every connection it serves ends with it, instead of
/// serving on unseen.
pub async fn serve_at_most<F, Fut>(
    listener: TcpListener,
    limits: (&'static str, usize, Duration),
    handle: F,
) where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Reply> + Send + 'static,
{
    let mut connections = tokio::task::JoinSet::new();
    accept_into(listener, limits, handle, (&mut connections, None)).await;
}

/// The accept loop of [`serve_at_most`], its connections in `connections`,
/// each told to stop by `stop` (if any).
async fn accept_into<F, Fut>(
    listener: TcpListener,
    (name, max, idle): (&'static str, usize, Duration),
    handle: F,
    (connections, stop): (&mut tokio::task::JoinSet<()>, Option<Stop>),
) where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Reply> + Send + 'static,
{
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(max));
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            // Ended connections are reaped as they end.
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let (stream, peer) = match accepted {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(listener = name, error = %e, "accept failed");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::warn!(listener = name, %peer, max, "connection refused: the listener serves as many as it may");
            drop(stream);
            continue;
        };
        let (handle, stop) = (handle.clone(), stop.clone());
        connections.spawn(async move {
            let _slot = slot;
            serve_one_until(stream, (name, peer, idle), handle, stop).await;
        });
    }
}

/// Set when the listener stops ([`serve_until`]).
/// Says `true` once the server stops.
pub type Stop = tokio::sync::watch::Receiver<bool>;

/// Serves one connection (a TCP stream, or TLS over one) until it ends, or
/// until no request has been in flight on it for `idle`. HTTP/1.1 request
/// heads must arrive within [`HEAD_TIMEOUT`].
pub async fn serve_one<I, F, Fut>(
    stream: I,
    limits: (&'static str, std::net::SocketAddr, Duration),
    handle: F,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Reply> + Send + 'static,
{
    serve_one_until(stream, limits, handle, None).await;
}

/// [`serve_one`], closed gracefully (its requests in flight answered, then
/// HTTP/2's `GOAWAY` or HTTP/1.1's `Connection: close`) once `stop` says so.
pub async fn serve_one_until<I, F, Fut>(
    stream: I,
    (name, peer, idle): (&'static str, std::net::SocketAddr, Duration),
    handle: F,
    stop: Option<Stop>,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Reply> + Send + 'static,
{
    let activity = Activity::new();
    let requests = activity.clone();
    let service = hyper::service::service_fn(move |req| {
        let busy = requests.begin();
        let reply = handle(req);
        async move {
            let reply = reply.await;
            drop(busy);
            Ok::<_, std::convert::Infallible>(reply)
        }
    });
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT);
    // A peer may leave at most the connection's window of its bodies
    // unread in the server, however many streams it opens.
    builder
        .http2()
        .max_concurrent_streams(MAX_STREAMS)
        .initial_stream_window_size(H2_WINDOW)
        .initial_connection_window_size(H2_CONNECTION_WINDOW);
    let conn = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    let stopped = async {
        match stop {
            Some(mut stop) => drop(stop.wait_for(|s| *s).await),
            None => std::future::pending().await,
        }
    };
    let served = tokio::select! {
        served = conn.as_mut() => served,
        () = activity.idle(idle) => {
            tracing::debug!(listener = name, %peer, "closing an idle connection");
            conn.as_mut().graceful_shutdown();
            tokio::time::timeout(CLOSE_GRACE, conn).await.unwrap_or(Ok(()))
        }
        () = stopped => {
            conn.as_mut().graceful_shutdown();
            tokio::time::timeout(STOP_GRACE, conn).await.unwrap_or(Ok(()))
        }
    };
    if let Err(e) = served {
        tracing::debug!(listener = name, %peer, error = %e, "connection ended");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reply::text;
    use http::StatusCode;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn answers_each_request_with_the_handler() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let server = tokio::spawn(serve(
            listener,
            "test",
            |req: Request<Incoming>| async move { text(StatusCode::OK, req.uri().path().to_owned()) },
        ));
        let mut c = tokio::net::TcpStream::connect(addr).await.expect("connect");
        c.write_all(b"GET /a/b HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .expect("write");
        let mut got = String::new();
        let read = tokio::time::timeout(Duration::from_secs(10), c.read_to_string(&mut got));
        read.await.expect("in time").expect("read");
        assert!(got.starts_with("HTTP/1.1 200"), "{got}");
        assert!(got.ends_with("/a/b"), "{got}");
        server.abort();
    }

    /// Past its limit a listener closes a new connection at once, and takes
    /// one again when a held one ends.
    #[tokio::test]
    async fn connections_past_the_limit_are_closed() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let server = tokio::spawn(serve_at_most(
            listener,
            ("test", 2, IDLE_TIMEOUT),
            |_: Request<Incoming>| async move { text(StatusCode::OK, "ok".to_owned()) },
        ));
        let held = [
            tokio::net::TcpStream::connect(addr).await.expect("connect"),
            tokio::net::TcpStream::connect(addr).await.expect("connect"),
        ];
        let get = |mut c: tokio::net::TcpStream| async move {
            let _ = c
                .write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                .await;
            let mut got = String::new();
            let read = tokio::time::timeout(Duration::from_secs(10), c.read_to_string(&mut got));
            let _ = read.await.expect("in time");
            got
        };
        let third = tokio::net::TcpStream::connect(addr).await.expect("connect");
        assert_eq!(get(third).await, "", "closed without an answer");
        drop(held);
        // The held connections' tasks end when they see the close.
        let mut answered = String::new();
        for _ in 0..100 {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let c = tokio::net::TcpStream::connect(addr).await.expect("connect");
            answered = get(c).await;
            if !answered.is_empty() {
                break;
            }
        }
        assert!(answered.starts_with("HTTP/1.1 200"), "{answered}");
        server.abort();
    }

    /// An HTTP/2 connection with no request in flight is closed after the
    /// idle limit (it has no request head to time out), and one whose
    /// request takes longer than the limit is answered.
    #[tokio::test]
    async fn idle_connections_are_closed_and_busy_ones_are_not() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let limit = Duration::from_millis(300);
        let server = tokio::spawn(serve_at_most(
            listener,
            ("test", 4, limit),
            |_: Request<Incoming>| async move {
                tokio::time::sleep(Duration::from_millis(900)).await;
                text(StatusCode::OK, "slow".to_owned())
            },
        ));
        let mut h2 = tokio::net::TcpStream::connect(addr).await.expect("connect");
        // The preface and an empty SETTINGS frame, then nothing.
        h2.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
            .await
            .expect("preface");
        let mut got = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(10), h2.read_to_end(&mut got));
        assert!(read.await.is_ok(), "the idle HTTP/2 connection stayed open");
        // A GOAWAY frame (type 7) said goodbye.
        assert!(
            got.windows(4).any(|w| w[3] == 7 && w[..3] == [0, 0, 8]),
            "{got:?}"
        );

        let mut c = tokio::net::TcpStream::connect(addr).await.expect("connect");
        c.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .expect("write");
        let mut got = String::new();
        let read = tokio::time::timeout(Duration::from_secs(10), c.read_to_string(&mut got));
        read.await.expect("in time").expect("read");
        assert!(got.starts_with("HTTP/1.1 200"), "{got}");
        server.abort();
    }

    /// An HTTP/2 connection idle after a request is closed at the idle
    /// limit: its request's mark of being busy is let go with its answer,
    /// and the GOAWAY comes well before [`HEAD_TIMEOUT`] past the answer.
    /// (Whether one that never asked is held to the head timeout instead
    /// is `a_connection_that_asks_nothing_ends_within_the_head_timeout`.)
    #[tokio::test]
    async fn an_http2_connection_idle_after_a_request_is_closed_at_the_idle_limit() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let server = tokio::spawn(serve_at_most(
            listener,
            ("test", 4, Duration::from_secs(1)),
            |_: Request<Incoming>| async move { text(StatusCode::OK, "ok".to_owned()) },
        ));
        let mut h2 = tokio::net::TcpStream::connect(addr).await.expect("connect");
        // The preface, an empty SETTINGS, and a GET of `/` on stream 1
        // (HEADERS, END_STREAM | END_HEADERS; :method GET, :scheme http,
        // :path /, :authority x).
        let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0".to_vec();
        hello.extend_from_slice(&[0, 0, 6, 1, 5, 0, 0, 0, 1, 0x82, 0x86, 0x84, 0x41, 1, b'x']);
        h2.write_all(&hello).await.expect("request");
        let mut frame = async || {
            let mut head = [0u8; 9];
            h2.read_exact(&mut head).await.expect("a frame");
            let len = usize::from(head[2]) | usize::from(head[1]) << 8;
            let mut payload = vec![0u8; len];
            h2.read_exact(&mut payload).await.expect("its payload");
            (
                head[3],
                u32::from_be_bytes([head[5], head[6], head[7], head[8]]),
            )
        };
        let within = Duration::from_secs(5);
        // The answer's HEADERS (type 1) on stream 1.
        let answered = async { while frame().await != (1, 1) {} };
        tokio::time::timeout(within, answered)
            .await
            .expect("answered");
        let answered_at = std::time::Instant::now();
        let goaway = async { while frame().await.0 != 7 {} };
        let said = tokio::time::timeout(HEAD_TIMEOUT - Duration::from_secs(3), goaway).await;
        assert!(
            said.is_ok(),
            "no GOAWAY {:?} after the answer",
            answered_at.elapsed()
        );
        server.abort();
    }

    /// A connection that has asked nothing (only the HTTP/2 preface) holds
    /// its slot for the head timeout at most, not the idle limit: without a
    /// token, anyone who reaches the listener could otherwise hold every
    /// slot for the idle limit.
    #[tokio::test]
    async fn a_connection_that_asks_nothing_ends_within_the_head_timeout() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let server = tokio::spawn(serve_at_most(
            listener,
            ("test", 4, Duration::from_secs(600)),
            |_: Request<Incoming>| async move { text(StatusCode::OK, "ok".to_owned()) },
        ));
        let mut h2 = tokio::net::TcpStream::connect(addr).await.expect("connect");
        h2.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
            .await
            .expect("preface");
        let started = std::time::Instant::now();
        // Its GOAWAY (type 7) comes once the head timeout is past.
        let goaway = async {
            let mut got = Vec::new();
            let mut buf = [0u8; 1024];
            while !got
                .windows(4)
                .any(|w: &[u8]| w[3] == 7 && w[..3] == [0, 0, 8])
            {
                let n = h2.read(&mut buf).await.expect("read");
                assert!(n > 0, "closed without a GOAWAY: {got:?}");
                got.extend_from_slice(&buf[..n]);
            }
        };
        let within = HEAD_TIMEOUT + Duration::from_secs(3);
        let said = tokio::time::timeout(within, goaway).await;
        assert!(said.is_ok(), "no GOAWAY after {:?}", started.elapsed());
        server.abort();
    }

    /// A graceful stop answers the request in flight, then ends: the
    /// listener takes no connection after it.
    #[tokio::test]
    async fn a_stop_answers_the_requests_in_flight() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let stop = std::sync::Arc::new(tokio::sync::Notify::new());
        let told = stop.clone();
        let server = tokio::spawn(serve_until(
            listener,
            "test",
            |_: Request<Incoming>| async move {
                tokio::time::sleep(Duration::from_millis(500)).await;
                text(StatusCode::OK, "finished".to_owned())
            },
            async move { told.notified().await },
        ));
        let mut c = tokio::net::TcpStream::connect(addr).await.expect("connect");
        c.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .expect("write");
        tokio::time::sleep(Duration::from_millis(100)).await;
        stop.notify_one();
        let mut got = String::new();
        let read = tokio::time::timeout(Duration::from_secs(10), c.read_to_string(&mut got));
        read.await.expect("in time").expect("read");
        assert!(
            got.starts_with("HTTP/1.1 200") && got.ends_with("finished"),
            "{got}"
        );
        tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .expect("the loop ended")
            .expect("join");
        assert!(
            tokio::net::TcpStream::connect(addr).await.is_err(),
            "closed"
        );
    }

    /// A listener's loop taken down (a drain) takes its connections with it:
    /// a keep-alive connection that was served is closed, not served on.
    #[tokio::test]
    async fn connections_end_with_their_listener() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let server = tokio::spawn(serve(listener, "test", |_: Request<Incoming>| async move {
            text(StatusCode::OK, "ok".to_owned())
        }));
        let mut c = tokio::net::TcpStream::connect(addr).await.expect("connect");
        c.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .expect("write");
        let mut buf = [0u8; 1024];
        let n = tokio::time::timeout(Duration::from_secs(10), c.read(&mut buf))
            .await
            .expect("in time")
            .expect("read");
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "served");
        server.abort();
        let _ = server.await;
        let after = tokio::time::timeout(Duration::from_secs(5), c.read(&mut buf))
            .await
            .expect("closed in time");
        assert!(matches!(after, Ok(0) | Err(_)), "closed: {after:?}");
    }
}
