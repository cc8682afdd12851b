//! The node reconciler against a real worker (a gateway, its VM tables in a
//! throwaway namespace) and a stand-in for the Kubernetes API.
//!
//! No API server can run on this machine, so the stand-in answers the few
//! calls the reconciler makes — list and watch Machines, merge-patch one —
//! from memory, *behind kube-rs's client interface*: it is the
//! `tower::Service` a `kube::Client` sends its HTTP requests to, so the
//! reconciler, the kube-rs controller and the client run unchanged.

mod support;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use egress_cluster::decide::Action as Did;
use egress_cluster::reconcile::{self, reconcile_one, Context, Done, ReconcileError};
use egress_cluster::resource::{Machine, MANAGED_ANNOTATION};
use egress_cluster::worker::Worker as WorkerApi;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use serde_json::{json, Value};
use support::{http, Worker};

const ALLOW_API: &str =
    r#"{"mode": "allowlist", "rules": [{"cidr": "10.0.0.0/8", "proto": "tcp", "port": 5151}]}"#;

/// Machines by (namespace, name), as the API server would hold them, every
/// merge patch received, and the Events created (a recurring one's patch
/// updates its `series`).
#[derive(Clone, Default)]
struct StandIn {
    machines: Arc<Mutex<BTreeMap<(String, String), Value>>>,
    patches: Arc<Mutex<Vec<(String, Value)>>>,
    events: Arc<Mutex<Vec<Value>>>,
    /// Merge patches of Machines still to refuse with `500`.
    failing_patches: Arc<std::sync::atomic::AtomicUsize>,
}

type Body = BoxBody<Bytes, Infallible>;

fn full(status: u16, v: &Value) -> http::Response<Body> {
    http::Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(v.to_string())).boxed())
        .expect("response")
}

impl StandIn {
    fn put(&self, m: Value) {
        let key = (
            m["metadata"]["namespace"]
                .as_str()
                .unwrap_or("default")
                .to_owned(),
            m["metadata"]["name"].as_str().expect("name").to_owned(),
        );
        self.machines.lock().expect("lock").insert(key, m);
    }

    fn get(&self, ns: &str, name: &str) -> Value {
        self.machines.lock().expect("lock")[&(ns.to_owned(), name.to_owned())].clone()
    }

    fn client(&self) -> kube::Client {
        let me = self.clone();
        let service = tower::service_fn(move |req: http::Request<kube::client::Body>| {
            let me = me.clone();
            async move { Ok::<_, Infallible>(me.answer(req).await) }
        });
        kube::Client::new(service, "default")
    }

    async fn answer(&self, req: http::Request<kube::client::Body>) -> http::Response<Body> {
        let method = req.method().clone();
        let path = req.uri().path().to_owned();
        let query = req.uri().query().unwrap_or("").to_owned();
        let body = req
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
        match (method.as_str(), parts.as_slice()) {
            ("GET", ["apis", "kairon.zyvor.dev", "v1beta1", "machines"])
                if query.contains("watch=true") =>
            {
                // A watch that stays open and quiet.
                let quiet =
                    futures::stream::pending::<Result<hyper::body::Frame<Bytes>, Infallible>>();
                http::Response::builder()
                    .status(200)
                    .header("content-type", "application/json")
                    .body(BodyExt::boxed(StreamBody::new(quiet)))
                    .expect("response")
            }
            ("GET", ["apis", "kairon.zyvor.dev", "v1beta1", "machines"]) => {
                let selector = query
                    .split('&')
                    .find_map(|kv| kv.strip_prefix("labelSelector="))
                    .map(|s| s.replace("%3D", "=").replace("%2F", "/"))
                    .unwrap_or_default();
                let (key, value) = selector.split_once('=').unwrap_or(("", ""));
                let items: Vec<Value> = self
                    .machines
                    .lock()
                    .expect("lock")
                    .values()
                    .filter(|m| key.is_empty() || m["metadata"]["labels"][key] == value)
                    .cloned()
                    .collect();
                full(
                    200,
                    &json!({"apiVersion": "kairon.zyvor.dev/v1beta1", "kind": "MachineList",
                            "metadata": {"resourceVersion": "1"}, "items": items}),
                )
            }
            (
                "PATCH",
                ["apis", "kairon.zyvor.dev", "v1beta1", "namespaces", ns, "machines", name],
            ) => {
                let failing = &self.failing_patches;
                let fail = failing
                    .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
                    .is_ok();
                if fail {
                    return full(
                        500,
                        &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "InternalError", "code": 500, "message": "etcd is down"}),
                    );
                }
                let patch: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                let key = ((*ns).to_owned(), (*name).to_owned());
                let mut machines = self.machines.lock().expect("lock");
                let Some(m) = machines.get_mut(&key) else {
                    return full(
                        404,
                        &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404, "message": "not found"}),
                    );
                };
                let annotations = m["metadata"]
                    .as_object_mut()
                    .expect("metadata")
                    .entry("annotations")
                    .or_insert_with(|| json!({}));
                for (k, v) in patch["metadata"]["annotations"]
                    .as_object()
                    .cloned()
                    .unwrap_or_default()
                {
                    match v {
                        Value::Null => {
                            annotations.as_object_mut().expect("object").remove(&k);
                        }
                        v => annotations[k.as_str()] = v,
                    }
                }
                self.patches
                    .lock()
                    .expect("lock")
                    .push((name.to_string(), patch));
                full(200, m)
            }
            ("POST", ["apis", "events.k8s.io", "v1", "namespaces", _, "events"]) => {
                let event: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                self.events.lock().expect("lock").push(event.clone());
                full(201, &event)
            }
            ("PATCH", ["apis", "events.k8s.io", "v1", "namespaces", _, "events", name]) => {
                let patch: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                let mut events = self.events.lock().expect("lock");
                match events.iter_mut().find(|e| e["metadata"]["name"] == *name) {
                    Some(e) => {
                        e["series"] = patch["series"].clone();
                        full(200, e)
                    }
                    None => full(404, &json!({"kind": "Status", "code": 404})),
                }
            }
            _ => full(
                404,
                &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404, "message": format!("stand-in: no {method} {path}")}),
            ),
        }
    }
}

