//! Budgets: a sandbox over its request budget gets `429`, another sandbox
//! does not notice, the budget refills on the gateway's clock; a spliced
//! bulk transfer is cut at its byte budget and the next flow is refused.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::*;

const H1: &[&[u8]] = &[b"http/1.1"];

/// One HTTP/1.1 GET on a kept-alive stream: the response head and body, as text.
async fn get<S>(s: &mut S, host: &str, path: &str) -> String
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let req = format!("GET {path} HTTP/1.1\r\nhost: {host}\r\n\r\n");
    s.write_all(req.as_bytes()).await.expect("write");
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .expect("an answer in time")
            .expect("read");
        assert!(n > 0, "closed: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&got);
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let len: usize = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length: ")
                        .map(|v| v.trim().parse().expect("length"))
                })
                .unwrap_or(0);
            if body.len() >= len {
                return text.into_owned();
            }
        }
    }
}

#[tokio::test]
async fn a_loop_over_its_request_budget_gets_429_and_the_other_sandbox_does_not() {
    let e = env(Options::default()).await;
    let p = r#"{"default": "deny", "tls_interception": "on",
        "allow": [{"domain": "api.example.test"}, {"ip": "8.8.8.8"}, {"ip": "1.1.1.1"}],
        "budgets": [{"destination": "other.example.test", "requests_per_minute": 100},
                    {"destination": "*.example.test", "requests_per_minute": 3}]}"#;
    e.sandbox("sb-a", SANDBOX_A, policy(p));
    e.sandbox("sb-b", SANDBOX_B, policy(p));
    let (mut a, _) = e
        .tls(SANDBOX_A, e.origins.api, "api.example.test", H1)
        .await
        .expect("handshake");
    for i in 0..3 {
        let r = get(&mut a, "api.example.test", "/loop").await;
        assert!(r.starts_with("HTTP/1.1 200"), "request {i}: {r}");
    }
    let over = get(&mut a, "api.example.test", "/loop").await;
    assert!(over.starts_with("HTTP/1.1 429"), "{over}");
    assert!(
        over.contains("x-egress-denied: budget_exceeded; rule=1"),
        "{over}"
    );
    assert!(over.contains("\"code\":\"budget_exceeded\""), "{over}");
    // The connection stays open, and stays refused.
    let again = get(&mut a, "api.example.test", "/loop").await;
    assert!(again.starts_with("HTTP/1.1 429"), "{again}");
    // The other sandbox, same policy, has a budget of its own.
    let (mut b, _) = e
        .tls(SANDBOX_B, e.origins.api, "api.example.test", H1)
        .await
        .expect("handshake");
    for i in 0..3 {
        let r = get(&mut b, "api.example.test", "/other").await;
        assert!(r.starts_with("HTTP/1.1 200"), "sandbox b, request {i}: {r}");
    }
    // 3 a minute: a request's worth is back after 20 s on the gateway's clock.
    e.clock.advance(Duration::from_secs(20));
    let refilled = get(&mut a, "api.example.test", "/loop").await;
    assert!(refilled.starts_with("HTTP/1.1 200"), "{refilled}");
    let next = get(&mut a, "api.example.test", "/loop").await;
    assert!(next.starts_with("HTTP/1.1 429"), "{next}");
    drop((a, b));
    let text = scrape(&e).await;
    assert!(
        text.contains("egress_budget_exceeded_total{kind=\"requests\"} 3"),
        "{text}"
    );
    assert!(text.contains("egress_budget_states 2"), "{text}");
    let lines = e.flow_lines(1).await;
    let a_line = lines
        .iter()
        .find(|l| l["src"].as_str().is_some_and(|s| s.starts_with(SANDBOX_A)))
        .expect("sandbox a's flow");
    assert!(
        a_line["request_denied"]
            .as_str()
            .is_some_and(|d| d.starts_with("budget_exceeded budgets[1]")),
        "{a_line}"
    );
    // A push that takes the entry in front away moves `*.example.test` to
    // index 0: its spent state goes with it, not to whatever entry holds
    // its old index now.
    let moved = r#"{"default": "deny", "tls_interception": "on",
        "allow": [{"domain": "api.example.test"}, {"ip": "8.8.8.8"}, {"ip": "1.1.1.1"}],
        "budgets": [{"destination": "*.example.test", "requests_per_minute": 3}]}"#;
    e.sandbox("sb-a", SANDBOX_A, policy(moved));
    let (mut a, _) = e
        .tls(SANDBOX_A, e.origins.api, "api.example.test", H1)
        .await
        .expect("handshake");
    let still = get(&mut a, "api.example.test", "/loop").await;
    assert!(
        still.starts_with("HTTP/1.1 429") && still.contains("budget_exceeded; rule=0"),
        "still spent: {still}"
    );
}

