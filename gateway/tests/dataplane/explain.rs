//! Explain cannot disagree with enforcement: for a table of flows, the
//! admin API's explain gives the verdict and reason the dataplane logged.

use std::net::SocketAddr;

use bytes::Bytes;
use egress_gateway::peek::fixture::{hello, records};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::*;

/// `POST /v1/explain` with `body`.
pub async fn explain(e: &Env, body: Value) -> Value {
    let tcp = tokio::net::TcpStream::connect(e.gateway.bound().admin)
        .await
        .expect("admin");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .expect("http");
    tokio::spawn(conn);
    let req = hyper::Request::post("/v1/explain")
        .header("host", "127.0.0.1")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("request");
    let resp = sender.send_request(req).await.expect("answer");
    assert_eq!(resp.status(), 200);
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    serde_json::from_slice(&bytes).expect("json")
}

/// One flow: a ClientHello naming `sni`, or a plain HTTP request for
/// `host`, or for the destination's address as its `Host`.
enum Send {
    Hello(&'static str),
    Get(&'static str),
    GetByAddress,
}

#[tokio::test]
async fn explain_gives_the_dataplanes_verdict_and_reason() {
    let api_dst = |e: &Env| e.origins.api;
    let relay_dst = |e: &Env| e.origins.relay;
    let plain_dst = |e: &Env| e.origins.plain;
    let platform_dst = |_: &Env| "10.0.0.1:443".parse::<SocketAddr>().expect("addr");
    type Row = (
        &'static str,
        Option<&'static str>,
        fn(&Env) -> SocketAddr,
        Send,
        &'static str,
        &'static str,
    );
    let intercept_on = r#"{"allow": [{"domain": "api.example.test"}, {"ip": "8.8.8.8"}], "tls_interception": "on"}"#;
    let exempt_relay = r#"{"default": "allow", "tls_interception": "on", "tls_interception_exemptions": [{"wildcard_domain": "*.relay.example.test"}]}"#;
    let rows: Vec<Row> = vec![
        (
            r#"{"allow": [{"cidr": "127.0.0.0/24"}]}"#,
            None,
            api_dst,
            Send::Hello("api.example.test"),
            "splice",
            "interception_off",
        ),
        (
            r#"{"allow": [{"cidr": "127.0.0.0/24"}], "tls_interception": "on"}"#,
            None,
            api_dst,
            Send::Hello("api.example.test"),
            "intercept",
            "not_exempt",
        ),
        (
            intercept_on,
            None,
            api_dst,
            Send::Hello("api.example.test"),
            "intercept",
            "needs_verification",
        ),
        (
            intercept_on,
            Some("api.example.test."),
            api_dst,
            Send::Hello("api.example.test"),
            "intercept",
            "not_exempt",
        ),
        (
            r#"{"allow": [{"domain": "api.example.test"}]}"#,
            None,
            api_dst,
            Send::Hello("api.example.test"),
            "deny",
            "no_dns_seen",
        ),
        (
            r#"{"default": "allow", "deny": [{"domain": "api.example.test"}]}"#,
            None,
            api_dst,
            Send::Hello("api.example.test"),
            "deny",
            "tenant_deny",
        ),
        (
            r#"{"default": "allow"}"#,
            None,
            platform_dst,
            Send::Hello("api.example.test"),
            "deny",
            "platform_deny",
        ),
        (
            exempt_relay,
            Some("a.relay.example.test."),
            relay_dst,
            Send::Hello("a.relay.example.test"),
            "splice",
            "exempt",
        ),
        (
            exempt_relay,
            Some("relay.example.test."),
            relay_dst,
            Send::Hello("a.relay.example.test"),
            "intercept",
            "not_exempt",
        ),
        (
            exempt_relay,
            None,
            relay_dst,
            Send::Hello("a.relay.example.test"),
            "intercept",
            "no_dns_seen",
        ),
        (
            r#"{"allow": [{"domain": "plain.example.test"}, {"ip": "8.8.8.8"}]}"#,
            Some("plain.example.test."),
            plain_dst,
            Send::Get("plain.example.test"),
            "allow",
            "allow_attributed_name",
        ),
        (
            r#"{"allow": [{"domain": "plain.example.test"}, {"ip": "8.8.8.8"}]}"#,
            None,
            plain_dst,
            Send::Get("plain.example.test"),
            "deny",
            "no_dns_seen",
        ),
        // An address for Host: HTTP with no name, which an address entry
        // letting no opaque stream through still allows.
        (
            r#"{"allow": [{"cidr": "127.0.0.0/8", "streams": []}]}"#,
            None,
            plain_dst,
            Send::GetByAddress,
            "allow",
            "allow_address",
        ),
    ];
    for (policy_json, resolve, dst, send, verdict, reason) in rows {
        let e = env(Options::default()).await;
        e.sandbox("a", SANDBOX_A, policy(policy_json));
        if let Some(name) = resolve {
            e.resolve(SANDBOX_A, name).await;
        }
        let dst = dst(&e);
        let mut s = e.connect(SANDBOX_A, dst).await;
        let question = match send {
            Send::Hello(sni) => {
                s.write_all(&records(&hello(Some(sni), &[], 0, false), 16_384))
                    .await
                    .expect("hello");
                json!({"sandbox": "a", "dst": dst, "tls": true, "sni": sni})
            }
            Send::Get(host) => {
                let req = format!("GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
                s.write_all(req.as_bytes()).await.expect("request");
                json!({"sandbox": "a", "dst": dst, "host": host})
            }
            Send::GetByAddress => {
                let host = dst.ip().to_string();
                let req = format!("GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
                s.write_all(req.as_bytes()).await.expect("request");
                json!({"sandbox": "a", "dst": dst, "host": host})
            }
        };
        let mut sink = Vec::new();
        let _ =
            tokio::time::timeout(std::time::Duration::from_secs(3), s.read_to_end(&mut sink)).await;
        drop(s);
        let line = e.flow_lines(1).await.remove(0);
        let answer = explain(&e, question).await;
        let case = format!("{policy_json} {resolve:?} → {line}");
        assert_eq!(
            (&line["verdict"], &line["reason"]),
            (&json!(verdict), &json!(reason)),
            "dataplane: {case}"
        );
        assert_eq!(
            (&answer["verdict"], &answer["reason"]),
            (&line["verdict"], &line["reason"]),
            "explain: {answer} vs {case}"
        );
        assert_eq!(answer["attributed"], line["attributed"], "{case}");
    }
}
