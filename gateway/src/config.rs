//! The gateway's TOML configuration. Every key has a default, so no file is
//! needed; unknown keys and bad values stop startup with an error naming the key.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use egress_policy::{Destination, Hostname, OpaqueStreams};
use serde::{Deserialize, Deserializer, Serialize};

use crate::upstream_proxy::UpstreamProxyConfig;
pub use egress_machine::config::{
    is_cgroup_path, is_iface_name, MachineEgressConfig, MachineMatch, MachineObserve,
};

/// The whole configuration.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub state_dir: PathBuf,
    pub listen: Listen,
    pub dns: Dns,
    pub tls: Tls,
    pub policy: PolicyConfig,
    pub timeouts: Timeouts,
    pub limits: Limits,
    pub log: Log,
    pub admin: Admin,
    pub machine_egress: MachineEgressConfig,
    pub splice: Splice,
    /// The operator's HTTP CONNECT proxies for the gateway's own upstream
    /// connections (`crate::upstream_proxy`).
    pub upstream_proxy: UpstreamProxyConfig,
    pub redirect: RedirectConfig,
    /// Where host-bound credentials' values may be read.
    pub credentials: CredentialSources,
}

/// The redirect rules (`egress-gateway redirect`): the worker-wide fence,
/// and what each sandbox interface's table bounds.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RedirectConfig {
    /// Interface names or prefixes ending in `*` (`["tap*"]`) that are
    /// sandbox interfaces: the fence drops everything arriving on them
    /// until they are attached (`redirect --sandbox-iface IFACE --apply`).
    pub fence: Vec<String>,
    /// Open connections (TCP, DNS over UDP, ICMP) the host's connection
    /// tracking keeps for one source address on a sandbox interface at
    /// once; past it, that source's new connections are dropped before
    /// NAT. The table is the host's: without a bound, one sandbox's SYN or
    /// query flood fills it for every sandbox and for the gateway's own
    /// connections. Read by `redirect --apply` (re-attach to change it).
    pub max_tracked_connections: u32,
    /// Source addresses an interface's table counts at once (the size of
    /// its `tracked4` and `tracked6` sets). A new connection from a source
    /// the full set cannot take is dropped: each source counts, or none
    /// passes. Read by `redirect --apply`.
    pub max_tracked_sources: u32,
}

/// `redirect.max_tracked_connections` by default: more than one sandbox's
/// share of the default `limits.max_connections` with its DNS, a sixteenth
/// of a 262,144-entry table.
pub const DEFAULT_MAX_TRACKED: u32 = 16_384;

/// The most `redirect.max_tracked_connections` may name.
const MAX_TRACKED: u32 = 4_194_304;

/// `redirect.max_tracked_sources` by default.
pub const DEFAULT_MAX_TRACKED_SOURCES: u32 = 65_535;

/// The most `redirect.max_tracked_sources` may name.
const MAX_TRACKED_SOURCES: u32 = 1_048_576;

impl Default for RedirectConfig {
    fn default() -> Self {
        Self {
            fence: Vec::new(),
            max_tracked_connections: DEFAULT_MAX_TRACKED,
            max_tracked_sources: DEFAULT_MAX_TRACKED_SOURCES,
        }
    }
}

impl RedirectConfig {
    fn first_invalid(&self) -> Option<(&'static str, String)> {
        let n = self.max_tracked_connections;
        if !(1..=MAX_TRACKED).contains(&n) {
            let why = format!("{n}: expected 1 to {MAX_TRACKED}");
            return Some(("redirect.max_tracked_connections", why));
        }
        let n = self.max_tracked_sources;
        if !(1..=MAX_TRACKED_SOURCES).contains(&n) {
            let why = format!("{n}: expected 1 to {MAX_TRACKED_SOURCES}");
            return Some(("redirect.max_tracked_sources", why));
        }
        let bad = self.fence.iter().find(|p| !is_iface_pattern(p))?;
        let why = format!("{bad:?}: expected an interface name, or a prefix ending in '*'");
        Some(("redirect.fence", why))
    }
}

/// An interface name, or a prefix of one ending in `*` (a fence pattern).
pub fn is_iface_pattern(p: &str) -> bool {
    is_iface_name(p.strip_suffix('*').unwrap_or(p))
}

/// How spliced flows move their bytes.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Splice {
    /// `off` (the default): the gateway copies them. `on`, experimental:
    /// the kernel moves them (sockmap and an `sk_skb` program, loaded at
    /// start), or the gateway where the program cannot be loaded (said once
    /// in the log); `egress_spliced_flows_total{path}` counts each. Not for
    /// untrusted sandboxes yet: the kernel's redirect has no back-pressure
    /// of its own, and a reader that stops can make the gateway's kernel
    /// hold without bound what its peer sends (docs/architecture.md).
    /// `pipe`: `splice(2)` through a pipe per direction (bounded by TCP).
    pub kernel: KernelSplice,
}

/// See [`Splice::kernel`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KernelSplice {
    #[default]
    Off,
    On,
    /// `splice(2)` through a pipe per direction: the bytes never reach user
    /// space, and TCP's back-pressure is intact (the gateway still wakes for
    /// each burst).
    Pipe,
}

/// Where host-bound credentials' values may come from
/// (`crate::credentials`): whoever can push a sandbox names the source,
/// and the gateway reads it with its own rights, so only these are read.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct CredentialSources {
    /// Directories a `file` source must lie under once its links are
    /// resolved (absolute). Empty: no file source.
    pub files_under: Vec<PathBuf>,
    /// What an `env` source's name must start with. Empty: any name.
    pub env_prefix: String,
}

impl Default for CredentialSources {
    fn default() -> Self {
        Self {
            files_under: [
                "/run/secrets",
                "/run/credentials/egress-gateway.service",
                "/etc/egress-gateway/credentials",
            ]
            .map(PathBuf::from)
            .to_vec(),
            env_prefix: "EGRESS_CREDENTIAL_".into(),
        }
    }
}

