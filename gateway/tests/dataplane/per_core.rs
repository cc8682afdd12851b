//! `limits.thread_per_core`: flows and queries spread by the kernel over
//! the worker threads' own listeners are decided exactly as on one runtime,
//! against the one registry and attribution cache.

use serde_json::json;

use crate::harness::*;

const H1: &[&[u8]] = &[b"http/1.1"];

#[tokio::test]
async fn flows_and_queries_on_every_worker_thread_are_decided_alike() {
    let e = env(Options {
        workers: 2,
        ..Options::default()
    })
    .await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(r#"{"allow": [{"domain": "api.example.test"}, {"ip": "8.8.8.8"}], "tls_interception": "on"}"#),
    );
    // Each query comes from a new source port, so the kernel hands them to
    // either thread's socket; every answer lands in the one cache.
    for _ in 0..8 {
        let answer = e.resolve(SANDBOX_A, "api.example.test.").await;
        assert_eq!(answer.answers.len(), 1, "{answer:?}");
    }
    const ALLOWED: usize = 24;
    const DENIED: usize = 8;
    for _ in 0..ALLOWED {
        let (tls, minted) = e
            .tls(SANDBOX_A, e.origins.api, "api.example.test", H1)
            .await
            .expect("handshake");
        assert!(minted, "terminated with a minted certificate");
        let (status, _) = http_get(tls, false, "api.example.test", "/")
            .await
            .expect("request");
        assert_eq!(status, 200);
    }
    for _ in 0..DENIED {
        assert!(
            e.tls(SANDBOX_A, e.origins.relay, "relay.example.test", H1)
                .await
                .is_err(),
            "a name the policy does not allow is refused on every thread"
        );
    }
    let lines = e.flow_lines(ALLOWED + DENIED).await;
    let intercepted = lines
        .iter()
        .filter(|l| {
            l["verdict"] == json!("intercept") && l["attributed"] == json!(["api.example.test"])
        })
        .count();
    let denied = lines
        .iter()
        .filter(|l| l["verdict"] == json!("deny"))
        .count();
    assert_eq!((intercepted, denied), (ALLOWED, DENIED), "{lines:#?}");

    // Both threads took connections (32 source ports all hashing to one
    // listener: one chance in 2^31), and every one was counted once.
    let per_worker = [
        value(&e, r#"egress_worker_connections_total{worker="0"}"#).await,
        value(&e, r#"egress_worker_connections_total{worker="1"}"#).await,
    ];
    assert!(per_worker.iter().all(|&n| n > 0), "{per_worker:?}");
    assert_eq!(per_worker.iter().sum::<u64>(), (ALLOWED + DENIED) as u64);
}
