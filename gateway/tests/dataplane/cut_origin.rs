//! An origin that dies in the middle of a response body: the intercepted
//! client must learn that the body is cut, over HTTP/1.1 and HTTP/2. A
//! response that ends cleanly there (a last chunk, an END_STREAM, or a TLS
//! close_notify after a body delimited by the close) would hand the client
//! part of a file as the whole of it.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::*;

const NAME: &str = "pause.example.test";

/// How the origin's answer breaks off, by the request's path.
const CUTS: &[&str] = &[
    // `content-length: 10`, five bytes, then TCP's FIN without close_notify.
    "/length-then-eof",
    // A body delimited by the close, five bytes, then TCP's FIN without
    // close_notify: a truncation TLS itself must catch.
    "/close-delimited-then-eof",
    // A body delimited by the close, five bytes, then a reset.
    "/close-delimited-then-reset",
];

/// An HTTPS origin (HTTP/1.1) at `PAUSE_IP` that answers each connection's
/// first request with a body cut as its path says.
async fn cutting_origin(e: &Env) -> SocketAddr {
    let config = e.origin_ca.server(&[NAME], &[b"http/1.1"]);
    tls_origin(PAUSE_IP, config, |mut tls| async move {
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            match tls.read(&mut byte).await {
                Ok(1) => head.push(byte[0]),
                _ => return,
            }
        }
        let head = String::from_utf8_lossy(&head).into_owned();
        let answer: &[u8] = if head.contains("/length-and-chunked ") {
            // Both framings: chunked wins (RFC 9112 6.3), ten bytes.
            b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\na\r\n0123456789\r\n0\r\n\r\n"
        } else if head.contains("/length-then-eof ") {
            b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nfirst"
        } else {
            b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nfirst"
        };
        let _ = tls.write_all(answer).await;
        let _ = tls.flush().await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (tcp, _) = tls.into_inner();
        if head.contains("-then-reset ") {
            let _ = socket2::SockRef::from(&tcp).set_linger(Some(Duration::ZERO));
        }
        // Dropped without close_notify: a FIN, or with linger 0 a reset.
        drop(tcp);
    })
    .await
}

/// What the client made of the cut body: `Err` if it saw the cut, `Ok`
/// with the body if the response looked whole.
async fn fetch(
    send: &mut hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    path: &str,
) -> Result<Bytes, String> {
    let req = hyper::Request::get(path)
        .header("host", NAME)
        .body(Full::new(Bytes::new()))
        .expect("request");
    let resp = send.send_request(req).await.map_err(|e| e.to_string())?;
    assert_eq!(resp.status(), 200, "the head came through before the cut");
    collect(resp).await
}

async fn collect(resp: hyper::Response<hyper::body::Incoming>) -> Result<Bytes, String> {
    tokio::time::timeout(Duration::from_secs(10), resp.into_body().collect())
        .await
        .expect("the body ends, one way or the other")
        .map(|b| b.to_bytes())
        .map_err(|e| format!("{e:?}"))
}

#[tokio::test]
async fn a_body_cut_at_the_origin_is_cut_for_an_http1_client() {
    let e = intercepting(&[NAME]).await;
    let origin = cutting_origin(&e).await;
    for path in CUTS {
        let (tls, minted) = e
            .tls(SANDBOX_A, origin, NAME, &[b"http/1.1"])
            .await
            .expect("handshake");
        assert!(minted, "intercepted");
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .expect("http/1.1");
        tokio::spawn(conn);
        let got = fetch(&mut send, path).await;
        assert!(
            got.is_err(),
            "{path}: the client took {got:?} for the whole body"
        );
    }
}

/// An origin's answer framed both ways (chunked and a `content-length`)
/// reaches the client framed by its chunks, the length dropped: passed on
/// with the length, its body would be cut to it. (Before: `012`.)
#[tokio::test]
async fn an_answer_framed_both_ways_goes_on_by_its_chunks() {
    let e = intercepting(&[NAME]).await;
    let origin = cutting_origin(&e).await;
    let (tls, _) = e
        .tls(SANDBOX_A, origin, NAME, &[b"http/1.1"])
        .await
        .expect("handshake");
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .expect("http/1.1");
    tokio::spawn(conn);
    let got = fetch(&mut send, "/length-and-chunked").await;
    assert_eq!(got.as_deref(), Ok(&b"0123456789"[..]), "{got:?}");
}

#[tokio::test]
async fn a_body_cut_at_the_origin_is_cut_for_an_http2_client() {
    let e = intercepting(&[NAME]).await;
    let origin = cutting_origin(&e).await;
    for path in CUTS {
        let (tls, minted) = e
            .tls(SANDBOX_A, origin, NAME, &[b"h2"])
            .await
            .expect("handshake");
        assert!(minted, "intercepted");
        let mut send = h2_client(tls).await;
        let req = hyper::Request::get(format!("https://{NAME}{path}"))
            .body(Full::new(Bytes::new()))
            .expect("request");
        let resp = send.send_request(req).await.expect("a head");
        assert_eq!(resp.status(), 200, "the head came through before the cut");
        let got = collect(resp).await;
        assert!(
            got.is_err(),
            "{path}: the client took {got:?} for the whole body"
        );
    }
}
