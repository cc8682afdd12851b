//! Each verdict, seen from a sandbox.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;

use crate::harness::*;

const H1: &[&[u8]] = &[b"http/1.1"];
const H2: &[&[u8]] = &[b"h2"];

#[tokio::test]
async fn ip_allow_with_interception_off_splices_and_the_client_sees_the_origin() {
    // The gateway's copy, and `splice(2)` through pipes: the same bytes.
    for (splice, path) in [("off", "user"), ("pipe", "pipe")] {
        splices_and_the_client_sees_the_origin(splice, path).await;
    }
}

async fn splices_and_the_client_sees_the_origin(splice: &'static str, path: &str) {
    let e = env(Options {
        splice,
        ..Options::default()
    })
    .await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(&format!(r#"{{"allow": [{{"ip": "{API_IP}"}}]}}"#)),
    );
    let (tls, minted) = e
        .tls(SANDBOX_A, e.origins.api, "api.example.test", H1)
        .await
        .expect("handshake");
    assert!(!minted, "spliced: the origin's own certificate");
    let (status, body) = http_get(tls, false, "api.example.test", "/hello")
        .await
        .expect("request");
    assert_eq!(status, 200);
    assert!(body.starts_with("origin=api GET /hello"), "{body}");
    let lines = e.flow_lines(1).await;
    assert_eq!(lines[0]["verdict"], json!("splice"));
    let counted = format!("egress_spliced_flows_total{{path=\"{path}\"}}");
    assert_eq!(value(&e, &counted).await, 1, "{counted}");
}

#[tokio::test]
async fn cidr_allow_with_interception_on_terminates_http1_and_http2() {
    let e = env(Options::default()).await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(r#"{"allow": [{"cidr": "127.0.0.0/24"}], "tls_interception": "on"}"#),
    );
    let (tls, minted) = e
        .tls(SANDBOX_A, e.origins.api, "api.example.test", H1)
        .await
        .expect("handshake");
    assert!(minted, "terminated: a minted leaf");
    let (status, body) = http_get(tls, false, "api.example.test", "/one")
        .await
        .expect("request");
    assert_eq!(
        (
            status,
            body.starts_with("origin=api GET /one host=api.example.test")
        ),
        (200, true),
        "{body}"
    );

    let (tls, minted) = e
        .tls(SANDBOX_A, e.origins.api, "api.example.test", H2)
        .await
        .expect("handshake");
    assert!(minted);
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let (status, body) = http_get(tls, true, "api.example.test", "/two")
        .await
        .expect("request");
    assert_eq!(status, 200);
    assert!(body.contains("GET /two"), "{body}");

    // An HTTP/2 client in front of an HTTP/1.1-only origin.
    let (tls, _) = e
        .tls(SANDBOX_A, e.origins.h1_only, "h1.example.test", H2)
        .await
        .expect("handshake");
    let (status, body) = http_get(tls, true, "h1.example.test", "/three")
        .await
        .expect("request");
    assert_eq!(status, 200);
    assert!(
        body.contains("origin=h1 GET /three host=h1.example.test version=HTTP/1.1"),
        "{body}"
    );
}

#[tokio::test]
async fn domain_allow_via_attribution_or_via_sni_verified_upstream() {
    let e = env(Options::default()).await;
    e.sandbox("a", SANDBOX_A, policy(r#"{"allow": [{"domain": "api.example.test"}, {"ip": "8.8.8.8"}], "tls_interception": "on"}"#));
    // No DNS seen: the SNI claim stands because the origin's certificate verifies for it.
    let (tls, minted) = e
        .tls(SANDBOX_A, e.origins.api, "api.example.test", H1)
        .await
        .expect("handshake");
    assert!(minted);
    let (status, _) = http_get(tls, false, "api.example.test", "/")
        .await
        .expect("request");
    assert_eq!(status, 200);
    // With DNS through the reserved resolver the address is attributed.
    let answer = e.resolve(SANDBOX_A, "api.example.test.").await;
    assert_eq!(answer.answers.len(), 1);
    let (tls, _) = e
        .tls(SANDBOX_A, e.origins.api, "api.example.test", H1)
        .await
        .expect("handshake");
    let (status, _) = http_get(tls, false, "api.example.test", "/")
        .await
        .expect("request");
    assert_eq!(status, 200);
    let lines = e.flow_lines(2).await;
    assert_eq!(lines[0]["attributed"], json!([]));
    assert_eq!(lines[0]["reason"], json!("needs_verification"));
    let last = &lines[1];
    assert_eq!(last["attributed"], json!(["api.example.test"]));
    assert_eq!(last["verdict"], json!("intercept"));
}

#[tokio::test]
async fn domain_allow_without_interception_needs_dns() {
    let e = env(Options::default()).await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(r#"{"allow": [{"domain": "api.example.test"}, {"ip": "8.8.8.8"}]}"#),
    );
    assert!(
        e.tls(SANDBOX_A, e.origins.api, "api.example.test", H1)
            .await
            .is_err(),
        "SNI alone is no attribution"
    );
    e.resolve(SANDBOX_A, "api.example.test.").await;
    let (_, minted) = e
        .tls(SANDBOX_A, e.origins.api, "api.example.test", H1)
        .await
        .expect("spliced after DNS");
    assert!(!minted);
    // Sandbox B resolved nothing: A's attribution is not B's.
    e.sandbox(
        "b",
        SANDBOX_B,
        policy(r#"{"allow": [{"domain": "api.example.test"}]}"#),
    );
    assert!(e
        .tls(SANDBOX_B, e.origins.api, "api.example.test", H1)
        .await
        .is_err());
    let mut reasons: Vec<_> = e
        .flow_lines(3)
        .await
        .iter()
        .map(|l| l["reason"].clone())
        .collect();
    reasons.sort_by_key(ToString::to_string);
    assert_eq!(
        reasons,
        [
            json!("interception_off"),
            json!("no_dns_seen"),
            json!("no_dns_seen")
        ]
    );
}

#[tokio::test]
async fn denies_beat_allows_and_exemptions_and_strangers_are_refused() {
    let e = env(Options::default()).await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(&format!(
            r#"{{"default": "allow", "deny": [{{"domain": "api.example.test"}}, {{"ip": "{RELAY_IP}"}}], "tls_interception": "on",
                "tls_interception_exemptions": [{{"cidr": "127.0.0.0/8"}}]}}"#
        )),
    );
    assert!(
        e.tls(SANDBOX_A, e.origins.api, "api.example.test", H1)
            .await
            .is_err(),
        "domain deny by SNI"
    );
    assert!(
        e.tls(SANDBOX_A, e.origins.relay, "a.relay.example.test", H1)
            .await
            .is_err(),
        "ip deny"
    );
    let mut stranger = e.connect(STRANGER, e.origins.api).await;
    assert!(
        closed_without_data(&mut stranger).await,
        "unknown source: reset"
    );
    let lines = e.flow_lines(3).await;
    let reasons: Vec<_> = lines
        .iter()
        .map(|l| l["reason"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(reasons, ["tenant_deny", "tenant_deny", "unknown_sandbox"]);
}

#[tokio::test]
async fn platform_deny_answers_plain_http_with_403() {
    let e = env(Options::default()).await;
    e.sandbox("a", SANDBOX_A, policy(r#"{"default": "allow"}"#));
    let s = e
        .connect(SANDBOX_A, "169.254.169.254:80".parse().expect("addr"))
        .await;
    let (status, body) = http_get(s, false, "metadata", "/latest/meta-data")
        .await
        .expect("an answer");
    assert_eq!(status, 403);
    assert!(
        body.contains("platform deny: cidr 169.254.0.0/16"),
        "{body}"
    );
    let line = e.flow_lines(1).await.pop().expect("line");
    assert_eq!(
        (line["verdict"].clone(), line["reason"].clone()),
        (json!("deny"), json!("platform_deny"))
    );
}

#[tokio::test]
async fn hostname_exemption_splices_only_with_attribution_and_consistent_sni() {
    let e = env(Options::default()).await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(r#"{"default": "allow", "tls_interception": "on", "tls_interception_exemptions": [{"wildcard_domain": "*.relay.example.test"}]}"#),
    );
    let (_, minted) = e
        .tls(SANDBOX_A, e.origins.relay, "a.relay.example.test", H1)
        .await
        .expect("handshake");
    assert!(minted, "SNI alone does not exempt");
    e.resolve(SANDBOX_A, "a.relay.example.test.").await;
    let (tls, minted) = e
        .tls(SANDBOX_A, e.origins.relay, "a.relay.example.test", H1)
        .await
        .expect("handshake");
    assert!(!minted, "exempt after DNS: the origin's certificate");
    let (status, body) = http_get(tls, false, "a.relay.example.test", "/x")
        .await
        .expect("request");
    assert_eq!((status, body.starts_with("origin=relay")), (200, true));
    // The apex is not covered by the wildcard, even when attributed.
    e.resolve(SANDBOX_A, "relay.example.test.").await;
    let (_, minted) = e
        .tls(SANDBOX_A, e.origins.relay, "relay.example.test", H1)
        .await
        .expect("handshake");
    assert!(minted, "an SNI that is no exempt name terminates");
    let mut reasons: Vec<_> = e
        .flow_lines(3)
        .await
        .iter()
        .map(|l| l["reason"].as_str().unwrap_or_default().to_owned())
        .collect();
    reasons.sort();
    assert_eq!(reasons, ["exempt", "no_dns_seen", "sni_mismatch"]);
}

#[tokio::test]
async fn expired_attribution_terminates_instead() {
    let e = env(Options {
        min_ttl: "1s",
        max_ttl: "1s",
        ..Options::default()
    })
    .await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(r#"{"default": "allow", "tls_interception": "on", "tls_interception_exemptions": [{"domain": "a.relay.example.test"}]}"#),
    );
    e.resolve(SANDBOX_A, "a.relay.example.test.").await;
    let (_, minted) = e
        .tls(SANDBOX_A, e.origins.relay, "a.relay.example.test", H1)
        .await
        .expect("handshake");
    assert!(!minted);
    e.clock.advance(Duration::from_millis(1_200));
    let (_, minted) = e
        .tls(SANDBOX_A, e.origins.relay, "a.relay.example.test", H1)
        .await
        .expect("handshake");
    assert!(minted, "expired: terminated");
    let lines = e.flow_lines(2).await;
    assert!(
        lines.iter().any(|l| l["reason"] == json!("expired")),
        "{lines:?}"
    );
}

#[tokio::test]
async fn ip_and_cidr_exemptions_splice_without_dns() {
    let e = env(Options::default()).await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(&format!(
            r#"{{"default": "allow", "tls_interception": "on", "tls_interception_exemptions": [{{"ip": "{API_IP}"}}, {{"cidr": "127.0.0.8/29"}}]}}"#
        )),
    );
    let (_, minted) = e
        .tls(SANDBOX_A, e.origins.api, "api.example.test", H1)
        .await
        .expect("handshake");
    assert!(!minted);
    let (_, minted) = e
        .tls(SANDBOX_A, e.origins.relay, "a.relay.example.test", H1)
        .await
        .expect("handshake");
    assert!(!minted, "{RELAY_IP} is in 127.0.0.8/29");
}

#[tokio::test]
async fn host_sni_mismatch_is_421_and_a_wrong_origin_certificate_is_502() {
    let e = env(Options::default()).await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(r#"{"default": "allow", "tls_interception": "on"}"#),
    );
    let (tls, _) = e
        .tls(SANDBOX_A, e.origins.api, "api.example.test", H1)
        .await
        .expect("handshake");
    let (status, _) = http_get(tls, false, "alias.example.test", "/")
        .await
        .expect("answer");
    assert_eq!(status, 421);
    let (tls, _) = e
        .tls(SANDBOX_A, e.origins.wrong_cert, "api.example.test", H1)
        .await
        .expect("handshake");
    let (status, body) = http_get(tls, false, "api.example.test", "/")
        .await
        .expect("answer");
    assert_eq!(status, 502);
    assert!(
        body.contains("upstream TLS failed for api.example.test"),
        "{body}"
    );
}

/// The `Host` of a request on a terminated flow must be its server name
/// even when a push has since turned interception off: the origin was
/// verified for the server name, and another name's credentials would go
/// to it.
#[tokio::test]
async fn host_sni_mismatch_stays_421_after_interception_is_turned_off() {
    let e = env(Options::default()).await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(r#"{"default": "allow", "tls_interception": "on"}"#),
    );
    let (tls, minted) = e
        .tls(SANDBOX_A, e.origins.api, "api.example.test", H1)
        .await
        .expect("handshake");
    assert!(minted);
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(r#"{"default": "allow", "tls_interception": "off"}"#),
    );
    let (status, _) = http_get(tls, false, "alias.example.test", "/")
        .await
        .expect("answer");
    assert_eq!(status, 421);
}

#[tokio::test]
async fn a_non_http_tls_protocol_fails_intercepted_and_works_exempted() {
    let e = env(Options::default()).await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(r#"{"default": "allow", "tls_interception": "on"}"#),
    );
    let (mut tls, minted) = e
        .tls(SANDBOX_A, e.origins.turn, "turn.example.test", &[])
        .await
        .expect("handshake");
    assert!(minted);
    tls.write_all_ignored(b"PING\n").await;
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(3), tls.read_to_end_ignored(&mut got)).await;
    let text = String::from_utf8_lossy(&got);
    assert!(!text.contains("PONG"), "{text}");
    assert!(
        text.is_empty() || text.starts_with("HTTP/1.1 400"),
        "{text}"
    );

    e.sandbox(
        "a",
        SANDBOX_A,
        policy(r#"{"default": "allow", "tls_interception": "on", "tls_interception_exemptions": [{"domain": "turn.example.test"}]}"#),
    );
    e.resolve(SANDBOX_A, "turn.example.test.").await;
    let (mut tls, minted) = e
        .tls(SANDBOX_A, e.origins.turn, "turn.example.test", &[])
        .await
        .expect("handshake");
    assert!(!minted);
    tls.write_all_ignored(b"PING\n").await;
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(3), tls.read_to_end_ignored(&mut got)).await;
    assert_eq!(got, b"PONG\n");
    drop(tls);
    let lines = e.flow_lines(2).await;
    assert!(
        lines.iter().any(|l| l["verdict"] == json!("intercept")
            && l["error"]
                .as_str()
                .is_some_and(|s| s.starts_with("non_http"))),
        "{lines:?}"
    );
}

#[tokio::test]
async fn plain_http_needs_its_host_attributed() {
    let e = env(Options::default()).await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(r#"{"allow": [{"domain": "plain.example.test"}, {"ip": "8.8.8.8"}]}"#),
    );
    let s = e.connect(SANDBOX_A, e.origins.plain).await;
    let (status, body) = http_get(s, false, "plain.example.test", "/")
        .await
        .expect("answer");
    assert_eq!(status, 403, "{body}");
    e.resolve(SANDBOX_A, "plain.example.test.").await;
    let s = e.connect(SANDBOX_A, e.origins.plain).await;
    let (status, body) = http_get(s, false, "plain.example.test", "/p")
        .await
        .expect("answer");
    assert_eq!(status, 200);
    assert!(
        body.starts_with("origin=plain GET /p host=plain.example.test"),
        "{body}"
    );
}

#[tokio::test]
async fn fragmented_and_one_byte_client_hellos_and_silent_clients() {
    let e = env(Options {
        peek: "500ms",
        ..Options::default()
    })
    .await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(r#"{"default": "allow", "tls_interception": "on"}"#),
    );
    let tcp = e.connect(SANDBOX_A, e.origins.api).await;
    let name = rustls::pki_types::ServerName::try_from("api.example.test").expect("name");
    let tls = tokio_rustls::TlsConnector::from(e.client_tls(H1))
        .connect(name, OneByte(tcp))
        .await
        .expect("handshake over 1-byte writes");
    let (status, _) = http_get(tls, false, "api.example.test", "/")
        .await
        .expect("request");
    assert_eq!(status, 200);
    let mut silent = e.connect(SANDBOX_A, e.origins.api).await;
    assert!(
        closed_without_data(&mut silent).await,
        "dropped at the peek timeout"
    );
    let lines = e.flow_lines(2).await;
    assert!(
        lines.iter().any(|l| l["reason"] == json!("peek_timeout")),
        "{lines:?}"
    );
}

/// Reads a response head, byte by byte (nothing past it is taken).
pub async fn read_head<S: tokio::io::AsyncRead + Unpin>(io: &mut S) -> String {
    let mut head = vec![0u8; 0];
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        tokio::io::AsyncReadExt::read_exact(io, &mut byte)
            .await
            .expect("head");
        head.push(byte[0]);
    }
    String::from_utf8_lossy(&head).into_owned()
}

#[tokio::test]
async fn only_a_websocket_is_bridged_through_interception() {
    // A bridge carries bytes no stage judges: an `h2c` one would carry
    // HTTP/2 requests for any authority, method and path to the origin.
    let e = env(Options::default()).await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(r#"{"default": "allow", "tls_interception": "on"}"#),
    );
    let (mut tls, _) = e
        .tls(SANDBOX_A, e.origins.api, "api.example.test", H1)
        .await
        .expect("handshake");
    let asks = [
        "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA",
        "Connection: upgrade\r\nUpgrade: websocket, h2c",
        "Connection: upgrade\r\nUpgrade: websocket\r\nUpgrade: h2c",
    ];
    for ask in asks {
        let req = format!("GET /up HTTP/1.1\r\nHost: api.example.test\r\n{ask}\r\n\r\n");
        tls.write_all_ignored(req.as_bytes()).await;
        let head = read_head(&mut tls).await;
        // The origin switches whenever it is asked to: it was not.
        assert!(head.starts_with("HTTP/1.1 200"), "{ask}: {head}");
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .and_then(|n| n.trim().parse().ok())
            .expect("a length");
        let mut body = vec![0u8; len];
        tokio::io::AsyncReadExt::read_exact(&mut tls, &mut body)
            .await
            .expect("body");
        let body = String::from_utf8_lossy(&body);
        assert!(body.starts_with("origin=api GET /up "), "{body}");
    }
    // A WebSocket request the origin refuses: its answer passes, without
    // its connection-specific fields.
    tls.write_all_ignored(b"GET /no-upgrade HTTP/1.1\r\nHost: api.example.test\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n").await;
    let head = read_head(&mut tls).await.to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 407"), "{head}");
    assert!(head.contains("x-end: 1"), "{head}");
    for name in [
        "proxy-authenticate",
        "x-hop",
        "keep-alive",
        "connection: x-hop",
    ] {
        assert!(!head.contains(name), "{name}: {head}");
    }
    let mut body = [0u8; 2];
    tokio::io::AsyncReadExt::read_exact(&mut tls, &mut body)
        .await
        .expect("body");
    // A WebSocket request the origin answers by switching to something else.
    tls.write_all_ignored(b"GET /other-protocol HTTP/1.1\r\nHost: api.example.test\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n").await;
    let head = read_head(&mut tls).await;
    assert!(head.starts_with("HTTP/1.1 502"), "{head}");
    // The WebSocket itself, bridged.
    let (mut tls, _) = e
        .tls(SANDBOX_A, e.origins.api, "api.example.test", H1)
        .await
        .expect("handshake");
    tls.write_all_ignored(b"GET /ws HTTP/1.1\r\nHost: api.example.test\r\nConnection: upgrade\r\nUpgrade: WebSocket\r\n\r\n").await;
    let head = read_head(&mut tls).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    tls.write_all_ignored(b"ping over the bridge").await;
    let mut echo = [0u8; 20];
    tokio::io::AsyncReadExt::read_exact(&mut tls, &mut echo)
        .await
        .expect("echo");
    assert_eq!(&echo, b"ping over the bridge");
}

/// An HTTP/1.1 origin at `PAUSE_IP` that refuses every WebSocket upgrade
/// with a `403` whose body is `hello` in chunks: `/coded` says
/// `transfer-encoding: gzip, chunked`, `/sized` puts a `content-length: 100`
/// beside `transfer-encoding: chunked`. One request a connection.
async fn refusing_origin(e: &Env) -> SocketAddr {
    use tokio::io::AsyncReadExt;
    let config = e.origin_ca.server(&["pause.example.test"], H1);
    tls_origin(PAUSE_IP, config, |mut tls| async move {
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            match tls.read(&mut byte).await {
                Ok(1) => head.push(byte[0]),
                _ => return,
            }
        }
        let framing = if head.starts_with(b"GET /coded ") {
            "transfer-encoding: gzip, chunked"
        } else {
            "transfer-encoding: chunked\r\ncontent-length: 100"
        };
        let answer = format!("HTTP/1.1 403 Forbidden\r\n{framing}\r\n\r\n5\r\nhello\r\n0\r\n\r\n");
        let _ = tls.write_all(answer.as_bytes()).await;
        let _ = tls.shutdown().await;
    })
    .await
}

/// An origin that refuses a WebSocket upgrade (no `101`) has its answer's
/// framing checked as any answer's: a transfer coding but chunked is
/// answered `502` (its coded bytes would reach the client unmarked once the
/// hop-by-hop header goes), and a `content-length` beside
/// `transfer-encoding: chunked` is dropped (it would frame the dechunked
/// body wrong). Before, a refused upgrade went back with only its
/// hop-by-hop fields stripped.
#[tokio::test]
async fn a_refused_upgrade_is_framed_as_any_answer() {
    let e = intercepting(&["pause.example.test"]).await;
    let origin = refusing_origin(&e).await;
    let (tls, minted) = e
        .tls(SANDBOX_A, origin, "pause.example.test", H1)
        .await
        .expect("handshake");
    assert!(minted, "intercepted");
    let (mut h1, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .expect("http/1.1");
    tokio::spawn(conn);
    let mut upgrade = async |path: &str| {
        h1.ready().await.expect("ready");
        let req = hyper::Request::get(path)
            .header("host", "pause.example.test")
            .header("connection", "upgrade")
            .header("upgrade", "websocket")
            .body(Full::new(Bytes::new()))
            .expect("request");
        let resp = h1.send_request(req).await.expect("answer");
        let (head, body) = resp.into_parts();
        let body = body.collect().await.map(|b| b.to_bytes());
        (head, body)
    };
    let (head, body) = upgrade("/coded").await;
    assert_eq!(head.status, 502, "{head:?} {body:?}");
    let (head, body) = upgrade("/sized").await;
    assert_eq!(head.status, 403, "{head:?}");
    assert!(
        !head.headers.contains_key("content-length"),
        "the length beside the chunks went on: {head:?}"
    );
    assert_eq!(body.expect("the whole body"), "hello");
}

/// Opens a WebSocket from `src` to the API origin through interception,
/// past its 101.
async fn websocket(e: &Env, src: &str) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let (mut tls, _) = e
        .tls(src, e.origins.api, "api.example.test", H1)
        .await
        .expect("handshake");
    tls.write_all_ignored(b"GET /ws HTTP/1.1\r\nHost: api.example.test\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n").await;
    let head = read_head(&mut tls).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    tls
}

/// Echoes chunks of 16 KiB over `tls` until it ends or `within` passes:
/// the bytes echoed, and whether it ended.
async fn echo_until_cut<S>(tls: &mut S, within: Duration) -> (u64, bool)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::AsyncReadExt;
    let chunk = vec![b'w'; 16 * 1024];
    let mut back = vec![0u8; 16 * 1024];
    let (mut echoed, until) = (0u64, tokio::time::Instant::now() + within);
    while tokio::time::Instant::now() < until {
        let round = async {
            tls.write_all(&chunk).await?;
            tls.read_exact(&mut back).await
        };
        match tokio::time::timeout_at(until, round).await {
            Ok(Ok(_)) => echoed += chunk.len() as u64,
            Ok(Err(_)) => return (echoed, true),
            Err(_) => break,
        }
    }
    (echoed, false)
}

