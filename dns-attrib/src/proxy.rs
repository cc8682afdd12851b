//! The DNS interception proxy for the reserved resolvers.
//!
//! Per query: identify the sandbox from the source address (the gateway's
//! [`QueryAdmission`]); refuse when it is unknown or its policy does not permit
//! the resolver; refuse a query over the sandbox's budgets ([`crate::budget`]);
//! answer locally what the policy's `dns` section keeps from
//! leaving ([`crate::gate`]); forward the query to the upstreams in order
//! (timeout, next upstream, TCP when the UDP answer is truncated) under an
//! ID of the gateway's own, random per query: the sandbox chose its query's
//! ID, and an answer that only had to match it could be planted by anyone
//! the sandbox told; commit what the answer attributes *before* returning
//! it, byte for byte but for the sandbox's ID put back and the `ech`
//! parameter of SVCB/HTTPS records, which is cut out ([`crate::svcb`]).
//!
//! Every wait has a timeout, in-flight queries are bounded per sandbox and in
//! total, malformed input ends in FORMERR or silence — never a panic — and a
//! UDP answer never exceeds the size the query allows.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::stream::{FuturesUnordered, StreamExt};
use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{DNSClass, RecordType};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::{Semaphore, SemaphorePermit};
use tokio::time::{timeout, Instant};

use egress_policy::{CompiledPolicy, SandboxId};

use crate::budget::{BudgetLimits, Budgets, Crossing};
use crate::cache::AttributionCache;
use crate::chain::attribution;
use crate::gate::{gate, Gate};
use crate::held::{share_with_reserve, Held, Holds};
use crate::metrics::DnsMetrics;
use crate::svcb::strip_ech;

/// The largest DNS message (TCP length prefix is 16 bits).
const MAX_MESSAGE: usize = 65_535;

/// Idle upstream UDP sockets kept per upstream.
const POOL_IDLE_MAX: usize = 64;

/// Queries one upstream UDP socket carries before it is closed, so the
/// source port keeps changing (an off-path spoofer has to guess it anew).
const SOCKET_MAX_USES: u32 = 32;

/// Most datagrams read and dropped from an idle pooled socket before a
/// query is sent on it ([`PooledSocket::drained`]); past them, it is closed.
const STALE_MAX: usize = 8;

/// The gateway's answer to "who sent this query, and may it use this resolver?".
#[derive(Clone)]
pub enum Admit {
    /// A known sandbox whose policy permits the resolver address; that
    /// policy's `dns` section judges the query.
    Allowed(SandboxId, Arc<dyn QueryRules>),
    /// A known sandbox whose policy does not: REFUSED, nothing recorded.
    Refused(SandboxId),
    /// No sandbox has this source address: REFUSED (fail closed).
    Unknown,
}

/// Implemented by the gateway: sandbox identity and policy for DNS flows.
pub trait QueryAdmission: Send + Sync + 'static {
    fn admit(&self, src: IpAddr, resolver: SocketAddr) -> Admit;
    /// Whether `src` still belongs to `sandbox`'s registration
    /// `registration` ([`QueryRules::registration`]) when its answer comes:
    /// a sandbox deleted (or the address taken from it, or the id deleted
    /// and registered again) while its query was out records nothing.
    fn holds(&self, src: IpAddr, sandbox: &SandboxId, registration: u64) -> bool;
    /// Whether `sandbox`'s registration `registration` is still registered
    /// (whatever its addresses now).
    fn registered(&self, sandbox: &SandboxId, registration: u64) -> bool;
}

/// The policy a sandbox's queries are judged by: the gateway's sandbox
/// record, handed over as it is (no copy per query).
pub trait QueryRules: Send + Sync + 'static {
    fn policy(&self) -> &CompiledPolicy;
    /// Which registration of its id this is (kept by the pushes that
    /// replace it, new once the id is deleted and registered again).
    fn registration(&self) -> u64 {
        0
    }
}

/// Proxy settings.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    /// Tried in order; the next is tried when one times out or fails.
    pub upstreams: Vec<SocketAddr>,
    /// Per attempt on one upstream (default 2 s).
    pub upstream_timeout: Duration,
    /// Queries being resolved at once, over all sandboxes (default 1,024).
    pub max_in_flight: usize,
    /// Queries being resolved at once for one sandbox (default 64).
    pub max_in_flight_per_sandbox: usize,
    /// A TCP client that sends nothing for this long is closed (default 10 s).
    pub tcp_idle_timeout: Duration,
    /// TCP client connections at once (default 256).
    pub max_tcp_connections: usize,
    /// Each sandbox's DNS budgets, unless its policy overrides them
    /// (default 500 queries per second, 1,000 new names per minute).
    pub budget: BudgetLimits,
    /// The most a policy's `dns.budget` may give its sandbox (default
    /// [`egress_policy::dns::MAX_RATE`] each): the policy is the tenant's,
    /// the ceiling the operator's.
    pub budget_ceiling: BudgetLimits,
    /// Sandboxes with budgets at once (default 16,384); the least recently
    /// active make room ([`crate::budget`]).
    pub budget_sandboxes: usize,
}

/// The transport a query arrived on, which bounds the answer's size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    Udp,
    Tcp,
}

/// The proxy: shared by its UDP and TCP listeners.
pub struct DnsProxy {
    config: ProxyConfig,
    cache: Arc<AttributionCache>,
    admission: Arc<dyn QueryAdmission>,
    metrics: Arc<DnsMetrics>,
    in_flight: Arc<Semaphore>,
    /// Shared with every [`DnsProxy::sibling`]: one table per gateway.
    budgets: Arc<Budgets>,
    /// Shared with every [`DnsProxy::sibling`], so the bound holds over all of them.
    per_sandbox: Holds<SandboxId>,
    /// DNS-over-HTTPS bodies being read, per source address (shared too):
    /// at most `max_in_flight_per_sandbox` each ([`DnsProxy::doh_read`]).
    doh_reads: Holds<IpAddr>,
    /// One per upstream, in the order of `config.upstreams`.
    sockets: Vec<SocketPool>,
}

