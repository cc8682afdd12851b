//! The attribution cache: per sandbox, `ip -> {name -> expiry}`.
//!
//! Each sandbox has its own bounded cache, so a sandbox that resolves
//! millions of names evicts only its own entries; the number of sandboxes is
//! bounded too, which bounds the whole. Expiry is decided on an injectable
//! [`Clock`]; moka's own time-based eviction only reclaims memory well after
//! the logical expiry.
//!
//! TTLs are clamped to `[min_ttl, max_ttl]`. The floor exists because a
//! TTL-0 (or 1 s) answer must still cover the connection that follows it:
//! the sandbox connects a few milliseconds to seconds after its resolver
//! returns, and an attribution that has already expired would turn a
//! legitimate flow into a denial or an interception.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use egress_policy::{AttributionGap, Hostname, SandboxId};
use moka::notification::RemovalCause;

use crate::chain::Attribution;
use crate::clock::{Clock, Millis};
use crate::ghosts::Ghosts;

/// Bounds and TTL clamp of the cache.
#[derive(Clone, Debug)]
pub struct CacheConfig {
    /// Floor on attribution lifetime (default 30 s); see the module docs.
    pub min_ttl: Duration,
    /// Ceiling on attribution lifetime (default 24 h).
    pub max_ttl: Duration,
    /// Addresses remembered per sandbox (default 65,536).
    pub per_sandbox_ips: u64,
    /// Names remembered per address (default 32): the soonest to expire go first.
    pub names_per_ip: usize,
    /// Sandboxes with a cache at once (default 4,096); past that, new
    /// sandboxes get no attribution (they fail closed) and a warning is logged.
    pub max_sandboxes: usize,
}

/// The attribution cache of every sandbox.
pub struct AttributionCache {
    config: CacheConfig,
    clock: Arc<dyn Clock>,
    sandboxes: RwLock<HashMap<SandboxId, Arc<SandboxCache>>>,
    evictions: Arc<AtomicU64>,
    refused_sandboxes: AtomicU64,
}

struct SandboxCache {
    ips: moka::sync::Cache<IpAddr, Arc<IpNames>>,
    /// Addresses evicted for size, so a miss can say `evicted`.
    evicted: Arc<Ghosts>,
}

/// The names attributed to one address, with their expiries.
#[derive(Debug)]
pub struct IpNames {
    names: Box<[Hostname]>,
    expires: Box<[Millis]>,
    /// The earliest expiry: before it, every name is live and a lookup borrows.
    first_expiry: Millis,
}

/// The answer to "which names did this sandbox resolve to this IP?".
#[derive(Debug)]
pub enum Lookup {
    Found { entry: Arc<IpNames>, now: Millis },
    Missing(AttributionGap),
}

// === impl CacheConfig ===

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            min_ttl: Duration::from_secs(30),
            max_ttl: Duration::from_secs(24 * 3600),
            per_sandbox_ips: 65_536,
            names_per_ip: 32,
            max_sandboxes: 4_096,
        }
    }
}

// === impl Lookup ===

impl Lookup {
    /// The live names: borrowed when none has expired (the common case), copied otherwise.
    pub fn names(&self) -> Cow<'_, [Hostname]> {
        match self {
            Self::Found { entry, now } if *now < entry.first_expiry => Cow::Borrowed(&entry.names),
            Self::Found { entry, now } => {
                Cow::Owned(entry.live(*now).map(|(n, _)| n.clone()).collect())
            }
            Self::Missing(_) => Cow::Borrowed(&[]),
        }
    }

    /// Why there are no names, for the verdict's reason.
    pub fn gap(&self) -> AttributionGap {
        match self {
            Self::Found { .. } => AttributionGap::NoMatch,
            Self::Missing(gap) => *gap,
        }
    }
}

// === impl IpNames ===

impl IpNames {
    /// Names not yet expired at `now`, with their expiry.
    pub fn live(&self, now: Millis) -> impl Iterator<Item = (&Hostname, Millis)> {
        self.names
            .iter()
            .zip(self.expires.iter().copied())
            .filter(move |(_, e)| *e > now)
    }

    fn merged(
        old: Option<&Self>,
        now: Millis,
        names: &[Hostname],
        expiry: Millis,
        cap: usize,
    ) -> Self {
        let mut all: Vec<(Hostname, Millis)> = old
            .map(|o| o.live(now).map(|(n, e)| (n.clone(), e)).collect())
            .unwrap_or_default();
        for n in names {
            match all.iter_mut().find(|(m, _)| m == n) {
                // A later answer with a shorter TTL does not cut short an earlier one.
                Some((_, e)) => *e = (*e).max(expiry),
                None => all.push((n.clone(), expiry)),
            }
        }
        if all.len() > cap {
            all.sort_by_key(|(_, e)| std::cmp::Reverse(*e));
            all.truncate(cap);
        }
        let first_expiry = all.iter().map(|(_, e)| *e).min().unwrap_or(now);
        let (names, expires): (Vec<_>, Vec<_>) = all.into_iter().unzip();
        Self {
            names: names.into(),
            expires: expires.into(),
            first_expiry,
        }
    }
}

// === impl AttributionCache ===

impl AttributionCache {
    pub fn new(config: CacheConfig, clock: Arc<dyn Clock>) -> Self {
        Self {
            config,
            clock,
            sandboxes: RwLock::new(HashMap::new()),
            evictions: Arc::new(AtomicU64::new(0)),
            refused_sandboxes: AtomicU64::new(0),
        }
    }

    pub fn now(&self) -> Millis {
        self.clock.now()
    }