/// A bridged WebSocket belongs to its flow: its bytes are charged to the
/// byte budget of the request that opened it, chunk by chunk (cut past it,
/// `budget_exceeded`), it ends when its sandbox is deleted
/// (`gateway_sandbox_removed`), and its flow's line counts its bytes.
#[tokio::test]
async fn a_bridged_websocket_is_charged_and_cut_as_its_flow() {
    const BUDGET: u64 = 256 * 1024;
    let e = env(Options::default()).await;
    let budgeted = format!(
        r#"{{"default": "allow", "tls_interception": "on",
        "budgets": [{{"destination": "api.example.test", "bytes_per_hour": {BUDGET}}}]}}"#
    );
    e.sandbox("a", SANDBOX_A, policy(&budgeted));
    e.sandbox(
        "b",
        SANDBOX_B,
        policy(r#"{"default": "allow", "tls_interception": "on"}"#),
    );
    let mut ws = websocket(&e, SANDBOX_A).await;
    let (echoed, cut) = echo_until_cut(&mut ws, Duration::from_secs(5)).await;
    assert!(cut, "not cut after {echoed} bytes echoed");
    // Each byte crosses the budget twice (there and back).
    assert!(2 * echoed <= BUDGET, "at most the budget: {echoed} echoed");
    let line = e.flow_lines(1).await.pop().expect("a line");
    let error = line["error"].as_str().unwrap_or_default();
    assert!(error.starts_with("budget_exceeded: budgets[0]"), "{line}");
    assert!(line["bytes_up"].as_u64().unwrap_or(0) > echoed, "{line}");
    let text = scrape(&e).await;
    assert!(
        text.contains("egress_budget_exceeded_total{kind=\"bytes\"} 1"),
        "the cut is counted: {text}"
    );

    let mut ws = websocket(&e, SANDBOX_B).await;
    let (echoed, cut) = echo_until_cut(&mut ws, Duration::from_millis(300)).await;
    assert!(!cut && echoed > 0, "the bridge works: {echoed}");
    assert!(e
        .gateway
        .registry()
        .remove(&egress_policy::SandboxId::new("b")));
    let (_, cut) = echo_until_cut(&mut ws, Duration::from_secs(5)).await;
    assert!(cut, "the bridge outlived its sandbox");
    let line = e.flow_lines(2).await.pop().expect("a line");
    assert_eq!(line["error"], json!("gateway_sandbox_removed"), "{line}");
}