/// Connected UDP sockets to one upstream that answered their last query
/// cleanly, reused for up to [`SOCKET_MAX_USES`] queries: creating, binding,
/// connecting, registering and closing a socket per query cost more than the
/// rest of the proxy's work (issue 8's profile).
#[derive(Default)]
struct SocketPool {
    idle: Mutex<Vec<PooledSocket>>,
}

struct PooledSocket {
    socket: UdpSocket,
    uses: u32,
    /// Room for the largest answer, kept with the socket: allocated once
    /// per socket rather than once per query, never zeroed, and only the
    /// bytes an answer fills are ever touched.
    buf: Vec<u8>,
}

/// Why no upstream answered.
#[derive(Debug, thiserror::Error)]
enum UpstreamError {
    #[error("timed out")]
    Timeout,
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("answer does not match the query")]
    Mismatch,
}

// === impl ProxyConfig ===

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            upstreams: Vec::new(),
            upstream_timeout: Duration::from_secs(2),
            max_in_flight: 1_024,
            max_in_flight_per_sandbox: 64,
            tcp_idle_timeout: Duration::from_secs(10),
            max_tcp_connections: 256,
            budget: BudgetLimits::default(),
            budget_ceiling: BudgetLimits {
                qps: egress_policy::dns::MAX_RATE,
                new_names_per_minute: egress_policy::dns::MAX_RATE,
            },
            budget_sandboxes: 16_384,
        }
    }
}

// === impl DnsProxy ===

impl DnsProxy {
    pub fn new(
        config: ProxyConfig,
        cache: Arc<AttributionCache>,
        admission: Arc<dyn QueryAdmission>,
    ) -> Arc<Self> {
        Arc::new(Self {
            in_flight: Arc::new(Semaphore::new(config.max_in_flight)),
            budgets: Arc::new(Budgets::new(config.budget_sandboxes)),
            sockets: config
                .upstreams
                .iter()
                .map(|_| SocketPool::default())
                .collect(),
            config,
            cache,
            admission,
            metrics: Arc::new(DnsMetrics::default()),
            per_sandbox: Arc::new(Mutex::new(HashMap::new())),
            doh_reads: Arc::new(Mutex::new(HashMap::new())),
        })
    }

    /// A proxy for another thread's listeners: the same cache, admission,
    /// metrics and in-flight bounds (global and per sandbox), with upstream
    /// sockets of its own, so a query is received, resolved and answered on
    /// one thread and its sockets register with that thread's runtime only.
    pub fn sibling(&self) -> Arc<Self> {
        Arc::new(Self {
            config: self.config.clone(),
            cache: self.cache.clone(),
            admission: self.admission.clone(),
            metrics: self.metrics.clone(),
            in_flight: self.in_flight.clone(),
            budgets: self.budgets.clone(),
            per_sandbox: self.per_sandbox.clone(),
            doh_reads: self.doh_reads.clone(),
            sockets: self.sockets.iter().map(|_| SocketPool::default()).collect(),
        })
    }

    /// A place for one DNS-over-HTTPS body from `src` to be read in, while
    /// it holds fewer than `max_in_flight_per_sandbox`: a query's body is
    /// read before the query can be judged, so this bounds what one
    /// sandbox's streams make the gateway hold (each body at most
    /// [`crate::doh::MAX_QUERY`] bytes). `None`: the caller refuses it.
    pub fn doh_read(&self, src: IpAddr) -> Option<Held<IpAddr>> {
        let cap = self.config.max_in_flight_per_sandbox;
        let held = Held::take(&self.doh_reads, src.to_canonical(), |_| cap);
        if held.is_none() {
            self.metrics.overloaded.inc();
        }
        held
    }

    pub fn metrics(&self) -> &Arc<DnsMetrics> {
        &self.metrics
    }

    pub fn cache(&self) -> &Arc<AttributionCache> {
        &self.cache
    }

    /// Serves UDP queries on `socket`, standing in for `resolver`, until the task is dropped.
    ///
    /// Every admitted query is answered on this task, concurrently with the
    /// others and with receiving: no task is spawned per query, so a query,
    /// its upstream exchange and its answer never leave the thread that
    /// received it. Past the in-flight bound the answer is SERVFAIL.
    pub async fn serve_udp(self: Arc<Self>, socket: UdpSocket, resolver: SocketAddr) {
        // A query larger than this is not a query a stub resolver sends; it
        // arrives cut short and answers FORMERR.
        let mut buf = vec![0u8; 4_096];
        let mut answering = FuturesUnordered::new();
        loop {
            tokio::select! {
                // Answers first: they free in-flight slots.
                biased;
                Some(()) = answering.next(), if !answering.is_empty() => {}
                received = socket.recv_from(&mut buf) => {
                    let (len, src) = match received {
                        Ok(x) => x,
                        Err(e) => {
                            // ICMP errors from earlier sends surface here on Linux; keep serving.
                            tracing::debug!(error = %e, "dns udp receive");
                            continue;
                        }
                    };
                    let query = &buf[..len];
                    let Ok(permit) = self.in_flight.try_acquire() else {
                        self.metrics.overloaded.inc();
                        if let Some(resp) = error_reply(query, ResponseCode::ServFail) {
                            let _ = socket.send_to(&resp, src).await;
                        }
                        continue;
                    };
                    answering.push(self.answer_udp(query.to_vec(), src, resolver, &socket, permit));
                }
            }
        }
    }

