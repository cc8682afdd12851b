//! Starting and stopping the gateway: the CA, the listeners, the shared
//! state, the accept loop and the drain. What happens to one connection is
//! in [`crate::flow`].

use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use dns_attrib::{
    AttributionCache, BudgetLimits, CacheConfig, Clock, DnsProxy, ProxyConfig, SystemClock,
};
use egress_certs::{CertificateAuthority, LeafMinter, MintConfig};
use egress_policy::{Destination, PlatformDenies};
use prometheus_client::metrics::counter::Counter;
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::admin::Control;
use crate::ca_reload::CaReloader;
use crate::config::Config;
use crate::flowlog::FlowLog;
use crate::registry::Registry;
use crate::slots::{NoSlot, Slots};
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
    #[error("state_dir: {path} belongs to uid {owner}, not to this process's uid {me}: its owner could change the policies and the CA under it (chown it, or choose another)")]
    StateDirOwner { path: String, owner: u32, me: u32 },
    #[error("{key}: {path}: {message}")]
    Token {
        key: &'static str,
        path: String,
        message: String,
    },
    #[error("{0}")]
    Snapshot(#[from] crate::persist::PersistError),
    #[error("machine egress: {0}")]
    Machines(#[from] egress_machine::MachineError),
    #[error("state_dir: {path} is locked by another running gateway; one state directory serves one gateway")]
    StateDirInUse { path: String },
    #[error("state_dir: {path}: {source}")]
    StateDir { path: String, source: io::Error },
    #[error("cannot start worker thread {worker}: {source}")]
    Worker { worker: usize, source: io::Error },
    #[error("takeover: {0}")]
    Takeover(String),
    #[error("the host's own addresses (denied to sandboxes, as the listeners' are) cannot be read: {why}")]
    HostAddresses { why: String },
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
    /// One per flow being handled, shared out by source; draining takes them all.
    slots: Arc<Slots>,
    bound: Bound,
    tasks: JoinSet<()>,
    /// With `limits.thread_per_core`, the worker threads; none without.
    workers: Workers,
    /// Reads the CA files again on SIGHUP.
    ca: CaReloader,
    /// `state_dir/gateway.lock`, held (`flock`) while the gateway serves;
    /// released early only to hand over to a successor.
    lock: Option<std::fs::File>,
    /// The handover socket and the listening sockets a successor would take.
    offer: Option<crate::handover::Offer>,
    /// Sealed before a handover: no push is acknowledged after.
    committer: crate::commit::Committer,
    /// Sealed before a handover too: no VM's change is made after.
    machines: Arc<egress_machine::Machines>,
}

/// Every listener, bound before anything is served.
struct Listeners {
    /// One set per worker thread with `limits.thread_per_core` (the same
    /// addresses, `SO_REUSEPORT`); one set without.
    data: Vec<DataListeners>,
    admin: TcpListener,
    bound: Bound,
}

/// What one thread serves flows and queries on, bound but not yet
/// registered with a runtime.
struct DataListeners {
    transparent: std::net::TcpListener,
    dns: (std::net::UdpSocket, std::net::TcpListener),
    dns_alt: (std::net::UdpSocket, std::net::TcpListener),
}

/// The same, registered with the runtime that will serve them.
struct Served {
    transparent: TcpListener,
    dns: (UdpSocket, TcpListener),
    dns_alt: (UdpSocket, TcpListener),
}

/// The per-core worker threads and the phase they follow.
struct Workers {
    phase: watch::Sender<Phase>,
    threads: Vec<std::thread::JoinHandle<()>>,
    /// What ended a worker thread's listener early ([`ended`]): the gateway
    /// stops serving and drains.
    failed: (
        tokio::sync::mpsc::UnboundedSender<String>,
        tokio::sync::mpsc::UnboundedReceiver<String>,
    ),
    /// One message from each worker once its listeners (DNS among them)
    /// have stopped: a handover exports the attribution only after.
    stopped: (
        tokio::sync::mpsc::UnboundedSender<()>,
        tokio::sync::mpsc::UnboundedReceiver<()>,
    ),
}

impl Default for Workers {
    fn default() -> Self {
        Self {
            phase: watch::Sender::new(Phase::Serving),
            threads: Vec::new(),
            failed: tokio::sync::mpsc::unbounded_channel(),
            stopped: tokio::sync::mpsc::unbounded_channel(),
        }
    }
}

impl Workers {
    /// Waits (at most [`WORKERS_STOP_WAIT`]) until every worker thread's
    /// listeners have stopped, so no DNS answer is recorded into a cache
    /// being exported; a worker stuck past it is logged.
    async fn listeners_stopped(&mut self) {
        let all = self.threads.len();
        let wait = async {
            for _ in 0..all {
                if self.stopped.1.recv().await.is_none() {
                    return;
                }
            }
        };
        if tokio::time::timeout(WORKERS_STOP_WAIT, wait).await.is_err() {
            tracing::warn!(
                "a worker thread's listeners did not stop within {WORKERS_STOP_WAIT:?}; going on"
            );
        }
    }
}

/// How long the drain waits for the worker threads' listeners to stop.
const WORKERS_STOP_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// How [`Gateway::run`] ended.
#[derive(Debug)]
pub struct Stopped {
    /// Flows still open when the drain gave up (0: a clean drain).
    pub left: usize,
    /// The drain was ended before its deadline, and the flows still open
    /// then were cut: the successor of a handover stopped telling this
    /// gateway which sandboxes change.
    pub cut_short: bool,
    /// A task that serves until the drain (a listener, DNS, the admin API,
    /// a background loop) ended first, and how: the gateway stopped serving
    /// because of it, and the process should exit with a failure.
    pub failed: Option<String>,
}

/// Where the gateway is in its life; worker threads follow it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    /// Accepting flows and queries.
    Serving,
    /// No new flows; open ones go on.
    Draining,
    /// The drain is over: what is left is dropped with the runtime.
    Exit,
}

/// How long flows still open when the drain's time runs out have to reset
/// and write their lines: past a tick of their watch (at most a second).
const DRAIN_GRACE: std::time::Duration = std::time::Duration::from_secs(3);

