//! `egress-cluster reconcile`: the node reconciler. A kube-rs controller
//! watches the Machines placed on this node (label
//! [`NODE_LABEL`](crate::resource::NODE_LABEL)) and, for each running VM,
//! brings the worker's policy in line with `spec.network.egress` through
//! [`decide`](crate::decide::decide). Each Machine is reconciled on its own:
//! a failing worker call requeues that Machine with exponential backoff
//! (1 s doubling to 5 min) and never holds up the others; a converged one is
//! looked at again every `resync` so drift on the worker (a policy written
//! through the relay) is caught.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::StreamExt;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::watcher;
use kube::{Api, Client, Resource, ResourceExt};

use egress_policy::machine::MachineEgress;

use crate::decide::{self, decide};
use crate::resource::{Machine, MANAGED_ANNOTATION, NODE_LABEL};
use crate::worker::{Worker, WorkerError};

/// What this reconciler calls on the Kubernetes API, as RBAC names it:
/// `(API group, resource, verbs)`. `deploy/kubernetes`'s RBAC for the
/// reconciler is checked against it (`integration/tests/manifests.rs`), so
/// a new call here must be added here. The calls, all in this file:
///
/// - [`run`]: `Controller::new(Api::all, watcher)` lists Machines in every
///   namespace and watches them (label selector, no `get`);
/// - [`reconcile_one`] (`mark_managed`): `Api::patch` with a merge patch of
///   the `MANAGED_ANNOTATION` annotation (the object, not `machines/status`);
/// - [`refuse`]: a `Warning` Event about a Machine that is not reconciled
///   (kube-rs' `Recorder`: `create`, and `patch` when the same Event
///   recurs within minutes).
///
/// Nothing else is read.
pub const KUBE_ACCESS: &[(&str, &str, &[&str])] = &[
    ("kairon.zyvor.dev", "machines", &["list", "watch", "patch"]),
    ("events.k8s.io", "events", &["create", "patch"]),
];

/// The Events' reporting controller.
pub const REPORTER: &str = "egress-cluster-reconciler";

