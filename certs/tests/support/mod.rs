#![allow(unreachable_pub, dead_code)] // shared by several test binaries, each using part
//! What the certs crate's integration tests share: a TLS server on loopback
//! that serves minted leaves.

use std::net::SocketAddr;
use std::sync::Arc;

use egress_certs::LeafResolver;
use rustls::ServerConfig;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

/// Serves every connection with `resolver`, writing `ok` after the handshake.
pub async fn server(resolver: LeafResolver) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let config = ServerConfig::builder()
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(resolver));
    let acceptor = TlsAcceptor::from(Arc::new(config));
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                if let Ok(mut tls) = acceptor.accept(tcp).await {
                    let _ = tls.write_all(b"ok").await;
                    let _ = tls.shutdown().await;
                }
            });
        }
    });
    addr
}
