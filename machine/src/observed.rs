//! What a VM tried to reach and was refused (or, in audit, would have been):
//! a bounded store with counts and first/last seen, fed either by the log
//! group's events one packet at a time ([`Store::record`], exact), or by
//! reads of the kernel's `observed` set ([`Store::merge`], sampled).
//!
//! Sampled:
//! The kernel set is a buffer the size of the store; this store is the
//! record. Each read merges the kernel's per-element packet counters (a
//! counter lower than last read means the element was re-created: the whole
//! count is new). Past `capacity` entries the least recently seen are evicted
//! and counted; when the kernel set fills up, its least recently seen
//! elements are removed from the kernel (their counts stay here) so new
//! destinations keep being recorded.

use std::collections::HashMap;
use std::net::IpAddr;
#[cfg(test)]
use std::net::Ipv4Addr;
use std::time::{Duration, SystemTime};

use egress_policy::machine::Proto;

use super::nft::KernelObserved;

/// One destination.
pub type Key = (IpAddr, Proto, u16);

/// One observed destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seen {
    pub count: u64,
    pub first: SystemTime,
    pub last: SystemTime,
    /// The kernel counter at the last read, to add only what is new.
    kernel_packets: u64,
}

/// A VM's observed destinations, bounded.
#[derive(Debug)]
pub struct Store {
    capacity: usize,
    entries: HashMap<Key, Seen>,
    evictions: u64,
}

impl Store {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            entries: HashMap::new(),
            evictions: 0,
        }
    }

    /// Entries evicted by the bound so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Every entry, most recently seen first.
    pub fn entries(&self) -> Vec<(Key, Seen)> {
        let mut all: Vec<(Key, Seen)> = self.entries.iter().map(|(k, s)| (*k, *s)).collect();
        all.sort_by(|a, b| b.1.last.cmp(&a.1.last).then(a.0.cmp(&b.0)));
        all
    }

    /// Merges one read of the kernel set taken at `now`; returns the
    /// elements to remove from the kernel (evicted here, or trimmed to keep
    /// room in the kernel set), each one in `kernel`: a delete of one that
    /// is not there fails the whole transaction. Once they are removed,
    /// [`Store::forgotten`].
    pub fn merge(&mut self, now: SystemTime, kernel: &[KernelObserved]) -> Vec<Key> {
        for k in kernel {
            let key = (k.addr, k.proto, k.port);
            let at = now.checked_sub(k.idle).unwrap_or(now);
            let seen = self.entries.entry(key).or_insert(Seen {
                count: 0,
                first: at,
                last: at,
                kernel_packets: 0,
            });
            let new = if k.packets >= seen.kernel_packets {
                k.packets - seen.kernel_packets
            } else {
                k.packets
            };
            seen.count = seen.count.saturating_add(new);
            seen.kernel_packets = k.packets;
            if new > 0 || at > seen.last {
                seen.last = seen.last.max(at);
            }
        }
        let mut forget = Vec::new();
        if self.entries.len() > self.capacity {
            let excess = self.entries.len() - self.capacity;
            let in_kernel: std::collections::HashSet<Key> =
                kernel.iter().map(|k| (k.addr, k.proto, k.port)).collect();
            for (key, _) in self.oldest(excess) {
                self.entries.remove(&key);
                self.evictions += 1;
                if in_kernel.contains(&key) {
                    forget.push(key);
                }
            }
        }
        // Keep an eighth of the kernel set free for new destinations.
        let high = self.capacity - self.capacity / 8;
        if kernel.len() > high {
            let mut in_kernel: Vec<&KernelObserved> = kernel
                .iter()
                .filter(|k| !forget.contains(&(k.addr, k.proto, k.port)))
                .collect();
            in_kernel.sort_by_key(|k| std::cmp::Reverse(k.idle));
            let trim = kernel.len().saturating_sub(high) + self.capacity / 16;
            for k in in_kernel.into_iter().take(trim) {
                forget.push((k.addr, k.proto, k.port));
            }
        }
        forget
    }

    /// `keys` were removed from the kernel set: their counters there start
    /// again from zero, and all they count next is new. (Until the removal
    /// is known to have taken, the kernel's counts stay the baseline: a
    /// removal that failed would otherwise count them twice.)
    pub fn forgotten(&mut self, keys: &[Key]) {
        for key in keys {
            if let Some(seen) = self.entries.get_mut(key) {
                seen.kernel_packets = 0;
            }
        }
    }

    /// Records one logged packet seen at `at` (events): the count is one
    /// more, and the times widen to take `at` in. Past `capacity`, the
    /// least recently seen sixteenth goes at once (so a flood of new
    /// destinations sorts the store once per sixteenth, not per packet),
    /// counted as evictions.
    pub fn record(&mut self, key: Key, at: SystemTime) {
        let seen = self.entries.entry(key).or_insert(Seen {
            count: 0,
            first: at,
            last: at,
            kernel_packets: 0,
        });
        seen.count = seen.count.saturating_add(1);
        seen.first = seen.first.min(at);
        seen.last = seen.last.max(at);
        if self.entries.len() > self.capacity {
            let excess = self.entries.len() - self.capacity + self.capacity / 16;
            for (key, _) in self.oldest(excess) {
                self.entries.remove(&key);
                self.evictions += 1;
            }
        }
    }

    fn oldest(&self, n: usize) -> Vec<(Key, Seen)> {
        let mut all = self.entries();
        let keep = all.len().saturating_sub(n);
        all.split_off(keep)
    }
}

