//! A spliced TLS flow past a HelloRetryRequest: the client's second
//! ClientHello is read before the flow runs unread, and one that names
//! another server than the first is refused (a server such as OpenSSL's
//! takes its name from the second). A real retry (an origin that takes
//! only secp256r1, which rustls' client does not offer a share of first)
//! goes through.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use egress_policy::SandboxId;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::harness::*;

/// An origin that answers any first bytes with a retry request.
const FAKE_IP: &str = "127.0.0.21";
/// A real TLS origin that takes only secp256r1.
const P256_IP: &str = "127.0.0.22";

/// The random of a HelloRetryRequest (RFC 8446 §4.1.3).
const HRR_RANDOM: [u8; 32] = [
    0xcf, 0x21, 0xad, 0x74, 0xe5, 0x9a, 0x61, 0x11, 0xbe, 0x1d, 0x8c, 0x02, 0x1e, 0x65, 0xb8, 0x91,
    0xc2, 0xa2, 0x11, 0x16, 0x7a, 0xbb, 0x8c, 0x5e, 0x07, 0x9e, 0x09, 0xe2, 0xc8, 0xa8, 0x33, 0x9c,
];

fn retry_request() -> Vec<u8> {
    let mut body = vec![0x03, 0x03];
    body.extend_from_slice(&HRR_RANDOM);
    body.extend_from_slice(&[0, 0x13, 0x01, 0]);
    body.extend_from_slice(&[0, 12, 0, 0x2b, 0, 2, 3, 4, 0, 0x33, 0, 2, 0, 0x17]);
    let mut message = vec![2, 0, 0, body.len() as u8];
    message.extend_from_slice(&body);
    let mut out = vec![0x16, 3, 3, 0, message.len() as u8];
    out.extend_from_slice(&message);
    out
}

/// A ClientHello naming `sni`, as rustls' client writes it.
fn client_hello(sni: &str) -> Vec<u8> {
    let config = rustls::ClientConfig::builder()
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    let name = ServerName::try_from(sni.to_owned()).expect("name");
    let mut c = rustls::ClientConnection::new(Arc::new(config), name).expect("client");
    let mut out = Vec::new();
    c.write_tls(&mut out).expect("hello");
    out
}

/// A retry request whose message carries `pad` bytes of a padding
/// extension, cut into records of at most 16 KiB.
fn padded_retry_request(pad: usize) -> Vec<u8> {
    let mut body = vec![0x03, 0x03];
    body.extend_from_slice(&HRR_RANDOM);
    body.extend_from_slice(&[0, 0x13, 0x01, 0]);
    let extensions = 12 + 4 + pad;
    body.extend_from_slice(&u16::try_from(extensions).expect("fits").to_be_bytes());
    body.extend_from_slice(&[0, 0x2b, 0, 2, 3, 4, 0, 0x33, 0, 2, 0, 0x17]);
    body.extend_from_slice(&[0, 0x15]);
    body.extend_from_slice(&u16::try_from(pad).expect("fits").to_be_bytes());
    body.resize(body.len() + pad, 0);
    let mut message = vec![2];
    message.extend_from_slice(&u32::try_from(body.len()).expect("fits").to_be_bytes()[1..]);
    message.extend_from_slice(&body);
    let mut out = Vec::new();
    for part in message.chunks(16 * 1024) {
        out.extend_from_slice(&[0x16, 3, 3]);
        out.extend_from_slice(&u16::try_from(part.len()).expect("fits").to_be_bytes());
        out.extend_from_slice(part);
    }
    out
}

/// The fake origin: answers the first bytes with a retry request, and
/// records everything it receives.
async fn retrying_origin() -> (SocketAddr, Arc<Mutex<Vec<u8>>>) {
    answering_origin(retry_request()).await
}

/// A fake origin that answers the first bytes with `answer`, and records
/// everything it receives.
async fn answering_origin(answer: Vec<u8>) -> (SocketAddr, Arc<Mutex<Vec<u8>>>) {
    answering_after(answer, Duration::ZERO).await
}

/// The same, answering `wait` after the first bytes came.
async fn answering_after(answer: Vec<u8>, wait: Duration) -> (SocketAddr, Arc<Mutex<Vec<u8>>>) {
    let answer = Arc::new(answer);
    let l = TcpListener::bind((FAKE_IP, 0)).await.expect("bind");
    let addr = l.local_addr().expect("addr");
    let got = Arc::new(Mutex::new(Vec::new()));
    let seen = got.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let (seen, answer) = (seen.clone(), answer.clone());
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let mut answered = false;
                while let Ok(n) = s.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    seen.lock().expect("lock").extend_from_slice(&buf[..n]);
                    if !answered {
                        answered = true;
                        tokio::time::sleep(wait).await;
                        if s.write_all(&answer).await.is_err() {
                            break;
                        }
                    }
                }
            });
        }
    });
    (addr, got)
}