    /// Answers one UDP query from `src` on `socket`; the permit is its in-flight slot.
    async fn answer_udp(
        &self,
        query: Vec<u8>,
        src: SocketAddr,
        resolver: SocketAddr,
        socket: &UdpSocket,
        permit: SemaphorePermit<'_>,
    ) {
        if let Some(resp) = self
            .answer(&query, src.ip(), resolver, Transport::Udp)
            .await
        {
            let _ = socket.send_to(&resp, src).await;
        }
        drop(permit);
    }

    /// Serves DNS over TCP on `listener`, standing in for `resolver`, until
    /// the task is dropped: its connections go with it (a drain or a
    /// handover answers nothing more into a cache being exported).
    pub async fn serve_tcp(self: Arc<Self>, listener: TcpListener, resolver: SocketAddr) {
        let connections = Arc::new(Semaphore::new(self.config.max_tcp_connections));
        let per_source: Holds<IpAddr> = Arc::default();
        let mut served = tokio::task::JoinSet::new();
        loop {
            let (stream, src) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors, say: the pending connection stays
                    // queued, so back off rather than spin.
                    tracing::debug!(error = %e, "dns tcp accept failed");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            };
            while served.try_join_next().is_some() {}
            // A source no sandbox's policy lets ask this resolver holds no
            // connection: it would only ever be refused.
            if !matches!(self.admission.admit(src.ip(), resolver), Admit::Allowed(..)) {
                self.metrics.refused.inc();
                drop(stream);
                continue;
            }
            // One source may not hold every connection the listener has, nor
            // a few sources together: each its share, at most 16.
            let total = self.config.max_tcp_connections;
            let used = total.saturating_sub(connections.available_permits());
            let share =
                |holding| share_with_reserve(total, used, holding, 2, 2).min(MAX_TCP_PER_SOURCE);
            let Some(mine) = Held::take(&per_source, src.ip().to_canonical(), share) else {
                self.metrics.overloaded.inc();
                drop(stream);
                continue;
            };
            let Ok(permit) = connections.clone().try_acquire_owned() else {
                self.metrics.overloaded.inc();
                drop(stream);
                continue;
            };
            let this = self.clone();
            served.spawn(async move {
                this.serve_tcp_connection(stream, src, resolver).await;
                drop((permit, mine));
            });
        }
    }

    async fn serve_tcp_connection(
        &self,
        mut stream: TcpStream,
        src: SocketAddr,
        resolver: SocketAddr,
    ) {
        let mut len = [0u8; 2];
        loop {
            match timeout(self.config.tcp_idle_timeout, stream.read_exact(&mut len)).await {
                Ok(Ok(_)) => {}
                _ => return,
            }
            let mut query = vec![0u8; usize::from(u16::from_be_bytes(len))];
            match timeout(self.config.tcp_idle_timeout, stream.read_exact(&mut query)).await {
                Ok(Ok(_)) => {}
                _ => return,
            }
            // The proxy's place is held while the query is answered, not
            // while a slow reader takes the answer. Past the bound,
            // SERVFAIL, as on UDP: the connection, and the queries
            // pipelined behind it, go on.
            let answered = self
                .answer_bounded(&query, src.ip(), resolver, Transport::Tcp)
                .await;
            let Some(resp) = answered else {
                return;
            };
            let Some(framed) = tcp_frame(&resp) else {
                return;
            };
            if timeout(self.config.tcp_idle_timeout, stream.write_all(&framed))
                .await
                .is_err()
            {
                return;
            }
        }
    }

    /// [`answer`](Self::answer) within the proxy's bound on queries in
    /// flight, which the UDP and TCP listeners take before they call it
    /// (for a transport that has none of its own: DNS over HTTPS). Past the
    /// bound, SERVFAIL.
    pub async fn answer_bounded(
        &self,
        raw: &[u8],
        src: IpAddr,
        resolver: SocketAddr,
        transport: Transport,
    ) -> Option<Vec<u8>> {
        let Ok(_permit) = self.in_flight.try_acquire() else {
            self.metrics.overloaded.inc();
            return error_reply(raw, ResponseCode::ServFail);
        };
        self.answer(raw, src, resolver, transport).await
    }

    /// Answers one query from `src`; `None` means send nothing.
    pub async fn answer(
        &self,
        raw: &[u8],
        src: IpAddr,
        resolver: SocketAddr,
        transport: Transport,
    ) -> Option<Vec<u8>> {
        self.metrics.queries.inc();
        let query = match self.parse_query(raw) {
            Ok(q) => q,
            Err(reply) => return reply,
        };
        // `parse_query` admits exactly one question.
        let question = query.queries.first()?;
        let (sandbox, registration) = match self.judge(&query, question, src, resolver) {
            Ok(judged) => judged,
            Err(reply) => return reply,
        };
        let Some(_slot) = Held::take(&self.per_sandbox, sandbox.clone(), |n| self.fair_share(n))
        else {
            self.metrics.overloaded.inc();
            return reply(&query, ResponseCode::ServFail);
        };
        let Some((bytes, answer)) = self.forward(raw, &query, question).await else {
            self.metrics.servfail.inc();
            return reply(&query, ResponseCode::ServFail);
        };
        // Deleted while its query was out: nothing is recorded under an id
        // that may come back as another sandbox, and the address, which
        // may be another's now, is refused.
        if !self.admission.holds(src, &sandbox, registration) {
            self.metrics.refused.inc();
            return reply(&query, ResponseCode::Refused);
        }
        let delivered = self.deliver(&query, &sandbox, bytes, answer, transport);
        // Deleted between the check and the record: the cache the record
        // may have made again for its id goes (an id that comes back
        // starts with no evidence). Only the address moved: its evidence
        // stands, the answer is refused.
        if !self.admission.holds(src, &sandbox, registration) {
            if !self.admission.registered(&sandbox, registration) {
                self.cache.remove_sandbox(&sandbox);
            }
            self.metrics.refused.inc();
            return reply(&query, ResponseCode::Refused);
        }
        delivered
    }

    /// Queries one sandbox may have being resolved at once: the configured
    /// bound, or under contention the sandbox's fair share of the proxy's
    /// (never below [`MIN_SHARE`]), and in the last eighth no more than
    /// [`MIN_SHARE`] ([`share_with_reserve`]): a few sandboxes at their bound could
    /// otherwise take every place and leave the others' queries none. A
    /// sandbox over its share keeps what it holds and takes no more until
    /// it is under it. `holding`: the sandboxes with queries in flight.
    fn fair_share(&self, holding: usize) -> usize {
        let total = self.config.max_in_flight;
        // The query's own place is taken already.
        let used = total.saturating_sub(self.in_flight.available_permits());
        let share = share_with_reserve(total, used, holding, MIN_SHARE, MIN_SHARE);
        self.config.max_in_flight_per_sandbox.min(share)
    }

    /// Admission, the sandbox's budgets and its policy's `dns` section: the
    /// sandbox whose query may leave, or the reply that ends it. A query
    /// spends a query token; only a query that would leave spends a
    /// new-name token (names answered here tell no one anything).
    fn judge(
        &self,
        query: &Message,
        question: &Query,
        src: IpAddr,
        resolver: SocketAddr,
    ) -> Result<(SandboxId, u64), Option<Vec<u8>>> {
        let (sandbox, rules) = match self.admission.admit(src, resolver) {
            Admit::Allowed(id, rules) => (id, rules),
            Admit::Refused(_) | Admit::Unknown => {
                self.metrics.refused.inc();
                return Err(reply(query, ResponseCode::Refused));
            }
        };
        let policy = rules.policy();
        let limits = self.limits(policy);
        let now = self.cache.now();
        let over = |c| self.over_budget(query, &sandbox, c);
        self.budgets.query(&sandbox, limits, now).map_err(over)?;
        if let Some(local) = self.local_answer(query, question, &sandbox, policy) {
            return Err(local);
        }
        let over = |c| self.over_budget(query, &sandbox, c);
        let asked = (&question.name, question_variant(query, question));
        self.budgets
            .question(&sandbox, asked, limits, now)
            .map_err(over)?;
        Ok((sandbox, rules.registration()))
    }

    /// The operator's budgets, with the policy's overrides up to the
    /// operator's ceilings.
    fn limits(&self, policy: &CompiledPolicy) -> BudgetLimits {
        let mut limits = self.config.budget;
        let ceiling = self.config.budget_ceiling;
        if let Some(b) = policy.policy().dns.as_ref().and_then(|d| d.budget.as_ref()) {
            if let Some(qps) = b.qps {
                limits.qps = qps.get().min(ceiling.qps);
            }
            if let Some(n) = b.new_names_per_minute {
                limits.new_names_per_minute = n.get().min(ceiling.new_names_per_minute);
            }
        }
        limits
    }

    /// REFUSED for a query over budget (`dns_budget`), logged when the
    /// sandbox crosses the budget, not for every query past it.
    fn over_budget(&self, query: &Message, sandbox: &SandboxId, c: Crossing) -> Option<Vec<u8>> {
        self.metrics.budget_refused.inc();
        if c.first {
            tracing::warn!(%sandbox, reason = "dns_budget", budget = c.over.code(), "DNS over budget: REFUSED until the budget refills");
        }
        reply(query, ResponseCode::Refused)
    }

    /// The proxy's own answer when the policy's `dns` section keeps the
    /// query from leaving ([`crate::gate`]); `None`: forward it.
    fn local_answer(
        &self,
        query: &Message,
        question: &Query,
        sandbox: &SandboxId,
        policy: &CompiledPolicy,
    ) -> Option<Option<Vec<u8>>> {
        let (code, reason) = match gate(policy, question) {
            Gate::Forward => return None,
            Gate::Refuse(reason) => {
                self.metrics.policy_refused.inc();
                (ResponseCode::Refused, reason)
            }
            Gate::NxDomain(reason) => {
                self.metrics.policy_nxdomain.inc();
                (ResponseCode::NXDomain, reason)
            }
        };
        tracing::debug!(%sandbox, name = %question.name, qtype = %question.query_type, reason, "dns query answered by policy");
        Some(reply(query, code))
    }

    /// The query in `raw`, or the reply (perhaps none) that ends it: it
    /// must parse, be a query with opcode QUERY and carry one question.
    fn parse_query(&self, raw: &[u8]) -> Result<Message, Option<Vec<u8>>> {
        let Ok(query) = Message::from_vec(raw) else {
            self.metrics.formerr.inc();
            return Err(error_reply(raw, ResponseCode::FormErr));
        };
        if query.metadata.message_type != MessageType::Query {
            return Err(None); // a response sent to us: never answer it (no reflection loops)
        }
        if query.metadata.op_code != OpCode::Query {
            return Err(reply(&query, ResponseCode::NotImp));
        }
        if query.queries.len() != 1 {
            self.metrics.formerr.inc();
            return Err(reply(&query, ResponseCode::FormErr));
        }
        Ok(query)
    }

    /// An upstream's answer on its way to the sandbox: `ech` stripped (or
    /// SERVFAIL when that cannot be done faithfully), what it attributes
    /// committed, cut to the size a UDP query allows.
    fn deliver(
        &self,
        query: &Message,
        sandbox: &SandboxId,
        bytes: Vec<u8>,
        answer: Message,
        transport: Transport,
    ) -> Option<Vec<u8>> {
        let (bytes, answer) = match strip_ech(&answer) {
            Ok(None) => (bytes, answer),
            Ok(Some(stripped)) => {
                self.metrics.ech_stripped.inc();
                (stripped.bytes, stripped.message)
            }
            Err(e) => {
                // Fail closed: an `ech` must not reach the sandbox.
                tracing::debug!(error = %e, "dns answer with ech not rewritable");
                self.metrics.servfail.inc();
                return reply(query, ResponseCode::ServFail);
            }
        };
        let question = query.queries.first()?;
        if answer.metadata.response_code == ResponseCode::NoError
            && question.query_class == DNSClass::IN
        {
            if let Some(a) = attribution(&question.name, &answer) {
                // Committed before the sandbox sees the answer, so the
                // connection that follows can never race it.
                if self.cache.record(sandbox, &a) {
                    self.metrics.attributed.inc();
                }
            }
        }
        self.metrics.answers.inc();
        if transport == Transport::Udp && bytes.len() > usize::from(query.max_payload()) {
            // No amplification: the client asks again over TCP.
            self.metrics.truncated.inc();
            return answer.truncate().to_vec().ok();
        }
        Some(bytes)
    }

    /// Asks each upstream in turn; the raw answer and its parse.
    async fn forward(
        &self,
        raw: &[u8],
        query: &Message,
        question: &Query,
    ) -> Option<(Vec<u8>, Message)> {
        let id = random_id()?;
        let sent = &upstream_query(raw, query, id)?;
        let (mut bytes, mut msg) = self.ask_upstreams(sent, id, question).await?;
        // The sandbox's own ID, recursion bit and question, put back.
        bytes[..2].copy_from_slice(&query.metadata.id.to_be_bytes());
        msg.metadata.id = query.metadata.id;
        let rd = query.metadata.recursion_desired;
        bytes[2] = (bytes[2] & !RD) | if rd { RD } else { 0 };
        msg.metadata.recursion_desired = rd;
        own_question(&mut bytes, raw);
        msg.queries.clone_from(&query.queries);
        Some((bytes, msg))
    }

    /// Asks each upstream in turn with `raw`, whose ID is `id`.
    async fn ask_upstreams(
        &self,
        raw: &[u8],
        id: u16,
        question: &Query,
    ) -> Option<(Vec<u8>, Message)> {
        for (upstream, pool) in self.config.upstreams.iter().zip(&self.sockets) {
            let attempt = async {
                let (bytes, msg) = pool
                    .exchange(*upstream, raw, id, question, self.config.upstream_timeout)
                    .await?;
                if msg.metadata.truncation {
                    self.metrics.tcp_fallbacks.inc();
                    return tcp_exchange(
                        *upstream,
                        raw,
                        id,
                        question,
                        self.config.upstream_timeout,
                    )
                    .await;
                }
                Ok((bytes, msg))
            };
            match attempt.await {
                Ok(x) => return Some(x),
                Err(e) => {
                    self.metrics.upstream_failures.inc();
                    tracing::debug!(%upstream, error = %e, "dns upstream failed");
                }
            }
        }
        None
    }
}

