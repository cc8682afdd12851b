//! Upstream connections, shared across one sandbox's client connections.
//!
//! Requests go out in the client's protocol: HTTP/2 is offered to the
//! origin only for an HTTP/2 client connection (`PoolKey::h2`). An HTTP/2
//! upstream connection enters the pool as it is made: it multiplexes, so
//! the sandbox's other HTTP/2 client connections to the same destination
//! and name take a clone. An HTTP/1.1 client connection keeps the upstream
//! connection it uses while it is busy (nothing per request), and gives it
//! back to the pool after a quarter second without a byte either way
//! (`intercept::serve`) or when it ends; its next request takes one from
//! the pool again. So an idle client connection pins no upstream
//! connection, and a sandbox holding thousands of idle keep-alive
//! connections costs the origins a bounded pool, not a connection each.
//!
//! A connection is pooled under its sandbox (the registration: a sandbox
//! deleted and registered again under its id is another), the original
//! destination *and*
//! the name its certificate was verified for: a request is only ever sent
//! over a connection verified for the name it needs, and never over one
//! another sandbox opened (two tenants on one origin connection would share
//! its connection-bound state, its HTTP/2 head-of-line blocking and its
//! fairness). Entries are bounded per key, per sandbox and in total, and
//! dropped after `MAX_IDLE` (origins close idle keep-alive connections on
//! their own schedule; a stale one would fail a request).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dns_attrib::held::share_with_reserve;
use egress_policy::{Hostname, SandboxId};
use http_body_util::combinators::BoxBody;
use prometheus_client::metrics::gauge::Gauge;

use crate::upstream_proxy::ProxyName;

/// What bodies fail with, whichever side they come from.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

pub(crate) type Body = BoxBody<Bytes, BoxError>;

/// A connection to an origin.
pub(crate) enum Sender {
    H1(hyper::client::conn::http1::SendRequest<Body>),
    H2(crate::h2client::H2Sender),
}

/// Where a connection goes and what it was verified as: over TLS, the name
/// (or, with `None`, the destination address); in plain HTTP, nothing — plain
/// connections never share a key with TLS ones.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct PoolKey {
    pub(crate) sandbox: SandboxId,
    /// The registration of `sandbox` ([`crate::registry::Sandbox::serial`]):
    /// a sandbox deleted and registered again under its id never takes
    /// the connections the first one pooled.
    pub(crate) serial: u64,
    pub(crate) dst: SocketAddr,
    pub(crate) tls: bool,
    pub(crate) name: Option<Hostname>,
    /// The operator's proxy it was tunnelled through (`None`: direct): a
    /// sandbox re-registered with another way out never takes the old one's.
    pub(crate) via: Option<ProxyName>,
    /// HTTP/2 was offered to the origin: the client connection speaks it.
    /// An HTTP/1.1 client's requests go out on HTTP/1.1 connections of
    /// their own, request for request, with no translation to HTTP/2.
    pub(crate) h2: bool,
}

impl PoolKey {
    /// Whether this key is the one for `(dst, tls, name, h2)` (of the same
    /// sandbox), without building it.
    pub(crate) fn is(&self, dst: SocketAddr, tls: bool, name: Option<&Hostname>, h2: bool) -> bool {
        self.dst == dst && self.tls == tls && self.name.as_ref() == name && self.h2 == h2
    }
}

/// Idle connections under one key (beyond it, client connections that
/// fall quiet at the same time close theirs, and open their next upstream
/// connection afresh).
const MAX_PER_KEY: usize = 128;
/// Idle connections one sandbox may keep, over all its origins, at most:
/// less as the pool fills ([`sandbox_cap`]).
const MAX_PER_SANDBOX: usize = 256;
const MAX_TOTAL: usize = 4_096;
/// A sandbox's share of the pool is never below this many entries...
const MIN_SANDBOX_SHARE: usize = 16;
/// ...nor above it once the pool's last eighth is reached: that eighth is
/// a reserve the sandboxes holding little take from, so sixteen sandboxes
/// at 256 each cannot leave every other none.
const NEWCOMER_SHARE: usize = 16;
const MAX_IDLE: Duration = Duration::from_secs(30);

#[derive(Default)]
pub(crate) struct UpstreamPool {
    idle: Mutex<Idle>,
    /// Entries held, for `/metrics` (`egress_upstream_pooled_connections`).
    pooled: Gauge,
}

#[derive(Default)]
struct Idle {
    by_key: HashMap<PoolKey, Vec<(Instant, Sender)>>,
    /// Entries over all keys, kept as they change (not summed under the lock).
    total: usize,
    /// Entries per sandbox, likewise.
    per_sandbox: HashMap<SandboxId, usize>,
    /// When every key's expired and closed entries were last dropped.
    swept: Option<Instant>,
}