/// A bridged WebSocket runs while its sandbox's policy lets the request
/// that opened it through: a push that changes nothing for it leaves it,
/// one whose per-request rule refuses its path (or, for the second, whose
/// deny names its host) ends it within a tick (`gateway_policy_withdrawn`).
#[tokio::test]
async fn a_bridged_websocket_ends_when_its_policy_refuses_the_request_that_opened_it() {
    let e = env(Options::default()).await;
    let open = r#"{"default": "allow", "tls_interception": "on"}"#;
    e.sandbox("a", SANDBOX_A, policy(open));
    let mut ws = websocket(&e, SANDBOX_A).await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(
            r#"{"default": "allow", "tls_interception": "on",
            "deny": [{"domain": "api.example.test", "http": {"paths": ["/other"]}}]}"#,
        ),
    );
    let (echoed, cut) = echo_until_cut(&mut ws, Duration::from_millis(1500)).await;
    assert!(!cut && echoed > 0, "a rule for another path: still open");
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(
            r#"{"default": "allow", "tls_interception": "on",
            "deny": [{"domain": "api.example.test", "http": {"paths": ["/ws"]}}]}"#,
        ),
    );
    let (_, cut) = echo_until_cut(&mut ws, Duration::from_secs(3)).await;
    assert!(cut, "its path refused: ended");
    let line = e.flow_lines(1).await.pop().expect("a line");
    assert_eq!(line["error"], json!("gateway_policy_withdrawn"), "{line}");

    e.sandbox("a", SANDBOX_A, policy(open));
    let mut ws = websocket(&e, SANDBOX_A).await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(r#"{"default": "allow", "tls_interception": "on", "deny": [{"domain": "api.example.test"}]}"#),
    );
    let (_, cut) = echo_until_cut(&mut ws, Duration::from_secs(3)).await;
    assert!(cut, "its host denied: ended");
    let line = e.flow_lines(2).await.pop().expect("a line");
    assert_eq!(line["error"], json!("gateway_policy_withdrawn"), "{line}");
}

