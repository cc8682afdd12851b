//! Requests and ClientHellos the gateway and an origin could read two ways
//! never pass: the request is refused (400/431) before anything is
//! forwarded, the hello is reset, and the flow log says why.

use std::time::Duration;

use bytes::Bytes;
use egress_gateway::peek::fixture::{hello_with, records, sni_data};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::json;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::harness::*;

const H1: &[&[u8]] = &[b"http/1.1"];
const H2: &[&[u8]] = &[b"h2"];

/// Intercepts everything; one denied name.
const INTERCEPT_BUT_DENIED: &str = r#"{"default": "allow", "tls_interception": "on",
    "deny": [{"domain": "denied.example.test"}]}"#;

/// Writes `request` as raw bytes and reads the answer until the peer closes.
async fn raw<S: AsyncRead + AsyncWrite + Unpin>(mut io: S, request: &[u8]) -> String {
    io.write_all(request).await.expect("write");
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), io.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// One HTTP/2 request with `:authority` and the given `host` headers.
async fn h2_request<S>(io: S, authority: &str, hosts: &[&str], extra: usize) -> (u16, String)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(io))
            .await
            .expect("h2 handshake");
    tokio::spawn(conn);
    let mut req = hyper::Request::builder().uri(format!("https://{authority}/two"));
    for h in hosts {
        req = req.header("host", *h);
    }
    if extra > 0 {
        req = req.header("x-big", "b".repeat(extra));
    }
    let resp = sender
        .send_request(req.body(Full::new(Bytes::new())).expect("request"))
        .await
        .expect("answer");
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test]
async fn http2_authority_and_host_must_name_the_same_host() {
    let e = env(Options::default()).await;
    e.sandbox("a", SANDBOX_A, policy(INTERCEPT_BUT_DENIED));
    // Both an HTTP/1.1-only origin (the gateway writes a Host for it) and an
    // HTTP/2 one (it writes an :authority).
    for (dst, name) in [
        (e.origins.h1_only, "h1.example.test"),
        (e.origins.api, "api.example.test"),
    ] {
        let (tls, _) = e.tls(SANDBOX_A, dst, name, H2).await.expect("handshake");
        let (status, body) = h2_request(tls, name, &["denied.example.test"], 0).await;
        assert_eq!(status, 400, "{name}: {body}");
        assert!(
            !body.contains("origin="),
            "nothing reached the origin: {body}"
        );
        assert!(body.contains("two hosts"), "{body}");

        // A host header that agrees (case, port) is forwarded as the one authority.
        let (tls, _) = e.tls(SANDBOX_A, dst, name, H2).await.expect("handshake");
        let upper = format!("{}:443", name.to_ascii_uppercase());
        let (status, body) = h2_request(tls, name, &[&upper], 0).await;
        assert_eq!(status, 200, "{body}");
        assert!(body.contains(&format!("host={name} ")), "{body}");

        // Two host headers, even equal ones.
        let (tls, _) = e.tls(SANDBOX_A, dst, name, H2).await.expect("handshake");
        let (status, body) = h2_request(tls, name, &[name, name], 0).await;
        assert_eq!(status, 400, "{body}");
    }
}

