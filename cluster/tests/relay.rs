//! The console relay against a running worker (a real gateway, in process,
//! its VM tables in a throwaway namespace): bearer auth, every route mapped,
//! the worker's status passed through, the 64 KiB cap, an unreachable worker.

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use egress_cluster::relay::{self, RelayConfig};
use serde_json::{json, Value};
use support::{http, json, Worker, NO_HEADERS};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const TOKEN: &str = "console-token-0123456789";
const OTHER_TOKEN: &str = "second-console-token-abcdef";

/// A relay in front of `worker`, accepting [`TOKEN`] and [`OTHER_TOKEN`].
async fn relay_to(worker: SocketAddr, worker_token: Option<&str>, timeout: Duration) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let config = RelayConfig {
        worker,
        worker_token: worker_token.map(str::to_owned),
        tokens: vec![TOKEN.to_owned(), OTHER_TOKEN.to_owned()],
        timeout,
    };
    tokio::spawn(relay::serve(listener, Arc::new(config)));
    addr
}

/// A relay in front of the worker, with the worker's token.
async fn relay_for(w: &Worker) -> SocketAddr {
    relay_to(w.admin, Some(&w.token), Duration::from_secs(10)).await
}

const AUTH: [(&str, &str); 1] = [("authorization", "Bearer console-token-0123456789")];

/// A request to the relay with [`TOKEN`]; the status and the JSON body.
async fn call(relay: SocketAddr, method: &str, path: &str, body: Option<&str>) -> (u16, Value) {
    let (status, headers, text) = http(relay, method, path, &AUTH, body).await;
    if !text.is_empty() {
        let ct = headers.get("content-type").and_then(|v| v.to_str().ok());
        assert_eq!(ct, Some("application/json"), "{status} {text}");
    }
    (status, json(&text))
}

/// A request straight to the worker.
async fn direct(w: &Worker, method: &str, path: &str, body: Option<&str>) -> (u16, Value) {
    let (status, _, text) = http(w.admin, method, path, &w.auth(), body).await;
    (status, json(&text))
}

/// Raw HTTP/1.1: `head` (without the blank line), then `body` in pieces,
/// whatever the server does meanwhile; the status and body of the answer.
async fn raw(addr: SocketAddr, head: &str, pieces: &[Vec<u8>]) -> (u16, String, Duration) {
    let started = Instant::now();
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(format!("{head}\r\n\r\n").as_bytes())
        .await
        .expect("write head");
    for p in pieces {
        // The server may answer, and close, before it has read everything.
        if s.write_all(p).await.is_err() {
            break;
        }
    }
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = Duration::from_secs(10);
    loop {
        match tokio::time::timeout(deadline, s.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => out.extend_from_slice(&buf[..n]),
            _ => break,
        }
        if complete(&out) {
            break;
        }
    }
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body, started.elapsed())
}

/// Whether `out` holds a whole response with a Content-Length.
fn complete(out: &[u8]) -> bool {
    let text = String::from_utf8_lossy(out);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return false;
    };
    head.lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse::<usize>().ok())
        .is_some_and(|n| body.len() >= n)
}

const POLICY: &str = r#"{"mode": "allowlist", "rules": [
    {"cidr": "10.0.0.0/8", "proto": "tcp", "port": 5151, "note": "Veyron API"},
    {"cidr": "0.0.0.0/0", "proto": "udp", "port": 53}]}"#;