impl std::fmt::Debug for Admit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Allowed(id, _) => f.debug_tuple("Allowed").field(id).finish_non_exhaustive(),
            Self::Refused(id) => f.debug_tuple("Refused").field(id).finish(),
            Self::Unknown => f.write_str("Unknown"),
        }
    }
}

impl QueryRules for CompiledPolicy {
    fn policy(&self) -> &CompiledPolicy {
        self
    }
}

impl std::fmt::Debug for DnsProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DnsProxy")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// DNS-over-TCP connections one source address may hold at once (fewer,
/// its fair share of `max_tcp_connections`, when many sources hold some).
const MAX_TCP_PER_SOURCE: usize = 16;

/// The least of the proxy's places a sandbox may hold under contention
/// (its fair share, [`DnsProxy::fair_share`], never goes below it).
const MIN_SHARE: usize = 4;

/// How long the TCP accept loop waits after accepting failed.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

// === impl PooledSocket ===

impl PooledSocket {
    /// A fresh socket connected to `upstream`, and whether `raw` was
    /// already sent on it. A new socket is writable at once, but the runtime
    /// learns that only at its next turn of the reactor, which a busy
    /// listener may not take for a while: the first datagram goes out
    /// before the socket is handed to the runtime.
    fn open(upstream: SocketAddr, raw: &[u8]) -> io::Result<(Self, bool)> {
        let local: SocketAddr = match upstream {
            SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
            SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
        };
        let socket = std::net::UdpSocket::bind(local)?;
        socket.connect(upstream)?;
        socket.set_nonblocking(true)?;
        let sent = match socket.send(raw) {
            Ok(_) => true,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => false,
            Err(e) => return Err(e),
        };
        let pooled = Self {
            socket: UdpSocket::from_std(socket)?,
            uses: 0,
            buf: Vec::with_capacity(MAX_MESSAGE),
        };
        Ok((pooled, sent))
    }

