//! The running gateway: listeners, shared state, and the stages of a flow.
//!
//! ```text
//! Accepted ─▶ original destination ─▶ sandbox ─▶ peek (TLS / HTTP / opaque)
//!          ─▶ attribution + decide ─▶ deny │ splice (allow, splice) │ intercept
//! ```
//! Every stage that cannot complete ends the flow denied (fail closed), and
//! every flow writes one line to the flow log.

use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use dns_attrib::{AttributionCache, CacheConfig, DnsProxy, ProxyConfig, SystemClock};
use egress_certs::{CertificateAuthority, LeafMinter, MintConfig};
use egress_policy::{Destination, Flow, Hostname, PlatformDenies, Protocol, Verdict};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::config::Config;
use crate::flowlog::{FlowLog, FlowRecord};
use crate::io::{Counted, Counts, Rewind};
use crate::peek::{peek, Classified, PeekError};
use crate::registry::Registry;

/// How the original destination of a redirected connection is learned.
pub trait OriginalDst: Send + Sync + 'static {
    fn original_dst(&self, stream: &TcpStream) -> io::Result<SocketAddr>;
}

/// `SO_ORIGINAL_DST` / `IP6T_SO_ORIGINAL_DST`, set by the nftables `redirect`.
#[derive(Debug, Default)]
pub struct SoOriginalDst;

impl OriginalDst for SoOriginalDst {
    fn original_dst(&self, stream: &TcpStream) -> io::Result<SocketAddr> {
        let sock = socket2::SockRef::from(stream);
        let addr = match stream.local_addr()? {
            SocketAddr::V4(_) => sock.original_dst_v4()?,
            SocketAddr::V6(_) => sock.original_dst_v6()?,
        };
        addr.as_socket().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                "original destination is not an IP address",
            )
        })
    }
}

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("interception CA: {0}")]
    Ca(#[from] egress_certs::CertError),
    #[error("tls.extra_upstream_roots: {path}: {message}")]
    Roots { path: String, message: String },
    #[error("log.flow_log: {path}: {source}")]
    FlowLog { path: String, source: io::Error },
    #[error("admin.token_file: {path}: {message}")]
    Token { path: String, message: String },
    #[error("{0}")]
    Snapshot(#[from] crate::persist::PersistError),
    #[error("cannot listen on {what} {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        source: io::Error,
    },
}

/// State every flow reads.
pub struct Shared {
    config: arc_swap::ArcSwap<Config>,
    pub registry: Arc<Registry>,
    pub cache: Arc<AttributionCache>,
    pub minter: Arc<LeafMinter>,
    pub(crate) upstream_tls: Arc<rustls::ClientConfig>,
    pub(crate) upstream_tls_h1: Arc<rustls::ClientConfig>,
    /// The terminating side for clients that send an SNI: one config, so
    /// its session cache lets those clients resume (see `intercept`).
    pub(crate) server_tls: Arc<rustls::ServerConfig>,
    pub(crate) flow_log: FlowLog,
    orig_dst: Arc<dyn OriginalDst>,
    pub dns: Arc<DnsProxy>,
    pub(crate) ready: AtomicBool,
    pub(crate) metrics: crate::metrics::Metrics,
    pub(crate) admin_token: Option<String>,
    /// Serialises pushes, so each one's snapshot write matches its state.
    pub(crate) push_lock: tokio::sync::Mutex<()>,
    /// One permit per flow being handled; draining takes them all.
    slots: Arc<Semaphore>,
    /// Idle upstream connections of the intercept path.
    pub(crate) pool: crate::pool::UpstreamPool,
}

/// The addresses the gateway actually listens on (ports may have been 0).
#[derive(Clone, Copy, Debug)]
pub struct Bound {
    pub transparent: SocketAddr,
    pub dns: SocketAddr,
    pub dns_alt: SocketAddr,
    pub admin: SocketAddr,
}

/// A bound, running gateway.
pub struct Gateway {
    shared: Arc<Shared>,
    bound: Bound,
    tasks: JoinSet<()>,
}

const RESOLVER_PRIMARY: SocketAddr =
    SocketAddr::new(IpAddr::V4(std::net::Ipv4Addr::new(8, 8, 8, 8)), 53);
const RESOLVER_ALT: SocketAddr =
    SocketAddr::new(IpAddr::V4(std::net::Ipv4Addr::new(1, 1, 1, 1)), 53);

// === impl Shared ===