#[tokio::test]
async fn a_spliced_bulk_transfer_is_cut_at_its_byte_budget_and_the_next_flow_refused() {
    let e = env(Options::default()).await;
    const BUDGET: u64 = 256 * 1024;
    let p = format!(
        r#"{{"default": "allow", "tls_interception": "on",
        "tls_interception_exemptions": [{{"wildcard_domain": "*.relay.example.test"}}],
        "budgets": [{{"destination": "*.relay.example.test", "bytes_per_hour": {BUDGET}}}]}}"#
    );
    e.sandbox("sb-a", SANDBOX_A, policy(&p));
    e.sandbox("sb-b", SANDBOX_B, policy(&p));
    e.resolve(SANDBOX_A, "a.relay.example.test.").await;
    e.resolve(SANDBOX_B, "a.relay.example.test.").await;
    let (mut tls, minted) = e
        .tls(SANDBOX_A, e.origins.relay, "a.relay.example.test", H1)
        .await
        .expect("handshake");
    assert!(!minted, "spliced: the origin's own certificate");
    let req = "GET /bytes/4194304 HTTP/1.1\r\nhost: a.relay.example.test\r\n\r\n";
    tls.write_all(req.as_bytes()).await.expect("write");
    let mut got = 0u64;
    let mut buf = vec![0u8; 64 * 1024];
    let cut = loop {
        match tokio::time::timeout(Duration::from_secs(5), tls.read(&mut buf)).await {
            Ok(Ok(0)) => break false,
            Ok(Ok(n)) => got += n as u64,
            Ok(Err(_)) => break true,
            Err(_) => panic!("neither cut nor done after {got} bytes"),
        }
    };
    assert!(cut, "reset, not closed: {got} bytes");
    assert!(got > 64 * 1024, "bytes flowed before the cut: {got}");
    assert!(got <= BUDGET, "at most the budget: {got}");
    // The next flow to a covered name is refused at connect.
    let refused = e
        .tls(SANDBOX_A, e.origins.relay, "a.relay.example.test", H1)
        .await;
    assert!(refused.is_err(), "the next flow is refused");
    // Another sandbox, same budget, downloads within its own.
    let (b, _) = e
        .tls(SANDBOX_B, e.origins.relay, "a.relay.example.test", H1)
        .await
        .expect("handshake");
    let (status, body) = http_get_bytes(b, false, "a.relay.example.test", "/bytes/131072")
        .await
        .expect("sandbox b's download");
    assert_eq!((status, body.len()), (200, 128 * 1024));
    let lines = e.flow_lines(3).await;
    let errors: Vec<&str> = lines.iter().filter_map(|l| l["error"].as_str()).collect();
    assert!(
        errors
            .iter()
            .any(|e| e.starts_with("budget_exceeded: budgets[0]")),
        "{lines:?}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l["reason"] == "budget_exceeded" && l["verdict"] == "deny"),
        "{lines:?}"
    );
    let text = scrape(&e).await;
    assert!(
        text.contains("egress_budget_exceeded_total{kind=\"bytes\"} 2"),
        "{text}"
    );
}

/// A `Host` claimed over plain HTTP (or an SNI on a spliced flow) that is
/// not attributed to the address may add an entry, never take the flow out
/// of the one its evidence falls under: it makes the budget stricter, never
/// looser.
#[tokio::test]
async fn a_claimed_name_makes_the_budget_stricter_never_looser() {
    let e = env(Options::default()).await;
    let p = r#"{"default": "allow",
        "budgets": [{"destination": "generous.example.test", "requests_per_minute": 100000},
                    {"destination": "*", "requests_per_minute": 2}]}"#;
    e.sandbox("sb-a", SANDBOX_A, policy(p));
    let mut s = e.connect(SANDBOX_A, e.origins.plain).await;
    for i in 0..2 {
        let r = get(&mut s, "generous.example.test", "/").await;
        assert!(r.starts_with("HTTP/1.1 200"), "request {i}: {r}");
    }
    let over = get(&mut s, "generous.example.test", "/").await;
    assert!(
        over.starts_with("HTTP/1.1 429") && over.contains("budget_exceeded; rule=1"),
        "the claim is no evidence: {over}"
    );
    // An entry only a claim covers still applies to what claims it.
    let p = r#"{"default": "allow",
        "budgets": [{"destination": "*.relay.example.test", "requests_per_minute": 2}]}"#;
    e.sandbox("sb-b", SANDBOX_B, policy(p));
    let mut s = e.connect(SANDBOX_B, e.origins.plain).await;
    for i in 0..2 {
        let r = get(&mut s, "x.relay.example.test", "/").await;
        assert!(r.starts_with("HTTP/1.1 200"), "request {i}: {r}");
    }
    let over = get(&mut s, "x.relay.example.test", "/").await;
    assert!(
        over.starts_with("HTTP/1.1 429") && over.contains("budget_exceeded; rule=0"),
        "{over}"
    );
}

