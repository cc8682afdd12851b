//! What to do with a worker's gateway, decided from what the store knows
//! of it and what it reports, with no I/O: [`plan`]. The dispatcher's
//! check gathers the inputs (`GET /readyz`, and the list when asked to
//! compare) and carries out the [`Action`].

/// What the store recorded of a gateway: the epoch last seen and the
/// generation acknowledged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Known<'a> {
    pub epoch: Option<&'a str>,
    pub acknowledged: Option<i64>,
}

/// What comparing the gateway's list with the store's rows found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Listed {
    /// Not fetched (yet).
    NotFetched,
    /// No verdict: the list could not be fetched or read, or changes are
    /// still being pushed (those are not drift).
    Inconclusive,
    /// The same sandboxes, addresses and policies; the generation it listed.
    Matches(Option<i64>),
    /// Something differs with every change pushed.
    Differs,
}

/// Why a gateway is resynced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cause {
    /// A new epoch: it restarted and knows nothing the store pushed.
    Restarted,
    /// Same epoch, another generation, and its list differs from the store.
    Drift,
}

/// What a check of a gateway calls for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// Nothing learnt (unreachable, not ready, or no verdict on its list):
    /// pushes go on, the next check looks again.
    Wait,
    /// In step: it reports the generation acknowledged. Push changes.
    PushChanges,
    /// Its list matches the store: acknowledge the generation it listed
    /// (when it listed one), then push changes.
    Acknowledge(Option<i64>),
    /// Same epoch, another generation than acknowledged: fetch its list
    /// and plan again with what the comparison found.
    Compare,
    /// Replace everything it knows with the store's view.
    Resync(Cause),
}

impl Action {
    /// The `compares` metric's outcome label (`None`: nothing decided yet).
    pub(crate) fn label(self) -> Option<&'static str> {
        match self {
            Self::Wait | Self::Compare => None,
            Self::PushChanges => Some("generation"),
            Self::Acknowledge(_) => Some("listed"),
            Self::Resync(Cause::Restarted) => Some("restarted"),
            Self::Resync(Cause::Drift) => Some("drift"),
        }
    }
}

/// Decides what a gateway needs from what the store knows of it (`known`),
/// what its `/readyz` reports (`reported`: epoch and generation, `None`
/// while unreachable or not ready) and, once compared, its list (`listed`).
pub(crate) fn plan(known: Known<'_>, reported: Option<(&str, i64)>, listed: Listed) -> Action {
    let Some((epoch, generation)) = reported else {
        return Action::Wait;
    };
    if known.epoch != Some(epoch) {
        return Action::Resync(Cause::Restarted);
    }
    if known.acknowledged == Some(generation) {
        return Action::PushChanges;
    }
    match listed {
        Listed::NotFetched => Action::Compare,
        Listed::Inconclusive => Action::Wait,
        Listed::Matches(listed) => Action::Acknowledge(listed),
        Listed::Differs => Action::Resync(Cause::Drift),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_follows_the_table() {
        let seen = |epoch, acknowledged| Known {
            epoch,
            acknowledged,
        };
        let cases = [
            // Unreachable or not ready: nothing, whatever the store knows.
            (
                (seen(Some("e1"), Some(7)), None, Listed::NotFetched),
                Action::Wait,
            ),
            ((seen(None, None), None, Listed::Differs), Action::Wait),
            // A new epoch (or one never seen): it restarted.
            (
                (
                    seen(Some("e1"), Some(7)),
                    Some(("e2", 7)),
                    Listed::NotFetched,
                ),
                Action::Resync(Cause::Restarted),
            ),
            (
                (seen(None, None), Some(("e1", 0)), Listed::NotFetched),
                Action::Resync(Cause::Restarted),
            ),
            // A restart wins over a list that matched.
            (
                (
                    seen(Some("e1"), Some(3)),
                    Some(("e2", 5)),
                    Listed::Matches(Some(5)),
                ),
                Action::Resync(Cause::Restarted),
            ),
            // Same epoch, the generation acknowledged: in step, no list.
            (
                (
                    seen(Some("e1"), Some(7)),
                    Some(("e1", 7)),
                    Listed::NotFetched,
                ),
                Action::PushChanges,
            ),
            (
                (seen(Some("e1"), Some(7)), Some(("e1", 7)), Listed::Differs),
                Action::PushChanges,
            ),
            // Same epoch, another generation: compare the lists.
            (
                (
                    seen(Some("e1"), Some(7)),
                    Some(("e1", 9)),
                    Listed::NotFetched,
                ),
                Action::Compare,
            ),
            (
                (seen(Some("e1"), None), Some(("e1", 0)), Listed::NotFetched),
                Action::Compare,
            ),
            (
                (
                    seen(Some("e1"), Some(7)),
                    Some(("e1", 9)),
                    Listed::Inconclusive,
                ),
                Action::Wait,
            ),
            (
                (
                    seen(Some("e1"), Some(7)),
                    Some(("e1", 9)),
                    Listed::Matches(Some(9)),
                ),
                Action::Acknowledge(Some(9)),
            ),
            (
                (
                    seen(Some("e1"), Some(7)),
                    Some(("e1", 9)),
                    Listed::Matches(None),
                ),
                Action::Acknowledge(None),
            ),
            (
                (seen(Some("e1"), Some(7)), Some(("e1", 9)), Listed::Differs),
                Action::Resync(Cause::Drift),
            ),
        ];
        for ((known, reported, listed), expected) in cases {
            assert_eq!(
                plan(known, reported, listed),
                expected,
                "{known:?} {reported:?} {listed:?}"
            );
        }
    }

    #[test]
    fn each_decision_has_its_metric_label() {
        let cases = [
            (Action::Wait, None),
            (Action::Compare, None),
            (Action::PushChanges, Some("generation")),
            (Action::Acknowledge(Some(1)), Some("listed")),
            (Action::Resync(Cause::Restarted), Some("restarted")),
            (Action::Resync(Cause::Drift), Some("drift")),
        ];
        for (action, label) in cases {
            assert_eq!(action.label(), label, "{action:?}");
        }
    }
}
