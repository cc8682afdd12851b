//! Budget state: per sandbox and `budgets` entry, a request bucket and a
//! byte bucket ([`egress_policy::budget`]), spent by every flow and request
//! the policy let through.
//!
//! Buckets start full and refill continuously: the request bucket holds a
//! minute of its rate, the byte bucket an hour of its rate. Both count in
//! integer units, one token being the period in milliseconds (60,000 for a
//! request, 3,600,000 for a byte), so a limit is also its refill in units
//! per millisecond and 1 TiB an hour still fits a `u64`. Time is passed in
//! ([`Millis`]): the table reads no clock, and tests move time by hand.
//!
//! A byte budget that a flow crosses is drained to zero (the flow is cut
//! there), and a new spliced or opaque flow needs at least [`MIN_TO_START`]
//! bytes left: less would be cut before a TLS handshake finished.
//!
//! State is bounded: at most `limits.max_budget_states` entries, spread over
//! [`SHARDS`] maps each behind its own lock. A shard that is full forgets a
//! state whose buckets have refilled completely — starting over from full
//! grants nothing such a state would not — and if none has, the new state
//! is refused: the flow or request that needed it is refused
//! `budget_exceeded` (fail closed), counted in
//! `egress_budget_states_full_total`. Forgetting a partly spent bucket would
//! hand its sandbox a fresh budget, which a sandbox could provoke by
//! touching many destinations; refusing cannot be turned into more bytes.
//! A policy push that changes an entry's limit keeps the entry's state,
//! capped at the new capacity. About 120 bytes a state: 8 MiB at 65,536.

pub(crate) mod saved;

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::{Mutex, MutexGuard, PoisonError};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use dns_attrib::held::share_with_reserve;
use dns_attrib::{AttributionCache, Millis};
use egress_policy::{Budget, BudgetDestination, SandboxId};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use serde::{Deserialize, Serialize};

/// Independent maps (and locks) the states are spread over.
pub(crate) const SHARDS: usize = 16;

/// Bytes a byte budget must have left for a new spliced or opaque flow.
pub(crate) const MIN_TO_START: u64 = 1024;

const MINUTE_MS: u64 = 60_000;
const HOUR_MS: u64 = 3_600_000;

/// Which budget was exceeded (the `kind` of `egress_budget_exceeded_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Over {
    Requests,
    Bytes,
    /// No room for the state this needed (fail closed).
    NoState,
}

/// The budget states of every sandbox on this gateway.
pub(crate) struct BudgetTable {
    shards: Box<[Mutex<HashMap<Key, State>>]>,
    per_shard: usize,
    keys: RandomState,
    /// States held now (`egress_budget_states`).
    gauge: Gauge,
    /// States refused for want of room (`egress_budget_states_full_total`).
    full: Counter,
    /// States each sandbox holds, across the shards (taken after a shard's
    /// lock): one sandbox may not hold more than [`MAX_STATES_PER_SANDBOX`],
    /// nor, once the table is seven eighths full, more than
    /// [`RESERVE_STATES`] — so sandboxes that spend on new destinations
    /// from push to push cannot leave the others none.
    held: Mutex<HashMap<SandboxId, usize>>,
    /// When refilled states were last forgotten all at once (ms; [`BudgetTable::sweep`]).
    swept: std::sync::atomic::AtomicU64,
}

/// Most states one sandbox holds: twice the entries a policy may have
/// (states of entries a push took out stay until they refill).
pub(crate) const MAX_STATES_PER_SANDBOX: usize = 2 * egress_policy::budget::MAX_BUDGETS;
/// Most states a sandbox may hold for a new one to be made once the table
/// is seven eighths full.
pub(crate) const RESERVE_STATES: usize = 8;
/// [`BudgetTable::swept`] before any sweep.
const NEVER: u64 = u64::MAX;
/// How long a refilled state must have been untouched for a sweep to
/// forget it: one in use (a request now and then, a body being charged) stays.
const IDLE_SWEPT_MS: u64 = 60_000;

