//! The attribution cache: per sandbox, `ip -> {name -> expiry}`.
//!
//! Each sandbox has its own bounded cache, so a sandbox that resolves
//! millions of names evicts only its own entries; the number of sandboxes is
//! bounded too, which bounds the whole. Expiry is decided on an injectable
//! [`Clock`]; an address not written for `max_ttl` + 60 s of real time (so
//! every name on it has long expired) is reclaimed, memory only.
//!
//! A sandbox's cache is an exact LRU behind one mutex: the `lru` crate's
//! [`LruCache`], unbounded, with the bound kept here so that an eviction for
//! size can be counted and remembered as a ghost. Recording an answer for a
//! known address is a hash probe, a merge of at most `names_per_ip` names and
//! a relink, with no allocation besides the merged entry (a new address adds
//! the crate's list node); a lookup is a hash probe, a relink and an `Arc`
//! clone. Either holds the lock for well under a microsecond, and only that
//! sandbox's DNS answers and flows share it.
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
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::{Duration, Instant};

use egress_policy::{AttributionGap, Hostname, SandboxId};
use lru::LruCache;

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
    /// What a sandbox's names may weigh over all its addresses (default
    /// 8 MiB): each name its length plus [`NAME_OVERHEAD`]. Past it, the
    /// least recently used addresses are evicted, as past `per_sandbox_ips`.
    /// Without it, 32 names of 253 bytes on each of 65,536 addresses would
    /// be half a gigabyte for one sandbox.
    pub name_bytes_per_sandbox: usize,
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
    /// The sandbox's addresses, most recently used first.
    lru: Mutex<LruCache<IpAddr, Slot>>,
    /// Addresses kept at most. The [`LruCache`] itself is unbounded: a bound
    /// of 0 must store nothing, and an eviction for size is counted here.
    capacity: usize,
    /// What the names held weigh ([`IpNames::weight`]); changed only under
    /// the `lru` lock.
    weight: std::sync::atomic::AtomicUsize,
    /// The bound on `weight`.
    max_weight: usize,
    /// Addresses evicted for size, so a miss can say `evicted`.
    evicted: Ghosts,
    /// Origin of [`Slot::written`] (real time: reclaim is about memory).
    origin: Instant,
    /// Seconds after its last write that an address is reclaimed.
    reclaim_after: u64,
    evictions: Arc<AtomicU64>,
}

/// What a sandbox's cache holds for one address.
struct Slot {
    names: Arc<IpNames>,
    /// Seconds since [`SandboxCache::origin`] at the last write.
    written: u64,
}

/// What one name held in the cache is counted as weighing beyond its
/// length: its `String` and its expiry.
pub(crate) const NAME_OVERHEAD: usize = 32;

/// The names attributed to one address, with their expiries.
#[derive(Debug)]
pub struct IpNames {
    names: Vec<Hostname>,
    /// One per name, in the same order.
    expires: Vec<Millis>,
    /// The earliest expiry: before it, every name is live and a lookup borrows.
    first_expiry: Millis,
}