/// Why one reconcile failed (the Machine is requeued with backoff).
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error(transparent)]
    Worker(#[from] WorkerError),
    #[error("patching the annotation: {0}")]
    Kube(#[from] kube::Error),
    #[error("the reconcile took longer than {0:?}")]
    Timeout(Duration),
}

/// Longest one reconcile may take (its worker calls and its patch).
const RECONCILE_TIMEOUT: Duration = Duration::from_secs(60);

/// The reconciler's shared state.
pub struct Context {
    pub client: Client,
    pub worker: Worker,
    /// How often a converged Machine is checked again.
    pub resync: Duration,
    /// Consecutive failures per Machine, for the backoff. A Machine
    /// deleted while failing is not reconciled again to clear its entry:
    /// past [`PRUNE_ABOVE`] entries, those the controller's cache no longer
    /// holds are dropped.
    failures: Mutex<HashMap<String, u32>>,
    /// The controller's cache of the node's Machines (set by [`run`]).
    live: std::sync::OnceLock<kube::runtime::reflector::Store<Machine>>,
    /// Names this reconciler in the Events of [`refuse`].
    reporter: Reporter,
    /// Per Machine refused, the reason and note of its last Event and the
    /// recorder that made a series of its repeats. A refusal with another
    /// reason or note takes a new recorder, so it is a new Event: kube's
    /// recorder makes a repeat of any Event with the same reason, and a
    /// series keeps the note it began with. The entry goes when the
    /// Machine is reconciled; entries of deleted Machines are dropped as
    /// [`Context::failures`]' are.
    noted: Mutex<HashMap<String, (String, Recorder)>>,
}

/// Failure entries kept before those of deleted Machines are looked for.
const PRUNE_ABOVE: usize = 64;

impl Context {
    /// `instance` names this reconciler in its Events (the pod's name).
    pub fn new(
        client: Client,
        worker: Worker,
        resync: Duration,
        instance: Option<String>,
    ) -> Arc<Self> {
        Arc::new(Self {
            worker,
            resync,
            failures: Mutex::new(HashMap::new()),
            live: std::sync::OnceLock::new(),
            reporter: Reporter {
                controller: REPORTER.into(),
                instance,
            },
            noted: Mutex::new(HashMap::new()),
            client,
        })
    }

    /// Whether the Machine `key` (`namespace/name`) is still in the
    /// controller's cache (without one yet: yes).
    fn is_live(&self, key: &str) -> bool {
        let Some(store) = self.live.get() else {
            return true;
        };
        let (namespace, name) = key.split_once('/').unwrap_or(("", key));
        let object = kube::runtime::reflector::ObjectRef::<Machine>::new(name).within(namespace);
        store.get(&object).is_some()
    }

    fn failures(&self) -> std::sync::MutexGuard<'_, HashMap<String, u32>> {
        self.failures.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The recorder for an Event on the Machine `key` saying `said` (its
    /// reason and note): the one of its last Event if that said the same.
    fn recorder(&self, key: String, said: String) -> Recorder {
        let mut noted = self.noted.lock().unwrap_or_else(PoisonError::into_inner);
        if noted.len() >= PRUNE_ABOVE && !noted.contains_key(&key) {
            noted.retain(|k, _| self.is_live(k));
        }
        let fresh = || Recorder::new(self.client.clone(), self.reporter.clone());
        match noted.entry(key) {
            std::collections::hash_map::Entry::Occupied(mut e) if e.get().0 != said => {
                let recorder = fresh();
                e.insert((said, recorder.clone()));
                recorder
            }
            std::collections::hash_map::Entry::Occupied(e) => e.get().1.clone(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert((said, fresh())).1.clone(),
        }
    }
}

/// What one reconcile did, for logs and tests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Done {
    /// Not running (no runtime id, or not `Running`): nothing to do.
    NotRunning,
    /// Not reconciled, and said in a `Warning` Event on the Machine:
    /// `status.runtimeID` is not a VM id, or the worker's VM of that id is
    /// not this Machine's (nothing written); or `spec.network.egress` is
    /// invalid (the webhook should have refused it): a managed Machine's VM
    /// with a policy of its own keeps it, any other is held on `loopback`.
    /// Looked at again every `resync`.
    Invalid(Refused),
    /// The worker has no such VM (yet).
    NoVm,
    Applied(decide::Action),
}

/// Why a Machine is not reconciled: the Event's reason and note.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refused {
    /// `InvalidEgress`, `InvalidRuntimeID` or `RuntimeIDNotThisMachine`.
    pub reason: &'static str,
    pub note: String,
}

fn key(m: &Machine) -> String {
    format!("{}/{}", m.namespace().unwrap_or_default(), m.name_any())
}

/// Reconciles one Machine: reads the worker's policy, applies the decision,
/// and records in the annotation whether the reconciler manages the policy
/// — before its first write, so a write whose record failed is still
/// cleared once the field goes. An invalid `spec.network.egress` holds a
/// VM on `loopback` (nothing leaves) until it is valid, and says why —
/// unless the Machine is managed and its VM has a policy of its own.
pub async fn reconcile_one(m: &Machine, ctx: &Context) -> Result<Done, ReconcileError> {
    let Some(vm) = m.running() else {
        return Ok(Done::NotRunning);
    };
    // The id goes into the worker's URL path: one that is not a VM id
    // (`../defaults`, say) names no VM, and nothing is written for it.
    if !crate::relay::valid_id(vm) {
        let why = format!("status.runtimeID {vm:?} is not a VM id");
        return Ok(refuse(m, ctx, "InvalidRuntimeID", why).await);
    }
    let Some(held) = ctx.worker.addresses(vm).await? else {
        return Ok(Done::NoVm);
    };
    if let Some(why) = not_this_machines(m, vm, &held) {
        return Ok(refuse(m, ctx, "RuntimeIDNotThisMachine", why).await);
    }
    let Some(current) = ctx.worker.policy(vm).await? else {
        return Ok(Done::NoVm);
    };
    let (spec, invalid) = match spec_of(m) {
        Ok(spec) => (spec, None),
        // A managed Machine's VM keeps the policy of its own it has (the
        // one written from an earlier valid spec, or since through the
        // relay: which is not recorded), as before: the spec may have been
        // stored before a stricter check, or be read by an older
        // reconciler during an upgrade. Any other VM: nothing leaves until
        // the field is valid.
        Err(why) if current.own && m.managed() => {
            return Ok(refuse(m, ctx, "InvalidEgress", why).await);
        }
        Err(why) => (Some(MachineEgress::loopback()), Some(why)),
    };
    let d = decide(spec.as_ref(), m.managed(), &current);
    if d.managed && !m.managed() {
        mark_managed(m, ctx, true).await?;
    }
    match &d.action {
        decide::Action::Write(p) => ctx.worker.write(vm, p).await?,
        decide::Action::Clear => ctx.worker.clear(vm).await?,
        decide::Action::Leave => {}
    }
    if !d.managed && m.managed() {
        mark_managed(m, ctx, false).await?;
    }
    if let Some(why) = invalid {
        let why = format!("{why}; the VM is held on loopback (nothing leaves) until it is valid");
        return Ok(refuse(m, ctx, "InvalidEgress", why).await);
    }
    if d.action != decide::Action::Leave {
        tracing::info!(machine = %key(m), %vm, action = ?d.action, "reconciled");
    }
    Ok(Done::Applied(d.action))
}

/// Sets (`true`) or removes the `egress-managed` annotation.
async fn mark_managed(m: &Machine, ctx: &Context, managed: bool) -> Result<(), ReconcileError> {
    let value = if managed {
        serde_json::json!("true")
    } else {
        serde_json::Value::Null
    };
    let patch = serde_json::json!({ "metadata": { "annotations": { MANAGED_ANNOTATION: value } } });
    let api: Api<Machine> = Api::namespaced(
        ctx.client.clone(),
        &m.namespace().unwrap_or_else(|| "default".into()),
    );
    api.patch(
        &m.name_any(),
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await?;
    Ok(())
}

/// `spec.network.egress` validated (`None`: the field is absent), or why
/// it is invalid.
fn spec_of(m: &Machine) -> Result<Option<MachineEgress>, String> {
    match m.egress() {
        None => Ok(None),
        Some(Ok(p)) => Ok(Some(p)),
        Some(Err(problems)) => {
            let why: Vec<String> = problems.iter().map(|p| p.message.clone()).collect();
            Err(format!(
                "spec.network.egress is invalid: {}",
                why.join("; ")
            ))
        }
    }
}

/// Why the worker's VM `vm` (holding `held`) is not `m`'s, if it is not:
/// an address it holds that `status.addresses` does not list. A Machine
/// names its VM by `status.runtimeID` alone, so without this a Machine
/// whose status named another Machine's VM would write its policy to that
/// VM. (A VM matched by cgroup holds no address: nothing to compare.)
fn not_this_machines(m: &Machine, vm: &str, held: &[IpAddr]) -> Option<String> {
    let listed: Vec<IpAddr> = m
        .status
        .as_ref()
        .map(|s| s.addresses.iter().filter_map(|a| a.parse().ok()).collect())
        .unwrap_or_default();
    let foreign: Vec<&IpAddr> = held.iter().filter(|a| !listed.contains(a)).collect();
    (!foreign.is_empty()).then(|| {
        format!(
            "the worker's VM {vm:?} holds {foreign:?}, which status.addresses ({listed:?}) does not list: it is not this Machine's VM"
        )
    })
}

/// Says why `m` is not reconciled: in the log, and in a `Warning` Event on
/// the Machine (`kubectl describe machine` shows it). An Event that cannot
/// be published is logged; the answer is the same.
async fn refuse(m: &Machine, ctx: &Context, reason: &'static str, note: String) -> Done {
    tracing::warn!(machine = %key(m), reason, why = %note, "not reconciled");
    // The API server refuses a note over 1 kB.
    let said = egress_api::text::bounded(&note, 1_000);
    let event = Event {
        type_: EventType::Warning,
        reason: reason.into(),
        note: Some(said.clone()),
        action: "Reconcile".into(),
        secondary: None,
    };
    let recorder = ctx.recorder(key(m), format!("{reason}: {said}"));
    if let Err(e) = recorder.publish(&event, &m.object_ref(&())).await {
        tracing::warn!(machine = %key(m), error = %e, "the Event could not be published");
    }
    Done::Invalid(Refused { reason, note })
}

async fn reconcile(m: Arc<Machine>, ctx: Arc<Context>) -> Result<Action, ReconcileError> {
    // The worker's calls have their own timeout; the Kubernetes client's
    // patch has none, and a hung one would hold this Machine (its later
    // changes included) for good.
    let done = tokio::time::timeout(RECONCILE_TIMEOUT, reconcile_one(&m, &ctx))
        .await
        .map_err(|_| ReconcileError::Timeout(RECONCILE_TIMEOUT))??;
    ctx.failures().remove(&key(&m));
    if !matches!(done, Done::Invalid(_)) {
        ctx.noted
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&key(&m));
    }
    Ok(match done {
        Done::NotRunning => Action::await_change(),
        // Looked at again: the worker's VM may become this Machine's (its
        // VM manager registers it again), and an invalid field's `loopback`
        // is written again if it went. The Event recorder makes a series of
        // the repeats.
        Done::Invalid(_) => Action::requeue(jittered(ctx.resync)),
        // The VM manager has not registered it yet: look again soon.
        Done::NoVm => Action::requeue(Duration::from_secs(10)),
        Done::Applied(_) => Action::requeue(jittered(ctx.resync)),
    })
}

/// `every`, give or take a tenth: Machines reconciled together (at a
/// start) are looked at again spread out, not in waves.
pub fn jittered(every: Duration) -> Duration {
    let tenth = every / 10;
    let spread = tenth.as_millis().max(1) as u64 * 2;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::from(d.subsec_nanos()));
    let offset = Duration::from_millis(nanos % spread);
    (every - tenth) + offset
}