impl Shared {
    /// The configuration in force now (a cheap snapshot; see [`Shared::reload`]).
    pub fn config(&self) -> Arc<Config> {
        self.config.load_full()
    }

    /// Applies what can change without a restart (`timeouts`, `limits`
    /// other than `max_connections`, `log`); returns the keys that changed
    /// but need a restart, which keep their running values.
    pub fn reload(&self, mut next: Config) -> Vec<&'static str> {
        let now = self.config();
        let mut restart = Vec::new();
        let mut keep = |key: &'static str, changed: bool| {
            if changed {
                restart.push(key);
            }
        };
        keep("state_dir", next.state_dir != now.state_dir);
        keep(
            "listen",
            format!("{:?}", next.listen) != format!("{:?}", now.listen),
        );
        keep("dns", format!("{:?}", next.dns) != format!("{:?}", now.dns));
        keep("tls", format!("{:?}", next.tls) != format!("{:?}", now.tls));
        keep(
            "policy",
            format!("{:?}", next.policy) != format!("{:?}", now.policy),
        );
        keep(
            "admin",
            format!("{:?}", next.admin) != format!("{:?}", now.admin),
        );
        keep(
            "limits.max_connections",
            next.limits.max_connections != now.limits.max_connections,
        );
        keep(
            "limits.leaf_cache",
            next.limits.leaf_cache != now.limits.leaf_cache,
        );
        keep(
            "limits.worker_threads",
            next.limits.worker_threads != now.limits.worker_threads,
        );
        keep("log.flow_log", next.log.flow_log != now.log.flow_log);
        next.state_dir.clone_from(&now.state_dir);
        next.listen = now.listen.clone();
        next.dns = now.dns.clone();
        next.tls = now.tls.clone();
        next.policy = now.policy.clone();
        next.admin = now.admin.clone();
        next.limits.max_connections = now.limits.max_connections;
        next.limits.leaf_cache = now.limits.leaf_cache;
        next.limits.worker_threads = now.limits.worker_threads;
        next.log = now.log.clone();
        self.config.store(Arc::new(next));
        restart
    }
}

// === impl Gateway ===

impl Gateway {
    /// Loads the CA, binds every listener and starts serving.
    pub async fn start(
        config: Config,
        orig_dst: Arc<dyn OriginalDst>,
        flow_log: FlowLog,
    ) -> Result<Self, StartError> {
        let ca = match config.ca_paths() {
            Some(paths) => CertificateAuthority::load(&paths)?,
            None => CertificateAuthority::load_or_create(&config.state_dir.join("ca"))?,
        };
        let minter = Arc::new(LeafMinter::new(
            Arc::new(ca),
            MintConfig {
                cache_capacity: config.limits.leaf_cache,
                ..MintConfig::default()
            },
        )?);
        let (upstream_tls, upstream_tls_h1) = upstream_tls(&config)?;
        let admin_token = match &config.admin.token_file {
            None => None,
            Some(path) => Some(read_token(path)?),
        };

        let bind_tcp = |what, addr| async move {
            TcpListener::bind(addr)
                .await
                .map_err(|source| StartError::Bind { what, addr, source })
        };
        let transparent = bind_tcp("listen.transparent", config.listen.transparent).await?;
        let (dns_udp, dns_tcp) = bind_dns("listen.dns", config.listen.dns).await?;
        let (alt_udp, alt_tcp) = bind_dns("listen.dns_alt", config.listen.dns_alt).await?;
        let admin = bind_tcp("listen.admin", config.listen.admin).await?;
        let local = |l: io::Result<SocketAddr>, what, addr| {
            l.map_err(|source| StartError::Bind { what, addr, source })
        };
        let bound = Bound {
            transparent: local(
                transparent.local_addr(),
                "listen.transparent",
                config.listen.transparent,
            )?,
            dns: local(dns_udp.local_addr(), "listen.dns", config.listen.dns)?,
            dns_alt: local(
                alt_udp.local_addr(),
                "listen.dns_alt",
                config.listen.dns_alt,
            )?,
            admin: local(admin.local_addr(), "listen.admin", config.listen.admin)?,
        };

        // The gateway's own addresses are never a destination.
        let mut platform = config.policy.platform_deny.clone();
        for addr in [bound.transparent, bound.dns, bound.dns_alt, bound.admin] {
            if !addr.ip().is_unspecified() {
                platform.push(Destination::Ip(addr.ip()));
            }
        }
        let registry = Arc::new(Registry::new(Arc::new(PlatformDenies::new(platform))));
        let cache = Arc::new(AttributionCache::new(
            CacheConfig {
                min_ttl: config.dns.min_ttl,
                max_ttl: config.dns.max_ttl,
                ..CacheConfig::default()
            },
            SystemClock::new(),
        ));
        let dns = DnsProxy::new(
            ProxyConfig {
                upstreams: config.dns.upstreams.clone(),
                upstream_timeout: config.dns.upstream_timeout,
                ..ProxyConfig::default()
            },
            cache.clone(),
            registry.clone(),
        );
        // The last pushed state, before a single flow is served.
        if let Some(doc) = crate::persist::load(&config.state_dir)? {
            let n = crate::persist::apply(&registry, doc, &config.state_dir)?;
            tracing::info!(sandboxes = n, path = %crate::persist::path(&config.state_dir).display(), "loaded snapshot");
        }
        let metrics =
            crate::metrics::Metrics::new(dns.metrics().clone(), cache.clone(), minter.clone());
        let slots = Arc::new(Semaphore::new(config.limits.max_connections));
        let server_tls = crate::intercept::server_tls(&minter, None);
        let shared = Arc::new(Shared {
            metrics,
            admin_token,
            push_lock: tokio::sync::Mutex::new(()),
            slots,
            pool: crate::pool::UpstreamPool::default(),
            config: arc_swap::ArcSwap::from_pointee(config),
            registry,
            cache,
            minter,
            upstream_tls,
            upstream_tls_h1,
            server_tls,
            flow_log,
            orig_dst,
            dns: dns.clone(),
            ready: AtomicBool::new(false),
        });
        let mut tasks = JoinSet::new();
        tasks.spawn(dns.clone().serve_udp(dns_udp, RESOLVER_PRIMARY));
        tasks.spawn(dns.clone().serve_tcp(dns_tcp, RESOLVER_PRIMARY));
        tasks.spawn(dns.clone().serve_udp(alt_udp, RESOLVER_ALT));
        tasks.spawn(dns.serve_tcp(alt_tcp, RESOLVER_ALT));
        tasks.spawn(crate::admin::serve(admin, shared.clone()));
        tasks.spawn(accept(transparent, shared.clone()));
        shared.ready.store(true, Ordering::Release);
        Ok(Self {
            shared,
            bound,
            tasks,
        })
    }

