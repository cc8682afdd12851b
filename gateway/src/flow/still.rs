//! A flow the gateway does not read (spliced TLS, opaque bytes) is judged
//! once, on its first bytes; it then runs as long as its sandbox's policy
//! still lets it. A push that takes out the entry that allowed it, an
//! approval revoked or past its `until` (the registry compiles the policy
//! again), an exemption taken out (the flow would now be terminated) or a
//! deny added, or its destination become one of the addresses denied while
//! the gateway runs (another sandbox's or a VM's, the host's): at the next
//! tick of the flow's idle watch (within a second) the flow is judged
//! again, under the policy as it is then, on the names it was first judged
//! on (their expiry since does not end a flow; the evidence was whole when
//! it was admitted), and cut unless the verdict is the one it runs under
//! and the byte limits of the budgets that charge it are the ones its meter
//! was made with (a limit lowered by a push reaches the sandbox's next flow).

use std::sync::{Arc, Mutex, PoisonError};

use egress_policy::budget::BudgetDestination;
use egress_policy::{CompiledPolicy, Hostname, Verdict};

use crate::decide::{judge, Claims, Decided};
use crate::doh::DohNames;

/// What a running flow was judged on, and the policy last found to let it
/// run with the platform's count of changes then (a flow is judged again
/// only when the registration's policy or the platform's addresses change).
pub(crate) struct StillAllowed<'a> {
    claims: &'a Claims<'a>,
    decided: &'a Decided,
    last: Mutex<(Arc<CompiledPolicy>, u64)>,
}

impl<'a> StillAllowed<'a> {
    /// A flow admitted under `policy` as `decided`. Its first tick judges
    /// it again whatever the count: the platform's addresses may have
    /// changed between the decision and now.
    pub(crate) fn new(
        claims: &'a Claims<'a>,
        decided: &'a Decided,
        policy: &Arc<CompiledPolicy>,
    ) -> Self {
        let changes = policy.platform().changes();
        Self {
            claims,
            decided,
            last: Mutex::new((policy.clone(), changes.wrapping_sub(1))),
        }
    }

    /// For a TLS flow, what its ClientHello was judged on.
    pub(crate) fn hello(&self) -> Option<crate::hello_retry::Judged<'a>> {
        (self.claims.protocol == egress_policy::Protocol::Tls).then_some(
            crate::hello_retry::Judged {
                sni: self.claims.sni,
                ech: self.claims.ech,
            },
        )
    }

    /// Whether `policy` (the registration's now) gives the flow the verdict
    /// it runs under: allowed as it is (opaque) or spliced.
    pub(crate) fn under(&self, policy: &Arc<CompiledPolicy>, doh: &DohNames) -> bool {
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        let changes = policy.platform().changes();
        if Arc::ptr_eq(&last.0, policy) && last.1 == changes {
            return true;
        }
        let lookup = &self.decided.lookup;
        let now = judge(policy, self.claims, &lookup.names(), lookup.gap(), doh);
        let same = matches!(
            (&self.decided.verdict, &now),
            (Verdict::Allow(_), Verdict::Allow(_)) | (Verdict::Splice(..), Verdict::Splice(..))
        );
        // Its meter was made with the byte limits that charged it then (a
        // flow without one may be in the kernel's splice, which counts
        // nothing): a limit lowered, added or taken out reaches the flow by
        // cutting it, and the sandbox's next one runs under it.
        let same = same && self.byte_limits(&last.0) == self.byte_limits(policy);
        if same {
            *last = (policy.clone(), changes);
        }
        same
    }

    /// The byte limits `policy`'s budgets charge the flow under, as its
    /// budget stage chose them (`Budgets::charged`: its attributed names,
    /// and its SNI as a claim).
    fn byte_limits(&self, policy: &CompiledPolicy) -> Vec<(BudgetDestination, u64)> {
        let budgets = &policy.policy().budgets;
        if budgets.is_empty() {
            return Vec::new();
        }
        let attributed = self.decided.lookup.names();
        let evidence: Vec<&Hostname> = attributed.iter().collect();
        let claims: Vec<&Hostname> = self
            .claims
            .sni
            .filter(|s| !attributed.contains(s))
            .into_iter()
            .collect();
        budgets
            .charged(&evidence, &claims)
            .into_iter()
            .filter_map(|(_, b)| Some((b.destination.clone(), b.bytes_per_hour?)))
            .collect()
    }
}
