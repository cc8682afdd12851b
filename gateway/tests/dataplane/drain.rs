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
