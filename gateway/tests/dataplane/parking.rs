//! An intercepted HTTP/1.1 connection resting between requests is parked:
//! its parser and buffers are set aside until the client's next bytes. No
//! exchange is cut, no byte is lost, and the limits hold while it rests.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::harness::*;

const H1: &[&[u8]] = &[b"http/1.1"];
const PARKED: &str = "egress_parked_connections";

/// Waits (at most 6 s) for the parked gauge to read `n`.
async fn parked_becomes(e: &Env, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(6);
    loop {
        let now = value(e, PARKED).await;
        if now == n {
            return;
        }
        assert!(Instant::now() < deadline, "{PARKED} is {now}, not {n}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn an_idle_connection_is_parked_and_serves_its_next_request() {
    let e = intercepting(&["h1.example.test"]).await;
    let mut h1 = h1_client(&e).await;
    let (status, body) = get_on(&mut h1, "h1.example.test", "/one").await;
    assert_eq!((status, body.contains("GET /one")), (200, true), "{body}");
    parked_becomes(&e, 1).await;

    // Its next request wakes it, and is served.
    let (status, body) = get_on(&mut h1, "h1.example.test", "/two").await;
    assert_eq!((status, body.contains("GET /two")), (200, true), "{body}");
    parked_becomes(&e, 1).await;

    // After a request whose body was read to its end (the parser is past
    // it) the connection is parked too.
    h1.ready().await.expect("ready");
    let post = hyper::Request::post("/up")
        .header("host", "h1.example.test")
        .body(Full::new(Bytes::from_static(b"abc")))
        .expect("request");
    let resp = h1.send_request(post).await.expect("response");
    assert_eq!(resp.status(), 200);
    drop(resp);
    parked_becomes(&e, 1).await;
    let (status, body) = get_on(&mut h1, "h1.example.test", "/three").await;
    assert_eq!((status, body.contains("GET /three")), (200, true), "{body}");
    parked_becomes(&e, 1).await;

    // The client goes: the flow ends whole, with its four requests.
    drop(h1);
    parked_becomes(&e, 0).await;
    let lines = e.flow_lines(1).await;
    assert_eq!(lines[0]["requests"], 4, "{lines:?}");
    assert!(lines[0].get("error").is_none(), "{lines:?}");
}

/// An HTTPS origin for `pause.example.test` that answers `GET /pause` with
/// the first half of its body, then the rest 2.5 s later; `POST /early`
/// with `early` at once, reading no body; and anything else with `ok` at
/// once (HTTP/1.1, keep-alive, hand-written, heads only: a body's bytes are
/// read as the next head).
async fn pause_origin(e: &Env) -> SocketAddr {
    let config = e.origin_ca.server(&["pause.example.test"], &[b"http/1.1"]);
    tls_origin(PAUSE_IP, config, |mut tls| async move {
        while let Some(head) = read_head(&mut tls).await {
            if answer_pausing(&mut tls, &head).await.is_err() {
                return;
            }
        }
    })
    .await
}

async fn answer_pausing<S: AsyncWrite + Unpin>(s: &mut S, head: &str) -> std::io::Result<()> {
    if head.starts_with("POST /early ") {
        return s
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nearly")
            .await;
    }
    if !head.starts_with("GET /pause ") {
        return s
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            .await;
    }
    s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nfirst")
        .await?;
    s.flush().await?;
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    s.write_all(b"secnd").await?;
    s.flush().await
}

/// Reads one message head (to its blank line); `None` at the end.
async fn read_head<S: AsyncRead + Unpin>(s: &mut S) -> Option<String> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match s.read(&mut byte).await {
            Ok(1) => head.push(byte[0]),
            _ => return None,
        }
    }
    Some(String::from_utf8_lossy(&head).into_owned())
}

