//! The way out: one TCP connect to the original destination, direct or
//! through the operator's CONNECT proxy (both the splice and the intercept
//! path use it), the TLS client configs that verify origins, the
//! terminating server config, and the pool of idle upstream HTTP
//! connections. Owned by the intercept path; the splice path only borrows
//! [`connect_out`].

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use egress_certs::{LeafMinter, LeafResolver};
use egress_policy::Hostname;
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::net::TcpStream;

use crate::config::{Config, Timeouts};
use crate::fault::Fault;
use crate::metrics::Metrics;
use crate::pool::{Body, Sender, UpstreamPool};
use crate::upstream_proxy::{ProxyError, ProxyFailure, Route};

/// Sessions the shared terminating config remembers for resumption.
const RESUMABLE_SESSIONS: usize = 10_000;
/// Registrations with client configs of their own at once (each holds a
/// view of [`sessions::Sessions`], where the tickets are); the least
/// recently used make room.
const REGISTRATIONS_WITH_SESSIONS: u64 = 16_384;
/// A registration that opened no upstream TLS connection for this long
/// loses its configs.
const SESSIONS_IDLE: Duration = Duration::from_secs(30 * 60);

mod sessions;

/// A `tls.extra_upstream_roots` file that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("tls.extra_upstream_roots: {path}: {message}")]
pub struct RootsError {
    pub path: String,
    pub message: String,
}

/// Why no connection to the original destination was opened.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConnectError {
    /// The direct TCP connect failed.
    #[error("{0}")]
    Direct(std::io::Error),
    /// The operator's proxy gave no tunnel (nothing was tried direct).
    #[error(transparent)]
    Proxy(ProxyError),
}

impl ConnectError {
    /// Whose fault it was, for `egress_flow_errors_total`.
    pub(crate) fn fault(&self) -> Fault {
        match self {
            Self::Direct(e) => Fault::connect(e),
            Self::Proxy(e) => Fault::proxy(&e.failure),
        }
    }

    /// The flow log's `error`: `upstream_connect: …` or `upstream_proxy: …`.
    pub(crate) fn log(&self) -> String {
        match self {
            Self::Direct(e) => format!("upstream_connect: {e}"),
            Self::Proxy(e) => format!("upstream_proxy: {e}"),
        }
    }
}

/// Why a request could not be forwarded: the client gets a 502 saying so.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ForwardError {
    #[error("cannot connect to {0}: {1}")]
    Connect(SocketAddr, ConnectError),
    #[error("upstream TLS failed for {name}: {reason}")]
    Tls {
        name: String,
        reason: String,
        fault: Fault,
    },
    #[error("upstream HTTP failed: {0}")]
    Http(String),
    /// The failure of a connect another request of the client connection
    /// made while this one waited for it, with the proxy's header if the
    /// operator's proxy caused it.
    #[error("{message}")]
    Failed {
        fault: Fault,
        message: String,
        proxy: Option<http::HeaderValue>,
    },
}

impl ForwardError {
    /// Whose fault it was, for `egress_flow_errors_total`.
    pub(crate) fn fault(&self) -> Fault {
        match self {
            Self::Connect(_, e) => e.fault(),
            Self::Tls { fault, .. } => *fault,
            Self::Http(_) => Fault::UPSTREAM_HTTP,
            Self::Failed { fault, .. } => *fault,
        }
    }

    /// The client's `502`: the error as its body (after `context`, if any),
    /// and for a proxy's failure `x-egress-upstream-proxy: <proxy>; <result>`
    /// (`; status=<n>` for a refusal), so a client can tell the operator's
    /// proxy from the origin without parsing the text.
    pub(crate) fn response(&self, context: &str) -> http::Response<Body> {
        let mut resp =
            crate::reply::text(http::StatusCode::BAD_GATEWAY, &format!("{context}{self}\n"));
        if let Some(v) = self.proxy_header() {
            resp.headers_mut().insert(PROXY_HEADER, v);
        }
        resp
    }