impl Sender {
    /// Whether a request can go out on it now.
    pub(crate) fn usable(&self) -> bool {
        match self {
            Self::H1(s) => s.is_ready(),
            Self::H2(s) => s.usable(),
        }
    }

    /// Whether it can never carry a request again. An HTTP/1.1 connection
    /// whose response was just read may not be ready yet (its task has not
    /// run since), nor an HTTP/2 one at its origin's limit of streams, but
    /// neither is closed.
    fn closed(&self) -> bool {
        match self {
            Self::H1(s) => s.is_closed(),
            Self::H2(s) => !s.open(),
        }
    }

    /// Whether it is the HTTP/2 connection `h2`.
    fn is(&self, h2: &crate::h2client::H2Sender) -> bool {
        matches!(self, Self::H2(s) if s.same(h2))
    }

    fn share(&self) -> Option<Self> {
        match self {
            Self::H2(s) => Some(Self::H2(s.clone())),
            Self::H1(_) => None,
        }
    }
}

/// Hands out entry `i` of a key's list at `now`: an HTTP/1.1 connection is
/// taken out; an HTTP/2 one multiplexes, so a clone goes and it stays
/// pooled, used now (so last: the list stays in time order).
fn hand_out(list: &mut Vec<(Instant, Sender)>, i: usize, now: Instant) -> Sender {
    let (at, sender) = list.remove(i);
    match sender.share() {
        Some(shared) => {
            list.push((at.max(now), sender));
            shared
        }
        None => sender,
    }
}

impl UpstreamPool {
    /// An HTTP/2 connection for `key` that is open, at its origin's limit
    /// of streams or not: a request queues on it for a stream. Used now,
    /// as [`Self::take`]'s are: last in the list.
    pub(crate) fn open_h2(&self, key: &PoolKey) -> Option<Sender> {
        let mut idle = self
            .idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = Instant::now();
        let list = idle.by_key.get_mut(key)?;
        let at = list.iter().rposition(|(at, s)| match s {
            Sender::H2(h) => !expired(*at, now) && h.open(),
            Sender::H1(_) => false,
        })?;
        Some(hand_out(list, at, now))
    }

    /// An idle connection for `key`, if one is still usable: the newest
    /// ready one. Expired entries (the oldest) and closed ones met on the
    /// way are dropped; one not ready yet stays for a later request.
    pub(crate) fn take(&self, key: &PoolKey) -> Option<Sender> {
        self.take_at(key, Instant::now())
    }

    /// [`Self::take`] at `now`.
    fn take_at(&self, key: &PoolKey, now: Instant) -> Option<Sender> {
        let mut idle = self
            .idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let idle = &mut *idle;
        let list = idle.by_key.get_mut(key)?;
        let before = list.len();
        // Entries are pushed in time order: the expired ones are a prefix.
        let stale = list.partition_point(|(at, _)| expired(*at, now));
        list.drain(..stale);
        let mut found = None;
        let mut i = list.len();
        while i > 0 {
            i -= 1;
            if list[i].1.closed() {
                list.remove(i);
            } else if list[i].1.usable() {
                found = Some(hand_out(list, i, now));
                break;
            }
        }
        // Dropped or handed out: no longer idle here.
        let taken = before - list.len();
        let empty = list.is_empty();
        idle.total -= taken;
        idle.forget(&key.sandbox, taken);
        if empty {
            idle.by_key.remove(key);
        }
        self.pooled.set(gauge(idle.total));
        found
    }

    /// Returns a connection its client connection is done with (or has
    /// been quiet on for a second). An HTTP/1.1 one may still be finishing a
    /// response: it is kept, and handed out once ready.
    pub(crate) fn put(&self, key: PoolKey, sender: Sender) {
        if sender.closed() {
            return;
        }
        let mut idle = self
            .idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let idle = &mut *idle;
        let now = Instant::now();
        // Keys nobody asks for again are only cleaned here.
        if idle.swept.is_none_or(|at| expired(at, now)) {
            idle.sweep(now);
        }
        let held = idle.per_sandbox.get(&key.sandbox).copied().unwrap_or(0);
        let sandbox_full = held >= sandbox_cap(idle.total, idle.per_sandbox.len());
        if idle.total < MAX_TOTAL && !sandbox_full {
            let sandbox = key.sandbox.clone();
            let list = idle.by_key.entry(key).or_default();
            // An HTTP/2 connection is shared: pooled once, and another only
            // beside it (one at its origin's limit of streams is not
            // handed out, and a request then opens another).
            let pooled = match &sender {
                Sender::H2(h2) => list.iter().any(|(_, s)| s.is(h2)),
                Sender::H1(_) => false,
            };
            if list.len() < MAX_PER_KEY && !pooled {
                list.push((now, sender));
                idle.total += 1;
                *idle.per_sandbox.entry(sandbox).or_insert(0) += 1;
            }
        }
        self.pooled.set(gauge(idle.total));
    }

