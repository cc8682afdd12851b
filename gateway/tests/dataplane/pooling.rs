//! Upstream HTTP/1.1 connections are pooled per sandbox, destination and
//! verified name, and a client connection keeps one only while it is busy:
//! after a quarter second without a byte it gives it back, so an idle client
//! connection pins none. And each request reaches the origin in the client's
//! own protocol.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};

use crate::harness::*;

const CONNECTS: &str = "egress_upstream_connect_seconds_count";
const POOLED: &str = "egress_upstream_pooled_connections";

/// Waits (at most 10 s) until the pool holds `n` connections: a client
/// connection gives its upstream connection back a quarter to half a second after
/// its last byte.
async fn pooled(e: &Env, n: u64) {
    for _ in 0..100 {
        if value(e, POOLED).await == n {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    panic!("the pool holds {}, not {n}", value(e, POOLED).await);
}

#[tokio::test]
async fn an_idle_client_connection_pins_no_upstream_connection() {
    let e = intercepting(&["h1.example.test"]).await;

    let mut first = h1_client(&e).await;
    let (status, body) = get_on(&mut first, "h1.example.test", "/one").await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("origin=h1 GET /one"), "{body}");
    let opened = value(&e, CONNECTS).await;
    assert_eq!(opened, 1, "one upstream connection so far");

    // The first client connection stays open and idle: its upstream
    // connection goes back to the pool, and a second client connection of
    // the same sandbox takes it.
    pooled(&e, 1).await;
    let mut second = h1_client(&e).await;
    let (status, body) = get_on(&mut second, "h1.example.test", "/two").await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("origin=h1 GET /two"), "{body}");
    assert_eq!(
        value(&e, CONNECTS).await,
        opened,
        "the second client connection reused the pooled upstream connection"
    );

    // Both now idle; the first asks again and takes it back.
    pooled(&e, 1).await;
    let (status, body) = get_on(&mut first, "h1.example.test", "/three").await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("origin=h1 GET /three"), "{body}");
    assert_eq!(value(&e, CONNECTS).await, opened);

    // A response abandoned before its end: its connection must not carry
    // another request (the rest of the body would be read as the answer).
    pooled(&e, 1).await;
    let mut third = h1_client(&e).await;
    third.ready().await.expect("ready");
    let req = hyper::Request::builder()
        .uri("/bytes/8388608")
        .header("host", "h1.example.test")
        .body(Full::new(Bytes::new()))
        .expect("request");
    let resp = third.send_request(req).await.expect("response head");
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let frame = body.frame().await.expect("a first frame").expect("data");
    assert!(frame.is_data());
    assert_eq!(
        value(&e, CONNECTS).await,
        opened,
        "the third took the pooled one"
    );
    drop((body, third));
    for path in ["/four", "/five"] {
        let (status, text) = get_on(&mut second, "h1.example.test", path).await;
        assert_eq!(status, 200, "{text}");
        assert!(text.contains(&format!("origin=h1 GET {path} ")), "{text}");
    }
    assert_eq!(
        value(&e, CONNECTS).await,
        opened + 1,
        "the abandoned response's connection was not reused; one new connection, then pooled"
    );
}

#[tokio::test]
async fn requests_reach_the_origin_in_the_clients_protocol() {
    let e = intercepting(&["api.example.test"]).await;
    // The origin offers h2 and HTTP/1.1; each client gets its own protocol.
    for (alpn, h2, version) in [
        (&[&b"http/1.1"[..]][..], false, "HTTP/1.1"),
        (&[&b"h2"[..]][..], true, "HTTP/2.0"),
        (&[&b"http/1.1"[..]][..], false, "HTTP/1.1"),
    ] {
        let (tls, minted) = e
            .tls(SANDBOX_A, e.origins.api, "api.example.test", alpn)
            .await
            .expect("handshake");
        assert!(minted, "intercepted");
        let (status, body) = http_get(tls, h2, "api.example.test", "/p")
            .await
            .expect("request");
        assert_eq!(status, 200, "{body}");
        assert!(
            body.contains(&format!("version={version}")),
            "{version}: {body}"
        );
    }
}

