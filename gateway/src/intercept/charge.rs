//! What a served connection charges to its sandbox's byte budgets: each
//! byte once, to the entries of the request it belongs to.
//!
//! HTTP/1.1 carries one request at a time: what the connection moves from
//! one request's budget stage to the next's (the rest of its body, its
//! response, the next head) is the earlier request's, charged to its
//! entries when the next request is judged, or when the connection ends.
//!
//! HTTP/2 interleaves its streams, and a connection's "last request" cannot
//! tell whose bytes moved: a request to an entry without a byte limit
//! opened while a download runs would otherwise take the download's bytes.
//! Each stream's bodies, both ways, are charged to its own entries as they
//! pass ([`StreamCharge`]), before hyper writes or the origin reads them,
//! and counted apart. The connection's other bytes (heads, framing, TLS
//! records: the connection's bytes less the metered ones) are charged as
//! HTTP/1.1's are, to the request judged before them; among interleaved
//! streams that is an approximation, but only of heads and frames, never
//! of a body. So each byte is charged once: a body by its stream, the rest
//! by the connection. A stream's entries are those it was judged under (a
//! push applies from the next request), and its body is charged whatever
//! is left, never cut, as an HTTP/1.1 response is not: terminated flows
//! are bounded request by request, the next request to a spent entry
//! refused.
//!
//! The last request's entries are kept by destination, never by position:
//! a push that reorders the list charges the same destinations, and one no
//! longer in the list is charged nothing more.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::task::{Context, Poll};

use bytes::Bytes;
use dns_attrib::AttributionCache;
use egress_policy::budget::{Budget, Budgets};
use egress_policy::{BudgetDestination, SandboxId};
use hyper::body::{Frame, SizeHint};

use crate::budget::BudgetTable;
use crate::io::Counts;
use crate::pool::{Body, BoxError};

/// A connection's byte counts, and what of them budgets were charged.
pub(super) struct BudgetCharge {
    pub(super) activity: Arc<Counts>,
    /// Of the bytes no stream's meter charged, those charged so far.
    charged: AtomicU64,
    /// Body bytes that HTTP/2 streams charged to their own entries, made
    /// with the first stream's meter (a connection without one allocates
    /// nothing for it).
    metered: OnceLock<Arc<AtomicU64>>,
    /// The destinations of the last request's entries (one, or two:
    /// `Budgets::charged`); `None` before the first request judged under
    /// budgets. Behind one lock with the charge, so that two HTTP/2
    /// streams judged at once each take the bytes before them once.
    last: Mutex<Option<Vec<BudgetDestination>>>,
}

/// An HTTP/2 stream's bodies, charged chunk by chunk to its entries that
/// limit bytes (none: counted only, as no other request's).
pub(super) struct StreamCharge {
    table: Arc<BudgetTable>,
    clock: Arc<AttributionCache>,
    sandbox: SandboxId,
    entries: Vec<Budget>,
    metered: Arc<AtomicU64>,
}

/// A response body whose data is charged to its stream as hyper takes it.
struct Charged {
    body: Body,
    charge: Arc<StreamCharge>,
}

// === impl BudgetCharge ===

impl BudgetCharge {
    pub(super) fn new(activity: Arc<Counts>) -> Self {
        Self {
            activity,
            charged: AtomicU64::new(0),
            metered: OnceLock::new(),
            last: Mutex::new(None),
        }
    }

    /// Bytes the connection moved, both ways.
    pub(super) fn moved(&self) -> u64 {
        self.activity.read.load(Ordering::Relaxed) + self.activity.written.load(Ordering::Relaxed)
    }

    /// Keeps `now` as the last request's destinations, giving the ones it
    /// replaces and the bytes moved since the last charge, which are theirs.
    pub(super) fn hand_over(
        &self,
        now: Vec<BudgetDestination>,
    ) -> (Option<Vec<BudgetDestination>>, u64) {
        let mut last = self.lock();
        let before = last.replace(now);
        (before, self.uncharged())
    }

    /// The last request's destinations, and the bytes moved since the last
    /// charge, which are theirs.
    pub(super) fn rest(&self) -> (Option<Vec<BudgetDestination>>, u64) {
        let last = self.lock();
        (last.clone(), self.uncharged())
    }

    /// The last request's destinations.
    pub(super) fn last(&self) -> Option<Vec<BudgetDestination>> {
        self.lock().clone()
    }

    /// Counts every byte moved so far as charged: a bridge's bytes are
    /// charged by its own meter, or are nobody's.
    pub(super) fn settle(&self) {
        let _ = self.uncharged();
    }

