//! The `Machine` custom resource (`kairon.zyvor.dev/v1beta1`), as far as
//! machine egress reads it: `spec.network.mode` and `spec.network.egress`,
//! and the status fields that say where and whether the VM runs. The CRD
//! manifest is generated from these types (`egress-cluster crd`, committed
//! as `deploy/machine-crd.yaml`).

use egress_policy::machine::{MachineEgress, Problem};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The label the scheduler puts on a Machine placed on a node; each node's
/// reconciler watches only its own.
pub const NODE_LABEL: &str = "kairon.zyvor.dev/node";

/// Set (`"true"`) while the reconciler manages the VM's own policy on the
/// worker: only then does removing `spec.network.egress` clear it.
pub const MANAGED_ANNOTATION: &str = "kairon.zyvor.dev/egress-managed";

/// A VM.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[kube(
    group = "kairon.zyvor.dev",
    version = "v1beta1",
    kind = "Machine",
    namespaced,
    status = "MachineStatus",
    shortname = "mach",
    printcolumn = r#"{"name": "Phase", "type": "string", "jsonPath": ".status.phase"}"#,
    printcolumn = r#"{"name": "Egress", "type": "string", "jsonPath": ".spec.network.egress.mode"}"#
)]
pub struct MachineSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<Network>,
}

/// `spec.network`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
pub struct Network {
    /// `user`: user-mode (slirp) networking, whose egress this policy governs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<NetworkMode>,
    // Held as written and validated as the webhook and the worker validate
    // it (`Machine::egress`): read into `Egress`, a field this build does
    // not know (one a newer CRD allows) would be dropped, the policy checked
    // wider than written, and a value it does not know would stop the
    // node's whole watch. (Not a doc comment: the CRD's description.)
    /// The VM's egress policy; absent: the node default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<Egress>")]
    pub egress: Option<serde_json::Value>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum NetworkMode {
    User,
    Tap,
}

/// `spec.network.egress`, as the CRD describes it (the schema only: the
/// field is held as written, [`Network::egress`]).
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
pub struct Egress {
    /// `loopback` | `allowlist` | `audit` | `open`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<EgressMode>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 256))]
    pub rules: Option<Vec<EgressRule>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum EgressMode {
    Loopback,
    Allowlist,
    Audit,
    Open,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Proto {
    Tcp,
    Udp,
}

/// One rule: an IPv4 CIDR (or address), optionally a protocol and a port.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
pub struct EgressRule {
    pub cidr: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proto: Option<Proto>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 256))]
    pub note: Option<String>,
}

/// Where and whether the VM runs.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
pub struct MachineStatus {
    /// `Pending`, `Running`, `Stopped`, …; only a `Running` VM is reconciled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// The VM's id on its worker (the VM manager's runtime id).
    #[serde(default, rename = "runtimeID", skip_serializing_if = "Option::is_none")]
    pub runtime_id: Option<String>,
    /// The source addresses of the VM's QEMU process's traffic.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<String>,
}

impl Machine {
    /// `spec.network.egress` validated; `None` when the field is absent.
    pub fn egress(&self) -> Option<Result<MachineEgress, Vec<Problem>>> {
        let egress = self.spec.network.as_ref()?.egress.as_ref()?;
        Some(MachineEgress::from_value(egress))
    }

    /// The worker's id for the VM, when it runs.
    pub fn running(&self) -> Option<&str> {
        let status = self.status.as_ref()?;
        (status.phase.as_deref() == Some("Running"))
            .then_some(())
            .and(status.runtime_id.as_deref())
    }

    /// Whether the reconciler set the VM's own policy on the worker.
    pub fn managed(&self) -> bool {
        self.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(MANAGED_ANNOTATION))
            .is_some_and(|v| v == "true")
    }
}

/// The CRD manifest, as YAML.
pub fn crd_yaml() -> Result<String, serde_yaml::Error> {
    use kube::CustomResourceExt;
    serde_yaml::to_string(&Machine::crd())
}