/// Seconds since the epoch, for the API.
pub fn unix(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_secs()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(last_octet: u8, port: u16, packets: u64, idle: u64) -> KernelObserved {
        KernelObserved {
            addr: IpAddr::V4(Ipv4Addr::new(198, 51, 100, last_octet)),
            proto: Proto::Tcp,
            port,
            packets,
            idle: Duration::from_secs(idle),
        }
    }

    #[test]
    fn counts_add_only_what_is_new_and_survive_recreation() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let mut s = Store::new(16);
        assert!(s.merge(t0, &[k(1, 443, 3, 0)]).is_empty());
        s.merge(t0 + Duration::from_secs(5), &[k(1, 443, 5, 1)]);
        let (key, seen) = s.entries()[0];
        assert_eq!(key.2, 443);
        assert_eq!(seen.count, 5);
        assert_eq!(seen.first, t0);
        assert_eq!(seen.last, t0 + Duration::from_secs(4));
        // The element expired and came back with a lower counter: all of it is new.
        s.merge(t0 + Duration::from_secs(10), &[k(1, 443, 2, 0)]);
        assert_eq!(s.entries()[0].1.count, 7);
        // Gone from the kernel: the record stays.
        s.merge(t0 + Duration::from_secs(15), &[]);
        assert_eq!(s.entries()[0].1.count, 7);
    }

    #[test]
    fn events_count_exactly_and_keep_their_times() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let key = (IpAddr::V4(Ipv4Addr::new(198, 51, 100, 1)), Proto::Tcp, 80);
        let mut s = Store::new(16);
        // Out of order (two datagrams can be read in either order).
        for ms in [300u64, 100, 900, 500] {
            s.record(key, t0 + Duration::from_millis(ms));
        }
        let (_, seen) = s.entries()[0];
        assert_eq!(seen.count, 4);
        assert_eq!(seen.first, t0 + Duration::from_millis(100));
        assert_eq!(seen.last, t0 + Duration::from_millis(900));
        // A flood of new destinations: bounded, the oldest go, counted.
        for i in 0..40u16 {
            let k = (IpAddr::V4(Ipv4Addr::new(203, 0, 113, 1)), Proto::Udp, i);
            s.record(k, t0 + Duration::from_secs(10 + u64::from(i)));
        }
        assert!(s.len() <= 16);
        assert_eq!(s.evictions(), 41 - s.len() as u64);
        assert!(
            s.entries().iter().any(|(k, _)| k.2 == 39),
            "the newest is kept"
        );
    }

    #[test]
    fn the_bound_evicts_the_least_recently_seen_and_counts() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let mut s = Store::new(16);
        let kernel: Vec<KernelObserved> =
            (0..20u8).map(|i| k(i, 80, 1, u64::from(100 - i))).collect();
        let forget = s.merge(t0, &kernel);
        assert_eq!(s.len(), 16);
        assert_eq!(s.evictions(), 4);
        // The four idle longest (octets 0..4) went, from here and the kernel.
        for i in 0..4u8 {
            assert!(forget.contains(&(IpAddr::V4(Ipv4Addr::new(198, 51, 100, i)), Proto::Tcp, 80)));
        }
        assert!(s
            .entries()
            .iter()
            .all(|(key, _)| matches!(key.0, IpAddr::V4(a) if a.octets()[3] >= 4)));
        // The kernel set was over 7/8 full: more were trimmed from it, not from here.
        assert!(forget.len() > 4);
    }

    /// Only what the kernel set holds is removed from it (a delete of an
    /// element that is not there fails the whole transaction), and an
    /// element's kernel count stays the baseline until its removal took.
    #[test]
    fn what_is_removed_from_the_kernel_is_there_and_counted_once() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let mut s = Store::new(16);
        // Round one: 15 in the kernel, over 7/8 of 16: the two idle longest
        // are trimmed from the kernel and kept here.
        let round1: Vec<KernelObserved> = (1..=15u8)
            .map(|i| k(i, 80, 3, u64::from(100 - i)))
            .collect();
        let trimmed = s.merge(t0, &round1);
        assert_eq!(trimmed.len(), 2, "{trimmed:?}");
        s.forgotten(&trimmed);
        // Round two: two new ones; the store is over its bound and evicts
        // the least recently seen, which are the trimmed ones, not in the kernel.
        let mut round2: Vec<KernelObserved> = (3..=15u8)
            .map(|i| k(i, 80, 3, u64::from(100 - i)))
            .collect();
        round2.extend([k(200, 443, 1, 0), k(201, 443, 1, 0)]);
        let t1 = t0 + Duration::from_secs(5);
        let forget = s.merge(t1, &round2);
        let in_kernel: Vec<Key> = round2.iter().map(|k| (k.addr, k.proto, k.port)).collect();
        for key in &forget {
            assert!(
                in_kernel.contains(key),
                "{key:?} is not in the kernel set: {forget:?}"
            );
        }
        // Their removal failed: the same read again counts nothing new.
        let total = |s: &Store| s.entries().iter().map(|(_, seen)| seen.count).sum::<u64>();
        let before = total(&s);
        s.merge(t1 + Duration::from_secs(5), &round2);
        assert_eq!(total(&s), before, "counted twice after a failed removal");
    }
}