#[tokio::test]
async fn callers_need_a_listed_token() {
    // Refused before anything is forwarded: no worker needed.
    let (worker, _held) = egress_testkit::closed_port();
    let relay = relay_to(worker, None, Duration::from_secs(1)).await;
    let no_auth: [(&str, &str); 0] = [];
    let wrong = [("authorization", "Bearer console-token-0123456780")];
    let prefix = [("authorization", "Bearer console-token-012345678")];
    let longer = [("authorization", "Bearer console-token-01234567899")];
    let basic = [("authorization", "Basic Y29uc29sZTp0b2tlbg==")];
    let bare = [("authorization", TOKEN)];
    let empty = [("authorization", "Bearer ")];
    for (what, headers) in [
        ("missing", &no_auth[..]),
        ("wrong", &wrong[..]),
        ("a prefix", &prefix[..]),
        ("longer", &longer[..]),
        ("basic", &basic[..]),
        ("no scheme", &bare[..]),
        ("empty", &empty[..]),
    ] {
        for (method, path) in [
            ("GET", "/vm-egress/vm1"),
            ("PUT", "/egress-defaults"),
            ("GET", "/nowhere"),
        ] {
            let (status, h, body) = http(relay, method, path, headers, Some("{}")).await;
            assert_eq!(status, 401, "{what} {method} {path}: {body}");
            assert_eq!(
                h.get("www-authenticate").and_then(|v| v.to_str().ok()),
                Some("Bearer"),
                "{what}"
            );
            assert!(json(&body)["error"].is_string(), "{body}");
        }
    }
    // Either listed token gets through auth (to the closed worker: 502), and
    // the scheme is case-insensitive.
    for value in [
        format!("Bearer {TOKEN}"),
        format!("Bearer {OTHER_TOKEN}"),
        format!("bearer {OTHER_TOKEN}"),
    ] {
        let (status, _, body) = http(
            relay,
            "GET",
            "/vm-egress/vm1",
            &[("authorization", value)],
            None,
        )
        .await;
        assert_eq!(status, 502, "{body}");
    }
}

#[tokio::test]
async fn unknown_routes_bad_ids_and_methods() {
    let (worker, _held) = egress_testkit::closed_port();
    let relay = relay_to(worker, None, Duration::from_secs(1)).await;
    for path in [
        "/",
        "/vm-egress",
        "/vm-egressx/vm1",
        "/v1/vms/vm1/network/egress",
        "/egress-defaults/x",
        "/egress-defaults-x",
    ] {
        let (status, body) = call(relay, "GET", path, None).await;
        assert_eq!(status, 404, "{path}: {body}");
        assert!(body["error"].is_string());
    }
    let long = format!("/vm-egress/{}", "a".repeat(65));
    for path in [
        "/vm-egress/",
        "/vm-egress/a/b",
        "/vm-egress/a%2Fb",
        "/vm-egress/..",
        "/vm-egress-observed/vm%201",
        "/vm-egress-suggest/é",
        long.as_str(),
    ] {
        let method = if path.starts_with("/vm-egress-suggest") {
            "POST"
        } else {
            "GET"
        };
        let (status, body) = call(relay, method, path, None).await;
        assert_eq!(status, 400, "{path}: {body}");
        assert!(
            body["error"]
                .as_str()
                .expect("error")
                .contains("runtime id"),
            "{body}"
        );
    }
    for (method, path, allow) in [
        ("POST", "/vm-egress/vm1", "GET, PUT, DELETE"),
        ("PUT", "/vm-egress-observed/vm1", "GET"),
        ("GET", "/vm-egress-suggest/vm1", "POST"),
        ("DELETE", "/egress-defaults", "GET, PUT"),
    ] {
        let (status, h, body) = http(relay, method, path, &AUTH, None).await;
        assert_eq!(status, 405, "{method} {path}: {body}");
        assert_eq!(h.get("allow").and_then(|v| v.to_str().ok()), Some(allow));
    }
}