    pub fn bound(&self) -> Bound {
        self.bound
    }

    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    pub fn registry(&self) -> &Arc<Registry> {
        &self.shared.registry
    }

    /// Serves until `shutdown` completes; then stops accepting, lets open
    /// flows finish for up to `timeouts.drain`, and returns the number of
    /// flows still open when it gave up (0 for a clean drain).
    pub async fn run_until(mut self, shutdown: impl Future<Output = ()>) -> usize {
        shutdown.await;
        self.shared.ready.store(false, Ordering::Release);
        self.tasks.shutdown().await;
        let config = self.shared.config();
        let max = config.limits.max_connections;
        let all = u32::try_from(max).unwrap_or(u32::MAX);
        let drain = config.timeouts.drain;
        match tokio::time::timeout(drain, self.shared.slots.acquire_many(all)).await {
            Ok(_) => 0,
            Err(_) => max - self.shared.slots.available_permits(),
        }
    }
}

fn read_token(path: &std::path::Path) -> Result<String, StartError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| StartError::Token {
        path: shown.clone(),
        message: e.to_string(),
    })?;
    let token = text.trim().to_owned();
    if token.len() < 16 {
        return Err(StartError::Token {
            path: shown,
            message: "the token must be at least 16 characters".into(),
        });
    }
    Ok(token)
}

/// A UDP socket and a TCP listener on the same address. With port 0 the
/// kernel picks the UDP port, which TCP may already use: try a few.
async fn bind_dns(
    what: &'static str,
    addr: SocketAddr,
) -> Result<(UdpSocket, TcpListener), StartError> {
    let err = |source| StartError::Bind { what, addr, source };
    let mut last = None;
    for _ in 0..16 {
        let udp = UdpSocket::bind(addr).await.map_err(err)?;
        let local = udp.local_addr().map_err(err)?;
        match TcpListener::bind(local).await {
            Ok(tcp) => return Ok((udp, tcp)),
            Err(e) if addr.port() == 0 && e.kind() == io::ErrorKind::AddrInUse => last = Some(e),
            Err(e) => return Err(err(e)),
        }
    }
    Err(err(last.unwrap_or_else(|| {
        io::Error::from(io::ErrorKind::AddrInUse)
    })))
}

