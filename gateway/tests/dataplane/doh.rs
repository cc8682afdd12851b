//! Encrypted DNS from a sandbox: DoH to a reserved resolver is answered by
//! the gateway and attributes what it resolves; DoH with interception off,
//! DoT and DoH to other resolvers are refused `encrypted_dns`.

use std::net::SocketAddr;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use hickory_proto::op::{Message, MessageType, OpCode, Query};
use hickory_proto::rr::{Name, RData, RecordType};
use serde_json::json;

use egress_policy::SandboxId;

use crate::harness::*;

const H1: &[&[u8]] = &[b"http/1.1"];
const H2: &[&[u8]] = &[b"h2"];

fn dns_google() -> SocketAddr {
    "8.8.8.8:443".parse().expect("addr")
}

/// A DoH query for `name` (id 0, as RFC 8484 asks).
fn query(name: &str) -> Vec<u8> {
    let mut q = Message::new(0, MessageType::Query, OpCode::Query);
    q.add_query(Query::query(
        Name::from_ascii(name).expect("name"),
        RecordType::A,
    ));
    q.to_vec().expect("encode")
}

/// The A records of a DoH answer body.
fn addresses(body: &[u8]) -> Vec<String> {
    let m = Message::from_vec(body).expect("a DNS message");
    m.answers
        .iter()
        .filter_map(|r| match &r.data {
            RData::A(a) => Some(a.to_string()),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn doh_to_a_reserved_resolver_is_answered_and_attributes() {
    let e = env(Options::default()).await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(
            r#"{"default": "deny", "tls_interception": "on",
                "allow": [{"ip": "8.8.8.8"}, {"wildcard_domain": "*.relay.example.test"}],
                "tls_interception_exemptions": [{"wildcard_domain": "*.relay.example.test"}]}"#,
        ),
    );
    // Before any DNS: the exemption by name cannot apply.
    let (_, minted) = e
        .tls(SANDBOX_A, e.origins.relay, "a.relay.example.test", H1)
        .await
        .expect("handshake");
    assert!(minted, "no attribution yet: terminated, not spliced");

    // DoH POST over HTTP/1.1 to dns.google at 8.8.8.8: a minted certificate,
    // the fake upstream's answer.
    let (tls, minted) = e
        .tls(SANDBOX_A, dns_google(), "dns.google", H1)
        .await
        .expect("handshake");
    assert!(minted, "the gateway terminates DoH");
    let (status, body) = http_post_bytes(
        tls,
        "dns.google",
        "/dns-query",
        "application/dns-message",
        query("a.relay.example.test."),
    )
    .await
    .expect("DoH POST");
    assert_eq!(status, 200);
    assert_eq!(addresses(&body), [RELAY_IP]);

    // ... which attributes: the exemption by name now splices.
    let (_, minted) = e
        .tls(SANDBOX_A, e.origins.relay, "a.relay.example.test", H1)
        .await
        .expect("handshake");
    assert!(
        !minted,
        "attributed through DoH: spliced, the origin's own certificate"
    );

    // DoH GET over HTTP/2; a path that is not DoH is answered 404, never forwarded.
    let (tls, _) = e
        .tls(SANDBOX_A, dns_google(), "dns.google", H2)
        .await
        .expect("handshake");
    let path = format!(
        "/dns-query?dns={}",
        URL_SAFE_NO_PAD.encode(query("relay.example.test."))
    );
    let (status, body) = http_get_bytes(tls, true, "dns.google", &path)
        .await
        .expect("DoH GET");
    assert_eq!((status, addresses(&body)), (200, vec![RELAY_IP.to_owned()]));
    let (tls, _) = e
        .tls(SANDBOX_A, dns_google(), "dns.google", H1)
        .await
        .expect("handshake");
    let (status, _) = http_get(tls, false, "dns.google", "/resolve?name=x.test")
        .await
        .expect("GET");
    assert_eq!(status, 404);

    let lines = e.flow_lines(5).await;
    let doh: Vec<_> = lines
        .iter()
        .filter(|l| l["sni"] == json!("dns.google"))
        .collect();
    assert_eq!(doh.len(), 3, "{lines:?}");
    for l in doh {
        assert_eq!(
            (&l["verdict"], &l["reason"]),
            (&json!("intercept"), &json!("doh_answered")),
            "{l}"
        );
    }
}

#[tokio::test]
async fn other_encrypted_dns_is_refused_unless_allowed_by_name() {
    let e = env(Options::default()).await;
    // Interception off: the gateway cannot answer DoH, so it refuses it.
    e.sandbox("off", SANDBOX_A, policy(r#"{"default": "allow"}"#));
    // Interception on, everything allowed by address.
    e.sandbox(
        "on",
        SANDBOX_B,
        policy(r#"{"default": "deny", "tls_interception": "on", "allow": [{"cidr": "127.0.0.0/24"}, {"ip": "8.8.8.8"}]}"#),
    );
    let dot: SocketAddr = format!("{API_IP}:853").parse().expect("addr");
    for (src, dst, sni) in [
        (SANDBOX_A, dns_google(), "dns.google"),
        (SANDBOX_A, dot, "dns.example.test"),
        (SANDBOX_B, dot, "dns.example.test"),
        (SANDBOX_B, e.origins.api, "dns.quad9.net"),
    ] {
        let refused = e.tls(src, dst, sni, H1).await;
        assert!(refused.is_err(), "{src} → {dst} ({sni}) was not refused");
    }
    let lines = e.flow_lines(4).await;
    for l in &lines {
        assert_eq!(
            (&l["verdict"], &l["reason"]),
            (&json!("deny"), &json!("encrypted_dns")),
            "{l}"
        );
    }
}

/// Sandbox A allowed to 8.8.8.8, and an HTTP/2 connection to its DoH,
/// terminated by the gateway.
async fn doh_over_h2(e: &Env) -> h2::client::SendRequest<bytes::Bytes> {
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(r#"{"default": "deny", "tls_interception": "on", "allow": [{"ip": "8.8.8.8"}]}"#),
    );
    let (tls, minted) = e
        .tls(SANDBOX_A, dns_google(), "dns.google", H2)
        .await
        .expect("handshake");
    assert!(minted, "terminated");
    let (client, conn) = h2::client::handshake(tls).await.expect("h2");
    tokio::spawn(conn);
    client
}

/// A DoH connection is its sandbox's registration's: once the id is
/// removed and registered again (same address), a query on the open
/// connection is refused `403`, not admitted as the new registration's (its
/// budget, its evidence).
#[tokio::test]
async fn a_doh_connection_ends_with_its_registration() {
    let e = env(Options::default()).await;
    let client = doh_over_h2(&e).await;
    let ask = |client: h2::client::SendRequest<bytes::Bytes>| async move {
        let mut client = client.ready().await.expect("ready");
        let path = format!(
            "https://dns.google/dns-query?dns={}",
            URL_SAFE_NO_PAD.encode(query("relay.example.test."))
        );
        let req = http::Request::get(path).body(()).expect("request");
        let (resp, _) = client.send_request(req, true).expect("stream");
        let resp = tokio::time::timeout(std::time::Duration::from_secs(5), resp)
            .await
            .expect("an answer in time")
            .expect("response");
        (resp.status().as_u16(), client)
    };
    let (status, client) = ask(client).await;
    assert_eq!(status, 200, "answered while registered");
    assert!(e.gateway.registry().remove(&SandboxId::new("a")));
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(r#"{"default": "deny", "tls_interception": "on", "allow": [{"ip": "8.8.8.8"}]}"#),
    );
    let (status, _) = ask(client).await;
    assert_eq!(status, 403, "a query of the removed registration");
}

/// A DoH body is read before its query can be judged: a source holds at
/// most 64 bodies being read at once (the 65th is refused `429`, and one
/// more fits once one is done), and a body past 4,096 bytes is refused
/// `413` as it arrives.
#[tokio::test]
async fn doh_bodies_being_read_are_bounded_per_source() {
    let e = env(Options::default()).await;
    let client = doh_over_h2(&e).await;
    let post = || {
        http::Request::post("https://dns.google/dns-query")
            .header("content-type", "application/dns-message")
            .body(())
            .expect("request")
    };
    let mut client = client.ready().await.expect("ready");
    // 64 bodies begun and never ended.
    let mut open = Vec::new();
    for _ in 0..64 {
        let (resp, mut body) = client.send_request(post(), false).expect("stream");
        body.send_data(bytes::Bytes::from_static(b"\0\0\x01"), false)
            .expect("data");
        open.push((resp, body));
        client = client.ready().await.expect("ready");
    }
    let whole = |client: &mut h2::client::SendRequest<bytes::Bytes>, body: Vec<u8>| {
        let (resp, mut stream) = client.send_request(post(), false).expect("stream");
        stream
            .send_data(bytes::Bytes::from(body), true)
            .expect("data");
        async move {
            let resp = tokio::time::timeout(std::time::Duration::from_secs(5), resp)
                .await
                .expect("an answer in time")
                .expect("response");
            resp.status().as_u16()
        }
    };
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let status = whole(&mut client, query("a.relay.example.test.")).await;
    assert_eq!(status, 429, "the 65th body being read");
    let (first, mut stream) = open.remove(0);
    stream
        .send_data(bytes::Bytes::from_static(b""), true)
        .expect("end");
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), first).await;
    let status = whole(&mut client, query("a.relay.example.test.")).await;
    assert_eq!(status, 200, "a place given back");
    let status = whole(&mut client, vec![0u8; 5_000]).await;
    assert_eq!(status, 413, "past 4,096 bytes");
}

/// A DoH POST begun over HTTP/2 from sandbox A: its answer, and its body
/// to send.
async fn doh_post(e: &Env) -> (h2::client::ResponseFuture, h2::SendStream<bytes::Bytes>) {
    let client = doh_over_h2(e).await;
    let mut client = client.ready().await.expect("ready");
    let req = http::Request::post("https://dns.google/dns-query")
        .header("content-type", "application/dns-message")
        .body(())
        .expect("request");
    client.send_request(req, false).expect("stream")
}

/// `resp` is `503` within 5 s, and the drain (`drained`) ends with no flow left.
async fn refused_while_draining(
    resp: h2::client::ResponseFuture,
    drained: tokio::task::JoinHandle<usize>,
) {
    let resp = tokio::time::timeout(std::time::Duration::from_secs(5), resp)
        .await
        .expect("an answer in time")
        .expect("response");
    assert_eq!(resp.status().as_u16(), 503);
    let left = tokio::time::timeout(std::time::Duration::from_secs(10), drained)
        .await
        .expect("the drain ends")
        .expect("drain");
    assert_eq!(left, 0);
}

/// A DoH query a draining gateway would answer is refused `503` instead:
/// the attribution it recorded would be lost to a successor, which has
/// taken it over by then (the client asks again, of the successor's DNS).
#[tokio::test]
async fn a_draining_gateway_answers_no_doh() {
    let e = env(Options::default()).await;
    // A query in flight (its body not yet whole) when the drain starts.
    let (resp, mut body) = doh_post(&e).await;
    let q = query("a.relay.example.test.");
    body.send_data(bytes::Bytes::copy_from_slice(&q[..4]), false)
        .expect("data");
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let Env {
        gateway, dns_asked, ..
    } = e;
    let drained = tokio::spawn(gateway.run_until(async {}));
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    body.send_data(bytes::Bytes::copy_from_slice(&q[4..]), true)
        .expect("data");
    refused_while_draining(resp, drained).await;
    // Refused before it was asked of the upstream, not only when answered.
    let asked = dns_asked.lock().expect("asked").clone();
    assert!(
        !asked.iter().any(|n| n == "a.relay.example.test"),
        "{asked:?}"
    );
}

/// A query whose upstream answer comes after the drain began is answered
/// `503` too: what the answer recorded may have missed the attribution a
/// successor took over, so the client asks the successor.
#[tokio::test]
async fn a_doh_answer_that_comes_after_the_drain_began_is_not_given() {
    let e = env(Options::default()).await;
    let (resp, mut body) = doh_post(&e).await;
    let q = query("slow.example.test.");
    body.send_data(bytes::Bytes::from(q), true).expect("data");
    // The upstream answers 600 ms after it is asked: the drain begins once
    // it has been (the check before the query has passed).
    let asked = || {
        let names = e.dns_asked.lock().expect("asked");
        names.iter().any(|n| n == "slow.example.test")
    };
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
    while !asked() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(asked(), "the upstream was asked");
    let Env { gateway, .. } = e;
    let drained = tokio::spawn(gateway.run_until(async {}));
    refused_while_draining(resp, drained).await;
}
