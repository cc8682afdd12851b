//! A push reaches open connections: each request on an intercepted
//! keep-alive connection is judged under its sandbox's registration as it
//! is when the request comes, and a sandbox deleted ends its connections.

use std::time::Duration;

use egress_policy::SandboxId;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::*;

/// The policy of [`intercepting`], with `extra` added to it.
fn allowing(extra: &str) -> egress_policy::Policy {
    policy(&format!(
        r#"{{"allow": [{{"domain": "goaway.example.test"}}, {{"domain": "h1.example.test"}},
                      {{"ip": "8.8.8.8"}}]{extra}, "tls_interception": "on"}}"#
    ))
}

#[tokio::test]
async fn a_push_applies_to_the_next_request_on_an_open_connection() {
    let e = intercepting(&["goaway.example.test", "h1.example.test"]).await;
    let mut h1 = h1_client(&e).await;
    let h2 = intercepted_h2(&e, e.origins.goaway, "goaway.example.test").await;
    let h2_get = |path: &'static str| {
        let h2 = h2.clone();
        async move {
            let uri = format!("https://goaway.example.test{path}");
            let (head, body) = h2_send(&h2, http::Method::GET, &uri).await;
            (head.status.as_u16(), body)
        }
    };
    assert_eq!(get_on(&mut h1, "h1.example.test", "/one").await.0, 200);
    assert_eq!(h2_get("/one").await.0, 200);

    // A deny of both names, pushed while both connections are open.
    e.sandbox(
        "a",
        SANDBOX_A,
        allowing(
            r#", "deny": [{"domain": "h1.example.test"}, {"domain": "goaway.example.test", "http": {"paths": ["/secret"]}}]"#,
        ),
    );
    let (status, body) = get_on(&mut h1, "h1.example.test", "/two").await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("tenant_deny"), "{body}");
    let (status, body) = h2_get("/secret").await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("http_deny"), "{body}");
    assert_eq!(h2_get("/public").await.0, 200, "the rest still passes");

    // Opened again: the same connection passes again.
    e.sandbox("a", SANDBOX_A, allowing(""));
    assert_eq!(get_on(&mut h1, "h1.example.test", "/three").await.0, 200);

    // Deleted: the next request is refused, and both connections end.
    assert!(e.gateway.registry().remove(&SandboxId::new("a")));
    let (status, body) = get_on(&mut h1, "h1.example.test", "/four").await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("unknown_sandbox"), "{body}");
    assert!(
        h1_closed_within(&h1, Duration::from_secs(3)).await,
        "the HTTP/1.1 connection was closed"
    );
    let after = h2
        .clone()
        .send_request(
            hyper::Request::get("https://goaway.example.test/five")
                .body(http_body_util::Full::new(bytes::Bytes::new()))
                .expect("request"),
        )
        .await;
    assert!(
        after.as_ref().map_or(true, |r| r.status() == 403),
        "refused or closed: {:?}",
        after.map(|r| r.status())
    );
    let lines = e.flow_lines(2).await;
    assert!(
        lines.iter().any(|l| l["request_denied"]
            .as_str()
            .is_some_and(|d| d.starts_with("tenant_deny"))),
        "{lines:?}"
    );
}

#[tokio::test]
async fn an_idle_connection_ends_when_its_sandbox_is_deleted() {
    let e = intercepting(&["h1.example.test"]).await;
    let mut h1 = h1_client(&e).await;
    assert_eq!(get_on(&mut h1, "h1.example.test", "/").await.0, 200);
    // Another sandbox on another address changes nothing for it.
    e.sandbox("b", SANDBOX_B, allowing(""));
    assert!(e.gateway.registry().remove(&SandboxId::new("b")));
    assert!(
        !h1_closed_within(&h1, Duration::from_millis(1500)).await,
        "still open while its sandbox is"
    );
    assert!(e.gateway.registry().remove(&SandboxId::new("a")));
    assert!(
        h1_closed_within(&h1, Duration::from_secs(3)).await,
        "closed within a tick of the delete"
    );
    // Its flow says why, as a spliced stream's does.
    let line = &e.flow_lines(1).await[0];
    assert_eq!(line["error"], "gateway_sandbox_removed", "{line}");
    assert_eq!(line["requests"], 1, "{line}");
}