/// A sandbox and its `budgets` entry's destination: an entry keeps its state
/// when a push adds, removes or reorders other entries (keyed by its index,
/// it would pass its spent state to another destination and start full).
type Key = (SandboxId, BudgetDestination);

#[derive(Debug)]
struct State {
    requests: Bucket,
    bytes: Bucket,
}

/// A token bucket, in units (a token is `period` units).
#[derive(Clone, Copy, Debug)]
struct Bucket {
    units: u64,
    at: Millis,
    /// The limit it was last spent under; `None`: never spent (full).
    limit: Option<Limit>,
}

/// One entry's limits as bucket parameters.
#[derive(Clone, Copy, Debug)]
struct Limit {
    /// Tokens per period, also units per millisecond.
    rate: u64,
    /// Milliseconds in the period, also units per token.
    period: u64,
}

/// A running spliced or opaque flow's byte budget: every chunk is charged
/// before it is written, and the first that does not fit cuts the flow.
pub(crate) struct Meter {
    table: Arc<BudgetTable>,
    /// The clock the attribution cache runs on (tests move it).
    clock: Arc<AttributionCache>,
    sandbox: SandboxId,
    /// The entries charged, by index (one, or two: [`Budgets::charged`]).
    ///
    /// [`Budgets::charged`]: egress_policy::budget::Budgets::charged
    entries: Vec<(u32, Budget)>,
    /// Which of `entries` the flow crossed.
    over: std::sync::atomic::AtomicUsize,
    crossed: AtomicBool,
    cut: tokio::sync::Notify,
}

/// A state that is not full, as a gateway hands it to its successor (a
/// takeover): the buckets' time as an age, since the two processes' clocks
/// differ. Read back through `SandboxId::parse` and the limits' bounds: a
/// line that does not pass is dropped.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Spent {
    pub(crate) sandbox: String,
    pub(crate) destination: BudgetDestination,
    pub(crate) requests: Option<SpentBucket>,
    pub(crate) bytes: Option<SpentBucket>,
}

/// Each of `states` that reads as a [`Spent`]; one that does not (a
/// destination another build wrote differently) is dropped, named in a
/// warning with `whence`: its state starts full, the others are kept.
pub(crate) fn each_read(states: Vec<serde_json::Value>, whence: &str) -> Vec<Spent> {
    let (total, mut first) = (states.len(), None);
    let read: Vec<Spent> = states
        .into_iter()
        .filter_map(|v| {
            serde_json::from_value(v)
                .map_err(|e| first.get_or_insert(e.to_string()).clone())
                .ok()
        })
        .collect();
    if let Some(error) = first {
        let dropped = total - read.len();
        tracing::warn!(from = whence, dropped, of = total, first = %error, "budget states this build does not read are dropped: they start full");
    }
    read
}

/// One bucket of a [`Spent`] state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SpentBucket {
    pub(crate) units: u64,
    /// Milliseconds since its units were counted.
    pub(crate) age_ms: u64,
    /// The limit it was spent under: tokens per period, and the period.
    pub(crate) rate: u64,
    pub(crate) period: u64,
}

// === impl Meter ===

impl Meter {
    pub(crate) fn new(
        (table, clock): (Arc<BudgetTable>, Arc<AttributionCache>),
        sandbox: SandboxId,
        entries: Vec<(u32, Budget)>,
    ) -> Self {
        Self {
            table,
            clock,
            sandbox,
            entries,
            over: std::sync::atomic::AtomicUsize::new(0),
            crossed: AtomicBool::new(false),
            cut: tokio::sync::Notify::new(),
        }
    }

    /// Charges `n` bytes about to move; `false`: they do not fit, and the
    /// flow is to be cut ([`Meter::cut`] wakes).
    pub(crate) fn spend(&self, n: usize) -> bool {
        let now = self.clock.now();
        let over = self.entries.iter().position(|(_, budget)| {
            self.table
                .bytes(&self.sandbox, budget, n as u64, now)
                .is_err()
        });
        let Some(i) = over else { return true };
        if !self.crossed.swap(true, Ordering::Relaxed) {
            self.over.store(i, Ordering::Relaxed);
            self.cut.notify_one();
        }
        false
    }

