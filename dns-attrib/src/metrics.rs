//! Counters the gateway exports (it owns the Prometheus registry).

use std::sync::atomic::{AtomicU64, Ordering};

/// A monotonically increasing count.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// What the DNS proxy counts.
#[derive(Debug, Default)]
pub struct DnsMetrics {
    /// Datagrams and TCP messages received.
    pub queries: Counter,
    /// Upstream answers returned to sandboxes.
    pub answers: Counter,
    /// REFUSED: unknown source, or the policy does not permit the resolver.
    pub refused: Counter,
    /// FORMERR: the query did not parse or had other than one question.
    pub formerr: Counter,
    /// SERVFAIL because every upstream failed, or an answer carrying `ech`
    /// could not be rewritten faithfully.
    pub servfail: Counter,
    /// Attempts on one upstream that timed out or failed.
    pub upstream_failures: Counter,
    /// UDP answers truncated to the client's size limit.
    pub truncated: Counter,
    /// Truncated upstream UDP answers asked again over TCP.
    pub tcp_fallbacks: Counter,
    /// Queries turned away because in-flight limits were reached.
    pub overloaded: Counter,
    /// Answers that attributed names to addresses.
    pub attributed: Counter,
    /// REFUSED by the policy's `dns` section: ANY, or a type outside `query_types`.
    pub policy_refused: Counter,
    /// NXDOMAIN from the proxy itself under `resolve: "policy"`.
    pub policy_nxdomain: Counter,
    /// REFUSED because the sandbox is over a DNS budget (`dns_budget`).
    pub budget_refused: Counter,
    /// Answers whose SVCB/HTTPS records lost their `ech` parameter.
    pub ech_stripped: Counter,
}