/// Longest wait for the commit thread to seal the pushed state at a
/// handover; less when the successor, which waits 10 s for its answer from
/// its request, would give up first ([`crate::handover::Successor::answer_within`]).
const SEAL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(8);

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
        Self::start_inner(config, orig_dst, flow_log, clock, None).await
    }

    /// Starts on the sockets, state and attribution a running gateway
    /// handed over ([`crate::handover::take_over`]): no listener is bound.
    pub async fn take_over(
        config: Config,
        orig_dst: Arc<dyn OriginalDst>,
        flow_log: FlowLog,
        taken: crate::handover::Taken,
    ) -> Result<Self, StartError> {
        Self::start_inner(config, orig_dst, flow_log, SystemClock::new(), Some(taken)).await
    }

    async fn start_inner(
        config: Config,
        orig_dst: Arc<dyn OriginalDst>,
        flow_log: FlowLog,
        clock: Arc<dyn Clock>,
        mut taken: Option<crate::handover::Taken>,
    ) -> Result<Self, StartError> {
        // Before anything in the state directory is read or written.
        let lock = lock(&config, taken.is_some())?;
        let cold = taken.is_none();
        let received = taken.as_ref().map(|t| t.received);
        let predecessor = taken.as_mut().and_then(|t| t.predecessor.take());
        let minter = minter(&config)?;
        let up = Arc::new(Upstreams::new(&config, minter.clone())?);
        let tokens = tokens(&config)?;
        let (listeners, attributed, budgets) = Listeners::open(&config, taken)?;
        let registry = Arc::new(Registry::new(Arc::new(platform(
            &config,
            &listeners.bound,
        )?)));
        let (cache, dns) = attribution(&config, &registry, clock);
        let committer = recover(&config, &registry, &cache, (attributed, received))?;
        // What the predecessor had, before anything here changes it.
        let predecessor = predecessor.map(|stream| (stream, registry.checkpoint()));
        let offer = offer(&config, &listeners);
        // Every VM's table, before a single flow is served.
        let machines = machines(&config, &registry, &cache)?;
        let metrics = metrics((&dns, &cache, &minter), &machines, &flow_log, &up);
        let ca = CaReloader::new(minter, &config, metrics.ca_reloads.clone());
        let slots = Slots::new(config.limits.max_connections);
        let mut dp = Dataplane::new(config, registry, cache, flow_log, metrics, orig_dst);
        dp.kernel = crate::ksplice::load(dp.config().splice.kernel);
        dp.resolver = Some(dns.clone());
        let dp = Arc::new(dp);
        take_budgets(&dp, budgets, cold);
        dp.reload_secrets();
        let mut gateway = Self {
            dp,
            up,
            slots,
            bound: listeners.bound,
            tasks: JoinSet::new(),
            workers: Workers::default(),
            ca,
            lock: Some(lock),
            offer,
            committer: committer.clone(),
            machines: machines.clone(),
        };
        gateway.spawn_background(&machines);
        gateway.serve(
            listeners,
            &dns,
            Control::new(gateway.dp.clone(), tokens, committer, machines),
        )?;
        gateway.started(predecessor);
        Ok(gateway)
    }

    /// Once serving: the saved budget states' file removed (a cold start's,
    /// or the one a takeover wrote of what it was handed); after a
    /// takeover, the predecessor told of what changes.
    fn started(&self, predecessor: Option<Told>) {
        saved_budgets_taken(&self.dp);
        if let Some(told) = predecessor {
            tell_predecessor(told, self.dp.registry.clone());
        }
    }

    /// The tasks beside the listeners: machine egress's, the fence keeper,
    /// the host's addresses, the lapse watch, the attribution sweep.
    fn spawn_background(&mut self, machines: &Arc<egress_machine::Machines>) {
        self.spawn_machine_tasks(machines);
        self.spawn_fence_keeper();
        self.spawn_host_reader();
        self.spawn_lapse_watch();
        self.spawn_attribution_sweep();
    }

    /// With `redirect.fence` set, the fence kept in place every
    /// [`crate::redirect::FENCE_CHECK_EVERY`], installed at once if missing.
    fn spawn_fence_keeper(&mut self) {
        if self.dp.config().redirect.fence.is_empty() {
            return;
        }
        let dp = self.dp.clone();
        self.tasks.spawn(async move {
            let mut tick = tokio::time::interval(crate::redirect::FENCE_CHECK_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut first = true;
            loop {
                tick.tick().await;
                let dp = dp.clone();
                let _ = tokio::task::spawn_blocking(move || keep_fence(&dp, first)).await;
                first = false;
            }
        });
    }

    /// The host's addresses read again every [`HOST_READ_EVERY`]: one it
    /// gains (a renumbering, a new IPv6 temporary address) is denied to
    /// sandboxes from then on. A reading that fails keeps the last.
    fn spawn_host_reader(&mut self) {
        let dp = self.dp.clone();
        self.tasks.spawn(async move {
            let mut tick = tokio::time::interval(HOST_READ_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                match tokio::task::spawn_blocking(egress_machine::host::read).await {
                    Ok(Ok(host)) => dp.registry.platform().set_host(host),
                    Ok(Err(error)) => tracing::warn!(%error, "the host's addresses were not read again; the last reading stands"),
                    Err(_) => {}
                }
            }
        });
    }

    /// Every second, the sandboxes with an allow entry past its `until`
    /// compiled again without it ([`Registry::recompile_lapsed`]): an
    /// approval closes on time even when the push that takes it out does
    /// not come (a controller down, a worker cut off).
    fn spawn_lapse_watch(&mut self) {
        self.tasks.spawn(lapse_watch(self.dp.clone()));
    }

    /// Every [`SWEEP_EVERY`], the attribution of addresses no answer has
    /// written for `dns.max_ttl` and a minute is reclaimed: expired, it
    /// decides nothing, and a sandbox that stopped resolving would keep it,
    /// within its bound, until it is deleted.
    fn spawn_attribution_sweep(&mut self) {
        let dp = self.dp.clone();
        self.tasks.spawn(async move {
            let mut tick = tokio::time::interval(SWEEP_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                let dp = dp.clone();
                let _ = tokio::task::spawn_blocking(move || dp.cache.sync()).await;
            }
        });
    }

    /// Machine egress's observer rounds and, with events, the log reader.
    fn spawn_machine_tasks(&mut self, machines: &Arc<egress_machine::Machines>) {
        let every = self.dp.config().machine_egress.observe_interval;
        self.tasks.spawn(machines.clone().observer(every));
        if machines.observes_events() {
            self.tasks
                .spawn(egress_machine::events::read(machines.clone()));
        }
    }

    /// Spawns every listener's task (with `limits.thread_per_core`, starts
    /// the worker threads) and declares the gateway ready.
    fn serve(
        &mut self,
        l: Listeners,
        dns: &Arc<DnsProxy>,
        control: Arc<Control>,
    ) -> Result<(), StartError> {
        self.tasks.spawn(crate::admin::serve(l.admin, control));
        let failed = |worker| move |source| StartError::Worker { worker, source };
        if !self.dp.config().limits.thread_per_core {
            for data in l.data {
                let served = data.register().map_err(failed(0))?;
                let (dp, up, slots) = (self.dp.clone(), self.up.clone(), self.slots.clone());
                let accepted = self.dp.metrics.worker(0);
                serve_data(&mut self.tasks, served, dns, dp, up, slots, accepted);
            }
        } else {
            for (i, data) in l.data.into_iter().enumerate() {
                // The runtime is built here and the sockets registered with
                // it, so a failure stops the start instead of a thread.
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(failed(i))?;
                let served = {
                    let _in = rt.enter();
                    data.register().map_err(failed(i))?
                };
                let dns = dns.sibling();
                let up = Arc::new(self.up.for_worker());
                let (dp, slots) = (self.dp.clone(), self.slots.clone());
                let accepted = self.dp.metrics.worker(i);
                let phase = (
                    self.workers.phase.subscribe(),
                    self.workers.failed.0.clone(),
                    self.workers.stopped.0.clone(),
                );
                let thread = std::thread::Builder::new()
                    .name(format!("egress-worker-{i}"))
                    .spawn(move || {
                        rt.block_on(worker(served, dns, dp, up, slots, accepted, phase));
                    })
                    .map_err(failed(i))?;
                self.workers.threads.push(thread);
            }
        }
        self.dp.ready.store(true, Ordering::Release);
        Ok(())
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

    /// The interception CA leaves are minted under now (sandboxes trust it,
    /// or the fleet root above it).
    pub fn ca(&self) -> Arc<CertificateAuthority> {
        self.up.minter.ca()
    }

    /// What SIGHUP uses to read the CA files again; tests call it directly.
    pub fn ca_reloader(&self) -> CaReloader {
        self.ca.clone()
    }

    /// Serves until `shutdown` completes; then stops accepting, lets open
    /// flows finish for up to `timeouts.drain`, and returns the number of
    /// flows still open when it gave up (0 for a clean drain).
    ///
    /// A successor asking through the handover socket
    /// ([`crate::handover`]) ends serving too: it gets the listening
    /// sockets, the pushed state and the attribution, and this gateway
    /// drains what it has open.
    pub async fn run_until(self, shutdown: impl Future<Output = ()>) -> usize {
        self.run(shutdown).await.left
    }

    /// [`Gateway::run_until`], which also stops (and drains) when a task
    /// that should serve until then ends first: a panic in a listener would
    /// otherwise leave it dead while `/readyz` said ready.
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) -> Stopped {
        let (successor, failed) = self.serving(shutdown).await;
        if let Some(why) = &failed {
            tracing::error!(
                %why,
                "a task the gateway serves with ended; stopping (drain, then exit with a failure)"
            );
        }
        self.dp.ready.store(false, Ordering::Release);
        self.dp.draining.store(true, Ordering::Release);
        self.workers.phase.send_replace(Phase::Draining);
        self.tasks.shutdown().await;
        // The flows draining are judged by the policy as it is: an approval
        // closes on time during the drain too.
        let lapse = tokio::spawn(lapse_watch(self.dp.clone()));
        self.workers.listeners_stopped().await;
        let mut failed = failed;
        let mut handed = false;
        if let Some(successor) = successor {
            match self.hand_over(successor).await {
                Ok(()) => handed = true,
                Err(why) => failed = failed.or(Some(why)),
            }
        }
        // Without a successor the listening sockets close here.
        self.offer = None;
        let config = self.dp.config();
        let (left, cut_short) = if self.slots.all_back(config.timeouts.drain).await {
            (0, self.dp.drain_over.load(Ordering::Acquire))
        } else {
            let open = self.slots.open();
            self.drain_over().await;
            (open, false)
        };
        lapse.abort();
        if !handed {
            save_budgets(&self.dp);
        }
        self.workers.phase.send_replace(Phase::Exit);
        let threads = std::mem::take(&mut self.workers.threads);
        let _ = tokio::task::spawn_blocking(move || {
            for t in threads {
                let _ = t.join();
            }
        })
        .await;
        // Every line of the drained flows on disk before the process exits.
        let dp = self.dp.clone();
        let _ = tokio::task::spawn_blocking(move || dp.flow_log.close()).await;
        Stopped {
            left,
            cut_short,
            failed,
        }
    }

    /// Serves until `shutdown`, a successor, or the end of a task that
    /// should have run until then (what it was).
    async fn serving(
        &mut self,
        shutdown: impl Future<Output = ()>,
    ) -> (Option<crate::handover::Successor>, Option<String>) {
        let workers = &mut self.workers.failed.1;
        let task = async {
            tokio::select! {
                why = ended(&mut self.tasks) => why,
                Some(why) = workers.recv() => why,
            }
        };
        match &self.offer {
            Some(offer) => tokio::select! {
                () = shutdown => (None, None),
                s = offer.successor() => (Some(s), None),
                why = task => (None, Some(why)),
            },
            None => tokio::select! {
                () = shutdown => (None, None),
                why = task => (None, Some(why)),
            },
        }
    }
}

