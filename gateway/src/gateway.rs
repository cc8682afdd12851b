//! Starting and stopping the gateway: the CA, the listeners, the shared
//! state, the accept loop and the drain. What happens to one connection is
//! in [`crate::flow`].

use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use dns_attrib::{AttributionCache, CacheConfig, Clock, DnsProxy, ProxyConfig, SystemClock};
use egress_certs::{CertificateAuthority, LeafMinter, MintConfig};
use egress_policy::{Destination, PlatformDenies};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::admin::Control;
use crate::config::Config;
use crate::flowlog::FlowLog;
use crate::registry::Registry;
use crate::state::{Dataplane, OriginalDst};
use crate::upstream::{RootsError, Upstreams};

/// `SO_ORIGINAL_DST` / `IP6T_SO_ORIGINAL_DST`, set by the nftables `redirect`.
#[derive(Debug, Default)]
pub struct SoOriginalDst;

impl OriginalDst for SoOriginalDst {
    fn original_dst(&self, stream: &TcpStream) -> io::Result<SocketAddr> {
        let sock = socket2::SockRef::from(stream);
        let addr = match stream.local_addr()? {
            SocketAddr::V4(_) => sock.original_dst_v4()?,
            // An IPv4 connection on a dual-stack (`[::]`) listener: its
            // conntrack entry is IPv4, so ask the IPv4 way.
            SocketAddr::V6(v6) if v6.ip().to_ipv4_mapped().is_some() => sock.original_dst_v4()?,
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
    #[error(transparent)]
    Roots(#[from] RootsError),
    #[error("log.flow_log: {path}: {source}")]
    FlowLog { path: String, source: io::Error },
    #[error("admin.token_file: {path}: {message}")]
    Token { path: String, message: String },
    #[error("{0}")]
    Snapshot(#[from] crate::persist::PersistError),
    #[error("machine egress: {0}")]
    Machines(#[from] crate::machine::MachineError),
    #[error("cannot listen on {what} {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        source: io::Error,
    },
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
    dp: Arc<Dataplane>,
    up: Arc<Upstreams>,
    /// One permit per flow being handled; draining takes them all.
    slots: Arc<Semaphore>,
    bound: Bound,
    tasks: JoinSet<()>,
}

/// Every listener, bound before anything is served.
struct Listeners {
    transparent: TcpListener,
    dns: (UdpSocket, TcpListener),
    dns_alt: (UdpSocket, TcpListener),
    admin: TcpListener,
    bound: Bound,
}

const RESOLVER_PRIMARY: SocketAddr =
    SocketAddr::new(IpAddr::V4(std::net::Ipv4Addr::new(8, 8, 8, 8)), 53);
const RESOLVER_ALT: SocketAddr =
    SocketAddr::new(IpAddr::V4(std::net::Ipv4Addr::new(1, 1, 1, 1)), 53);

// === impl Gateway ===

impl Gateway {
    /// Loads the CA, binds every listener and starts serving, on the system clock.
    pub async fn start(
        config: Config,
        orig_dst: Arc<dyn OriginalDst>,
        flow_log: FlowLog,
    ) -> Result<Self, StartError> {
        Self::start_with_clock(config, orig_dst, flow_log, SystemClock::new()).await
    }

    /// As [`Gateway::start`], with attribution lifetimes measured on `clock`
    /// (tests move a manual clock instead of sleeping).
    pub async fn start_with_clock(
        config: Config,
        orig_dst: Arc<dyn OriginalDst>,
        flow_log: FlowLog,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, StartError> {
        let minter = minter(&config)?;
        let up = Arc::new(Upstreams::new(&config, minter.clone())?);
        let token = match &config.admin.token_file {
            None => None,
            Some(path) => Some(read_token(path)?),
        };
        let listeners = Listeners::bind(&config).await?;
        let bound = listeners.bound;
        let registry = Arc::new(Registry::new(Arc::new(platform(&config, &bound))));
        let (cache, dns) = attribution(&config, &registry, clock);
        // The last acknowledged state, before a single flow is served.
        let (journal, seq, n) = crate::journal::recover(&registry, &config.state_dir)?;
        if seq > 0 {
            tracing::info!(sandboxes = n, generation = seq, dir = %config.state_dir.display(), "recovered pushed state");
        }
        let committer = crate::commit::Committer::start(
            registry.clone(),
            config.state_dir.clone(),
            journal,
            seq,
        );
        // Every VM's table, before a single flow is served.
        let machines = crate::machine::Machines::start(
            &config.machine_egress,
            &config.state_dir,
            registry.clone(),
        )?;
        let mut metrics =
            crate::metrics::Metrics::new(dns.metrics().clone(), cache.clone(), minter);
        metrics.declare("deny", crate::flow::Refusal::CODES);
        metrics.machines(machines.clone());
        metrics.flow_log(flow_log.dropped());
        let slots = Arc::new(Semaphore::new(config.limits.max_connections));
        let kernel = crate::ksplice::load(config.splice.kernel);
        let mut dp = Dataplane::new(config, registry, cache, flow_log, metrics, orig_dst);
        dp.kernel = kernel;
        let dp = Arc::new(dp);
        dp.reload_secrets();
        let mut gateway = Self {
            dp,
            up,
            slots,
            bound,
            tasks: JoinSet::new(),
        };
        let every = gateway.dp.config().machine_egress.observe_interval;
        gateway.tasks.spawn(machines.clone().observer(every));
        gateway.serve(
            listeners,
            &dns,
            Control::new(gateway.dp.clone(), token, committer, machines),
        );
        Ok(gateway)
    }

    /// Spawns every listener's task and declares the gateway ready.
    fn serve(&mut self, l: Listeners, dns: &Arc<DnsProxy>, control: Arc<Control>) {
        self.tasks
            .spawn(dns.clone().serve_udp(l.dns.0, RESOLVER_PRIMARY));
        self.tasks
            .spawn(dns.clone().serve_tcp(l.dns.1, RESOLVER_PRIMARY));
        self.tasks
            .spawn(dns.clone().serve_udp(l.dns_alt.0, RESOLVER_ALT));
        self.tasks
            .spawn(dns.clone().serve_tcp(l.dns_alt.1, RESOLVER_ALT));
        self.tasks.spawn(crate::admin::serve(l.admin, control));
        let (dp, up, slots) = (self.dp.clone(), self.up.clone(), self.slots.clone());
        self.tasks.spawn(accept(l.transparent, dp, up, slots));
        self.dp.ready.store(true, Ordering::Release);
    }

    pub fn bound(&self) -> Bound {
        self.bound
    }

    /// The state every flow reads: configuration, sandboxes, attribution.
    pub fn dataplane(&self) -> &Arc<Dataplane> {
        &self.dp
    }

    pub fn registry(&self) -> &Arc<Registry> {
        &self.dp.registry
    }

    /// The interception CA sandboxes must trust.
    pub fn ca(&self) -> &CertificateAuthority {
        self.up.minter.ca()
    }

    /// Serves until `shutdown` completes; then stops accepting, lets open
    /// flows finish for up to `timeouts.drain`, and returns the number of
    /// flows still open when it gave up (0 for a clean drain).
    pub async fn run_until(mut self, shutdown: impl Future<Output = ()>) -> usize {
        shutdown.await;
        self.dp.ready.store(false, Ordering::Release);
        self.tasks.shutdown().await;
        let config = self.dp.config();
        let max = config.limits.max_connections;
        let all = u32::try_from(max).unwrap_or(u32::MAX);
        let left =
            match tokio::time::timeout(config.timeouts.drain, self.slots.acquire_many(all)).await {
                Ok(_) => 0,
                Err(_) => max - self.slots.available_permits(),
            };
        // Every line of the drained flows on disk before the process exits.
        let dp = self.dp.clone();
        let _ = tokio::task::spawn_blocking(move || dp.flow_log.close()).await;
        left
    }
}

/// The attribution cache (on `clock`) and the DNS proxy that fills it.
fn attribution(
    config: &Config,
    registry: &Arc<Registry>,
    clock: Arc<dyn Clock>,
) -> (Arc<AttributionCache>, Arc<DnsProxy>) {
    let cache = Arc::new(AttributionCache::new(
        CacheConfig {
            min_ttl: config.dns.min_ttl,
            max_ttl: config.dns.max_ttl,
            max_sandboxes: config.dns.max_sandboxes,
            ..CacheConfig::default()
        },
        clock,
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
    (cache, dns)
}

/// The CA (loaded, or created in `state_dir`) and the leaf minter over it.
fn minter(config: &Config) -> Result<Arc<LeafMinter>, StartError> {
    let ca = match config.ca_paths() {
        Some(paths) => CertificateAuthority::load(&paths)?,
        None => CertificateAuthority::load_or_create(&config.state_dir.join("ca"))?,
    };
    let mint = MintConfig {
        cache_capacity: config.limits.leaf_cache,
        ..MintConfig::default()
    };
    Ok(Arc::new(LeafMinter::new(Arc::new(ca), mint)?))
}

/// The configured platform denies plus the gateway's own addresses, which
/// are never a destination.
fn platform(config: &Config, bound: &Bound) -> PlatformDenies {
    let mut list = config.policy.platform_deny.clone();
    for addr in [bound.transparent, bound.dns, bound.dns_alt, bound.admin] {
        if !addr.ip().is_unspecified() {
            list.push(Destination::Ip(addr.ip()));
        }
    }
    PlatformDenies::new(list)
}

impl Listeners {
    async fn bind(config: &Config) -> Result<Self, StartError> {
        let tcp = |what, addr| async move {
            TcpListener::bind(addr)
                .await
                .map_err(|source| StartError::Bind { what, addr, source })
        };
        let local = |l: io::Result<SocketAddr>, what, addr| {
            l.map_err(|source| StartError::Bind { what, addr, source })
        };
        let listen = &config.listen;
        let transparent = tcp("listen.transparent", listen.transparent).await?;
        let dns = bind_dns("listen.dns", listen.dns).await?;
        let dns_alt = bind_dns("listen.dns_alt", listen.dns_alt).await?;
        let admin = tcp("listen.admin", listen.admin).await?;
        let bound = Bound {
            transparent: local(
                transparent.local_addr(),
                "listen.transparent",
                listen.transparent,
            )?,
            dns: local(dns.0.local_addr(), "listen.dns", listen.dns)?,
            dns_alt: local(dns_alt.0.local_addr(), "listen.dns_alt", listen.dns_alt)?,
            admin: local(admin.local_addr(), "listen.admin", listen.admin)?,
        };
        Ok(Self {
            transparent,
            dns,
            dns_alt,
            admin,
            bound,
        })
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

async fn accept(
    listener: TcpListener,
    dp: Arc<Dataplane>,
    up: Arc<Upstreams>,
    slots: Arc<Semaphore>,
) {
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
        // On a dual-stack listener IPv4 peers arrive as `::ffff:a.b.c.d`.
        let peer = SocketAddr::new(peer.ip().to_canonical(), peer.port());
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            tracing::warn!(%peer, "connection limit reached; closing");
            dp.metrics.over_limit.inc();
            crate::io::reset(&stream);
            continue;
        };
        let (dp, up) = (dp.clone(), up.clone());
        tokio::spawn(async move {
            crate::flow::handle(dp, up, stream, peer).await;
            drop(permit);
        });
    }
}
