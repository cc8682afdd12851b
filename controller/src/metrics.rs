//! Prometheus metrics of both roles, served on `GET /metrics`:
//! `space_sandbox_egress_profile_admission_total{profile,outcome,reason}`,
//! requests, the queue, and pushes.

use std::sync::atomic::AtomicU64;

use egress_policy::{Admission, AdmissionReason, Outcome};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AdmissionLabels {
    pub profile: String,
    pub outcome: &'static str,
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub route: &'static str,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: &'static str,
}

/// Every metric of a process; each role uses its share.
pub struct Metrics {
    registry: Registry,
    pub admission: Family<AdmissionLabels, Counter>,
    pub requests: Family<RequestLabels, Counter>,
    pub operations: Family<OutcomeLabels, Counter>,
    pub queue_depth: Gauge,
    pub queue_oldest_seconds: Gauge<f64, AtomicU64>,
    pub pushes: Family<OutcomeLabels, Counter>,
    pub push_lag_seconds: Gauge<f64, AtomicU64>,
    pub push_latency_seconds: Histogram,
    pub leader: Gauge,
    pub pool_claims: Family<OutcomeLabels, Counter>,
    pub shards: Gauge,
    pub compares: Family<OutcomeLabels, Counter>,
}

impl Metrics {
    pub fn new() -> Self {
        let mut m = Self {
            registry: Registry::default(),
            admission: Family::default(),
            requests: Family::default(),
            operations: Family::default(),
            queue_depth: Gauge::default(),
            queue_oldest_seconds: Gauge::default(),
            pushes: Family::default(),
            push_lag_seconds: Gauge::default(),
            push_latency_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            leader: Gauge::default(),
            pool_claims: Family::default(),
            shards: Gauge::default(),
            compares: Family::default(),
        };
        m.register();
        m.register_dispatcher();
        m
    }

    /// Registers every metric, in the order they are exposed.
    fn register(&mut self) {
        let registry = &mut self.registry;
        registry.register(
            "space_sandbox_egress_profile_admission",
            "Egress profile admissions: ok/ready per selected profile; failed/invalid_request (profile=unknown) for refused selections; failed/unconfigured for saved names no longer configured",
            self.admission.clone(),
        );
        registry.register(
            "egress_controller_requests",
            "API requests by route and status",
            self.requests.clone(),
        );
        registry.register(
            "egress_controller_operations",
            "Queued operations finished, by outcome (succeeded, retried, failed)",
            self.operations.clone(),
        );
        registry.register(
            "egress_controller_queue_depth",
            "Operations queued now",
            self.queue_depth.clone(),
        );
        registry.register(
            "egress_controller_queue_oldest_seconds",
            "Age of the oldest queued operation",
            self.queue_oldest_seconds.clone(),
        );
        registry.register(
            "egress_controller_pushes",
            "Pushes to gateways, by outcome (applied, failed, resync)",
            self.pushes.clone(),
        );
        registry.register(
            "egress_controller_push_lag_seconds",
            "Age of the oldest change a gateway has not acknowledged",
            self.push_lag_seconds.clone(),
        );
        registry.register(
            "egress_controller_push_latency_seconds",
            "From a sandbox change to its gateway acknowledging it",
            self.push_latency_seconds.clone(),
        );
    }

    /// The dispatchers' own: leadership, shards, gateway checks, warm pools.
    fn register_dispatcher(&mut self) {
        let registry = &mut self.registry;
        registry.register(
            "egress_controller_leader",
            "1 while this dispatcher does what one does for all (approval expiry, pruning, the queue metrics)",
            self.leader.clone(),
        );
        registry.register(
            "egress_controller_pool_claims",
            "Warm-pool claims, by outcome (claimed; empty: fell back to a create; replayed: an idempotency key)",
            self.pool_claims.clone(),
        );
        registry.register(
            "egress_controller_shards",
            "Worker shards this dispatcher holds a lease on",
            self.shards.clone(),
        );
        registry.register(
            "egress_controller_gateway_checks",
            "Gateway checks by outcome: generation (in step by its generation), listed (list compared, in step), drift, restarted",
            self.compares.clone(),
        );
    }

    /// Counts admission results.
    pub fn admitted(&self, admissions: &[Admission]) {
        for a in admissions {
            let outcome = match a.outcome {
                Outcome::Ok => "ok",
                Outcome::Failed => "failed",
            };
            let reason = match a.reason {
                AdmissionReason::Ready => "ready",
                AdmissionReason::InvalidRequest => "invalid_request",
                AdmissionReason::Unconfigured => "unconfigured",
            };
            self.admission
                .get_or_create(&AdmissionLabels {
                    profile: a.profile.clone(),
                    outcome,
                    reason,
                })
                .inc();
        }
    }

    /// The text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}