/// A request that never ends (an upload trickling for ever) does not keep
/// its connection past its sandbox's delete: after the grace given to
/// requests in flight (5 s), the connection ends under it.
#[tokio::test]
async fn a_request_in_flight_ends_a_few_seconds_after_its_sandbox_is_deleted() {
    let e = intercepting(&["h1.example.test"]).await;
    let mut tls = h1_upload(&e).await;
    let cut = cut_while_trickling(&mut tls, || {
        assert!(e.gateway.registry().remove(&SandboxId::new("a")));
    })
    .await;
    cut_after_the_grace(&e, cut, Duration::from_secs(5), "gateway_sandbox_removed").await;
}

/// A request in flight (an upload trickling for ever) whose name a push
/// then denies is cut, as a WebSocket's bridge or a spliced stream is:
/// its connection stops at once and ends under it after a short grace.
/// (Before: it ran on for as long as the client kept it going.)
#[tokio::test]
async fn a_request_in_flight_is_cut_when_a_push_denies_it() {
    let e = intercepting(&["h1.example.test"]).await;
    let mut tls = h1_upload(&e).await;
    let cut = cut_while_trickling(&mut tls, || {
        // A per-request rule on the upload's own method (POST).
        e.sandbox("a", SANDBOX_A, denying_post());
    })
    .await;
    cut_after_the_grace(&e, cut, Duration::from_secs(1), "gateway_policy_withdrawn").await;
}

/// An upload naming another path in a header (`X-Original-URL`), let
/// through while the policy has no per-request rule, is cut by a push
/// that adds one: a request carrying it then would be refused.
#[tokio::test]
async fn a_request_naming_another_path_is_cut_when_a_push_adds_a_rule() {
    let e = intercepting(&["h1.example.test"]).await;
    let mut tls = h1_tls(&e).await;
    tls.write_all(b"POST /up HTTP/1.1\r\nHost: h1.example.test\r\nX-Original-URL: /admin\r\ntransfer-encoding: chunked\r\n\r\n")
        .await
        .expect("head");
    let cut = cut_while_trickling(&mut tls, || {
        // A per-request rule on another method: the upload's own is not refused.
        let rule = r#", "deny": [{"domain": "h1.example.test", "http": {"methods": ["DELETE"]}}]"#;
        e.sandbox("a", SANDBOX_A, allowing(rule));
    })
    .await;
    cut_after_the_grace(&e, cut, Duration::from_secs(1), "gateway_policy_withdrawn").await;
}

/// A drain does not stop the judging of what is in flight: an upload a
/// push refuses during the drain is cut after the grace, not carried on to
/// the drain's deadline (30 s here). Before, once a drain had told the
/// connection to stop, only the deadline and a delete could end it.
#[tokio::test]
async fn a_request_in_flight_is_cut_when_a_push_denies_it_during_a_drain() {
    let e = intercepting(&["h1.example.test"]).await;
    let mut tls = h1_upload(&e).await;
    let registry = e.gateway.registry().clone();
    let Env { gateway, flows, .. } = e;
    let drained = tokio::spawn(gateway.run_until(async {}));
    let cut = cut_while_trickling(&mut tls, || {
        let at = vec![SANDBOX_A.parse().expect("ip")];
        registry
            .put(SandboxId::new("a"), at, denying_post())
            .expect("put");
    })
    .await;
    let cut = cut.expect("the upload ran on for 15 s");
    assert!(
        cut >= Duration::from_secs(1),
        "not before the grace: {cut:?}"
    );
    let left = tokio::time::timeout(Duration::from_secs(10), drained)
        .await
        .expect("the drain ends once the upload is cut")
        .expect("drain");
    assert_eq!(left, 0);
    let line = flows.records().pop().expect("a line");
    assert_eq!(line["error"], "gateway_policy_withdrawn", "{line}");
}

