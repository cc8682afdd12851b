//! Failures after the verdict, counted by whose fault they were:
//! `egress_flow_errors_total{side, kind}`.

use std::net::SocketAddr;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::*;

const H1: &[&[u8]] = &[b"http/1.1"];

/// The counter for (side, kind) from `/metrics`.
async fn errors(e: &Env, side: &str, kind: &str) -> u64 {
    let mut s = tokio::net::TcpStream::connect(e.gateway.bound().admin)
        .await
        .expect("admin");
    s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n")
        .await
        .expect("write");
    let mut text = String::new();
    s.read_to_string(&mut text).await.expect("read");
    let series = format!("egress_flow_errors_total{{side=\"{side}\",kind=\"{kind}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(series.as_str()))
        .unwrap_or_else(|| panic!("no series {series} in:\n{text}"))
        .trim()
        .parse()
        .expect("a count")
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
