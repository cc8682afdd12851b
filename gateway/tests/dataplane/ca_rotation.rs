//! The interception CA replaced under a running gateway (what SIGHUP does):
//! open connections carry on under the old CA, new handshakes get leaves
//! under the new one, and a broken replacement leaves the CA in service.

use std::path::Path;
use std::sync::Arc;

use egress_certs::CertificateAuthority;
use egress_gateway::CaReload;
use hyper_util::rt::TokioIo;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::net::TcpStream;

use crate::harness::*;

type Tls = tokio_rustls::client::TlsStream<TcpStream>;

/// A sandbox client trusting `ca` and nothing else.
fn trusting(ca: &CertificateAuthority) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.cert_der().clone()).expect("root");
    let mut c = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    c.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(c)
}

/// An intercepted TLS connection to the API origin, verified with `client`.
async fn handshake(e: &Env, client: Arc<rustls::ClientConfig>) -> std::io::Result<Tls> {
    let tcp = e.connect(SANDBOX_A, e.origins.api).await;
    let name = ServerName::try_from("api.example.test").expect("name");
    tokio_rustls::TlsConnector::from(client)
        .connect(name, tcp)
        .await
}

fn served_ca(tls: &Tls) -> CertificateDer<'static> {
    tls.get_ref().1.peer_certificates().expect("chain")[1].clone()
}

/// Copies `from`'s `ca.crt` and `ca.key` over `to`'s.
fn install(from: &Path, to: &Path) {
    for file in ["ca.crt", "ca.key"] {
        std::fs::copy(from.join(file), to.join(file)).expect("copy");
    }
}

#[tokio::test]
async fn a_replaced_ca_serves_new_handshakes_while_open_connections_carry_on() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let a = CertificateAuthority::create(&tmp.path().join("a")).expect("CA A");
    let b = CertificateAuthority::create(&tmp.path().join("b")).expect("CA B");
    let live = tmp.path().join("live");
    std::fs::create_dir(&live).expect("dir");
    install(&tmp.path().join("a"), &live);
    let e = env(Options {
        ca_files: Some((live.join("ca.crt"), live.join("ca.key"))),
        ..Options::default()
    })
    .await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(r#"{"allow": [{"cidr": "127.0.0.0/24"}], "tls_interception": "on"}"#),
    );

    // Under A: a connection that stays open across the rotation.
    let old = handshake(&e, trusting(&a)).await.expect("A is in service");
    assert_eq!(&served_ca(&old), a.cert_der());
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(old))
        .await
        .expect("http/1.1");
    tokio::spawn(conn);
    let (status, body) = get_on(&mut sender, "api.example.test", "/before").await;
    assert_eq!(status, 200, "{body}");

    install(&tmp.path().join("b"), &live);
    let reloaded = e.gateway.ca_reloader().reload().expect("B loads");
    assert_eq!(
        reloaded,
        CaReload::Replaced {
            subject: b.subject().to_owned(),
            fingerprint: b.fingerprint().to_owned(),
        }
    );

    // (1) The open connection still carries a request and its response.
    let (status, body) = get_on(&mut sender, "api.example.test", "/after").await;
    assert_eq!(status, 200, "{body}");
    assert!(body.starts_with("origin=api GET /after"), "{body}");

    // (2) New handshakes: leaves under B; a client trusting only A fails.
    assert!(
        handshake(&e, trusting(&a)).await.is_err(),
        "a client trusting only A refuses the new leaf"
    );
    let new = handshake(&e, trusting(&b)).await.expect("B verifies");
    assert_eq!(&served_ca(&new), b.cert_der());
    let (status, _) = http_get(new, false, "api.example.test", "/new")
        .await
        .expect("request");
    assert_eq!(status, 200);

    // (3) A broken replacement (A's certificate beside B's key): B stays.
    std::fs::copy(tmp.path().join("a/ca.crt"), live.join("ca.crt")).expect("copy");
    let err = e
        .gateway
        .ca_reloader()
        .reload()
        .expect_err("the key does not match");
    let shown = err.to_string();
    assert!(
        shown.contains(live.join("ca.crt").to_str().expect("utf-8")),
        "{shown}"
    );
    assert!(shown.contains("does not belong"), "{shown}");
    assert_eq!(e.gateway.ca().fingerprint(), b.fingerprint());
    let still = handshake(&e, trusting(&b))
        .await
        .expect("B still in service");
    assert_eq!(&served_ca(&still), b.cert_der());

    assert_eq!(
        value(&e, r#"egress_tls_ca_reloads_total{result="ok"}"#).await,
        1
    );
    assert_eq!(
        value(&e, r#"egress_tls_ca_reloads_total{result="error"}"#).await,
        1
    );
    let not_after = u64::try_from(b.not_after().unix_timestamp()).expect("after 1970");
    assert_eq!(
        value(&e, "egress_tls_ca_not_after_seconds").await,
        not_after
    );
    assert_eq!(value(&e, "egress_tls_leaf_keys_total").await, 2);
}
