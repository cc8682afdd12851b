//! DNS interception for the reserved resolvers (8.8.8.8, 1.1.1.1) and the
//! attribution cache it fills.
//!
//! Hostname exemptions and domain allows stand on one fact: *this sandbox
//! resolved this name through the reserved resolvers, the answer contained
//! this IP, and that answer has not expired*. This crate produces that fact,
//! and nothing else may: [`AttributionCache::record`] is called only by the
//! proxy, with answers to queries it forwarded.
//!
//! The proxy also decides what of a sandbox's DNS may leave and what comes
//! back: the policy's `dns` section (query types, names by policy), per
//! sandbox budgets against names used as a channel, and answers stripped of
//! the `ech` parameter that would hide the real server name from the
//! gateway.

mod budget;
mod cache;
mod chain;
mod clock;
pub mod doh;
mod gate;
mod ghosts;
pub mod held;
mod metrics;
mod proxy;
mod svcb;

pub use budget::{BudgetLimits, Over};
pub use cache::{AttributionCache, CacheConfig, IpNames, Lookup};
pub use chain::{attribution, Attribution};
pub use clock::{Clock, ManualClock, Millis, SystemClock};
pub use metrics::{Counter, DnsMetrics};
pub use proxy::{Admit, DnsProxy, ProxyConfig, QueryAdmission, QueryRules, Transport};
pub use svcb::{has_ech, strip_ech, EchStripError, EchStripped};