/// Every [`LAPSE_CHECK_EVERY`], the sandboxes with an allow entry past its
/// `until` compiled again without it.
async fn lapse_watch(dp: Arc<Dataplane>) {
    let mut tick = tokio::time::interval(LAPSE_CHECK_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        // Compiled on a blocking thread: many entries may lapse at once.
        let registry = dp.registry.clone();
        let lapsed = move || registry.recompile_lapsed(time::OffsetDateTime::now_utc());
        // A panic there ends this task, as it would have here: the
        // gateway stops rather than keep lapsed entries in force.
        let n = match tokio::task::spawn_blocking(lapsed).await {
            Ok(n) => n,
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        };
        if n > 0 {
            tracing::info!(
                sandboxes = n,
                "allow entries past their until taken out of force"
            );
        }
    }
}

/// The handover connection to a predecessor, and the registry it left.
type Told = (
    std::os::unix::net::UnixStream,
    Arc<crate::registry::Generation>,
);

/// On a thread of its own, tells the predecessor (`stream`: the handover
/// connection) which of its sandboxes change here while it drains
/// ([`crate::handover::changes`]).
fn tell_predecessor((stream, had): Told, registry: Arc<Registry>) {
    let spawned = std::thread::Builder::new()
        .name("egress-tell".into())
        .spawn(move || crate::handover::changes::tell(stream, &registry, had));
    if let Err(e) = spawned {
        // The predecessor hears nothing, and ends its drain.
        tracing::warn!(error = %e, "cannot start the thread that tells the predecessor of changes");
    }
}

/// On a thread of its own while this gateway drains after a handover,
/// takes out each sandbox the successor says changed; when the successor
/// stops telling, ends the drain: what changed is not known.
fn hear_successor(stream: std::os::unix::net::UnixStream, dp: Arc<Dataplane>) {
    let over = dp.clone();
    let hear = move || {
        let why = crate::handover::changes::listen(stream, &dp.registry);
        if !dp.drain_over.swap(true, Ordering::AcqRel) {
            tracing::warn!(%why, "the successor no longer tells this gateway which sandboxes change: the flows still draining end");
        }
    };
    if let Err(e) = std::thread::Builder::new()
        .name("egress-hear".into())
        .spawn(hear)
    {
        tracing::warn!(error = %e, "cannot hear the successor's changes: the flows still draining end");
        over.drain_over.store(true, Ordering::Release);
    }
}

/// The first of `tasks` to end, described (they serve until the drain, so
/// any end is a failure); never, while there are none.
async fn ended(tasks: &mut JoinSet<()>) -> String {
    match tasks.join_next().await {
        Some(Ok(())) => "a listener or background task returned".into(),
        Some(Err(e)) if e.is_panic() => {
            let panic = e.into_panic();
            let message = panic
                .downcast_ref::<&str>()
                .map(|m| (*m).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            format!("a task panicked: {message}")
        }
        Some(Err(e)) => format!("a task ended: {e}"),
        None => std::future::pending().await,
    }
}

impl Gateway {
    /// The drain's time ran out with flows open: spliced ones are told to
    /// reset (they look at least every second) and write their lines; they
    /// have [`DRAIN_GRACE`] to end.
    async fn drain_over(&self) {
        self.dp.drain_over.store(true, Ordering::Release);
        self.slots.all_back(DRAIN_GRACE).await;
    }

    /// Seals the pushed state, lets go of the state directory and sends the
    /// successor the sockets and the attribution.
    async fn hand_over(&mut self, successor: crate::handover::Successor) -> Result<(), String> {
        // Every acknowledged push is in the journal; none is acknowledged
        // after. A commit thread that does not seal in time may still write:
        // the lock is kept and nothing is handed on (the successor's wait
        // for its answer ends; this gateway drains and exits).
        let deadline = tokio::time::Instant::now() + SEAL_TIMEOUT.min(successor.answer_within());
        let left = || deadline.saturating_duration_since(tokio::time::Instant::now());
        let sealed = match self.committer.seal(left()).await {
            Ok(()) => seal_machines(&self.machines, left()).await,
            Err(why) => Err(why),
        };
        if let Err(why) = sealed {
            tracing::error!(%why, "the handover failed after this gateway stopped serving: draining, then exiting with a failure (a supervisor starts a gateway on this state_dir again)");
            return Err(format!("handover: {why}"));
        }
        let attribution = crate::handover::Export {
            cache: self.dp.cache.clone(),
            ids: self.dp.registry.ids(),
        };
        // Flows still draining here spend this gateway's states after they
        // are sent: what they move is not charged again by the successor.
        let budgets = match successor.budgets {
            true => self.dp.budgets.spent(self.dp.cache.now()),
            false => Vec::new(),
        };
        drop(self.lock.take());
        let Some(offer) = self.offer.take() else {
            return Ok(());
        };
        let b = budgets.len();
        let sent = tokio::task::spawn_blocking(move || {
            offer.hand_over(successor, (&attribution, &budgets))
        })
        .await;
        let failed = match sent {
            Ok(Ok((kept, n))) => {
                if let Some(stream) = kept {
                    hear_successor(stream, self.dp.clone());
                }
                tracing::info!(
                    attributed = n,
                    budgets = b,
                    "handed the listeners, the pushed state, the attribution and the budget states to a successor; draining"
                );
                return Ok(());
            }
            Ok(Err(e)) => e.to_string(),
            Err(e) => e.to_string(),
        };
        tracing::error!(error = %failed, "the handover failed after this gateway stopped serving: draining, then exiting with a failure (a supervisor starts a gateway on this state_dir again)");
        Err(format!("handover: {failed}"))
    }
}

/// The last acknowledged state (snapshot and journal) and a predecessor's
/// attribution, before a single flow is served; the commit thread that
/// carries the state on.
fn recover(
    config: &Config,
    registry: &Arc<Registry>,
    cache: &Arc<AttributionCache>,
    (attributed, received): (Vec<crate::handover::Attributed>, Option<std::time::Instant>),
) -> Result<crate::commit::Committer, StartError> {
    let (journal, seq, n) = crate::journal::recover(registry, &config.state_dir)?;
    if seq > 0 {
        tracing::info!(sandboxes = n, generation = seq, dir = %config.state_dir.display(), "recovered pushed state");
    }
    let max = config.limits.max_sandboxes;
    if registry.len() > max {
        tracing::warn!(sandboxes = registry.len(), max, "recovered more sandboxes than limits.max_sandboxes: they stay registered, and no new one is until fewer are");
    }
    registry.set_max(max);
    restore_attribution(cache, registry, attributed, received);
    Ok(crate::commit::Committer::start(
        (registry.clone(), cache.clone()),
        config.state_dir.clone(),
        journal,
        seq,
    ))
}

/// The listeners, and what a predecessor handed over with them.
type Opened = (
    Listeners,
    Vec<crate::handover::Attributed>,
    Vec<crate::budget::Spent>,
);

/// Takes over a predecessor's budget states for the sandboxes the recovered
/// state has: a sandbox keeps what it spent across the takeover.
/// Machine egress sealed ([`egress_machine::Machines::seal`]): a VM's
/// change in flight (an nft run, its file) finished, none after, within
/// `within`. Past it, the change may still write, and the handover fails.
async fn seal_machines(
    machines: &Arc<egress_machine::Machines>,
    within: std::time::Duration,
) -> Result<(), String> {
    let m = machines.clone();
    let sealed = tokio::task::spawn_blocking(move || m.seal());
    match tokio::time::timeout(within, sealed).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(format!("sealing machine egress: {e}")),
        Err(_) => Err(format!(
            "a machine egress change did not finish within {}s (a stalled nft?)",
            within.as_secs_f64()
        )),
    }
}