impl Listen {
    /// Two listeners on one port (one address, or one of them on every
    /// address): a start binds one and fails on the other, but with
    /// `limits.thread_per_core` each is bound with `SO_REUSEPORT`, and the
    /// kernel would share the port between them (DNS for one resolver
    /// judged as the other's, TLS taken by the DNS listener).
    fn first_invalid(&self) -> Option<(&'static str, String)> {
        let all = [
            ("listen.transparent", self.transparent),
            ("listen.dns", self.dns),
            ("listen.dns_alt", self.dns_alt),
            ("listen.admin", self.admin),
        ];
        // Port 0 is one the kernel picks for each: no clash.
        let clash = |a: SocketAddr, b: SocketAddr| {
            a.port() != 0
                && a.port() == b.port()
                && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
        };
        for (i, (key, addr)) in all.iter().enumerate() {
            if let Some((other, _)) = all[..i].iter().find(|(_, a)| clash(*a, *addr)) {
                let why =
                    format!("{addr} is also {other}'s: each listener needs a port of its own");
                return Some((key, why));
            }
        }
        None
    }
}

impl CredentialSources {
    fn first_invalid(&self) -> Option<(&'static str, String)> {
        if let Some(dir) = self.files_under.iter().find(|d| !d.is_absolute()) {
            let why = format!("{dir:?}: expected an absolute path");
            return Some(("credentials.files_under", why));
        }
        let name_char = |c: char| c.is_ascii_alphanumeric() || c == '_';
        if !self.env_prefix.chars().all(name_char) {
            let why = format!("{:?}: expected letters, digits and '_'", self.env_prefix);
            return Some(("credentials.env_prefix", why));
        }
        None
    }
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Admin {
    /// A file holding the bearer token every admin route but `/healthz`
    /// requires. Unset: no token (bind the admin listener to loopback).
    pub token_file: Option<PathBuf>,
    /// A file holding a second token that reads `GET /metrics` and nothing
    /// else: what a scraper is given, which then cannot push policies.
    pub metrics_token_file: Option<PathBuf>,
}

#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Listen {
    /// Where the redirect sends sandbox TCP.
    pub transparent: SocketAddr,
    /// Where the redirect sends DNS for 8.8.8.8 (UDP and TCP).
    pub dns: SocketAddr,
    /// Where the redirect sends DNS for 1.1.1.1 (UDP and TCP). A redirected
    /// UDP datagram does not carry its original destination, so each
    /// reserved resolver has its own port.
    pub dns_alt: SocketAddr,
    /// Health, readiness, metrics and (later) the control API.
    pub admin: SocketAddr,
}

#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Dns {
    /// Upstream resolvers, tried in order. Empty: every query answers SERVFAIL.
    pub upstreams: Vec<SocketAddr>,
    #[serde(deserialize_with = "egress_policy::duration::deserialize")]
    pub min_ttl: Duration,
    #[serde(deserialize_with = "egress_policy::duration::deserialize")]
    pub max_ttl: Duration,
    #[serde(deserialize_with = "egress_policy::duration::deserialize")]
    pub upstream_timeout: Duration,
    /// Sandboxes with an attribution cache at once; past that, a sandbox's
    /// DNS attributes nothing (its name allows fail closed, with a warning).
    /// Also the sandboxes with DNS budgets at once (the least recently
    /// active make room).
    pub max_sandboxes: usize,
    /// Each sandbox's DNS queries per second (a burst of one second's
    /// worth); past it, REFUSED (`dns_budget`). A policy's `dns.budget`
    /// overrides it.
    pub budget_qps: u32,
    /// Each sandbox's new distinct names per minute (a burst of one
    /// minute's worth): what a name-encoding channel spends.
    pub budget_new_names_per_minute: u32,
    /// The most queries per second a policy's `dns.budget` may give its
    /// sandbox: the policy is pushed for a tenant, the ceiling is the
    /// operator's. Below `budget_qps`, `budget_qps` is the ceiling (so a
    /// configuration from before the ceilings keeps its meaning).
    pub budget_max_qps: u32,
    /// The most new names per minute a policy's `dns.budget` may give.
    pub budget_max_new_names_per_minute: u32,
    /// DoH servers refused as `encrypted_dns` unless a policy allows them by
    /// name, besides the built-in list (`egress_gateway::doh::BUILTIN_DOH_NAMES`).
    #[serde(deserialize_with = "hostnames")]
    pub doh_names: Vec<Hostname>,
}

#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Tls {
    /// The interception CA; both or neither. Neither: one is created in
    /// `state_dir`. `ca_cert` may hold a chain: the worker's intermediate
    /// first (the one `ca_key` belongs to), then further intermediates, then
    /// optionally the fleet root (not served). Read again on SIGHUP.
    pub ca_cert: Option<PathBuf>,
    pub ca_key: Option<PathBuf>,
    /// PEM files trusted, besides the built-in web roots, when verifying origins.
    pub extra_upstream_roots: Vec<PathBuf>,
    /// How long one leaf key signs minted leaves (default `24h`, from `1m`
    /// to `30d`): the first mint after that makes a new key.
    #[serde(deserialize_with = "egress_policy::duration::deserialize")]
    pub leaf_key_lifetime: Duration,
    /// Which library seals and opens TLS 1.3 AES-GCM records: `auto`
    /// (aws-lc-rs where its AVX-512 path runs, ring elsewhere),
    /// `aws-lc-rs` or `ring` ([`crate::aes_gcm`]).
    pub aes_gcm: crate::aes_gcm::AesGcm,
}

#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyConfig {
    /// Destinations no sandbox may reach. Defaults to the built-in list
    /// (loopback, link-local and metadata, private ranges, …); the
    /// gateway's own listen addresses are always added.
    pub platform_deny: Vec<Destination>,
    /// Streams the gateway cannot read (neither TLS nor HTTP): `allow` (an
    /// allow lets them through, the seed's meaning) or `deny` (only where an
    /// allow entry's `streams` names their protocol).
    pub opaque_streams: OpaqueStreams,
}

#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Timeouts {
    /// Longest wait for the first bytes that classify a flow.
    #[serde(deserialize_with = "egress_policy::duration::deserialize")]
    pub peek: Duration,
    #[serde(deserialize_with = "egress_policy::duration::deserialize")]
    pub connect: Duration,
    #[serde(deserialize_with = "egress_policy::duration::deserialize")]
    pub tls_handshake: Duration,
    /// A spliced or intercepted flow with no bytes either way for this long is closed.
    #[serde(deserialize_with = "egress_policy::duration::deserialize")]
    pub idle: Duration,
    /// An HTTP/1 request head (after termination, or on plain HTTP) must
    /// arrive whole within this, counted from the moment the connection
    /// waits for it: a client that trickles a head, or keeps a keep-alive
    /// connection idle, is closed.
    #[serde(deserialize_with = "egress_policy::duration::deserialize")]
    pub request_head: Duration,
    /// On SIGTERM/SIGINT, how long open flows may take to finish.
    #[serde(deserialize_with = "egress_policy::duration::deserialize")]
    pub drain: Duration,
}