    /// `x-egress-upstream-proxy`'s value, when the operator's proxy caused
    /// the failure.
    pub(crate) fn proxy_header(&self) -> Option<http::HeaderValue> {
        match self {
            Self::Connect(_, ConnectError::Proxy(e)) => {
                let mut v = format!("{}; {}", e.proxy, e.failure.result());
                if let ProxyFailure::Refused { status, .. } = &e.failure {
                    v.push_str(&format!("; status={status}"));
                }
                http::HeaderValue::from_str(&v).ok()
            }
            Self::Failed { proxy, .. } => proxy.clone(),
            _ => None,
        }
    }
}

/// The header of a `502` the operator's upstream proxy caused.
pub(crate) const PROXY_HEADER: &str = "x-egress-upstream-proxy";

/// The TLS client configs that verify origins, with one session store.
#[derive(Clone)]
struct ClientTls {
    /// Offers h2 and HTTP/1.1 (for HTTP/2 clients).
    tls: Arc<rustls::ClientConfig>,
    /// The same, HTTP/1.1 only (HTTP/1.1 clients, upgrades).
    tls_h1: Arc<rustls::ClientConfig>,
}

/// The intercept path's state.
pub(crate) struct Upstreams {
    pub(crate) minter: Arc<LeafMinter>,
    /// The configs each registration's are made from; they resume nothing.
    base: ClientTls,
    /// Each registration's configs ([`crate::registry::Sandbox::serial`]),
    /// with a session store of its own: a session one sandbox's connection
    /// got is resumed only by that sandbox's, so an origin cannot link two
    /// tenants' connections through one ticket.
    by_registration: moka::sync::Cache<u64, ClientTls>,
    /// Every registration's tickets, bounded in all ([`sessions`]).
    sessions: Arc<sessions::Sessions>,
    /// The terminating side for clients that send an SNI: one config, so
    /// its session cache lets those clients resume.
    pub(crate) server_tls: Arc<rustls::ServerConfig>,
    /// The TLS library calls, both sides ([`crate::aes_gcm`]).
    pub(crate) provider: Arc<rustls::crypto::CryptoProvider>,
    /// Idle upstream connections, across client connections.
    pub(crate) pool: UpstreamPool,
}

impl Upstreams {
    pub(crate) fn new(config: &Config, minter: Arc<LeafMinter>) -> Result<Self, RootsError> {
        let roots = Arc::new(roots(config)?);
        let choice = config.tls.aes_gcm;
        let provider = crate::aes_gcm::provider(choice);
        tracing::info!(
            configured = ?choice,
            used = ?choice.resolved(),
            "TLS 1.3 AES-GCM records sealed and opened by this library (tls.aes_gcm)"
        );
        let build = |alpn: &[&[u8]]| {
            let mut c = client_builder(&provider)
                .with_root_certificates(roots.clone())
                .with_no_client_auth();
            c.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
            // Each registration's copy gets a store of its own.
            c.resumption = rustls::client::Resumption::disabled();
            Arc::new(c)
        };
        let base = ClientTls {
            tls: build(&[b"h2", b"http/1.1"]),
            tls_h1: build(&[b"http/1.1"]),
        };
        Ok(Self {
            server_tls: server_tls(&provider, &minter, None),
            provider,
            minter,
            base,
            by_registration: moka::sync::Cache::builder()
                .max_capacity(REGISTRATIONS_WITH_SESSIONS)
                .time_to_idle(SESSIONS_IDLE)
                .build(),
            sessions: Arc::default(),
            pool: UpstreamPool::default(),
        })
    }

    /// Registration `serial`'s configs, made on its first TLS connection.
    fn client_tls(&self, serial: u64) -> ClientTls {
        self.by_registration.get_with(serial, || {
            let store = self.sessions.of(serial);
            let own = |base: &rustls::ClientConfig| {
                let mut c = base.clone();
                c.resumption = rustls::client::Resumption::store(store.clone());
                Arc::new(c)
            };
            ClientTls {
                tls: own(&self.base.tls),
                tls_h1: own(&self.base.tls_h1),
            }
        })
    }