fn take_over_budgets(dp: &Dataplane, lines: Vec<crate::budget::Spent>) {
    if lines.is_empty() {
        return;
    }
    let total = lines.len();
    let known = |id: &egress_policy::SandboxId| dp.registry.get(id).is_some();
    let taken = dp.budgets.take_over(lines, dp.cache.now(), known);
    tracing::info!(taken, of = total, "budget states taken over");
}

/// One look at the fence; installed if missing: at start, said once;
/// later (something removed it), counted and said loudly, as is each
/// interface attached or fenced again.
fn keep_fence(dp: &Dataplane, first: bool) {
    use crate::redirect::Mended;
    let config = dp.config();
    let patterns = &config.redirect.fence;
    let ports = crate::redirect::Ports {
        transparent: config.listen.transparent.port(),
        dns: config.listen.dns.port(),
        dns_alt: config.listen.dns_alt.port(),
    };
    let rules = (ports, crate::redirect::Tracking::from(&*config));
    let told = |what: Mended<'_>| match what {
        Mended::Fence if first => {
            tracing::info!(?patterns, "installed the fence of sandbox interfaces");
        }
        Mended::Fence => {
            dp.metrics.fence_restored.inc();
            tracing::error!(?patterns, "the fence of sandbox interfaces was gone or emptied (something on the host removes nftables rules); installed it again: the interfaces it let through are attached again once they exist");
        }
        Mended::Redirect(iface) => {
            dp.metrics.fence_restored.inc();
            tracing::error!(%iface, "a sandbox interface lost its redirect (its table gone or emptied, or the fence put back without it: something on the host removes nftables rules); attached it again");
        }
        Mended::Fenced(iface) => {
            dp.metrics.fence_restored.inc();
            tracing::error!(%iface, "a sandbox interface lost its redirect and could not be attached again; fenced it: attach it again (egress-gateway redirect --apply, or restart its egress-gateway-redirect@ unit)");
        }
    };
    if let Err(e) = crate::redirect::keep_fence(patterns, rules, told) {
        tracing::error!(error = %e, ?patterns, "keeping the fence of sandbox interfaces failed; the next look tries again within 5 s");
    }
}

/// Machine egress, started with every VM's table in place.
fn machines(
    config: &Config,
    registry: &Arc<Registry>,
    cache: &Arc<AttributionCache>,
) -> Result<Arc<egress_machine::Machines>, StartError> {
    let neighbours = crate::neighbours::Neighbours {
        registry: registry.clone(),
        cache: cache.clone(),
    };
    Ok(egress_machine::Machines::start(
        &config.machine_egress,
        &config.state_dir,
        Arc::new(neighbours),
    )?)
}

/// The budget states a predecessor handed over, and on a cold start those
/// the last gateway on the state directory wrote when it stopped.
fn take_budgets(dp: &Dataplane, handed: Vec<crate::budget::Spent>, cold: bool) {
    take_over_budgets(dp, handed);
    if cold {
        take_saved_budgets(dp);
    }
}

/// Takes over the budget states the last gateway on this state directory
/// wrote when it stopped ([`crate::budget::saved`]); a file that does not
/// read back leaves every state full, as before, and says so. The file is
/// removed once the gateway serves ([`saved_budgets_taken`]).
fn take_saved_budgets(dp: &Dataplane) {
    let dir = &dp.config().state_dir;
    match crate::budget::saved::read(dir, std::time::SystemTime::now()) {
        Ok(lines) => take_over_budgets(dp, lines),
        Err(e) => {
            tracing::error!(error = %e, "the budget states of the last stop could not be read: they start full")
        }
    }
}

/// The saved budget states, taken at a cold start, removed once the
/// gateway serves: a start that failed before leaves them for the next.
fn saved_budgets_taken(dp: &Dataplane) {
    if let Err(e) = crate::budget::saved::taken(&dp.config().state_dir) {
        tracing::warn!(error = %e, "the budget states taken at start could not be removed: a later cold start may take them again, aged by then");
    }
}

/// Writes the budget states a predecessor handed over, as a stop would:
/// it no longer writes them (it handed them over), and a takeover that fails
/// after this would otherwise leave the next cold start every state full.
/// Removed once this gateway serves ([`saved_budgets_taken`]).
fn keep_handed_budgets(config: &Config, handed: &[crate::budget::Spent]) {
    if handed.is_empty() {
        return;
    }
    let now = std::time::SystemTime::now();
    if let Err(e) = crate::budget::saved::save(&config.state_dir, handed.to_vec(), now) {
        tracing::warn!(error = %e, "the budget states handed over could not be written: a start that fails now leaves the next cold start every state full");
    }
}

/// Writes the budget states that are not full for the next gateway on this
/// state directory (a stop without a successor, after the drain).
fn save_budgets(dp: &Dataplane) {
    let spent = dp.budgets.spent(dp.cache.now());
    if spent.is_empty() {
        return;
    }
    let n = spent.len();
    let dir = &dp.config().state_dir;
    match crate::budget::saved::save(dir, spent, std::time::SystemTime::now()) {
        Ok(()) => tracing::info!(states = n, "budget states written for the next start"),
        Err(e) => {
            tracing::error!(error = %e, "the budget states could not be written: the next start begins them full")
        }
    }
}

