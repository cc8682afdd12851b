//! Behind the operator's CONNECT proxy (`[upstream_proxy]`): a tiny proxy
//! of the test's own records every request head and relays (or refuses,
//! closes, stays silent); an origin of the test's own records who connects.
//! The proxy is asked for the original destination's address with Basic
//! credentials, server-first bytes behind its `200` arrive intact, its
//! failures are `502`s that say so, and nothing reaches the origin but
//! through it — unless the sandbox's registration says `direct`.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

use crate::harness::*;

/// The proxies and the banner origin live on loopback addresses of their own.
const PROXY_IP: &str = "127.0.0.30";
const BANNER_IP: &str = "127.0.0.31";
const H1: &[&[u8]] = &[b"http/1.1"];
const BANNER: &[u8] = b"SSH-2.0-origin-speaks-first\r\n";

/// What a test proxy does with a CONNECT.
#[derive(Clone, Copy)]
enum Mode {
    Relay,
    Answer(&'static [u8]),
    Silent,
}

/// The request heads a proxy received.
#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<String>>>);

impl Seen {
    fn heads(&self) -> Vec<String> {
        self.0.lock().expect("lock").clone()
    }
}

/// A CONNECT proxy on [`PROXY_IP`]; it dials origins from that address.
async fn proxy(mode: Mode) -> (SocketAddr, Seen) {
    let l = TcpListener::bind((PROXY_IP, 0)).await.expect("bind proxy");
    let addr = l.local_addr().expect("addr");
    let seen = Seen::default();
    let log = seen.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(serve_proxy(s, mode, log.clone()));
        }
    });
    (addr, seen)
}

async fn serve_proxy(mut s: TcpStream, mode: Mode, seen: Seen) {
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if s.read(&mut b).await.unwrap_or(0) == 0 {
            return;
        }
        head.push(b[0]);
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    seen.0.lock().expect("lock").push(head.clone());
    match mode {
        Mode::Answer(bytes) => {
            let _ = s.write_all(bytes).await;
        }
        Mode::Silent => tokio::time::sleep(Duration::from_secs(10)).await,
        Mode::Relay => {
            let target: SocketAddr = head
                .split_whitespace()
                .nth(1)
                .and_then(|t| t.parse().ok())
                .expect("CONNECT ip:port");
            let sock = TcpSocket::new_v4().expect("socket");
            sock.bind((PROXY_IP.parse::<IpAddr>().expect("ip"), 0).into())
                .expect("bind");
            let Ok(mut origin) = sock.connect(target).await else {
                let _ = s.write_all(b"HTTP/1.1 502 Bad Gateway\r\n\r\n").await;
                return;
            };
            let _ = s
                .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
                .await;
            let _ = tokio::io::copy_bidirectional(&mut s, &mut origin).await;
        }
    }
}