#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Most bytes read to classify a flow (a post-quantum ClientHello is ~2 KB).
    pub peek_bytes: usize,
    /// Largest request head accepted after termination and on plain HTTP:
    /// the whole HTTP/1.1 head, or the HTTP/2 header list. Larger: `431`.
    pub max_request_head: usize,
    /// Flows handled at once; further connections are closed at once.
    pub max_connections: usize,
    /// Leaf certificates kept.
    pub leaf_cache: u64,
    /// Threads that serve flows; 0 (the default): one per CPU the process may
    /// run on. Each extra thread costs cross-thread wake-ups: on a worker
    /// where the gateway shares a couple of cores with the sandboxes, 1 costs
    /// 10–20% less CPU per request (benches/RESULTS.md).
    pub worker_threads: usize,
    /// `false` (the default): one work-stealing runtime with
    /// `worker_threads` threads and one listener of each kind. `true`: one
    /// single-threaded runtime per worker thread, each with its own
    /// `SO_REUSEPORT` transparent and DNS listeners and its own upstream
    /// pool, so a flow's tasks never cross threads; the control API runs on
    /// a thread of its own.
    pub thread_per_core: bool,
    /// Budget states (one per sandbox and `budgets` entry in use) this
    /// gateway keeps; past it a flow or request that needs a new one is
    /// refused `budget_exceeded` (fail closed) unless a refilled state can
    /// be forgotten ([`crate::budget`]).
    pub max_budget_states: usize,
    /// Sandboxes registered at once: a push or a resync that would register
    /// more is refused (`409`, naming this), so a controller's runaway
    /// cannot grow the registry without bound. What the state directory
    /// holds at start is recovered whatever this says.
    pub max_sandboxes: usize,
}

#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Log {
    /// `stdout`, `off`, or a file path: one JSON line per flow.
    pub flow_log: String,
    /// A file flow log's size past which lines are dropped (and counted in
    /// `egress_flow_log_dropped_lines_total`) until it is rotated: a
    /// sandbox opening connections in a loop cannot fill the disk the
    /// gateway's state shares.
    pub flow_log_max_bytes: u64,
}

impl Default for Log {
    fn default() -> Self {
        Self {
            flow_log: "stdout".into(),
            flow_log_max_bytes: 4 << 30,
        }
    }
}

/// The smallest cap `log.flow_log_max_bytes` may set.
const MIN_FLOW_LOG_BYTES: u64 = 1 << 20;

/// Why the configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{path}: {key}: {message}")]
    Invalid {
        path: PathBuf,
        key: &'static str,
        message: String,
    },
}

// === defaults ===

impl Default for Config {
    fn default() -> Self {
        Self {
            state_dir: PathBuf::from("./.egress-gateway"),
            listen: Listen::default(),
            dns: Dns::default(),
            tls: Tls::default(),
            policy: PolicyConfig::default(),
            timeouts: Timeouts::default(),
            limits: Limits::default(),
            log: Log::default(),
            admin: Admin::default(),
            machine_egress: MachineEgressConfig::default(),
            splice: Splice::default(),
            redirect: RedirectConfig::default(),
            upstream_proxy: UpstreamProxyConfig::default(),
            credentials: CredentialSources::default(),
        }
    }
}

impl Default for Listen {
    fn default() -> Self {
        Self {
            transparent: ([0, 0, 0, 0], 15001).into(),
            dns: ([0, 0, 0, 0], 15053).into(),
            dns_alt: ([0, 0, 0, 0], 15054).into(),
            admin: ([127, 0, 0, 1], 15000).into(),
        }
    }
}

impl Default for Dns {
    fn default() -> Self {
        Self {
            upstreams: Vec::new(),
            min_ttl: Duration::from_secs(30),
            max_ttl: Duration::from_secs(24 * 3600),
            upstream_timeout: Duration::from_secs(2),
            // As many as `limits.max_sandboxes` registers.
            max_sandboxes: 65_536,
            budget_qps: 500,
            budget_new_names_per_minute: 1_000,
            budget_max_qps: 5_000,
            budget_max_new_names_per_minute: 10_000,
            doh_names: Vec::new(),
        }
    }
}

impl Dns {
    /// The first DNS budget key out of range.
    fn invalid_budget(&self) -> Option<(&'static str, String)> {
        let max = egress_policy::dns::MAX_RATE;
        let keys = [
            ("dns.budget_qps", self.budget_qps),
            ("dns.budget_max_qps", self.budget_max_qps),
            (
                "dns.budget_new_names_per_minute",
                self.budget_new_names_per_minute,
            ),
            (
                "dns.budget_max_new_names_per_minute",
                self.budget_max_new_names_per_minute,
            ),
        ];
        for (key, n) in keys {
            if !(1..=max).contains(&n) {
                return Some((key, format!("{n} is outside 1..={max}")));
            }
        }
        None
    }

    /// The most a policy's `dns.budget` gives: each ceiling, or the
    /// default when that is higher.
    pub fn budget_ceiling(&self) -> (u32, u32) {
        (
            self.budget_max_qps.max(self.budget_qps),
            self.budget_max_new_names_per_minute
                .max(self.budget_new_names_per_minute),
        )
    }
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            platform_deny: egress_policy::default_denies(),
            opaque_streams: OpaqueStreams::Allow,
        }
    }
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            peek: Duration::from_secs(5),
            connect: Duration::from_secs(10),
            tls_handshake: Duration::from_secs(10),
            idle: Duration::from_secs(300),
            request_head: Duration::from_secs(60),
            drain: Duration::from_secs(30),
        }
    }
}