    /// The same configs (the terminating one too, so sessions resume on any
    /// thread) with an empty pool of its own: one per worker thread with
    /// `limits.thread_per_core`, so a pooled connection is only ever used on
    /// the runtime its I/O is registered with.
    pub(crate) fn for_worker(&self) -> Self {
        Self {
            minter: self.minter.clone(),
            base: self.base.clone(),
            by_registration: self.by_registration.clone(),
            sessions: self.sessions.clone(),
            server_tls: self.server_tls.clone(),
            provider: self.provider.clone(),
            pool: UpstreamPool::default(),
        }
    }

    /// Opens an HTTP connection to `dst` for registration `serial`: TLS
    /// verified for `verify_as` (or, without a name, for the address) when
    /// `tls`, else plain. `allow_h2`: offer HTTP/2 (not for upgrades).
    pub(crate) async fn connect(
        &self,
        (dst, route, serial): (SocketAddr, &Route, u64),
        tls: bool,
        verify_as: Option<&Hostname>,
        allow_h2: bool,
        timeouts: &Timeouts,
        metrics: &Metrics,
    ) -> Result<Sender, ForwardError> {
        let tcp = connect_out(route, dst, timeouts.connect, metrics)
            .await
            .map_err(|e| ForwardError::Connect(dst, e))?;
        bound_unread(&tcp, timeouts.idle);
        if !tls {
            return http1(tcp).await;
        }
        let own = self.client_tls(serial);
        let config = if allow_h2 { &own.tls } else { &own.tls_h1 };
        let (name, server_name) = match verify_as {
            Some(n) => (
                n.to_string(),
                ServerName::try_from(n.as_str().to_owned()).map_err(|e| ForwardError::Tls {
                    name: n.to_string(),
                    reason: e.to_string(),
                    fault: Fault::upstream_tls(&std::io::Error::other(e)),
                })?,
            ),
            None => (dst.ip().to_string(), ServerName::IpAddress(dst.ip().into())),
        };
        let failed = |e: std::io::Error| ForwardError::Tls {
            name: name.clone(),
            reason: e.to_string(),
            fault: Fault::upstream_tls(&e),
        };
        let connector = tokio_rustls::TlsConnector::from(config.clone());
        let tls = tokio::time::timeout(timeouts.tls_handshake, connector.connect(server_name, tcp))
            .await
            .map_err(|_| {
                failed(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "handshake timed out",
                ))
            })?
            .map_err(failed)?;
        if tls.get_ref().1.alpn_protocol() == Some(b"h2") {
            // The `h2` crate is the only reader of `tls`: see `http1`.
            let io = crate::io::Coalesce::new(crate::io::ReadLatch::new(tls));
            let sender = crate::h2client::handshake(io)
                .await
                .map_err(|e| ForwardError::Http(e.to_string()))?;
            Ok(Sender::H2(sender))
        } else {
            http1(tls).await
        }
    }
}

async fn http1<I>(io: I) -> Result<Sender, ForwardError>
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    // hyper is the only reader of `io`: the latch spares it the reads that
    // would find nothing.
    let io = crate::io::ReadLatch::new(io);
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .map_err(|e| ForwardError::Http(e.to_string()))?;
    tokio::spawn(conn.with_upgrades());
    Ok(Sender::H1(sender))
}