/// Restores a predecessor's attribution for the sandboxes the recovered
/// state has (a line for any other sandbox is dropped), each lifetime less
/// the time since the lines came (`received`), the state's recovery
/// included (one that ran out is dropped).
fn restore_attribution(
    cache: &AttributionCache,
    registry: &Registry,
    lines: Vec<crate::handover::Attributed>,
    received: Option<std::time::Instant>,
) {
    if lines.is_empty() {
        return;
    }
    let (mut restored, total) = (0usize, lines.len());
    for line in lines {
        // What the start took since the predecessor's lines came (the
        // state's recovery included) is taken off their lifetimes: a
        // handover extends no evidence.
        let since = received.map_or(std::time::Duration::ZERO, |r| r.elapsed());
        let Ok(id) = egress_policy::SandboxId::parse(&line.sandbox) else {
            continue;
        };
        if registry.get(&id).is_none() {
            continue;
        }
        let names: Vec<_> = line
            .names
            .iter()
            .filter_map(|(n, ms)| {
                let name = egress_policy::Hostname::parse(n).ok()?;
                let left = std::time::Duration::from_millis(*ms).checked_sub(since)?;
                (!left.is_zero()).then_some((name, left))
            })
            .collect();
        if cache.restore(&id, line.ip, &names) {
            restored += 1;
        }
    }
    tracing::info!(restored, of = total, "attributed addresses taken over");
}

/// The handover offer: the socket and duplicates of every listener. A
/// gateway that cannot offer still serves; it is replaced by a restart.
fn offer(config: &Config, listeners: &Listeners) -> Option<crate::handover::Offer> {
    let offered = listeners
        .duplicates()
        .and_then(|sockets| crate::handover::Offer::listen(config, sockets));
    match offered {
        Ok(o) => Some(o),
        Err(e) => {
            tracing::warn!(error = %e, "no handover socket: replacing this gateway will need a restart");
            None
        }
    }
}

/// The metrics, with every source read at scrape time registered.
fn metrics(
    (dns, cache, minter): (&Arc<DnsProxy>, &Arc<AttributionCache>, &Arc<LeafMinter>),
    machines: &Arc<egress_machine::Machines>,
    flow_log: &FlowLog,
    up: &Upstreams,
) -> crate::metrics::Metrics {
    let mut metrics =
        crate::metrics::Metrics::new(dns.metrics().clone(), cache.clone(), minter.clone());
    metrics.declare("deny", crate::flow::Refusal::CODES);
    metrics.machines(egress_machine::metrics::collector(machines.clone()));
    metrics.flow_log(flow_log.dropped());
    metrics.upstream_pool(up.pool.gauge());
    metrics
}

/// The attribution cache (on `clock`) and the DNS proxy that fills it.
fn attribution(
    config: &Config,
    registry: &Arc<Registry>,
    clock: Arc<dyn Clock>,
) -> (Arc<AttributionCache>, Arc<DnsProxy>) {
    let (dns, registered) = (config.dns.max_sandboxes, config.limits.max_sandboxes);
    if dns < registered {
        tracing::warn!(
            dns_max_sandboxes = dns,
            limits_max_sandboxes = registered,
            "dns.max_sandboxes is below limits.max_sandboxes: past it a sandbox's DNS attributes nothing (its name allows fail closed), and the least recently active sandboxes' DNS budgets start over full"
        );
    }
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
            budget: BudgetLimits {
                qps: config.dns.budget_qps,
                new_names_per_minute: config.dns.budget_new_names_per_minute,
            },
            budget_ceiling: BudgetLimits {
                qps: config.dns.budget_ceiling().0,
                new_names_per_minute: config.dns.budget_ceiling().1,
            },
            budget_sandboxes: config.dns.max_sandboxes,
            ..ProxyConfig::default()
        },
        cache.clone(),
        registry.clone(),
    );
    (cache, dns)
}

/// What a successor checks before it asks for a takeover (after which a
/// failure would leave nothing serving): the CA, the origin roots and the
/// admin token load, and the pushed state and the machine egress state
/// read in this build (the policies read into a scratch registry as
/// recovery reads them, every one compiled, and each VM's addresses
/// claimed there against the sandboxes' and each other's; no file changed,
/// the running gateway writing on).
pub fn preflight(config: &Config) -> Result<(), StartError> {
    let minter = minter(config)?;
    Upstreams::new(config, minter)?;
    tokens(config)?;
    let platform = PlatformDenies::new(config.policy.platform_deny.clone());
    let scratch = Registry::new(Arc::new(platform));
    let (seq, n) = crate::journal::check(&scratch, &config.state_dir)?;
    let claim = |vm: &str, addresses: &[IpAddr]| {
        let claimed = scratch.claim_for_vm(vm, addresses);
        claimed.map_err(|e| e.to_string())
    };
    let vms = egress_machine::check_state(&config.machine_egress, &config.state_dir, claim)?;
    tracing::info!(
        sandboxes = n,
        generation = seq,
        vms,
        "the pushed state reads in this build"
    );
    Ok(())
}

/// The CA (loaded, or created in `state_dir`) and the leaf minter over it.
fn minter(config: &Config) -> Result<Arc<LeafMinter>, StartError> {
    let ca = match config.ca_paths() {
        Some(paths) => CertificateAuthority::load(&paths)?,
        None => CertificateAuthority::load_or_create(&config.state_dir.join("ca"))?,
    };
    let mint = MintConfig {
        cache_capacity: config.limits.leaf_cache,
        key_lifetime: time::Duration::try_from(config.tls.leaf_key_lifetime)
            .unwrap_or(MintConfig::default().key_lifetime),
        ..MintConfig::default()
    };
    Ok(Arc::new(LeafMinter::new(Arc::new(ca), mint)?))
}

/// The platform denies: the configured list, the gateway's listen
/// addresses, its upstream proxies' addresses, and every address of the
/// host (read now, and again every [`HOST_READ_EVERY`]): the gateway dials
/// from the host, so a sandbox reaching one of them would reach the host's
/// own services (the host's public address is in no private range). A
/// proxy may trust the worker by its address: a sandbox that reached it
/// directly would use the worker's standing there, past every policy.
fn platform(config: &Config, bound: &Bound) -> Result<PlatformDenies, StartError> {
    let mut list = config.policy.platform_deny.clone();
    let listeners = [bound.transparent, bound.dns, bound.dns_alt, bound.admin];
    let proxies = config.upstream_proxy.proxies.values().map(|p| p.address);
    for addr in listeners.into_iter().chain(proxies) {
        let d = Destination::Ip(addr.ip().to_canonical());
        if !addr.ip().is_unspecified() && !list.contains(&d) {
            list.push(d);
        }
    }
    let open = host_ranges_open(&list);
    if !open.is_empty() {
        tracing::warn!(ranges = ?open, "policy.platform_deny does not cover these ranges, which reach the gateway's host (only its own addresses in them are denied): a sandbox allowed there reaches the host's services; add them back unless that is meant");
    }
    let host = egress_machine::host::read().map_err(|why| StartError::HostAddresses { why })?;
    let denies = PlatformDenies::new(list).with_opaque_streams(config.policy.opaque_streams);
    denies.set_host(host);
    Ok(denies)
}

/// The ranges that reach the gateway's own host whatever its addresses
/// (loopback, "this host") that no entry of `list` covers whole.
fn host_ranges_open(list: &[Destination]) -> Vec<&'static str> {
    ["127.0.0.0/8", "0.0.0.0/8", "::1/128", "::/128"]
        .into_iter()
        .filter(|range| {
            let Ok(Destination::Cidr(net)) = Destination::parse(egress_policy::Kind::Cidr, range)
            else {
                return true;
            };
            !list
                .iter()
                .any(|d| matches!(d, Destination::Cidr(c) if c.contains(&net)))
        })
        .collect()
}

/// How often the host's addresses are read again.
pub(crate) const HOST_READ_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// How often expired attribution is reclaimed.
const SWEEP_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

/// How often the registry looks for allow entries past their `until`.
const LAPSE_CHECK_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