#[tokio::test]
async fn an_unreachable_worker_is_502_with_a_reason() {
    let (worker, _held) = egress_testkit::closed_port();
    let relay = relay_to(worker, None, Duration::from_secs(2)).await;
    let (status, body) = call(relay, "PUT", "/vm-egress/vm1", Some(POLICY)).await;
    assert_eq!(status, 502, "{body}");
    let error = body["error"].as_str().expect("error");
    assert!(
        error.starts_with("worker unreachable: connect 127.0.0.1:"),
        "{error}"
    );

    // A worker that accepts and never answers: the timeout bounds it.
    let silent = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let silent_addr = silent.local_addr().expect("addr");
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = silent.accept().await {
            held.push(s);
        }
    });
    let relay = relay_to(silent_addr, None, Duration::from_millis(300)).await;
    let started = Instant::now();
    let (status, body) = call(relay, "GET", "/egress-defaults", None).await;
    assert_eq!(status, 504, "{body}");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(
        body["error"].as_str(),
        Some("no answer from the worker: no answer within 300ms")
    );
    // A change sent and not answered may have been made: the caller is
    // told to read it back rather than to take it as not made.
    let (status, body) = call(relay, "PUT", "/vm-egress/vm1", Some(POLICY)).await;
    assert_eq!(status, 504, "{body}");
    assert_eq!(
        body["error"].as_str(),
        Some("no answer from the worker: no answer within 300ms (the change may have been made: read it back before trying again)")
    );

    // A worker that hangs up mid-exchange.
    let rude = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let rude_addr = rude.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = rude.accept().await {
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf).await;
            let _ = s
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{")
                .await;
        }
    });
    let relay = relay_to(rude_addr, None, Duration::from_secs(5)).await;
    let (status, body) = call(relay, "GET", "/egress-defaults", None).await;
    assert_eq!(status, 502, "{body}");
    assert!(body["error"]
        .as_str()
        .expect("error")
        .starts_with("no answer from the worker: reading the reply: "));

    // A worker whose answer is larger than the relay reads: an answer came,
    // too large to read (before, it was "no answer from the worker").
    let large = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let large_addr = large.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = large.accept().await {
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf).await;
            let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", 9 << 20);
            let _ = s.write_all(head.as_bytes()).await;
            let _ = s.write_all(&vec![b' '; 9 << 20]).await;
        }
    });
    let relay = relay_to(large_addr, None, Duration::from_secs(5)).await;
    let (status, body) = call(relay, "GET", "/egress-defaults", None).await;
    assert_eq!(status, 502, "{body}");
    assert_eq!(
        body["error"].as_str(),
        Some("worker's answer to GET /v1/network/egress/defaults is unreadable: the reply is larger than 8388608 bytes"),
        "{body}"
    );
    holder.abort();
}

#[tokio::test]
async fn every_route_reaches_the_worker() {
    let Some(w) = Worker::start().await else {
        return;
    };
    w.register_vm("vm1", "100.64.50.2").await;
    let relay = relay_for(&w).await;

    // PUT: the worker has it.
    let (status, body) = call(relay, "PUT", "/vm-egress/vm1", Some(POLICY)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["source"], "vm", "{body}");
    let (status, direct_view) = direct(&w, "GET", "/v1/vms/vm1/network/egress", None).await;
    assert_eq!(status, 200);
    assert_eq!(direct_view["source"], "vm");
    assert_eq!(
        direct_view["policy"]["rules"][0]["port"], 5151,
        "{direct_view}"
    );
    assert_eq!(direct_view["policy"]["rules"][1]["cidr"], "0.0.0.0/0");
    assert!(
        w.ruleset().contains("5151"),
        "the VM's table is in the namespace"
    );

    // GET through the relay: the same document.
    let (status, body) = call(relay, "GET", "/vm-egress/vm1", None).await;
    assert_eq!((status, &body), (200, &direct_view));

    // Observed.
    let (status, body) = call(relay, "GET", "/vm-egress-observed/vm1", None).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["vm"], "vm1");
    assert_eq!(body["recorded"], "refused");
    assert!(body["observed"].is_array(), "{body}");

    // Suggest, the query passing through.
    let (status, body) = call(relay, "POST", "/vm-egress-suggest/vm1", None).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["applied"], false, "{body}");
    let (status, body) = call(relay, "POST", "/vm-egress-suggest/vm1?apply=true", None).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["applied"], true, "{body}");
    assert_eq!(body["vm"], "vm1");

    // DELETE: the VM follows the node default again.
    let (status, body) = call(relay, "DELETE", "/vm-egress/vm1", None).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["source"], "default", "{body}");
    let (_, view) = direct(&w, "GET", "/v1/vms/vm1/network/egress", None).await;
    assert_eq!(view["source"], "default");

    // The node default.
    let (status, body) = call(relay, "GET", "/egress-defaults", None).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["policy"]["mode"], "loopback", "{body}");
    let default = r#"{"mode": "allowlist", "rules": [{"cidr": "192.0.2.0/24", "proto": "tcp", "port": 443}]}"#;
    let (status, body) = call(
        relay,
        "PUT",
        "/egress-defaults?apply_running=true",
        Some(default),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["apply_running"], true, "{body}");
    assert_eq!(body["policy"]["rules"][0]["cidr"], "192.0.2.0/24");
    let (_, worker_default) = direct(&w, "GET", "/v1/network/egress/defaults", None).await;
    assert_eq!(worker_default["policy"], body["policy"]);
    // vm1 follows the default and was running: it has it now.
    let (_, view) = direct(&w, "GET", "/v1/vms/vm1/network/egress", None).await;
    assert_eq!(view["policy"], body["policy"], "{view}");
    let (status, body) = call(
        relay,
        "PUT",
        "/egress-defaults",
        Some(r#"{"mode": "loopback"}"#),
    )
    .await;
    assert_eq!(
        (status, &body["apply_running"]),
        (200, &json!(false)),
        "{body}"
    );
}