/// The answer to "which names did this sandbox resolve to this IP?".
/// Cloned without copying a name: it shares the entry as it was.
#[derive(Clone, Debug)]
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
            name_bytes_per_sandbox: 8 << 20,
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

    /// What these names weigh: their lengths, and [`NAME_OVERHEAD`] each.
    fn weight(&self) -> usize {
        self.names
            .iter()
            .map(|n| n.as_str().len() + NAME_OVERHEAD)
            .sum()
    }

    /// The names `a` attributes, expiring at `expiry`.
    fn new(now: Millis, names: &[Hostname], expiry: Millis, cap: usize) -> Self {
        let mut fresh = Self {
            names: Vec::with_capacity(names.len()),
            expires: Vec::with_capacity(names.len()),
            first_expiry: now,
        };
        fresh.merge(now, names, expiry, cap);
        fresh
    }

    /// A copy of the live names, with room for `more`.
    fn live_copy(&self, now: Millis, more: usize) -> Self {
        let mut copy = Self {
            names: Vec::with_capacity(self.names.len() + more),
            expires: Vec::with_capacity(self.names.len() + more),
            first_expiry: self.first_expiry,
        };
        for (n, e) in self.live(now) {
            copy.names.push(n.clone());
            copy.expires.push(e);
        }
        copy
    }

    /// Drops the expired names, adds `names` (or extends their expiry), and
    /// keeps at most `cap`: past that, the soonest to expire of the names
    /// this answer did not give are dropped (of equal expiries, the later in
    /// order): a sandbox was just answered `names` for this address and
    /// connects on them next, however short their TTL. No sort; in place.
    fn merge(&mut self, now: Millis, names: &[Hostname], expiry: Millis, cap: usize) {
        if self.first_expiry <= now {
            let mut kept = 0;
            for i in 0..self.names.len() {
                if self.expires[i] > now {
                    self.names.swap(kept, i);
                    self.expires.swap(kept, i);
                    kept += 1;
                }
            }
            self.names.truncate(kept);
            self.expires.truncate(kept);
        }
        for n in names {
            match self.names.iter().position(|m| m == n) {
                // A later answer with a shorter TTL does not cut short an earlier one.
                Some(i) => self.expires[i] = self.expires[i].max(expiry),
                None => {
                    self.names.push(n.clone());
                    self.expires.push(expiry);
                }
            }
        }
        while self.names.len() > cap {
            // The soonest to expire, of the names not just given if any
            // is left; of equal expiries, the last.
            let older = |i: usize| !names.contains(&self.names[i]);
            let any_older = (0..self.names.len()).any(older);
            let mut at = None;
            for (i, e) in self.expires.iter().enumerate() {
                let candidate = !any_older || older(i);
                if candidate && at.is_none_or(|a: usize| *e <= self.expires[a]) {
                    at = Some(i);
                }
            }
            let at = at.unwrap_or(0);
            self.names.remove(at);
            self.expires.remove(at);
        }
        self.first_expiry = self.expires.iter().copied().min().unwrap_or(now);
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
        let now = self.clock.now();
        let expiry = now.saturating_add(self.lifetime(a.ttl));
        self.record_until(sandbox, &a.names, &a.addrs, expiry)
    }

    /// Restores what another gateway attributed (a takeover): each name on
    /// `ip` lives exactly as long as it had left there, never longer than
    /// `max_ttl` (the floor is not applied: nothing is extended). Returns
    /// false when the sandbox could not get a cache.
    pub fn restore(&self, sandbox: &SandboxId, ip: IpAddr, names: &[(Hostname, Duration)]) -> bool {
        let now = self.clock.now();
        names.iter().all(|(name, left)| {
            let expiry = now.saturating_add((*left).min(self.config.max_ttl));
            self.record_until(sandbox, std::slice::from_ref(name), &[ip], expiry)
        })
    }

    fn record_until(
        &self,
        sandbox: &SandboxId,
        a_names: &[Hostname],
        addrs: &[IpAddr],
        expiry: Millis,
    ) -> bool {
        let Some(cache) = self.sandbox_cache(sandbox) else {
            return false;
        };
        let now = self.clock.now();
        let written = cache.seconds();
        let cap = self.config.names_per_ip;
        // Entries replaced or reclaimed are dropped after the lock is released.
        let mut dropped = Vec::new();
        let mut lru = cache.lock();
        for ip in addrs {
            // An address is kept as flows carry it: an IPv4-mapped one as IPv4.
            let ip = &ip.to_canonical();
            cache.evicted.remove(ip);
            // Written again, an address is used again: `get_mut` relinks it first.
            match lru.get_mut(ip) {
                Some(slot) => {
                    let before = slot.names.weight();
                    slot.merge(now, a_names, expiry, cap, &mut dropped);
                    slot.written = written;
                    cache.reweigh(before, slot.names.weight());
                }
                None => {
                    let names = Arc::new(IpNames::new(now, a_names, expiry, cap));
                    cache.insert(&mut lru, *ip, Slot { names, written }, &mut dropped);
                }
            }
        }
        cache.reclaim(&mut lru, written, &mut dropped);
        cache.lighten(&mut lru, &mut dropped);
        drop(lru);
        drop(dropped);
        true
    }

    /// The live names `sandbox` resolved to `ip`, or why there are none.
    pub fn names_for(&self, sandbox: &SandboxId, ip: IpAddr) -> Lookup {
        let ip = ip.to_canonical();
        let Some(cache) = self.existing(sandbox) else {
            return Lookup::Missing(AttributionGap::NoDnsSeen);
        };
        let now = self.clock.now();
        let seconds = cache.seconds();
        let found = {
            let mut lru = cache.lock();
            // A lookup is a use. One not to be reclaimed, that is: a stale
            // address stays where it is, on its way to the tail and reclaim.
            match lru.peek(&ip) {
                Some(slot) if !cache.reclaimable(slot, seconds) => {
                    let names = slot.names.clone();
                    lru.promote(&ip);
                    Some(names)
                }
                _ => None,
            }
        };
        match found {
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
        let seconds = cache.seconds();
        let all: Vec<(IpAddr, Arc<IpNames>)> = {
            // `iter` reads without relinking: listing is not a use.
            let lru = cache.lock();
            lru.iter()
                .filter(|(_, slot)| !cache.reclaimable(slot, seconds))
                .map(|(ip, slot)| (*ip, slot.names.clone()))
                .collect()
        };
        let now = self.clock.now();
        let mut out: Vec<_> = all
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

    /// Forgets every sandbox `keep` says no to (a resync replaced the
    /// gateway's sandboxes): a sandbox created later under a removed one's
    /// ID starts with no evidence.
    pub fn retain_sandboxes(&self, keep: impl Fn(&SandboxId) -> bool) {
        if let Ok(mut map) = self.sandboxes.write() {
            map.retain(|id, _| keep(id));
        }
    }

    /// Addresses cached over all sandboxes (a metric).
    pub fn entry_count(&self) -> u64 {
        self.all().iter().map(|c| c.lock().len() as u64).sum()
    }

    /// Addresses evicted for size since start (a metric).
    pub fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::Relaxed)
    }

    /// Attributions dropped because no cache could be made for the sandbox (a metric).
    pub fn refused_sandboxes(&self) -> u64 {
        self.refused_sandboxes.load(Ordering::Relaxed)
    }

    /// Reclaims every address not written for `max_ttl` + 60 s (the size
    /// bound is always exact; this only makes the reclaim exact too).
    pub fn sync(&self) {
        for c in self.all() {
            let seconds = c.seconds();
            let mut dropped = Vec::new();
            let mut lru = c.lock();
            let stale: Vec<IpAddr> = lru
                .iter()
                .filter(|(_, slot)| c.reclaimable(slot, seconds))
                .map(|(ip, _)| *ip)
                .collect();
            for ip in stale {
                if let Some(old) = lru.pop(&ip) {
                    c.reweigh(old.names.weight(), 0);
                    dropped.push(old.names);
                }
            }
            drop(lru);
            drop(dropped);
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
            let refused = self.refused_sandboxes.fetch_add(1, Ordering::Relaxed);
            // Once every 1,024 refusals, not once per answer: a sandbox's
            // DNS must not flood the log (and journald's rate limit).
            if refused.is_multiple_of(1_024) {
                tracing::warn!(%sandbox, max = self.config.max_sandboxes, refused = refused + 1, "attribution cache full of sandboxes; not recording (logged once every 1,024 refusals; egress_attribution_sandboxes_refused_total counts each)");
            }
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
        let capacity = usize::try_from(config.per_sandbox_ips).unwrap_or(usize::MAX);
        Self {
            // Unbounded, so the map grows with use rather than being sized for
            // the bound up front: most sandboxes resolve a handful of names.
            lru: Mutex::new(LruCache::unbounded()),
            capacity,
            weight: std::sync::atomic::AtomicUsize::new(0),
            max_weight: config.name_bytes_per_sandbox,
            evicted: Ghosts::new(slots.clamp(1_024, 1 << 24)),
            origin: Instant::now(),
            reclaim_after: config
                .max_ttl
                .saturating_add(Duration::from_secs(60))
                .as_secs(),
            evictions,
        }
    }

    fn lock(&self) -> MutexGuard<'_, LruCache<IpAddr, Slot>> {
        // Every update leaves the cache consistent before it can panic: the
        // crate's operations are whole, and a merge only rewrites one entry.
        self.lru.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whole seconds since `origin`.
    fn seconds(&self) -> u64 {
        self.origin.elapsed().as_secs()
    }

    /// Not written for `reclaim_after` at `seconds`: as good as gone.
    fn reclaimable(&self, slot: &Slot, seconds: u64) -> bool {
        slot.written.saturating_add(self.reclaim_after) <= seconds
    }

    /// Puts a new address in, evicting the least recently used while full
    /// (counted, and remembered as evicted); nothing is kept at capacity 0.
    fn insert(
        &self,
        lru: &mut LruCache<IpAddr, Slot>,
        ip: IpAddr,
        slot: Slot,
        dropped: &mut Vec<Arc<IpNames>>,
    ) {
        while lru.len() >= self.capacity {
            if !self.evict_lru(lru, dropped) {
                break;
            }
        }
        if self.capacity > 0 {
            self.reweigh(0, slot.names.weight());
            lru.put(ip, slot);
        }
    }

    /// Evicts the least recently used address (counted, and remembered as
    /// evicted); whether there was one.
    fn evict_lru(&self, lru: &mut LruCache<IpAddr, Slot>, dropped: &mut Vec<Arc<IpNames>>) -> bool {
        let Some((ip, old)) = lru.pop_lru() else {
            return false;
        };
        self.evictions.fetch_add(1, Ordering::Relaxed);
        self.evicted.insert(&ip);
        self.reweigh(old.names.weight(), 0);
        dropped.push(old.names);
        true
    }

    /// Evicts the least recently used addresses while the names weigh more
    /// than `max_weight`.
    fn lighten(&self, lru: &mut LruCache<IpAddr, Slot>, dropped: &mut Vec<Arc<IpNames>>) {
        while self.weight.load(Ordering::Relaxed) > self.max_weight {
            if !self.evict_lru(lru, dropped) {
                break;
            }
        }
    }

    /// Accounts an entry that weighed `before` and weighs `after` now.
    fn reweigh(&self, before: usize, after: usize) {
        let w = self.weight.load(Ordering::Relaxed);
        self.weight.store(
            w.saturating_add(after).saturating_sub(before),
            Ordering::Relaxed,
        );
    }

    /// Memory reclaim: the least recently used, if not written for long.
    /// Not an eviction: its names have long expired, nothing is lost.
    fn reclaim(
        &self,
        lru: &mut LruCache<IpAddr, Slot>,
        written: u64,
        dropped: &mut Vec<Arc<IpNames>>,
    ) {
        while lru
            .peek_lru()
            .is_some_and(|(_, slot)| self.reclaimable(slot, written))
        {
            if let Some((_, old)) = lru.pop_lru() {
                self.reweigh(old.names.weight(), 0);
                dropped.push(old.names);
            }
        }
    }
}

// === impl Slot ===

impl Slot {
    /// Merges names into this address's entry: in place when no lookup
    /// holds it, else into a copy, the lookup keeping its snapshot (the
    /// replaced entry goes to `dropped`).
    fn merge(
        &mut self,
        now: Millis,
        a_names: &[Hostname],
        expiry: Millis,
        cap: usize,
        dropped: &mut Vec<Arc<IpNames>>,
    ) {
        match Arc::get_mut(&mut self.names) {
            // No lookup holds this entry: merged in place, no copy.
            Some(entry) => entry.merge(now, a_names, expiry, cap),
            // A lookup still reads it: it keeps its snapshot.
            None => {
                let mut copy = self.names.live_copy(now, a_names.len());
                copy.merge(now, a_names, expiry, cap);
                dropped.push(std::mem::replace(&mut self.names, Arc::new(copy)));
            }
        }
    }
}

#[cfg(test)]
mod tests;
