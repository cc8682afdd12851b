use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::ReadBuf;

use super::fixture::{hello, records};
use super::*;

/// Yields at most `step` bytes per read: a slow, segmented sender.
struct Trickle {
    data: Vec<u8>,
    pos: usize,
    step: usize,
}

impl AsyncRead for Trickle {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let n = self
            .step
            .min(self.data.len() - self.pos)
            .min(buf.remaining());
        let start = self.pos;
        buf.put_slice(&self.data[start..start + n]);
        self.pos += n;
        Poll::Ready(Ok(()))
    }
}

async fn run(data: Vec<u8>, step: usize) -> Result<(Classified, Vec<u8>), PeekError> {
    let mut t = Trickle { data, pos: 0, step };
    peek(&mut t, 16 * 1024, Duration::from_secs(5)).await
}

fn tls(sni: Option<&str>) -> Classified {
    Classified::Tls(ClientHello {
        sni: sni.map(str::to_owned),
        ..ClientHello::default()
    })
}

#[tokio::test]
async fn client_hello_in_one_record() {
    let bytes = records(
        &hello(Some("api.example.test"), &["h2", "http/1.1"], 0, false),
        16_384,
    );
    let (c, read) = run(bytes.clone(), 4096).await.expect("classified");
    assert_eq!(
        c,
        Classified::Tls(ClientHello {
            sni: Some("api.example.test".into()),
            early_data: false
        })
    );
    assert_eq!(read, bytes, "everything read is handed back for replay");
}

#[tokio::test]
async fn post_quantum_sized_hello_split_over_records_and_sent_byte_by_byte() {
    let hs = hello(Some("pq.example.test"), &["h2"], 1_800, true);
    assert!(hs.len() > 1_900);
    for (fragment, step) in [(100, 1), (16_384, 1), (7, 13), (1_000, 1_460)] {
        let bytes = records(&hs, fragment);
        let (c, read) = run(bytes.clone(), step).await.expect("classified");
        let Classified::Tls(ch) = c else {
            panic!("not TLS")
        };
        assert_eq!(
            ch.sni.as_deref(),
            Some("pq.example.test"),
            "fragment {fragment} step {step}"
        );
        assert!(ch.early_data);
        assert_eq!(read, bytes);
    }
}

#[tokio::test]
async fn hello_from_rustls_parses() {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    let mut config = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let name = rustls::pki_types::ServerName::try_from("real.example.test").expect("name");
    let mut conn = rustls::ClientConnection::new(Arc::new(config), name).expect("client");
    let mut bytes = Vec::new();
    conn.write_tls(&mut bytes).expect("hello");
    let (c, _) = run(bytes, 1).await.expect("classified");
    let Classified::Tls(ch) = c else {
        panic!("not TLS")
    };
    assert_eq!(ch.sni.as_deref(), Some("real.example.test"));
}

#[tokio::test]
async fn every_prefix_of_a_hello_waits_for_more() {
    let bytes = records(&hello(Some("a.test"), &[], 0, false), 50);
    for end in 0..bytes.len() {
        assert!(
            matches!(classify(&bytes[..end]), Ok(Step::NeedMore)),
            "prefix {end}"
        );
    }
    assert!(matches!(
        classify(&bytes),
        Ok(Step::Done(Classified::Tls(_)))
    ));
    assert_eq!(
        run(bytes[..bytes.len() - 1].to_vec(), 64).await,
        Err(PeekError::Closed)
    );
}

#[tokio::test]
async fn hello_without_sni_and_malformed_hellos() {
    assert_eq!(
        run(records(&hello(None, &[], 0, false), 16_384), 100)
            .await
            .map(|x| x.0),
        Ok(tls(None))
    );
    let mut not_hello = hello(Some("a.test"), &[], 0, false);
    not_hello[0] = 2;
    assert!(matches!(
        run(records(&not_hello, 16_384), 100).await,
        Err(PeekError::Malformed(_))
    ));
    let mut bad_len = records(&hello(Some("a.test"), &[], 0, false), 16_384);
    bad_len[3] = 0xff;
    bad_len[4] = 0xff;
    assert!(matches!(
        run(bad_len, 100).await,
        Err(PeekError::Malformed(_))
    ));
    let mut alert_between = records(&hello(Some("a.test"), &[], 0, false), 40);
    alert_between[45] = 0x15;
    assert!(matches!(
        run(alert_between, 100).await,
        Err(PeekError::Malformed(_))
    ));
}

#[tokio::test]
async fn hello_larger_than_the_limit_is_refused() {
    let bytes = records(&hello(Some("big.test"), &[], 12_000, false), 16_384);
    let mut t = Trickle {
        data: bytes,
        pos: 0,
        step: 1_000,
    };
    assert_eq!(
        peek(&mut t, 4_096, Duration::from_secs(5))
            .await
            .map(|x| x.0),
        Err(PeekError::TooLarge)
    );
}

#[tokio::test]
async fn http_request_heads() {
    let req = b"GET /x HTTP/1.1\r\nUser-Agent: t\r\nHOST: Api.Example.Test:8080\r\n\r\n".to_vec();
    let (c, read) = run(req.clone(), 3).await.expect("classified");
    assert_eq!(
        c,
        Classified::Http {
            host: Some("Api.Example.Test".into())
        }
    );
    assert_eq!(read, req);
    let (c, _) = run(b"POST / HTTP/1.0\r\n\r\n".to_vec(), 100)
        .await
        .expect("classified");
    assert_eq!(c, Classified::Http { host: None });
    let (c, _) = run(
        b"GET / HTTP/1.1\r\nHost: [2001:db8::1]:80\r\n\r\n".to_vec(),
        100,
    )
    .await
    .expect("classified");
    assert_eq!(
        c,
        Classified::Http {
            host: Some("2001:db8::1".into())
        }
    );
}

#[tokio::test]
async fn opaque_bytes_and_silence() {
    let (c, read) = run(b"SSH-2.0-OpenSSH_9.6\r\n".to_vec(), 100)
        .await
        .expect("classified");
    assert_eq!((c, read.len()), (Classified::Opaque, 21));
    let (c, _) = run(vec![0x00, 0x01, 0x02], 1).await.expect("classified");
    assert_eq!(c, Classified::Opaque);
    assert_eq!(run(vec![], 1).await, Err(PeekError::Closed));
    // A silent client is dropped at the timeout.
    let (mut client, _server) = tokio::io::duplex(64);
    let r = peek(&mut client, 1024, Duration::from_millis(50)).await;
    assert_eq!(r, Err(PeekError::Timeout));
}

#[test]
fn ports_are_stripped_from_authorities() {
    assert_eq!(strip_port("a.test:443"), "a.test");
    assert_eq!(strip_port("a.test"), "a.test");
    assert_eq!(strip_port("[2001:db8::1]:443"), "2001:db8::1");
    assert_eq!(strip_port("2001:db8::1"), "2001:db8::1");
    assert_eq!(strip_port("a.test:x"), "a.test:x");
}

proptest::proptest! {
    /// Arbitrary bytes never panic the classifier.
    #[test]
    fn classify_never_panics(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
        let _ = classify(&bytes);
        let mut tls = vec![0x16, 0x03, 0x01];
        tls.extend_from_slice(&bytes);
        let _ = classify(&tls);
    }
}
