//! Upstream connections, shared across one sandbox's client connections.
//!
//! An HTTP/1.1 connection enters the pool when its client connection is
//! done with it. An HTTP/2 connection enters it as it is made: it
//! multiplexes, so the sandbox's other client connections to the same
//! destination and name take a clone rather than each pinning one of its
//! own (an idle intercepted connection then holds no upstream connection).
//!
//! A connection is pooled under its sandbox, the original destination *and*
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
use egress_policy::{Hostname, SandboxId};
use http_body_util::combinators::BoxBody;

use crate::upstream_proxy::ProxyName;

pub(crate) type Body = BoxBody<Bytes, hyper::Error>;

/// A connection to an origin.
pub(crate) enum Sender {
    H1(hyper::client::conn::http1::SendRequest<Body>),
    H2(hyper::client::conn::http2::SendRequest<Body>),
}

/// Where a connection goes and what it was verified as: over TLS, the name
/// (or, with `None`, the destination address); in plain HTTP, nothing — plain
/// connections never share a key with TLS ones.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct PoolKey {
    pub(crate) sandbox: SandboxId,
    pub(crate) dst: SocketAddr,
    pub(crate) tls: bool,
    pub(crate) name: Option<Hostname>,
    /// The operator's proxy it was tunnelled through (`None`: direct): a
    /// sandbox re-registered with another way out never takes the old one's.
    pub(crate) via: Option<ProxyName>,
}

impl PoolKey {
    /// Whether this key is the one for `(dst, tls, name)` (of the same
    /// sandbox), without building it.
    pub(crate) fn is(&self, dst: SocketAddr, tls: bool, name: Option<&Hostname>) -> bool {
        self.dst == dst && self.tls == tls && self.name.as_ref() == name
    }
}

const MAX_PER_KEY: usize = 32;
/// Idle connections one sandbox may keep, over all its origins.
const MAX_PER_SANDBOX: usize = 256;
const MAX_TOTAL: usize = 4_096;
const MAX_IDLE: Duration = Duration::from_secs(30);

#[derive(Default)]
pub(crate) struct UpstreamPool {
    idle: Mutex<Idle>,
}

#[derive(Default)]
struct Idle {
    by_key: HashMap<PoolKey, Vec<(Instant, Sender)>>,
    /// Entries over all keys, kept as they change (not summed under the lock).
    total: usize,
    /// Entries per sandbox, likewise.
    per_sandbox: HashMap<SandboxId, usize>,
}

impl Sender {
    /// Whether a request can go out on it now.
    pub(crate) fn usable(&self) -> bool {
        match self {
            Self::H1(s) => s.is_ready(),
            Self::H2(s) => !s.is_closed() && s.is_ready(),
        }
    }

    fn share(&self) -> Option<Self> {
        match self {
            Self::H2(s) => Some(Self::H2(s.clone())),
            Self::H1(_) => None,
        }
    }
}

impl UpstreamPool {
    /// An idle connection for `key`, if one is still usable.
    pub(crate) fn take(&self, key: &PoolKey) -> Option<Sender> {
        let mut idle = self
            .idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let idle = &mut *idle;
        let list = idle.by_key.get_mut(key)?;
        let before = list.len();
        list.retain(|(at, s)| at.elapsed() < MAX_IDLE && s.usable());
        // HTTP/2 multiplexes: hand out a clone and keep the connection pooled.
        let found = match list.last() {
            Some((_, s)) if s.share().is_some() => s.share(),
            Some(_) => list.pop().map(|(_, s)| s),
            None => None,
        };
        let gone = before - list.len();
        let empty = list.is_empty();
        idle.total -= gone;
        idle.forget(&key.sandbox, gone);
        if empty {
            idle.by_key.remove(key);
        }
        found
    }

    /// Returns a connection that finished its requests.
    pub(crate) fn put(&self, key: PoolKey, sender: Sender) {
        if !sender.usable() {
            return;
        }
        let mut idle = self
            .idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let idle = &mut *idle;
        let sandbox_full = idle
            .per_sandbox
            .get(&key.sandbox)
            .is_some_and(|n| *n >= MAX_PER_SANDBOX);
        if idle.total >= MAX_TOTAL || sandbox_full {
            return;
        }
        let sandbox = key.sandbox.clone();
        let list = idle.by_key.entry(key).or_default();
        let shared = matches!(sender, Sender::H2(_));
        if list.len() >= MAX_PER_KEY || (shared && !list.is_empty()) {
            return;
        }
        list.push((Instant::now(), sender));
        idle.total += 1;
        *idle.per_sandbox.entry(sandbox).or_insert(0) += 1;
    }
}

impl Idle {
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

    fn key(sandbox: &str) -> PoolKey {
        PoolKey {
            sandbox: SandboxId::new(sandbox),
            dst: "198.51.100.7:443".parse().expect("addr"),
            tls: true,
            name: Some(Hostname::parse("api.example.test").expect("name")),
            via: None,
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
}