/// On HTTP/2 every stream in flight is judged again after a push, not only
/// the last one let through: an upload the push refuses is cut, though a
/// request let through after it (and still allowed) has ended since.
#[tokio::test]
async fn an_http2_stream_in_flight_is_cut_whatever_came_after_it() {
    let e = intercepting(&["h1.example.test"]).await;
    let (tls, minted) = e
        .tls(SANDBOX_A, e.origins.h1_only, "h1.example.test", &[b"h2"])
        .await
        .expect("handshake");
    assert!(minted, "intercepted");
    let (mut client, h2_conn) = h2::client::handshake(tls).await.expect("h2");
    tokio::spawn(h2_conn);
    let post = http::Request::post("https://h1.example.test/up")
        .body(())
        .expect("request");
    let (_answer, mut upload) = client.send_request(post, false).expect("POST");
    upload
        .send_data(bytes::Bytes::from_static(b"x"), false)
        .expect("data");
    // A GET after it, let through, its answer read to the end.
    let get = http::Request::get("https://h1.example.test/")
        .body(())
        .expect("request");
    let (answer, _) = client.send_request(get, true).expect("GET");
    let answer = answer.await.expect("answer");
    assert_eq!(answer.status(), 200);
    let mut body = answer.into_body();
    while let Some(chunk) = body.data().await {
        chunk.expect("data");
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // A per-request rule on the upload's own method (POST).
    e.sandbox("a", SANDBOX_A, denying_post());
    let pushed = tokio::time::Instant::now();
    let mut cut = None;
    for _ in 0..75 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        if upload
            .send_data(bytes::Bytes::from_static(b"x"), false)
            .is_err()
        {
            cut = Some(pushed.elapsed());
            break;
        }
    }
    cut_after_the_grace(&e, cut, Duration::from_secs(1), "gateway_policy_withdrawn").await;
}

