//! Idle upstream connections, shared across client connections.
//!
//! A connection is pooled under the original destination *and* the name its
//! certificate was verified for, so a request is only ever sent over a
//! connection verified for the name it needs. Entries are bounded per key and
//! in total, and dropped after `MAX_IDLE` (origins close idle keep-alive
//! connections on their own schedule; a stale one would fail a request).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;
use egress_policy::Hostname;
use http_body_util::combinators::BoxBody;

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
    pub(crate) dst: SocketAddr,
    pub(crate) tls: bool,
    pub(crate) name: Option<Hostname>,
}

impl PoolKey {
    /// Whether this key is the one for `(dst, tls, name)`, without building it.
    pub(crate) fn is(&self, dst: SocketAddr, tls: bool, name: Option<&Hostname>) -> bool {
        self.dst == dst && self.tls == tls && self.name.as_ref() == name
    }
}

const MAX_PER_KEY: usize = 32;
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
        idle.total -= before - list.len();
        if list.is_empty() {
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
        if idle.total >= MAX_TOTAL {
            return;
        }
        let list = idle.by_key.entry(key).or_default();
        let shared = matches!(sender, Sender::H2(_));
        if list.len() >= MAX_PER_KEY || (shared && !list.is_empty()) {
            return;
        }
        list.push((Instant::now(), sender));
        idle.total += 1;
    }
}

impl std::fmt::Debug for UpstreamPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamPool").finish_non_exhaustive()
    }
}