    /// The gauge of entries held, to register with the metrics.
    pub(crate) fn gauge(&self) -> Gauge {
        self.pooled.clone()
    }
}

/// How many idle entries a sandbox may hold when the pool holds `total`
/// over `holding` sandboxes: its fair share with a reserve (as the flow
/// log's sources have theirs), at most [`MAX_PER_SANDBOX`].
fn sandbox_cap(total: usize, holding: usize) -> usize {
    let share = share_with_reserve(MAX_TOTAL, total, holding, MIN_SANDBOX_SHARE, NEWCOMER_SHARE);
    share.min(MAX_PER_SANDBOX)
}

/// Whether an entry put (or a sweep made) at `at` is `MAX_IDLE` old at `now`.
fn expired(at: Instant, now: Instant) -> bool {
    now.duration_since(at) >= MAX_IDLE
}

fn gauge(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl Idle {
    /// Drops every key's expired and closed entries.
    fn sweep(&mut self, now: Instant) {
        self.swept = Some(now);
        let mut gone: Vec<(SandboxId, usize)> = Vec::new();
        self.by_key.retain(|key, list| {
            let before = list.len();
            list.retain(|(at, s)| !expired(*at, now) && !s.closed());
            if list.len() < before {
                gone.push((key.sandbox.clone(), before - list.len()));
            }
            !list.is_empty()
        });
        for (sandbox, n) in gone {
            self.total -= n;
            self.forget(&sandbox, n);
        }
    }

    fn forget(&mut self, sandbox: &SandboxId, n: usize) {
        if n == 0 {
            return;
        }
        if let Some(count) = self.per_sandbox.get_mut(sandbox) {
            *count = count.saturating_sub(n);
            if *count == 0 {
                self.per_sandbox.remove(sandbox);
            }
        }
    }
}

impl std::fmt::Debug for UpstreamPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamPool").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper_util::rt::TokioIo;

    /// A ready HTTP/1.1 sender over an in-memory pipe (the other end is kept
    /// so the connection stays open).
    async fn sender() -> (Sender, tokio::io::DuplexStream) {
        let (ours, theirs) = tokio::io::duplex(1024);
        let (mut s, conn) = hyper::client::conn::http1::handshake(TokioIo::new(ours))
            .await
            .expect("handshake");
        tokio::spawn(conn);
        s.ready().await.expect("ready");
        (Sender::H1(s), theirs)
    }

    /// An HTTP/2 sender over an in-memory pipe (the other end is kept, and
    /// never answers: the connection stays open).
    async fn h2_sender() -> (Sender, tokio::io::DuplexStream) {
        let (ours, theirs) = tokio::io::duplex(64 * 1024);
        let s = crate::h2client::handshake(ours).await.expect("handshake");
        (Sender::H2(s), theirs)
    }

    /// A shared HTTP/2 entry is used each time it is handed out: it goes
    /// 30 s after its last use, not 30 s after it was first pooled (a busy
    /// key lost its connection every 30 s, and opened another).
    #[tokio::test]
    async fn a_shared_http2_connection_stays_pooled_while_it_is_used() {
        let pool = UpstreamPool::default();
        let (s, _peer) = h2_sender().await;
        let start = Instant::now();
        pool.put(key("a"), s);
        let at = |secs| start + Duration::from_secs(secs);
        assert!(pool.take_at(&key("a"), at(29)).is_some(), "29 s after");
        assert!(pool.take_at(&key("a"), at(45)).is_some(), "used at 29 s");
        assert!(
            pool.take_at(&key("a"), at(76)).is_none(),
            "unused since 45 s"
        );
    }

    fn key(sandbox: &str) -> PoolKey {
        PoolKey {
            sandbox: SandboxId::new(sandbox),
            serial: 1,
            dst: "198.51.100.7:443".parse().expect("addr"),
            tls: true,
            name: Some(Hostname::parse("api.example.test").expect("name")),
            via: None,
            h2: true,
        }
    }

    #[tokio::test]
    async fn one_sandbox_never_gets_another_sandboxs_connection() {
        let pool = UpstreamPool::default();
        let (s, _peer) = sender().await;
        pool.put(key("a"), s);
        assert!(pool.take(&key("b")).is_none(), "b must open its own");
        assert!(pool.take(&key("a")).is_some(), "a reuses its own");
        assert!(
            pool.take(&key("a")).is_none(),
            "an HTTP/1.1 connection is taken once"
        );
    }

    #[tokio::test]
    async fn each_sandbox_keeps_a_bounded_number_of_idle_connections() {
        let pool = UpstreamPool::default();
        let mut peers = Vec::new();
        for i in 0..(MAX_PER_SANDBOX + 10) {
            let (s, peer) = sender().await;
            peers.push(peer);
            let mut k = key("a");
            k.dst.set_port(u16::try_from(1000 + i).expect("port"));
            pool.put(k, s);
        }
        let (s, peer) = sender().await;
        peers.push(peer);
        pool.put(key("b"), s);
        let idle = pool.idle.lock().expect("lock");
        assert_eq!(
            idle.per_sandbox.get(&SandboxId::new("a")),
            Some(&MAX_PER_SANDBOX)
        );
        assert_eq!(
            idle.per_sandbox.get(&SandboxId::new("b")),
            Some(&1),
            "b is not starved by a"
        );
        assert_eq!(idle.total, MAX_PER_SANDBOX + 1);
    }

    /// Sandboxes that each pool as much as they may one after another
    /// leave room for the next: the last eighth of the pool goes a little
    /// to each sandbox holding little.
    #[tokio::test]
    async fn sandboxes_filling_the_pool_leave_room_for_the_next() {
        let pool = UpstreamPool::default();
        let mut peers = Vec::new();
        for sb in 0..MAX_TOTAL / MAX_PER_SANDBOX {
            for i in 0..MAX_PER_SANDBOX {
                let (s, peer) = sender().await;
                peers.push(peer);
                let mut k = key(&format!("sb{sb}"));
                k.dst.set_port(u16::try_from(1000 + i).expect("port"));
                pool.put(k, s);
            }
        }
        let held = |sb: &str| {
            let idle = pool.idle.lock().expect("lock");
            idle.per_sandbox.get(&SandboxId::new(sb)).copied()
        };
        assert_eq!(
            held("sb0"),
            Some(MAX_PER_SANDBOX),
            "the first filled its own"
        );
        assert_eq!(held("sb15"), Some(NEWCOMER_SHARE), "past seven eighths");
        for i in 0..NEWCOMER_SHARE + 1 {
            let (s, peer) = sender().await;
            peers.push(peer);
            let mut k = key("late");
            k.dst.set_port(u16::try_from(1000 + i).expect("port"));
            pool.put(k, s);
        }
        assert_eq!(held("late"), Some(NEWCOMER_SHARE), "the next still pools");
    }

    #[tokio::test]
    async fn a_connection_still_finishing_is_kept_but_not_handed_out() {
        use http_body_util::BodyExt;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let pool = UpstreamPool::default();
        let (Sender::H1(mut s), mut peer) = sender().await else {
            unreachable!("sender() is HTTP/1.1")
        };
        // A request in flight: the connection is busy, not closed.
        let req = http::Request::get("/")
            .body(http_body_util::Empty::new().map_err(|e| match e {}).boxed())
            .expect("request");
        let answer = tokio::spawn(s.send_request(req));
        let mut buf = [0u8; 1024];
        let n = peer.read(&mut buf).await.expect("the request");
        assert!(buf[..n].starts_with(b"GET / HTTP/1.1"));
        pool.put(key("a"), Sender::H1(s));
        assert!(pool.take(&key("a")).is_none(), "busy: not handed out");
        peer.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            .await
            .expect("the response");
        let resp = answer.await.expect("task").expect("response");
        assert_eq!(resp.status(), 200);
        // Kept while busy: once its response is in, the same connection is ready.
        let mut found = None;
        for _ in 0..100 {
            found = pool.take(&key("a"));
            if found.is_some() {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert!(
            found.is_some_and(|s| s.usable()),
            "ready once the response is read"
        );
        // Closed while pooled: dropped, not handed out.
        let (s, peer) = sender().await;
        pool.put(key("a"), s);
        drop(peer);
        let closed = || {
            let idle = pool.idle.lock().expect("lock");
            idle.by_key[&key("a")].iter().all(|(_, s)| s.closed())
        };
        for _ in 0..200 {
            if closed() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(closed(), "hyper saw the close");
        assert!(pool.take(&key("a")).is_none(), "never handed out");
        assert_eq!(pool.idle.lock().expect("lock").total, 0);
    }

    #[tokio::test]
    async fn a_sweep_drops_every_keys_expired_entries_and_their_counts() {
        let pool = UpstreamPool::default();
        let mut peers = Vec::new();
        for sandbox in ["a", "b"] {
            let (s, peer) = sender().await;
            peers.push(peer);
            pool.put(key(sandbox), s);
        }
        assert_eq!(pool.pooled.get(), 2);
        let mut idle = pool.idle.lock().expect("lock");
        idle.sweep(Instant::now() + MAX_IDLE);
        assert_eq!(idle.total, 0);
        assert!(idle.by_key.is_empty() && idle.per_sandbox.is_empty());
    }
}
