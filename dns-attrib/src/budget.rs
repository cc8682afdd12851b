//! Per-sandbox DNS budgets: queries per second, and new distinct names per
//! minute, each a token bucket.
//!
//! A lookup leaves the gateway even when every flow to its name is denied,
//! so a sandbox can move data out in the names it asks (`<chunk>.attacker.example`,
//! one new name per chunk). The query-rate bucket bounds how hard a sandbox
//! can drive the proxy; the new-name bucket bounds how many names it can
//! send out, which is what such a channel spends. Past either, the query is
//! answered REFUSED (`dns_budget`) and nothing leaves.
//!
//! Buckets start full: the query bucket holds one second of its rate, the
//! name bucket one minute of its rate, and both refill continuously on the
//! injected [`Clock`](crate::Clock), in integer units ([`UNITS`] a token),
//! so tests move time instead of sleeping. A name is "new" when it is not
//! among the names the sandbox asked recently: a fixed table of
//! [`SEEN_SLOTS`] 32-bit fingerprints (SipHash, one key per process, of the name
//! ASCII-lower-cased) in buckets of four, the oldest of a bucket forgotten
//! first. A name asked again costs a query token only; a name forgotten
//! and asked again counts as new, which a legitimate sandbox's generous
//! budget absorbs and an exfiltrating one (every name new) cannot dodge.
//!
//! State is bounded: `max_sandboxes` sandboxes (and a margin) have buckets,
//! in [`SHARDS`] least-recently-used tables each behind its own mutex, so a
//! flood from one sandbox holds only its shard's lock, for a hash probe and
//! a little arithmetic, and never another shard's. Each table has room for
//! its share and a margin, so none evicts while fewer than `max_sandboxes`
//! have buckets; past that, a sandbox evicted for room (the least recently
//! active of its shard) starts over with full buckets when it returns.
//! About 2.2 KiB per sandbox that asks, taken as it asks: 43 MiB at most at
//! 16,384 sandboxes, 144 MiB at the gateway's default of 65,536.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::num::NonZeroUsize;
use std::sync::{Mutex, PoisonError};

use egress_policy::SandboxId;
use hickory_proto::rr::Name;
use lru::LruCache;

use crate::clock::Millis;

/// Units in one token: both rates are then whole units per millisecond
/// (a rate of `r` per second is `60·r`, of `r` per minute is `r`).
pub(crate) const UNITS: u64 = 60_000;

/// Name fingerprints remembered per sandbox.
pub(crate) const SEEN_SLOTS: usize = 512;

/// Independent tables (and locks) the sandboxes are spread over.
pub(crate) const SHARDS: usize = 16;

const WAYS: usize = 4;

/// The limits that apply to one sandbox's queries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BudgetLimits {
    /// Queries per second (the bucket holds one second of them).
    pub qps: u32,
    /// New distinct names per minute (the bucket holds one minute of them).
    pub new_names_per_minute: u32,
}

/// Which budget a query exceeded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Over {
    Queries,
    NewNames,
}

/// The budgets of every sandbox on this gateway.
pub(crate) struct Budgets {
    shards: Box<[Mutex<LruCache<SandboxId, SandboxBudget>>]>,
    keys: RandomState,
}

struct SandboxBudget {
    queries: Bucket,
    names: Bucket,
    seen: Box<[u32; SEEN_SLOTS]>,
    /// Whether the last check of each budget failed ([`Over`] as index):
    /// a crossing is logged once, not once per query.
    over: [bool; 2],
    /// When each budget's crossing was last reported: a sandbox that asks
    /// at twice its budget crosses it at every other query, and is
    /// reported once in [`REPORT_EVERY`].
    reported: [Option<Millis>; 2],
}

/// The least time between two reports of one sandbox's crossings of one
/// budget.
const REPORT_EVERY: u64 = 60_000;

/// A token bucket, in [`UNITS`].
struct Bucket {
    units: u64,
    at: Millis,
}

// === impl BudgetLimits ===

impl Default for BudgetLimits {
    fn default() -> Self {
        Self {
            qps: 500,
            new_names_per_minute: 1_000,
        }
    }
}

impl Over {
    pub fn code(self) -> &'static str {
        match self {
            Self::Queries => "qps",
            Self::NewNames => "new_names",
        }
    }
}

/// Room in each shard for `max_sandboxes` spread over [`SHARDS`] by a keyed
/// hash: the mean, plus six standard deviations of a shard's count and four.
/// A shard that filled at the mean would evict a sandbox's spent buckets
/// (handing it full ones) while the table as a whole had room: at 16,384
/// sandboxes a shard's count varies by about 31 around its 1,024. With the
/// margin (1,226 there) no shard fills before `max_sandboxes` sandboxes have
/// buckets but with odds below one in a billion, and the hash's key is the
/// process's own, so no sandbox can choose its shard.
fn shard_room(max_sandboxes: usize) -> usize {
    let mean = max_sandboxes.div_ceil(SHARDS);
    // The binomial's deviation, sqrt(n·p·(1-p)), is below sqrt(mean).
    mean + 6 * (mean.isqrt() + 1) + 4
}

// === impl Budgets ===