    /// Reads and drops what came on a pooled socket while it sat idle, and
    /// whether the socket is fit for another query. Nothing that came
    /// before a query was sent is its answer: a late duplicate, or a
    /// datagram forged in the upstream's name to be read first once the
    /// next query goes out (with a few hundred queued, each under another
    /// ID, the forger would no longer have to beat the real answer). A
    /// socket with more than [`STALE_MAX`] of them, or an error queued, is
    /// closed, and the query takes a fresh one.
    ///
    /// The last answer left the socket marked readable, so the first
    /// receive is a system call. Its "nothing yet" also clears that mark,
    /// so the wait for this query's answer starts without a receive that
    /// only says "nothing yet" again.
    fn drained(&self) -> bool {
        let mut one = [0u8; 1];
        for _ in 0..=STALE_MAX {
            match self.socket.try_recv(&mut one) {
                Ok(_) => continue,
                Err(e) => return e.kind() == io::ErrorKind::WouldBlock,
            }
        }
        false
    }
}

// === impl SocketPool ===

impl SocketPool {
    /// An answer from `upstream` over UDP, ignoring datagrams that do not
    /// match the query (a late duplicate of an earlier answer among them).
    /// The socket goes back to the pool only after a matching answer; one
    /// that timed out or failed is closed.
    async fn exchange(
        &self,
        upstream: SocketAddr,
        raw: &[u8],
        id: u16,
        question: &Query,
        limit: Duration,
    ) -> Result<(Vec<u8>, Message), UpstreamError> {
        let pooled = self.idle.lock().ok().and_then(|mut idle| idle.pop());
        let (mut pooled, sent) = match pooled.filter(PooledSocket::drained) {
            Some(p) => (p, false),
            None => PooledSocket::open(upstream, raw)?,
        };
        pooled.uses += 1;
        if !sent {
            pooled.socket.send(raw).await?;
        }
        let deadline = Instant::now() + limit;
        loop {
            pooled.buf.clear();
            tokio::time::timeout_at(deadline, pooled.socket.recv_buf(&mut pooled.buf))
                .await
                .map_err(|_| UpstreamError::Timeout)??;
            if let Some(msg) = matching(&pooled.buf, id, question) {
                // Copied out at its own size.
                let bytes = pooled.buf.as_slice().to_vec();
                self.put_back(pooled);
                return Ok((bytes, msg));
            }
        }
    }