impl Limits {
    fn first_invalid(&self) -> Option<(&'static str, String)> {
        // Past a megabyte a flow that never completes its first bytes
        // (a head with no end) holds that much, and each read classifies
        // the whole buffer again.
        if !(512..=MAX_PEEK_BYTES).contains(&self.peek_bytes) {
            return Some((
                "limits.peek_bytes",
                format!(
                    "{} is outside 512..={MAX_PEEK_BYTES} bytes",
                    self.peek_bytes
                ),
            ));
        }
        if !(MIN_REQUEST_HEAD..=MAX_REQUEST_HEAD).contains(&self.max_request_head) {
            let why = format!(
                "{} is outside {MIN_REQUEST_HEAD}..={MAX_REQUEST_HEAD} bytes",
                self.max_request_head
            );
            return Some(("limits.max_request_head", why));
        }
        if !(MIN_BUDGET_STATES..=MAX_BUDGET_STATES).contains(&self.max_budget_states) {
            let why = format!(
                "{} is outside {MIN_BUDGET_STATES}..={MAX_BUDGET_STATES}",
                self.max_budget_states
            );
            return Some(("limits.max_budget_states", why));
        }
        if !(1..=MAX_SANDBOXES).contains(&self.max_sandboxes) {
            let why = format!("{} is outside 1..={MAX_SANDBOXES}", self.max_sandboxes);
            return Some(("limits.max_sandboxes", why));
        }
        // Past a million the semaphore's permits (and the drain, which
        // takes them all at once) stop meaning what they say.
        if !(1..=MAX_CONNECTIONS).contains(&self.max_connections) {
            let why = format!("{} is outside 1..={MAX_CONNECTIONS}", self.max_connections);
            return Some(("limits.max_connections", why));
        }
        if self.leaf_cache == 0 {
            let why = "0 would keep no leaf: every handshake would mint one".into();
            return Some(("limits.leaf_cache", why));
        }
        if self.leaf_cache > MAX_LEAF_CACHE {
            let why = format!(
                "{} is more than {MAX_LEAF_CACHE} (a leaf with its chain is a few KiB)",
                self.leaf_cache
            );
            return Some(("limits.leaf_cache", why));
        }
        if self.worker_threads > 1_024 {
            let why = format!("{} is more than 1024", self.worker_threads);
            return Some(("limits.worker_threads", why));
        }
        None
    }
}

/// The longest any duration of the configuration may be (a week): longer
/// than any wait or answer lifetime an operator means, and far below what
/// would overflow a clock reading.
pub const MAX_DURATION: Duration = Duration::from_secs(7 * 86_400);

/// The most sandboxes `dns.max_sandboxes` may name: its budget tables are
/// allocated for that many at start.
const MAX_DNS_SANDBOXES: usize = 1 << 20;

/// The most flows `limits.max_connections` may allow at once.
const MAX_CONNECTIONS: usize = 1 << 20;

/// The most sandboxes `limits.max_sandboxes` may allow.
const MAX_SANDBOXES: usize = 1 << 22;

/// Shorter leaf key lifetimes would mint most leaves twice for nothing: a
/// key that signs for less than a minute protects nothing a minute would not.
const MIN_LEAF_KEY_LIFETIME: Duration = Duration::from_secs(60);
/// A month: past that the key is effectively the process's, as before.
const MAX_LEAF_KEY_LIFETIME: Duration = Duration::from_secs(30 * 86_400);

impl Tls {
    fn first_invalid(&self) -> Option<(&'static str, String)> {
        if self.ca_cert.is_some() != self.ca_key.is_some() {
            let why = "tls.ca_cert and tls.ca_key go together: set both or neither";
            return Some(("tls.ca_cert", why.into()));
        }
        let lifetime = self.leaf_key_lifetime;
        if !(MIN_LEAF_KEY_LIFETIME..=MAX_LEAF_KEY_LIFETIME).contains(&lifetime) {
            let why = format!("{lifetime:?} is outside 1m..=30d");
            return Some(("tls.leaf_key_lifetime", why));
        }
        None
    }
}

impl Default for Tls {
    fn default() -> Self {
        Self {
            ca_cert: None,
            ca_key: None,
            extra_upstream_roots: Vec::new(),
            leaf_key_lifetime: Duration::from_secs(24 * 3600),
            aes_gcm: crate::aes_gcm::AesGcm::Auto,
        }
    }
}

/// The smallest head bound hyper's HTTP/1 server accepts.
const MIN_REQUEST_HEAD: usize = 8 * 1024;
/// Heads larger than this are a memory risk, not a request.
const MAX_REQUEST_HEAD: usize = 1024 * 1024;
const MAX_PEEK_BYTES: usize = 1024 * 1024;
const MAX_LEAF_CACHE: u64 = 1_000_000;
/// Budget states: one per shard at least; at most 16 Mi (about 1 GiB).
const MIN_BUDGET_STATES: usize = 16;
const MAX_BUDGET_STATES: usize = 1 << 24;

impl Limits {
    /// The worker threads: `worker_threads`, or with 0 one per CPU the
    /// process may run on (1 when that cannot be read).
    pub fn threads(&self) -> usize {
        match self.worker_threads {
            0 => std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
            n => n,
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            peek_bytes: 16 * 1024,
            max_request_head: 64 * 1024,
            max_connections: 10_000,
            leaf_cache: 10_000,
            worker_threads: 0,
            thread_per_core: false,
            max_budget_states: 65_536,
            max_sandboxes: 65_536,
        }
    }
}

// === loading ===

/// What `egress-gateway redirect` reads of the file: `[listen]`,
/// `[redirect]` and the DNS budget keys of `[dns]`, validated; every other
/// key is left to the gateway. The
/// fence and each interface's table are installed at boot from the same
/// file the gateway reads, and a mistake elsewhere in it (a typo under
/// `[limits]`, a key only a newer build knows) must not leave the sandbox
/// interfaces unfenced.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct RedirectView {
    pub listen: Listen,
    pub redirect: RedirectConfig,
    pub dns: DnsRateView,
}

/// The keys of `[dns]` an interface's rules are written with: the most DNS
/// datagrams a second one source may send ([`crate::redirect::Tracking`]).
/// Its other keys are the gateway's alone.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default)]
pub struct DnsRateView {
    pub budget_qps: u32,
    pub budget_max_qps: u32,
}

impl Default for DnsRateView {
    fn default() -> Self {
        let dns = Dns::default();
        Self {
            budget_qps: dns.budget_qps,
            budget_max_qps: dns.budget_max_qps,
        }
    }
}

impl DnsRateView {
    /// The most queries a second a policy's DNS budget gives, as
    /// [`Dns::budget_ceiling`] reads it.
    pub fn ceiling(&self) -> u32 {
        self.budget_max_qps.max(self.budget_qps)
    }

    fn first_invalid(&self) -> Option<(&'static str, String)> {
        let max = egress_policy::dns::MAX_RATE;
        [
            ("dns.budget_qps", self.budget_qps),
            ("dns.budget_max_qps", self.budget_max_qps),
        ]
        .into_iter()
        .find(|(_, n)| !(1..=max).contains(n))
        .map(|(key, n)| (key, format!("{n} is outside 1..={max}")))
    }
}

