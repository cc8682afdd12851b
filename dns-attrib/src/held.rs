//! Shares of a bounded resource, counted per key: a sandbox's DNS queries in
//! flight, a source's DNS-over-TCP connections, a source's connections to
//! the gateway, a source's bytes in the flow log's queue. A key at its cap
//! takes no more, so one key cannot hold what the others need.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Counts held per key.
pub type Holds<K> = Arc<Mutex<HashMap<K, usize>>>;

/// One of a key's holds (of `units`), given back on drop.
pub struct Held<K: Eq + std::hash::Hash> {
    holds: Holds<K>,
    key: K,
    units: usize,
}

/// The fair share of `total` places when `holding` keys hold some: what is
/// left if one more key came, never below `floor`. A few keys at their
/// share leave room for the next one.
pub fn fair_share(total: usize, holding: usize, floor: usize) -> usize {
    (total / (holding + 1)).max(floor)
}

/// A key's share of `total` when `used` of it is taken and `holding` keys
/// hold some: its [`fair_share`], and once the last eighth is reached no
/// more than `newcomer`. A share once taken is kept as more keys come, so
/// that last eighth is a reserve only keys holding little take from:
/// however many keys filled their shares one after another, the next one
/// still finds room.
pub fn share_with_reserve(
    total: usize,
    used: usize,
    holding: usize,
    floor: usize,
    newcomer: usize,
) -> usize {
    let share = fair_share(total, holding, floor);
    if used >= total - total / 8 {
        share.min(newcomer)
    } else {
        share
    }
}

impl<K: Eq + std::hash::Hash + Clone> Held<K> {
    /// A hold on `key`, unless it has its cap already: `cap` of the number
    /// of keys held, read under the same lock. A poisoned lock takes none.
    pub fn take(holds: &Holds<K>, key: K, cap: impl FnOnce(usize) -> usize) -> Option<Self> {
        Self::take_units(holds, key, 1, cap)
    }

    /// `units` held on `key` at once (bytes, say), unless that would take
    /// it past its cap.
    pub fn take_units(
        holds: &Holds<K>,
        key: K,
        units: usize,
        cap: impl FnOnce(usize) -> usize,
    ) -> Option<Self> {
        let mut map = holds.lock().ok()?;
        let cap = cap(map.len());
        let n = map.entry(key.clone()).or_insert(0);
        if n.saturating_add(units) > cap {
            if *n == 0 {
                map.remove(&key);
            }
            return None;
        }
        *n += units;
        Some(Self {
            holds: holds.clone(),
            key,
            units,
        })
    }
}

impl<K: Eq + std::hash::Hash> Drop for Held<K> {
    fn drop(&mut self) {
        if let Ok(mut map) = self.holds.lock() {
            if let Some(n) = map.get_mut(&self.key) {
                *n -= self.units;
                if *n == 0 {
                    map.remove(&self.key);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Under contention each key gets its share and the next key still
    /// finds room; given back, a key's count goes and its slot in the map.
    #[test]
    fn a_key_takes_its_share_and_leaves_room_for_the_next() {
        let holds: Holds<u8> = Arc::default();
        let cap = |n| fair_share(12, n, 2);
        let first: Vec<_> = std::iter::from_fn(|| Held::take(&holds, 1, cap)).collect();
        assert_eq!(first.len(), 6, "alone, half of 12");
        let second: Vec<_> = std::iter::from_fn(|| Held::take(&holds, 2, cap)).collect();
        assert_eq!(second.len(), 4, "one of three");
        assert!(Held::take(&holds, 3, cap).is_some(), "room for a third");
        assert!(Held::take(&holds, 1, |_| 0).is_none());
        drop((first, second));
        assert!(holds.lock().expect("lock").is_empty());
        assert_eq!(fair_share(12, 100, 2), 2, "never below the floor");
    }

    /// Units are held and given back together; a take that would pass the
    /// cap takes nothing. Past seven eighths used, only the newcomer's cap.
    #[test]
    fn units_are_held_together_and_the_last_eighth_is_kept_for_newcomers() {
        let holds: Holds<u8> = Arc::default();
        let big = Held::take_units(&holds, 1, 700, |_| 1000).expect("fits");
        assert!(Held::take_units(&holds, 1, 301, |_| 1000).is_none());
        let small = Held::take_units(&holds, 1, 300, |_| 1000).expect("fits exactly");
        drop(big);
        assert_eq!(holds.lock().expect("lock").get(&1), Some(&300));
        drop(small);
        assert!(holds.lock().expect("lock").is_empty());
        assert_eq!(share_with_reserve(800, 699, 1, 8, 5), 400);
        assert_eq!(share_with_reserve(800, 700, 1, 8, 5), 5);
    }
}