    /// Whether the flow crossed its budget.
    pub(crate) fn crossed(&self) -> bool {
        self.crossed.load(Ordering::Relaxed)
    }

    /// Resolves when the flow crossed its budget.
    pub(crate) async fn cut(&self) {
        self.cut.notified().await;
    }

    /// The entry's index and the readable reason, for the flow log.
    pub(crate) fn describe(&self) -> String {
        let i = self.over.load(Ordering::Relaxed);
        let Some((rule, budget)) = self.entries.get(i).or(self.entries.first()) else {
            return String::new();
        };
        format!(
            "budgets[{rule}] ({}): {}",
            budget.destination,
            describe(Over::Bytes, budget)
        )
    }
}

// === impl Over ===

impl Over {
    pub(crate) fn kind(self) -> &'static str {
        match self {
            Self::Requests => "requests",
            Self::Bytes => "bytes",
            Self::NoState => "state",
        }
    }
}

/// The readable reason of a refusal or cut, for the flow log and the answer.
pub(crate) fn describe(over: Over, budget: &Budget) -> String {
    match (over, budget.requests_per_minute, budget.bytes_per_hour) {
        (Over::Requests, Some(n), _) => format!("over {n} requests a minute"),
        (Over::Bytes, _, Some(n)) => format!("over {n} bytes an hour"),
        (Over::NoState, ..) => {
            "no room for a budget state (limits.max_budget_states): refused".to_owned()
        }
        _ => "over budget".to_owned(),
    }
}

// === impl BudgetTable ===

