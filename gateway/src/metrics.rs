//! Prometheus metrics (served at `/metrics` on the admin listener).
//!
//! Labels are bounded sets only: verdicts and reason codes, directions,
//! outcomes. Sandbox ids and names never become labels.
//!
//! Every family has HELP text saying what is counted and when, in the words
//! of the metrics table in `docs/operations.md`;
//! `gateway/tests/control/promtool.rs` lints a scrape with `promtool check
//! metrics`. HELP passed to `Registry::register` gets its closing period from
//! prometheus-client; the families `Sources` emits write theirs out.

use std::sync::Arc;

use dns_attrib::{AttributionCache, DnsMetrics};
use egress_certs::LeafMinter;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct FlowLabels {
    pub(crate) verdict: &'static str,
    pub(crate) reason: &'static str,
}

/// A shadow difference: the active verdict, the candidate's verdict (or
/// `unobservable`) and the candidate's reason code.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ShadowLabels {
    pub(crate) active: &'static str,
    pub(crate) shadow: &'static str,
    pub(crate) reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct DirectionLabels {
    pub(crate) direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct OutcomeLabels {
    pub(crate) outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ResultLabels {
    /// `ok` or `error`.
    pub(crate) result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct CodeLabels {
    pub(crate) code: &'static str,
}

/// The gateway's own instruments.
pub(crate) struct Metrics {
    registry: Registry,
    pub(crate) flows: Family<FlowLabels, Counter>,
    pub(crate) bytes: Family<DirectionLabels, Counter>,
    pub(crate) active: Gauge,
    /// Intercepted HTTP/1.1 connections parked between requests.
    pub(crate) parked: Gauge,
    pub(crate) peek_seconds: Histogram,
    pub(crate) handshake_seconds: Histogram,
    pub(crate) upstream_connect_seconds: Histogram,
    /// Requests sent again on another connection: refused unprocessed by an
    /// HTTP/2 origin (a GOAWAY below them, `REFUSED_STREAM`), or not sent, or
    /// a bodyless GET, HEAD or OPTIONS failed, on an HTTP/1.1 one.
    pub(crate) upstream_retries: Counter,
    pub(crate) pushes: Family<OutcomeLabels, Counter>,
    faults: Family<FaultLabels, Counter>,
    pub(crate) over_limit: Counter,
    /// Connections reset at accept because their source held its share.
    pub(crate) over_share: Counter,
    /// HTTP/2 requests refused `503` because their source held its share
    /// of requests in flight.
    pub(crate) requests_over_share: Counter,
    /// Requests refused on a flow that was let through, by code.
    pub(crate) requests_denied: Family<CodeLabels, Counter>,
    /// Requests an audited rule would have refused, by code.
    pub(crate) requests_would_deny: Family<CodeLabels, Counter>,
    /// Credential values put in place of a placeholder.
    pub(crate) credentials_injected: Counter,
    /// Credential values an origin sent back, replaced by their placeholder.
    pub(crate) credentials_reflected: Counter,
    /// Spliced flows, by who moved their bytes (`SplicePath as usize`):
    /// made once, so an ended flow never looks up its label.
    spliced: [Counter; 3],
    /// Connections accepted on the transparent listener, by worker thread.
    pub(crate) accepted: Family<WorkerLabels, Counter>,
    /// Reloads of the interception CA's files (SIGHUP), by result.
    pub(crate) ca_reloads: Family<ResultLabels, Counter>,
    /// Tunnels asked of the operator's upstream proxies, by proxy and result.
    proxy_connects: Family<ProxyLabels, Counter>,
    pub(crate) budgets: BudgetMetrics,
    /// Times the fence (`redirect.fence`) was found missing and installed.
    pub(crate) fence_restored: Counter,
}

/// The policy budgets' instruments.
#[derive(Default)]
pub(crate) struct BudgetMetrics {
    /// Flows and requests refused or cut over a budget, by kind.
    exceeded: Family<KindLabels, Counter>,
    /// Budget states held (sandbox × `budgets` entry).
    pub(crate) states: Gauge,
    /// Budget states refused for want of room (`limits.max_budget_states`).
    pub(crate) states_full: Counter,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct KindLabels {
    /// `requests`, `bytes` or `state` (no room for a budget state).
    pub(crate) kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProxyLabels {
    /// A configured proxy's name (`upstream_proxy.proxies`): a bounded set.
    proxy: String,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct WorkerLabels {
    /// The worker's index, `0` to `limits.worker_threads - 1` with
    /// `limits.thread_per_core`; `0` alone without (one accept loop).
    pub(crate) worker: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PathLabels {
    path: &'static str,
}

/// Who moved a spliced flow's bytes: the `path` of `egress_spliced_flows_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SplicePath {
    /// The sockmap (`splice.kernel = "on"`).
    Kernel,
    /// `splice(2)` through pipes (`splice.kernel = "pipe"`).
    Pipe,
    /// The gateway's copy.
    User,
}

impl SplicePath {
    const ALL: [Self; 3] = [Self::Kernel, Self::Pipe, Self::User];

    fn label(self) -> &'static str {
        match self {
            Self::Kernel => "kernel",
            Self::Pipe => "pipe",
            Self::User => "user",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FaultLabels {
    side: &'static str,
    kind: &'static str,
}

/// Reads the DNS proxy's, the attribution cache's and the minter's counters at scrape time.
#[derive(Debug)]
struct Sources {
    dns: Arc<DnsMetrics>,
    cache: Arc<AttributionCache>,
    minter: Arc<LeafMinter>,
}

impl Metrics {
    pub(crate) fn new(
        dns: Arc<DnsMetrics>,
        cache: Arc<AttributionCache>,
        minter: Arc<LeafMinter>,
    ) -> Self {
        let latency = || Histogram::new(exponential_buckets(0.0001, 2.0, 18));
        let mut m = Self {
            registry: Registry::with_prefix("egress"),
            flows: Family::default(),
            bytes: Family::default(),
            active: Gauge::default(),
            parked: Gauge::default(),
            peek_seconds: latency(),
            handshake_seconds: latency(),
            upstream_connect_seconds: latency(),
            upstream_retries: Counter::default(),
            pushes: Family::default(),
            faults: Family::default(),
            over_limit: Counter::default(),
            over_share: Counter::default(),
            requests_over_share: Counter::default(),
            requests_denied: Family::default(),
            requests_would_deny: Family::default(),
            credentials_injected: Counter::default(),
            credentials_reflected: Counter::default(),
            spliced: Default::default(),
            accepted: Family::default(),
            ca_reloads: Family::default(),
            proxy_connects: Family::default(),
            budgets: BudgetMetrics::default(),
            fence_restored: Counter::default(),
        };
        // Registration order is the scrape's family order.
        m.register_flows();
        m.register_operations();
        m.register_requests();
        m.register_spliced();
        m.registry
            .register_collector(Box::new(Sources { dns, cache, minter }));
        m.register_ca_reloads();
        m.register_budgets();
        m.registry.register(
            "redirect_fence_restored",
            "Times the gateway found the fence of redirect.fence missing or emptied (a ruleset flushed by another tool, say) and installed it again, and interfaces without their redirect (their table gone, or left out of a fence installed again) it attached again, or fenced when that failed",
            m.fence_restored.clone(),
        );
        m
    }

    /// `flows`, `bytes`, `active_connections` and the flow stages' latencies.
    fn register_flows(&mut self) {
        let r = &mut self.registry;
        r.register(
            "flows",
            "Flows ended, by verdict and reason code",
            self.flows.clone(),
        );
        r.register(
            "bytes",
            "Bytes of ended flows, up (sandbox to origin) and down, added when the flow ends",
            self.bytes.clone(),
        );
        r.register(
            "active_connections",
            "Flows being handled now (compare with limits.max_connections)",
            self.active.clone(),
        );
        r.register(
            "parked_connections",
            "Intercepted HTTP/1.1 connections resting between requests, their parser and buffers set aside until the client's next bytes",
            self.parked.clone(),
        );
        r.register(
            "peek_seconds",
            "Seconds to classify a flow from its first bytes",
            self.peek_seconds.clone(),
        );
        r.register(
            "tls_handshake_seconds",
            "Seconds of the client-side TLS handshake on intercepted flows",
            self.handshake_seconds.clone(),
        );
        r.register(
            "upstream_connect_seconds",
            "Seconds of the TCP connect to the original destination",
            self.upstream_connect_seconds.clone(),
        );
        r.register(
            "upstream_retries",
            "Requests sent again on another connection: refused unprocessed by an HTTP/2 origin (GOAWAY, REFUSED_STREAM; bodyless GET, HEAD and OPTIONS only), or not sent, or a bodyless GET, HEAD or OPTIONS failed, on an HTTP/1.1 connection the origin closed",
            self.upstream_retries.clone(),
        );
    }

    /// `policy_pushes`, `connections_over_limit`, `connections_over_share`,
    /// `http2_requests_over_share` and `flow_errors{side,kind}`
    /// (every fault at zero from the start).
    fn register_operations(&mut self) {
        let r = &mut self.registry;
        r.register(
            "policy_pushes",
            "Admin writes: PUT one, PUT all, DELETE, and a shadow's PUT, DELETE and promote; applied or rejected",
            self.pushes.clone(),
        );
        r.register(
            "connections_over_limit",
            "Connections reset at accept because limits.max_connections flows were being handled",
            self.over_limit.clone(),
        );
        r.register(
            "connections_over_share",
            "Connections reset at accept because their source address held its share of limits.max_connections (max_connections / (sources holding + 1), at least 64; in the last eighth of the slots, 8)",
            self.over_share.clone(),
        );
        r.register(
            "http2_requests_over_share",
            "Intercepted HTTP/2 requests answered 503 because their source address held its share of requests in flight (shared like limits.max_connections)",
            self.requests_over_share.clone(),
        );
        r.register(
            "flow_errors",
            "Failures after the verdict, by whose fault (side: client, upstream, gateway) and kind",
            self.faults.clone(),
        );
        for f in crate::fault::ALL {
            let _ = self.faults.get_or_create(&FaultLabels {
                side: f.side.as_str(),
                kind: f.kind,
            });
        }
    }

    /// `requests_denied{code}` and `requests_would_deny{code}` (every code at
    /// zero from the start), `credentials_injected` and `credentials_reflected`.
    fn register_requests(&mut self) {
        let r = &mut self.registry;
        r.register(
            "requests_denied",
            "Requests refused with 403 on a flow that was let through (per-request rules, credentials, the request's own authority), by code",
            self.requests_denied.clone(),
        );
        r.register(
            "requests_would_deny",
            "Requests an audited per-request rule would have refused; they were let through",
            self.requests_would_deny.clone(),
        );
        r.register(
            "credentials_injected",
            "Host-bound credential values put in place of a placeholder (or added) on requests to their hosts",
            self.credentials_injected.clone(),
        );
        r.register(
            "credentials_reflected",
            "Host-bound credential values an origin sent back in an answer, replaced by their placeholder before the sandbox saw them",
            self.credentials_reflected.clone(),
        );
        for code in egress_policy::RequestCode::CODES
            .iter()
            .chain(crate::credentials::Refusal::CODES)
            .chain(&["budget_exceeded", "unknown_sandbox"])
        {
            let _ = self.requests_denied.get_or_create(&CodeLabels { code });
        }
        for code in egress_policy::RequestCode::CODES {
            let _ = self.requests_would_deny.get_or_create(&CodeLabels { code });
        }
    }

    /// `spliced_flows{path}` (each path's counter made once, kept in
    /// `spliced`) and `worker_connections{worker}`.
    fn register_spliced(&mut self) {
        let spliced = Family::<PathLabels, Counter>::default();
        self.spliced = SplicePath::ALL.map(|p| {
            spliced
                .get_or_create(&PathLabels { path: p.label() })
                .clone()
        });
        let r = &mut self.registry;
        r.register(
            "spliced_flows",
            "Spliced flows ended, by who moved the bytes: kernel (sockmap), pipe (splice(2) through a pipe), or user (the gateway's copy: splice.kernel off, the program not loadable, the flow could not join the map, or no pipe could be made)",
            spliced,
        );
        r.register(
            "worker_connections",
            "Connections accepted on the transparent listener, by worker (with limits.thread_per_core, the kernel spreads them over the workers' listeners)",
            self.accepted.clone(),
        );
    }

    /// `budget_exceeded{kind}` (every kind at zero from the start),
    /// `budget_states` and `budget_states_full`.
    fn register_budgets(&mut self) {
        let r = &mut self.registry;
        r.register(
            "budget_exceeded",
            "Requests refused (429) and spliced or opaque flows refused or cut over a policy budget, by kind: requests, bytes, or state (no room for a budget state: limits.max_budget_states)",
            self.budgets.exceeded.clone(),
        );
        r.register(
            "budget_states",
            "Budget states held (one per sandbox and budgets entry in use; at most limits.max_budget_states)",
            self.budgets.states.clone(),
        );
        r.register(
            "budget_states_full",
            "Budget states refused because limits.max_budget_states were held and none had refilled (the flow or request was refused)",
            self.budgets.states_full.clone(),
        );
        for kind in ["requests", "bytes", "state"] {
            let _ = self.budgets.exceeded.get_or_create(&KindLabels { kind });
        }
    }

    /// Counts one budget refusal or cut.
    pub(crate) fn budget_exceeded(&self, over: crate::budget::Over) {
        self.budgets
            .exceeded
            .get_or_create(&KindLabels { kind: over.kind() })
            .inc();
    }

    /// `tls_ca_reloads{result}`, both results at zero from the start.
    fn register_ca_reloads(&mut self) {
        self.registry.register(
            "tls_ca_reloads",
            "Reloads of the interception CA's files (SIGHUP), by result: ok (the files were valid, changed or not) or error (the CA in service was kept)",
            self.ca_reloads.clone(),
        );
        for result in ["ok", "error"] {
            let _ = self.ca_reloads.get_or_create(&ResultLabels { result });
        }
    }

    /// Counts one failure after the verdict.
    pub(crate) fn fault(&self, f: crate::fault::Fault) {
        self.faults
            .get_or_create(&FaultLabels {
                side: f.side.as_str(),
                kind: f.kind,
            })
            .inc();
    }

    /// Registers `upstream_proxy_connects`, with every configured proxy's
    /// series at zero.
    pub(crate) fn upstream_proxies<'a>(&mut self, names: impl Iterator<Item = &'a str>) {
        self.registry.register(
            "upstream_proxy_connects",
            "Tunnels asked of the operator's upstream proxies (CONNECT to the original destination), by proxy and result: ok, unreachable, refused (not 2xx), closed, timeout, bad_response, unavailable (its password unreadable)",
            self.proxy_connects.clone(),
        );
        for proxy in names {
            for &result in crate::upstream_proxy::RESULTS {
                let _ = self.proxy_connects.get_or_create(&ProxyLabels {
                    proxy: proxy.to_owned(),
                    result,
                });
            }
        }
    }

    /// Counts one tunnel asked of `proxy`.
    pub(crate) fn proxy_connect(&self, proxy: &str, result: &'static str) {
        self.proxy_connects
            .get_or_create(&ProxyLabels {
                proxy: proxy.to_owned(),
                result,
            })
            .inc();
    }

    /// Registers `shadow_diff_total` and returns the family to count into.
    pub(crate) fn shadow_diffs(&mut self) -> Family<ShadowLabels, Counter> {
        let family = Family::<ShadowLabels, Counter>::default();
        self.registry.register(
            "shadow_diff",
            "Flows and requests a sandbox's shadow (candidate) policy judged otherwise than its active policy, by active verdict, shadow verdict (unobservable: the candidate judges requests the active flow does not show) and the shadow's reason code",
            family.clone(),
        );
        family
    }

    /// Adds the flow log's dropped-line count, read at scrape time.
    pub(crate) fn flow_log(&mut self, dropped: Arc<std::sync::atomic::AtomicU64>) {
        self.registry
            .register_collector(Box::new(FlowLogSources { dropped }));
    }

    /// Adds the gauge of upstream connections the pool holds.
    pub(crate) fn upstream_pool(&mut self, pooled: Gauge) {
        self.registry.register(
            "upstream_pooled_connections",
            "Upstream connections held in the pool for the next request of the same sandbox, destination, verified name and client protocol (HTTP/1.1 ones given back by quiet client connections, HTTP/2 ones shared)",
            pooled,
        );
    }

    /// Adds the machine egress figures, read at scrape time
    /// ([`egress_machine::metrics::collector`]).
    pub(crate) fn machines(&mut self, collector: Box<dyn Collector>) {
        self.registry.register_collector(collector);
    }

    /// The text exposition format.
    pub(crate) fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }

    /// Counts a spliced flow that ended, by who moved its bytes.
    pub(crate) fn spliced(&self, path: SplicePath) {
        self.spliced[path as usize].inc();
    }

    /// Worker `i`'s accept counter, made once per worker so the accept loop
    /// never looks up its label.
    pub(crate) fn worker(&self, i: usize) -> Counter {
        self.accepted
            .get_or_create(&WorkerLabels {
                worker: i.to_string(),
            })
            .clone()
    }

    /// Creates the `flows` series for `verdict` with each of `reasons` at
    /// zero, so they exist (and `rate()` works) before the first such flow.
    pub(crate) fn declare(&self, verdict: &'static str, reasons: &[&'static str]) {
        for &reason in reasons {
            let _ = self.flows.get_or_create(&FlowLabels { verdict, reason });
        }
    }

    pub(crate) fn flow(&self, verdict: &'static str, reason: &'static str, up: u64, down: u64) {
        self.flows
            .get_or_create(&FlowLabels { verdict, reason })
            .inc();
        self.bytes
            .get_or_create(&DirectionLabels { direction: "up" })
            .inc_by(up);
        self.bytes
            .get_or_create(&DirectionLabels { direction: "down" })
            .inc_by(down);
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Sources {
    /// `dns_events{outcome}`: the DNS proxy's counters as one family.
    fn dns_events(&self, encoder: &mut DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let d = &self.dns;
        let outcomes: [(&'static str, u64); 12] = [
            ("answered", d.answers.get()),
            ("refused", d.refused.get()),
            ("policy_refused", d.policy_refused.get()),
            ("policy_nxdomain", d.policy_nxdomain.get()),
            ("dns_budget", d.budget_refused.get()),
            ("formerr", d.formerr.get()),
            ("servfail", d.servfail.get()),
            ("truncated", d.truncated.get()),
            ("overloaded", d.overloaded.get()),
            ("attributed", d.attributed.get()),
            ("tcp_fallback", d.tcp_fallbacks.get()),
            ("upstream_failure", d.upstream_failures.get()),
        ];
        let counter = ConstCounter::new(0u64);
        let mut family = encoder.encode_descriptor(
                "dns_events",
                "DNS proxy events by outcome: answers, REFUSED (admission; the policy's dns section), NXDOMAIN by policy, REFUSED over a sandbox's DNS budget, FORMERR, SERVFAIL, truncations, overload, attributions, TCP retries, upstream failures.",
                None,
                counter.metric_type(),
            )?;
        for (outcome, n) in outcomes {
            ConstCounter::new(n).encode(family.encode_family(&OutcomeLabels { outcome })?)?;
        }
        Ok(())
    }
}

impl Sources {
    /// The counters read at a scrape: name, help, value.
    fn counters(&self) -> [(&'static str, &'static str, u64); 6] {
        let d = &self.dns;
        [
            (
                "dns_queries",
                "DNS messages received, over UDP and TCP.",
                d.queries.get(),
            ),
            (
                "dns_ech_stripped",
                "DNS answers whose SVCB/HTTPS records lost their ech parameter before reaching the sandbox.",
                d.ech_stripped.get(),
            ),
            (
                "attribution_evictions",
                "Attributed addresses evicted by the per-sandbox size bound.",
                self.cache.evictions(),
            ),
            (
                "attribution_sandboxes_refused",
                "DNS answers not recorded because dns.max_sandboxes sandboxes already had an attribution cache (the sandbox's name allows fail closed).",
                self.cache.refused_sandboxes(),
            ),
            (
                "certificates_minted",
                "Leaf certificates minted.",
                self.minter.minted(),
            ),
            (
                "tls_leaf_keys",
                "Leaf keys made since start, the first included: one more each time tls.leaf_key_lifetime runs out or a new CA is put in service.",
                self.minter.generations(),
            ),
        ]
    }
}

impl Collector for Sources {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        self.dns_events(&mut encoder)?;
        for (name, help, n) in self.counters() {
            let c = ConstCounter::new(n);
            c.encode(encoder.encode_descriptor(name, help, None, c.metric_type())?)?;
        }
        let gauges: [(&str, &str, u64); 2] = [
            (
                "attribution_entries",
                "Attributed addresses cached, over all sandboxes (approximate).",
                self.cache.entry_count(),
            ),
            (
                "certificates_cached",
                "Leaf certificates in the cache.",
                self.minter.cached(),
            ),
        ];
        for (name, help, n) in gauges {
            let g = ConstGauge::new(i64::try_from(n).unwrap_or(i64::MAX));
            g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        let g = ConstGauge::new(self.minter.ca().not_after().unix_timestamp());
        g.encode(encoder.encode_descriptor(
            "tls_ca_not_after_seconds",
            "When the interception CA in service expires (the earliest notAfter in tls.ca_cert), in seconds since the Unix epoch.",
            None,
            g.metric_type(),
        )?)?;
        Ok(())
    }
}

/// Reads the flow log's dropped-line count at scrape time.
#[derive(Debug)]
struct FlowLogSources {
    dropped: Arc<std::sync::atomic::AtomicU64>,
}

impl Collector for FlowLogSources {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let c = ConstCounter::new(self.dropped.load(std::sync::atomic::Ordering::Relaxed));
        c.encode(encoder.encode_descriptor(
            "flow_log_dropped_lines",
            "Flow-log lines not written: the writer had 65,536 lines (or 32 MiB) queued, a write failed, the file was over log.flow_log_max_bytes, or the writer did not finish within 5 s at shutdown; the flows themselves are unaffected.",
            None,
            c.metric_type(),
        )?)
    }
}