/// Reads one response with a `content-length` body: its status and body.
async fn read_response<S: AsyncRead + Unpin>(s: &mut S) -> (u16, String) {
    let head = tokio::time::timeout(Duration::from_secs(5), read_head(s))
        .await
        .expect("a response in time")
        .expect("a response head");
    let status = head[9..12].parse().expect("status");
    let length: usize = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|v| v.trim().to_owned())
        })
        .expect("content-length")
        .parse()
        .expect("length");
    let mut body = vec![0u8; length];
    s.read_exact(&mut body).await.expect("body");
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test]
async fn a_response_that_pauses_is_not_cut_by_a_park() {
    let e = intercepting(&["pause.example.test"]).await;
    let origin = pause_origin(&e).await;
    let (mut tls, minted) = e
        .tls(SANDBOX_A, origin, "pause.example.test", H1)
        .await
        .expect("handshake");
    assert!(minted, "intercepted");
    // Two requests in one write: the second's bytes are all read before the
    // first response ends, so only the open exchange says it is in flight.
    tls.write_all(
        b"GET /first HTTP/1.1\r\nHost: pause.example.test\r\n\r\n\
          GET /pause HTTP/1.1\r\nHost: pause.example.test\r\n\r\n",
    )
    .await
    .expect("write");
    assert_eq!(read_response(&mut tls).await, (200, "ok".to_owned()));
    let watch = async {
        // Late in the pause, past the second that parks a resting
        // connection, nothing is parked.
        tokio::time::sleep(Duration::from_millis(2_000)).await;
        value(&e, PARKED).await
    };
    let (got, parked_in_pause) = tokio::join!(read_response(&mut tls), watch);
    assert_eq!(got, (200, "firstsecnd".to_owned()), "the whole body");
    assert_eq!(parked_in_pause, 0, "not parked while the response was open");
    parked_becomes(&e, 1).await;
    tls.write_all(b"GET /next HTTP/1.1\r\nHost: pause.example.test\r\n\r\n")
        .await
        .expect("write");
    assert_eq!(read_response(&mut tls).await, (200, "ok".to_owned()));
}

#[tokio::test]
async fn a_request_body_still_coming_after_its_response_is_never_read_as_a_request() {
    let e = intercepting(&["pause.example.test"]).await;
    let origin = pause_origin(&e).await;
    let (mut tls, _) = e
        .tls(SANDBOX_A, origin, "pause.example.test", H1)
        .await
        .expect("handshake");
    // The origin answers `/early` without waiting for the body, so the
    // response ends while the parser is still in the body.
    let tail = b"GET /smuggled HTTP/1.1\r\nHost: pause.example.test\r\n\r\n";
    let head = format!(
        "POST /early HTTP/1.1\r\nHost: pause.example.test\r\ncontent-length: {}\r\n\r\nhello",
        5 + tail.len()
    );
    tls.write_all(head.as_bytes()).await.expect("write");
    assert_eq!(read_response(&mut tls).await, (200, "early".to_owned()));
    // Past a lull, then the rest of the body, which reads like a request.
    tokio::time::sleep(Duration::from_millis(2_200)).await;
    assert_eq!(value(&e, PARKED).await, 0, "in a body: not parked");
    tls.write_all(tail).await.expect("write");
    let mut more = [0u8; 64];
    let after = tokio::time::timeout(Duration::from_secs(1), tls.read(&mut more)).await;
    assert!(
        after.is_err(),
        "nothing answers the body's bytes: {:?}",
        after.map(|r| r.map(|n| String::from_utf8_lossy(&more[..n]).into_owned()))
    );
}