/// Trusted roots for origins: the built-in web roots plus `tls.extra_upstream_roots`.
fn upstream_tls(
    config: &Config,
) -> Result<(Arc<rustls::ClientConfig>, Arc<rustls::ClientConfig>), StartError> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    for path in &config.tls.extra_upstream_roots {
        let shown = path.display().to_string();
        let err = |message: String| StartError::Roots {
            path: shown.clone(),
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
    let roots = Arc::new(roots);
    let build = |alpn: Vec<Vec<u8>>| {
        let mut c = rustls::ClientConfig::builder()
            .with_root_certificates(roots.clone())
            .with_no_client_auth();
        c.alpn_protocols = alpn;
        Arc::new(c)
    };
    Ok((
        build(vec![b"h2".to_vec(), b"http/1.1".to_vec()]),
        build(vec![b"http/1.1".to_vec()]),
    ))
}

async fn accept(listener: TcpListener, shared: Arc<Shared>) {
    let slots = shared.slots.clone();
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                // EMFILE and friends: back off briefly rather than spin.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            tracing::warn!(%peer, "connection limit reached; closing");
            reset(&stream);
            continue;
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            handle(shared, stream, peer).await;
            drop(permit);
        });
    }
}

/// Serves a flow request by request: intercepted TLS (`tls` is the
/// ClientHello's validated SNI, if any) or plain HTTP (`None`), each request
/// judged on its own Host.
async fn http_flow(
    shared: &Arc<Shared>,
    sandbox: &Arc<crate::registry::Sandbox>,
    dst: SocketAddr,
    tls: Option<Option<Hostname>>,
    stream: TcpStream,
    peeked: Vec<u8>,
    rec: &mut FlowRecord,
) {
    let counts = Arc::new(Counts::default());
    let peeked_len = peeked.len() as u64;
    let client = Rewind::new(peeked, Counted::new(stream, counts.clone()));
    let (shared, sandbox, activity) = (shared.clone(), sandbox.clone(), counts.clone());
    let out = match tls {
        Some(sni) => crate::intercept::intercept(shared, sandbox, dst, sni, client, activity).await,
        None => crate::intercept::serve_plain_http(shared, sandbox, dst, client, activity).await,
    };
    rec.bytes_up = peeked_len + counts.read.load(Ordering::Relaxed);
    rec.bytes_down = counts.written.load(Ordering::Relaxed);
    rec.requests = Some(out.requests);
    if out.host.is_some() {
        rec.host = out.host;
    }
    rec.error = out.error;
}

/// Counts a flow as active while it lives.
struct Active<'a>(&'a prometheus_client::metrics::gauge::Gauge);