impl Listeners {
    /// Binds every listener: with `limits.thread_per_core`, one set of
    /// transparent and DNS listeners per worker thread, all on the first
    /// set's addresses (`SO_REUSEPORT`; the kernel spreads connections and
    /// queries over them by their addresses and ports).
    fn bind(config: &Config) -> Result<Self, StartError> {
        let listen = &config.listen;
        let copies = crate::handover::copies(config);
        let reuse = copies > 1;
        let first = DataListeners::bind((listen.transparent, listen.dns, listen.dns_alt), reuse)?;
        let admin = tcp_listener(listen.admin, false)
            .and_then(TcpListener::from_std)
            .map_err(|source| StartError::Bind {
                what: "listen.admin",
                addr: listen.admin,
                source,
            })?;
        let bound = Self::bound_of(&first, &admin, listen)?;
        let mut data = vec![first];
        for _ in 1..copies {
            data.push(DataListeners::bind(
                (bound.transparent, bound.dns, bound.dns_alt),
                true,
            )?);
        }
        Ok(Self { data, admin, bound })
    }

    /// Bound afresh, or a predecessor's (with its attribution).
    fn open(config: &Config, taken: Option<crate::handover::Taken>) -> Result<Opened, StartError> {
        match taken {
            None => Ok((Self::bind(config)?, Vec::new(), Vec::new())),
            Some(t) => {
                keep_handed_budgets(config, &t.budgets);
                Ok((Self::adopt(config, t.sockets)?, t.attribution, t.budgets))
            }
        }
    }

    /// The sockets a predecessor handed over, in the shape `config` binds:
    /// for each copy a transparent listener and both DNS pairs, and the admin listener.
    fn adopt(
        config: &Config,
        sockets: Vec<(crate::handover::Kind, std::os::fd::OwnedFd)>,
    ) -> Result<Self, StartError> {
        use crate::handover::Kind;
        let mut sockets: std::collections::VecDeque<_> = sockets.into();
        let mut take = |kind: Kind| {
            let at = sockets.iter().position(|(k, _)| *k == kind);
            at.and_then(|i| sockets.remove(i))
                .map(|(_, fd)| fd)
                .ok_or_else(|| {
                    StartError::Takeover(format!(
                        "the running gateway handed over no {kind:?} socket"
                    ))
                })
        };
        let admin = TcpListener::from_std(take(Kind::Admin)?.into())
            .map_err(|e| StartError::Takeover(format!("the admin listener: {e}")))?;
        let mut data = Vec::new();
        for _ in 0..crate::handover::copies(config) {
            data.push(DataListeners {
                transparent: take(Kind::Transparent)?.into(),
                dns: (take(Kind::DnsUdp)?.into(), take(Kind::DnsTcp)?.into()),
                dns_alt: (take(Kind::DnsAltUdp)?.into(), take(Kind::DnsAltTcp)?.into()),
            });
        }
        let bound = Self::bound_of(&data[0], &admin, &config.listen)?;
        Ok(Self { data, admin, bound })
    }

    fn bound_of(
        first: &DataListeners,
        admin: &TcpListener,
        listen: &crate::config::Listen,
    ) -> Result<Bound, StartError> {
        let local = |l: io::Result<SocketAddr>, what, addr| {
            l.map_err(|source| StartError::Bind { what, addr, source })
        };
        Ok(Bound {
            transparent: local(
                first.transparent.local_addr(),
                "listen.transparent",
                listen.transparent,
            )?,
            dns: local(first.dns.0.local_addr(), "listen.dns", listen.dns)?,
            dns_alt: local(
                first.dns_alt.0.local_addr(),
                "listen.dns_alt",
                listen.dns_alt,
            )?,
            admin: local(admin.local_addr(), "listen.admin", listen.admin)?,
        })
    }

    /// A duplicate of every listening socket, for a successor: while one is
    /// open the socket keeps listening, so connections queue instead of
    /// being refused.
    fn duplicates(&self) -> io::Result<Vec<(crate::handover::Kind, std::os::fd::OwnedFd)>> {
        use crate::handover::Kind;
        use std::os::fd::AsFd;
        let mut out = Vec::new();
        for d in &self.data {
            out.push((
                Kind::Transparent,
                d.transparent.as_fd().try_clone_to_owned()?,
            ));
            out.push((Kind::DnsUdp, d.dns.0.as_fd().try_clone_to_owned()?));
            out.push((Kind::DnsTcp, d.dns.1.as_fd().try_clone_to_owned()?));
            out.push((Kind::DnsAltUdp, d.dns_alt.0.as_fd().try_clone_to_owned()?));
            out.push((Kind::DnsAltTcp, d.dns_alt.1.as_fd().try_clone_to_owned()?));
        }
        out.push((Kind::Admin, self.admin.as_fd().try_clone_to_owned()?));
        Ok(out)
    }
}

impl DataListeners {
    fn bind(
        (transparent, dns, dns_alt): (SocketAddr, SocketAddr, SocketAddr),
        reuse_port: bool,
    ) -> Result<Self, StartError> {
        let what = "listen.transparent";
        let transparent =
            tcp_listener(transparent, reuse_port).map_err(|source| StartError::Bind {
                what,
                addr: transparent,
                source,
            })?;
        Ok(Self {
            transparent,
            dns: bind_dns("listen.dns", dns, reuse_port)?,
            dns_alt: bind_dns("listen.dns_alt", dns_alt, reuse_port)?,
        })
    }

    /// Registers the sockets with the runtime this is called in.
    fn register(self) -> io::Result<Served> {
        Ok(Served {
            transparent: TcpListener::from_std(self.transparent)?,
            dns: (
                UdpSocket::from_std(self.dns.0)?,
                TcpListener::from_std(self.dns.1)?,
            ),
            dns_alt: (
                UdpSocket::from_std(self.dns_alt.0)?,
                TcpListener::from_std(self.dns_alt.1)?,
            ),
        })
    }
}

/// A non-blocking TCP listener on `addr` (`SO_REUSEADDR`, as tokio's
/// `bind`; `SO_REUSEPORT` when `reuse_port`), with tokio's backlog.
fn tcp_listener(addr: SocketAddr, reuse_port: bool) -> io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    s.set_reuse_address(true)?;
    if reuse_port {
        s.set_reuse_port(true)?;
    }
    s.set_nonblocking(true)?;
    s.bind(&addr.into())?;
    s.listen(1024)?;
    Ok(s.into())
}

/// A non-blocking UDP socket on `addr` (`SO_REUSEPORT` when `reuse_port`).
fn udp_socket(addr: SocketAddr, reuse_port: bool) -> io::Result<std::net::UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let s = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    if reuse_port {
        s.set_reuse_port(true)?;
    }
    s.set_nonblocking(true)?;
    s.bind(&addr.into())?;
    Ok(s.into())
}

/// Takes `state_dir/gateway.lock` (an exclusive `flock`, released when the
/// process exits however it exits). A second gateway on the same directory
/// is refused at start: it would append to the same journal, and with
/// `limits.thread_per_core` (`SO_REUSEPORT`) its listeners would bind beside
/// the first one's and take part of its traffic.
fn lock_state_dir(dir: &std::path::Path) -> Result<std::fs::File, StartError> {
    let path = dir.join("gateway.lock");
    let shown = path.display().to_string();
    let failed = |source| StartError::StateDir {
        path: shown.clone(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(failed)?;
    // The pushed policies, the sandboxes' addresses and the CA's key are
    // the gateway's alone: a directory made by someone else (a Kubernetes
    // hostPath is 0755) is closed to others first.
    // One this process may not change (another user's) is said, not fatal.
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let meta = std::fs::metadata(dir).map_err(failed)?;
    // Another user's directory: they could replace the policies, the
    // journal or the CA under this process (and plant links it follows).
    let me = std::fs::metadata("/proc/self").map_err(failed)?.uid();
    if meta.uid() != me {
        return Err(StartError::StateDirOwner {
            path: dir.display().to_string(),
            owner: meta.uid(),
            me,
        });
    }
    let mode = meta.permissions().mode();
    if mode & 0o077 != 0 {
        if let Err(e) = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)) {
            tracing::warn!(dir = %dir.display(), mode = format!("{:o}", mode & 0o777), error = %e, "the state directory is open to other users and could not be closed");
        }
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(failed)?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(StartError::StateDirInUse { path: shown }),
        Err(std::fs::TryLockError::Error(e)) => Err(failed(e)),
    }
}

