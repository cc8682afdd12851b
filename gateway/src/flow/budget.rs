//! The budget stage of a spliced or opaque flow: after the policy let it
//! through and before the origin is dialled. The `budgets` entries that
//! cover its names (`Budgets::charged`: `*` any flow) are each
//! charged a request for the connection and the bytes already peeked; over
//! it, or with less than a KiB of its byte budget left, the flow is refused
//! (`budget_exceeded`). With a byte limit, the flow runs under a
//! [`Meter`] that cuts it where it crosses the limit. Budgets never allow.

use dns_attrib::Lookup;
use egress_policy::budget::Budget;
use egress_policy::Hostname;

use crate::budget::{describe, Meter};
use crate::registry::Sandbox;
use crate::state::Dataplane;

/// `Ok(None)`: no entry covers the flow, or its entry limits requests only;
/// `Err`: the readable reason the flow is refused.
pub(super) fn admit(
    dp: &Dataplane,
    sandbox: &Sandbox,
    (lookup, sni): (&Lookup, Option<&Hostname>),
    peeked: usize,
) -> Result<Option<Meter>, String> {
    let budgets = &sandbox.policy.policy().budgets;
    if budgets.is_empty() {
        return Ok(None);
    }
    // The SNI is a claim: it may add an entry, never take the flow out of
    // the one its attributed names fall under (`Budgets::charged`).
    let attributed = lookup.names();
    let evidence: Vec<&Hostname> = attributed.iter().collect();
    let claims: Vec<&Hostname> = sni
        .filter(|s| !attributed.contains(s))
        .into_iter()
        .collect();
    let entries = budgets.charged(&evidence, &claims);
    let now = dp.cache.now();
    // Each entry is charged, refused or not: one that is spent must not
    // keep the peeked bytes from the other.
    let mut refused = None;
    for (rule, budget) in &entries {
        if let Err(over) = dp.budgets.connect(&sandbox.id, budget, peeked as u64, now) {
            refused = refused.or(Some((rule, budget, over)));
        }
    }
    if let Some((rule, budget, over)) = refused {
        dp.metrics.budget_exceeded(over);
        let why = describe(over, budget);
        return Err(format!("budgets[{rule}] ({}): {why}", budget.destination));
    }
    let metered: Vec<(u32, Budget)> = entries
        .into_iter()
        .filter(|(_, b)| b.bytes_per_hour.is_some())
        .map(|(rule, b)| (rule, b.clone()))
        .collect();
    Ok((!metered.is_empty()).then(|| {
        let table = (dp.budgets.clone(), dp.cache.clone());
        Meter::new(table, sandbox.id.clone(), metered)
    }))
}