/// What `egress-gateway redirect --fence` reads of the file: `[redirect]`
/// alone. The fence needs no port, so a mistake under `[listen]` does not
/// leave the sandbox interfaces unfenced either (a file that is not TOML
/// at all still does: `run --check` before a restart says so).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
struct FenceView {
    redirect: RedirectConfig,
}

impl RedirectView {
    /// Reads `[listen]` and `[redirect]` of a TOML file and validates them.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let view: Self = read_toml(path)?;
        view.checked(path)
    }

    /// Reads `[redirect]` of a TOML file alone and validates it (the
    /// fence's view): `[listen]` is left at its defaults.
    pub fn load_fence(path: &Path) -> Result<Self, ConfigError> {
        let view: FenceView = read_toml(path)?;
        Self {
            redirect: view.redirect,
            ..Self::default()
        }
        .checked(path)
    }

    fn checked(self, path: &Path) -> Result<Self, ConfigError> {
        let view = self;
        match view
            .redirect
            .first_invalid()
            .or_else(|| view.dns.first_invalid())
        {
            Some((key, message)) => Err(ConfigError::Invalid {
                path: path.to_owned(),
                key,
                message,
            }),
            None => Ok(view),
        }
    }
}

/// A TOML file read as `T`, the error naming the file.
fn read_toml<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    toml::from_str(&text).map_err(|e| ConfigError::Parse {
        path: path.to_owned(),
        message: e.to_string().trim_end().replace('\n', " "),
    })
}

impl Config {
    /// Reads and validates a TOML file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// Parses and validates TOML text; `path` only names the source in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let config: Self = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            message: e.to_string().trim_end().replace('\n', " "),
        })?;
        config.validate(path)?;
        Ok(config)
    }

    fn validate(&self, path: &Path) -> Result<(), ConfigError> {
        self.first_invalid().map_or(Ok(()), |(key, message)| {
            Err(ConfigError::Invalid {
                path: path.to_owned(),
                key,
                message,
            })
        })
    }

    /// The first key whose value is refused, and why.
    fn first_invalid(&self) -> Option<(&'static str, String)> {
        if self.dns.min_ttl > self.dns.max_ttl {
            let (min, max) = (self.dns.min_ttl, self.dns.max_ttl);
            return Some((
                "dns.min_ttl",
                format!("{min:?} is longer than dns.max_ttl {max:?}"),
            ));
        }
        if self.dns.max_sandboxes == 0 {
            return Some((
                "dns.max_sandboxes",
                "0 would attribute no sandbox's DNS: at least 1".into(),
            ));
        }
        if let Some(invalid) = self.dns.invalid_budget() {
            return Some(invalid);
        }
        if let Some(invalid) = self.tls.first_invalid() {
            return Some(invalid);
        }
        // Zero would wait for nothing; a TTL floor, the TTL ceiling and the
        // drain may be zero.
        let may_be_zero = ["dns.min_ttl", "dns.max_ttl", "timeouts.drain"];
        for (key, d) in self.durations() {
            if d.is_zero() && !may_be_zero.contains(&key) {
                return Some((key, "must be longer than zero".into()));
            }
        }
        if let Some(invalid) = self.longest_waits().or_else(|| self.sizes()) {
            return Some(invalid);
        }
        if let Some(up) = self
            .dns
            .upstreams
            .iter()
            .find(|u| is_reserved_resolver(u.ip()))
        {
            let why = format!(
                "{up} is a reserved resolver the gateway intercepts; name the resolver behind it"
            );
            return Some(("dns.upstreams", why));
        }
        self.listen
            .first_invalid()
            .or_else(|| self.limits.first_invalid())
            .or_else(|| self.machine_egress.first_invalid())
            .or_else(|| self.redirect.first_invalid())
            .or_else(|| self.upstream_proxy.first_invalid())
            .or_else(|| self.credentials.first_invalid())
            .or_else(|| self.admin_invalid())
    }

    /// A size out of its bounds: the DNS tables sized at start, the flow
    /// log's cap.
    fn sizes(&self) -> Option<(&'static str, String)> {
        if self.dns.max_sandboxes > MAX_DNS_SANDBOXES {
            let why = format!(
                "{} is more than {MAX_DNS_SANDBOXES} (its tables are sized at start)",
                self.dns.max_sandboxes
            );
            return Some(("dns.max_sandboxes", why));
        }
        let target = self.log.flow_log.as_str();
        if !matches!(target, "stdout" | "off") && !std::path::Path::new(target).is_absolute() {
            let why = format!(
                "{target:?}: expected \"stdout\", \"off\" or an absolute file path (a relative one would be opened against the working directory)"
            );
            return Some(("log.flow_log", why));
        }
        if self.log.flow_log_max_bytes < MIN_FLOW_LOG_BYTES {
            let why = format!(
                "{} is below {MIN_FLOW_LOG_BYTES} bytes",
                self.log.flow_log_max_bytes
            );
            return Some(("log.flow_log_max_bytes", why));
        }
        None
    }

    /// Every duration of the configuration but the TLS ones, by key.
    fn durations(&self) -> [(&'static str, Duration); 9] {
        [
            ("dns.min_ttl", self.dns.min_ttl),
            ("dns.max_ttl", self.dns.max_ttl),
            ("dns.upstream_timeout", self.dns.upstream_timeout),
            ("timeouts.peek", self.timeouts.peek),
            ("timeouts.connect", self.timeouts.connect),
            ("timeouts.tls_handshake", self.timeouts.tls_handshake),
            ("timeouts.idle", self.timeouts.idle),
            ("timeouts.request_head", self.timeouts.request_head),
            ("timeouts.drain", self.timeouts.drain),
        ]
    }

    /// A duration past [`MAX_DURATION`]: added to a clock reading, a value
    /// near `u64::MAX` seconds would panic where it is used, not here.
    fn longest_waits(&self) -> Option<(&'static str, String)> {
        self.durations()
            .into_iter()
            .find(|(_, d)| *d > MAX_DURATION)
            .map(|(key, d)| (key, format!("{d:?} is longer than 7d")))
    }

    /// An admin listener off loopback without a token: anyone who reaches
    /// it could push policies.
    fn admin_invalid(&self) -> Option<(&'static str, String)> {
        let admin = self.listen.admin;
        if admin.ip().is_loopback() || self.admin.token_file.is_some() {
            return None;
        }
        let why = format!(
            "unset while listen.admin {admin} is not a loopback address: anyone who reaches it could push policies; set a token file, or listen on 127.0.0.1"
        );
        Some(("admin.token_file", why))
    }

    /// The CA files: configured, or `None` for one created in `state_dir`.
    pub fn ca_paths(&self) -> Option<egress_certs::CaPaths> {
        match (&self.tls.ca_cert, &self.tls.ca_key) {
            (Some(cert), Some(key)) => Some(egress_certs::CaPaths {
                cert: cert.clone(),
                key: key.clone(),
            }),
            _ => None,
        }
    }
}