/// A connection to the original destination `dst`, the way `route` says:
/// direct, or tunnelled through the operator's proxy (never direct when a
/// proxy is the way: its failure is the connection's). Within `timeout`,
/// timed in `upstream_connect_seconds`; a proxy's answer is counted in
/// `upstream_proxy_connects_total`. The error says why, for the flow log
/// and 502s.
pub(crate) async fn connect_out(
    route: &Route,
    dst: SocketAddr,
    timeout: Duration,
    metrics: &Metrics,
) -> Result<TcpStream, ConnectError> {
    let proxy = match route {
        Route::Direct => {
            return connect_tcp(dst, timeout, metrics)
                .await
                .map_err(ConnectError::Direct)
        }
        Route::Missing(name) => {
            return Err(ConnectError::Proxy(ProxyError {
                proxy: name.clone(),
                failure: ProxyFailure::Missing,
            }))
        }
        Route::Via(proxy) => proxy,
    };
    let started = Instant::now();
    let tunnel = crate::upstream_proxy::connect(proxy, dst, timeout).await;
    metrics
        .upstream_connect_seconds
        .observe(started.elapsed().as_secs_f64());
    let result = tunnel.as_ref().map_or_else(ProxyFailure::result, |_| "ok");
    metrics.proxy_connect(proxy.name.as_str(), result);
    tunnel.map_err(|failure| {
        ConnectError::Proxy(ProxyError {
            proxy: proxy.name.clone(),
            failure,
        })
    })
}

/// Past `idle` with bytes the origin has not taken (unacknowledged, or held
/// back by a window it keeps shut), the kernel ends the connection. The
/// connection's task outlives the flow it served (it closes the TLS session
/// after the last request, or waits on a body), and an origin that stops
/// reading would otherwise hold the task and its socket for good: neither
/// the flow's slot nor the pool counts them.
fn bound_unread(tcp: &TcpStream, idle: Duration) {
    if let Err(error) = socket2::SockRef::from(tcp).set_tcp_user_timeout(Some(idle)) {
        tracing::debug!(%error, "TCP_USER_TIMEOUT not set on an origin connection");
    }
}

/// TCP to the original destination within `timeout`, timed in
/// `upstream_connect_seconds`; the error says why, for the flow log and 502s.
async fn connect_tcp(
    dst: SocketAddr,
    timeout: Duration,
    metrics: &Metrics,
) -> Result<TcpStream, std::io::Error> {
    let started = Instant::now();
    let tcp = tokio::time::timeout(timeout, TcpStream::connect(dst)).await;
    metrics
        .upstream_connect_seconds
        .observe(started.elapsed().as_secs_f64());
    let tcp = tcp.map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "timed out"))??;
    let _ = tcp.set_nodelay(true);
    Ok(tcp)
}

/// The terminating TLS config. `fallback_ip`: mint for this address when the
/// client sends no SNI — such a config is per flow, so it neither keeps
/// sessions nor issues tickets. The shared one (no fallback) issues
/// stateless tickets (or, without a ticket key, keeps up to
/// [`RESUMABLE_SESSIONS`]), so a client that reconnects skips the full
/// handshake; a resumed session decides nothing — each request is still
/// judged on the flow's SNI and Host.
pub(crate) fn server_tls(
    provider: &Arc<rustls::crypto::CryptoProvider>,
    minter: &Arc<LeafMinter>,
    fallback_ip: Option<IpAddr>,
) -> Arc<rustls::ServerConfig> {
    // aws-lc-rs's provider with one AEAD's calls swapped supports the same
    // versions as aws-lc-rs's own, which `builder()` takes without a check.
    #[allow(clippy::unwrap_used)]
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap();
    let mut config = builder
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(LeafResolver::new(minter.clone(), fallback_ip)));
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    // No 0-RTT: early data could be replayed before policy sees the request.
    config.max_early_data_size = 0;
    if fallback_ip.is_some() {
        config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        config.send_tls13_tickets = 0;
    } else {
        // Stateless tickets (sealed with a key rotated every 6 h, good for
        // 12 h): the gateway keeps nothing per session, so one sandbox
        // making thousands of handshakes pushes no other's sessions out of a
        // shared cache. TLS 1.2 clients without tickets do not resume.
        match rustls::crypto::aws_lc_rs::Ticketer::new() {
            Ok(ticketer) => {
                config.ticketer = ticketer;
                config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
            }
            Err(e) => {
                tracing::warn!(error = %e, "no session ticket key; sessions are remembered in memory instead");
                config.session_storage =
                    rustls::server::ServerSessionMemoryCache::new(RESUMABLE_SESSIONS);
            }
        }
    }
    Arc::new(config)
}

