//! The VM-manager routes of machine egress, on the admin listener (same
//! bearer token):
//!
//! | route | what |
//! | --- | --- |
//! | `GET /v1/vms` | every VM |
//! | `PUT /v1/vms/{id}` | `{"addresses": [..], "egress": <policy, optional>}`: register; without `egress` a new VM follows the node default, a known one keeps its own |
//! | `GET`/`DELETE /v1/vms/{id}` | read; remove the VM and its table |
//! | `GET`/`PUT`/`DELETE /v1/vms/{id}/network/egress` | the VM's policy; `DELETE` clears its own (it follows the node default) |
//! | `GET /v1/vms/{id}/network/egress/observed` | refused (audit: would-be-refused) destinations |
//! | `POST /v1/vms/{id}/network/egress/suggest[?apply=true]` | rules that would allow what was observed |
//! | `GET`/`PUT /v1/network/egress/defaults[?apply_running=true]` | the node default |
//!
//! Invalid policies are `400` with `{"error", "errors": [{"rule", "message"}]}`
//! — the same errors as `egress-gateway machine-egress check`; an unknown VM
//! is `404`; an address a sandbox or another VM holds is `409`.

use std::net::IpAddr;
use std::sync::Arc;

use egress_policy::machine::{self, MachineEgress, Observed, Problem};
use http::{Method, Request, StatusCode};
use hyper::body::Incoming;
use serde_json::{json, Value};

use crate::{EgressView, MachineError, Machines, Registration, Vm};
use egress_api::body::MAX_BODY;
use egress_api::reply::{error, json_reply, Reply};

/// Serves one machine egress request: the match names the route, each
/// handler below serves one.
pub async fn route(req: Request<Incoming>, m: &Arc<Machines>) -> Reply {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let query = req.uri().query().unwrap_or("").to_owned();
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    match (&method, segments.as_slice()) {
        (&Method::GET, ["v1", "vms"]) => list_vms(m),
        (&Method::PUT, ["v1", "vms", id]) => put_vm(req, m, id).await,
        (&Method::GET, ["v1", "vms", id]) => get_vm(m, id),
        (&Method::DELETE, ["v1", "vms", id]) => delete_vm(m, id).await,
        (&Method::GET, ["v1", "vms", id, "network", "egress"]) => get_egress(m, id),
        (&Method::PUT, ["v1", "vms", id, "network", "egress"]) => put_egress(req, m, id).await,
        (&Method::DELETE, ["v1", "vms", id, "network", "egress"]) => clear_egress(m, id).await,
        (&Method::GET, ["v1", "vms", id, "network", "egress", "observed"]) => {
            get_observed(m, id).await
        }
        (&Method::POST, ["v1", "vms", id, "network", "egress", "suggest"]) => {
            post_suggest(&query, m, id).await
        }
        (&Method::GET, ["v1", "network", "egress", "defaults"]) => get_defaults(m),
        (&Method::PUT, ["v1", "network", "egress", "defaults"]) => {
            put_defaults(req, &query, m).await
        }
        _ => error(
            StatusCode::NOT_FOUND,
            &format!("no route {method} {path}"),
            None,
        ),
    }
}

// === the routes ===

/// `GET /v1/vms`.
fn list_vms(m: &Machines) -> Reply {
    let vms: Vec<Value> = m.vms().iter().map(|vm| vm_json(vm)).collect();
    json_reply(StatusCode::OK, &json!({ "vms": vms }))
}

/// `PUT /v1/vms/{id}`: register (or re-register) a VM.
async fn put_vm(req: Request<Incoming>, m: &Arc<Machines>, id: &str) -> Reply {
    let doc = match egress_api::body::text(req.into_body(), MAX_BODY).await {
        Ok(t) => t,
        Err(r) => return r,
    };
    let r = match registration(&doc) {
        Ok(x) => x,
        Err(r) => return *r,
    };
    let (m, id) = (m.clone(), id.to_owned());
    blocking(move || m.put_vm(&id, r).map(|vm| vm_json(&vm))).await
}