impl BudgetTable {
    /// Room for `max_states` states (at least one per shard).
    pub(crate) fn new(max_states: usize, gauge: Gauge, full: Counter) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            per_shard: max_states.div_ceil(SHARDS).max(1),
            keys: RandomState::new(),
            gauge,
            full,
            held: Mutex::default(),
            swept: std::sync::atomic::AtomicU64::new(NEVER),
        }
    }

    /// A request on a terminated or plain-HTTP flow: first charges the
    /// `bytes` the flow moved since the last charge, then needs a request
    /// token and, with a byte limit, a byte left.
    pub(crate) fn request(
        &self,
        sandbox: &SandboxId,
        budget: &Budget,
        bytes: u64,
        now: Millis,
    ) -> Result<(), Over> {
        self.with((sandbox, &budget.destination), now, |s| {
            if let Some(l) = byte_limit(budget) {
                s.bytes.drain(l, bytes, now);
                if !s.bytes.has(l, 1, now) {
                    return Err(Over::Bytes);
                }
            }
            match request_limit(budget) {
                Some(l) if !s.requests.take(l, 1, now) => Err(Over::Requests),
                _ => Ok(()),
            }
        })
    }

    /// A new spliced or opaque flow: one request token (a connection is the
    /// only request the gateway sees on it), [`MIN_TO_START`] bytes left,
    /// and the `peeked` bytes already read charged.
    pub(crate) fn connect(
        &self,
        sandbox: &SandboxId,
        budget: &Budget,
        peeked: u64,
        now: Millis,
    ) -> Result<(), Over> {
        self.with((sandbox, &budget.destination), now, |s| {
            if let Some(l) = byte_limit(budget) {
                if !s.bytes.has(l, MIN_TO_START.max(peeked), now) {
                    return Err(Over::Bytes);
                }
            }
            if let Some(l) = request_limit(budget) {
                if !s.requests.take(l, 1, now) {
                    return Err(Over::Requests);
                }
            }
            if let Some(l) = byte_limit(budget) {
                s.bytes.drain(l, peeked, now);
            }
            Ok(())
        })
    }

    /// `n` more bytes of a running flow: `Err` when they do not fit, and
    /// the budget is then drained (the flow is cut before they move).
    pub(crate) fn bytes(
        &self,
        sandbox: &SandboxId,
        budget: &Budget,
        n: u64,
        now: Millis,
    ) -> Result<(), Over> {
        let Some(l) = byte_limit(budget) else {
            return Ok(());
        };
        self.with((sandbox, &budget.destination), now, |s| {
            if s.bytes.take(l, n, now) {
                Ok(())
            } else {
                s.bytes.drain(l, n, now);
                Err(Over::Bytes)
            }
        })
    }

    /// Bytes a flow moved after its last request was judged: charged, never
    /// refused — nor for a sandbox's bounds, when its state was forgotten
    /// meanwhile (the bytes have moved: the state they make is spent).
    pub(crate) fn charge(&self, sandbox: &SandboxId, budget: &Budget, n: u64, now: Millis) {
        if let Some(l) = byte_limit(budget) {
            let _ = self.with_bound((sandbox, &budget.destination), now, false, |s| {
                s.bytes.drain(l, n, now);
                Ok(())
            });
        }
    }

    /// Every state not refilled at `now`, for a successor (a full one is
    /// what the successor starts from anyway).
    pub(crate) fn spent(&self, now: Millis) -> Vec<Spent> {
        let mut out = Vec::new();
        for shard in &*self.shards {
            for ((sandbox, destination), s) in lock(shard).iter() {
                if s.requests.is_full(now) && s.bytes.is_full(now) {
                    continue;
                }
                out.push(Spent {
                    sandbox: sandbox.as_str().to_owned(),
                    destination: destination.clone(),
                    requests: s.requests.spent(now),
                    bytes: s.bytes.spent(now),
                });
            }
        }
        out
    }

    /// Takes over a predecessor's `lines` for the sandboxes `known` says
    /// this gateway has; how many were taken. A line that does not read
    /// back is dropped, and so is one for which the table has no room
    /// (its state starts full, as after a cold start).
    pub(crate) fn take_over(
        &self,
        lines: Vec<Spent>,
        now: Millis,
        known: impl Fn(&SandboxId) -> bool,
    ) -> usize {
        let mut taken = 0;
        for line in lines {
            let Ok(sandbox) = SandboxId::parse(&line.sandbox) else {
                continue;
            };
            let (Some(requests), Some(bytes)) = (
                Bucket::taken(line.requests, MINUTE_MS, now),
                Bucket::taken(line.bytes, HOUR_MS, now),
            ) else {
                continue;
            };
            if !known(&sandbox) {
                continue;
            }
            let held = self.with_bound((&sandbox, &line.destination), now, false, |s| {
                *s = State { requests, bytes };
                Ok(())
            });
            taken += usize::from(held.is_ok());
        }
        taken
    }

    /// States held now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).len()).sum()
    }

    fn with(
        &self,
        (sandbox, destination): (&SandboxId, &BudgetDestination),
        now: Millis,
        f: impl FnOnce(&mut State) -> Result<(), Over>,
    ) -> Result<(), Over> {
        self.with_bound((sandbox, destination), now, true, f)
    }

    /// [`BudgetTable::with`]; a new state for `sandbox` only within its
    /// bound, the reserve's and the shard's room when `bounded` (a state
    /// taken over from a predecessor existed already, and bytes charged
    /// have moved: neither is ever refused).
    fn with_bound(
        &self,
        (sandbox, destination): (&SandboxId, &BudgetDestination),
        now: Millis,
        bounded: bool,
        f: impl FnOnce(&mut State) -> Result<(), Over>,
    ) -> Result<(), Over> {
        let key = (sandbox.clone(), destination.clone());
        // SHARDS is a power of two; the low bits of SipHash are uniform.
        let shard = (self.keys.hash_one(&key) as usize) & (SHARDS - 1);
        if let Some(state) = lock(&self.shards[shard]).get_mut(&key) {
            return f(state);
        }
        // Refilled states count until they are forgotten: past a bound,
        // forget them all (at most once a second) and look again.
        if bounded && !self.room_in(&lock(&self.held), sandbox) {
            self.sweep(now);
        }
        let mut map = lock(&self.shards[shard]);
        if let Some(state) = map.get_mut(&key) {
            return f(state);
        }
        // The shard's walk for a refilled state before `held` is taken: every
        // new state in every shard needs it.
        // A state that must be (bytes that moved, a predecessor's) is made
        // past the shard's room when nothing refilled can go: dropped, it
        // would start full again.
        let gone = match map.len() >= self.per_shard {
            true => match forget_one_refilled(&mut map, now) {
                Some((gone, _)) => Some(gone),
                None if !bounded => None,
                None => {
                    self.full.inc();
                    return Err(Over::NoState);
                }
            },
            false => None,
        };
        let mut held = lock(&self.held);
        if let Some(gone) = &gone {
            release(&mut held, gone);
            self.gauge.dec();
        }
        // Checked again where the state is counted: the bound is exact.
        if bounded && !self.room_in(&held, sandbox) {
            self.full.inc();
            return Err(Over::NoState);
        }
        *held.entry(sandbox.clone()).or_insert(0) += 1;
        drop(held);
        self.gauge.inc();
        f(map.entry(key).or_insert_with(|| State::full(now)))
    }

    /// Whether `sandbox` may hold one more state (`held`: the counts):
    /// under its bound, and once the table is seven eighths full, under
    /// the reserve's.
    fn room_in(&self, held: &HashMap<SandboxId, usize>, sandbox: &SandboxId) -> bool {
        let mine = held.get(sandbox).copied().unwrap_or(0);
        let max = self.per_shard * SHARDS;
        let used = usize::try_from(self.gauge.get()).unwrap_or(0);
        // The reserve the connection slots and the DNS proxy keep: a floor
        // of the bound (a fair share of a large table is larger), the
        // newcomer's share in the last eighth.
        let share = share_with_reserve(
            max,
            used,
            held.len(),
            MAX_STATES_PER_SANDBOX,
            RESERVE_STATES,
        );
        mine < share.min(MAX_STATES_PER_SANDBOX)
    }

    /// Forgets every state refilled at `now` and untouched for a minute,
    /// shard by shard (starting over from full grants nothing; a state in
    /// use is kept); nothing when a sweep ran less than a second ago (a
    /// sandbox at its bound asking again and again does not make the
    /// gateway walk the table each time).
    fn sweep(&self, now: Millis) {
        let last = self.swept.load(std::sync::atomic::Ordering::Relaxed);
        if (last != NEVER && now.0 < last.saturating_add(1_000))
            || self
                .swept
                .compare_exchange(
                    last,
                    now.0,
                    std::sync::atomic::Ordering::Relaxed,
                    std::sync::atomic::Ordering::Relaxed,
                )
                .is_err()
        {
            return;
        }
        for shard in self.shards.iter() {
            let mut map = lock(shard);
            let before = map.len();
            let mut gone = Vec::new();
            map.retain(|k, s| {
                let touched = s.requests.at.0.max(s.bytes.at.0);
                let idle = now.0.saturating_sub(touched) >= IDLE_SWEPT_MS;
                let refilled = idle && s.requests.is_full(now) && s.bytes.is_full(now);
                if refilled {
                    gone.push(k.0.clone());
                }
                !refilled
            });
            let mut held = lock(&self.held);
            for sandbox in &gone {
                release_one(&mut held, sandbox);
            }
            drop(held);
            self.gauge.dec_by((before - map.len()) as i64);
        }
    }
}

