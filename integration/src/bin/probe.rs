//! `egress-probe`: a sandbox-side client for what curl does not do.
//!
//! - `line`: TLS to an address with a server name, send a line, print the reply
//!   and whether the gateway (rather than the origin) presented the certificate.
//! - `many`: N HTTPS requests, C at a time, over fresh connections; prints counts.
//! - `request`: one request written exactly as asked — an HTTP/1.1 head as
//!   text (two `Host` headers, bare LFs, …) or an HTTP/2 request with any
//!   `:authority` and `host` headers — over TLS or plain TCP; prints the answer.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

#[derive(Parser)]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

/// Where to connect, the server name to send, and the CAs to trust.
#[derive(clap::Args)]
struct Target {
    #[arg(long)]
    connect: SocketAddr,
    #[arg(long)]
    sni: String,
    #[arg(long, required = true)]
    ca: Vec<PathBuf>,
}

/// One request written exactly as asked.
#[derive(clap::Args)]
struct RequestArgs {
    #[arg(long)]
    connect: SocketAddr,
    /// TLS with this server name; without it, plain TCP.
    #[arg(long)]
    sni: Option<String>,
    #[arg(long)]
    ca: Vec<PathBuf>,
    /// HTTP/1.1: the whole request as text, with `\r` and `\n` written as escapes.
    #[arg(long, conflicts_with = "h2_authority")]
    raw: Option<String>,
    /// Any bytes, in hex (a hand-built ClientHello, an SSLv2 hello): sent
    /// as they are over plain TCP.
    #[arg(long, conflicts_with_all = ["h2_authority", "raw", "sni"])]
    hex: Option<String>,
    /// HTTP/2 (ALPN h2) to `/` with this `:authority`.
    #[arg(long)]
    h2_authority: Option<String>,
    /// HTTP/2: `host` headers to send besides the `:authority`.
    #[arg(long = "host")]
    hosts: Vec<String>,
    /// HTTP/2: a header of this many bytes, to try the head bound.
    #[arg(long, default_value_t = 0)]
    pad: usize,
}

#[derive(Subcommand)]
enum Cmd {
    Request(RequestArgs),
    Line {
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        send: String,
    },
    Many {
        #[command(flatten)]
        target: Target,
        #[arg(long, default_value_t = 1000)]
        count: usize,
        #[arg(long, default_value_t = 100)]
        concurrency: usize,
        #[arg(long, default_value = "/bytes/1000")]
        path: String,
        /// How long each request waits for its answer, once sent.
        #[arg(long, default_value_t = 30)]
        response_timeout_secs: u64,
    },
}

fn tls_config(cas: &[PathBuf]) -> Result<Arc<rustls::ClientConfig>, String> {
    tls_config_alpn(cas, b"http/1.1")
}

fn tls_config_alpn(cas: &[PathBuf], alpn: &[u8]) -> Result<Arc<rustls::ClientConfig>, String> {
    let mut roots = rustls::RootCertStore::empty();
    for path in cas {
        for c in
            CertificateDer::pem_file_iter(path).map_err(|e| format!("{}: {e}", path.display()))?
        {
            roots
                .add(c.map_err(|e| e.to_string())?)
                .map_err(|e| e.to_string())?;
        }
    }
    let mut c = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    c.alpn_protocols = vec![alpn.to_vec()];
    Ok(Arc::new(c))
}

async fn connect(
    config: Arc<rustls::ClientConfig>,
    addr: SocketAddr,
    sni: &str,
) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>, String> {
    let tcp = tokio::time::timeout(
        Duration::from_secs(10),
        tokio::net::TcpStream::connect(addr),
    )
    .await
    .map_err(|_| "connect timed out".to_owned())?
    .map_err(|e| format!("connect: {e}"))?;
    let name = ServerName::try_from(sni.to_owned()).map_err(|e| e.to_string())?;
    tokio::time::timeout(
        Duration::from_secs(10),
        tokio_rustls::TlsConnector::from(config).connect(name, tcp),
    )
    .await
    .map_err(|_| "TLS handshake timed out".to_owned())?
    .map_err(|e| format!("TLS: {e}"))
}

async fn line(
    config: Arc<rustls::ClientConfig>,
    addr: SocketAddr,
    sni: &str,
    send: &str,
) -> Result<serde_json::Value, String> {
    let mut tls = connect(config, addr, sni).await?;
    let minted = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .is_some_and(|c| {
            c.as_ref()
                .windows(30)
                .any(|w| w == b"egress-gateway interception CA")
        });
    tls.write_all(format!("{send}\n").as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut reply = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), tls.read_to_end(&mut reply)).await;
    Ok(serde_json::json!({"issuer_gateway": minted, "reply": String::from_utf8_lossy(&reply)}))
}

/// An error's kind: an answer's status line (`HTTP/1.1 502 Bad Gateway`),
/// else the error as it is (the probe's own errors are a small set).
fn error_kind(e: &str) -> String {
    if e.starts_with("HTTP/") {
        e.lines().next().unwrap_or(e).to_owned()
    } else {
        e.to_owned()
    }
}