/// `GET /v1/vms/{id}`.
fn get_vm(m: &Machines, id: &str) -> Reply {
    match m.vm(id) {
        Ok(vm) => json_reply(StatusCode::OK, &vm_json(&vm)),
        Err(e) => failed(&e),
    }
}

/// `DELETE /v1/vms/{id}`: remove the VM and its table.
async fn delete_vm(m: &Arc<Machines>, id: &str) -> Reply {
    let (m, id) = (m.clone(), id.to_owned());
    blocking(move || m.delete_vm(&id).map(|()| json!({ "deleted": id }))).await
}

/// `GET /v1/vms/{id}/network/egress`.
fn get_egress(m: &Machines, id: &str) -> Reply {
    match m.egress(id) {
        Ok(view) => json_reply(StatusCode::OK, &egress_json(id, &view)),
        Err(e) => failed(&e),
    }
}

/// `PUT /v1/vms/{id}/network/egress`: the VM's own policy.
async fn put_egress(req: Request<Incoming>, m: &Arc<Machines>, id: &str) -> Reply {
    let policy = match policy_body(req).await {
        Ok(p) => p,
        Err(r) => return r,
    };
    let (m, id) = (m.clone(), id.to_owned());
    blocking(move || {
        m.set_egress(&id, Some(policy))
            .map(|v| egress_json(&id, &v))
    })
    .await
}

/// `DELETE /v1/vms/{id}/network/egress`: clear the VM's own policy, so it
/// follows the node default.
async fn clear_egress(m: &Arc<Machines>, id: &str) -> Reply {
    let (m, id) = (m.clone(), id.to_owned());
    blocking(move || m.set_egress(&id, None).map(|v| egress_json(&id, &v))).await
}

/// `GET /v1/vms/{id}/network/egress/observed`.
async fn get_observed(m: &Arc<Machines>, id: &str) -> Reply {
    let (m, id) = (m.clone(), id.to_owned());
    reading(move || observed_json(&m, &id)).await
}

/// `POST /v1/vms/{id}/network/egress/suggest[?apply=true]`.
async fn post_suggest(query: &str, m: &Arc<Machines>, id: &str) -> Reply {
    let apply = match flag(query, "apply") {
        Ok(a) => a,
        Err(r) => return *r,
    };
    let (m, id) = (m.clone(), id.to_owned());
    let run = move || suggest(&m, &id, apply);
    match apply {
        true => blocking(run).await,
        false => reading(run).await,
    }
}

/// `GET /v1/network/egress/defaults`.
fn get_defaults(m: &Machines) -> Reply {
    json_reply(
        StatusCode::OK,
        &json!({ "policy": m.default_policy().to_value() }),
    )
}

/// `PUT /v1/network/egress/defaults[?apply_running=true]`.
async fn put_defaults(req: Request<Incoming>, query: &str, m: &Arc<Machines>) -> Reply {
    let apply_running = match flag(query, "apply_running") {
        Ok(a) => a,
        Err(r) => return *r,
    };
    let policy = match policy_body(req).await {
        Ok(p) => p,
        Err(r) => return r,
    };
    let m = m.clone();
    blocking(move || {
        let value = policy.to_value();
        m.set_default(policy, apply_running).map(|applied| {
            json!({ "policy": value, "apply_running": apply_running, "applied_to": applied })
        })
    })
    .await
}

// === shared helpers ===

/// Changes, and reads, on a blocking thread at once ([`blocking`],
/// [`reading`]).
const TURNS: usize = 2;

/// The places of changes ([`blocking`]), shared by every call of the
/// process.
static CHANGES: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(TURNS);

/// The places of reads ([`reading`]): a read waits for no change's turn.
static READS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(TURNS);