/// One state fewer held by `sandbox`'s key.
fn release(held: &mut HashMap<SandboxId, usize>, (sandbox, _): &Key) {
    release_one(held, sandbox);
}

/// One state fewer held by `sandbox`.
fn release_one(held: &mut HashMap<SandboxId, usize>, sandbox: &SandboxId) {
    if let Some(n) = held.get_mut(sandbox) {
        *n -= 1;
        if *n == 0 {
            held.remove(sandbox);
        }
    }
}

/// Removes one state whose buckets are both full at `now`, and returns it;
/// `None` when none is.
fn forget_one_refilled(map: &mut HashMap<Key, State>, now: Millis) -> Option<(Key, State)> {
    let refilled = map
        .iter()
        .find(|(_, s)| s.requests.is_full(now) && s.bytes.is_full(now))
        .map(|(k, _)| k.clone())?;
    map.remove_entry(&refilled)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn request_limit(b: &Budget) -> Option<Limit> {
    b.requests_per_minute.map(|rate| Limit {
        rate: u64::from(rate),
        period: MINUTE_MS,
    })
}

fn byte_limit(b: &Budget) -> Option<Limit> {
    b.bytes_per_hour.map(|rate| Limit {
        rate,
        period: HOUR_MS,
    })
}

// === impl State ===

impl State {
    /// Both buckets full: `u64::MAX` units is "full at any limit", capped
    /// at the limit's capacity when first used.
    fn full(now: Millis) -> Self {
        let b = Bucket {
            units: u64::MAX,
            at: now,
            limit: None,
        };
        Self {
            requests: b,
            bytes: b,
        }
    }
}

// === impl Bucket ===

impl Bucket {
    /// Refills up to `now`, capped at the capacity (a period's worth).
    fn refill(&mut self, l: Limit, now: Millis) {
        let capacity = l.rate * l.period;
        let elapsed = now.0.saturating_sub(self.at.0);
        self.units = self
            .units
            .saturating_add(elapsed.saturating_mul(l.rate))
            .min(capacity);
        self.at = Millis(self.at.0.max(now.0));
        self.limit = Some(l);
    }

    fn has(&mut self, l: Limit, tokens: u64, now: Millis) -> bool {
        self.refill(l, now);
        self.units >= tokens.saturating_mul(l.period)
    }

    fn take(&mut self, l: Limit, tokens: u64, now: Millis) -> bool {
        let room = self.has(l, tokens, now);
        if room {
            self.units -= tokens * l.period;
        }
        room
    }

    /// Spends `tokens`, or everything left when fewer are.
    fn drain(&mut self, l: Limit, tokens: u64, now: Millis) {
        self.refill(l, now);
        self.units = self.units.saturating_sub(tokens.saturating_mul(l.period));
    }

    /// The bucket for a successor, if it was ever spent: refilled to `now`
    /// first, so the successor's clock (which starts anew, and may read
    /// less than the age) loses none of the refill.
    fn spent(&self, now: Millis) -> Option<SpentBucket> {
        let l = self.limit?;
        let mut b = *self;
        b.refill(l, now);
        Some(SpentBucket {
            units: b.units,
            age_ms: now.0.saturating_sub(b.at.0),
            rate: l.rate,
            period: l.period,
        })
    }

    /// A predecessor's bucket (`None`: full) of a limit with `period`;
    /// `None` when it does not read back (another period, a rate out of
    /// bounds, more units than a period holds). Its age is refilled here:
    /// this process's clock starts anew, and an age longer than its
    /// reading so far (a restart after hours down) would otherwise lose
    /// the difference.
    fn taken(line: Option<SpentBucket>, period: u64, now: Millis) -> Option<Self> {
        let Some(b) = line else {
            return Some(Self {
                units: u64::MAX,
                at: now,
                limit: None,
            });
        };
        let capacity = b.rate.checked_mul(b.period)?;
        let refilled = b
            .units
            .saturating_add(b.age_ms.saturating_mul(b.rate))
            .min(capacity);
        (b.period == period && b.rate > 0 && b.units <= capacity).then_some(Self {
            units: refilled,
            at: now,
            limit: Some(Limit {
                rate: b.rate,
                period: b.period,
            }),
        })
    }

    /// Whether nothing is spent at `now`: never used, or refilled to its
    /// last limit's capacity.
    fn is_full(&self, now: Millis) -> bool {
        let Some(l) = self.limit else {
            return true;
        };
        let mut b = *self;
        b.refill(l, now);
        b.units >= l.rate * l.period
    }
}

#[cfg(test)]
mod tests;