#[tokio::test]
async fn the_workers_status_passes_through() {
    let Some(w) = Worker::start().await else {
        return;
    };
    w.register_vm("vm1", "100.64.50.3").await;
    let relay = relay_for(&w).await;

    // Unknown VM: the worker's 404.
    for (method, path) in [
        ("GET", "/vm-egress/nope"),
        ("PUT", "/vm-egress/nope"),
        ("DELETE", "/vm-egress/nope"),
        ("GET", "/vm-egress-observed/nope"),
        ("POST", "/vm-egress-suggest/nope"),
    ] {
        let body = (method == "PUT").then_some(POLICY);
        let (status, reply) = call(relay, method, path, body).await;
        assert_eq!(status, 404, "{method} {path}: {reply}");
        assert!(
            reply["error"].as_str().expect("error").contains("nope"),
            "{reply}"
        );
    }

    // An invalid policy: the worker's 400 with its errors.
    let bad = r#"{"mode": "allowlist", "rules": [{"cidr": "10.1.2.3/8"}, {"cidr": "1.2.3.4", "port": 80}]}"#;
    let (status, reply) = call(relay, "PUT", "/vm-egress/vm1", Some(bad)).await;
    assert_eq!(status, 400, "{reply}");
    let errors = reply["errors"].as_array().expect("the worker's errors");
    assert_eq!(errors.len(), 2, "{reply}");
    assert_eq!(errors[0]["rule"], 0);
    assert_eq!(errors[1]["rule"], 1);
    let (_, direct_reply) = direct(&w, "PUT", "/v1/vms/vm1/network/egress", Some(bad)).await;
    assert_eq!(reply, direct_reply);
    let (status, reply) = call(relay, "PUT", "/egress-defaults", Some("not json")).await;
    assert_eq!(status, 400, "{reply}");
    // A query the worker refuses.
    let (status, reply) = call(relay, "POST", "/vm-egress-suggest/vm1?apply=maybe", None).await;
    assert_eq!(status, 400, "{reply}");
    assert_eq!(reply["field"], "apply", "{reply}");

    // Without the worker's token: the worker's 401.
    let tokenless = relay_to(w.admin, None, Duration::from_secs(10)).await;
    let (status, reply) = call(tokenless, "GET", "/egress-defaults", None).await;
    assert_eq!(status, 401, "{reply}");
    // The worker's own refusal of an unauthenticated caller, for comparison.
    let (status, _, _) = http(
        w.admin,
        "GET",
        "/v1/network/egress/defaults",
        NO_HEADERS,
        None,
    )
    .await;
    assert_eq!(status, 401);
}

/// A valid policy of exactly `len` bytes: 200 rules with long notes,
/// padded with spaces.
fn policy_of(len: usize) -> String {
    let rules: Vec<Value> = (0..200)
        .map(|i| json!({ "cidr": format!("198.51.{}.{}", i / 100, i % 100), "note": "n".repeat(256) }))
        .collect();
    let mut text = json!({ "mode": "allowlist", "rules": rules }).to_string();
    assert!(text.len() <= len, "{} > {len}", text.len());
    text.push_str(&" ".repeat(len - text.len()));
    text
}