/// A ServerHello that asks for no retry: the retry request's message with
/// another random.
fn server_hello() -> Vec<u8> {
    let mut out = retry_request();
    out[11..43].copy_from_slice(&[0x11; 32]);
    out
}

/// A flow cut (its sandbox deleted) while it waits for the server's first
/// message passes nothing more on: neither that message to the client nor
/// what the client sent after its hello (read with it by the peek) to the
/// origin. Both sides are reset, and the flow's line names the cut.
/// Before, both went on, up to the handshake's time after the cut.
#[tokio::test]
async fn a_flow_cut_before_the_servers_answer_passes_nothing_more() {
    let e = spliced_env().await;
    let (origin, got) = answering_after(server_hello(), Duration::from_millis(1500)).await;
    let mut s = e.connect(SANDBOX_A, origin).await;
    let hello = client_hello("a.relay.example.test");
    let mut first = hello.clone();
    first.extend_from_slice(&[0x14, 3, 3, 0, 1, 1]);
    s.write_all(&first).await.expect("hello");
    for _ in 0..100 {
        if !got.lock().expect("lock").is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(e.gateway.registry().remove(&SandboxId::new("a")));
    let mut buf = vec![0u8; 4096];
    let read = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await;
    assert!(
        matches!(read, Ok(Ok(0) | Err(_))),
        "the server's answer reached the client: {read:?}"
    );
    let line = &e.flow_lines(1).await[0];
    assert_eq!(line["error"], "gateway_sandbox_removed", "{line}");
    assert!(
        *got.lock().expect("lock") == hello,
        "the origin got more than the hello"
    );
}

async fn spliced_env() -> Env {
    let e = env(Options::default()).await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(r#"{"default": "allow", "deny": [{"domain": "blocked.example.test"}]}"#),
    );
    e
}

/// Reads the retry request the origin answered, passed on as it came.
async fn retry_request_back(s: &mut tokio::net::TcpStream) {
    let want = retry_request();
    let mut back = vec![0u8; want.len()];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut back))
        .await
        .expect("the retry request in time")
        .expect("read");
    assert_eq!(back, want, "the retry request passed on as it came");
}

/// The client's side of a retry: its first hello, the retry request back,
/// its second hello; whether the flow then stays open.
async fn retry(e: &Env, origin: SocketAddr, first: &[u8], second: &[u8]) -> bool {
    let mut s = e.connect(SANDBOX_A, origin).await;
    s.write_all(first).await.expect("first hello");
    retry_request_back(&mut s).await;
    // A change_cipher_spec first, as clients in middlebox mode send.
    let mut again = vec![0x14, 3, 3, 0, 1, 1];
    again.extend_from_slice(second);
    s.write_all(&again).await.expect("second hello");
    let mut b = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_millis(1500), s.read(&mut b)).await;
    read.is_err() // still open: nothing to read, no end
}

#[tokio::test]
async fn a_second_client_hello_naming_another_server_is_refused() {
    let e = spliced_env().await;
    let (origin, got) = retrying_origin().await;
    let first = client_hello("a.relay.example.test");
    let second = client_hello("blocked.example.test");
    assert!(!retry(&e, origin, &first, &second).await);
    assert_eq!(
        *got.lock().expect("lock"),
        first,
        "the origin saw the first hello only"
    );
    let line = &e.flow_lines(1).await[0];
    let error = line["error"].as_str().unwrap_or_default();
    assert!(
        error.contains(
            "the second ClientHello names blocked.example.test, the first a.relay.example.test"
        ),
        "{line}"
    );
    let text = scrape(&e).await;
    assert!(
        text.contains(r#"egress_flow_errors_total{side="client",kind="hello_retry"} 1"#),
        "{text}"
    );
}

/// A client that sends its second hello with its first, before the retry
/// request comes, has it held back and read as the second hello when the
/// request comes: the origin never gets it.
#[tokio::test]
async fn a_second_client_hello_sent_with_the_first_is_read_too() {
    let e = spliced_env().await;
    let (origin, got) = retrying_origin().await;
    let first = client_hello("a.relay.example.test");
    let mut both = first.clone();
    both.extend_from_slice(&client_hello("blocked.example.test"));
    let mut s = e.connect(SANDBOX_A, origin).await;
    s.write_all(&both).await.expect("both hellos at once");
    retry_request_back(&mut s).await;
    let mut b = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_secs(3), s.read(&mut b)).await;
    assert!(matches!(read, Ok(Ok(0) | Err(_))), "reset: {read:?}");
    assert_eq!(
        *got.lock().expect("lock"),
        first,
        "the origin saw the first hello only"
    );
    let line = &e.flow_lines(1).await[0];
    let error = line["error"].as_str().unwrap_or_default();
    assert!(error.contains("names blocked.example.test"), "{line}");
}

