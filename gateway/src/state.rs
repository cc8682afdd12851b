//! What every flow reads: the configuration in force, the sandboxes, the
//! attribution cache, the flow log and the metrics. The intercept path's
//! upstream state and the control API's state are their own (`upstream`,
//! `admin`); this module imports neither.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use dns_attrib::AttributionCache;

use crate::config::Config;
use crate::flowlog::FlowLog;
use crate::metrics::Metrics;
use crate::registry::Registry;

/// How the original destination of a redirected connection is learned.
pub trait OriginalDst: Send + Sync + 'static {
    fn original_dst(&self, stream: &tokio::net::TcpStream)
        -> std::io::Result<std::net::SocketAddr>;
}

/// The dataplane's shared state.
pub struct Dataplane {
    config: arc_swap::ArcSwap<Config>,
    pub registry: Arc<Registry>,
    pub cache: Arc<AttributionCache>,
    pub(crate) flow_log: FlowLog,
    pub(crate) metrics: Metrics,
    pub(crate) orig_dst: Arc<dyn OriginalDst>,
    /// Serving (readiness): false before start and while draining.
    pub(crate) ready: AtomicBool,
    /// The drain has started: intercepted connections close at their next
    /// request boundary (HTTP/1.1 after the response in progress, HTTP/2
    /// with a GOAWAY), so their clients come back to a gateway that serves.
    pub(crate) draining: AtomicBool,
    /// The drain's time ran out: spliced flows still open are reset (a
    /// dropped task would close them with a FIN, which a client reading to
    /// the end of the stream takes for a whole download).
    pub(crate) drain_over: AtomicBool,
    /// The values of the sandboxes' host-bound credentials.
    pub(crate) secrets: crate::credentials::Secrets,
    /// The in-kernel splice, where it could be loaded (`splice.kernel`).
    pub(crate) kernel: Option<crate::ksplice::KernelSplice>,
    /// Well-known DoH servers' names (`dns.doh_names` and the built-in ones).
    pub(crate) doh_names: crate::doh::DohNames,
    /// The DNS proxy that answers DoH to the reserved resolvers (set at start).
    pub(crate) resolver: Option<Arc<dns_attrib::DnsProxy>>,
    /// The operator's upstream proxies (`upstream_proxy`, fixed at start).
    pub(crate) proxies: crate::upstream_proxy::UpstreamProxies,
    /// What each sandbox's denials propose (`GET /v1/sandboxes/{id}/proposals`).
    pub(crate) proposed: crate::proposed::Proposed,
    /// Request and byte budgets spent ([`crate::budget`]).
    pub(crate) budgets: Arc<crate::budget::BudgetTable>,
    /// Intercepted HTTP/2 requests in flight, shared between sources as
    /// the connection slots are (`limits.max_connections`): each holds its
    /// head (up to `limits.max_request_head`) until its answer's head comes,
    /// and a connection's streams would otherwise multiply what one
    /// connection may hold by hyper's 200.
    pub(crate) h2_requests: Arc<crate::slots::Slots>,
    /// `shadow_diff_total`: differences of the sandboxes' shadow policies.
    pub(crate) shadow_diffs: prometheus_client::metrics::family::Family<
        crate::metrics::ShadowLabels,
        prometheus_client::metrics::counter::Counter,
    >,
}

impl Dataplane {
    pub(crate) fn new(
        config: Config,
        registry: Arc<Registry>,
        cache: Arc<AttributionCache>,
        flow_log: FlowLog,
        mut metrics: Metrics,
        orig_dst: Arc<dyn OriginalDst>,
    ) -> Self {
        let doh_names = crate::doh::DohNames::new(&config.dns.doh_names);
        let proxies = crate::upstream_proxy::UpstreamProxies::new(&config.upstream_proxy);
        metrics.upstream_proxies(proxies.names().map(|n| n.as_str()));
        let budgets = Arc::new(crate::budget::BudgetTable::new(
            config.limits.max_budget_states,
            metrics.budgets.states.clone(),
            metrics.budgets.states_full.clone(),
        ));
        let shadow_diffs = metrics.shadow_diffs();
        let secrets = crate::credentials::Secrets::new(config.credentials.clone());
        let h2_requests = crate::slots::Slots::new(config.limits.max_connections);
        Self {
            budgets,
            h2_requests,
            config: arc_swap::ArcSwap::from_pointee(config),
            registry,
            cache,
            flow_log,
            metrics,
            orig_dst,
            ready: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            drain_over: AtomicBool::new(false),
            secrets,
            kernel: None,
            doh_names,
            resolver: None,
            proxies,
            proposed: crate::proposed::Proposed::default(),
            shadow_diffs,
        }
    }

    /// Reads every registered sandbox's credential values and every
    /// upstream proxy's password again (start, SIGHUP); logs the ones that
    /// cannot be read, by source, never a value.
    pub fn reload_secrets(&self) {
        for why in self.proxies.reload() {
            tracing::error!(proxy = %why, "upstream proxy password unreadable: connections through it fail (proxy_unavailable), none go direct");
        }
        let sandboxes = self.registry.all();
        let sources = sandboxes
            .iter()
            .flat_map(|s| s.credentials.iter().map(|c| &c.source));
        let failed = self.secrets.reload(sources);
        for why in &failed {
            tracing::error!(source = %why, "credential value unreadable: requests that need it are refused (credential_unavailable)");
        }
    }

    /// The configuration in force now (a cheap snapshot; see [`Dataplane::reload`]).
    pub fn config(&self) -> Arc<Config> {
        self.config.load_full()
    }

    /// Applies what can change without a restart to new flows; returns the
    /// keys that changed but need a restart, which keep their running values.
    pub fn reload(&self, next: &Config) -> Vec<String> {
        let (config, restart) = self.config().reloaded(next);
        self.config.store(Arc::new(config));
        restart
    }
}
