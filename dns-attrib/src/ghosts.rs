//! Addresses a sandbox's cache evicted for size, remembered compactly so a
//! later miss can say `evicted` rather than `no_dns_seen`.
//!
//! A fixed table of 32-bit fingerprints in buckets of four, allocated on
//! the first eviction: an address hashes (SipHash, keyed per table) to a
//! bucket and a fingerprint; its bucket keeps the four most recent
//! fingerprints that landed in it. Memory is 4 bytes a slot whatever the
//! flood; the most recent evictions are remembered (the last quarter-table
//! of them about 98% of the time), older ones fade as their buckets fill. A
//! never-seen address reads as evicted only if its bucket holds its own
//! 32-bit fingerprint: about one in a billion. Either way a miss denies (or
//! terminates): the table only chooses the reason an operator reads.

use std::hash::BuildHasher;
use std::net::IpAddr;
use std::sync::{Mutex, OnceLock, PoisonError};

const WAYS: usize = 4;

pub(crate) struct Ghosts {
    slots: OnceLock<Mutex<Box<[u32]>>>,
    buckets: usize,
    keys: std::collections::hash_map::RandomState,
}

impl Ghosts {
    /// A table of about `slots` fingerprints (a power of two of buckets of four).
    pub(crate) fn new(slots: usize) -> Self {
        Self {
            slots: OnceLock::new(),
            buckets: (slots / WAYS).max(1).next_power_of_two(),
            keys: std::collections::hash_map::RandomState::new(),
        }
    }

    /// The bucket's first slot and the fingerprint (never 0: 0 is empty).
    fn place(&self, ip: &IpAddr) -> (usize, u32) {
        let h = self.keys.hash_one(ip);
        let bucket = (h as usize) & (self.buckets - 1);
        ((bucket * WAYS), ((h >> 32) as u32).max(1))
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Box<[u32]>> {
        self.slots
            .get_or_init(|| Mutex::new(vec![0; self.buckets * WAYS].into_boxed_slice()))
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn insert(&self, ip: &IpAddr) {
        let (at, fp) = self.place(ip);
        let mut t = self.table();
        let bucket = &mut t[at..at + WAYS];
        // Newest last; the oldest falls out (or `fp` moves up if present).
        let from = bucket.iter().position(|x| *x == fp).unwrap_or(0);
        bucket[from..].rotate_left(1);
        bucket[WAYS - 1] = fp;
    }

    pub(crate) fn contains(&self, ip: &IpAddr) -> bool {
        if self.slots.get().is_none() {
            return false;
        }
        let (at, fp) = self.place(ip);
        self.table()[at..at + WAYS].contains(&fp)
    }

    /// Forgets `ip` (it was attributed again).
    pub(crate) fn remove(&self, ip: &IpAddr) {
        if self.slots.get().is_none() {
            return;
        }
        let (at, fp) = self.place(ip);
        for x in &mut self.table()[at..at + WAYS] {
            if *x == fp {
                *x = 0;
            }
        }
    }

    /// Bytes held (0 until the first eviction).
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        self.slots.get().map_or(0, |_| self.buckets * WAYS * 4)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    #[test]
    fn remembers_recent_evictions_in_fixed_memory() {
        let g = Ghosts::new(1 << 16);
        let ip = |n: u32| IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + n));
        assert!(!g.contains(&ip(1)));
        assert_eq!(g.bytes(), 0, "nothing allocated before the first eviction");
        for n in 0..1_000_000 {
            g.insert(&ip(n));
        }
        assert_eq!(g.bytes(), 4 << 16, "fixed size");
        // The last quarter-table of evictions is remembered.
        let recent = (1_000_000 - (1 << 14)..1_000_000)
            .filter(|n| g.contains(&ip(*n)))
            .count();
        assert!(recent > 15_700, "{recent} of the last 16,384");
        // Never-seen addresses do not read as evicted.
        let strangers = (0..100_000)
            .filter(|n| g.contains(&ip(50_000_000 + n)))
            .count();
        assert_eq!(strangers, 0);
        g.remove(&ip(999_999));
        assert!(!g.contains(&ip(999_999)));
    }
}
