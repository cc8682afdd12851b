//! An origin that stops reading: the connection the gateway opened to it
//! ends once `timeouts.idle` passes with bytes it has not taken, after the
//! flow that opened it is gone. Without a bound, the connection's task (it
//! writes TLS's close_notify behind bytes the origin never takes) and its
//! socket would stay for good, outside every count.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::*;

const NAME: &str = "pause.example.test";

/// An HTTPS origin at `PAUSE_IP` with a small receive buffer that reads a
/// request's head and then nothing more, holding the connection for 60 s.
async fn stalled_origin(e: &Env) -> SocketAddr {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(2048).expect("rcvbuf");
    socket
        .bind(SocketAddr::new(PAUSE_IP.parse().expect("ip"), 0))
        .expect("bind");
    let listener = socket.listen(16).expect("listen");
    let addr = listener.local_addr().expect("addr");
    let acceptor = tokio_rustls::TlsAcceptor::from(e.origin_ca.server(&[NAME], &[b"http/1.1"]));
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    match tls.read(&mut byte).await {
                        Ok(1) => head.push(byte[0]),
                        _ => return,
                    }
                }
                tokio::time::sleep(Duration::from_secs(60)).await;
                drop(tls);
            });
        }
    });
    addr
}

/// The host's sockets (in any state but TIME_WAIT and LISTEN) whose far end
/// is `origin`: the gateway's side of its connections to it.
fn connections_to(origin: SocketAddr) -> usize {
    let port = format!(":{:04X}", origin.port());
    std::fs::read_to_string("/proc/net/tcp")
        .expect("/proc/net/tcp")
        .lines()
        .skip(1)
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 3 && f[2].ends_with(&port) && !matches!(f[3], "06" | "0A")
        })
        .count()
}

/// Waits up to `within` for `connections_to(origin)` to be `n`.
async fn until_connections(origin: SocketAddr, n: usize, within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    while connections_to(origin) != n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} connections to the origin after {within:?}, not {n}",
            connections_to(origin)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn the_connection_to_an_origin_that_stops_reading_ends_at_the_idle_timeout() {
    let e = env(Options {
        idle: "2s",
        ..Options::default()
    })
    .await;
    e.sandbox("a", SANDBOX_A, intercepting_policy(&[NAME]));
    e.resolve(SANDBOX_A, &format!("{NAME}.")).await;
    let origin = stalled_origin(&e).await;
    let (mut tls, minted) = e
        .tls(SANDBOX_A, origin, NAME, &[b"http/1.1"])
        .await
        .expect("handshake");
    assert!(minted, "intercepted");
    let body = vec![b'x'; 256 * 1024];
    let head = format!(
        "POST /up HTTP/1.1\r\nHost: {NAME}\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    tls.write_all(head.as_bytes()).await.expect("head");
    // As much of the body as the gateway takes in 3 s: the origin reads none.
    let _ = tokio::time::timeout(Duration::from_secs(3), tls.write_all(&body)).await;
    until_connections(origin, 1, Duration::from_secs(5)).await;
    drop(tls);
    // The flow ends at its idle timeout (2 s) at the latest; the connection
    // to the origin 2 s after its last byte was taken, and a probe's time.
    until_connections(origin, 0, Duration::from_secs(20)).await;
}