/// A server-first origin: sends [`BANNER`] at once, then echoes; records
/// the address of every peer.
async fn banner_origin() -> (SocketAddr, Arc<Mutex<Vec<IpAddr>>>) {
    let l = TcpListener::bind((BANNER_IP, 0)).await.expect("bind");
    let addr = l.local_addr().expect("addr");
    let peers = Arc::new(Mutex::new(Vec::new()));
    let seen = peers.clone();
    tokio::spawn(async move {
        while let Ok((mut s, peer)) = l.accept().await {
            seen.lock().expect("lock").push(peer.ip());
            tokio::spawn(async move {
                if s.write_all(BANNER).await.is_err() {
                    return;
                }
                let mut buf = [0u8; 1024];
                while let Ok(n) = s.read(&mut buf).await {
                    if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    (addr, peers)
}

/// `[upstream_proxy]` naming `proxies` (name, address), `default` first
/// unless `None`; `corp` gets Basic credentials from a file in `dir`.
fn section(dir: &std::path::Path, default: Option<&str>, proxies: &[(&str, SocketAddr)]) -> String {
    let pw = dir.join("proxy-password");
    std::fs::write(&pw, "s3cret\n").expect("password");
    let mut s = String::from("[upstream_proxy]\n");
    if let Some(d) = default {
        s.push_str(&format!("default = \"{d}\"\n"));
    }
    for (name, addr) in proxies {
        s.push_str(&format!(
            "[upstream_proxy.proxies.{name}]\naddress = \"{addr}\"\n"
        ));
        if *name == "corp" {
            s.push_str(&format!(
                "username = \"gw\"\npassword_file = \"{}\"\n",
                pw.display()
            ));
        }
    }
    s
}

/// `PUT /v1/sandboxes/a` from [`SANDBOX_A`] with `extra` fields: status and body.
async fn register(e: &Env, extra: &str) -> (u16, String) {
    let body = format!(
        r#"{{"addresses": ["{SANDBOX_A}"], "policy": {{"default": "allow", "tls_interception": "on"}}{extra}}}"#
    );
    let mut s = TcpStream::connect(e.gateway.bound().admin)
        .await
        .expect("admin");
    let req = format!(
        "PUT /v1/sandboxes/a HTTP/1.0\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("write");
    let mut text = String::new();
    s.read_to_string(&mut text).await.expect("read");
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned());
    (status, body.unwrap_or_default())
}

/// An intercepted HTTP/1.1 connection from sandbox A to api.example.test.
async fn connection(
    e: &Env,
) -> hyper::client::conn::http1::SendRequest<http_body_util::Empty<bytes::Bytes>> {
    let (tls, _) = e
        .tls(SANDBOX_A, e.origins.api, "api.example.test", H1)
        .await
        .expect("the gateway terminates TLS");
    let (sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
        .await
        .expect("h1");
    tokio::spawn(conn);
    sender
}

/// An intercepted GET from sandbox A: status, `x-egress-upstream-proxy`, body.
async fn get(e: &Env) -> (u16, Option<String>, String) {
    get_on(&mut connection(e).await).await
}

/// `GET /hello` on an open connection: status, `x-egress-upstream-proxy`, body.
async fn get_on(
    sender: &mut hyper::client::conn::http1::SendRequest<http_body_util::Empty<bytes::Bytes>>,
) -> (u16, Option<String>, String) {
    let req = hyper::Request::builder()
        .uri("/hello")
        .header("host", "api.example.test")
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .expect("request");
    let resp = sender.send_request(req).await.expect("answer");
    let status = resp.status().as_u16();
    let header = resp
        .headers()
        .get("x-egress-upstream-proxy")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .expect("body")
        .to_bytes();
    (status, header, String::from_utf8_lossy(&body).into_owned())
}

/// A spliced server-first flow from sandbox A to `dst`: the banner it got
/// (`None`: closed), and the echo of what it sent.
async fn banner_flow(e: &Env, dst: SocketAddr) -> Option<(Vec<u8>, Vec<u8>)> {
    let mut s = e.connect(SANDBOX_A, dst).await;
    s.write_all(b"SSH-2.0-client\r\n").await.expect("write");
    let mut got = vec![0u8; BANNER.len() + 16];
    let read = tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut got)).await;
    match read {
        Ok(Ok(_)) => {
            let echo = got.split_off(BANNER.len());
            Some((got, echo))
        }
        _ => None,
    }
}

/// The flow log's line for the flow to `dst`, once written.
async fn line_to(e: &Env, dst: SocketAddr) -> serde_json::Value {
    for _ in 0..100 {
        let found = e
            .flows
            .records()
            .into_iter()
            .find(|l| l["dst"] == dst.to_string());
        if let Some(l) = found {
            return l;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no flow-log line for {dst}: {:?}", e.flows.records());
}

#[tokio::test]
async fn every_upstream_connection_goes_through_the_proxy_named_by_address() {
    let dir = tempfile::tempdir().expect("dir");
    let (corp, seen) = proxy(Mode::Relay).await;
    let (origin, peers) = banner_origin().await;
    let e = env(Options {
        extra: section(dir.path(), Some("corp"), &[("corp", corp)]),
        ..Options::default()
    })
    .await;
    assert_eq!(register(&e, "").await.0, 200);

    // Intercepted: the proxy is asked for the address the flow was decided on.
    let (status, header, body) = get(&e).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(header, None);
    assert!(body.starts_with("origin=api GET /hello"), "{body}");
    let heads = seen.heads();
    let api = e.origins.api;
    assert_eq!(heads.len(), 1, "{heads:?}");
    assert!(
        heads[0].starts_with(&format!("CONNECT {api} HTTP/1.1\r\nHost: {api}\r\n")),
        "{heads:?}"
    );
    assert!(
        heads[0].contains("Proxy-Authorization: Basic Z3c6czNjcmV0\r\n"),
        "{heads:?}"
    );

    // Spliced, server first: the banner behind the 200 arrives intact, and
    // the origin sees only the proxy.
    let (banner, echo) = banner_flow(&e, origin).await.expect("spliced");
    assert_eq!(banner, BANNER);
    assert_eq!(echo, b"SSH-2.0-client\r\n");
    assert_eq!(
        *peers.lock().expect("lock"),
        [PROXY_IP.parse::<IpAddr>().expect("ip")],
        "nothing connected to the origin directly"
    );
    assert!(seen.heads()[1].starts_with(&format!("CONNECT {origin} HTTP/1.1\r\n")));
    assert_eq!(
        value(
            &e,
            "egress_upstream_proxy_connects_total{proxy=\"corp\",result=\"ok\"}"
        )
        .await,
        2
    );

    // A denied destination is refused by the gateway: the proxy never hears of it.
    let before = seen.heads().len();
    e.sandbox(
        "a",
        SANDBOX_A,
        policy(&format!(
            r#"{{"default": "allow", "deny": [{{"ip": "{BANNER_IP}"}}]}}"#
        )),
    );
    assert_eq!(banner_flow(&e, origin).await, None, "denied");
    assert_eq!(seen.heads().len(), before, "no CONNECT for a denied flow");

    // `direct` in the registration bypasses the default proxy.
    let (status, body) = register(&e, r#", "upstream_proxy": "direct""#).await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(r#""upstream_proxy":"direct""#), "{body}");
    assert!(banner_flow(&e, origin).await.is_some());
    let peers = peers.lock().expect("lock").clone();
    assert_eq!(peers.len(), 2);
    assert_ne!(peers[1], PROXY_IP.parse::<IpAddr>().expect("ip"), "direct");
    assert_eq!(seen.heads().len(), before, "the proxy was not asked");

    // A name the gateway does not have is refused, naming the field.
    let (status, body) = register(&e, r#", "upstream_proxy": "elsewhere""#).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body.contains(r#""field":"upstream_proxy""#) && body.contains("elsewhere"),
        "{body}"
    );
}

#[tokio::test]
async fn a_proxy_that_refuses_closes_or_stays_silent_is_a_502_that_says_so() {
    let dir = tempfile::tempdir().expect("dir");
    let (refuse, _) = proxy(Mode::Answer(
        b"HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic realm=\"corp\"\r\n\r\n",
    ))
    .await;
    let (forbid, _) = proxy(Mode::Answer(b"HTTP/1.1 403 Forbidden\r\n\r\n")).await;
    let (closer, _) = proxy(Mode::Answer(b"HTTP/1.1 200 Conne")).await;
    let (silent, _) = proxy(Mode::Silent).await;
    let (origin, peers) = banner_origin().await;
    let e = env(Options {
        extra: section(
            dir.path(),
            None,
            &[
                ("refuse", refuse),
                ("forbid", forbid),
                ("closer", closer),
                ("silent", silent),
            ],
        ),
        ..Options::default()
    })
    .await;
    let cases = [
        ("refuse", "refuse; refused; status=407", "refused CONNECT"),
        ("forbid", "forbid; refused; status=403", "403 Forbidden"),
        ("closer", "closer; closed", "closed the connection"),
        ("silent", "silent; timeout", "did not answer CONNECT"),
    ];
    for (name, header, says) in cases {
        let (status, body) = register(&e, &format!(r#", "upstream_proxy": "{name}""#)).await;
        assert_eq!(status, 200, "{body}");
        let started = Instant::now();
        let (status, got, body) = get(&e).await;
        assert_eq!(status, 502, "{name}: {body}");
        assert_eq!(got.as_deref(), Some(header), "{name}: {body}");
        assert!(
            body.contains(&format!("upstream proxy {name} ")) && body.contains(says),
            "{name}: {body}"
        );
        // timeouts.connect is 2 s in the harness.
        assert!(started.elapsed() < Duration::from_secs(4), "{name}");
    }
    for (proxy, result, kind) in [
        ("refuse", "refused", "proxy_refused"),
        ("closer", "closed", "proxy_closed"),
        ("silent", "timeout", "proxy_timeout"),
    ] {
        let series = format!(
            "egress_upstream_proxy_connects_total{{proxy=\"{proxy}\",result=\"{result}\"}}"
        );
        assert_eq!(value(&e, &series).await, 1, "{series}");
        let fault = format!("egress_flow_errors_total{{side=\"upstream\",kind=\"{kind}\"}}");
        assert!(value(&e, &fault).await >= 1, "{fault}");
    }

    // A spliced flow through a refusing proxy is closed, the flow log says
    // why, and nothing went to the origin directly.
    register(&e, r#", "upstream_proxy": "forbid""#).await;
    assert_eq!(banner_flow(&e, origin).await, None);
    let spliced = line_to(&e, origin).await;
    let error = spliced["error"].as_str().unwrap_or_default();
    assert!(
        error.starts_with("upstream_proxy: upstream proxy forbid refused CONNECT")
            && error.contains("403"),
        "{spliced}"
    );
    assert!(peers.lock().expect("lock").is_empty(), "never direct");
}

/// A registration that names another way out applies from the next request
/// on an open connection: the upstream connection it held (opened direct)
/// is not used for it. It went on direct before.
#[tokio::test]
async fn a_changed_way_out_applies_to_the_next_request_on_an_open_connection() {
    let dir = tempfile::tempdir().expect("dir");
    let (corp, seen) = proxy(Mode::Relay).await;
    let e = env(Options {
        extra: section(dir.path(), None, &[("corp", corp)]),
        ..Options::default()
    })
    .await;
    assert_eq!(register(&e, "").await.0, 200);
    let mut sender = connection(&e).await;
    assert_eq!(get_on(&mut sender).await.0, 200);
    assert!(seen.heads().is_empty(), "direct: {:?}", seen.heads());

    let (status, body) = register(&e, r#", "upstream_proxy": "corp""#).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(get_on(&mut sender).await.0, 200);
    let heads = seen.heads();
    assert_eq!(
        heads.len(),
        1,
        "the next request went through corp: {heads:?}"
    );
    assert!(
        heads[0].starts_with(&format!("CONNECT {} HTTP/1.1\r\n", e.origins.api)),
        "{heads:?}"
    );
}
