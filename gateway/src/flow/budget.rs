//! The budget stage of a spliced or opaque flow: after the policy let it
//! through and before the origin is dialled. The first `budgets` entry that
//! covers one of the names attributed to its address (`*`: any flow) is
//! charged a request for the connection and the bytes already peeked; over
//! it, or with less than a KiB of its byte budget left, the flow is refused
//! (`budget_exceeded`). With a byte limit, the flow runs under a
//! [`Meter`] that cuts it where it crosses the limit. Budgets never allow.

use dns_attrib::Lookup;

use crate::budget::{describe, Meter};
use crate::registry::Sandbox;
use crate::state::Dataplane;

/// `Ok(None)`: no entry covers the flow, or its entry limits requests only;
/// `Err`: the readable reason the flow is refused.
pub(super) fn admit(
    dp: &Dataplane,
    sandbox: &Sandbox,
    lookup: &Lookup,
    peeked: usize,
) -> Result<Option<Meter>, String> {
    let budgets = &sandbox.policy.policy().budgets;
    if budgets.is_empty() {
        return Ok(None);
    }
    // Evidence only: the SNI of a spliced flow is a claim (one that is
    // attributed is among the attributed names), and a claim must not
    // choose a more generous entry than the evidence gets.
    let attributed = lookup.names();
    let Some((rule, budget)) = budgets.find(attributed.iter()) else {
        return Ok(None);
    };
    if let Err(over) = dp
        .budgets
        .connect(&sandbox.id, budget, peeked as u64, dp.cache.now())
    {
        dp.metrics.budget_exceeded(over);
        let why = describe(over, budget);
        return Err(format!("budgets[{rule}] ({}): {why}", budget.destination));
    }
    Ok(budget.bytes_per_hour.map(|_| {
        let table = (dp.budgets.clone(), dp.cache.clone());
        Meter::new(table, (sandbox.id.clone(), rule), budget.clone())
    }))
}