    /// The clamped lifetime of an answer with `ttl` seconds.
    pub fn lifetime(&self, ttl: u32) -> Duration {
        Duration::from_secs(u64::from(ttl)).clamp(self.config.min_ttl, self.config.max_ttl)
    }

    /// Records what one answer attributes. Returns false when the sandbox
    /// could not get a cache (too many sandboxes).
    pub fn record(&self, sandbox: &SandboxId, a: &Attribution) -> bool {
        let Some(cache) = self.sandbox_cache(sandbox) else {
            return false;
        };
        let now = self.clock.now();
        let expiry = now.saturating_add(self.lifetime(a.ttl));
        for ip in &a.addrs {
            cache.evicted.remove(ip);
            cache.ips.entry(*ip).and_upsert_with(|old| {
                let old = old.map(|e| e.into_value());
                Arc::new(IpNames::merged(
                    old.as_deref(),
                    now,
                    &a.names,
                    expiry,
                    self.config.names_per_ip,
                ))
            });
        }
        true
    }

    /// The live names `sandbox` resolved to `ip`, or why there are none.
    pub fn names_for(&self, sandbox: &SandboxId, ip: IpAddr) -> Lookup {
        let Some(cache) = self.existing(sandbox) else {
            return Lookup::Missing(AttributionGap::NoDnsSeen);
        };
        let now = self.clock.now();
        match cache.ips.get(&ip) {
            Some(entry) if entry.live(now).next().is_some() => Lookup::Found { entry, now },
            Some(_) => Lookup::Missing(AttributionGap::Expired),
            None if cache.evicted.contains(&ip) => Lookup::Missing(AttributionGap::Evicted),
            None => Lookup::Missing(AttributionGap::NoDnsSeen),
        }
    }

    /// Every live entry of `sandbox`: address, then names with their remaining lifetime.
    pub fn entries(&self, sandbox: &SandboxId) -> Vec<(IpAddr, Vec<(Hostname, Duration)>)> {
        let Some(cache) = self.existing(sandbox) else {
            return Vec::new();
        };
        let now = self.clock.now();
        let mut out: Vec<_> = cache
            .ips
            .iter()
            .map(|(ip, e)| {
                let names: Vec<_> = e
                    .live(now)
                    .map(|(n, x)| (n.clone(), x.remaining_after(now)))
                    .collect();
                (*ip, names)
            })
            .filter(|(_, names)| !names.is_empty())
            .collect();
        out.sort_by_key(|(ip, _)| *ip);
        out
    }

    /// Forgets a sandbox (it was removed from the gateway).
    pub fn remove_sandbox(&self, sandbox: &SandboxId) {
        if let Ok(mut map) = self.sandboxes.write() {
            map.remove(sandbox);
        }
    }

    /// Addresses cached over all sandboxes (a metric; approximate until maintenance runs).
    pub fn entry_count(&self) -> u64 {
        self.all().iter().map(|c| c.ips.entry_count()).sum()
    }

    /// Addresses evicted for size since start (a metric).
    pub fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::Relaxed)
    }

    /// Attributions dropped because no cache could be made for the sandbox (a metric).
    pub fn refused_sandboxes(&self) -> u64 {
        self.refused_sandboxes.load(Ordering::Relaxed)
    }

    /// Runs pending maintenance (evictions), making counts exact.
    pub fn sync(&self) {
        for c in self.all() {
            c.ips.run_pending_tasks();
        }
    }

    fn all(&self) -> Vec<Arc<SandboxCache>> {
        self.sandboxes
            .read()
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default()
    }

    fn existing(&self, sandbox: &SandboxId) -> Option<Arc<SandboxCache>> {
        self.sandboxes.read().ok()?.get(sandbox).cloned()
    }

    fn sandbox_cache(&self, sandbox: &SandboxId) -> Option<Arc<SandboxCache>> {
        if let Some(c) = self.existing(sandbox) {
            return Some(c);
        }
        let mut map = self.sandboxes.write().ok()?;
        if let Some(c) = map.get(sandbox) {
            return Some(c.clone());
        }
        if map.len() >= self.config.max_sandboxes {
            self.refused_sandboxes.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%sandbox, max = self.config.max_sandboxes, "attribution cache full of sandboxes; not recording");
            return None;
        }
        let c = Arc::new(SandboxCache::new(&self.config, self.evictions.clone()));
        map.insert(sandbox.clone(), c.clone());
        Some(c)
    }
}

impl fmt::Debug for AttributionCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AttributionCache")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

// === impl SandboxCache ===

impl SandboxCache {
    fn new(config: &CacheConfig, evictions: Arc<AtomicU64>) -> Self {
        // Four slots per cached address: a flood is remembered as `evicted`
        // for about four cache-fulls of names, in 16 bytes per cached address.
        let slots = usize::try_from(config.per_sandbox_ips.saturating_mul(4)).unwrap_or(1 << 20);
        let evicted = Arc::new(Ghosts::new(slots.clamp(1_024, 1 << 24)));
        let ghost = evicted.clone();
        let ips = moka::sync::Cache::builder()
            .max_capacity(config.per_sandbox_ips)
            // LRU, not TinyLFU: a fresh answer must always be admitted, or the
            // connection that follows it would find no attribution.
            .eviction_policy(moka::policy::EvictionPolicy::lru())
            // Memory reclaim only: logical expiry is decided on the injected clock.
            .time_to_live(config.max_ttl + Duration::from_secs(60))
            .eviction_listener(move |ip: Arc<IpAddr>, _, cause| {
                if cause == RemovalCause::Size {
                    evictions.fetch_add(1, Ordering::Relaxed);
                    ghost.insert(&ip);
                }
            })
            .build();
        Self { ips, evicted }
    }
}

#[cfg(test)]
mod tests;
