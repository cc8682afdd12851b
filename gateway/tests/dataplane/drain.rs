//! The drain: intercepted connections end at their next request boundary,
//! so the drain ends with them rather than at its deadline.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;

use crate::harness::*;

#[tokio::test]
async fn a_drain_ends_intercepted_connections_at_their_next_request_boundary() {
    let e = intercepting(&["goaway.example.test", "h1.example.test"]).await;
    // An HTTP/1.1 keep-alive connection, idle after one request.
    let mut h1 = h1_client(&e).await;
    assert_eq!(get_on(&mut h1, "h1.example.test", "/one").await.0, 200);
    // An HTTP/2 connection with a stream in flight (answered after a second).
    let h2 = intercepted_h2(&e, e.origins.goaway, "goaway.example.test").await;
    let slow = {
        let h2 = h2.clone();
        tokio::spawn(async move {
            let (head, body) =
                h2_send(&h2, http::Method::GET, "https://goaway.example.test/slow").await;
            (head.status.as_u16(), body)
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;

    // The drain (`timeouts.drain`: 30 s) ends with the two connections.
    let started = Instant::now();
    let Env { gateway, .. } = e;
    let left = gateway.run_until(async {}).await;
    let took = started.elapsed();
    assert_eq!(left, 0, "no flow left open");
    assert!(took < Duration::from_secs(5), "the drain took {took:?}");
    assert_eq!(
        slow.await.expect("slow"),
        (200, "conn=1".to_owned()),
        "the stream in flight finished"
    );
    // Both clients were told: the HTTP/1.1 connection is closed, the
    // HTTP/2 one takes no new request.
    assert!(
        h1_closed_within(&h1, Duration::from_secs(2)).await,
        "the idle HTTP/1.1 connection was closed"
    );
    let req = hyper::Request::get("https://goaway.example.test/next")
        .body(Full::new(Bytes::new()))
        .expect("request");
    let after = h2.clone().send_request(req).await;
    assert!(
        after.is_err(),
        "no request after the GOAWAY: {:?}",
        after.map(|r| r.status())
    );
}

/// A spliced flow still open when the drain's time runs out is reset, not
/// closed: a client reading to the end of the stream must not take the cut
/// for the end of a whole download. Its line is written, `drain_deadline`.
#[tokio::test]
async fn a_spliced_flow_open_at_the_drains_end_is_reset_and_logged() {
    let e = draining_in_a_second().await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(
            r#"{"default": "allow", "tls_interception": "on",
                "tls_interception_exemptions": [{"wildcard_domain": "*.relay.example.test"}]}"#,
        ),
    );
    e.resolve(SANDBOX_A, "a.relay.example.test.").await;
    let (mut tls, minted) = e
        .tls(
            SANDBOX_A,
            e.origins.relay,
            "a.relay.example.test",
            &[b"http/1.1"],
        )
        .await
        .expect("handshake");
    assert!(!minted, "spliced");
    let Env { gateway, flows, .. } = e;
    let left = gateway.run_until(async {}).await;
    assert_eq!(left, 1, "open at the deadline");
    // The client learns of a cut, not of an end.
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(
        Duration::from_secs(5),
        tokio::io::AsyncReadExt::read(&mut tls, &mut buf),
    )
    .await
    .expect("an answer");
    assert!(
        read.as_ref()
            .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
        "reset, not an end: {read:?}"
    );
    assert_drain_deadline_logged(&flows.records());
}

/// An intercepted request still in flight when the drain's time runs out
/// (an upload that never ends) does not outlast it: the connection ends,
/// and its line is written, `drain_deadline`.
#[tokio::test]
async fn an_intercepted_request_open_at_the_drains_end_is_cut_and_logged() {
    use tokio::io::AsyncWriteExt;
    let e = draining_in_a_second().await;
    e.sandbox("a", SANDBOX_A, intercepting_policy(&["h1.example.test"]));
    e.resolve(SANDBOX_A, "h1.example.test.").await;
    let mut tls = h1_upload(&e).await;
    // A chunk every 200 ms for at most 15 s, until the gateway ends it.
    let trickle = tokio::spawn(async move {
        for _ in 0..75 {
            if tls.write_all(b"1\r\nx\r\n").await.is_err() || tls.flush().await.is_err() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        false
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let Env { gateway, flows, .. } = e;
    let left = gateway.run_until(async {}).await;
    assert_eq!(left, 1, "open at the deadline");
    assert!(trickle.await.expect("trickle"), "the upload was cut");
    assert_drain_deadline_logged(&flows.records());
}

/// A gateway whose drain lasts a second (`timeouts.drain`).
async fn draining_in_a_second() -> Env {
    env(Options {
        drain: "1s",
        ..Options::default()
    })
    .await
}

/// Some flow's line says it was cut at the drain's deadline.
fn assert_drain_deadline_logged(lines: &[serde_json::Value]) {
    assert!(
        lines.iter().any(|l| l["error"]
            .as_str()
            .is_some_and(|e| e.contains("drain_deadline"))),
        "{lines:?}"
    );
}