/// [`allowing`] with a per-request rule on `POST` to `h1.example.test`.
fn denying_post() -> egress_policy::Policy {
    allowing(r#", "deny": [{"domain": "h1.example.test", "http": {"methods": ["POST"]}}]"#)
}

/// Trickles an upload's chunks on `tls` (one every 200 ms, for at most
/// 15 s) and does `act` 600 ms in: how long after `act` the gateway cut
/// the upload, if it did.
async fn cut_while_trickling(
    tls: &mut tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
    act: impl FnOnce(),
) -> Option<Duration> {
    let mut act = Some(act);
    let mut since = None;
    for _ in 0..75 {
        if tls.write_all(b"1\r\nx\r\n").await.is_err() || tls.flush().await.is_err() {
            return since.map(|at: tokio::time::Instant| at.elapsed());
        }
        if let Some(act) = act.take() {
            tokio::time::sleep(Duration::from_millis(600)).await;
            act();
            since = Some(tokio::time::Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    None
}

/// A cut seen, no sooner than `grace`, and the flow's line naming `error`.
async fn cut_after_the_grace(e: &Env, cut: Option<Duration>, grace: Duration, error: &str) {
    let cut = cut.expect("the upload ran on for 15 s");
    assert!(cut >= grace, "not before the grace: {cut:?}");
    let line = &e.flow_lines(1).await[0];
    assert_eq!(line["error"], error, "{line}");
}

/// An origin address no other test uses.
const SPLICED_IP: &str = "127.0.0.19";

#[tokio::test]
async fn a_spliced_stream_runs_through_a_push_and_is_cut_when_its_sandbox_is_deleted() {
    let e = env(Options::default()).await;
    let allow = |extra: &str| {
        policy(&format!(
            r#"{{"allow": [{{"ip": "{SPLICED_IP}"}}{extra}]}}"#
        ))
    };
    e.sandbox("a", SANDBOX_A, allow(""));
    let origin = crate::streams::echo_origin(SPLICED_IP).await;
    let mut s = e.connect(SANDBOX_A, origin).await;
    let echo = |s: &'static [u8]| (s, vec![0u8; s.len()]);
    let (hello, mut back) = echo(b"hello");
    s.write_all(hello).await.expect("write");
    tokio::time::timeout(Duration::from_secs(3), s.read_exact(&mut back))
        .await
        .expect("echo in time")
        .expect("echo");
    assert_eq!(back, hello);

    // A push to its sandbox does not end it: it carries no request to judge.
    e.sandbox(
        "a",
        SANDBOX_A,
        allow(r#", {"domain": "other.example.test"}"#),
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (again, mut back) = echo(b"again");
    s.write_all(again).await.expect("write");
    tokio::time::timeout(Duration::from_secs(3), s.read_exact(&mut back))
        .await
        .expect("echo in time")
        .expect("echo");
    assert_eq!(back, again);

    assert!(e.gateway.registry().remove(&SandboxId::new("a")));
    assert!(closed_without_data(&mut s).await, "cut within a tick");
    let line = &e.flow_lines(1).await[0];
    assert_eq!(line["error"], "gateway_sandbox_removed", "{line}");
    assert_eq!(line["bytes_up"], 10, "{line}");
}

/// Writes `data` and reads its echo back within 3 s.
async fn echoed(s: &mut tokio::net::TcpStream, data: &[u8]) {
    let mut back = vec![0u8; data.len()];
    s.write_all(data).await.expect("write");
    tokio::time::timeout(Duration::from_secs(3), s.read_exact(&mut back))
        .await
        .expect("echo in time")
        .expect("echo");
    assert_eq!(back, data);
}

/// A spliced (here opaque) stream runs while its sandbox's policy lets it:
/// a push that takes out the entry it runs under cuts it within a tick,
/// and its line says why.
#[tokio::test]
async fn a_spliced_stream_is_cut_when_a_push_takes_its_allow_out() {
    let e = env(Options::default()).await;
    let allowed = format!(r#"{{"allow": [{{"ip": "{SPLICED_IP}"}}]}}"#);
    e.sandbox("a", SANDBOX_A, policy(&allowed));
    let origin = crate::streams::echo_origin(SPLICED_IP).await;
    let mut s = e.connect(SANDBOX_A, origin).await;
    echoed(&mut s, b"hello").await;
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(r#"{"allow": [{"domain": "other.example.test"}]}"#),
    );
    assert!(closed_without_data(&mut s).await, "cut within a tick");
    let line = &e.flow_lines(1).await[0];
    assert_eq!(line["error"], "gateway_policy_withdrawn", "{line}");
    assert_eq!(line["bytes_up"], 5, "{line}");
    let metrics = scrape(&e).await;
    assert!(
        metrics.contains(r#"egress_flow_errors_total{side="gateway",kind="policy_withdrawn"} 1"#),
        "{metrics}"
    );
}

/// A push that lowers (or adds) the byte budget a running stream is charged
/// under cuts it within a tick (its meter holds the limits it was made
/// with); a push that leaves that limit as it was does not.
#[tokio::test]
async fn a_spliced_stream_is_cut_when_a_push_changes_its_byte_budget() {
    let e = env(Options::default()).await;
    let with = |bytes: u64, other: &str| {
        format!(
            r#"{{"allow": [{{"ip": "{SPLICED_IP}"}}, {{"domain": "{other}"}}],
                "budgets": [{{"destination": "*", "bytes_per_hour": {bytes}}}]}}"#
        )
    };
    e.sandbox("a", SANDBOX_A, policy(&with(1 << 30, "x.example.test")));
    let origin = crate::streams::echo_origin(SPLICED_IP).await;
    let mut s = e.connect(SANDBOX_A, origin).await;
    echoed(&mut s, b"hello").await;
    // Another entry changed, the budget not: the stream runs on.
    e.sandbox("a", SANDBOX_A, policy(&with(1 << 30, "y.example.test")));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    echoed(&mut s, b"again").await;
    e.sandbox("a", SANDBOX_A, policy(&with(1 << 20, "y.example.test")));
    assert!(closed_without_data(&mut s).await, "cut within a tick");
    let line = &e.flow_lines(1).await[0];
    assert_eq!(line["error"], "gateway_policy_withdrawn", "{line}");
    assert_eq!(line["bytes_up"], 10, "{line}");
}

/// A spliced stream whose destination becomes another sandbox's address
/// (a platform deny: no sandbox reaches another through the gateway) is
/// cut within a tick, though its own sandbox's policy did not change.
#[tokio::test]
async fn a_spliced_stream_is_cut_when_its_destination_becomes_a_sandboxs_address() {
    let e = env(Options::default()).await;
    let allowed = format!(r#"{{"allow": [{{"ip": "{SPLICED_IP}"}}]}}"#);
    e.sandbox("a", SANDBOX_A, policy(&allowed));
    let origin = crate::streams::echo_origin(SPLICED_IP).await;
    let mut s = e.connect(SANDBOX_A, origin).await;
    echoed(&mut s, b"hello").await;
    // Another sandbox registered elsewhere: still open.
    e.sandbox("c", "127.0.0.29", policy(&allowed));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    echoed(&mut s, b"again").await;
    e.sandbox("b", SPLICED_IP, policy(&allowed));
    assert!(closed_without_data(&mut s).await, "cut within a tick");
    let line = &e.flow_lines(1).await[0];
    assert_eq!(line["error"], "gateway_policy_withdrawn", "{line}");
    assert_eq!(line["bytes_up"], 10, "{line}");
}

/// Sandbox A allowed to the echo origin at `SPLICED_IP` by an entry whose
/// `until` is 2 s ahead, and a stream to it spliced (an echo read back).
async fn spliced_until_soon() -> (Env, tokio::net::TcpStream) {
    let e = env(Options::default()).await;
    let rfc3339 = time::format_description::well_known::Rfc3339;
    let soon = (time::OffsetDateTime::now_utc() + time::Duration::seconds(2))
        .format(&rfc3339)
        .expect("format");
    let p = format!(
        r#"{{"allow": [{{"ip": "{SPLICED_IP}", "until": "{soon}"}}, {{"domain": "other.example.test"}}]}}"#
    );
    e.sandbox("a", SANDBOX_A, policy(&p));
    let origin = crate::streams::echo_origin(SPLICED_IP).await;
    let mut s = e.connect(SANDBOX_A, origin).await;
    echoed(&mut s, b"before").await;
    (e, s)
}

/// An allow entry's `until` ends the spliced streams it let through, with no
/// push: the registry compiles the policy again, and the stream is judged
/// under it.
#[tokio::test]
async fn a_spliced_stream_ends_at_its_entrys_until() {
    let (e, mut s) = spliced_until_soon().await;
    let mut buf = [0u8; 16];
    let read = tokio::time::timeout(Duration::from_secs(6), s.read(&mut buf)).await;
    assert!(
        matches!(read, Ok(Ok(0) | Err(_))),
        "cut after the until: {read:?}"
    );
    let line = &e.flow_lines(1).await[0];
    assert_eq!(line["error"], "gateway_policy_withdrawn", "{line}");
}

/// During a drain too: the lapse watch goes on while the flows drain, so a
/// spliced stream an entry let through ends at the entry's `until`, not at
/// the end of the drain (30 s here).
#[tokio::test]
async fn a_spliced_stream_draining_ends_at_its_entrys_until() {
    let (e, mut s) = spliced_until_soon().await;
    let Env { gateway, flows, .. } = e;
    let drained = tokio::spawn(gateway.run_until(async {}));
    let mut buf = [0u8; 16];
    let read = tokio::time::timeout(Duration::from_secs(6), s.read(&mut buf)).await;
    assert!(
        matches!(read, Ok(Ok(0) | Err(_))),
        "cut at the until while draining: {read:?}"
    );
    let left = tokio::time::timeout(Duration::from_secs(10), drained)
        .await
        .expect("the drain ends once the stream is cut")
        .expect("drain");
    assert_eq!(left, 0);
    let line = flows.records().pop().expect("a line");
    assert_eq!(line["error"], "gateway_policy_withdrawn", "{line}");
}

/// A TLS stream spliced by an exemption is cut when a push takes the
/// exemption out: it would be terminated now, and the gateway cannot start
/// reading a stream already spliced. Its client connects again and is.
#[tokio::test]
async fn a_spliced_tls_stream_is_cut_when_its_exemption_is_taken_out() {
    let e = env(Options::default()).await;
    let exempting = |exemptions: &str| {
        policy(&format!(
            r#"{{"default": "allow", "tls_interception": "on", "tls_interception_exemptions": [{exemptions}]}}"#
        ))
    };
    e.sandbox(
        "a",
        SANDBOX_A,
        exempting(r#"{"wildcard_domain": "*.relay.example.test"}"#),
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
    // Another exemption pushed: this one still splices.
    e.sandbox(
        "a",
        SANDBOX_A,
        exempting(r#"{"wildcard_domain": "*.relay.example.test"}, {"domain": "x.example.test"}"#),
    );
    let mut buf = [0u8; 64];
    let idle = tokio::time::timeout(
        Duration::from_millis(1500),
        tokio::io::AsyncReadExt::read(&mut tls, &mut buf),
    )
    .await;
    assert!(idle.is_err(), "still open: {idle:?}");
    e.sandbox("a", SANDBOX_A, exempting(r#"{"domain": "x.example.test"}"#));
    let read = tokio::time::timeout(
        Duration::from_secs(3),
        tokio::io::AsyncReadExt::read(&mut tls, &mut buf),
    )
    .await;
    assert!(
        matches!(read, Ok(Ok(0) | Err(_))),
        "cut within a tick: {read:?}"
    );
    let line = &e.flow_lines(1).await[0];
    assert_eq!(line["error"], "gateway_policy_withdrawn", "{line}");
    let (_, minted) = e
        .tls(
            SANDBOX_A,
            e.origins.relay,
            "a.relay.example.test",
            &[b"http/1.1"],
        )
        .await
        .expect("handshake");
    assert!(minted, "connected again: terminated");
}

/// A flow is decided under the registration as it is after its peek: a
/// deny pushed while the client had sent nothing yet applies to it (and
/// one pushed later cuts it: see above).
#[tokio::test]
async fn a_push_during_the_peek_decides_the_flow() {
    let e = env(Options::default()).await;
    e.sandbox("a", SANDBOX_A, policy(r#"{"default": "allow"}"#));
    let origin = crate::streams::echo_origin(SPLICED_IP).await;
    let mut s = e.connect(SANDBOX_A, origin).await;
    // Accepted, peeking: the push lands before its first byte.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let deny = format!(r#"{{"default": "allow", "deny": [{{"ip": "{SPLICED_IP}"}}]}}"#);
    e.sandbox("a", SANDBOX_A, policy(&deny));
    s.write_all(b"\x00\x01opaque").await.expect("write");
    assert!(closed_without_data(&mut s).await, "refused, never spliced");
    let line = &e.flow_lines(1).await[0];
    assert_eq!(line["reason"], "tenant_deny", "{line}");
}

/// A sandbox deleted and registered again under the same id is another
/// registration: the spliced flows of the first end, as for a delete.
#[tokio::test]
async fn a_spliced_stream_ends_when_its_sandbox_is_registered_again() {
    let e = env(Options::default()).await;
    let allow = policy(&format!(r#"{{"allow": [{{"ip": "{SPLICED_IP}"}}]}}"#));
    e.sandbox("a", SANDBOX_A, allow.clone());
    let origin = crate::streams::echo_origin(SPLICED_IP).await;
    let mut s = e.connect(SANDBOX_A, origin).await;
    let mut back = [0u8; 5];
    s.write_all(b"hello").await.expect("write");
    tokio::time::timeout(Duration::from_secs(3), s.read_exact(&mut back))
        .await
        .expect("echo in time")
        .expect("echo");
    assert!(e.gateway.registry().remove(&SandboxId::new("a")));
    e.sandbox("a", SANDBOX_A, allow);
    assert!(closed_without_data(&mut s).await, "cut within a tick");
    let line = &e.flow_lines(1).await[0];
    assert_eq!(line["error"], "gateway_sandbox_removed", "{line}");
}