async fn get(
    config: Arc<rustls::ClientConfig>,
    addr: SocketAddr,
    sni: String,
    path: String,
    wait: Duration,
) -> Result<(), String> {
    let mut tls = connect(config, addr, &sni).await?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: {sni}\r\nConnection: close\r\n\r\n");
    tls.write_all(req.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut resp = Vec::new();
    tokio::time::timeout(wait, tls.read_to_end(&mut resp))
        .await
        .map_err(|_| "response timed out".to_owned())?
        .map_err(|e| e.to_string())?;
    if resp.starts_with(b"HTTP/1.1 200") {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&resp[..resp.len().min(80)]).into_owned())
    }
}

/// Something to read and write: TLS or plain TCP.
trait Io: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Io for T {}

async fn request(args: RequestArgs) -> Result<serde_json::Value, String> {
    let h2 = args.h2_authority.is_some();
    let io: Box<dyn Io> = match &args.sni {
        Some(sni) => {
            let config = tls_config_alpn(&args.ca, if h2 { b"h2" } else { b"http/1.1" })?;
            Box::new(connect(config, args.connect, sni).await?)
        }
        None => Box::new(
            tokio::time::timeout(
                Duration::from_secs(10),
                tokio::net::TcpStream::connect(args.connect),
            )
            .await
            .map_err(|_| "connect timed out".to_owned())?
            .map_err(|e| format!("connect: {e}"))?,
        ),
    };
    if let Some(authority) = args.h2_authority {
        return h2_request(io, &authority, &args.hosts, args.pad).await;
    }
    let bytes = match (args.raw, args.hex) {
        (Some(raw), _) => raw.replace("\\r", "\r").replace("\\n", "\n").into_bytes(),
        (None, Some(hex)) => unhex(&hex)?,
        (None, None) => return Err("give --raw, --hex or --h2-authority".to_owned()),
    };
    let mut io = io;
    io.write_all(&bytes).await.map_err(|e| e.to_string())?;
    let mut resp = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), io.read_to_end(&mut resp)).await;
    Ok(serde_json::json!({"response": String::from_utf8_lossy(&resp)}))
}

/// `hex` as bytes (two digits a byte).
fn unhex(hex: &str) -> Result<Vec<u8>, String> {
    let digits = hex.trim().as_bytes();
    if !digits.len().is_multiple_of(2) {
        return Err("--hex: an odd number of digits".to_owned());
    }
    digits
        .chunks(2)
        .map(|pair| {
            std::str::from_utf8(pair)
                .ok()
                .and_then(|d| u8::from_str_radix(d, 16).ok())
                .ok_or_else(|| {
                    format!(
                        "--hex: {:?} is not a hex byte",
                        String::from_utf8_lossy(pair)
                    )
                })
        })
        .collect()
}

async fn h2_request(
    io: Box<dyn Io>,
    authority: &str,
    hosts: &[String],
    pad: usize,
) -> Result<serde_json::Value, String> {
    use http_body_util::BodyExt;
    let (mut sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(io),
    )
    .await
    .map_err(|e| format!("h2 handshake: {e}"))?;
    tokio::spawn(conn);
    let mut req = hyper::Request::builder().uri(format!("https://{authority}/"));
    for h in hosts {
        req = req.header("host", h);
    }
    if pad > 0 {
        req = req.header("x-pad", "p".repeat(pad));
    }
    let req = req
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .map_err(|e| e.to_string())?;
    let resp = tokio::time::timeout(Duration::from_secs(10), sender.send_request(req))
        .await
        .map_err(|_| "response timed out".to_owned())?
        .map_err(|e| format!("h2 request: {e}"))?;
    let status = resp.status().as_u16();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok(serde_json::json!({"status": status, "body": String::from_utf8_lossy(&body)}))
}

#[tokio::main]
async fn main() -> ExitCode {
    let out = match Args::parse().cmd {
        Cmd::Request(args) => request(args).await,
        Cmd::Line {
            target: Target { connect, sni, ca },
            send,
        } => match tls_config(&ca) {
            Ok(c) => line(c, connect, &sni, &send).await,
            Err(e) => Err(e),
        },
        Cmd::Many {
            target: Target { connect, sni, ca },
            count,
            concurrency,
            path,
            response_timeout_secs,
        } => match tls_config(&ca) {
            Err(e) => Err(e),
            Ok(config) => {
                let gate = Arc::new(tokio::sync::Semaphore::new(concurrency.max(1)));
                let wait = Duration::from_secs(response_timeout_secs);
                let mut tasks = Vec::with_capacity(count);
                for _ in 0..count {
                    let (config, sni, path, gate) =
                        (config.clone(), sni.clone(), path.clone(), gate.clone());
                    tasks.push(tokio::spawn(async move {
                        let _permit = gate.acquire_owned().await;
                        get(config, connect, sni, path, wait).await
                    }));
                }
                let mut ok = 0usize;
                // Every failure counted by its kind, so a test judges all of
                // them, not a sample.
                let mut errors: BTreeMap<String, usize> = BTreeMap::new();
                for t in tasks {
                    match t.await {
                        Ok(Ok(())) => ok += 1,
                        Ok(Err(e)) => *errors.entry(error_kind(&e)).or_default() += 1,
                        Err(e) => *errors.entry(e.to_string()).or_default() += 1,
                    }
                }
                Ok(serde_json::json!({"ok": ok, "failed": count - ok, "errors": errors}))
            }
        },
    };
    match out {
        Ok(v) => {
            println!("{v}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("egress-probe: {e}");
            ExitCode::FAILURE
        }
    }
}