/// `state_dir/gateway.lock`: taken at once, or (taking over) once the
/// predecessor lets go of it.
fn lock(config: &Config, taking_over: bool) -> Result<std::fs::File, StartError> {
    if taking_over {
        lock_released(&config.state_dir)
    } else {
        lock_state_dir(&config.state_dir)
    }
}

/// `admin.token_file`'s token and `admin.metrics_token_file`'s, each if
/// configured.
fn tokens(config: &Config) -> Result<crate::admin::Tokens, StartError> {
    let read = |key, path: &Option<std::path::PathBuf>| {
        path.as_deref().map(|p| read_token(key, p)).transpose()
    };
    Ok(crate::admin::Tokens {
        admin: read("admin.token_file", &config.admin.token_file)?,
        metrics: read("admin.metrics_token_file", &config.admin.metrics_token_file)?,
    })
}

/// The lock a predecessor releases as it hands over: taken within the
/// handover's timeout, or the takeover fails (and nothing was served).
fn lock_released(dir: &std::path::Path) -> Result<std::fs::File, StartError> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match lock_state_dir(dir) {
            Err(StartError::StateDirInUse { path }) if std::time::Instant::now() < deadline => {
                let _ = path;
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            other => return other,
        }
    }
}

fn read_token(key: &'static str, path: &std::path::Path) -> Result<String, StartError> {
    egress_api::file::warn_if_open(key, path);
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| StartError::Token {
        key,
        path: shown.clone(),
        message: e.to_string(),
    })?;
    let token = text.trim().to_owned();
    if token.len() < 16 {
        return Err(StartError::Token {
            key,
            path: shown,
            message: "the token must be at least 16 characters".into(),
        });
    }
    Ok(token)
}

/// A UDP socket and a TCP listener on the same address. With port 0 the
/// kernel picks the UDP port, which TCP may already use: try a few.
fn bind_dns(
    what: &'static str,
    addr: SocketAddr,
    reuse_port: bool,
) -> Result<(std::net::UdpSocket, std::net::TcpListener), StartError> {
    let err = |source| StartError::Bind { what, addr, source };
    let mut last = None;
    for _ in 0..16 {
        let udp = udp_socket(addr, reuse_port).map_err(err)?;
        let local = udp.local_addr().map_err(err)?;
        match tcp_listener(local, reuse_port) {
            Ok(tcp) => return Ok((udp, tcp)),
            Err(e) if addr.port() == 0 && e.kind() == io::ErrorKind::AddrInUse => last = Some(e),
            Err(e) => return Err(err(e)),
        }
    }
    Err(err(last.unwrap_or_else(|| {
        io::Error::from(io::ErrorKind::AddrInUse)
    })))
}

/// Spawns one set of listeners' tasks: DNS on both resolver addresses (UDP
/// and TCP) and the transparent accept loop.
fn serve_data(
    tasks: &mut JoinSet<()>,
    l: Served,
    dns: &Arc<DnsProxy>,
    dp: Arc<Dataplane>,
    up: Arc<Upstreams>,
    slots: Arc<Slots>,
    accepted: Counter,
) {
    tasks.spawn(dns.clone().serve_udp(l.dns.0, RESOLVER_PRIMARY));
    tasks.spawn(dns.clone().serve_tcp(l.dns.1, RESOLVER_PRIMARY));
    tasks.spawn(dns.clone().serve_udp(l.dns_alt.0, RESOLVER_ALT));
    tasks.spawn(dns.clone().serve_tcp(l.dns_alt.1, RESOLVER_ALT));
    tasks.spawn(accept(l.transparent, dp, up, slots, accepted));
}

/// One worker thread's life (`limits.thread_per_core`): serve its listeners
/// until the drain starts, then let its open flows run until the drain is
/// over (or the gateway is dropped).
async fn worker(
    l: Served,
    dns: Arc<DnsProxy>,
    dp: Arc<Dataplane>,
    up: Arc<Upstreams>,
    slots: Arc<Slots>,
    accepted: Counter,
    (mut phase, failed, stopped): (
        watch::Receiver<Phase>,
        tokio::sync::mpsc::UnboundedSender<String>,
        tokio::sync::mpsc::UnboundedSender<()>,
    ),
) {
    let mut tasks = JoinSet::new();
    serve_data(&mut tasks, l, &dns, dp, up, slots, accepted);
    let early = tokio::select! {
        _ = phase.wait_for(|p| *p >= Phase::Draining) => None,
        why = ended(&mut tasks) => Some(why),
    };
    if let Some(why) = early {
        let _ = failed.send(why);
        let _ = phase.wait_for(|p| *p >= Phase::Draining).await;
    }
    tasks.shutdown().await;
    let _ = stopped.send(());
    let _ = phase.wait_for(|p| *p >= Phase::Exit).await;
}

async fn accept(
    listener: TcpListener,
    dp: Arc<Dataplane>,
    up: Arc<Upstreams>,
    slots: Arc<Slots>,
    accepted: Counter,
) {
    let mut failed: u64 = 0;
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                // EMFILE and friends: back off briefly rather than spin,
                // and say so once every 100 (5 s of them), not 20 a second.
                if failed.is_multiple_of(100) {
                    tracing::warn!(error = %e, failed = failed + 1, "accept failed (logged once every 100; the open-file limit?)");
                }
                failed += 1;
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        accepted.inc();
        // On a dual-stack listener IPv4 peers arrive as `::ffff:a.b.c.d`.
        let peer = SocketAddr::new(peer.ip().to_canonical(), peer.port());
        let permit = match slots.take(peer.ip()) {
            Ok(slot) => slot,
            Err(no) => {
                refused(&dp, no, peer);
                crate::io::reset(&stream);
                continue;
            }
        };
        let (dp, up) = (dp.clone(), up.clone());
        tokio::spawn(async move {
            crate::flow::handle(dp, up, stream, peer).await;
            drop(permit);
        });
    }
}