    fn put_back(&self, pooled: PooledSocket) {
        if pooled.uses >= SOCKET_MAX_USES {
            return;
        }
        if let Ok(mut idle) = self.idle.lock() {
            if idle.len() < POOL_IDLE_MAX {
                idle.push(pooled);
            }
        }
    }
}

/// An answer from `upstream` over TCP.
async fn tcp_exchange(
    upstream: SocketAddr,
    raw: &[u8],
    id: u16,
    question: &Query,
    limit: Duration,
) -> Result<(Vec<u8>, Message), UpstreamError> {
    let exchange = async {
        let mut stream = TcpStream::connect(upstream).await?;
        let framed = tcp_frame(raw).ok_or(UpstreamError::Mismatch)?;
        stream.write_all(&framed).await?;
        let mut len = [0u8; 2];
        stream.read_exact(&mut len).await?;
        let mut buf = vec![0u8; usize::from(u16::from_be_bytes(len))];
        stream.read_exact(&mut buf).await?;
        let msg = matching(&buf, id, question).ok_or(UpstreamError::Mismatch)?;
        Ok((buf, msg))
    };
    timeout(limit, exchange)
        .await
        .map_err(|_| UpstreamError::Timeout)?
}

/// A message with the two-byte length prefix of DNS over TCP; `None` past 64 KiB.
fn tcp_frame(msg: &[u8]) -> Option<Vec<u8>> {
    let len = u16::try_from(msg.len()).ok()?;
    let mut framed = Vec::with_capacity(msg.len() + 2);
    framed.extend_from_slice(&len.to_be_bytes());
    framed.extend_from_slice(msg);
    Some(framed)
}

/// A query ID no one outside the gateway knows before the answer comes:
/// `None` (the query is dropped, and the sandbox asks again) if the system's
/// random source fails.
fn random_id() -> Option<u16> {
    let mut id = [0u8; 2];
    aws_lc_rs::rand::fill(&mut id).ok()?;
    Some(u16::from_be_bytes(id))
}

/// The recursion-desired bit, in the header's third byte.
const RD: u8 = 0x01;

/// What of a question besides its name reaches the name's authority and
/// could carry data there, as one number for the new-name budget: its type
/// unless A, AAAA or HTTPS (0 for those three), its class unless IN, its
/// AD, CD and DO bits and whether it carries EDNS (0 for an ordinary
/// question). A name asked again with
/// another of them then spends a name as a new name does, so a sandbox
/// cannot move 16 bits a query in the type of one name asked over and over
/// (nor one in whether the upstream query carries an OPT record). Which of
/// A, AAAA and HTTPS a query asks stays free: under 2 bits a query, within
/// the query budget.
fn question_variant(query: &Message, q: &Query) -> u64 {
    let ordinary = matches!(
        q.query_type,
        RecordType::A | RecordType::AAAA | RecordType::HTTPS
    );
    let ty = if ordinary {
        0
    } else {
        u64::from(u16::from(q.query_type))
    };
    let class = if q.query_class == DNSClass::IN {
        0
    } else {
        u64::from(u16::from(q.query_class))
    };
    let dnssec_ok = query.edns.as_ref().is_some_and(|e| e.flags().dnssec_ok);
    let bits = u64::from(query.metadata.authentic_data)
        | u64::from(query.metadata.checking_disabled) << 1
        | u64::from(dnssec_ok) << 2
        | u64::from(query.edns.is_some()) << 3;
    ty | class << 16 | bits << 32
}

/// The query as it goes upstream, built anew from `raw` (parsed as `query`)
/// rather than passed on: the ID `id`; recursion desired (a query without
/// it would ask the upstream's cache what other sandboxes resolved); the
/// sandbox's AD and CD bits; its one question, the name in lower case; and,
/// if it sent EDNS, an OPT with the gateway's payload size
/// ([`UPSTREAM_PAYLOAD`]: the sandbox's own would carry 16 bits a query),
/// its DO bit and no option.
/// What the sandbox put anywhere else does not leave: records in the other
/// sections, EDNS options (a client subnet would carry 24 bits a query to
/// the name's authority), the letters' case (a name asked again in other
/// letters spends no name budget, so its case would carry a bit a letter).
/// `None` if the question cannot be walked (`parse_query` took it, so that
/// does not happen).
/// The UDP payload size every upstream query offers (DNS Flag Day 2020's):
/// a larger answer comes back truncated and is asked again over TCP.
const UPSTREAM_PAYLOAD: u16 = 1232;