impl Drop for Active<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// A whole HTTP/1.1 response that closes the connection.
fn close_with(status: u16, phrase: &str, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {status} {phrase}\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Closes with RST: the answer for denied flows that have no protocol to speak.
fn reset(stream: &TcpStream) {
    let _ = socket2::SockRef::from(stream).set_linger(Some(std::time::Duration::ZERO));
}

/// One flow, from accept to the flow log.
async fn handle(shared: Arc<Shared>, mut stream: TcpStream, peer: SocketAddr) {
    let started = Instant::now();
    let _ = stream.set_nodelay(true);
    let mut rec = FlowRecord {
        src: Some(peer),
        verdict: "deny",
        ..FlowRecord::default()
    };
    shared.metrics.active.inc();
    let _active = Active(&shared.metrics.active);
    let finish = |mut rec: FlowRecord| {
        rec.duration_ms = started.elapsed().as_millis() as u64;
        shared
            .metrics
            .flow(rec.verdict, rec.reason, rec.bytes_up, rec.bytes_down);
        shared.flow_log.write(rec);
    };

    let dst = match shared.orig_dst.original_dst(&stream) {
        Ok(d) => d,
        Err(e) => {
            reset(&stream);
            rec.reason = "no_original_dst";
            rec.detail = format!("original destination unknown: {e}");
            return finish(rec);
        }
    };
    rec.dst = Some(dst);
    // A connection that reached the listener without the redirect reports
    // the listener itself as its destination: dialling it would loop.
    if stream.local_addr().is_ok_and(|local| local == dst) {
        reset(&stream);
        rec.reason = "not_redirected";
        rec.detail =
            "the connection was not redirected: its destination is the gateway itself".into();
        return finish(rec);
    }
    let Some(sandbox) = shared.registry.lookup(peer.ip()) else {
        reset(&stream);
        rec.reason = "unknown_sandbox";
        rec.detail = format!("no sandbox has source address {}", peer.ip());
        return finish(rec);
    };
    rec.sandbox = Some(sandbox.id.to_string());

    let config = shared.config();
    let timeouts = &config.timeouts;
    let peek_started = Instant::now();
    let peeked = peek(&mut stream, config.limits.peek_bytes, timeouts.peek).await;
    shared
        .metrics
        .peek_seconds
        .observe(peek_started.elapsed().as_secs_f64());
    let (classified, peeked) = match peeked {
        Ok(x) => x,
        Err(e) => {
            rec.reason = match e {
                PeekError::Timeout => "peek_timeout",
                PeekError::Closed => "closed_early",
                PeekError::TooLarge => "client_hello_too_large",
                PeekError::Malformed(_) => "malformed_client_hello",
                PeekError::MalformedRequest(_) => "malformed_request",
                PeekError::Io(_) => "client_error",
            };
            rec.detail = e.to_string();
            if matches!(e, PeekError::MalformedRequest(_)) {
                let _ = stream
                    .write_all(&close_with(400, "Bad Request", &format!("{e}\n")))
                    .await;
                let _ = stream.shutdown().await;
            } else {
                reset(&stream);
            }
            return finish(rec);
        }
    };
    // Names from the network arrive validated: the peek refused any that
    // could be read two ways; an IP literal counts as no name.
    let (protocol, sni, host) = match classified {
        Classified::Tls(ch) => (Protocol::Tls, ch.sni, None),
        Classified::Http { host } => (Protocol::Http, None, host),
        Classified::Opaque => (Protocol::Opaque, None, None),
    };
    // The log's strings are built only when there is a log to read them.
    let logging = shared.flow_log.enabled();
    if logging {
        rec.sni = sni.as_ref().map(ToString::to_string);
        rec.host = host.as_ref().map(ToString::to_string);
    }

    let lookup = shared.cache.names_for(&sandbox.id, dst.ip());
    let names = lookup.names();
    if logging {
        rec.attributed = names.iter().map(ToString::to_string).collect();
    }
    let verdict = sandbox.policy.decide(&Flow {
        dst,
        protocol,
        sni: sni.as_ref(),
        host: host.as_ref(),
        attributed: &names,
        attribution_gap: lookup.gap(),
    });
    drop(names);
    rec.verdict = verdict.name();
    rec.reason = verdict.code();
    if logging {
        rec.detail = verdict.describe(&sandbox.policy);
    }

    match verdict {
        Verdict::Deny(_) => {
            if protocol == Protocol::Http {
                let body = format!("egress denied: {}\n", verdict.describe(&sandbox.policy));
                let _ = stream.write_all(&close_with(403, "Forbidden", &body)).await;
                let _ = stream.shutdown().await;
            } else {
                reset(&stream);
            }
            finish(rec)
        }
        Verdict::Intercept(..) => {
            http_flow(&shared, &sandbox, dst, Some(sni), stream, peeked, &mut rec).await;
            finish(rec)
        }
        Verdict::Allow(_) if protocol == Protocol::Http => {
            http_flow(&shared, &sandbox, dst, None, stream, peeked, &mut rec).await;
            finish(rec)
        }
        Verdict::Allow(_) | Verdict::Splice(..) => {
            let connect_started = Instant::now();
            let origin = tokio::time::timeout(timeouts.connect, TcpStream::connect(dst)).await;
            shared
                .metrics
                .upstream_connect_seconds
                .observe(connect_started.elapsed().as_secs_f64());
            let origin = match origin {
                Ok(Ok(o)) => o,
                Ok(Err(e)) => {
                    reset(&stream);
                    rec.error = Some(format!("upstream_connect: {e}"));
                    return finish(rec);
                }
                Err(_) => {
                    reset(&stream);
                    rec.error = Some("upstream_connect: timed out".into());
                    return finish(rec);
                }
            };
            let _ = origin.set_nodelay(true);
            // The peeked bytes go first; then the two sockets are joined as they are.
            let mut origin = origin;
            if let Err(e) = origin.write_all(&peeked).await {
                reset(&stream);
                rec.error = Some(format!("upstream_write: {e}"));
                return finish(rec);
            }
            let moved = crate::splice::splice(stream, origin, timeouts.idle).await;
            rec.bytes_up = peeked.len() as u64 + moved.up;
            rec.bytes_down = moved.down;
            if moved.idle_timeout {
                rec.error = Some("idle_timeout".into());
            }
            finish(rec)
        }
    }
}