/// Reconciles in flight at once ([`run`]).
pub const RECONCILES_AT_ONCE: u16 = 4;

/// The backoff after `failures` consecutive failures: 1 s doubling, at most 5 min.
pub fn backoff(failures: u32) -> Duration {
    let secs = 1u64 << failures.saturating_sub(1).min(9);
    Duration::from_secs(secs.min(300))
}

fn error_policy(m: Arc<Machine>, err: &ReconcileError, ctx: Arc<Context>) -> Action {
    let n = {
        let mut failures = ctx.failures();
        if failures.len() >= PRUNE_ABOVE {
            prune(&mut failures, |k| ctx.is_live(k));
        }
        let n = failures.entry(key(&m)).or_insert(0);
        *n = n.saturating_add(1);
        *n
    };
    let wait = backoff(n);
    tracing::warn!(machine = %key(&m), error = %err, failures = n, retry_in = ?wait, "reconcile failed");
    Action::requeue(wait)
}

/// Drops the failure entries of Machines `live` says are gone.
fn prune(failures: &mut HashMap<String, u32>, live: impl Fn(&str) -> bool) {
    failures.retain(|k, _| live(k));
}

/// Runs the controller for the Machines on `node` until the stream ends.
pub async fn run(ctx: Arc<Context>, node: &str) {
    let api: Api<Machine> = Api::all(ctx.client.clone());
    let selector = format!("{NODE_LABEL}={node}");
    // A few reconciles at once: the worker takes two changes at a time,
    // and its admin listener (shared with the controller's pushes, the
    // probes and the metrics) takes a bounded number of connections.
    let config = kube::runtime::controller::Config::default().concurrency(RECONCILES_AT_ONCE);
    let controller =
        Controller::new(api, watcher::Config::default().labels(&selector)).with_config(config);
    let _ = ctx.live.set(controller.store());
    controller
        .shutdown_on_signal()
        .run(reconcile, error_policy, ctx)
        .for_each(|r| async move {
            // A failed watch or list (the API server unreachable, a Machine
            // that does not deserialize) stops all reconciling on the node:
            // said at warn, where the deployment's log level shows it.
            // A failed reconcile is said by `error_policy` already.
            match r {
                Err(kube::runtime::controller::Error::ReconcilerFailed(..)) | Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "watching the node's Machines failed"),
            }
        })
        .await;
}

#[cfg(test)]
mod tests {
    use super::{backoff, jittered, prune};
    use std::collections::HashMap;
    use std::time::Duration;

    #[test]
    fn failures_of_deleted_machines_are_dropped() {
        let mut failures: HashMap<String, u32> = [("ns/gone", 3), ("ns/kept", 1)]
            .map(|(k, n)| (k.to_owned(), n))
            .into();
        prune(&mut failures, |k| k == "ns/kept");
        assert_eq!(failures.keys().collect::<Vec<_>>(), ["ns/kept"]);
    }

    #[test]
    fn backoff_doubles_to_five_minutes() {
        assert_eq!(backoff(1), Duration::from_secs(1));
        assert_eq!(backoff(2), Duration::from_secs(2));
        assert_eq!(backoff(5), Duration::from_secs(16));
        assert_eq!(backoff(10), Duration::from_secs(300));
        assert_eq!(backoff(u32::MAX), Duration::from_secs(300));
    }

    #[test]
    fn resyncs_are_spread_a_tenth_either_way() {
        let every = std::time::Duration::from_secs(60);
        for _ in 0..100 {
            let d = jittered(every);
            assert!(d >= every * 9 / 10 && d <= every * 11 / 10, "{d:?}");
        }
    }
}
