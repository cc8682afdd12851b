//! Not an API: the per-flow cost of a shadow, for
//! `benches/benches/shadow.rs`. [`FlowBench::flow`] runs what the dataplane
//! runs for one flow's decision: [`crate::decide::decide`] under the active
//! policy and, where a shadow is set, [`super::flow`] under the candidate
//! (the second judgement, the report and the counter), nothing else.

use std::sync::Arc;

use dns_attrib::AttributionCache;
use egress_policy::{CompiledPolicy, SandboxId};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use super::{Judge, Shadow};
use crate::decide::{decide, Claims};
use crate::doh::DohNames;
use crate::metrics::ShadowLabels;

/// One sandbox's decision path, with or without a shadow.
pub struct FlowBench {
    doh: DohNames,
    diffs: Family<ShadowLabels, Counter>,
    shadow: Option<Shadow>,
}

impl FlowBench {
    /// `candidate`: the shadow, if any.
    pub fn new(candidate: Option<Arc<CompiledPolicy>>) -> Self {
        Self {
            doh: DohNames::new(&[]),
            diffs: Family::default(),
            shadow: candidate.map(|p| Shadow::new(p, super::now(), None)),
        }
    }

    /// One flow decided as the dataplane decides it; the active verdict's name.
    pub fn flow(
        &self,
        cache: &AttributionCache,
        id: &SandboxId,
        active: &CompiledPolicy,
        claims: &Claims<'_>,
    ) -> &'static str {
        let decided = decide(cache, id, active, claims, &self.doh);
        if let Some(shadow) = &self.shadow {
            let j = Judge {
                doh: &self.doh,
                diffs: &self.diffs,
            };
            super::flow(&j, shadow, claims, &decided, None);
        }
        decided.verdict.name()
    }
}