#[tokio::test]
async fn http1_with_two_hosts_or_a_disagreeing_target_gets_400_and_nothing_is_forwarded() {
    let e = env(Options::default()).await;
    e.sandbox("a", SANDBOX_A, policy(INTERCEPT_BUT_DENIED));
    let requests: [&[u8]; 5] = [
        b"GET /x HTTP/1.1\r\nHost: api.example.test\r\nHost: denied.example.test\r\nConnection: close\r\n\r\n",
        // The second Host hides behind a bare LF line ending.
        b"GET /x HTTP/1.1\r\nHost: api.example.test\r\nX-A: b\nHost: denied.example.test\r\nConnection: close\r\n\r\n",
        b"GET /x HTTP/1.1\r\nHost: api.example.test\r\nHost: api.example.test\r\nConnection: close\r\n\r\n",
        b"GET https://denied.example.test/x HTTP/1.1\r\nHost: api.example.test\r\nConnection: close\r\n\r\n",
        b"GET /x HTTP/1.1\r\nHost: api.example.test@denied.example.test\r\nConnection: close\r\n\r\n",
    ];
    for request in requests {
        let (tls, minted) = e
            .tls(SANDBOX_A, e.origins.api, "api.example.test", H1)
            .await
            .expect("handshake");
        assert!(minted);
        let answer = raw(tls, request).await;
        assert!(
            answer.starts_with("HTTP/1.1 400"),
            "{:?} → {answer}",
            String::from_utf8_lossy(request)
        );
        assert!(!answer.contains("origin="), "{answer}");
    }
    // An address as Host where the TLS server name named a host: 421.
    let (tls, _) = e
        .tls(SANDBOX_A, e.origins.api, "api.example.test", H1)
        .await
        .expect("handshake");
    let answer = raw(
        tls,
        format!("GET /x HTTP/1.1\r\nHost: {API_IP}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 421"), "{answer}");
    // The one agreeing claim is what the origin sees.
    let (tls, _) = e
        .tls(SANDBOX_A, e.origins.api, "api.example.test", H1)
        .await
        .expect("handshake");
    let answer = raw(
        tls,
        b"GET https://api.example.test/ok HTTP/1.1\r\nHost: API.example.test:443\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        answer.contains("origin=api GET /ok host=api.example.test "),
        "{answer}"
    );
    let lines = e.flow_lines(requests.len() + 2).await;
    assert_eq!(
        lines[0]["error"],
        json!("bad_request: more than one Host header"),
        "{lines:?}"
    );
}