/// A reserved resolver however it is written (`::ffff:8.8.8.8` and
/// `64:ff9b::808:808` reach it too).
fn is_reserved_resolver(ip: IpAddr) -> bool {
    let ip = egress_policy::embedded_ipv4(ip).map_or(ip.to_canonical(), IpAddr::V4);
    egress_policy::RESERVED_RESOLVERS.contains(&ip)
}

fn hostnames<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Hostname>, D::Error> {
    Vec::<String>::deserialize(d)?
        .iter()
        .map(|s| {
            Hostname::parse(s)
                .map_err(|e| serde::de::Error::custom(format!("invalid hostname {s:?}: {e}")))
        })
        .collect()
}

// === reload ===

/// What SIGHUP changes, for new flows: timeouts and the per-flow limits.
#[derive(Clone, Debug, PartialEq)]
pub struct Live {
    pub timeouts: Timeouts,
    pub peek_bytes: usize,
    pub max_request_head: usize,
}

/// What a running gateway keeps until it restarts: listeners, resolvers,
/// certificates, platform denies, the admin token, sizes fixed at start and
/// the flow log. Its field names are the configuration keys, so a reload
/// names what it could not apply from this type alone.
#[derive(Debug, PartialEq, Serialize)]
struct RestartOnly<'a> {
    state_dir: &'a Path,
    listen: &'a Listen,
    dns: &'a Dns,
    tls: &'a Tls,
    policy: &'a PolicyConfig,
    admin: &'a Admin,
    limits: RestartLimits,
    log: &'a Log,
    machine_egress: &'a MachineEgressConfig,
    splice: &'a Splice,
    upstream_proxy: &'a UpstreamProxyConfig,
    /// The fence only: the redirect's bound is read when an interface is
    /// attached, not by the running gateway.
    redirect: FenceOnly<'a>,
    credentials: &'a CredentialSources,
}

#[derive(Debug, PartialEq, Serialize)]
struct FenceOnly<'a> {
    fence: &'a [String],
}

#[derive(Debug, PartialEq, Serialize)]
struct RestartLimits {
    max_connections: usize,
    max_budget_states: usize,
    max_sandboxes: usize,
    leaf_cache: u64,
    worker_threads: usize,
    thread_per_core: bool,
}

impl Config {
    /// The part SIGHUP applies.
    pub fn live(&self) -> Live {
        Live {
            timeouts: self.timeouts.clone(),
            peek_bytes: self.limits.peek_bytes,
            max_request_head: self.limits.max_request_head,
        }
    }

    fn restart_only(&self) -> RestartOnly<'_> {
        RestartOnly {
            state_dir: &self.state_dir,
            listen: &self.listen,
            dns: &self.dns,
            tls: &self.tls,
            policy: &self.policy,
            admin: &self.admin,
            limits: RestartLimits {
                max_connections: self.limits.max_connections,
                max_budget_states: self.limits.max_budget_states,
                max_sandboxes: self.limits.max_sandboxes,
                leaf_cache: self.limits.leaf_cache,
                worker_threads: self.limits.worker_threads,
                thread_per_core: self.limits.thread_per_core,
            },
            log: &self.log,
            machine_egress: &self.machine_egress,
            splice: &self.splice,
            upstream_proxy: &self.upstream_proxy,
            redirect: FenceOnly {
                fence: &self.redirect.fence,
            },
            credentials: &self.credentials,
        }
    }

    /// This configuration with `live` in force.
    fn with_live(&self, live: Live) -> Self {
        let mut next = self.clone();
        next.timeouts = live.timeouts;
        next.limits.peek_bytes = live.peek_bytes;
        next.limits.max_request_head = live.max_request_head;
        next
    }

    /// What a running gateway on `self` becomes when `next` is loaded: `next`'s
    /// live part, `self`'s restart-only part; and the restart-only keys that
    /// differ (e.g. `listen.admin`, `limits.max_connections`), which keep
    /// their running values until a restart.
    pub fn reloaded(&self, next: &Self) -> (Self, Vec<String>) {
        let (now, then) = (self.restart_only(), next.restart_only());
        let mut restart = Vec::new();
        if now != then {
            let as_value = |r: &RestartOnly<'_>| serde_json::to_value(r).unwrap_or_default();
            changed_keys("", &as_value(&now), &as_value(&then), &mut restart);
        }
        (self.with_live(next.live()), restart)
    }
}