#[tokio::test]
async fn a_connection_rests_after_a_chunked_body_read_to_its_last_chunk() {
    let e = intercepting(&["h1.example.test"]).await;
    let (mut tls, _) = e
        .tls(SANDBOX_A, e.origins.h1_only, "h1.example.test", H1)
        .await
        .expect("handshake");
    tls.write_all(
        b"POST /chunked HTTP/1.1\r\nHost: h1.example.test\r\ntransfer-encoding: chunked\r\n\r\n\
          2\r\nab\r\n2\r\ncd\r\n0\r\n\r\n",
    )
    .await
    .expect("write");
    let (status, body) = read_response(&mut tls).await;
    assert_eq!(status, 200, "{body}");
    // The parser read the last chunk: the connection rests, and is parked.
    parked_becomes(&e, 1).await;
    tls.write_all(b"GET /after HTTP/1.1\r\nHost: h1.example.test\r\n\r\n")
        .await
        .expect("write");
    let (status, body) = read_response(&mut tls).await;
    assert_eq!((status, body.contains("GET /after")), (200, true), "{body}");
}

#[tokio::test]
async fn bytes_read_behind_a_request_are_read_again_by_the_next_parser() {
    let e = intercepting(&["h1.example.test"]).await;
    let (mut tls, _) = e
        .tls(SANDBOX_A, e.origins.h1_only, "h1.example.test", H1)
        .await
        .expect("handshake");
    // A request and the start of the next in one write: the parser reads
    // both, answers the first, and holds the start of the second.
    tls.write_all(b"GET /a HTTP/1.1\r\nHost: h1.example.test\r\n\r\nGET /b HTTP/1.1\r\nHo")
        .await
        .expect("write");
    let (status, body) = read_response(&mut tls).await;
    assert_eq!((status, body.contains("GET /a")), (200, true), "{body}");
    // Past a lull, when a connection with nothing in flight would be parked.
    tokio::time::sleep(Duration::from_millis(2_200)).await;
    assert_eq!(value(&e, PARKED).await, 0, "a head has begun: not parked");
    tls.write_all(b"st: h1.example.test\r\n\r\n")
        .await
        .expect("write");
    let (status, body) = read_response(&mut tls).await;
    assert_eq!((status, body.contains("GET /b")), (200, true), "{body}");

    // The same with the start of a head sent after the response.
    tokio::time::sleep(Duration::from_millis(100)).await;
    tls.write_all(b"GET /c HTTP/1.1\r\nHo")
        .await
        .expect("write");
    tokio::time::sleep(Duration::from_millis(2_200)).await;
    tls.write_all(b"st: h1.example.test\r\n\r\n")
        .await
        .expect("write");
    let (status, body) = read_response(&mut tls).await;
    assert_eq!((status, body.contains("GET /c")), (200, true), "{body}");
}

#[tokio::test]
async fn a_parked_connection_is_closed_at_the_head_timeout_and_by_a_drain() {
    let e = env(Options {
        request_head: "5s",
        idle: "30s",
        ..Options::default()
    })
    .await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(r#"{"allow": [{"domain": "h1.example.test"}], "tls_interception": "on"}"#),
    );
    e.resolve(SANDBOX_A, "h1.example.test.").await;
    // Parked after its request, it is closed once no head came for
    // `timeouts.request_head`, as hyper closes an idle keep-alive connection.
    let mut h1 = h1_client(&e).await;
    assert_eq!(get_on(&mut h1, "h1.example.test", "/one").await.0, 200);
    parked_becomes(&e, 1).await;
    assert!(
        h1_closed_within(&h1, Duration::from_secs(8)).await,
        "still open past the head timeout"
    );
    let lines = e.flow_lines(1).await;
    assert_eq!(lines[0]["error"], "head_timeout", "{lines:?}");

    // Parked when the drain starts, it is closed at once.
    let mut h1 = h1_client(&e).await;
    assert_eq!(get_on(&mut h1, "h1.example.test", "/two").await.0, 200);
    parked_becomes(&e, 1).await;
    let started = Instant::now();
    let Env { gateway, .. } = e;
    assert_eq!(gateway.run_until(async {}).await, 0, "no flow left open");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the drain took {:?}",
        started.elapsed()
    );
    assert!(
        h1_closed_within(&h1, Duration::from_secs(2)).await,
        "the parked connection was closed"
    );
}