/// Runs a change (it runs nft and fsyncs) off the async threads, once one
/// of [`TURNS`] places is free. Every change waits for the state's lock
/// anyway; waiting for it on a blocking thread each, a burst of calls (a
/// node booting its VMs) would take the blocking pool the gateway's other
/// blocking work shares (the fence keeper, the host's addresses, a
/// handover), and a caller that gave up would leave its thread waiting.
/// The place is held until the change is done, whether or not its caller
/// still waits.
async fn blocking(f: impl FnOnce() -> Result<Value, MachineError> + Send + 'static) -> Reply {
    on_blocking_thread(&CHANGES, f).await
}

/// A read ([`blocking`]'s places are for changes; reads have two of
/// their own).
async fn reading(f: impl FnOnce() -> Result<Value, MachineError> + Send + 'static) -> Reply {
    on_blocking_thread(&READS, f).await
}

async fn on_blocking_thread(
    places: &'static tokio::sync::Semaphore,
    f: impl FnOnce() -> Result<Value, MachineError> + Send + 'static,
) -> Reply {
    // Never closed: every call gets its place in turn.
    let Ok(place) = places.acquire().await else {
        return error(StatusCode::SERVICE_UNAVAILABLE, "stopping", None);
    };
    let run = move || {
        let _place = place;
        f()
    };
    match tokio::task::spawn_blocking(run).await {
        Ok(Ok(v)) => json_reply(StatusCode::OK, &v),
        Ok(Err(e)) => failed(&e),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string(), None),
    }
}

fn failed(e: &MachineError) -> Reply {
    let (status, field) = match e {
        MachineError::Id(_) => (StatusCode::BAD_REQUEST, Some("id")),
        MachineError::Missing(_) => (StatusCode::NOT_FOUND, None),
        MachineError::Conflict(_) => (StatusCode::CONFLICT, Some("addresses")),
        MachineError::DuplicateAddress { .. } | MachineError::NoAddress => {
            (StatusCode::BAD_REQUEST, Some("addresses"))
        }
        MachineError::Invalid { field, .. } => (StatusCode::BAD_REQUEST, Some(*field)),
        MachineError::Taken { field, .. } => (StatusCode::CONFLICT, Some(*field)),
        MachineError::Sealed => (StatusCode::SERVICE_UNAVAILABLE, None),
        MachineError::Kernel(_)
        | MachineError::KernelUnsure(_)
        | MachineError::Persist { .. }
        | MachineError::Load { .. }
        | MachineError::PersistUnsure { .. }
        | MachineError::Orphaned { .. }
        | MachineError::Mismatched { .. }
        | MachineError::Log { .. } => (StatusCode::INTERNAL_SERVER_ERROR, None),
    };
    error(status, &e.to_string(), field)
}

/// `400` with the validation errors, as `machine-egress check` prints them.
fn invalid(problems: &[Problem]) -> Reply {
    json_reply(
        StatusCode::BAD_REQUEST,
        &json!({ "error": "invalid machine egress policy", "errors": problems }),
    )
}

async fn policy_body(req: Request<Incoming>) -> Result<MachineEgress, Reply> {
    let text = egress_api::body::text(req.into_body(), MAX_BODY).await?;
    MachineEgress::from_json(&text).map_err(|p| invalid(&p))
}

/// Why a `PUT /v1/vms/{id}` body was refused: the message, the field it
/// names, and the policy's problems when it was the policy.
#[derive(Debug)]
pub struct RegistrationError {
    pub message: String,
    pub field: Option<String>,
    pub problems: Option<Vec<Problem>>,
}