    /// A meter for an HTTP/2 stream judged under `entries`.
    pub(super) fn stream(
        &self,
        (table, clock): (Arc<BudgetTable>, Arc<AttributionCache>),
        sandbox: SandboxId,
        entries: &[(u32, &Budget)],
    ) -> Arc<StreamCharge> {
        let entries = entries
            .iter()
            .filter(|(_, b)| b.bytes_per_hour.is_some())
            .map(|(_, b)| (*b).clone())
            .collect();
        Arc::new(StreamCharge {
            table,
            clock,
            sandbox,
            entries,
            metered: self.metered.get_or_init(Arc::default).clone(),
        })
    }

    /// The bytes moved since the last charge, less those metered, now
    /// counted as charged. A response chunk is metered before it is
    /// written and a request chunk after it is read, so the difference
    /// rises and falls; what was charged is never charged again, and never
    /// given back.
    fn uncharged(&self) -> u64 {
        let metered = self.metered.get().map_or(0, |m| m.load(Ordering::Relaxed));
        let unmetered = self.moved().saturating_sub(metered);
        let before = self.charged.fetch_max(unmetered, Ordering::Relaxed);
        unmetered.saturating_sub(before)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Vec<BudgetDestination>>> {
        self.last.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The entries of `budgets` with the destinations `last` names, each with
/// its index now; a destination no longer in the list has none.
pub(super) fn entries_of<'b>(
    last: &[BudgetDestination],
    budgets: &'b Budgets,
) -> Vec<(u32, &'b Budget)> {
    last.iter()
        .filter_map(|d| {
            let (i, b) = budgets
                .iter()
                .enumerate()
                .find(|(_, b)| b.destination == *d)?;
            Some((u32::try_from(i).ok()?, b))
        })
        .collect()
}

// === impl StreamCharge ===

impl StreamCharge {
    /// Charges `n` bytes of the stream's bodies about to move.
    pub(super) fn charge(&self, n: usize) {
        if n == 0 {
            return;
        }
        self.metered.fetch_add(n as u64, Ordering::Relaxed);
        let now = self.clock.now();
        for budget in &self.entries {
            self.table.charge(&self.sandbox, budget, n as u64, now);
        }
    }

    /// `body` with its data charged to the stream.
    pub(super) fn response(self: &Arc<Self>, body: Body) -> Body {
        http_body_util::BodyExt::boxed(Charged {
            body,
            charge: self.clone(),
        })
    }
}

// === impl Charged ===

impl hyper::body::Body for Charged {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            self.charge.charge(frame.data_ref().map_or(0, Bytes::len));
        }
        polled
    }
    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }
    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budgets(destinations: &[&str]) -> Budgets {
        let list: Vec<Budget> = destinations
            .iter()
            .map(|d| Budget {
                destination: BudgetDestination::parse(d).expect("destination"),
                requests_per_minute: Some(1),
                bytes_per_hour: None,
            })
            .collect();
        Budgets::try_from(list).expect("budgets")
    }

    #[test]
    fn the_last_entries_are_found_by_destination_wherever_they_stand() {
        let last = vec![
            BudgetDestination::parse("a.test").expect("a"),
            BudgetDestination::parse("*").expect("any"),
        ];
        let found = |list: &Budgets| -> Vec<(u32, String)> {
            entries_of(&last, list)
                .into_iter()
                .map(|(i, b)| (i, b.destination.to_string()))
                .collect()
        };
        let first = budgets(&["a.test", "b.test", "*"]);
        assert_eq!(found(&first), [(0, "a.test".into()), (2, "*".into())]);
        let reordered = budgets(&["*", "b.test", "a.test"]);
        assert_eq!(found(&reordered), [(2, "a.test".into()), (0, "*".into())]);
        let removed = budgets(&["b.test", "*"]);
        assert_eq!(
            found(&removed),
            [(1, "*".into())],
            "a.test is charged no more"
        );
    }

    #[test]
    fn each_byte_moved_is_charged_once_and_metered_bytes_never() {
        let counts = Arc::new(Counts::default());
        let charge = BudgetCharge::new(counts.clone());
        let a = vec![BudgetDestination::parse("a.test").expect("a")];
        counts.read.store(100, Ordering::Relaxed);
        assert_eq!(
            charge.hand_over(a.clone()),
            (None, 100),
            "the first request's own"
        );
        counts.written.store(1_000, Ordering::Relaxed);
        assert_eq!(charge.rest(), (Some(a.clone()), 1_000));
        assert_eq!(charge.rest(), (Some(a), 0), "charged once");
        // A stream's 500 body bytes, metered before they are written.
        let stream = charge.metered.get_or_init(Arc::default);
        stream.fetch_add(500, Ordering::Relaxed);
        assert_eq!(
            charge.rest().1,
            0,
            "less than charged: nothing, never negative"
        );
        counts.written.store(1_540, Ordering::Relaxed);
        assert_eq!(charge.rest().1, 40, "the frames around the body");
        counts.written.store(2_000, Ordering::Relaxed);
        charge.settle();
        assert_eq!(charge.rest().1, 0, "settled");
    }
}
