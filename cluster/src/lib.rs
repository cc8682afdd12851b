//! Machine egress in the cluster. The worker (the gateway's admin API,
//! `/v1/vms/…`) enforces a VM's L4 policy; this crate brings the policy
//! there and checks it on the way:
//!
//! - [`resource`]: the `Machine` custom resource (`kairon.zyvor.dev/v1beta1`);
//! - [`decide`]: what the node reconciler does for one Machine — a pure function;
//! - [`reconcile`]: the kube-rs controller around it, per node;
//! - [`worker`]: the worker's HTTP API as the reconciler uses it;
//! - [`webhook`]: the admission webhook (`AdmissionReview` v1);
//! - [`relay`]: the console relay onto the worker's routes.
//!
//! Policies are checked by `egress_policy::machine`, the same function the
//! worker and `egress-gateway machine-egress check` use.

pub mod decide;
pub mod reconcile;
pub mod relay;
pub mod resource;
pub mod webhook;
pub mod worker;