/// Reads `PUT /v1/vms/{id}`'s body: `{"addresses": [..], "egress":
/// <policy>?, "link": "<ifname>"?, "cgroup": "<path>"?}`. `addresses` may
/// be left out only with `cgroup`.
pub fn registration_doc(text: &str) -> Result<Registration, RegistrationError> {
    let doc: Value =
        egress_policy::json_value(text).map_err(|e| bad(format!("body: {e}"), None))?;
    let Some(obj) = doc.as_object() else {
        return Err(bad("body must be a JSON object".into(), None));
    };
    const FIELDS: [&str; 4] = ["addresses", "egress", "link", "cgroup"];
    if let Some(k) = obj.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        let why = format!("unknown field {k:?}, expected one of {FIELDS:?}");
        return Err(bad(why, Some(k)));
    }
    let link = optional_string(obj, "link")?;
    let cgroup = optional_string(obj, "cgroup")?;
    let addresses = match obj.get("addresses") {
        None if cgroup.is_some() => Vec::new(),
        list => addresses(list)?,
    };
    let egress = match obj.get("egress") {
        None | Some(Value::Null) => None,
        Some(v) => Some(MachineEgress::from_value(v).map_err(|p| RegistrationError {
            message: "invalid machine egress policy".into(),
            field: Some("egress".into()),
            problems: Some(p),
        })?),
    };
    Ok(Registration {
        addresses,
        egress,
        link,
        cgroup,
    })
}

fn bad(message: String, field: Option<&str>) -> RegistrationError {
    RegistrationError {
        message,
        field: field.map(str::to_owned),
        problems: None,
    }
}

/// `addresses`: a list of IP addresses.
fn addresses(list: Option<&Value>) -> Result<Vec<IpAddr>, RegistrationError> {
    let Some(list) = list.and_then(Value::as_array) else {
        let why = "addresses: expected a list of IP addresses".to_owned();
        return Err(bad(why, Some("addresses")));
    };
    let mut addresses = Vec::with_capacity(list.len());
    for (i, a) in list.iter().enumerate() {
        let field = format!("addresses[{i}]");
        match a.as_str().map(str::parse::<IpAddr>) {
            Some(Ok(ip)) => addresses.push(ip),
            _ => {
                return Err(bad(
                    format!("{field}: {a} is not an IP address"),
                    Some(&field),
                ))
            }
        }
    }
    Ok(addresses)
}

/// A string field that may be absent or null.
fn optional_string(
    obj: &serde_json::Map<String, Value>,
    name: &str,
) -> Result<Option<String>, RegistrationError> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(bad(format!("{name}: {v} is not a string"), Some(name))),
    }
}

/// The body as the route answers it: `400` naming the field, or the
/// checker's errors for an invalid policy.
fn registration(text: &str) -> Result<Registration, Box<Reply>> {
    registration_doc(text).map_err(|e| {
        Box::new(match e.problems {
            Some(p) => invalid(&p),
            None => error(StatusCode::BAD_REQUEST, &e.message, e.field.as_deref()),
        })
    })
}

/// `?name=true|false|1|0`; absent is false.
fn flag(query: &str, name: &str) -> Result<bool, Box<Reply>> {
    let mut value = false;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, "true"));
        if k != name {
            return Err(Box::new(error(
                StatusCode::BAD_REQUEST,
                &format!("unknown query parameter {k:?} (expected {name})"),
                Some(k),
            )));
        }
        value = match v {
            "true" | "1" => true,
            "false" | "0" => false,
            other => {
                return Err(Box::new(error(
                    StatusCode::BAD_REQUEST,
                    &format!("{name}={other:?}: expected true or false"),
                    Some(name),
                )))
            }
        };
    }
    Ok(value)
}

/// The VM's refused (or, in audit, would-be-refused) destinations, with
/// the names DNS attribution holds for each.
fn observed_json(m: &Machines, id: &str) -> Result<Value, MachineError> {
    let vm = m.vm(id)?;
    let view = m.observed(id)?;
    let list: Vec<Value> = view
        .entries
        .iter()
        .map(|((addr, proto, port), seen)| {
            json!({
                "address": addr,
                "proto": proto.as_str(),
                "port": port,
                "count": seen.count,
                "first_seen": crate::observed::unix(seen.first),
                "last_seen": crate::observed::unix(seen.last),
                "names": m.names_for(*addr),
            })
        })
        .collect();
    Ok(json!({
        "vm": id,
        "mode": vm.effective.mode.as_str(),
        "recorded": if vm.effective.mode == machine::Mode::Audit { "would_refuse" } else { "refused" },
        "evictions": view.evictions,
        "lost": view.lost,
        "observed": list,
    }))
}