#[tokio::test]
async fn large_bodies_cross_an_http2_origin_connection_both_ways() {
    let e = intercepting(&["api.example.test"]).await;
    let mut s = intercepted_h2(&e, e.origins.api, "api.example.test").await;
    // More than the origin connection's windows (2 MiB a stream, 5 MiB the
    // connection): it arrives whole only if the gateway gives the windows
    // back as it passes the bytes on.
    let n = 6 * 1024 * 1024;
    let req = hyper::Request::get(format!("https://api.example.test/bytes/{n}"))
        .body(Full::new(Bytes::new()))
        .expect("request");
    let resp = s.send_request(req).await.expect("GET");
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    assert_eq!(body.len(), n, "the whole response");
    assert!(body.iter().all(|&b| b == b'x'));
    // A request body larger than the origin's stream window: sent on in
    // pieces as the origin opens it, and echoed whole.
    let up = 3 * 1024 * 1024;
    let req = hyper::Request::post("https://api.example.test/echo")
        .body(Full::new(Bytes::from(vec![b'y'; up])))
        .expect("request");
    let resp = s.send_request(req).await.expect("POST");
    assert_eq!(resp.status(), 200);
    let text = resp.into_body().collect().await.expect("body").to_bytes();
    let text = String::from_utf8_lossy(&text);
    let (head, echoed) = text.split_once("body=").expect("an echo");
    assert!(
        head.contains("POST /echo") && head.contains("version=HTTP/2.0"),
        "the origin saw an HTTP/2 POST: {head}"
    );
    assert_eq!(echoed.len(), up, "the whole request body");
    assert!(echoed.bytes().all(|b| b == b'y'));
}

#[tokio::test]
async fn after_an_origins_goaway_new_requests_take_a_new_connection() {
    let e = intercepting(&["goaway.example.test"]).await;
    let s = intercepted_h2(&e, e.origins.goaway, "goaway.example.test").await;
    let get = |path: &'static str| send(&s, http::Method::GET, path);
    // A request still in flight keeps the first origin connection open...
    let slow = tokio::spawn(get("/slow"));
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    // ...after the origin has said GOAWAY on it.
    assert_eq!(get("/fast").await, (200, "conn=1".to_owned()));
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    assert_eq!(
        get("/next").await,
        (200, "conn=2".to_owned()),
        "a request after the GOAWAY goes out on a new connection, not a 502"
    );
    assert_eq!(
        slow.await.expect("slow"),
        (200, "conn=1".to_owned()),
        "the stream in flight finishes on the old one"
    );
}

#[tokio::test]
async fn requests_an_origin_refused_unprocessed_are_sent_again() {
    let e = intercepting(&["goaway.example.test"]).await;
    let s = intercepted_h2(&e, e.origins.goaway, "goaway.example.test").await;
    // While the origin holds /hold, a GET and a DELETE go out on the same
    // origin connection; its GOAWAY then refuses both, unprocessed.
    let hold = tokio::spawn(send(&s, http::Method::GET, "/hold"));
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    let get = tokio::spawn(send(&s, http::Method::GET, "/next"));
    let delete = tokio::spawn(send(&s, http::Method::DELETE, "/gone"));
    assert_eq!(
        get.await.expect("get"),
        (200, "conn=2".to_owned()),
        "a bodyless GET is sent again on a new connection, not answered 502"
    );
    let (status, body) = delete.await.expect("delete");
    assert_eq!(status, 502, "a DELETE is not sent again: {body}");
    // The stream the GOAWAY names as processed is not sent again: the
    // origin had it when the connection closed.
    let (status, body) = hold.await.expect("hold");
    assert_eq!(status, 502, "{body}");
    assert_eq!(value(&e, "egress_upstream_retries_total").await, 1);
}

/// A bodyless request to the GOAWAY origin on `s`, run on its own task: the
/// status and the body.
fn send(
    s: &hyper::client::conn::http2::SendRequest<Full<Bytes>>,
    method: http::Method,
    path: &str,
) -> impl std::future::Future<Output = (u16, String)> + Send + 'static {
    let (s, uri) = (s.clone(), format!("https://goaway.example.test{path}"));
    async move {
        let (head, body) = h2_send(&s, method, &uri).await;
        (head.status.as_u16(), body)
    }
}

/// An HTTPS origin (HTTP/1.1) at `PAUSE_IP` that notes how each connection's
/// handshake went, and answers one request with `connection: close`.
async fn resuming_origin(
    e: &Env,
) -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::Mutex<Vec<rustls::HandshakeKind>>>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let kinds = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = kinds.clone();
    let config = e.origin_ca.server(&["pause.example.test"], &[b"http/1.1"]);
    let addr = tls_origin(PAUSE_IP, config, move |mut tls| {
        let seen = seen.clone();
        async move {
            let kind = tls.get_ref().1.handshake_kind().expect("handshaken");
            seen.lock().expect("lock").push(kind);
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") {
                match tls.read(&mut byte).await {
                    Ok(1) => head.push(byte[0]),
                    _ => return,
                }
            }
            let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok";
            let _ = tls.write_all(answer).await;
            let _ = tls.shutdown().await;
        }
    })
    .await;
    (addr, kinds)
}