fn upstream_query(raw: &[u8], query: &Message, id: u16) -> Option<Vec<u8>> {
    let end = question_name_end(raw)?;
    // The name, its type and its class.
    let question = raw.get(HEADER_LEN..end + 4)?;
    let mut out = Vec::with_capacity(HEADER_LEN + question.len() + 11);
    out.extend_from_slice(&id.to_be_bytes());
    let ad = if query.metadata.authentic_data {
        0x20
    } else {
        0
    };
    let cd = if query.metadata.checking_disabled {
        0x10
    } else {
        0
    };
    // A query (QR 0, opcode 0) with recursion desired.
    out.extend_from_slice(&[RD, ad | cd]);
    let additional = u16::from(query.edns.is_some());
    out.extend_from_slice(&[0, 1, 0, 0, 0, 0]);
    out.extend_from_slice(&additional.to_be_bytes());
    out.extend_from_slice(question);
    // Length octets are at most 63, below every letter: only letters change.
    out[HEADER_LEN..end].make_ascii_lowercase();
    if let Some(edns) = &query.edns {
        let payload = UPSTREAM_PAYLOAD;
        let dnssec_ok = if edns.flags().dnssec_ok { 0x80 } else { 0 };
        // Owner: the root; type OPT (41); class: the payload size; TTL:
        // extended code 0, version 0, the DO bit; no data.
        out.extend_from_slice(&[0, 0, 41]);
        out.extend_from_slice(&payload.to_be_bytes());
        out.extend_from_slice(&[0, 0, dnssec_ok, 0, 0, 0]);
    }
    Some(out)
}

/// Puts the sandbox's question name (`raw`'s, in its own letters' case)
/// back into `answer`, where the answer carries the same name in the same
/// place; a stub checking its letters' case (0x20) then finds its own.
fn own_question(answer: &mut [u8], raw: &[u8]) {
    let Some(end) = question_name_end(raw) else {
        return;
    };
    let (Some(theirs), Some(ours)) = (answer.get_mut(HEADER_LEN..end), raw.get(HEADER_LEN..end))
    else {
        return;
    };
    if theirs.eq_ignore_ascii_case(ours) {
        theirs.copy_from_slice(ours);
    }
}

/// The length of a DNS message header: the question follows it.
const HEADER_LEN: usize = 12;

/// Where the first question's name ends in the message `m` (one past its
/// root label); `None` for a compression pointer or a label type other than
/// a plain label.
fn question_name_end(m: &[u8]) -> Option<usize> {
    let mut at = HEADER_LEN;
    loop {
        let len = usize::from(*m.get(at)?);
        match len {
            0 => return Some(at + 1),
            1..=63 => at += 1 + len,
            _ => return None,
        }
    }
}

/// Parses `bytes` when it is the response to the query sent as `id`: that
/// ID, a response, the same question.
fn matching(bytes: &[u8], id: u16, question: &Query) -> Option<Message> {
    let msg = Message::from_vec(bytes).ok()?;
    let same_question = match msg.queries.as_slice() {
        [q] => {
            q.name.eq_ignore_root(&question.name)
                && q.query_type == question.query_type
                && q.query_class == question.query_class
        }
        _ => false,
    };
    (msg.metadata.id == id && msg.metadata.message_type == MessageType::Response && same_question)
        .then_some(msg)
}

/// A response to a parsed query with `code`, echoing the question.
fn reply(query: &Message, code: ResponseCode) -> Option<Vec<u8>> {
    let mut m = Message::error_msg(query.metadata.id, query.metadata.op_code, code);
    m.metadata.recursion_desired = query.metadata.recursion_desired;
    m.metadata.recursion_available = true;
    m.add_queries(query.queries.iter().cloned());
    m.to_vec().ok()
}

