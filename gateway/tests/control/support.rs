//! A gateway with a fixed original destination, an echo origin, and an HTTP client for the admin API.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use egress_gateway::config::Config;
use egress_gateway::flowlog::FlowLog;
use egress_gateway::{Gateway, OriginalDst};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

pub const SANDBOX: &str = "127.0.0.2";
pub const ECHO_IP: &str = "127.0.0.20";

/// Every redirected connection "was for" one destination.
pub struct FixedDst(pub SocketAddr);

impl OriginalDst for FixedDst {
    fn original_dst(&self, _: &TcpStream) -> std::io::Result<SocketAddr> {
        Ok(self.0)
    }
}

/// An echo server: what the origin receives comes back.
pub async fn echo() -> SocketAddr {
    let l = TcpListener::bind((ECHO_IP.parse::<IpAddr>().expect("ip"), 0))
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                while let Ok(n) = s.read(&mut buf).await {
                    if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    addr
}

pub fn config(state_dir: &Path, extra: &str) -> Config {
    let text = format!(
        r#"
        state_dir = "{}"
        [listen]
        transparent = "127.0.0.1:0"
        dns = "127.0.0.1:0"
        dns_alt = "127.0.0.1:0"
        admin = "127.0.0.1:0"
        [policy]
        platform_deny = [{{cidr = "169.254.0.0/16"}}]
        [timeouts]
        peek = "300ms"
        {extra}
        "#,
        state_dir.display()
    );
    Config::parse(&text, Path::new("test.toml")).expect("config")
}

pub async fn start(config: Config, dst: SocketAddr) -> Gateway {
    start_again(&config, Arc::new(FixedDst(dst)))
        .await
        .expect("starts")
}

/// `Gateway::start`, tried again for up to 2 s while the state directory
/// reads as locked. These tests start and stop gateways on one directory in
/// a process where other tests' gateways spawn children (`nft`), and a child
/// holds a copy of every descriptor of the process from its fork to its exec,
/// a lock just released included (seen with `strace -f`: a `clone3` with
/// `CLONE_VFORK` between the lock's `flock` and its `close`). A lock that is
/// never released still fails, 2 s later.
pub async fn start_again(
    config: &Config,
    dst: Arc<dyn OriginalDst>,
) -> Result<Gateway, egress_gateway::StartError> {
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    loop {
        let started = Gateway::start(config.clone(), dst.clone(), FlowLog::off()).await;
        match started {
            Err(egress_gateway::StartError::StateDirInUse { .. })
                if std::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => return other,
        }
    }
}

/// One HTTP/1.1 request; the status and the body.
pub async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.expect("connect admin");
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n");
    if let Some(t) = token {
        req.push_str(&format!("Authorization: Bearer {t}\r\n"));
    }
    let body = body.unwrap_or("");
    req.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    s.write_all(req.as_bytes()).await.expect("write");
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out))
        .await
        .expect("answer in time")
        .expect("read");
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

pub fn json(body: &str) -> serde_json::Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{body:?}: {e}"))
}

/// A TCP connection from `src` to the gateway's transparent listener.
pub async fn connect_from(gw: &Gateway, src: &str) -> TcpStream {
    let sock = TcpSocket::new_v4().expect("socket");
    sock.bind((src.parse::<IpAddr>().expect("ip"), 0).into())
        .expect("bind");
    sock.connect(gw.bound().transparent).await.expect("connect")
}

/// A connection from `src` through the gateway; `Some(echo)` when bytes came back.
pub async fn flow(gw: &Gateway, src: &str, payload: &[u8]) -> Option<Vec<u8>> {
    let mut s = connect_from(gw, src).await;
    s.write_all(payload).await.ok()?;
    let mut buf = vec![0u8; payload.len()];
    match tokio::time::timeout(Duration::from_secs(3), s.read_exact(&mut buf)).await {
        Ok(Ok(_)) => Some(buf),
        _ => None,
    }
}

/// `name{labels} value` lines of the metrics text, as a map.
pub fn metrics(text: &str) -> std::collections::HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_owned(), v.parse().ok()?))
        })
        .collect()
}

/// One request with a body of `content_type`; the status and the body.
pub async fn http_typed(
    addr: SocketAddr,
    method: &str,
    path: &str,
    content_type: &str,
    body: String,
) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.expect("connect admin");
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.expect("write");
    // The server may answer (and close) before reading all of a refused body.
    let _ = s.write_all(body.as_bytes()).await;
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out)).await;
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}