fn suggest(m: &Machines, id: &str, apply: bool) -> Result<Value, MachineError> {
    let vm = m.vm(id)?;
    let entries = m.observed(id)?.entries;
    // The rules are IPv4 only: an IPv6 destination is listed as uncovered.
    let observed: Vec<Observed> = entries
        .iter()
        .filter_map(|((addr, proto, port), seen)| match addr {
            IpAddr::V4(v4) => Some(Observed {
                addr: *v4,
                proto: *proto,
                port: *port,
                names: m.names_for(*addr),
                count: seen.count,
            }),
            IpAddr::V6(_) => None,
        })
        .collect();
    let ipv6 = entries.iter().filter(|((a, _, _), _)| a.is_ipv6()).map(
        |((addr, proto, port), _)| json!({ "address": addr, "proto": proto.as_str(), "port": port }),
    );
    let s = machine::suggest(&vm.effective, &observed);
    let added: Vec<Value> = s
        .added
        .iter()
        .map(|r| {
            MachineEgress {
                mode: machine::Mode::Allowlist,
                rules: vec![r.clone()],
            }
            .to_value()["rules"][0]
                .clone()
        })
        .collect();
    let uncovered: Vec<Value> = s
        .uncovered
        .iter()
        .map(|o| json!({ "address": o.addr, "proto": o.proto.as_str(), "port": o.port }))
        .chain(ipv6)
        .collect();
    let policy = s.policy.to_value();
    if apply {
        m.set_egress_from(id, Some(s.policy), Some(&vm.effective))?;
    }
    Ok(json!({
        "vm": id,
        "policy": policy,
        "added": added,
        "notes": s.notes,
        "uncovered": uncovered,
        "applied": apply,
    }))
}

fn vm_json(vm: &Vm) -> Value {
    json!({
        "id": vm.id,
        "addresses": vm.addresses,
        "link": vm.link,
        "cgroup": vm.cgroup,
        "egress": vm.egress.as_ref().map(MachineEgress::to_value),
        "effective": vm.effective.to_value(),
        "follows_default": vm.egress.is_none(),
    })
}

fn egress_json(id: &str, view: &EgressView) -> Value {
    json!({
        "vm": id,
        "source": if view.own { "vm" } else { "default" },
        "policy": view.policy.to_value(),
    })
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use std::sync::Arc;

    /// A burst of calls takes at most [`super::TURNS`] blocking threads at
    /// once: the others wait their turn without one.
    #[tokio::test]
    async fn a_burst_of_calls_takes_two_blocking_threads_at_most() {
        let (now, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let calls: Vec<_> = (0..24)
            .map(|_| {
                let (now, most) = (now.clone(), most.clone());
                tokio::spawn(super::blocking(move || {
                    most.fetch_max(now.fetch_add(1, SeqCst) + 1, SeqCst);
                    std::thread::sleep(std::time::Duration::from_millis(50));
                    now.fetch_sub(1, SeqCst);
                    Ok(serde_json::json!({}))
                }))
            })
            .collect();
        for call in calls {
            assert_eq!(call.await.expect("call").status(), 200);
        }
        assert_eq!(most.load(SeqCst), super::TURNS);
    }

    #[test]
    fn a_registration_with_a_key_twice_is_refused() {
        let ok = super::registration_doc(r#"{"addresses": ["100.64.0.2"]}"#);
        assert!(ok.is_ok(), "{ok:?}");
        for text in [
            r#"{"addresses": ["100.64.0.2"], "egress": {"mode": "open"}, "egress": null}"#,
            r#"{"addresses": ["100.64.0.2"], "addresses": ["100.64.0.3"]}"#,
        ] {
            let e = super::registration_doc(text).expect_err(text);
            assert!(e.message.contains("duplicate key"), "{text}: {}", e.message);
        }
    }
}