/// A header-only response to bytes that may not parse; nothing when they are
/// not even a query header (too short, or already a response).
fn error_reply(raw: &[u8], code: ResponseCode) -> Option<Vec<u8>> {
    let header = raw.get(..12)?;
    if header[2] & 0x80 != 0 {
        return None;
    }
    let id = u16::from_be_bytes([header[0], header[1]]);
    let mut m = Message::error_msg(id, OpCode::Query, code);
    m.metadata.recursion_available = true;
    m.to_vec().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::rr::rdata::svcb::{
        EchConfigList, SvcParamKey, SvcParamValue, Unknown, SVCB,
    };
    use hickory_proto::rr::rdata::{A, HTTPS};
    use hickory_proto::rr::{Name, RData, Record};

    struct Nobody;

    impl QueryAdmission for Nobody {
        fn admit(&self, _: IpAddr, _: SocketAddr) -> Admit {
            Admit::Unknown
        }
        fn holds(&self, _: IpAddr, _: &SandboxId, _: u64) -> bool {
            true
        }
        fn registered(&self, _: &SandboxId, _: u64) -> bool {
            true
        }
    }

    /// An answer with `ech` that cannot be rewritten (here: a parameter
    /// too long to encode once `ech` is gone) is answered SERVFAIL, and
    /// nothing of it attributes: the `ech` never reaches the sandbox.
    #[test]
    fn an_answer_whose_ech_cannot_be_stripped_is_servfail_and_attributes_nothing() {
        let cache = Arc::new(AttributionCache::new(
            crate::cache::CacheConfig::default(),
            crate::clock::ManualClock::new(),
        ));
        let proxy = DnsProxy::new(ProxyConfig::default(), cache, Arc::new(Nobody));
        let owner = Name::from_ascii("ech.test.").expect("name");
        let mut query = Message::new(7, MessageType::Query, OpCode::Query);
        query.add_query(Query::query(owner.clone(), RecordType::A));
        let mut answer = query.clone();
        answer.metadata.message_type = MessageType::Response;
        let params = vec![
            (
                SvcParamKey::EchConfigList,
                SvcParamValue::EchConfigList(EchConfigList(b"ech!".to_vec())),
            ),
            (
                SvcParamKey::Unknown(65000),
                SvcParamValue::Unknown(Unknown(vec![0; 70_000])),
            ),
        ];
        let https = HTTPS(SVCB::new(1, Name::root(), params));
        answer.add_answer(Record::from_rdata(owner.clone(), 300, RData::HTTPS(https)));
        let addr = Ipv4Addr::new(203, 0, 113, 5);
        answer.add_answer(Record::from_rdata(owner, 300, RData::A(A(addr))));
        assert!(crate::svcb::strip_ech(&answer).is_err(), "the case is one");
        let sandbox = SandboxId::new("a");
        let sent = proxy.deliver(&query, &sandbox, Vec::new(), answer, Transport::Udp);
        let sent = Message::from_vec(&sent.expect("an answer")).expect("parses");
        assert_eq!(sent.metadata.response_code, ResponseCode::ServFail);
        assert!(sent.answers.is_empty());
        assert_eq!(proxy.metrics().servfail.get(), 1);
        assert_eq!(proxy.metrics().attributed.get(), 0);
        let names = proxy.cache().names_for(&sandbox, IpAddr::V4(addr));
        assert!(names.names().is_empty());
    }

    /// A query for `name` under `id`, and the answer to it: `addr` for ten seconds.
    fn query_and_answer(id: u16, addr: Ipv4Addr) -> (Message, Message) {
        let name = Name::from_ascii("pooled.test.").expect("name");
        let mut query = Message::new(id, MessageType::Query, OpCode::Query);
        query.add_query(Query::query(name.clone(), RecordType::A));
        let mut answer = query.clone();
        answer.metadata.message_type = MessageType::Response;
        answer.add_answer(Record::from_rdata(name, 10, RData::A(A(addr))));
        (query, answer)
    }

    /// The one address of an answer.
    fn address_of(msg: &Message) -> Option<Ipv4Addr> {
        match msg.answers.as_slice() {
            [r] => match &r.data {
                RData::A(a) => Some(a.0),
                _ => None,
            },
            _ => None,
        }
    }

    /// Datagrams that came, in the upstream's name, to a pooled socket
    /// while it sat idle are never read as the answer to the next query
    /// sent on it: here a few queued before that query goes out, one of
    /// them under its ID with the address a forger would want. They are
    /// dropped, and the socket answers the query; one that held more than
    /// [`STALE_MAX`] is closed, and the query goes out on a fresh one.
    #[tokio::test]
    async fn datagrams_queued_on_an_idle_socket_are_never_the_next_answer() {
        let upstream = tokio::net::UdpSocket::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let up = upstream.local_addr().expect("addr");
        let real = Ipv4Addr::new(203, 0, 113, 7);
        let answering = async {
            let mut buf = vec![0u8; 512];
            for _ in 0..3 {
                let (n, from) = upstream.recv_from(&mut buf).await.expect("a query");
                let query = Message::from_vec(&buf[..n]).expect("parses");
                let (_, answer) = query_and_answer(query.metadata.id, real);
                let bytes = answer.to_vec().expect("encodes");
                upstream.send_to(&bytes, from).await.expect("sent");
            }
        };
        let pool = SocketPool::default();
        let idle = || {
            pool.idle.lock().expect("lock")[0]
                .socket
                .local_addr()
                .expect("addr")
        };
        let ask = |id: u16| {
            let (query, _) = query_and_answer(id, real);
            let pool = &pool;
            async move {
                let raw = query.to_vec().expect("encodes");
                let (_, msg) = pool
                    .exchange(up, &raw, id, &query.queries[0], Duration::from_secs(5))
                    .await
                    .expect("an answer");
                address_of(&msg)
            }
        };
        let plant = |ids: std::ops::Range<u16>, to: SocketAddr| {
            let upstream = &upstream;
            async move {
                for id in ids {
                    let (_, planted) = query_and_answer(id, Ipv4Addr::new(198, 51, 100, 66));
                    let planted = planted.to_vec().expect("encodes");
                    upstream.send_to(&planted, to).await.expect("planted");
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        let asking = async {
            assert_eq!(ask(1).await, Some(real));
            let first = idle();
            plant(2..5, first).await;
            assert_eq!(ask(2).await, Some(real), "a planted answer was read");
            assert_eq!(idle(), first, "three dropped, the socket kept");
            let stale = u16::try_from(STALE_MAX).expect("small") + 1;
            plant(10..10 + stale, first).await;
            assert_eq!(ask(10).await, Some(real), "a planted answer was read");
            assert_ne!(idle(), first, "the socket that held {stale} is closed");
        };
        tokio::time::timeout(
            Duration::from_secs(10),
            futures::future::join(answering, asking),
        )
        .await
        .expect("both ends finish");
    }

    proptest::proptest! {
        /// Whatever the bytes, the error path neither panics nor answers a response.
        #[test]
        fn error_reply_never_panics(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64)) {
            if let Some(resp) = error_reply(&bytes, ResponseCode::FormErr) {
                let m = Message::from_vec(&resp).expect("we emit valid messages");
                proptest::prop_assert_eq!(m.metadata.response_code, ResponseCode::FormErr);
                proptest::prop_assert_eq!(m.metadata.id, u16::from_be_bytes([bytes[0], bytes[1]]));
            }
        }

        /// Decoding arbitrary bytes as a message never panics.
        #[test]
        fn message_parse_never_panics(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..600)) {
            let _ = Message::from_vec(&bytes);
        }
    }
}