#[tokio::test]
async fn a_second_client_hello_naming_the_same_server_goes_through() {
    let e = spliced_env().await;
    let (origin, got) = retrying_origin().await;
    let (first, second) = (
        client_hello("a.relay.example.test"),
        client_hello("a.relay.example.test"),
    );
    assert!(retry(&e, origin, &first, &second).await);
    let mut want = first;
    want.extend_from_slice(&[0x14, 3, 3, 0, 1, 1]);
    want.extend_from_slice(&second);
    assert_eq!(*got.lock().expect("lock"), want, "both hellos, as sent");
}

/// The start of a flow under a byte budget is charged before it passes: a
/// retry request larger than what the budget has left is not passed on,
/// and the flow is cut at its budget.
#[tokio::test]
async fn a_retry_request_past_the_byte_budget_is_not_passed_on() {
    let e = env(Options::default()).await;
    let p = r#"{"default": "allow", "budgets": [{"destination": "*", "bytes_per_hour": 8192}]}"#;
    e.sandbox("a", SANDBOX_A, policy(p));
    let (origin, _) = answering_origin(padded_retry_request(20 * 1024)).await;
    let mut s = e.connect(SANDBOX_A, origin).await;
    s.write_all(&client_hello("a.relay.example.test"))
        .await
        .expect("first hello");
    let (mut got, mut buf) = (0, vec![0u8; 64 * 1024]);
    let reset = loop {
        match tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await {
            Ok(Ok(0)) => break false,
            Ok(Ok(n)) => got += n,
            Ok(Err(_)) => break true,
            Err(_) => panic!("neither cut nor closed after {got} bytes"),
        }
    };
    assert_eq!(
        (got, reset),
        (0, true),
        "nothing of the retry request, reset"
    );
    let line = &e.flow_lines(1).await[0];
    let error = line["error"].as_str().unwrap_or_default();
    assert!(error.starts_with("budget_exceeded: budgets[0]"), "{line}");
}

/// What the client sent after its first hello, read by the peek, is
/// charged once, with the peek: a flow whose start fits its budget is not
/// cut for those bytes charged again as they pass.
#[tokio::test]
async fn the_bytes_read_with_the_first_hello_are_charged_once() {
    let e = env(Options::default()).await;
    let p = r#"{"default": "allow", "budgets": [{"destination": "*", "bytes_per_hour": 3200}]}"#;
    e.sandbox("a", SANDBOX_A, policy(p));
    let mut hello = retry_request();
    hello[5 + 4 + 2] ^= 1; // another random: a ServerHello, no retry
    let (origin, got) = answering_origin(hello.clone()).await;
    let first = client_hello("a.relay.example.test");
    // Early data sent with the hello, read with it (the peek reads 2 KiB
    // at a time): charged twice, the two would not fit in the budget.
    let mut sent = first.clone();
    let early = 1900 - first.len();
    sent.extend_from_slice(&[0x17, 3, 3]);
    sent.extend_from_slice(&u16::try_from(early).expect("fits").to_be_bytes());
    sent.resize(sent.len() + early, 0x2a);
    let mut s = e.connect(SANDBOX_A, origin).await;
    s.write_all(&sent).await.expect("hello and early data");
    let mut back = vec![0u8; hello.len()];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut back))
        .await
        .expect("the server's hello in time")
        .expect("the server's hello, not a cut");
    for _ in 0..100 {
        if got.lock().expect("lock").len() >= sent.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(*got.lock().expect("lock"), sent, "all of it passed on");
}

/// A real retry: the origin takes only secp256r1, rustls' client offers a
/// share of another group first, and the handshake and a request go through
/// the splice.
#[tokio::test]
async fn a_real_hello_retry_is_spliced_whole() {
    let e = spliced_env().await;
    let origin = p256_origin(&e).await;
    let (tls, minted) = e
        .tls(SANDBOX_A, origin, "p256.example.test", &[b"http/1.1"])
        .await
        .expect("handshake");
    assert!(!minted, "spliced");
    let group = tls
        .get_ref()
        .1
        .negotiated_key_exchange_group()
        .map(|g| g.name());
    assert_eq!(group, Some(rustls::NamedGroup::secp256r1), "after a retry");
    let (status, body) = http_get(tls, false, "p256.example.test", "/x")
        .await
        .expect("request");
    assert_eq!(
        (status, body.starts_with("origin=p256")),
        (200, true),
        "{body}"
    );
    let line = &e.flow_lines(1).await[0];
    assert_eq!(line["verdict"], "splice", "{line}");
    assert!(line.get("error").is_none_or(|v| v.is_null()), "{line}");
}

/// An HTTPS origin on [`P256_IP`] whose TLS takes only secp256r1.
async fn p256_origin(e: &Env) -> SocketAddr {
    let base = e.origin_ca.server(&["p256.example.test"], &[b"http/1.1"]);
    let mut provider = rustls::crypto::aws_lc_rs::default_provider();
    provider.kx_groups = vec![rustls::crypto::aws_lc_rs::kx_group::SECP256R1];
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(provider))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("versions")
        .with_no_client_auth()
        .with_cert_resolver(base.cert_resolver.clone());
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    https_origin(P256_IP, Arc::new(config), "p256").await
}
