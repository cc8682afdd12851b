//! `query --doh-sni NAME --doh-ca FILE`: the same queries as RFC 8484 POSTs
//! over one TLS + HTTP/2 connection, as a browser sends them, `concurrency`
//! streams at a time. `target` is where the sandbox believes the resolver
//! is (8.8.8.8:443); the benchmark's redirect takes it to the gateway.

use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::net::TcpSocket;

use crate::{encode_query, finish, Load, Tally};

type Sender = SendRequest<Full<Bytes>>;

pub(crate) async fn run(load: Load, sni: &str, ca: &Path, concurrency: u32) -> Result<(), String> {
    let sender = connect(&load, sni, ca).await?;
    let load = Arc::new(load);
    let next = Arc::new(AtomicU32::new(0));
    let started = Instant::now();
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (load, next, sender) = (load.clone(), next.clone(), sender.clone());
            let uri = format!("https://{sni}/dns-query");
            tokio::spawn(async move { worker(&load, sender, uri, &next).await })
        })
        .collect();
    finish(workers, started).await
}

/// TLS (trusting `ca`, ALPN h2) and HTTP/2 to `load.target` from `load.source`.
async fn connect(load: &Load, sni: &str, ca: &Path) -> Result<Sender, String> {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca).map_err(|e| format!("{}: {e}", ca.display()))? {
        roots
            .add(c.map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
    }
    let mut config = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let socket = if load.source.is_ipv4() {
        TcpSocket::new_v4()
    } else {
        TcpSocket::new_v6()
    }
    .map_err(|e| e.to_string())?;
    socket
        .bind((load.source, 0).into())
        .map_err(|e| format!("bind {}: {e}", load.source))?;
    let tcp = socket
        .connect(load.target)
        .await
        .map_err(|e| format!("connect to {}: {e}", load.target))?;
    tcp.set_nodelay(true).map_err(|e| e.to_string())?;
    let name = ServerName::try_from(sni.to_owned()).map_err(|e| e.to_string())?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .map_err(|e| format!("TLS to {sni}: {e}"))?;
    let (sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .map_err(|e| format!("HTTP/2: {e}"))?;
    tokio::spawn(conn);
    Ok(sender)
}

/// Takes query numbers until `count` is reached (or the deadline passes);
/// one stream outstanding.
async fn worker(
    load: &Load,
    mut sender: Sender,
    uri: String,
    next: &AtomicU32,
) -> Result<(Histogram<u64>, Tally), String> {
    let mut hist = Histogram::<u64>::new(3).map_err(|e| e.to_string())?;
    let mut tally = Tally::default();
    let mut q = Vec::with_capacity(512);
    loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        if i >= load.count || Instant::now() >= load.deadline {
            return Ok((hist, tally));
        }
        // RFC 8484 §4.1: id 0, so answers are cacheable.
        encode_query(&mut q, 0, &format!("{}{i}.bench.test", load.prefix))?;
        let sent = Instant::now();
        let answered = tokio::time::timeout(load.timeout, ask(&mut sender, &uri, &q)).await;
        match answered {
            Ok(Ok(0)) => {
                tally.answered += 1;
                let us = u64::try_from(sent.elapsed().as_micros()).unwrap_or(u64::MAX);
                hist.record(us.max(1)).map_err(|e| e.to_string())?;
            }
            Ok(Ok(5)) => tally.refused += 1,
            _ => tally.failed += 1,
        }
    }
}

/// One POST; the answer's RCODE.
async fn ask(sender: &mut Sender, uri: &str, query: &[u8]) -> Result<u8, String> {
    let req = hyper::Request::builder()
        .method("POST")
        .uri(uri)
        .header("content-type", "application/dns-message")
        .header("accept", "application/dns-message")
        .body(Full::new(Bytes::copy_from_slice(query)))
        .map_err(|e| e.to_string())?;
    sender.ready().await.map_err(|e| e.to_string())?;
    let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
    if resp.status() != 200 {
        return Err(format!("status {}", resp.status()));
    }
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    match body.get(..12) {
        Some(h) if h[2] & 0x80 != 0 => Ok(h[3] & 0x0f),
        _ => Err("not a DNS answer".to_owned()),
    }
}