#[tokio::test]
async fn a_refused_requests_method_is_cut_in_the_flow_log() {
    // The method is the sandbox's, as long as a request head: the flow log
    // (a queue of lines, bounded by count) shows its first 32 characters.
    let e = env(Options::default()).await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(r#"{"allow": [{"domain": "api.example.test", "http": "read_only"}], "tls_interception": "on"}"#),
    );
    let (mut tls, _) = e
        .tls(SANDBOX_A, e.origins.api, "api.example.test", H1)
        .await
        .expect("handshake");
    let method = "M".repeat(8_000);
    let req =
        format!("{method} /x HTTP/1.1\r\nHost: api.example.test\r\nConnection: close\r\n\r\n");
    tls.write_all_ignored(req.as_bytes()).await;
    let head = read_head(&mut tls).await;
    assert!(head.starts_with("HTTP/1.1 403"), "{head}");
    let line = e.flow_lines(1).await.pop().expect("a line");
    let shown = line["request_denied"]
        .as_str()
        .expect("the refused request");
    assert!(shown.contains(&"M".repeat(32)), "{shown}");
    assert!(
        !shown.contains(&"M".repeat(33)),
        "{} characters",
        shown.len()
    );
}

#[tokio::test]
async fn the_flow_log_has_a_line_per_flow_with_its_facts() {
    let e = env(Options::default()).await;
    e.sandbox("a", SANDBOX_A, policy(r#"{"allow": [{"domain": "api.example.test"}, {"ip": "8.8.8.8"}], "tls_interception": "on"}"#));
    e.resolve(SANDBOX_A, "api.example.test.").await;
    let (tls, _) = e
        .tls(SANDBOX_A, e.origins.api, "api.example.test", H1)
        .await
        .expect("handshake");
    let (status, _) = http_get(tls, false, "api.example.test", "/bytes/5000")
        .await
        .expect("request");
    assert_eq!(status, 200);
    let line = e.flow_lines(1).await.pop().expect("line");
    assert_eq!(line["sandbox"], json!("a"));
    assert_eq!(line["dst"], json!(e.origins.api.to_string()));
    assert_eq!(line["sni"], json!("api.example.test"));
    assert_eq!(line["host"], json!("api.example.test"));
    assert_eq!(line["attributed"], json!(["api.example.test"]));
    assert_eq!(
        (line["verdict"].clone(), line["reason"].clone()),
        (json!("intercept"), json!("not_exempt"))
    );
    assert!(
        line["bytes_down"].as_u64().is_some_and(|b| b > 5000),
        "{line}"
    );
    assert!(line["bytes_up"].as_u64().is_some_and(|b| b > 200), "{line}");
    assert_eq!(line["requests"], json!(1));
    assert!(line["ts"].as_str().is_some_and(|t| t.ends_with('Z')));
}

/// An HTTPS origin for api.example.test answering `received <n>`, n the
/// bytes of the request body; on `first` it reports the size of the body's
/// first piece as soon as that piece arrives, before the body is complete.
async fn body_counting_origin(e: &Env) -> (SocketAddr, mpsc::UnboundedReceiver<usize>) {
    let listener = tokio::net::TcpListener::bind((API_IP, 0))
        .await
        .expect("bind origin");
    let addr = listener.local_addr().expect("addr");
    let acceptor = tokio_rustls::TlsAcceptor::from(e.origin_ca.server(&["api.example.test"], H1));
    let (first, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, first) = (acceptor.clone(), first.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let service = hyper::service::service_fn(
                    move |req: hyper::Request<hyper::body::Incoming>| {
                        let first = first.clone();
                        async move {
                            let mut body = req.into_body();
                            let mut n = 0;
                            while let Some(frame) = body.frame().await {
                                let piece = frame?.into_data().map_or(0, |d| d.len());
                                if n == 0 && piece > 0 {
                                    let _ = first.send(piece);
                                }
                                n += piece;
                            }
                            let text = format!("received {n}");
                            Ok::<_, hyper::Error>(hyper::Response::new(Full::new(Bytes::from(
                                text,
                            ))))
                        }
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    (addr, rx)
}

/// Streaming, shown by order: the client sends the head and the first 100 KB,
/// then waits until the origin has bytes of the body, and only then sends the
/// other 200 KB. A gateway that held the body back until it had all of it
/// would leave the origin empty-handed: the wait's bound is the failure.
async fn a_request_body_streams(e: &Env) {
    let (origin, mut first) = body_counting_origin(e).await;
    let (mut tls, minted) = e
        .tls(SANDBOX_A, origin, "api.example.test", H1)
        .await
        .expect("handshake");
    assert!(minted, "intercepted");
    let (head, rest) = (vec![b'u'; 100_000], vec![b'u'; 200_000]);
    let request = "POST /upload HTTP/1.1\r\nhost: api.example.test\r\ncontent-length: 300000\r\nconnection: close\r\n\r\n";
    tls.write_all(request.as_bytes()).await.expect("head");
    tls.write_all(&head).await.expect("first bytes");
    tls.flush().await.expect("flush");
    let seen = tokio::time::timeout(Duration::from_secs(30), first.recv())
        .await
        .expect("the origin got none of the body before the client sent all of it")
        .expect("the origin runs");
    assert!((1..=100_000).contains(&seen), "{seen}");
    tls.write_all(&rest).await.expect("the rest");
    tls.flush().await.expect("flush");
    let mut response = Vec::new();
    tls.read_to_end_ignored(&mut response).await;
    let response = String::from_utf8_lossy(&response);
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(
        response.contains("received 300000"),
        "the whole body arrived: {response}"
    );
}

#[tokio::test]
async fn request_bodies_stream_through_interception_and_idle_flows_close() {
    let e = env(Options {
        idle: "1s",
        ..Options::default()
    })
    .await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(r#"{"default": "allow", "tls_interception": "on"}"#),
    );
    a_request_body_streams(&e).await;
    // And byte for byte, sent the usual way, to the origin that echoes it.
    let (tls, _) = e
        .tls(SANDBOX_A, e.origins.api, "api.example.test", H1)
        .await
        .expect("handshake");
    let (status, body) = http_post(tls, "api.example.test", "/upload", vec![b'u'; 300_000])
        .await
        .expect("request");
    assert_eq!(status, 200);
    assert!(
        body.starts_with("origin=api POST /upload"),
        "{}",
        &body[..80]
    );
    assert_eq!(
        body.matches('u').count(),
        300_000 + 1,
        "the whole body arrived (plus the u in /upload)"
    );

    let (mut tls, _) = e
        .tls(SANDBOX_A, e.origins.api, "api.example.test", H1)
        .await
        .expect("handshake");
    let mut got = Vec::new();
    let closed =
        tokio::time::timeout(Duration::from_secs(5), tls.read_to_end_ignored(&mut got)).await;
    assert!(closed.is_ok(), "an idle intercepted flow is closed");
    let lines = e.flow_lines(3).await; // two uploads, then the idle flow
    assert!(
        lines.iter().any(|l| l["error"] == json!("idle_timeout")),
        "{lines:?}"
    );
}

// === helpers ===

/// Writes one byte per call: a ClientHello arrives in many TCP segments.
struct OneByte(tokio::net::TcpStream);

impl tokio::io::AsyncRead for OneByte {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for OneByte {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let n = buf.len().min(1);
        std::pin::Pin::new(&mut self.0).poll_write(cx, &buf[..n])
    }
    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// Writes and reads whose failures the test judges by what arrives, not by the call.
trait Quiet {
    async fn write_all_ignored(&mut self, bytes: &[u8]);
    async fn read_to_end_ignored(&mut self, out: &mut Vec<u8>);
}

impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin> Quiet for T {
    async fn write_all_ignored(&mut self, bytes: &[u8]) {
        let _ = tokio::io::AsyncWriteExt::write_all(self, bytes).await;
        let _ = tokio::io::AsyncWriteExt::flush(self).await;
    }
    async fn read_to_end_ignored(&mut self, out: &mut Vec<u8>) {
        let _ = tokio::io::AsyncReadExt::read_to_end(self, out).await;
    }
}

/// An HTTP/1.1 connection to the api origin through the gateway with no
/// SNI (rustls sends none for an IP address; the leaf carries the IP), and
/// a GET with `host` on it: the status and the body.
async fn without_sni(e: &Env) -> impl AsyncFnMut(&str) -> (u16, String) {
    let tcp = e.connect(SANDBOX_A, e.origins.api).await;
    let ip = e.origins.api.ip();
    let tls = tokio_rustls::TlsConnector::from(e.client_tls(H1))
        .connect(rustls::pki_types::ServerName::IpAddress(ip.into()), tcp)
        .await
        .expect("handshake with an IP SAN leaf");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .expect("http");
    tokio::spawn(conn);
    async move |host: &str| {
        sender.ready().await.expect("ready");
        let req = hyper::Request::builder()
            .uri("/")
            .header("host", host)
            .body(Full::new(Bytes::new()))
            .expect("request");
        let resp = sender.send_request(req).await.expect("answer");
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        (status, String::from_utf8_lossy(&body).into_owned())
    }
}

#[tokio::test]
async fn without_sni_each_host_is_verified_on_its_own_connection() {
    let e = env(Options::default()).await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(r#"{"default": "allow", "tls_interception": "on"}"#),
    );
    let mut get = without_sni(&e).await;
    let (status, body) = get("api.example.test").await;
    assert_eq!(
        status, 200,
        "the origin's certificate covers api.example.test: {body}"
    );
    // Same client connection, another Host: the upstream connection verified
    // for api.example.test must not carry it.
    let (status, _) = get("other.example.test").await;
    assert_eq!(status, 502);
}

#[tokio::test]
async fn without_sni_a_host_passes_only_on_its_own_attribution() {
    // The api origin's address serves a certificate for api.example.test
    // and alias.example.test; only the first is allowed, and resolved.
    let e = env(Options::default()).await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(
            r#"{"allow": [{"domain": "api.example.test"}, {"ip": "8.8.8.8"}],
                "tls_interception": "on"}"#,
        ),
    );
    e.resolve(SANDBOX_A, "api.example.test.").await;
    let mut get = without_sni(&e).await;
    let (status, body) = get("api.example.test").await;
    assert_eq!(status, 200, "the allowed, attributed name: {body}");
    // Another name the address serves: not allowed, never resolved. Without
    // an SNI the Host is the claim, judged as an SNI would be.
    let (status, body) = get("alias.example.test").await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("sni_mismatch"), "{body}");
    // Resolved too, it is attributed to the address beside the allowed
    // name, but is not allowed itself: naming it is denied, in a Host or
    // an SNI (the origin, a CDN say, would route by it).
    e.resolve(SANDBOX_A, "alias.example.test.").await;
    let (status, body) = get("alias.example.test").await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("no_allow_match"), "{body}");
    let sni = e
        .tls(SANDBOX_A, e.origins.api, "alias.example.test", H1)
        .await;
    assert!(sni.is_err(), "the flow naming it is refused");
    let (tls, minted) = e
        .tls(SANDBOX_A, e.origins.api, "api.example.test", H1)
        .await
        .expect("the allowed name still passes");
    assert!(minted);
    let (status, _) = http_get(tls, false, "api.example.test", "/")
        .await
        .expect("answer");
    assert_eq!(status, 200);
}

/// Sandbox A may reach plain.example.test, which it resolved, and not
/// evil.example.test.
async fn plain_allowed_evil_denied() -> Env {
    let e = env(Options::default()).await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(r#"{"allow": [{"domain": "plain.example.test"}, {"ip": "8.8.8.8"}], "deny": [{"domain": "evil.example.test"}]}"#),
    );
    e.resolve(SANDBOX_A, "plain.example.test.").await;
    e
}

#[tokio::test]
async fn every_plain_http_request_on_a_keep_alive_connection_is_judged() {
    let e = plain_allowed_evil_denied().await;
    let tcp = e.connect(SANDBOX_A, e.origins.plain).await;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
            .await
            .expect("http");
    tokio::spawn(conn);
    let mut ask = async |host: &str| {
        sender.ready().await.expect("ready");
        let req = hyper::Request::builder()
            .uri("/k")
            .header("host", host)
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .expect("request");
        let resp = sender.send_request(req).await.expect("answer");
        let status = resp.status().as_u16();
        let body = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .expect("body")
            .to_bytes();
        (status, String::from_utf8_lossy(&body).into_owned())
    };
    let (status, body) = ask("plain.example.test").await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body.starts_with("origin=plain GET /k host=plain.example.test"),
        "{body}"
    );
    let (status, body) = ask("evil.example.test").await;
    assert_eq!(
        status, 403,
        "a denied Host later on the same connection: {body}"
    );
    assert!(
        body.contains("tenant deny: domain evil.example.test"),
        "{body}"
    );
    let (status, _) = ask("elsewhere.example.test").await;
    assert_eq!(status, 403, "a Host that is neither allowed nor attributed");
    let (status, _) = ask("plain.example.test").await;
    assert_eq!(status, 200, "the connection still serves allowed requests");
    drop(sender);
    let line = e.flow_lines(1).await.pop().expect("line");
    assert_eq!(
        (line["verdict"].clone(), line["requests"].clone()),
        (json!("allow"), json!(4))
    );
}

#[tokio::test]
async fn a_request_an_origin_would_read_is_judged_however_it_starts() {
    // Empty lines first, or a method the peek does not list: HTTP to the
    // origin, so HTTP to the gateway, and its Host judged.
    let e = plain_allowed_evil_denied().await;
    for start in ["\r\nGET", "\nPROPFIND", "GETS"] {
        let mut tcp = e.connect(SANDBOX_A, e.origins.plain).await;
        let req =
            format!("{start} /k HTTP/1.1\r\nHost: evil.example.test\r\nConnection: close\r\n\r\n");
        tcp.write_all_ignored(req.as_bytes()).await;
        let mut out = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end_ignored(&mut out))
            .await
            .expect("an answer");
        let out = String::from_utf8_lossy(&out);
        assert!(out.starts_with("HTTP/1.1 403"), "{start:?}: {out}");
        assert!(
            out.contains("tenant deny: domain evil.example.test"),
            "{out}"
        );
    }
}