#[tokio::test]
async fn request_heads_over_the_bound_get_431() {
    let e = env(Options::default()).await;
    e.sandbox("a", SANDBOX_A, policy(INTERCEPT_BUT_DENIED));
    let head = |extra: usize| {
        format!(
            "GET /x HTTP/1.1\r\nHost: api.example.test\r\nX-Big: {}\r\nConnection: close\r\n\r\n",
            "b".repeat(extra)
        )
        .into_bytes()
    };
    let (tls, _) = e
        .tls(SANDBOX_A, e.origins.api, "api.example.test", H1)
        .await
        .expect("handshake");
    let answer = raw(tls, &head(100 * 1024)).await;
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
    assert!(!answer.contains("origin="), "{answer}");
    // Under the bound it passes.
    let (tls, _) = e
        .tls(SANDBOX_A, e.origins.api, "api.example.test", H1)
        .await
        .expect("handshake");
    let answer = raw(tls, &head(40 * 1024)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

    // Plain HTTP, with the head larger than the peek reads.
    let s = e.connect(SANDBOX_A, e.origins.plain).await;
    let answer = raw(
        s,
        &format!(
            "GET /x HTTP/1.1\r\nHost: 127.0.0.14\r\nX-Big: {}\r\nConnection: close\r\n\r\n",
            "b".repeat(100 * 1024)
        )
        .into_bytes(),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");

    // HTTP/2: the header list is bounded the same way.
    let (tls, _) = e
        .tls(SANDBOX_A, e.origins.api, "api.example.test", H2)
        .await
        .expect("handshake");
    let (status, body) = h2_request(tls, "api.example.test", &[], 100 * 1024).await;
    assert_eq!(status, 431, "{body}");
    let (tls, _) = e
        .tls(SANDBOX_A, e.origins.api, "api.example.test", H2)
        .await
        .expect("handshake");
    let (status, body) = h2_request(tls, "api.example.test", &[], 40 * 1024).await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test]
async fn plain_http_with_two_hosts_is_refused_at_the_peek_and_per_request() {
    let e = env(Options::default()).await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(r#"{"allow": [{"domain": "plain.example.test"}, {"ip": "8.8.8.8"}]}"#),
    );
    e.resolve(SANDBOX_A, "plain.example.test.").await;
    let s = e.connect(SANDBOX_A, e.origins.plain).await;
    let answer = raw(
        s,
        b"GET / HTTP/1.1\r\nHost: plain.example.test\r\nHost: denied.example.test\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("more than one Host header"), "{answer}");
    let line = e.flow_lines(1).await.pop().expect("line");
    assert_eq!(
        (line["verdict"].clone(), line["reason"].clone()),
        (json!("deny"), json!("malformed_request"))
    );

    // A first request that passes, then one with two Hosts on the same connection.
    let s = e.connect(SANDBOX_A, e.origins.plain).await;
    let answer = raw(
        s,
        b"GET /1 HTTP/1.1\r\nHost: plain.example.test\r\n\r\nGET /2 HTTP/1.1\r\nHost: plain.example.test\r\nX: y\nHost: denied.example.test\r\n\r\nGET /3 HTTP/1.1\r\nHost: plain.example.test\r\n\r\n",
    )
    .await;
    assert!(
        answer.contains("origin=plain GET /1 host=plain.example.test"),
        "{answer}"
    );
    assert!(answer.contains("HTTP/1.1 400"), "{answer}");
    assert!(
        !answer.contains("GET /2") && !answer.contains("GET /3"),
        "nothing after the refused request is served: {answer}"
    );
}

#[tokio::test]
async fn a_client_hello_whose_server_name_reads_two_ways_is_reset_not_spliced() {
    let e = env(Options::default()).await;
    // An attributed-name exemption: a hello whose name the gateway read as
    // exempt (or as no name) would be spliced to the origin.
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(
            r#"{"default": "allow", "tls_interception": "on",
                "tls_interception_exemptions": [{"domain": "api.example.test"}]}"#,
        ),
    );
    e.resolve(SANDBOX_A, "api.example.test.").await;
    let sni = |name: &[u8]| (0x0000u16, sni_data(&[(0, name)]));
    let hellos = [
        (
            hello_with(&[sni(b"denied.example.test"), sni(b"api.example.test")]),
            "two server_name extensions",
        ),
        (
            hello_with(&[(
                0x0000,
                sni_data(&[(0, b"api.example.test"), (0, b"denied.example.test")]),
            )]),
            "more than one entry in the server_name list",
        ),
        (
            hello_with(&[sni(b"api.example.test\0.denied.example.test")]),
            "a NUL byte in the server name",
        ),
        (
            hello_with(&[sni(&[b'a'; 300])]),
            "a server name over 253 characters",
        ),
    ];
    for (hello, _) in &hellos {
        let mut s = e.connect(SANDBOX_A, e.origins.api).await;
        s.write_all(&records(hello, 16_384)).await.expect("write");
        assert!(
            closed_without_data(&mut s).await,
            "reset: no byte from the origin"
        );
    }
    let lines = e.flow_lines(hellos.len()).await;
    for (line, (_, why)) in lines.iter().zip(&hellos) {
        assert_eq!(
            (line["verdict"].clone(), line["reason"].clone()),
            (json!("deny"), json!("malformed_client_hello")),
            "{line}"
        );
        assert!(
            line["detail"].as_str().unwrap_or_default().contains(why),
            "{line}"
        );
    }
}

#[tokio::test]
async fn a_method_is_judged_in_every_form_an_origin_may_act_on() {
    // A lower-case method (servers that upper-case it act on DELETE), and a
    // POST whose override header names DELETE (frameworks that honour it).
    let e = env(Options::default()).await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(
            r#"{"allow": [{"domain": "plain.example.test"}, {"ip": "8.8.8.8"}],
                "deny": [{"domain": "plain.example.test", "http": {"methods": ["DELETE"]}}]}"#,
        ),
    );
    e.resolve(SANDBOX_A, "plain.example.test.").await;
    for head in [
        "delete /x HTTP/1.1\r\n",
        "POST /x HTTP/1.1\r\nX-HTTP-Method-Override: DELETE\r\n",
        "POST /x HTTP/1.1\r\nx-http-method: delete\r\n",
        "POST /x HTTP/1.1\r\nX-Method-Override: PATCH\r\nX-Method-Override:  DELETE \r\n",
        // The query's `_method` (Laravel, Symfony, Express's method-override).
        "POST /x?_method=DELETE HTTP/1.1\r\n",
        "POST /x?a=1&_method=%64elete+ HTTP/1.1\r\n",
        // Keys as PHP's $_GET reads them: `.` and blanks are `_`.
        "POST /x?.method=DELETE HTTP/1.1\r\n",
        "POST /x?+_method=DELETE HTTP/1.1\r\n",
        // ASP.NET reads the header's name in the query string too.
        "POST /x?x-http-method-override=DELETE HTTP/1.1\r\n",
    ] {
        let s = e.connect(SANDBOX_A, e.origins.plain).await;
        let req = format!(
            "{head}Host: plain.example.test\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
        let answer = raw(s, req.as_bytes()).await;
        assert!(answer.starts_with("HTTP/1.1 403"), "{head:?}: {answer}");
        assert!(answer.contains("http_deny"), "{answer}");
    }
    let s = e.connect(SANDBOX_A, e.origins.plain).await;
    let answer = raw(
        s,
        b"POST /x HTTP/1.1\r\nHost: plain.example.test\r\nX-HTTP-Method-Override: PUT\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    // A header that has an origin route by another path (IIS URL Rewrite,
    // ZF1) while per-request rules judge the target: refused.
    for extra in ["X-Original-URL: /admin\r\n", "x_rewrite_url: /admin\r\n"] {
        let s = e.connect(SANDBOX_A, e.origins.plain).await;
        let req = format!(
            "GET /x HTTP/1.1\r\n{extra}Host: plain.example.test\r\nConnection: close\r\n\r\n"
        );
        let answer = raw(s, req.as_bytes()).await;
        assert!(answer.starts_with("HTTP/1.1 400"), "{extra:?}: {answer}");
        assert!(answer.contains("names a path other"), "{answer}");
    }
    // More methods named than the gateway judges one by one: refused whole.
    let many: String = (0..17)
        .map(|i| format!("X-HTTP-Method: M{i}\r\n"))
        .collect();
    let s = e.connect(SANDBOX_A, e.origins.plain).await;
    let req = format!(
        "POST /x HTTP/1.1\r\n{many}Host: plain.example.test\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    let answer = raw(s, req.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("more than 16"), "{answer}");
    // The same under a policy with no per-request rule: the cap does not
    // wait for a rule (or a shadow) to be in place.
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(r#"{"allow": [{"domain": "plain.example.test"}, {"ip": "8.8.8.8"}]}"#),
    );
    let s = e.connect(SANDBOX_A, e.origins.plain).await;
    let answer = raw(s, req.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 400"), "no rule: {answer}");
    // A name with `_` that an origin taking `_` for `-` (Puma, CGI) reads
    // as an override, a framing header or another header of the request:
    // refused. One that reads as nothing else passes.
    for (extra, status) in [
        ("X-HTTP-Method_Override: DELETE\r\n", "400"),
        ("x_method_override: DELETE\r\n", "400"),
        ("Transfer_Encoding: chunked\r\n", "400"),
        ("X-Trace: 1\r\nX_Trace: 2\r\n", "400"),
        ("X_Trace: 1\r\n", "200"),
    ] {
        let s = e.connect(SANDBOX_A, e.origins.plain).await;
        let req = format!(
            "POST /x HTTP/1.1\r\n{extra}Host: plain.example.test\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
        let answer = raw(s, req.as_bytes()).await;
        assert!(
            answer.starts_with(&format!("HTTP/1.1 {status}")),
            "{extra:?}: {answer}"
        );
        if status == "400" {
            assert!(answer.contains("with '_' taken for '-'"), "{answer}");
        }
    }
}