impl Budgets {
    /// Room for `max_sandboxes` sandboxes however they fall into the
    /// shards: see [`shard_room`].
    pub(crate) fn new(max_sandboxes: usize) -> Self {
        let per_shard = NonZeroUsize::new(shard_room(max_sandboxes)).unwrap_or(NonZeroUsize::MIN);
        Self {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(LruCache::new(per_shard)))
                .collect(),
            keys: RandomState::new(),
        }
    }

    /// Spends a query token of `sandbox`; `Err` when it has none left.
    pub(crate) fn query(
        &self,
        sandbox: &SandboxId,
        limits: BudgetLimits,
        now: Millis,
    ) -> Result<(), Crossing> {
        let per_ms = u64::from(limits.qps) * (UNITS / 1_000);
        let capacity = u64::from(limits.qps) * UNITS;
        self.with(sandbox, limits, now, |b| {
            let room = b.queries.take(capacity, per_ms, now);
            b.verdict(room, Over::Queries, now)
        })
    }

    /// Spends a new-name token of `sandbox` when `name` is new to it.
    #[cfg(test)]
    pub(crate) fn name(
        &self,
        sandbox: &SandboxId,
        name: &Name,
        limits: BudgetLimits,
        now: Millis,
    ) -> Result<(), Crossing> {
        self.question(sandbox, (name, 0), limits, now)
    }

    /// Spends a new-name token of `sandbox` when the question, its `name`
    /// and `variant` (what else of the question could carry data: see
    /// [`crate::proxy`]; 0 for an ordinary one), is new to it.
    pub(crate) fn question(
        &self,
        sandbox: &SandboxId,
        (name, variant): (&Name, u64),
        limits: BudgetLimits,
        now: Millis,
    ) -> Result<(), Crossing> {
        let fp = self.fingerprint(name, variant);
        let per_ms = u64::from(limits.new_names_per_minute) * (UNITS / 60_000);
        let capacity = u64::from(limits.new_names_per_minute) * UNITS;
        self.with(sandbox, limits, now, |b| {
            if b.seen_before(fp) {
                return Ok(());
            }
            let room = b.names.take(capacity, per_ms, now);
            if room {
                b.remember(fp);
            }
            b.verdict(room, Over::NewNames, now)
        })
    }

    /// Sandboxes with buckets now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).len()).sum()
    }

    fn with<T>(
        &self,
        sandbox: &SandboxId,
        limits: BudgetLimits,
        now: Millis,
        f: impl FnOnce(&mut SandboxBudget) -> T,
    ) -> T {
        // SHARDS is a power of two; the low bits of SipHash are uniform.
        let shard = (self.keys.hash_one(sandbox) as usize) & (SHARDS - 1);
        let mut table = lock(&self.shards[shard]);
        f(table.get_or_insert_mut_ref(sandbox, || SandboxBudget::full(limits, now)))
    }

    /// A fingerprint of `name` and `variant`, ASCII case ignored, never 0
    /// (0 is an empty slot).
    fn fingerprint(&self, name: &Name, variant: u64) -> u32 {
        let mut h = self.keys.build_hasher();
        h.write_u64(variant);
        for label in name.iter() {
            h.write_u8(u8::try_from(label.len()).unwrap_or(u8::MAX));
            for b in label {
                h.write_u8(b.to_ascii_lowercase());
            }
        }
        (h.finish() as u32).max(1)
    }
}

/// A query over budget, and whether it is the first since the sandbox was
/// last within it, and the first such in a minute (the proxy logs those).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Crossing {
    pub(crate) over: Over,
    pub(crate) first: bool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

// === impl SandboxBudget ===

impl SandboxBudget {
    fn full(limits: BudgetLimits, now: Millis) -> Self {
        Self {
            queries: Bucket {
                units: u64::from(limits.qps) * UNITS,
                at: now,
            },
            names: Bucket {
                units: u64::from(limits.new_names_per_minute) * UNITS,
                at: now,
            },
            seen: Box::new([0; SEEN_SLOTS]),
            over: [false; 2],
            reported: [None; 2],
        }
    }

    fn verdict(&mut self, room: bool, over: Over, now: Millis) -> Result<(), Crossing> {
        let flag = &mut self.over[over as usize];
        let crossed = !*flag;
        *flag = !room;
        if room {
            return Ok(());
        }
        let last = &mut self.reported[over as usize];
        let first = crossed && last.is_none_or(|at| now.0.saturating_sub(at.0) >= REPORT_EVERY);
        if first {
            *last = Some(now);
        }
        Err(Crossing { over, first })
    }

    fn bucket(fp: u32) -> std::ops::Range<usize> {
        let at = (fp as usize >> 8) % (SEEN_SLOTS / WAYS) * WAYS;
        at..at + WAYS
    }

    fn seen_before(&self, fp: u32) -> bool {
        self.seen[Self::bucket(fp)].contains(&fp)
    }

    /// Newest last; the oldest of the bucket falls out.
    fn remember(&mut self, fp: u32) {
        let slots = &mut self.seen[Self::bucket(fp)];
        slots.rotate_left(1);
        slots[WAYS - 1] = fp;
    }
}

// === impl Bucket ===

impl Bucket {
    /// Refills for the time since the last call, then takes a token if there is one.
    fn take(&mut self, capacity: u64, per_ms: u64, now: Millis) -> bool {
        let elapsed = now.0.saturating_sub(self.at.0);
        self.units = self
            .units
            .saturating_add(elapsed.saturating_mul(per_ms))
            .min(capacity);
        self.at = self.at.max(now);
        if self.units >= UNITS {
            self.units -= UNITS;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests;