/// A request refused by the entry its claim chose still charges the bytes
/// moved before it to its evidence's entry: they are not lost with the
/// refusal.
#[tokio::test]
async fn bytes_refused_on_a_claims_entry_still_reach_the_evidences() {
    let e = env(Options::default()).await;
    let p = r#"{"default": "allow",
        "budgets": [{"destination": "pypi.example.test", "requests_per_minute": 1},
                    {"destination": "*", "bytes_per_hour": 204800}]}"#;
    e.sandbox("sb-a", SANDBOX_A, policy(p));
    let mut s = e.connect(SANDBOX_A, e.origins.plain).await;
    let first = get(&mut s, "pypi.example.test", "/").await;
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    let big = get(&mut s, "x.example.test", "/bytes/250000").await;
    assert!(big.starts_with("HTTP/1.1 200"), "{}", &big[..64]);
    // The claim's entry is spent: 429, and the 250 kB go to `*` all the same.
    let spent = get(&mut s, "pypi.example.test", "/").await;
    assert!(spent.contains("budget_exceeded; rule=0"), "{spent}");
    let after = get(&mut s, "x.example.test", "/").await;
    assert!(
        after.starts_with("HTTP/1.1 429") && after.contains("budget_exceeded; rule=1"),
        "the bytes were charged to `*`: {after}"
    );
}

/// The budgets of [`a_response_is_charged_to_its_own_requests_entry`] and
/// the tests after it: a byte budget on the relay, a request budget with no
/// byte limit on the api.
const RELAY_BYTES_API_REQUESTS: &str = r#"{"default": "allow",
    "budgets": [{"destination": "relay.example.test", "bytes_per_hour": 204800},
                {"destination": "api.example.test", "requests_per_minute": 600}]}"#;

/// A response is charged to the entries of the request it answers, not to
/// those of the next request on the connection: a download from the
/// byte-limited relay followed by a request to the api (whose entry limits
/// no bytes) still spends the relay's bytes.
#[tokio::test]
async fn a_response_is_charged_to_its_own_requests_entry() {
    let e = env(Options::default()).await;
    e.sandbox("sb-a", SANDBOX_A, policy(RELAY_BYTES_API_REQUESTS));
    let mut s = e.connect(SANDBOX_A, e.origins.plain).await;
    let big = get(&mut s, "relay.example.test", "/bytes/250000").await;
    assert!(big.starts_with("HTTP/1.1 200"), "{}", &big[..64]);
    let api = get(&mut s, "api.example.test", "/").await;
    assert!(api.starts_with("HTTP/1.1 200"), "{api}");
    let relay = get(&mut s, "relay.example.test", "/").await;
    assert!(
        relay.starts_with("HTTP/1.1 429") && relay.contains("budget_exceeded; rule=0"),
        "the download was charged to the relay: {relay}"
    );
    let api = get(&mut s, "api.example.test", "/").await;
    assert!(
        api.starts_with("HTTP/1.1 200"),
        "the api's entry is not: {api}"
    );
}

/// HTTP/2 streams on one connection are each charged their own bodies: a
/// request to the api opened while a download from the relay is in flight
/// does not take the download's bytes, and a stream that crosses its byte
/// budget runs to its end (terminated flows are bounded request by
/// request), the next request to the relay refused.
#[tokio::test]
async fn http2_streams_are_each_charged_their_own_bytes() {
    let e = env(Options::default()).await;
    e.sandbox("sb-a", SANDBOX_A, policy(RELAY_BYTES_API_REQUESTS));
    // A stream window of 64 KiB: the download moves only as it is read,
    // most of it after the api's request was judged.
    let tcp = e.connect(SANDBOX_A, e.origins.plain).await;
    let (s, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .adaptive_window(false)
        .initial_stream_window_size(65_535)
        .initial_connection_window_size(4 << 20)
        .handshake(TokioIo::new(tcp))
        .await
        .expect("http/2");
    tokio::spawn(conn);
    let get = |uri: &str| {
        hyper::Request::builder()
            .uri(uri)
            .body(Full::new(Bytes::new()))
            .expect("request")
    };
    // The download's head, its body not read yet.
    let download = s
        .clone()
        .send_request(get("http://relay.example.test/bytes/600000"))
        .await
        .expect("the download's head");
    assert_eq!(download.status(), 200);
    let (head, body) = h2_send(&s, http::Method::GET, "http://api.example.test/").await;
    assert_eq!(head.status, 200, "{body}");
    let body = download
        .into_body()
        .collect()
        .await
        .expect("the whole download")
        .to_bytes();
    assert_eq!(body.len(), 600_000, "not cut");
    let (head, body) = h2_send(&s, http::Method::GET, "http://api.example.test/").await;
    assert_eq!(head.status, 200, "the api's entry limits no bytes: {body}");
    let (head, body) = h2_send(&s, http::Method::GET, "http://relay.example.test/").await;
    assert_eq!(head.status, 429, "the download was the relay's: {body}");
    assert_eq!(
        head.headers["x-egress-denied"], "budget_exceeded; rule=0",
        "{body}"
    );
}

/// Two byte budgets, and the same two the other way round.
const RELAY_THEN_API: &str = r#"{"default": "allow",
    "budgets": [{"destination": "relay.example.test", "bytes_per_hour": 204800},
                {"destination": "api.example.test", "bytes_per_hour": 204800}]}"#;
