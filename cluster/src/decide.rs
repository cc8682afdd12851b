//! What the node reconciler does for one running Machine, as a pure
//! function of the spec, the `egress-managed` annotation and the worker's
//! current policy for the VM. The spec's reconciliation rules, sentence by
//! sentence:
//!
//! 1. *Create: the policy rides in the VM create request* — [`create_body`];
//!    the VM then has its own policy and the reconciler manages it.
//! 2. *Running Machine: read the worker's policy for the VM and write
//!    `PUT /v1/vms/{id}/network/egress` only when it differs.*
//! 3. *Removing the field clears the VM's own policy again (it then follows
//!    the node default), but only when the reconciler set one (annotation).*
//!    *A policy set directly on the worker, or through the console relay, on
//!    a Machine that never had the field is left alone; on a Machine that
//!    has the field, the spec wins on the next reconcile.*

use egress_policy::machine::MachineEgress;

/// The worker's policy for a VM (`GET /v1/vms/{id}/network/egress`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerPolicy {
    /// The VM has a policy of its own (`source: "vm"`); otherwise it
    /// follows the node default.
    pub own: bool,
    /// The policy in force, in normal form.
    pub policy: MachineEgress,
}

/// What to do on the worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// `PUT /v1/vms/{id}/network/egress` with this policy.
    Write(MachineEgress),
    /// `DELETE /v1/vms/{id}/network/egress`: back to the node default.
    Clear,
    /// Nothing.
    Leave,
}

/// The action, and whether the Machine is managed afterwards (the
/// annotation to write when it differs from the current one).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub action: Action,
    pub managed: bool,
}

/// Decides for a running Machine: `spec` is its validated
/// `spec.network.egress` (`None` when the field is absent), `managed` its
/// annotation, `worker` the worker's policy for the VM.
pub fn decide(spec: Option<&MachineEgress>, managed: bool, worker: &WorkerPolicy) -> Decision {
    match spec {
        // The field is there: the spec wins, whoever wrote the worker's
        // policy; written only when it differs.
        Some(p) if worker.own && worker.policy == *p => Decision {
            action: Action::Leave,
            managed: true,
        },
        Some(p) => Decision {
            action: Action::Write(p.clone()),
            managed: true,
        },
        // The field was removed and the reconciler had set the policy:
        // clear it (if the VM still has one of its own).
        None if managed => Decision {
            action: if worker.own {
                Action::Clear
            } else {
                Action::Leave
            },
            managed: false,
        },
        // Never had the field (or no longer managed): a policy set on the
        // worker directly or through the relay is left alone.
        None => Decision {
            action: Action::Leave,
            managed: false,
        },
    }
}

/// The VM create request's body (`PUT /v1/vms/{id}` on the worker): the
/// policy rides in it, so the VM never runs without it. Returns the body
/// and whether the Machine is managed from then on.
pub fn create_body(
    addresses: &[String],
    spec: Option<&MachineEgress>,
) -> (serde_json::Value, bool) {
    let mut body = serde_json::json!({ "addresses": addresses });
    if let Some(p) = spec {
        body["egress"] = p.to_value();
    }
    (body, spec.is_some())
}

#[cfg(test)]
mod tests;
