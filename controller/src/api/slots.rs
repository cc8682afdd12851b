//! Each tenant's requests in flight, bounded: one tenant's requests (a
//! shadow put that waits on a slow gateway inside a transaction, creates
//! queued behind its own tenant-wide approval) could otherwise hold every
//! connection of the API's database pool, and every other tenant's
//! requests would wait out the pool's acquire timeout. Past the bound a
//! request waits for one of its tenant's places, not for the pool.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Requests of one tenant in flight at once: three quarters of the API's
/// 16 database connections, so one tenant leaves the others a quarter
/// (and a tenant's burst of creates still runs a dozen at a time).
pub const PER_TENANT: usize = 12;

/// Longest a request waits for a place among its tenant's.
pub const WAIT: Duration = Duration::from_secs(10);

/// The places of each tenant that has sent a request (tenants come from
/// the tenants file: bounded).
#[derive(Default)]
pub struct TenantSlots(Mutex<HashMap<String, Arc<Semaphore>>>);

impl TenantSlots {
    /// A place for one request of `tenant`, waited for up to [`WAIT`];
    /// `None` when none came free.
    pub async fn take(&self, tenant: &str) -> Option<OwnedSemaphorePermit> {
        let places = {
            let mut map = self.0.lock().unwrap_or_else(PoisonError::into_inner);
            map.entry(tenant.to_owned())
                .or_insert_with(|| Arc::new(Semaphore::new(PER_TENANT)))
                .clone()
        };
        tokio::time::timeout(WAIT, places.acquire_owned())
            .await
            .ok()?
            .ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_tenant_at_its_bound_waits_and_another_does_not() {
        let slots = TenantSlots::default();
        let mut held = Vec::new();
        for _ in 0..PER_TENANT {
            held.push(slots.take("a").await.expect("a place"));
        }
        // Another tenant is not held up by a's requests.
        assert!(slots.take("b").await.is_some());
        // a's next waits for one of its own, and gets it once one ends.
        let next = slots.take("a");
        tokio::pin!(next);
        assert!(
            tokio::time::timeout(Duration::from_secs(1), &mut next)
                .await
                .is_err(),
            "a fifth place for a"
        );
        held.pop();
        held.push(next.await.expect("the place a's request gave back"));
        // None comes free within the wait: refused.
        assert!(slots.take("a").await.is_none());
    }
}