#[tokio::test]
async fn intercepted_clients_that_send_an_sni_resume_their_tls_sessions() {
    let e = env(Options::default()).await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(r#"{"allow": [{"cidr": "127.0.0.0/24"}], "tls_interception": "on"}"#),
    );
    // One client config, so its session store carries the ticket over.
    let config = e.client_tls(H1);
    let mut kinds = Vec::new();
    for path in ["/first", "/second"] {
        let tcp = e.connect(SANDBOX_A, e.origins.api).await;
        let name = rustls::pki_types::ServerName::try_from("api.example.test").expect("name");
        let tls = tokio_rustls::TlsConnector::from(config.clone())
            .connect(name, tcp)
            .await
            .expect("handshake");
        kinds.push(tls.get_ref().1.handshake_kind());
        // Reading the response also reads the session ticket before it.
        let (status, body) = http_get(tls, false, "api.example.test", path)
            .await
            .expect("request");
        assert_eq!(status, 200);
        assert!(body.contains(&format!("GET {path}")), "{body}");
    }
    assert_eq!(
        kinds,
        [
            Some(rustls::HandshakeKind::Full),
            Some(rustls::HandshakeKind::Resumed)
        ]
    );
}

#[tokio::test]
async fn connect_and_trace_inside_an_intercepted_connection_are_refused() {
    let e = env(Options::default()).await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(r#"{"default": "allow", "tls_interception": "on"}"#),
    );
    // Over HTTP/2 a CONNECT's stream stays open, and its DATA frames would
    // otherwise go on to the origin as a body: a tunnel no per-request rule
    // reads.
    let mut s = intercepted_h2(&e, e.origins.api, "api.example.test").await;
    let req = hyper::Request::connect("api.example.test:443")
        .body(Full::new(Bytes::new()))
        .expect("request");
    let resp = s.send_request(req).await.expect("response");
    assert_eq!(resp.status(), 405, "HTTP/2 CONNECT");
    // An origin answering TRACE echoes the request it got, with whatever
    // credentials the gateway put in.
    let (head, body) = h2_send(&s, http::Method::TRACE, "https://api.example.test/").await;
    assert_eq!(head.status, 405, "HTTP/2 TRACE");
    assert!(body.starts_with("TRACE is not forwarded"), "{body}");
    let (tls, _) = e
        .tls(SANDBOX_A, e.origins.api, "api.example.test", H1)
        .await
        .expect("handshake");
    let (mut s, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .expect("http/1.1");
    tokio::spawn(conn);
    let req = hyper::Request::connect("api.example.test:443")
        .header("host", "api.example.test:443")
        .body(Full::new(Bytes::new()))
        .expect("request");
    let resp = s.send_request(req).await.expect("response");
    assert_eq!(resp.status(), 405, "HTTP/1.1 CONNECT");
    let _ = resp.into_body().collect().await;
    s.ready().await.expect("ready");
    let req = hyper::Request::builder()
        .method("TRACE")
        .uri("/")
        .header("host", "api.example.test")
        .body(Full::new(Bytes::new()))
        .expect("request");
    let resp = s.send_request(req).await.expect("response");
    assert_eq!(resp.status(), 405, "HTTP/1.1 TRACE");
    let _ = resp.into_body().collect().await;
    // In lower case, or named by a method override: refused all the same.
    for (method, header) in [
        ("trace", None),
        ("POST", Some("TRACE")),
        ("GET", Some("trace")),
        // Express's method-override takes the first item of a list.
        ("POST", Some("TRACE, GET")),
    ] {
        s.ready().await.expect("ready");
        let mut req = hyper::Request::builder()
            .method(method)
            .uri("/")
            .header("host", "api.example.test");
        if let Some(h) = header {
            req = req.header("x-http-method-override", h);
        }
        let req = req.body(Full::new(Bytes::new())).expect("request");
        let resp = s.send_request(req).await.expect("response");
        assert_eq!(resp.status(), 405, "{method} {header:?}");
        let _ = resp.into_body().collect().await;
    }
    s.ready().await.expect("ready");
    let req = hyper::Request::post("/?_method=TRACE")
        .header("host", "api.example.test")
        .body(Full::new(Bytes::new()))
        .expect("request");
    let resp = s.send_request(req).await.expect("response");
    assert_eq!(resp.status(), 405, "_method=TRACE");
    let _ = resp.into_body().collect().await;
    // A byte that is not UTF-8 after it (Node reads 0xA0 as a no-break
    // space, which method-override trims).
    s.ready().await.expect("ready");
    let odd = hyper::header::HeaderValue::from_bytes(b"TRACE\xa0").expect("obs-text");
    let req = hyper::Request::post("/")
        .header("host", "api.example.test")
        .header("x-http-method-override", odd)
        .body(Full::new(Bytes::new()))
        .expect("request");
    let resp = s.send_request(req).await.expect("response");
    assert_eq!(resp.status(), 405, "TRACE and 0xA0");
}

/// Sends `request` on a new plain-HTTP connection of sandbox A, shuts its
/// side, and reads the answer to the end.
async fn plain_raw(e: &Env, request: &[u8]) -> String {
    use tokio::io::AsyncReadExt;
    let mut tcp = e.connect(SANDBOX_A, e.origins.plain).await;
    tcp.write_all(request).await.expect("write");
    tcp.shutdown().await.expect("half-close");
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut answer))
        .await
        .expect("the connection ended")
        .expect("read");
    String::from_utf8_lossy(&answer).into_owned()
}

/// A client that shuts its side after its request (`nc -N`, an HTTP/1.0
/// script) still gets its answer, as it would going direct. Before, the
/// gateway gave up the request in flight at the client's FIN, and the
/// client read nothing.
#[tokio::test]
async fn a_client_that_half_closes_after_its_request_gets_the_answer() {
    let e = plain_allowed_evil_denied().await;
    // The origin answers `/wait` after 300 ms: the FIN comes first.
    let answer = plain_raw(
        &e,
        b"GET /wait HTTP/1.0\r\nHost: plain.example.test\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.0 200"), "{answer}");
    assert!(answer.contains("origin=plain GET /wait"), "{answer}");
}

/// A request with a transfer coding but chunked (`gzip, chunked`) is
/// refused `400`: the chunks are read and the header is hop-by-hop, so the
/// coded bytes would reach the origin with nothing saying so.
#[tokio::test]
async fn a_request_transfer_coded_but_chunked_is_refused() {
    let e = plain_allowed_evil_denied().await;
    let answer = plain_raw(
        &e,
        b"POST /coded HTTP/1.1\r\nHost: plain.example.test\r\nTransfer-Encoding: gzip, chunked\r\nConnection: close\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(!answer.contains("origin=plain"), "{answer}");
}
