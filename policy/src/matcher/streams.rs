//! The allows for opaque streams (neither TLS nor HTTP), one lookup set per
//! kind of stream: unreadable bytes, and each protocol the gateway can name.
//!
//! An entry with `streams` lets exactly the protocols it names through; an
//! entry without follows the gateway's `opaque_streams` (`allow`: every
//! stream, the seed's meaning of an address allow; `deny`: none). The sets
//! exist only where they differ from the plain allows, so a policy without
//! `streams` under the default setting costs nothing.

use crate::rule::Rule;
use crate::stream::{OpaqueStreams, StreamProtocol};

use super::RuleSet;

/// Kinds of stream: unreadable, then each of [`StreamProtocol::ALL`].
const KINDS: usize = 1 + StreamProtocol::ALL.len();

/// The allow entries that let each kind of stream through.
#[derive(Debug)]
pub(super) struct StreamSets {
    /// By [`slot`]: index 0 unreadable, then each protocol.
    sets: [RuleSet; KINDS],
    /// By [`StreamProtocol::index`]: the entries whose `streams` name the
    /// protocol, which an allow qualifier of the same name does not hold back.
    named: [RuleSet; StreamProtocol::ALL.len()],
    /// Whether `default: allow` lets streams through: only when the
    /// gateway allows unreadable streams.
    pub(super) default: bool,
}

impl StreamSets {
    /// `None` when every allow lets every stream through (as without the sets).
    pub(super) fn new(
        allow: &[Rule],
        mode: OpaqueStreams,
        now: time::OffsetDateTime,
    ) -> Option<Self> {
        if mode == OpaqueStreams::Allow && allow.iter().all(|r| r.streams.is_none()) {
            return None;
        }
        let sets = std::array::from_fn(|i| {
            let kind = i
                .checked_sub(1)
                .and_then(|p| StreamProtocol::ALL.get(p).copied());
            // Entries with enforced per-request rules never pass a flow
            // whose requests cannot be seen.
            RuleSet::rules(allow, now, |r| {
                !r.enforced_http() && lets_through(r, kind, mode)
            })
        });
        let named = std::array::from_fn(|i| {
            let kind = StreamProtocol::ALL.get(i).copied();
            RuleSet::rules(allow, now, |r| {
                r.streams
                    .as_ref()
                    .is_some_and(|s| kind.is_some_and(|p| s.contains(p)))
            })
        });
        Some(Self {
            sets,
            named,
            default: mode == OpaqueStreams::Allow,
        })
    }

    /// The allows for a stream of this kind (`None`: unreadable).
    pub(super) fn get(&self, kind: Option<StreamProtocol>) -> &RuleSet {
        // `slot` is below KINDS by construction: 0, or 1 + an index into ALL.
        &self.sets[slot(kind)]
    }

    /// The entries whose `streams` name `kind`.
    pub(super) fn named(&self, kind: StreamProtocol) -> &RuleSet {
        // `index` is below ALL.len() by construction.
        &self.named[kind.index()]
    }
}

fn slot(kind: Option<StreamProtocol>) -> usize {
    kind.map_or(0, |p| 1 + p.index())
}

/// Whether entry `r` lets a stream of `kind` through under `mode`.
fn lets_through(r: &Rule, kind: Option<StreamProtocol>, mode: OpaqueStreams) -> bool {
    match (&r.streams, kind) {
        (Some(named), Some(p)) => named.contains(p),
        (Some(_), None) => false,
        (None, _) => mode == OpaqueStreams::Allow,
    }
}