/// The dotted keys whose values differ between two JSON trees.
fn changed_keys(prefix: &str, a: &serde_json::Value, b: &serde_json::Value, out: &mut Vec<String>) {
    match (a, b) {
        (serde_json::Value::Object(x), serde_json::Value::Object(y)) => {
            for (key, va) in x {
                let path = if prefix.is_empty() {
                    key.clone()
                } else {
                    format!("{prefix}.{key}")
                };
                let vb = y.get(key).unwrap_or(&serde_json::Value::Null);
                changed_keys(&path, va, vb, out);
            }
            // A key only the new file has (a proxy added to a map).
            for key in y.keys().filter(|k| !x.contains_key(*k)) {
                let path = if prefix.is_empty() {
                    key.clone()
                } else {
                    format!("{prefix}.{key}")
                };
                out.push(path);
            }
        }
        (a, b) if a != b => out.push(prefix.to_owned()),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, String> {
        Config::parse(text, Path::new("gw.toml")).map_err(|e| e.to_string())
    }

    /// `egress-gateway redirect` reads `[listen]`, `[redirect]` and the DNS
    /// budget keys, checked, and nothing else: a mistake under another key
    /// does not keep an interface from its rules.
    #[test]
    fn the_redirect_view_reads_the_dns_rate_and_nothing_else_of_dns() {
        let dir = tempfile::tempdir().expect("dir");
        let file = dir.path().join("gw.toml");
        let load = |text: &str| {
            std::fs::write(&file, text).expect("write");
            RedirectView::load(&file).map_err(|e| e.to_string())
        };
        let view = load("[dns]\nbudget_max_qps = 20\nbudget_qps = 10\nupstreams = \"not a list\"\nno_such_key = 1\n[limits]\nno_such_key = 1\n")
            .expect("loads");
        assert_eq!(view.dns.ceiling(), 20);
        assert_eq!(crate::redirect::Tracking::from(&view).dns_qps, 20);
        let full = parse("[dns]\nbudget_max_qps = 20\nbudget_qps = 30\n").expect("parses");
        assert_eq!(crate::redirect::Tracking::from(&full).dns_qps, 30);
        assert_eq!(load("").expect("defaults").dns.ceiling(), 5_000);
        let err = load("[dns]\nbudget_qps = 0\n").expect_err("refused");
        assert!(
            err.contains("dns.budget_qps") && err.contains("0 is outside"),
            "{err}"
        );
    }

    #[test]
    fn empty_file_is_the_defaults() {
        let c = parse("").expect("defaults");
        assert_eq!(c.listen.transparent.to_string(), "0.0.0.0:15001");
        assert_eq!(c.listen.dns.to_string(), "0.0.0.0:15053");
        assert_eq!(c.listen.admin.to_string(), "127.0.0.1:15000");
        assert_eq!(c.state_dir, PathBuf::from("./.egress-gateway"));
        assert_eq!(c.dns.min_ttl, Duration::from_secs(30));
        assert!(!c.policy.platform_deny.is_empty());
        assert_eq!(
            c.policy.opaque_streams,
            OpaqueStreams::Allow,
            "the seed's meaning"
        );
        assert_eq!(c.log.flow_log, "stdout");
    }

    #[test]
    fn full_file_parses() {
        let c = parse(
            r#"
            state_dir = "/var/lib/egress"
            [listen]
            transparent = "[::]:15001"
            [dns]
            upstreams = ["127.0.0.53:53", "[::1]:53"]
            min_ttl = "10s"
            max_ttl = "1h"
            [tls]
            ca_cert = "/etc/egress/ca.crt"
            ca_key = "/etc/egress/ca.key"
            extra_upstream_roots = ["/etc/egress/origin-ca.pem"]
            leaf_key_lifetime = "6h"
            aes_gcm = "ring"
            [policy]
            platform_deny = [{cidr = "169.254.0.0/16"}, {domain = "metadata.google.internal"}]
            opaque_streams = "deny"
            [timeouts]
            peek = "500ms"
            idle = "5m"
            [limits]
            peek_bytes = 8192
            worker_threads = 1
            thread_per_core = true
            [log]
            flow_log = "/var/log/egress/flows.jsonl"
            [splice]
            kernel = "pipe"
            [upstream_proxy]
            default = "corp"
            [upstream_proxy.proxies.corp]
            address = "203.0.113.8:3128"
            username = "gw"
            password_file = "/etc/egress-gateway/proxy-password"
            "#,
        )
        .expect("valid");
        assert!(c.limits.thread_per_core);
        assert_eq!(c.splice.kernel, KernelSplice::Pipe);
        assert_eq!(c.dns.upstreams.len(), 2);
        assert_eq!(c.timeouts.peek, Duration::from_millis(500));
        assert_eq!(c.policy.platform_deny.len(), 2);
        assert_eq!(c.policy.opaque_streams, OpaqueStreams::Deny);
        assert_eq!(c.limits.worker_threads, 1);
        assert!(c.ca_paths().is_some());
        assert_eq!(c.tls.leaf_key_lifetime, Duration::from_secs(6 * 3600));
        assert_eq!(c.tls.aes_gcm, crate::aes_gcm::AesGcm::Ring);
        assert_eq!(c.upstream_proxy.default.as_deref(), Some("corp"));
    }

    #[test]
    fn errors_name_the_key() {
        let cases = [
            ("[dns]\nupstream = []", "unknown field `upstream`"),
            ("[listen]\nadmin = \"localhost\"", "admin"),
            (
                "[listen]\nadmin = \"0.0.0.0:15000\"",
                "admin.token_file: unset while listen.admin 0.0.0.0:15000 is not a loopback address",
            ),
            (
                "[dns]\nmin_ttl = \"30 seconds\"",
                "invalid duration \"30 seconds\"",
            ),
            ("[dns]\nmin_ttl = \"2h\"\nmax_ttl = \"1h\"", "dns.min_ttl"),
            ("[dns]\nmax_sandboxes = 0", "dns.max_sandboxes"),
            (
                "[dns]\ndoh_names = [\"doh.corp.example\", \"not a name\"]",
                "invalid hostname \"not a name\"",
            ),
            (
                "[dns]\nbudget_qps = 0",
                "dns.budget_qps: 0 is outside 1..=1000000",
            ),
            (
                "[dns]\nbudget_new_names_per_minute = 2000000",
                "dns.budget_new_names_per_minute: 2000000 is outside",
            ),
            (
                "[dns]\nbudget_max_new_names_per_minute = 0",
                "dns.budget_max_new_names_per_minute: 0 is outside 1..=1000000",
            ),
            (
                "[dns]\nupstreams = [\"8.8.8.8:53\"]",
                "dns.upstreams: 8.8.8.8:53 is a reserved resolver",
            ),
            ("[tls]\nca_cert = \"/x\"", "tls.ca_cert"),
            (
                "[redirect]\nfence = [\"tap*\", \"t*p\"]",
                "redirect.fence: \"t*p\": expected an interface name",
            ),
            (
                "[redirect]\nmax_tracked_connections = 0",
                "redirect.max_tracked_connections: 0: expected 1 to 4194304",
            ),
            (
                "[redirect]\nmax_tracked_connections = 5000000",
                "redirect.max_tracked_connections: 5000000",
            ),
            (
                "[redirect]\nmax_tracked_sources = 0",
                "redirect.max_tracked_sources: 0: expected 1 to 1048576",
            ),
            (
                "[tls]\naes_gcm = \"openssl\"",
                "unknown variant `openssl`, expected one of `auto`, `aws-lc-rs`, `ring`",
            ),
            (
                "[tls]\nleaf_key_lifetime = \"30s\"",
                "tls.leaf_key_lifetime: 30s is outside 1m..=30d",
            ),
            (
                "[tls]\nleaf_key_lifetime = \"31d\"",
                "tls.leaf_key_lifetime: 2678400s is outside",
            ),
            (
                "[timeouts]\npeek = \"0s\"",
                "timeouts.peek: must be longer than zero",
            ),
            ("[limits]\npeek_bytes = 10", "limits.peek_bytes"),
            (
                "[limits]\npeek_bytes = 1073741824",
                "limits.peek_bytes: 1073741824 is outside 512..=1048576 bytes",
            ),
            (
                "[limits]\nleaf_cache = 100000000",
                "limits.leaf_cache: 100000000 is more than 1000000",
            ),
            (
                "[listen]\ndns = \"0.0.0.0:15053\"\ndns_alt = \"127.0.0.1:15053\"",
                "listen.dns_alt: 127.0.0.1:15053 is also listen.dns's",
            ),
            (
                "[log]\nflow_log_max_bytes = 1000",
                "log.flow_log_max_bytes: 1000 is below 1048576 bytes",
            ),
            (
                "[log]\nflow_log = \"Off\"",
                "log.flow_log: \"Off\": expected \"stdout\", \"off\" or an absolute file path",
            ),
            ("[log]\nflow_log = \"flows.jsonl\"", "log.flow_log: \"flows.jsonl\""),
            (
                "[dns]\nmax_ttl = \"18446744073709551615s\"",
                "dns.max_ttl: 18446744073709551615s is longer than 7d",
            ),
            (
                "[timeouts]\nrequest_head = \"5124095576030431h\"",
                "timeouts.request_head:",
            ),
            (
                "[timeouts]\ndrain = \"8d\"",
                "timeouts.drain: 691200s is longer than 7d",
            ),
            (
                "[dns]\nmax_sandboxes = 100000000",
                "dns.max_sandboxes: 100000000 is more than 1048576",
            ),
            (
                "[dns]\nupstreams = [\"[::ffff:8.8.8.8]:53\"]",
                "dns.upstreams: [::ffff:8.8.8.8]:53 is a reserved resolver",
            ),
            (
                "[dns]\nupstreams = [\"[64:ff9b::101:101]:53\"]",
                "dns.upstreams: [64:ff9b::101:101]:53 is a reserved resolver",
            ),
            (
                "[limits]\nmax_request_head = 4096",
                "limits.max_request_head: 4096 is outside 8192..=1048576 bytes",
            ),
            (
                "[limits]\nworker_threads = 5000",
                "limits.worker_threads: 5000 is more than 1024",
            ),
            (
                "[limits]\nmax_connections = 18446744073709551615",
                "limits.max_connections: 18446744073709551615 is outside 1..=1048576",
            ),
            (
                "[limits]\nmax_connections = 0",
                "limits.max_connections: 0 is outside 1..=1048576",
            ),
            (
                "[limits]\nmax_sandboxes = 0",
                "limits.max_sandboxes: 0 is outside 1..=4194304",
            ),
            ("[limits]\nleaf_cache = 0", "limits.leaf_cache: 0 would keep no leaf"),
            (
                "[policy]\nplatform_deny = [{cidr = \"10.0.0.1/8\"}]",
                "10.0.0.0/8",
            ),
            ("bogus = 1", "unknown field `bogus`"),
            ("[splice]\nkernel = \"fast\"", "unknown variant `fast`"),
            (
                "[policy]\nopaque_streams = \"block\"",
                "unknown variant `block`, expected `allow` or `deny`",
            ),
            ("[limits]\nthread_per_core = 2", "thread_per_core"),
            (
                "[upstream_proxy]\ndefault = \"corp\"",
                "upstream_proxy.default: \"corp\" names no proxy",
            ),
            (
                "[upstream_proxy.proxies.corp]\naddress = \"proxy.corp:3128\"",
                "invalid socket address",
            ),
        ];
        for (text, needle) in cases {
            let e = parse(text).expect_err(text);
            assert!(e.starts_with("gw.toml: "), "{e}");
            assert!(e.contains(needle), "{text}: {e} lacks {needle:?}");
        }
    }

    #[test]
    fn reload_applies_the_live_part_and_names_each_restart_only_key() {
        let now = Config::parse("", Path::new("now.toml")).expect("defaults");
        let next = Config::parse(
            r#"
            [timeouts]
            peek = "1s"
            [limits]
            max_request_head = 16384
            max_connections = 7
            [listen]
            admin = "127.0.0.1:1"
            [dns]
            upstreams = ["127.0.0.1:5353"]
            [log]
            flow_log = "off"
            [credentials]
            files_under = ["/run/credentials"]
            [redirect]
            fence = ["tap*"]
            max_tracked_connections = 99
            [upstream_proxy.proxies.lab]
            address = "127.0.0.1:3128"
            "#,
            Path::new("next.toml"),
        )
        .expect("valid");
        let (running, restart) = now.reloaded(&next);
        // The credential sources and the fence are read at start: a reload
        // that changes them says so (it said nothing before). The redirect's
        // bound is read at attach: a restart would not apply it, so it is
        // not listed.
        assert_eq!(
            restart,
            [
                "credentials.files_under",
                "dns.upstreams",
                "limits.max_connections",
                "listen.admin",
                "log.flow_log",
                "redirect.fence",
                "upstream_proxy.proxies.lab"
            ]
        );
        assert_eq!(running.live(), next.live(), "the live part is applied");
        assert_eq!(
            (
                running.listen,
                running.dns,
                running.limits.max_connections,
                running.log
            ),
            (
                now.listen.clone(),
                now.dns.clone(),
                now.limits.max_connections,
                now.log.clone()
            ),
            "restart-only keys keep their running values"
        );
        let (same, restart) = now.reloaded(&now);
        assert!(restart.is_empty());
        assert_eq!(same, now);
    }

    /// The default file sources hold the gateway unit's own systemd
    /// credentials, not every unit's: the cluster relay's copy of the admin
    /// token, another unit's keys, the system's credentials are no source.
    #[test]
    fn default_file_sources_are_not_every_units_credentials() {
        let sources = CredentialSources::default();
        let readable = |p: &str| {
            sources
                .files_under
                .iter()
                .any(|d| Path::new(p).starts_with(d))
        };
        assert!(readable("/run/credentials/egress-gateway.service/api-key"));
        for other in [
            "/run/credentials/egress-cluster-relay.service/worker.token",
            "/run/credentials/@system/passwd.hashed-password.root",
            "/run/credentials/egress-gateway.service.d/x",
        ] {
            assert!(!readable(other), "{other}");
        }
    }
}
