//! The gateway's connection slots (`limits.max_connections`), and each
//! source address's share of them: one sandbox opening connections it holds
//! (a peek that never comes, a trickle of bytes) cannot take every slot and
//! leave the other sandboxes' connections reset at accept.
//!
//! A source holds at most its fair share, `max_connections / (n + 1)` for the
//! `n` sources holding slots (never below [`MIN_SOURCE_SHARE`]): alone it
//! may take half. A share once taken is kept as more sources come, so the
//! last eighth of the slots is a reserve: only a source holding fewer than
//! [`NEWCOMER`] takes from it: after sources filled their shares one after
//! another, a sandbox's first connections still find room there, for about
//! `max / 8 / NEWCOMER` newcomers (156 at the default 10,000). The first
//! sources' shares are not taken back while they hold them.

use std::net::IpAddr;
use std::sync::Arc;

use dns_attrib::held::{share_with_reserve, Held, Holds};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The fewest slots a source may hold however many hold some.
pub(crate) const MIN_SOURCE_SHARE: usize = 64;

/// A source holding fewer slots than this takes from the reserve too.
pub(crate) const NEWCOMER: usize = 8;

/// Every slot of the gateway, and who holds them.
pub(crate) struct Slots {
    all: Arc<Semaphore>,
    per_source: Holds<IpAddr>,
    max: usize,
}

/// One flow's slot, given back on drop.
pub(crate) struct Slot {
    _permit: OwnedSemaphorePermit,
    _held: Held<IpAddr>,
}

/// Why a connection got no slot.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum NoSlot {
    /// Its source holds its share already.
    Share,
    /// Every slot is held.
    Limit,
}

impl Slots {
    pub(crate) fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            all: Arc::new(Semaphore::new(max)),
            per_source: Holds::default(),
            max,
        })
    }

    /// A slot for a connection from `source`.
    pub(crate) fn take(&self, source: IpAddr) -> Result<Slot, NoSlot> {
        let max = self.max;
        // Read before the holds' lock: a flow ending meanwhile only leaves
        // more room than counted.
        let used = max.saturating_sub(self.all.available_permits());
        let share = |holding| share_with_reserve(max, used, holding, MIN_SOURCE_SHARE, NEWCOMER);
        // Every slot held is the limit, whoever holds them.
        let permit = self
            .all
            .clone()
            .try_acquire_owned()
            .map_err(|_| NoSlot::Limit)?;
        let held =
            Held::take(&self.per_source, source.to_canonical(), share).ok_or(NoSlot::Share)?;
        Ok(Slot {
            _permit: permit,
            _held: held,
        })
    }

    /// Slots held now.
    pub(crate) fn open(&self) -> usize {
        self.max - self.all.available_permits()
    }

    /// Waits until every slot is given back (the drain), for at most `wait`;
    /// the slots stay taken so nothing new starts. `false` on the timeout.
    pub(crate) async fn all_back(&self, wait: std::time::Duration) -> bool {
        let all = u32::try_from(self.max).unwrap_or(u32::MAX);
        match tokio::time::timeout(wait, self.all.acquire_many(all)).await {
            Ok(Ok(permits)) => {
                permits.forget();
                true
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A source at its share is refused while another still gets a slot;
    /// past every slot, the limit refuses; slots given back are taken again.
    #[test]
    fn a_source_holds_its_share_and_the_next_finds_room() {
        let slots = Slots::new(256);
        let a: IpAddr = "100.64.0.2".parse().expect("ip");
        let mapped: IpAddr = "::ffff:100.64.0.2".parse().expect("ip");
        let held: Vec<Slot> = std::iter::from_fn(|| slots.take(a).ok()).collect();
        assert_eq!(held.len(), 128, "alone, half");
        assert_eq!(
            slots.take(mapped).err(),
            Some(NoSlot::Share),
            "one source in either spelling"
        );
        let others: Vec<Slot> = (0..128u8)
            .map(|i| {
                slots
                    .take(IpAddr::from([100, 64, 1, i]))
                    .expect("room for others")
            })
            .collect();
        assert_eq!(slots.open(), 256);
        assert_eq!(
            slots.take("100.64.2.1".parse().expect("ip")).err(),
            Some(NoSlot::Limit)
        );
        drop(held);
        assert_eq!(slots.open(), 128);
        assert!(slots.take(a).is_ok());
        drop(others);
    }

    /// Sources that fill their shares one after another (each keeping what
    /// it took as more come) never take every slot: the last eighth is left
    /// to sources holding fewer than eight, so a new one still connects.
    #[test]
    fn sources_filling_their_shares_in_turn_leave_room() {
        let slots = Slots::new(1024);
        let mut held = Vec::new();
        let mut took = Vec::new();
        for i in 0..5u8 {
            let source = IpAddr::from([100, 64, 9, i]);
            let mine: Vec<Slot> = std::iter::from_fn(|| slots.take(source).ok()).collect();
            took.push(mine.len());
            held.push(mine);
        }
        // The third stops where the reserve begins; later ones take eight.
        assert_eq!(took, [512, 341, 43, 8, 8]);
        assert_eq!(slots.open(), 912);
        assert!(
            slots.take(IpAddr::from([100, 64, 10, 1])).is_ok(),
            "room for the next"
        );
    }
}