fn machine(name: &str, node: &str, vm: &str, egress: Option<&str>, managed: bool) -> Value {
    let mut m = json!({
        "apiVersion": "kairon.zyvor.dev/v1beta1",
        "kind": "Machine",
        "metadata": {"name": name, "namespace": "prod", "resourceVersion": "1",
                     "labels": {"kairon.zyvor.dev/node": node}},
        "spec": {"network": {"mode": "user"}},
        "status": {"phase": "Running", "runtimeID": vm, "addresses": ["100.64.50.2"]},
    });
    if let Some(e) = egress {
        m["spec"]["network"]["egress"] = serde_json::from_str(e).expect("json");
    }
    if managed {
        m["metadata"]["annotations"] = json!({ MANAGED_ANNOTATION: "true" });
    }
    m
}

fn typed(v: &Value) -> Machine {
    serde_json::from_value(v.clone()).expect("a Machine")
}

fn worker_api(w: &Worker) -> WorkerApi {
    WorkerApi {
        admin: w.admin,
        token: Some(w.token.clone()),
        timeout: Duration::from_secs(5),
    }
}

async fn worker_policy(w: &Worker, vm: &str) -> Value {
    let (status, _, body) = http(
        w.admin,
        "GET",
        &format!("/v1/vms/{vm}/network/egress"),
        &w.auth(),
        None,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    support::json(&body)
}

async fn set_directly(w: &Worker, vm: &str, policy: &str) {
    let (status, _, body) = http(
        w.admin,
        "PUT",
        &format!("/v1/vms/{vm}/network/egress"),
        &w.auth(),
        Some(policy),
    )
    .await;
    assert_eq!(status, 200, "{body}");
}

/// A real worker with VM `vm-web` at 100.64.50.2, the API stand-in and a
/// reconciler's context over both (`None`: skipped, no namespace here).
async fn on_a_worker() -> Option<(Worker, StandIn, Arc<Context>)> {
    let w = Worker::start().await?;
    w.register_vm("vm-web", "100.64.50.2").await;
    let api = StandIn::default();
    let ctx = Context::new(api.client(), worker_api(&w), Duration::from_secs(60), None);
    Some((w, api, ctx))
}

#[tokio::test]
async fn each_reconciliation_rule_against_a_real_worker() {
    let Some((w, api, ctx)) = on_a_worker().await else {
        return;
    };

    // Running, field set, VM on the node default: written, and managed.
    api.put(machine("web", "node-a", "vm-web", Some(ALLOW_API), false));
    let done = reconcile_one(&typed(&api.get("prod", "web")), &ctx)
        .await
        .expect("reconciles");
    assert!(matches!(done, Done::Applied(Did::Write(_))), "{done:?}");
    let now = worker_policy(&w, "vm-web").await;
    assert_eq!(now["source"], "vm");
    assert_eq!(now["policy"]["rules"][0]["port"], 5151);
    assert!(
        w.ruleset().contains("10.0.0.0/8 . tcp . 5151"),
        "the kernel has it"
    );
    assert_eq!(
        api.get("prod", "web")["metadata"]["annotations"][MANAGED_ANNOTATION],
        "true"
    );

    // Again: the worker already has it, nothing is written.
    let done = reconcile_one(&typed(&api.get("prod", "web")), &ctx)
        .await
        .expect("reconciles");
    assert_eq!(done, Done::Applied(Did::Leave));
    let patches = api.patches.lock().expect("lock").len();
    assert_eq!(patches, 1, "the annotation is patched once");

    // Changed through the relay (directly on the worker): the spec wins.
    set_directly(&w, "vm-web", r#"{"mode": "open"}"#).await;
    let done = reconcile_one(&typed(&api.get("prod", "web")), &ctx)
        .await
        .expect("reconciles");
    assert!(matches!(done, Done::Applied(Did::Write(_))), "{done:?}");
    assert_eq!(
        worker_policy(&w, "vm-web").await["policy"]["mode"],
        "allowlist"
    );

    // The field removed: the reconciler set the policy, so it clears it.
    let done = field_removed(&api, &ctx, "web").await;
    assert_eq!(done, Done::Applied(Did::Clear));
    assert_eq!(worker_policy(&w, "vm-web").await["source"], "default");
    assert!(api.get("prod", "web")["metadata"]["annotations"]
        .get(MANAGED_ANNOTATION)
        .is_none());

    // Never had the field, a policy set directly: left alone.
    set_directly(&w, "vm-web", r#"{"mode": "open"}"#).await;
    let done = reconcile_one(&typed(&api.get("prod", "web")), &ctx)
        .await
        .expect("reconciles");
    assert_eq!(done, Done::Applied(Did::Leave));
    let now = worker_policy(&w, "vm-web").await;
    assert_eq!(
        (now["source"].as_str(), now["policy"]["mode"].as_str()),
        (Some("vm"), Some("open"))
    );

    // Not running, or not on the worker: nothing written.
    let mut stopped = machine("stopped", "node-a", "vm-web", Some(ALLOW_API), false);
    stopped["status"]["phase"] = "Stopped".into();
    assert_eq!(
        reconcile_one(&typed(&stopped), &ctx).await.expect("ok"),
        Done::NotRunning
    );
    let ghost = machine("ghost", "node-a", "vm-ghost", Some(ALLOW_API), false);
    assert_eq!(
        reconcile_one(&typed(&ghost), &ctx).await.expect("ok"),
        Done::NoVm
    );
    // An invalid field (the webhook would have refused it): the VM is held
    // on loopback, and the Machine managed (the field's removal clears it).
    invalid_reconciled(&api, &ctx, "bad", false).await;
    let now = worker_policy(&w, "vm-web").await;
    assert_eq!(
        (&now["source"], &now["policy"]["mode"]),
        (&json!("vm"), &json!("loopback"))
    );
    assert_eq!(
        api.get("prod", "bad")["metadata"]["annotations"][MANAGED_ANNOTATION],
        "true"
    );
    // ... and said on the Machine, where `kubectl describe` shows it.
    let events = api.events.lock().expect("lock").clone();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["type"], "Warning");
    assert_eq!(events[0]["reason"], "InvalidEgress");
    assert_eq!(events[0]["regarding"]["name"], "bad");
    assert_eq!(events[0]["regarding"]["kind"], "Machine");
    assert_eq!(events[0]["reportingController"], reconcile::REPORTER);
    let note = events[0]["note"].as_str().expect("a note");
    assert!(
        note.starts_with("spec.network.egress is invalid: "),
        "{note}"
    );
    // A managed Machine whose VM has a policy of its own (written from an
    // earlier valid spec stored before a stricter check, say) keeps it.
    set_directly(&w, "vm-web", r#"{"mode": "open"}"#).await;
    invalid_reconciled(&api, &ctx, "kept", true).await;
    assert_eq!(worker_policy(&w, "vm-web").await["policy"]["mode"], "open");

    // An unreachable worker is an error (the controller requeues with backoff).
    let (gone, _held) = egress_testkit::closed_port();
    let down = Context::new(
        api.client(),
        WorkerApi {
            admin: gone,
            token: None,
            timeout: Duration::from_secs(2),
        },
        Duration::from_secs(60),
        None,
    );
    let err = reconcile_one(&typed(&api.get("prod", "web")), &down)
        .await
        .expect_err("unreachable");
    assert!(matches!(err, ReconcileError::Worker(_)), "{err}");
}

/// Machine `name`'s `spec.network.egress` taken out, and reconciled.
async fn field_removed(api: &StandIn, ctx: &Context, name: &str) -> Done {
    let mut m = api.get("prod", name);
    m["spec"]["network"]
        .as_object_mut()
        .expect("network")
        .remove("egress");
    api.put(m);
    reconcile_one(&typed(&api.get("prod", name)), ctx)
        .await
        .expect("reconciles")
}

/// Machine `name` on vm-web, managed or not, with a policy the worker's
/// check refuses (rules under `open`), put and reconciled: refused
/// `InvalidEgress`.
async fn invalid_reconciled(api: &StandIn, ctx: &Context, name: &str, managed: bool) {
    let invalid = r#"{"mode": "open", "rules": [{"cidr": "10.0.0.0/8"}]}"#;
    api.put(machine(name, "node-a", "vm-web", Some(invalid), managed));
    let done = reconcile_one(&typed(&api.get("prod", name)), ctx)
        .await
        .expect("ok");
    assert!(
        matches!(&done, Done::Invalid(r) if r.reason == "InvalidEgress"),
        "{done:?}"
    );
}

/// A Machine refused again for another cause gets an Event saying that
/// cause: kube's recorder keys its series by reason alone, and a series
/// keeps the note it began with, so the first cause was shown for good.
/// The same cause again is a repeat of its own Event.
#[tokio::test]
async fn a_machine_refused_for_another_cause_gets_an_event_naming_it() {
    let Some((_w, api, ctx)) = on_a_worker().await else {
        return;
    };
    let refused = |spec: &'static str| {
        api.put(machine("bad", "node-a", "vm-web", Some(spec), false));
        let ctx = ctx.clone();
        let m = typed(&api.get("prod", "bad"));
        async move { reconcile_one(&m, &ctx).await.expect("ok") }
    };
    let first = refused(r#"{"mode": "open", "rules": [{"cidr": "10.0.0.0/8"}]}"#).await;
    let second = refused(r#"{"mode": "sideways"}"#).await;
    let again = refused(r#"{"mode": "sideways"}"#).await;
    let notes: Vec<String> = [&first, &second, &again]
        .iter()
        .map(|done| match done {
            Done::Invalid(r) if r.reason == "InvalidEgress" => r.note.clone(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_ne!(notes[0], notes[1]);
    let events = api.events.lock().expect("lock").clone();
    let shown: Vec<(&str, &Value)> = events
        .iter()
        .map(|e| (e["note"].as_str().unwrap_or(""), &e["series"]["count"]))
        .collect();
    assert_eq!(
        shown,
        [
            (notes[0].as_str(), &Value::Null),
            (notes[1].as_str(), &json!(2))
        ],
        "{events:?}"
    );
}

/// The annotation is recorded before the policy is written: a patch that
/// fails leaves nothing written, so once the field goes the VM is back on
/// the node default (written first, the VM kept `open` for good: unmanaged,
/// its policy was left alone).
#[tokio::test]
async fn a_policy_whose_record_failed_is_not_left_behind_when_the_field_goes() {
    let Some((w, api, ctx)) = on_a_worker().await else {
        return;
    };
    api.put(machine(
        "web",
        "node-a",
        "vm-web",
        Some(r#"{"mode": "open"}"#),
        false,
    ));
    api.failing_patches.store(1, SeqCst);
    let err = reconcile_one(&typed(&api.get("prod", "web")), &ctx)
        .await
        .expect_err("the annotation's patch failed");
    assert!(matches!(err, ReconcileError::Kube(_)), "{err}");
    let done = field_removed(&api, &ctx, "web").await;
    let now = worker_policy(&w, "vm-web").await;
    assert_eq!(now["source"], "default", "{done:?}: {now}");
}

/// The kube-rs controller itself: it lists the Machines labelled for its
/// node, reconciles each on its own (a Machine whose VM the worker does not
/// have does not hold up the others), and leaves other nodes' alone.
#[tokio::test]
async fn the_controller_reconciles_only_its_nodes_machines() {
    let Some(w) = Worker::start().await else {
        return;
    };
    w.register_vm("vm-a", "100.64.50.2").await;
    w.register_vm("vm-b", "100.64.50.3").await;
    let api = StandIn::default();
    api.put(machine(
        "ghost",
        "node-a",
        "vm-ghost",
        Some(ALLOW_API),
        false,
    ));
    api.put(machine("a", "node-a", "vm-a", Some(ALLOW_API), false));
    api.put(machine("b", "node-b", "vm-b", Some(ALLOW_API), false));
    let ctx = Context::new(api.client(), worker_api(&w), Duration::from_secs(60), None);
    let controller = tokio::spawn(async move { reconcile::run(ctx, "node-a").await });
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if worker_policy(&w, "vm-a").await["source"] == "vm" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the controller did not reconcile vm-a"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    controller.abort();
    assert_eq!(
        worker_policy(&w, "vm-b").await["source"],
        "default",
        "another node's Machine"
    );
    assert_eq!(
        api.get("prod", "a")["metadata"]["annotations"][MANAGED_ANNOTATION],
        "true"
    );
    let patched: Vec<String> = api
        .patches
        .lock()
        .expect("lock")
        .iter()
        .map(|(n, _)| n.clone())
        .collect();
    assert_eq!(patched, ["a"]);
}

/// A Machine whose `status.runtimeID` is not a VM id (it goes into the
/// worker's URL path: `..` would step out of `/v1/vms/`) is not reconciled:
/// nothing is read or written on the worker, nothing patched.
#[tokio::test]
async fn a_runtime_id_that_is_not_a_vm_id_is_not_reconciled() {
    let Some(w) = Worker::start().await else {
        return;
    };
    let api = StandIn::default();
    let ctx = Context::new(api.client(), worker_api(&w), Duration::from_secs(60), None);
    for id in ["..", "../network/egress/defaults", ""] {
        api.put(machine("web", "node-a", id, Some(ALLOW_API), false));
        let done = reconcile_one(&typed(&api.get("prod", "web")), &ctx)
            .await
            .expect("reconciles");
        assert!(
            matches!(&done, Done::Invalid(r) if r.reason == "InvalidRuntimeID"),
            "{id:?}: {done:?}"
        );
    }
    assert!(api.patches.lock().expect("lock").is_empty());
}

/// A Machine whose `status.runtimeID` names a VM holding an address its
/// `status.addresses` does not list (another Machine's VM) is not
/// reconciled: that VM's policy stays as it is, and a Warning Event says
/// why. Its own VM, named again, is reconciled.
#[tokio::test]
async fn a_runtime_id_naming_another_machines_vm_is_not_reconciled() {
    let Some(w) = Worker::start().await else {
        return;
    };
    w.register_vm("vm-web", "100.64.50.2").await;
    w.register_vm("vm-db", "100.64.50.3").await;
    let api = StandIn::default();
    let ctx = Context::new(api.client(), worker_api(&w), Duration::from_secs(60), None);
    // `web` lists 100.64.50.2 and names vm-db.
    api.put(machine(
        "web",
        "node-a",
        "vm-db",
        Some(r#"{"mode": "open"}"#),
        false,
    ));
    let done = reconcile_one(&typed(&api.get("prod", "web")), &ctx)
        .await
        .expect("reconciles");
    assert!(
        matches!(&done, Done::Invalid(r) if r.reason == "RuntimeIDNotThisMachine"),
        "{done:?}"
    );
    assert_eq!(worker_policy(&w, "vm-db").await["source"], "default");
    assert!(api.patches.lock().expect("lock").is_empty());
    let events = api.events.lock().expect("lock").clone();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["reason"], "RuntimeIDNotThisMachine");
    let note = events[0]["note"].as_str().expect("a note");
    assert!(note.contains("100.64.50.3"), "{note}");

    // The same refusal again: the Event recurs as a series, not a new one.
    reconcile_one(&typed(&api.get("prod", "web")), &ctx)
        .await
        .expect("reconciles");
    let events = api.events.lock().expect("lock").clone();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["series"]["count"], 2);

    api.put(machine(
        "web",
        "node-a",
        "vm-web",
        Some(r#"{"mode": "open"}"#),
        false,
    ));
    let done = reconcile_one(&typed(&api.get("prod", "web")), &ctx)
        .await
        .expect("reconciles");
    assert!(matches!(done, Done::Applied(Did::Write(_))), "{done:?}");
    assert_eq!(worker_policy(&w, "vm-web").await["source"], "vm");
}