#[tokio::test]
async fn bodies_are_capped_at_64_kib() {
    let Some(w) = Worker::start().await else {
        return;
    };
    w.register_vm("vm1", "100.64.50.4").await;
    let relay = relay_for(&w).await;
    let head = |len: Option<usize>| {
        let framing = match len {
            Some(n) => format!("Content-Length: {n}"),
            None => "Transfer-Encoding: chunked".to_owned(),
        };
        format!(
            "PUT /vm-egress/vm1 HTTP/1.1\r\nHost: relay\r\nAuthorization: Bearer {TOKEN}\r\n\
             Content-Type: application/json\r\nConnection: close\r\n{framing}"
        )
    };

    // 65 KiB declared: 413 at once, without waiting for the body.
    let (status, body, took) = raw(relay, &head(Some(65 * 1024)), &[]).await;
    assert_eq!(status, 413, "{body}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert!(json(&body)["error"].is_string());
    // And with the body sent.
    let big = policy_of(65 * 1024);
    let (status, body, _) = raw(relay, &head(Some(big.len())), &[big.clone().into_bytes()]).await;
    assert_eq!(status, 413, "{body}");

    // The same chunked: 413 once the cap is passed.
    let chunks: Vec<Vec<u8>> = big
        .as_bytes()
        .chunks(8 * 1024)
        .map(|c| {
            let mut piece = format!("{:x}\r\n", c.len()).into_bytes();
            piece.extend_from_slice(c);
            piece.extend_from_slice(b"\r\n");
            piece
        })
        .chain(std::iter::once(b"0\r\n\r\n".to_vec()))
        .collect();
    let (status, body, _) = raw(relay, &head(None), &chunks).await;
    assert_eq!(status, 413, "{body}");
    let (_, view) = direct(&w, "GET", "/v1/vms/vm1/network/egress", None).await;
    assert_eq!(view["source"], "default", "nothing was forwarded: {view}");

    // 60 KiB, and exactly 64 KiB, are forwarded (chunked too).
    for len in [60 * 1024, relay::MAX_BODY] {
        let text = policy_of(len);
        let (status, body) = call(relay, "PUT", "/vm-egress/vm1", Some(&text)).await;
        assert_eq!(status, 200, "{len}: {body}");
        let (_, view) = direct(&w, "GET", "/v1/vms/vm1/network/egress", None).await;
        assert_eq!(view["source"], "vm");
        assert_eq!(view["policy"]["rules"].as_array().map(Vec::len), Some(200));
        let (status, _) = call(relay, "DELETE", "/vm-egress/vm1", None).await;
        assert_eq!(status, 200);
    }
    let text = policy_of(60 * 1024);
    let chunks: Vec<Vec<u8>> = text
        .as_bytes()
        .chunks(8 * 1024)
        .map(|c| {
            let mut piece = format!("{:x}\r\n", c.len()).into_bytes();
            piece.extend_from_slice(c);
            piece.extend_from_slice(b"\r\n");
            piece
        })
        .chain(std::iter::once(b"0\r\n\r\n".to_vec()))
        .collect();
    let (status, body, _) = raw(relay, &head(None), &chunks).await;
    assert_eq!(status, 200, "{body}");
    let (_, view) = direct(&w, "GET", "/v1/vms/vm1/network/egress", None).await;
    assert_eq!(view["source"], "vm");
}

#[test]
fn token_files() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("tokens");
    std::fs::write(&path, format!("\n  {TOKEN}  \n\n{OTHER_TOKEN}\r\n")).expect("write");
    assert_eq!(
        relay::load_tokens(&path).expect("tokens"),
        [TOKEN, OTHER_TOKEN]
    );
    let shown = path.display().to_string();
    for (text, what) in [
        ("", "empty"),
        ("\n \n", "blank"),
        ("0123456789abcde\n", "short"),
    ] {
        std::fs::write(&path, text).expect("write");
        let e = relay::load_tokens(&path).expect_err(what);
        assert!(e.to_string().contains(&shown), "{what}: {e}");
        assert!(
            !e.to_string().contains("0123456789abcde"),
            "no token in {e}"
        );
    }
    let missing = dir.path().join("missing");
    let e = relay::load_tokens(&missing).expect_err("missing");
    assert!(
        e.to_string().contains(&missing.display().to_string()),
        "{e}"
    );
}
