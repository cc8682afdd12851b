//! What a spliced flow moved: the one answer of every path that moves its
//! bytes (the gateway's copy and `splice(2)` through pipes in `splice.rs`,
//! the sockmap in `ksplice.rs`), kept apart from both so neither path
//! borrows from the other.

use crate::fault::Fault;

/// What a splice moved.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Spliced {
    /// Client to origin.
    pub(crate) up: u64,
    /// Origin to client.
    pub(crate) down: u64,
    pub(crate) idle_timeout: bool,
    /// A side reset the flow while bytes moved.
    pub(crate) fault: Option<Fault>,
    /// The flow crossed its byte budget and was cut (reset both ways): the
    /// entry and the limit, for the flow log.
    pub(crate) budget_cut: Option<String>,
}

impl Spliced {
    /// A flow cut by `fault` (both sides reset) after `up` and `down` bytes.
    pub(crate) fn cut(up: u64, down: u64, fault: Fault) -> Self {
        Self {
            up,
            down,
            fault: Some(fault),
            ..Self::default()
        }
    }
}
