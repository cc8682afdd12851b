//! Failures after the verdict, counted by whose fault they were:
//! `egress_flow_errors_total{side, kind}`.

use std::net::SocketAddr;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::*;

const H1: &[&[u8]] = &[b"http/1.1"];

/// `egress_flow_errors_total{side, kind}`.
async fn errors(e: &Env, side: &str, kind: &str) -> u64 {
    value(
        e,
        &format!("egress_flow_errors_total{{side=\"{side}\",kind=\"{kind}\"}}"),
    )
    .await
}

#[tokio::test]
async fn failures_after_the_verdict_are_counted_by_whose_fault_they_were() {
    let e = env(Options::default()).await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(r#"{"default": "allow", "tls_interception": "on"}"#),
    );
    for (side, kind) in [
        ("upstream", "tls_verify"),
        ("upstream", "connect_refused"),
        ("client", "tls_handshake"),
    ] {
        assert_eq!(errors(&e, side, kind).await, 0, "{side}/{kind} before");
    }

    // The origin's certificate does not verify: the upstream's fault.
    let (tls, _) = e
        .tls(SANDBOX_A, e.origins.wrong_cert, "api.example.test", H1)
        .await
        .expect("handshake");
    let (status, _) = http_get(tls, false, "api.example.test", "/")
        .await
        .expect("answer");
    assert_eq!(status, 502);
    assert_eq!(errors(&e, "upstream", "tls_verify").await, 1);

    // Nothing listens at the destination: the upstream refused.
    let closed: SocketAddr = {
        let l = tokio::net::TcpListener::bind((API_IP, 0))
            .await
            .expect("bind");
        l.local_addr().expect("addr")
    };
    let (tls, _) = e
        .tls(SANDBOX_A, closed, "api.example.test", H1)
        .await
        .expect("the gateway terminates TLS first");
    let (status, body) = http_get(tls, false, "api.example.test", "/")
        .await
        .expect("answer");
    assert_eq!(status, 502, "{body}");
    assert_eq!(errors(&e, "upstream", "connect_refused").await, 1);

    // A client that does not trust the gateway's CA aborts the handshake:
    // the client's side.
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls::pki_types::CertificateDer::pem_slice_iter(e.origin_ca.cert_pem.as_bytes()) {
        roots.add(c.expect("pem")).expect("origin CA");
    }
    let config = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = e.connect(SANDBOX_A, e.origins.api).await;
    let name = ServerName::try_from("api.example.test").expect("name");
    let refused = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
        .connect(name, tcp)
        .await;
    assert!(refused.is_err(), "the client refuses the minted leaf");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while errors(&e, "client", "tls_handshake").await == 0 {
        assert!(std::time::Instant::now() < deadline, "not counted");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // Nothing was blamed on the wrong side.
    assert_eq!(errors(&e, "upstream", "tls_verify").await, 1);
    assert_eq!(errors(&e, "upstream", "connect_refused").await, 1);
}

/// Whether the gateway closed (or reset) `s` within `within`.
async fn closed_within<S: tokio::io::AsyncRead + Unpin>(
    s: &mut S,
    within: std::time::Duration,
) -> bool {
    let mut buf = [0u8; 256];
    let read = async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    tokio::time::timeout(within, read).await.is_ok()
}

/// One sandbox holding connections it never uses takes its share of the
/// slots, not all of them: its next one is reset and counted, and another
/// sandbox's request still goes through.
#[tokio::test]
async fn a_sandbox_holds_its_share_of_the_slots_and_another_still_connects() {
    use std::time::Duration;
    let e = env(Options {
        max_connections: 128,
        ..Options::default()
    })
    .await;
    let open = policy(r#"{"default": "allow", "tls_interception": "on"}"#);
    e.sandbox("a", SANDBOX_A, open.clone());
    e.sandbox("b", SANDBOX_B, open);
    // Half of 128 while it is the only source holding slots.
    let mut silent = Vec::new();
    for _ in 0..64 {
        silent.push(e.connect(SANDBOX_A, e.origins.api).await);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut over = e.connect(SANDBOX_A, e.origins.api).await;
    assert!(
        closed_within(&mut over, Duration::from_millis(500)).await,
        "past its share: reset at accept"
    );
    assert_eq!(value(&e, "egress_connections_over_share_total").await, 1);
    assert_eq!(value(&e, "egress_connections_over_limit_total").await, 0);
    let (tls, _) = e
        .tls(SANDBOX_B, e.origins.api, "api.example.test", H1)
        .await
        .expect("the other sandbox finds a slot");
    let (status, _) = http_get(tls, false, "api.example.test", "/")
        .await
        .expect("request");
    assert_eq!(status, 200);
    drop(silent);
}

#[tokio::test]
async fn slow_clients_are_closed_at_the_timeouts_and_the_limit_resets_new_ones() {
    use std::time::{Duration, Instant};
    let e = env(Options {
        peek: "500ms",
        request_head: "700ms",
        max_connections: 8,
        ..Options::default()
    })
    .await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(r#"{"default": "allow", "tls_interception": "on"}"#),
    );
    // Eight silent connections hold every slot...
    let mut silent = Vec::new();
    for _ in 0..8 {
        silent.push(e.connect(SANDBOX_A, e.origins.api).await);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    // ...so the ninth is reset at once, and counted.
    let mut ninth = e.connect(SANDBOX_A, e.origins.api).await;
    assert!(
        closed_within(&mut ninth, Duration::from_millis(500)).await,
        "over the limit: reset at accept"
    );
    assert_eq!(value(&e, "egress_connections_over_limit_total").await, 1);
    // The peek timeout closes the silent ones and frees their slots.
    for s in &mut silent {
        assert!(
            closed_within(s, Duration::from_secs(3)).await,
            "closed at timeouts.peek"
        );
    }
    drop(silent);

    // Slow-loris on the request head after termination: a head trickled a
    // byte at a time is cut at timeouts.request_head.
    let (mut tls, _) = e
        .tls(SANDBOX_A, e.origins.api, "api.example.test", H1)
        .await
        .expect("a slot is free again");
    tls.write_all(b"GET / HTTP/1.1\r\nHost: api.example.test\r\n")
        .await
        .expect("write");
    let started = Instant::now();
    let trickle = async {
        for b in b"X-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa" {
            if tls.write_all(&[*b]).await.is_err() || tls.flush().await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), trickle)
        .await
        .expect("the trickle ends: the gateway closed the connection");
    assert!(
        closed_within(&mut tls, Duration::from_secs(3)).await,
        "closed at the head timeout"
    );
    assert!(
        started.elapsed() < Duration::from_millis(4_000),
        "a 45-byte trickle at 100 ms a byte would take 4.5 s"
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    while errors(&e, "client", "head_timeout").await == 0 {
        assert!(Instant::now() < deadline, "head_timeout not counted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Eight peek timeouts and the head timeout (the reset at accept has no line).
    let lines = e.flow_lines(9).await;
    assert!(
        lines.iter().any(|l| l["error"] == "head_timeout"),
        "{lines:?}"
    );

    // Healthy: a whole request is served.
    let (tls, _) = e
        .tls(SANDBOX_A, e.origins.api, "api.example.test", H1)
        .await
        .expect("handshake");
    let (status, _) = http_get(tls, false, "api.example.test", "/")
        .await
        .expect("answer");
    assert_eq!(status, 200);
}

/// After the handshake, a client that sends nothing, or a part of the
/// HTTP/2 preface, is closed at `timeouts.request_head`: the sniff that
/// tells HTTP/2 from HTTP/1.1 waits for a head's first bytes. Before, it
/// was held to `timeouts.idle` (10 s here).
#[tokio::test]
async fn a_client_silent_after_the_handshake_is_closed_at_the_head_timeout() {
    let e = env(Options {
        request_head: "700ms",
        ..Options::default()
    })
    .await;
    let intercepted = r#"{"default": "allow", "tls_interception": "on"}"#;
    e.sandbox("a", SANDBOX_A, policy(intercepted));
    for first in [&b""[..], b"PRI * HT"] {
        let (mut tls, _) = e
            .tls(SANDBOX_A, e.origins.api, "api.example.test", &[b"h2"])
            .await
            .expect("handshake");
        tls.write_all(first).await.expect("write");
        tls.flush().await.expect("flush");
        let closed = closed_within(&mut tls, std::time::Duration::from_secs(5)).await;
        assert!(closed, "{first:?}: closed at the head timeout");
    }
}

/// A preface sent slowly (a pause past a tick of the connection's watch
/// in the middle of it) is HTTP/2 all the same. Before, the sniff was
/// begun again at each tick and lost what it had read: the rest was read
/// as HTTP/1.1.
#[tokio::test]
async fn a_preface_sent_slowly_is_still_http2() {
    let e = env(Options::default()).await;
    let intercepted = r#"{"default": "allow", "tls_interception": "on"}"#;
    e.sandbox("a", SANDBOX_A, policy(intercepted));
    let (mut tls, _) = e
        .tls(SANDBOX_A, e.origins.api, "api.example.test", &[b"h2"])
        .await
        .expect("handshake");
    let preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    tls.write_all(&preface[..8]).await.expect("write");
    tls.flush().await.expect("flush");
    tokio::time::sleep(std::time::Duration::from_millis(700)).await;
    // The rest, an empty SETTINGS, and a GET of `/` on stream 1 (HEADERS,
    // END_STREAM | END_HEADERS: :method GET, :scheme https, :path /,
    // :authority api.example.test).
    let mut rest = preface[8..].to_vec();
    rest.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
    let authority = b"api.example.test";
    let block_len = 3 + 2 + authority.len();
    rest.extend_from_slice(&[0, 0, block_len as u8, 1, 5, 0, 0, 0, 1, 0x82, 0x87, 0x84]);
    rest.extend_from_slice(&[0x41, authority.len() as u8]);
    rest.extend_from_slice(authority);
    tls.write_all(&rest).await.expect("write");
    tls.flush().await.expect("flush");
    let answered = async {
        loop {
            let mut head = [0u8; 9];
            tls.read_exact(&mut head).await.expect("a frame");
            assert_ne!(&head[..5], b"HTTP/", "read as HTTP/1.1");
            let len = usize::from(head[1]) << 8 | usize::from(head[2]);
            let mut payload = vec![0u8; len];
            tls.read_exact(&mut payload).await.expect("its payload");
            if head[3] == 1 && head[5..9] == [0, 0, 0, 1] {
                return;
            }
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(5), answered)
        .await
        .expect("stream 1 answered");
}