/// A session the gateway got on one sandbox's connection to an origin is
/// resumed by that sandbox's next connection, never by another sandbox's:
/// one ticket would let the origin link the two tenants.
#[tokio::test]
async fn upstream_tls_sessions_are_resumed_only_by_their_own_sandbox() {
    const NAME: &str = "pause.example.test";
    let e = intercepting(&[NAME]).await;
    e.sandbox("b", SANDBOX_B, intercepting_policy(&[NAME]));
    e.resolve(SANDBOX_B, &format!("{NAME}.")).await;
    let (origin, kinds) = resuming_origin(&e).await;
    for src in [SANDBOX_A, SANDBOX_A, SANDBOX_B] {
        let (tls, minted) = e
            .tls(src, origin, NAME, &[b"http/1.1"])
            .await
            .expect("handshake");
        assert!(minted, "intercepted");
        let (status, body) = http_get(tls, false, NAME, "/").await.expect("request");
        assert_eq!((status, body.as_str()), (200, "ok"), "{src}");
    }
    use rustls::HandshakeKind::{Full, Resumed};
    assert_eq!(*kinds.lock().expect("lock"), [Full, Resumed, Full]);
}

/// An HTTP/1.1 origin on `H1_ONLY_IP` (another port) that answers the
/// first request of each connection (`conn=<n>`) and closes the connection
/// when the second comes, without an answer: a keep-alive connection the
/// origin closes just as it is used again.
async fn closing_origin(e: &Env) -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let config = e.origin_ca.server(&["h1.example.test"], &[b"http/1.1"]);
    let conns = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    tls_origin(H1_ONLY_IP, config, move |mut tls| {
        let n = conns.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        async move {
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            for answered in [false, true] {
                head.clear();
                while !head.ends_with(b"\r\n\r\n") {
                    if tls.read(&mut byte).await.unwrap_or(0) == 0 {
                        return;
                    }
                    head.push(byte[0]);
                }
                if answered {
                    return;
                }
                let body = format!("conn={n}");
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                let _ = tls.write_all(answer.as_bytes()).await;
            }
        }
    })
    .await
}

/// A bodyless GET on an HTTP/1.1 connection the origin closes as it is
/// used again is sent once more on another: the client gets its answer,
/// not a 502.
#[tokio::test]
async fn a_get_on_a_connection_the_origin_closes_is_sent_again() {
    let e = intercepting(&["h1.example.test"]).await;
    let origin = closing_origin(&e).await;
    let (tls, minted) = e
        .tls(SANDBOX_A, origin, "h1.example.test", &[b"http/1.1"])
        .await
        .expect("handshake");
    assert!(minted);
    let (mut h1, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
        .await
        .expect("http/1.1");
    tokio::spawn(conn);
    assert_eq!(
        get_on(&mut h1, "h1.example.test", "/one").await,
        (200, "conn=1".into())
    );
    assert_eq!(
        get_on(&mut h1, "h1.example.test", "/two").await,
        (200, "conn=2".into())
    );
    // A GET whose `_method` names another method is no request to repeat:
    // the origin may have acted on it.
    let (status, body) = get_on(&mut h1, "h1.example.test", "/three?_method=POST").await;
    assert_eq!(status, 502, "{body}");
}

/// A client connection that opens a WebSocket gives back the upstream
/// connection its earlier requests held once the bridge starts (the
/// WebSocket has one of its own): another client connection's request
/// takes it from the pool. Before, the bridge kept it for its whole life,
/// idle, and the other client connection opened a new one.
#[tokio::test]
async fn a_websocket_gives_back_its_connections_pooled_upstream_connection() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let e = intercepting(&["h1.example.test"]).await;
    let mut tls = h1_tls(&e).await;
    tls.write_all(b"GET /one HTTP/1.1\r\nHost: h1.example.test\r\n\r\n")
        .await
        .expect("request");
    let head = crate::verdicts::read_head(&mut tls).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .and_then(|n| n.trim().parse().ok())
        .expect("a length");
    tls.read_exact(&mut vec![0u8; len]).await.expect("body");
    // At once, before a lull would give the upstream connection back.
    tls.write_all(b"GET /ws HTTP/1.1\r\nHost: h1.example.test\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n")
        .await
        .expect("upgrade");
    let head = crate::verdicts::read_head(&mut tls).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    tls.write_all(b"ping").await.expect("ping");
    let mut echo = [0u8; 4];
    tls.read_exact(&mut echo).await.expect("echo");
    assert_eq!(&echo, b"ping");
    let opened = value(&e, CONNECTS).await;
    assert_eq!(opened, 2, "the first request's, and the WebSocket's own");
    pooled(&e, 1).await;
    let mut other = h1_client(&e).await;
    let (status, body) = get_on(&mut other, "h1.example.test", "/two").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(value(&e, CONNECTS).await, opened, "the pooled one, taken");
}