/// A client config builder over `provider`, with the default versions.
pub(crate) fn client_builder(
    provider: &Arc<rustls::crypto::CryptoProvider>,
) -> rustls::ConfigBuilder<rustls::ClientConfig, rustls::WantsVerifier> {
    // As for the server side: the versions of aws-lc-rs's own provider.
    #[allow(clippy::unwrap_used)]
    rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap()
}

/// Trusted roots for origins: the built-in web roots plus `tls.extra_upstream_roots`.
fn roots(config: &Config) -> Result<rustls::RootCertStore, RootsError> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    for path in &config.tls.extra_upstream_roots {
        let err = |message: String| RootsError {
            path: path.display().to_string(),
            message,
        };
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
            .map_err(|e| err(e.to_string()))?
            .collect::<Result<_, _>>()
            .map_err(|e| err(e.to_string()))?;
        if certs.is_empty() {
            return Err(err("no PEM certificates in the file".into()));
        }
        for c in certs {
            roots.add(c).map_err(|e| err(e.to_string()))?;
        }
    }
    Ok(roots)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upstream_proxy::{ProxyError, ProxyFailure, ProxyName};

    /// A request that waited behind a connect the operator's proxy refused
    /// gets the same `502` as the one that connected: its fault, its text
    /// and `x-egress-upstream-proxy`.
    #[test]
    fn a_shared_failure_says_what_the_proxy_said() {
        let dst: SocketAddr = "203.0.113.7:443".parse().expect("addr");
        let refused = ForwardError::Connect(
            dst,
            ConnectError::Proxy(ProxyError {
                proxy: ProxyName::parse("corp").expect("name"),
                failure: ProxyFailure::Refused {
                    dst,
                    status: 407,
                    reason: "Proxy Authentication Required".into(),
                },
            }),
        );
        let shared = ForwardError::Failed {
            fault: refused.fault(),
            message: refused.to_string(),
            proxy: refused.proxy_header(),
        };
        let (first, again) = (refused.response(""), shared.response(""));
        let header = |r: &http::Response<Body>| r.headers().get(PROXY_HEADER).cloned();
        assert_eq!(
            header(&first).as_ref().map(|v| v.as_bytes()),
            Some(&b"corp; refused; status=407"[..])
        );
        assert_eq!(header(&again), header(&first));
        assert_eq!(shared.fault(), refused.fault());
        assert_eq!(shared.to_string(), refused.to_string());
    }
}

#[cfg(test)]
mod session_tests {
    use super::*;
    use egress_certs::{CertificateAuthority, MintConfig};

    /// The shared terminating config keeps no state per session (a sandbox
    /// making handshakes evicts nobody's), and issues tickets instead; the
    /// per-flow one (no SNI) does neither.
    #[test]
    fn the_shared_config_resumes_by_stateless_tickets() {
        let dir = tempfile::tempdir().expect("temp");
        let ca = CertificateAuthority::load_or_create(&dir.path().join("ca")).expect("ca");
        let minter =
            Arc::new(LeafMinter::new(Arc::new(ca), MintConfig::default()).expect("minter"));
        let provider = crate::aes_gcm::provider(crate::aes_gcm::AesGcm::Auto);
        let shared = server_tls(&provider, &minter, None);
        assert!(shared.ticketer.enabled(), "tickets");
        assert!(!shared.session_storage.can_cache(), "no session cache");
        let per_flow = server_tls(&provider, &minter, Some("203.0.113.7".parse().expect("ip")));
        assert!(!per_flow.ticketer.enabled());
        assert_eq!(per_flow.send_tls13_tickets, 0);
    }
}
