//! Proposals: denied flows and refused requests, seen from a sandbox, show
//! up in `GET /v1/sandboxes/{id}/proposals` with counts and examples; a
//! platform deny never does.

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::*;

const H1: &[&[u8]] = &[b"http/1.1"];

/// `GET path` on the admin listener: the status and the JSON body.
async fn admin_get(e: &Env, path: &str) -> (u16, Value) {
    admin(e, "GET", path).await
}

/// `method path` on the admin listener: the status and the JSON body.
async fn admin(e: &Env, method: &str, path: &str) -> (u16, Value) {
    let tcp = tokio::net::TcpStream::connect(e.gateway.bound().admin)
        .await
        .expect("admin");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .expect("http");
    tokio::spawn(conn);
    let req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "127.0.0.1")
        .body(Empty::<Bytes>::new())
        .expect("request");
    let resp = sender.send_request(req).await.expect("answer");
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    (status, serde_json::from_slice(&bytes).expect("json"))
}

fn find<'a>(doc: &'a Value, rule: &Value) -> Option<&'a Value> {
    doc["proposals"]
        .as_array()
        .expect("proposals")
        .iter()
        .find(|p| &p["rule"] == rule)
}

#[tokio::test]
async fn denied_names_requests_and_addresses_are_proposed_with_evidence() {
    let e = env(Options::default()).await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(
            r#"{"allow": [{"domain": "api.example.test", "http": "read_only"}],
                "tls_interception": "on"}"#,
        ),
    );
    // A name no entry allows (unresolved), twice.
    for _ in 0..2 {
        let denied = e
            .tls(SANDBOX_A, e.origins.relay, "relay.example.test", H1)
            .await;
        assert!(denied.is_err(), "no_allow_match: reset");
    }
    // A request the read-only entry does not cover.
    let (tls, minted) = e
        .tls(SANDBOX_A, e.origins.api, "api.example.test", H1)
        .await
        .expect("terminated");
    assert!(minted);
    let (status, _) = http_post(tls, "api.example.test", "/v1/%78?q=1", b"{}".to_vec())
        .await
        .expect("answer");
    assert_eq!(status, 403);
    // An address without any name: plain HTTP/1.0 without Host.
    let mut s = e.connect(SANDBOX_A, e.origins.plain).await;
    s.write_all(b"GET / HTTP/1.0\r\n\r\n").await.expect("write");
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer).await;
    assert!(answer.starts_with(b"HTTP/1.1 403"), "{answer:?}");
    // A platform deny.
    let platform = e.tls(
        SANDBOX_A,
        "10.0.0.1:443".parse().expect("addr"),
        "x.example.test",
        H1,
    );
    assert!(platform.await.is_err());

    let (status, doc) = admin_get(&e, "/v1/sandboxes/a/proposals").await;
    assert_eq!(status, 200, "{doc}");
    assert_eq!(doc["sandbox"], "a");
    assert_eq!(
        doc["proposals"].as_array().expect("list").len(),
        3,
        "{doc:#}"
    );

    let name = find(&doc, &json!({"domain": "relay.example.test"})).expect("the name");
    assert_eq!(name["count"], 2);
    // A domain allow exists and the sandbox never resolved this address.
    assert_eq!(name["reasons"], json!(["no_dns_seen"]));
    assert_eq!(name["examples"].as_array().expect("examples").len(), 2);
    assert_eq!(name["examples"][0]["sni"], "relay.example.test");
    assert_eq!(name["examples"][0]["dst"], e.origins.relay.to_string());
    assert!(name["id"].as_str().expect("id").starts_with("p-"));
    assert!(
        name["first_seen"].as_str().expect("time") <= name["last_seen"].as_str().expect("time")
    );

    let rule =
        json!({"domain": "api.example.test", "http": {"methods": ["POST"], "paths": ["/v1/x"]}});
    let request = find(&doc, &rule).expect("the request");
    assert_eq!(request["count"], 1);
    assert_eq!(request["reasons"], json!(["http_not_allowed"]));
    assert_eq!(request["examples"][0]["method"], "POST");
    assert_eq!(request["examples"][0]["path"], "/v1/x");

    let address = find(&doc, &json!({"ip": PLAIN_IP})).expect("the address");
    assert_eq!(address["count"], 1);

    assert!(
        find(&doc, &json!({"domain": "x.example.test"})).is_none(),
        "platform deny"
    );
    let (status, _) = admin_get(&e, "/v1/sandboxes/nope/proposals").await;
    assert_eq!(status, 404);
}

#[tokio::test]
async fn an_entry_the_policy_already_has_is_not_proposed() {
    // The name is allowed; the flow is denied because the sandbox never
    // resolved it through the gateway. Approving `{"domain": ..}` again
    // would add nothing, and the flow would stay denied.
    let e = env(Options::default()).await;
    e.sandbox(
        "b",
        SANDBOX_B,
        policy(r#"{"allow": [{"domain": "relay.example.test"}]}"#),
    );
    let denied = e
        .tls(SANDBOX_B, e.origins.relay, "relay.example.test", H1)
        .await;
    assert!(denied.is_err(), "no_dns_seen: reset");
    let (status, doc) = admin_get(&e, "/v1/sandboxes/b/proposals").await;
    assert_eq!(status, 200, "{doc}");
    assert_eq!(doc["proposals"], json!([]), "{doc:#}");
}

/// An entry past its `until` covers nothing: what it covered is proposed
/// again, whether or not the push that takes it out has come.
#[tokio::test]
async fn an_entry_past_its_until_does_not_hide_a_proposal() {
    let e = env(Options::default()).await;
    e.sandbox(
        "b",
        SANDBOX_B,
        policy(
            r#"{"allow": [{"domain": "relay.example.test", "until": "2001-01-01T00:00:00Z"}, {"domain": "api.example.test"}]}"#,
        ),
    );
    let denied = e
        .tls(SANDBOX_B, e.origins.relay, "relay.example.test", H1)
        .await;
    assert!(denied.is_err(), "the entry lapsed");
    let (status, doc) = admin_get(&e, "/v1/sandboxes/b/proposals").await;
    assert_eq!(status, 200, "{doc}");
    assert!(
        find(&doc, &json!({"domain": "relay.example.test"})).is_some(),
        "{doc:#}"
    );
}

#[tokio::test]
async fn proposals_go_with_their_sandbox() {
    let e = env(Options::default()).await;
    e.sandbox("a", SANDBOX_A, policy(r#"{"allow": []}"#));
    let denied = e
        .tls(SANDBOX_A, e.origins.relay, "relay.example.test", H1)
        .await;
    assert!(denied.is_err());
    let (_, doc) = admin_get(&e, "/v1/sandboxes/a/proposals").await;
    assert_eq!(doc["proposals"].as_array().expect("list").len(), 1);
    let (status, _) = admin(&e, "DELETE", "/v1/sandboxes/a").await;
    assert_eq!(status, 200);
    let (status, _) = admin_get(&e, "/v1/sandboxes/a/proposals").await;
    assert_eq!(status, 404);
    e.sandbox("a", SANDBOX_A, policy(r#"{"allow": []}"#));
    let (_, doc) = admin_get(&e, "/v1/sandboxes/a/proposals").await;
    assert_eq!(doc["proposals"], json!([]), "forgotten with the sandbox");
}