const API_THEN_RELAY: &str = r#"{"default": "allow",
    "budgets": [{"destination": "api.example.test", "bytes_per_hour": 204800},
                {"destination": "relay.example.test", "bytes_per_hour": 204800}]}"#;

/// An entry's bytes follow its destination: a push that reorders the list
/// between a download and the next request charges the download to the
/// relay's entry, wherever it now stands.
#[tokio::test]
async fn a_reorder_between_two_requests_does_not_move_the_bytes() {
    let e = env(Options::default()).await;
    let (first, reordered) = (RELAY_THEN_API, API_THEN_RELAY);
    e.sandbox("sb-a", SANDBOX_A, policy(first));
    let mut s = e.connect(SANDBOX_A, e.origins.plain).await;
    let big = get(&mut s, "relay.example.test", "/bytes/250000").await;
    assert!(big.starts_with("HTTP/1.1 200"), "{}", &big[..64]);
    e.sandbox("sb-a", SANDBOX_A, policy(reordered));
    let api = get(&mut s, "api.example.test", "/").await;
    assert!(
        api.starts_with("HTTP/1.1 200"),
        "the api was not charged: {api}"
    );
    let relay = get(&mut s, "relay.example.test", "/").await;
    assert!(
        relay.starts_with("HTTP/1.1 429") && relay.contains("budget_exceeded; rule=1"),
        "{relay}"
    );
}

/// Likewise when the connection ends after the push: what it moved since
/// its last request goes to that request's destination.
#[tokio::test]
async fn a_reorder_before_the_connection_ends_does_not_move_the_bytes() {
    let e = env(Options::default()).await;
    let (first, reordered) = (RELAY_THEN_API, API_THEN_RELAY);
    e.sandbox("sb-b", SANDBOX_B, policy(first));
    let mut s = e.connect(SANDBOX_B, e.origins.plain).await;
    let big = get(&mut s, "relay.example.test", "/bytes/250000").await;
    assert!(big.starts_with("HTTP/1.1 200"), "{}", &big[..64]);
    e.sandbox("sb-b", SANDBOX_B, policy(reordered));
    drop(s);
    e.flow_lines(1).await;
    let mut s = e.connect(SANDBOX_B, e.origins.plain).await;
    let api = get(&mut s, "api.example.test", "/").await;
    assert!(
        api.starts_with("HTTP/1.1 200"),
        "the api was not charged: {api}"
    );
    let relay = get(&mut s, "relay.example.test", "/").await;
    assert!(
        relay.starts_with("HTTP/1.1 429") && relay.contains("budget_exceeded; rule=1"),
        "{relay}"
    );
}

/// An HTTP/2 stream's body is charged once: by its stream, not again with
/// the connection's bytes when the next request is judged.
#[tokio::test]
async fn an_http2_body_is_charged_once() {
    let e = env(Options::default()).await;
    e.sandbox("sb-a", SANDBOX_A, policy(RELAY_BYTES_API_REQUESTS));
    let s = h2_client(e.connect(SANDBOX_A, e.origins.plain).await).await;
    let relay = |path: &str| format!("http://relay.example.test{path}");
    let (head, body) = h2_send(&s, http::Method::GET, &relay("/bytes/120000")).await;
    assert_eq!((head.status.as_u16(), body.len()), (200, 120_000));
    // 120 kB of 200 kB spent, not 240.
    let (head, body) = h2_send(&s, http::Method::GET, &relay("/bytes/60000")).await;
    assert_eq!(head.status, 200, "{body}");
    let (head, body) = h2_send(&s, http::Method::GET, &relay("/")).await;
    assert_eq!(head.status, 200, "{body}");
    let (head, body) = h2_send(&s, http::Method::GET, &relay("/bytes/60000")).await;
    assert_eq!(head.status, 200, "{body}");
    let (head, body) = h2_send(&s, http::Method::GET, &relay("/")).await;
    assert_eq!(head.status, 429, "240 kB of 200 kB: {body}");
}