/// Counts a connection that got no slot, and warns once every 1,024 of
/// each kind (the first included), not once a connection: a sandbox opening
/// connections in a loop must not flood the log.
fn refused(dp: &Dataplane, no: NoSlot, peer: SocketAddr) {
    let (counter, what) = match no {
        NoSlot::Share => (&dp.metrics.over_share, "source holds its share of connections (limits.max_connections); closing (logged once every 1,024; egress_connections_over_share_total counts each)"),
        NoSlot::Limit => (&dp.metrics.over_limit, "connection limit reached; closing (logged once every 1,024; egress_connections_over_limit_total counts each)"),
    };
    if counter.get().is_multiple_of(1_024) {
        tracing::warn!(%peer, "{what}");
    }
    counter.inc();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A state directory another user owns is refused, naming both uids
    /// (they could replace the policies or the CA under the gateway).
    #[test]
    fn a_state_dir_of_another_user_is_refused() {
        let dir = tempfile::tempdir().expect("temp");
        let theirs = dir.path().join("state");
        std::fs::create_dir(&theirs).expect("mkdir");
        if std::os::unix::fs::chown(&theirs, Some(65_534), None).is_err() {
            return egress_testkit::skip("a state_dir of another user", "chown needs root");
        }
        let err = lock_state_dir(&theirs).expect_err("another user's");
        assert!(err.to_string().contains("belongs to uid 65534"), "{err}");
        let mine = dir.path().join("mine");
        assert!(lock_state_dir(&mine).is_ok());
    }

    /// A predecessor's attribution lives what it had left less the time
    /// since its lines came, counted as each is restored (after the
    /// state's recovery, which may take seconds): a handover extends no
    /// evidence. A name whose time ran out meanwhile is dropped.
    #[test]
    fn restored_attribution_loses_the_time_since_it_came() {
        let registry = Registry::new(Arc::new(PlatformDenies::new(Vec::new())));
        let policy = egress_policy::Policy::from_json(r#"{"allow": [{"domain": "a.test"}]}"#)
            .expect("policy");
        let id = egress_policy::SandboxId::new("sb1");
        let sandbox_ip: std::net::IpAddr = "100.64.0.2".parse().expect("ip");
        registry
            .put(id.clone(), vec![sandbox_ip], policy)
            .expect("put");
        let clock: Arc<dyn Clock> = dns_attrib::SystemClock::new();
        let cache = AttributionCache::new(dns_attrib::CacheConfig::default(), clock);
        let ip: std::net::IpAddr = "203.0.113.9".parse().expect("ip");
        let line = crate::handover::Attributed {
            sandbox: "sb1".into(),
            ip,
            names: vec![("a.test".into(), 60_000), ("b.test".into(), 1_000)],
        };
        let received = std::time::Instant::now() - Duration::from_secs(20);
        restore_attribution(&cache, &registry, vec![line], Some(received));
        let entries = cache.entries(&id);
        assert_eq!(entries.len(), 1, "{entries:?}");
        let (_, names) = &entries[0];
        assert_eq!(names.len(), 1, "b.test had 1 s of the 20 gone: {names:?}");
        assert_eq!(names[0].0.as_str(), "a.test");
        assert!(names[0].1 <= Duration::from_secs(40), "{names:?}");
        assert!(names[0].1 > Duration::from_secs(30), "{names:?}");
    }

    /// A task that serves until the drain and ends first (here a panic)
    /// stops the gateway: readiness false, a drain, and `failed` naming
    /// it, for the process to exit with a failure. Before, the gateway
    /// served on without it.
    #[tokio::test]
    async fn a_task_that_ends_early_stops_the_gateway() {
        let dir = tempfile::tempdir().expect("temp");
        let text = format!(
            "state_dir = \"{}\"\n[listen]\ntransparent = \"127.0.0.1:0\"\ndns = \"127.0.0.1:0\"\ndns_alt = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n",
            dir.path().display()
        );
        let config = Config::parse(&text, std::path::Path::new("t.toml")).expect("config");
        let mut gw = Gateway::start(config, Arc::new(SoOriginalDst), FlowLog::off())
            .await
            .expect("starts");
        let dp = gw.dataplane().clone();
        assert!(dp.ready.load(Ordering::Acquire));
        gw.tasks.spawn(async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            panic!("the DNS listener broke");
        });
        let stopped = tokio::time::timeout(Duration::from_secs(20), gw.run(std::future::pending()))
            .await
            .expect("stopped by the task's end, not by a signal");
        let failed = stopped.failed.expect("a failure");
        assert!(failed.contains("the DNS listener broke"), "{failed}");
        assert!(!dp.ready.load(Ordering::Acquire));
    }

    /// The verdict for an opaque stream to `dst` under `platform` and a
    /// policy that allows everything.
    fn verdict(platform: impl Into<Arc<PlatformDenies>>, dst: &str) -> egress_policy::Verdict {
        let policy = egress_policy::Policy::from_json(r#"{"default": "allow"}"#).expect("policy");
        let compiled = egress_policy::CompiledPolicy::new(policy, platform.into());
        let claims = crate::decide::Claims {
            dst: dst.parse().expect("addr"),
            protocol: egress_policy::Protocol::Opaque(None),
            sni: None,
            host: None,
            ech: false,
        };
        let none = crate::doh::DohNames::empty();
        crate::decide::judge(
            &compiled,
            &claims,
            &[],
            egress_policy::AttributionGap::NoDnsSeen,
            &none,
        )
    }

    /// Every address of the host is a platform deny, whatever the listeners
    /// are bound to (the gateway dials from the host), and so is one the
    /// host gains later, in every form that names it. The list is emptied
    /// here to show it: before, listeners on one address added that
    /// address only, and the host's addresses were read once.
    #[test]
    fn every_address_of_the_host_is_denied_now_and_later() {
        let config = Config::parse(
            "[policy]\nplatform_deny = []\n",
            std::path::Path::new("t.toml"),
        )
        .expect("config");
        let at = |s: &str| s.parse::<SocketAddr>().expect("addr");
        let one = Bound {
            transparent: at("127.0.0.1:15001"),
            dns: at("127.0.0.1:15053"),
            dns_alt: at("127.0.0.1:15054"),
            admin: at("127.0.0.1:15000"),
        };
        let host = egress_machine::host::read().expect("the host's addresses");
        assert!(!host.is_empty());
        let denies = Arc::new(platform(&config, &one).expect("platform"));
        for ip in host {
            let dst = SocketAddr::new(ip, 22).to_string();
            assert_eq!(
                verdict(denies.clone(), &dst).code(),
                "platform_deny",
                "{dst}"
            );
        }
        let v = verdict(denies.clone(), "127.0.0.2:22");
        assert_ne!(v.code(), "platform_deny");
        // An address gained later, read again.
        for dst in [
            "203.0.113.77:22",
            "[::ffff:203.0.113.77]:22",
            "[64:ff9b::cb00:714d]:22",
        ] {
            assert_ne!(
                verdict(denies.clone(), dst).code(),
                "platform_deny",
                "{dst}"
            );
        }
        denies.set_host(["203.0.113.77".parse().expect("ip")]);
        for dst in [
            "203.0.113.77:22",
            "[::ffff:203.0.113.77]:22",
            "[64:ff9b::cb00:714d]:22",
        ] {
            let v = verdict(denies.clone(), dst);
            assert_eq!(v.code(), "platform_deny", "{dst}");
            assert_eq!(v.deny_rule(), None, "no entry of the list: {dst}");
        }
    }

    /// A `policy.platform_deny` that leaves out loopback or "this host"
    /// is told at start: those ranges reach the host whatever its addresses.
    #[test]
    fn a_platform_list_without_the_hosts_ranges_is_named() {
        let parse = |c: &str| Destination::parse(egress_policy::Kind::Cidr, c).expect(c);
        assert!(host_ranges_open(&egress_policy::default_denies()).is_empty());
        assert_eq!(
            host_ranges_open(&[parse("169.254.0.0/16")]),
            ["127.0.0.0/8", "0.0.0.0/8", "::1/128", "::/128"]
        );
        let most = [parse("127.0.0.0/16"), parse("0.0.0.0/8"), parse("::/127")];
        assert_eq!(
            host_ranges_open(&most),
            ["127.0.0.0/8"],
            "a /16 is not the /8"
        );
    }

    /// An upstream proxy may trust the worker by its address: no sandbox
    /// reaches it directly.
    #[test]
    fn the_upstream_proxies_are_no_destination() {
        let config = Config::parse(
            "[policy]\nplatform_deny = []\n[upstream_proxy.proxies.corp]\naddress = \"203.0.113.8:3128\"\n",
            std::path::Path::new("t.toml"),
        )
        .expect("config");
        let at = |s: &str| s.parse::<SocketAddr>().expect("addr");
        let bound = Bound {
            transparent: at("127.0.0.1:15001"),
            dns: at("127.0.0.1:15053"),
            dns_alt: at("127.0.0.1:15054"),
            admin: at("127.0.0.1:15000"),
        };
        for dst in ["203.0.113.8:3128", "203.0.113.8:443"] {
            let v = verdict(platform(&config, &bound).expect("platform"), dst);
            assert_eq!(v.code(), "platform_deny", "{dst}");
        }
        let v = verdict(
            platform(&config, &bound).expect("platform"),
            "203.0.113.9:3128",
        );
        assert_ne!(v.code(), "platform_deny");
    }
}
