//! The admin listener: the control API the controller pushes policies to,
//! explain and attribution for operators, health, readiness and metrics.
//!
//! | route | what |
//! | --- | --- |
//! | `PUT /v1/sandboxes/{id}` | `{"addresses": [..], "policy": {..}}`, validated whole, applied atomically |
//! | `GET`/`DELETE /v1/sandboxes/{id}` | read or remove one |
//! | `GET /v1/sandboxes` | list |
//! | `PUT /v1/sandboxes` | `{"sandboxes": [{"id", "addresses", "policy"}]}`: replace all (resync) |
//! | `POST /v1/explain` | `{"sandbox", "dst", "tls", "sni", "host"}`: the decision now, and why |
//! | `GET /v1/sandboxes/{id}/attribution` | live attribution with remaining TTL |
//! | `GET /v1/sandboxes/{id}/proposals` | allow entries the sandbox's denials propose ([`crate::proposed`]) |
//! | `PUT`/`GET`/`DELETE /v1/sandboxes/{id}/shadow` | a candidate policy judged beside the active one ([`crate::shadow`]) |
//! | `GET /v1/sandboxes/{id}/shadow/report`, `POST …/shadow/promote` | what it would change; make it the policy |
//! | `/v1/vms/…`, `/v1/network/egress/defaults` | machine egress ([`egress_machine::api`]) |
//! | `GET /healthz`, `/readyz`, `/metrics` | |
//!
//! With `admin.token_file` set, every route but `/healthz` and `/readyz` needs
//! `Authorization: Bearer <token>`. Bodies are capped at 1 MiB (`413`).

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use egress_api::body::{Line, Lines};
use egress_api::explain::{Explain, Question};
pub(crate) use egress_api::gateway::{PutSandbox, Resync};
use egress_api::reply::{openmetrics, text};
use egress_policy::SandboxId;
use http::{header, Method, Request, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::net::TcpListener;

use crate::commit::{Change, Committer, NotApplied, Outcome};
use crate::control_http::{body_text, error, json_reply, Reply, MAX_BODY};
use crate::credentials::{self};
use crate::decide::{explained, explained_request, judge_question, Claims};
use crate::metrics::OutcomeLabels;
use crate::persist::{self, SandboxDoc};
use crate::registry::{Extras, Registry};
use crate::state::Dataplane;

mod order;
mod shadow;

/// The control API's state: the dataplane it changes, and what only it uses.
pub(crate) struct Control {
    dp: Arc<Dataplane>,
    /// The bearer tokens the routes need.
    tokens: Tokens,
    /// Makes pushes durable and applies them in order (group commit).
    committer: Committer,
    /// The order pushes arrived in, which each sandbox's keep.
    arrivals: order::Arrivals,
    /// New at every start: a controller that sees it change knows the
    /// gateway restarted and resyncs it.
    epoch: String,
    /// Machine egress: the VM routes.
    machines: Arc<egress_machine::Machines>,
}

impl Control {
    pub(crate) fn new(
        dp: Arc<Dataplane>,
        tokens: Tokens,
        committer: Committer,
        machines: Arc<egress_machine::Machines>,
    ) -> Arc<Self> {
        Arc::new(Self {
            dp,
            tokens,
            committer,
            arrivals: order::Arrivals::default(),
            epoch: epoch(),
            machines,
        })
    }
}

impl Control {
    /// The pushed state's generation: the last journal sequence number.
    fn generation(&self) -> u64 {
        self.committer.generation.load(Ordering::Acquire)
    }
}

/// The admin listener's bearer tokens.
#[derive(Clone, Debug, Default)]
pub(crate) struct Tokens {
    /// `admin.token_file`'s: every route but `/healthz` and `/readyz`.
    pub(crate) admin: Option<String>,
    /// `admin.metrics_token_file`'s: `GET /metrics` only.
    pub(crate) metrics: Option<String>,
}

/// A random identifier for this process's lifetime.
fn epoch() -> String {
    use aws_lc_rs::rand::SecureRandom;
    let mut bytes = [0u8; 8];
    let _ = aws_lc_rs::rand::SystemRandom::new().fill(&mut bytes);
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Serves the admin API on `listener` until the task is dropped.
pub(crate) async fn serve(listener: TcpListener, ctl: Arc<Control>) {
    egress_api::serve::serve(listener, "admin", move |req| {
        let ctl = ctl.clone();
        async move { route(req, &ctl).await }
    })
    .await;
}

/// `GET /readyz`: `200 ready epoch=… generation=… revisions=1` once the pushed state is
/// enforced and the listeners are up, else `503 not ready`; `503` too once
/// no change can be committed before a restart.
fn readyz(ctl: &Control) -> Reply {
    if ctl.committer.stuck.load(Ordering::Acquire) {
        // Every change refused: the controller's deletes and narrowings
        // would not be enforced.
        let why = "not ready: the state directory is in doubt, no change is committed; restart the gateway\n";
        return text(StatusCode::SERVICE_UNAVAILABLE, why);
    }
    if ctl.dp.ready.load(Ordering::Acquire) {
        // `revisions=1`: pushes may name a revision (an earlier build
        // refuses a document with the field, and says nothing of it).
        let state = format!(
            "ready epoch={} generation={} revisions=1\n",
            ctl.epoch,
            ctl.generation()
        );
        text(StatusCode::OK, state)
    } else {
        text(StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}

async fn route(req: Request<Incoming>, ctl: &Control) -> Reply {
    let path = req.uri().path().to_owned();
    if path == "/healthz" {
        return text(StatusCode::OK, "ok\n");
    }
    // Readiness answers without the token too: a kubelet or load balancer
    // probe cannot present one, and the body (epoch and generation) is no
    // secret.
    if path == "/readyz" && req.method() == Method::GET {
        return readyz(ctl);
    }
    if let Some(refused) = authorize(&req, ctl) {
        return refused;
    }
    let method = req.method().clone();
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    if let ["v1", "vms", ..] | ["v1", "network", ..] = segments.as_slice() {
        return egress_machine::api::route(req, &ctl.machines).await;
    }
    if let ["v1", "sandboxes", _, "shadow", ..] = segments.as_slice() {
        return shadow_route(req, ctl, &segments).await;
    }
    match (&method, segments.as_slice()) {
        (&Method::GET, ["metrics"]) => metrics(ctl),
        (&Method::GET, ["v1", "sandboxes"]) => list(ctl),
        (&Method::PUT, ["v1", "sandboxes"]) if is_ndjson(&req) => {
            match stream_docs(req, ctl.dp.registry.max()).await {
                Ok((docs, lines)) => resync(ctl, docs, Some(lines)).await,
                Err(r) => rejected(ctl, r),
            }
        }
        (&Method::PUT, ["v1", "sandboxes"]) => match body::<Resync>(req).await {
            Ok(doc) => resync(ctl, doc.sandboxes, None).await,
            Err(r) => rejected(ctl, r),
        },
        (&Method::GET, ["v1", "sandboxes", id]) => get(ctl, id),
        (&Method::PUT, ["v1", "sandboxes", id]) => {
            let id = (*id).to_owned();
            if let Err(msg) = valid_id(&id) {
                return rejected(ctl, error(StatusCode::BAD_REQUEST, &msg, Some("id")));
            }
            match body::<PutSandbox>(req).await {
                Ok(doc) => put(ctl, id, doc).await,
                Err(r) => rejected(ctl, r),
            }
        }
        (&Method::DELETE, ["v1", "sandboxes", id]) => delete(ctl, id, req.uri().query()).await,
        (&Method::GET, ["v1", "sandboxes", id, "attribution"]) => attribution(ctl, id),
        (&Method::GET, ["v1", "sandboxes", id, "proposals"]) => proposals(ctl, id),
        (&Method::POST, ["v1", "explain"]) => match body::<Explain>(req).await {
            Ok(e) => explain(ctl, e),
            Err(r) => r,
        },
        _ => error(
            StatusCode::NOT_FOUND,
            &format!("no route {method} {path}"),
            None,
        ),
    }
}

/// The shadow routes ([`shadow`]).
async fn shadow_route(req: Request<Incoming>, ctl: &Control, segments: &[&str]) -> Reply {
    let method = req.method().clone();
    match (&method, segments) {
        (&Method::PUT, ["v1", "sandboxes", id, "shadow"]) => {
            let id = (*id).to_owned();
            match body::<shadow::PutShadow>(req).await {
                Ok(doc) => shadow::put(ctl, &id, doc).await,
                Err(r) => rejected(ctl, r),
            }
        }
        (&Method::GET, ["v1", "sandboxes", id, "shadow"]) => shadow::get(ctl, id),
        (&Method::DELETE, ["v1", "sandboxes", id, "shadow"]) => shadow::delete(ctl, id).await,
        (&Method::GET, ["v1", "sandboxes", id, "shadow", "report"]) => shadow::report(ctl, id),
        (&Method::POST, ["v1", "sandboxes", id, "shadow", "promote"]) => {
            shadow::promote(ctl, id).await
        }
        _ => error(
            StatusCode::NOT_FOUND,
            &format!("no route {method} /{}", segments.join("/")),
            None,
        ),
    }
}

/// With a token configured: `401` unless the request presents it (or, for
/// `GET /metrics`, the metrics token). Without one (the listener is on
/// loopback): [`not_from_a_browser`].
fn authorize(req: &Request<Incoming>, ctl: &Control) -> Option<Reply> {
    let Some(token) = ctl.tokens.admin.as_ref() else {
        return not_from_a_browser(req);
    };
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let is = |t: &String| presented.is_some_and(|p| constant_time_eq(p.as_bytes(), t.as_bytes()));
    let scrape = req.method() == Method::GET && req.uri().path() == "/metrics";
    if is(token) || (scrape && ctl.tokens.metrics.as_ref().is_some_and(is)) {
        return None;
    }
    let mut r = error(
        StatusCode::UNAUTHORIZED,
        "missing or wrong bearer token",
        None,
    );
    r.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        header::HeaderValue::from_static("Bearer"),
    );
    Some(r)
}

/// Without a token, anything on the host reaches the admin API, a browser
/// too: a page's cross-origin request (it carries `Origin`), or its own
/// name resolved again to 127.0.0.1 (DNS rebinding: its `Host` is the
/// page's name). `403` for either; the tools that use the API (curl, the
/// CLI, a controller on the host) send neither.
fn not_from_a_browser(req: &Request<Incoming>) -> Option<Reply> {
    if let Some(origin) = req.headers().get(header::ORIGIN) {
        let why = format!(
            "a browser's request (Origin {:?}): without admin.token_file the admin API takes none",
            String::from_utf8_lossy(origin.as_bytes())
        );
        return Some(error(StatusCode::FORBIDDEN, &why, None));
    }
    let host = req
        .headers()
        .get(header::HOST)
        .map(|h| String::from_utf8_lossy(h.as_bytes()).into_owned())
        .or_else(|| req.uri().authority().map(|a| a.as_str().to_owned()));
    match host {
        Some(h) if !is_loopback_host(&h) => {
            let why = format!(
                "Host {h:?}: without admin.token_file the admin API answers requests to a loopback address or localhost only"
            );
            Some(error(StatusCode::FORBIDDEN, &why, None))
        }
        _ => None,
    }
}

/// `localhost`, or a loopback address, with or without a port.
fn is_loopback_host(host: &str) -> bool {
    let Ok(authority) = host.parse::<http::uri::Authority>() else {
        return false;
    };
    let name = authority.host();
    let name = name.trim_start_matches('[').trim_end_matches(']');
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.to_canonical().is_loopback())
}

fn metrics(ctl: &Control) -> Reply {
    openmetrics(ctl.dp.metrics.encode())
}

/// `GET /v1/sandboxes`. The generation is read before the sandboxes: the
/// commit thread changes the registry before it counts the change, so the
/// list holds at least what its generation says. Read the other way round,
/// a change landing between the two reads was counted in a generation
/// listed without it, and a controller that acknowledged that generation
/// (its drift check) would never see the change. Each sandbox is written
/// out as it is read: the reply's bytes are the only copy of the list.
fn list(ctl: &Control) -> Reply {
    let generation = ctl.generation();
    let sandboxes = Listed(ctl.dp.registry.all());
    json_reply(
        StatusCode::OK,
        &Listing {
            epoch: &ctl.epoch,
            generation,
            sandboxes,
        },
    )
}

/// The body of `GET /v1/sandboxes`.
#[derive(serde::Serialize)]
struct Listing<'a> {
    epoch: &'a str,
    generation: u64,
    sandboxes: Listed,
}

/// Sandboxes listed, each as [`sandbox_json`] writes it.
struct Listed(Vec<Arc<crate::registry::Sandbox>>);

impl serde::Serialize for Listed {
    fn serialize<S: serde::Serializer>(&self, out: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq;
        let mut seq = out.serialize_seq(Some(self.0.len()))?;
        for s in &self.0 {
            seq.serialize_element(&sandbox_json(&SandboxDoc::from(&**s)))?;
        }
        seq.end()
    }
}

fn get(ctl: &Control, id: &str) -> Reply {
    match ctl.dp.registry.get(&SandboxId::new(id)) {
        Some(s) => json_reply(StatusCode::OK, &sandbox_json(&SandboxDoc::from(&*s))),
        None => error(StatusCode::NOT_FOUND, &format!("no sandbox {id:?}"), None),
    }
}

/// Reads and parses a capped JSON body; errors name the field.
async fn body<T: for<'de> Deserialize<'de>>(req: Request<Incoming>) -> Result<T, Reply> {
    egress_api::body::json(&body_text(req).await?)
}

fn valid_id(id: &str) -> Result<(), String> {
    SandboxId::parse(id).map(drop).map_err(|e| e.to_string())
}

/// Checks a pushed sandbox's credentials and reads their values, off the
/// async workers: reading files (and taking the values' lock) blocks.
async fn load_credentials(ctl: &Control, list: &[credentials::Credential]) -> Result<(), String> {
    credentials::validate(list)?;
    if list.is_empty() {
        return Ok(());
    }
    let (dp, list) = (ctl.dp.clone(), list.to_vec());
    tokio::task::spawn_blocking(move || dp.secrets.load(&list))
        .await
        .unwrap_or_else(|e| Err(format!("reading the values failed: {e}")))
}

/// [`load_credentials`] for a resync's sandboxes (already checked): the
/// first that cannot be read, with its index.
async fn load_all_credentials(ctl: &Control, docs: &[SandboxDoc]) -> Result<(), (usize, String)> {
    if docs.iter().all(|d| d.credentials.is_empty()) {
        return Ok(());
    }
    let dp = ctl.dp.clone();
    let lists: Vec<Vec<credentials::Credential>> =
        docs.iter().map(|d| d.credentials.clone()).collect();
    tokio::task::spawn_blocking(move || dp.secrets.load_all(lists.iter().map(|l| &l[..])))
        .await
        .unwrap_or_else(|e| Err((0, format!("reading the values failed: {e}"))))
}

async fn put(ctl: &Control, id: String, doc: PutSandbox) -> Reply {
    let sid = SandboxId::new(&id);
    let ticket = ctl.arrivals.arrive(&sid);
    if let Err(e) = egress_api::gateway::sandbox_addresses(&doc.addresses) {
        return rejected(ctl, error(StatusCode::BAD_REQUEST, &e, Some("addresses")));
    }
    if let Err(e) = load_credentials(ctl, &doc.credentials).await {
        return rejected(ctl, error(StatusCode::BAD_REQUEST, &e, Some("credentials")));
    }
    if let Some(Err(e)) = doc.upstream_proxy.as_ref().map(|c| ctl.dp.proxies.check(c)) {
        return rejected(
            ctl,
            error(StatusCode::BAD_REQUEST, &e, Some("upstream_proxy")),
        );
    }
    let extras = Extras {
        credentials: doc.credentials,
        upstream_proxy: doc.upstream_proxy,
        shadow: None,
        revision: doc.revision,
    };
    // Compiling the policy is the costly part: done here, concurrently.
    let compile = move |r: &Registry| r.prepare_with(sid, doc.addresses, doc.policy, extras);
    let sandbox = match compiled(ctl, compile).await {
        Ok(sandbox) => sandbox,
        Err(reply) => return rejected(ctl, reply),
    };
    let change = Change::Put(sandbox.clone());
    let answer = match ticket.queue(|| ctl.committer.queue(change)) {
        Ok(Ok(answer)) => answer,
        Ok(Err(why)) => return refused(ctl, why, "addresses"),
        Err(order::Superseded) => return superseded(ctl, false),
    };
    match Committer::outcome(answer).await {
        Ok(_) => {
            applied(ctl);
            json_reply(StatusCode::OK, &sandbox_json(&SandboxDoc::from(&*sandbox)))
        }
        Err(why) => refused(ctl, why, "addresses"),
    }
}

/// A push that did not apply: `409` for a conflict, `500` when it could not
/// be made durable (nothing applied), `503` when the commit queue is full.
fn refused(ctl: &Control, why: NotApplied, field: &str) -> Reply {
    let reply = match why {
        // The limit is no field's fault.
        NotApplied::Refused(e @ crate::registry::RegistryError::Full { .. }) => {
            error(StatusCode::CONFLICT, &e.to_string(), None)
        }
        NotApplied::Refused(e) => error(StatusCode::CONFLICT, &e.to_string(), Some(field)),
        NotApplied::Missing => error(StatusCode::NOT_FOUND, "no such sandbox", None),
        NotApplied::Failed(e) => error(StatusCode::INTERNAL_SERVER_ERROR, &e, None),
        NotApplied::Conflict(e) => error(StatusCode::CONFLICT, &e, None),
        NotApplied::Stale(s) => {
            let why = format!(
                "not applied: the gateway holds revision {} of this sandbox, later than this change's {} (a later change arrived first)",
                s.held, s.named
            );
            error(StatusCode::CONFLICT, &why, Some("revision"))
        }
        NotApplied::Busy => {
            let why = "not applied: the commit thread has too many changes waiting (the state directory's disk may be stalled); try again";
            error(StatusCode::SERVICE_UNAVAILABLE, why, None)
        }
    };
    rejected(ctl, reply)
}

/// Replaces every sandbox (the controller's resync), atomically; written as
/// a new snapshot. `lines`: an NDJSON body's line of each document, which
/// its errors name.
async fn resync(ctl: &Control, docs: Vec<SandboxDoc>, lines: Option<Vec<usize>>) -> Reply {
    // Its place in the order, as it arrives: a push that arrives while its
    // credentials are read or its policies compiled is newer.
    let ticket = ctl.arrivals.arrive_resync();
    let named = |status: StatusCode, i: usize, part: &str, why: &str| {
        let field = format!("sandboxes[{i}].{part}");
        let why = match lines.as_ref().and_then(|l| l.get(i)) {
            Some(line) => format!("line {line}: {why}"),
            None => why.to_owned(),
        };
        rejected(ctl, error(status, &why, Some(&field)))
    };
    let bad = |i: usize, part: &str, why: &str| named(StatusCode::BAD_REQUEST, i, part, why);
    if let Err((i, msg)) = egress_api::gateway::resync_ids(&docs) {
        return bad(i, "id", &msg);
    }
    // Refused before a credential is read or a policy compiled: the
    // registry would refuse it after compiling every one.
    let max = ctl.dp.registry.max();
    if docs.len() > max {
        let refused_as = format!("a resync of {}", docs.len());
        let why = crate::registry::RegistryError::Full {
            max,
            refused: refused_as,
        };
        return refused(ctl, NotApplied::Refused(why), "sandboxes");
    }
    if let Some((status, i, part, why)) = unfit(ctl, &docs) {
        return named(status, i, part, &why);
    }
    if let Err((i, e)) = load_all_credentials(ctl, &docs).await {
        return bad(i, "credentials", &e);
    }
    let compile = move |r: &Registry| docs.into_iter().map(|d| persist::prepare(d, r)).collect();
    let prepared = match compiled(ctl, compile).await {
        Ok(prepared) => prepared,
        Err(reply) => return rejected(ctl, reply),
    };
    commit_resync(ctl, ticket, prepared).await
}

/// Queues a resync's `prepared` sandboxes in `ticket`'s place and answers
/// how many, with the generation they were committed at: what a
/// controller acknowledges, not the one it reads later, which may count
/// another client's change since.
async fn commit_resync(
    ctl: &Control,
    ticket: order::Ticket<'_>,
    prepared: Vec<Arc<crate::registry::Sandbox>>,
) -> Reply {
    let n = prepared.len();
    // The evidence went as the commit thread applied the resync.
    let forget = |dp: &Dataplane, outcome: &Outcome| {
        if outcome.is_ok() {
            let registry = &dp.registry;
            dp.proposed.retain(|id| registry.get(id).is_some());
        }
    };
    let answer = match ticket.queue(|| ctl.committer.queue(Change::Replace(prepared))) {
        Ok(Ok(answer)) => answer,
        Ok(Err(why)) => return refused(ctl, why, "sandboxes"),
        Err(order::Superseded) => return superseded(ctl, true),
    };
    match then(ctl, answer, forget).await {
        Ok(generation) => {
            applied(ctl);
            let answer = json!({ "sandboxes": n, "generation": generation });
            json_reply(StatusCode::OK, &answer)
        }
        Err(why) => refused(ctl, why, "sandboxes"),
    }
}

/// A delete's query: nothing, or `revision=N` alone.
fn delete_revision(query: Option<&str>) -> Result<Option<u64>, String> {
    let Some(query) = query else {
        return Ok(None);
    };
    let value = query
        .strip_prefix(egress_api::gateway::REVISION)
        .and_then(|q| q.strip_prefix('='));
    match value.map(str::parse::<u64>) {
        Some(Ok(revision)) => Ok(Some(revision)),
        _ => Err(format!(
            "the query {query:?} is not revision=N (N a whole number below 2^64)"
        )),
    }
}

async fn delete(ctl: &Control, id: &str, query: Option<&str>) -> Reply {
    let revision = match delete_revision(query) {
        Ok(revision) => revision,
        Err(why) => {
            let reply = error(StatusCode::BAD_REQUEST, &why, Some("revision"));
            return rejected(ctl, reply);
        }
    };
    let sid = SandboxId::new(id);
    let ticket = ctl.arrivals.arrive(&sid);
    let gone = sid.clone();
    // Missing too: a delete applied before its first caller went away. The
    // evidence went as the commit thread applied it.
    let forget = move |dp: &Dataplane, outcome: &Outcome| {
        if matches!(outcome, Ok(_) | Err(NotApplied::Missing)) {
            dp.proposed.forget(&gone);
        }
    };
    let answer = match ticket.queue(|| ctl.committer.queue(Change::Delete(sid, revision))) {
        Ok(Ok(answer)) => answer,
        Ok(Err(why)) => return refused(ctl, why, "id"),
        Err(order::Superseded) => return superseded(ctl, false),
    };
    match then(ctl, answer, forget).await {
        Ok(_) => {
            applied(ctl);
            json_reply(StatusCode::OK, &json!({ "deleted": id }))
        }
        Err(NotApplied::Missing) => {
            error(StatusCode::NOT_FOUND, &format!("no sandbox {id:?}"), None)
        }
        Err(why) => refused(ctl, why, "id"),
    }
}

/// Waits for a queued change's outcome and then calls `forget` with it, in
/// a task of their own: the request's future is dropped if its client goes
/// away while the change commits (the commit thread applies it all the
/// same), and what a removed sandbox leaves (evidence, proposals) must go
/// with it even then, or a sandbox registered again under its id would
/// find it.
async fn then(
    ctl: &Control,
    answer: tokio::sync::oneshot::Receiver<Outcome>,
    forget: impl FnOnce(&Dataplane, &Outcome) + Send + 'static,
) -> Outcome {
    let dp = ctl.dp.clone();
    let task = tokio::spawn(async move {
        let outcome = Committer::outcome(answer).await;
        forget(&dp, &outcome);
        outcome
    });
    task.await
        .unwrap_or_else(|e| Err(NotApplied::Failed(format!("the commit's task failed: {e}"))))
}

/// A change that a later one overtook ([`order`]), nothing applied: `409`
/// for a push of one sandbox, `503` for a resync (to be sent again).
fn superseded(ctl: &Control, resync: bool) -> Reply {
    let reply = match resync {
        false => {
            let why = "not applied: a later push of this sandbox (or a resync) arrived after this one and was queued first";
            error(StatusCode::CONFLICT, why, None)
        }
        true => {
            let why = "not applied: a push of a sandbox arrived after this resync and was queued first; resync again";
            error(StatusCode::SERVICE_UNAVAILABLE, why, None)
        }
    };
    rejected(ctl, reply)
}

fn applied(ctl: &Control) {
    ctl.dp
        .metrics
        .pushes
        .get_or_create(&OutcomeLabels { outcome: "applied" })
        .inc();
}

/// The first document of a resync that cannot be registered, before any
/// credential is read or policy compiled: the status, its index, the
/// field and why.
fn unfit(ctl: &Control, docs: &[SandboxDoc]) -> Option<(StatusCode, usize, &'static str, String)> {
    let bad = |i, part, why: String| Some((StatusCode::BAD_REQUEST, i, part, why));
    for (i, d) in docs.iter().enumerate() {
        if let Err(e) = egress_api::gateway::sandbox_addresses(&d.addresses) {
            return bad(i, "addresses", e);
        }
        if let Err(e) = credentials::validate(&d.credentials) {
            return bad(i, "credentials", e);
        }
        if let Some(Err(e)) = d.upstream_proxy.as_ref().map(|c| ctl.dp.proxies.check(c)) {
            return bad(i, "upstream_proxy", e);
        }
    }
    // Two documents naming one address: the later one named (the
    // registry would say only that the address "already belongs" to the
    // earlier, as if it were registered before).
    let (i, ip, j) = shared_address(docs)?;
    let why = format!("address {ip} is also sandboxes[{j}]'s ({})", docs[j].id);
    Some((StatusCode::CONFLICT, i, "addresses", why))
}

/// The first document of `docs` with an address an earlier one has: its
/// index, the address, and the earlier one's index.
fn shared_address(docs: &[SandboxDoc]) -> Option<(usize, IpAddr, usize)> {
    let mut held: HashMap<IpAddr, usize> = HashMap::new();
    for (i, d) in docs.iter().enumerate() {
        for ip in &d.addresses {
            match held.entry(*ip) {
                Entry::Occupied(o) if *o.get() != i => return Some((i, *ip, *o.get())),
                Entry::Occupied(_) => {}
                Entry::Vacant(v) => {
                    v.insert(i);
                }
            }
        }
    }
    None
}

/// Runs `compile` (compiling policies, the costly part of a push) on the
/// runtime's blocking threads: on one of its workers, a large policy or a
/// resync of thousands would hold a thread the flows and DNS share for as
/// long. A compile that panicked is `500`.
pub(crate) async fn compiled<T: Send + 'static>(
    ctl: &Control,
    compile: impl FnOnce(&Registry) -> T + Send + 'static,
) -> Result<T, Reply> {
    let registry = ctl.dp.registry.clone();
    tokio::task::spawn_blocking(move || compile(&registry))
        .await
        .map_err(|e| {
            let why = format!("compiling the policy failed: {e}");
            error(StatusCode::INTERNAL_SERVER_ERROR, &why, None)
        })
}

fn rejected(ctl: &Control, reply: Reply) -> Reply {
    ctl.dp
        .metrics
        .pushes
        .get_or_create(&OutcomeLabels {
            outcome: "rejected",
        })
        .inc();
    reply
}

fn explain(ctl: &Control, e: Explain) -> Reply {
    let Some(sandbox) = ctl.dp.registry.get(&SandboxId::new(&e.sandbox)) else {
        return error(
            StatusCode::NOT_FOUND,
            &format!("no sandbox {:?}", e.sandbox),
            Some("sandbox"),
        );
    };
    // Read as the dataplane reads it: a name the peek refuses is refused here.
    let Question {
        sni,
        host,
        address_host,
        request,
    } = match e.question() {
        Ok(q) => q,
        Err(u) => return error(StatusCode::BAD_REQUEST, &u.message, Some(u.field)),
    };
    let claims = Claims::asked(e.dst, e.tls, e.ech, sni.as_ref(), host.as_ref())
        .with_address_host(address_host)
        .with_stream(e.stream);
    let lookup = ctl.dp.cache.names_for(&sandbox.id, claims.dst.ip());
    let names = lookup.names();
    let doh = &ctl.dp.doh_names;
    let verdict = judge_question(&sandbox.policy, &claims, &names, lookup.gap(), doh);
    let mut v = explained(&verdict, &sandbox.policy, &names);
    if let Some((method, path)) = &request {
        if !verdict.is_deny() {
            // On a terminated flow the request's name is its Host, which must be the SNI.
            let name = host.as_ref().or(sni.as_ref());
            v["request"] = explained_request(&sandbox.policy, e.tls, name, &names, method, path);
            explain_credentials(
                &mut v["request"],
                &sandbox.credentials,
                (e.tls, name),
                &names,
            );
        }
    }
    json_reply(StatusCode::OK, &v)
}

/// A request explain allows, judged by the credentials stage too, as far
/// as it goes without headers (the question has none): refused there, it
/// is `deny` with the stage's code and the credential's index and name.
fn explain_credentials(
    request: &mut Value,
    list: &[credentials::Credential],
    (tls, name): (bool, Option<&egress_policy::Hostname>),
    attributed: &[egress_policy::Hostname],
) {
    let path = request["path"].as_str().unwrap_or_default().to_owned();
    if request["verdict"] != "allow" || list.is_empty() {
        return;
    }
    let may_be = crate::decide::request_names(tls, name, attributed);
    let names = match name.filter(|_| tls) {
        Some(verified) => credentials::Names::Verified(verified),
        None => credentials::Names::Unverified(&may_be),
    };
    if let Some(refused) = credentials::refused_whatever_the_headers(list, names, &path) {
        request["verdict"] = json!("deny");
        request["reason"] = json!(refused.why.code());
        request["credential"] = json!(refused.index);
        request["detail"] = json!(format!(
            "credentials[{}] {:?}",
            refused.index, list[refused.index].name
        ));
    }
}

fn attribution(ctl: &Control, id: &str) -> Reply {
    let sid = SandboxId::new(id);
    if ctl.dp.registry.get(&sid).is_none() {
        return error(StatusCode::NOT_FOUND, &format!("no sandbox {id:?}"), None);
    }
    let entries: Vec<Value> = ctl.dp
        .cache
        .entries(&sid)
        .into_iter()
        .map(|(ip, names)| {
            json!({
                "ip": ip,
                "names": names.iter().map(|(n, left)| json!({"name": n, "ttl_remaining_s": left.as_secs()})).collect::<Vec<_>>(),
            })
        })
        .collect();
    json_reply(
        StatusCode::OK,
        &json!({ "sandbox": id, "entries": entries }),
    )
}

/// What the sandbox's denials propose ([`crate::proposed`]).
fn proposals(ctl: &Control, id: &str) -> Reply {
    let sid = SandboxId::new(id);
    let Some(sandbox) = ctl.dp.registry.get(&sid) else {
        return error(StatusCode::NOT_FOUND, &format!("no sandbox {id:?}"), None);
    };
    // A flow denied only for an attribution gap, its name or address
    // already covered by an allow: the entry fixes nothing (the sandbox must
    // resolve the name through the gateway), and approving it, or a
    // wildcard merged from it, would open more than the sandbox has (a
    // qualified entry turned whole). (An entry denied for want of an allow,
    // and approved since, stays listed: approving it again answers the
    // approval in force.)
    // An entry past its `until` covers nothing (the controller's push that
    // takes it out may not have come yet): what it covered is proposed.
    let now = time::OffsetDateTime::now_utc();
    let allow: Vec<_> = sandbox
        .policy
        .policy()
        .allow
        .iter()
        .filter(|r| r.in_force(now))
        .cloned()
        .collect();
    let list = ctl
        .dp
        .proposed
        .list_except(&sid, sandbox.policy.platform(), &allow);
    json_reply(StatusCode::OK, &crate::proposed::document(id, &list))
}

fn sandbox_json(s: &SandboxDoc) -> Value {
    let mut v = json!({ "id": s.id, "addresses": s.addresses, "policy": s.policy });
    if !s.credentials.is_empty() {
        v["credentials"] = json!(s.credentials);
    }
    if let Some(way) = &s.upstream_proxy {
        v["upstream_proxy"] = json!(way);
    }
    if let Some(revision) = s.revision {
        v["revision"] = json!(revision);
    }
    v
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Longest an NDJSON resync's body may go without a byte.
const RESYNC_QUIET: std::time::Duration = std::time::Duration::from_secs(30);

/// A resync sent as NDJSON (`application/x-ndjson`): one sandbox document
/// per line, streamed, so its size is not bound by the body cap (each line
/// is).
fn is_ndjson<B>(req: &Request<B>) -> bool {
    req.headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().starts_with("application/x-ndjson"))
}

/// Reads an NDJSON resync body line by line; errors name the line. The
/// documents, and the line each was on. More than `max` documents
/// (`limits.max_sandboxes`) is refused at the first one past it, as the
/// registry would refuse them all, not after the whole body is held.
async fn stream_docs(
    req: Request<Incoming>,
    max: usize,
) -> Result<(Vec<SandboxDoc>, Vec<usize>), Reply> {
    let mut body = req.into_body();
    let mut lines = Lines::new(MAX_BODY);
    let mut docs = (Vec::new(), Vec::new());
    // Bound by `max` documents of at most a line's cap each, and the
    // stream may not go quiet: a sender that stops ends it, and what was
    // read goes.
    loop {
        let next = tokio::time::timeout(RESYNC_QUIET, body.frame()).await;
        let Ok(next) = next else {
            let why = format!("the body went quiet for {RESYNC_QUIET:?}");
            return Err(error(StatusCode::REQUEST_TIMEOUT, &why, None));
        };
        let Some(frame) = next else {
            break;
        };
        let frame = frame.map_err(|e| {
            let why = format!("reading the body: {e}");
            error(StatusCode::BAD_REQUEST, &why, None)
        })?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        for line in lines.feed(&data)? {
            ndjson_line(line, &mut docs, max).map_err(|r| *r)?;
        }
    }
    if let Some(line) = lines.finish()? {
        ndjson_line(line, &mut docs, max).map_err(|r| *r)?;
    }
    Ok(docs)
}

/// One line of an NDJSON resync: a sandbox document, and its line.
fn ndjson_line(
    (line_no, text): Line,
    (docs, lines): &mut (Vec<SandboxDoc>, Vec<usize>),
    max: usize,
) -> Result<(), Box<Reply>> {
    if docs.len() >= max {
        let why = crate::registry::RegistryError::Full {
            max,
            refused: format!("a resync of more than {max} (line {line_no})"),
        };
        return Err(Box::new(error(
            StatusCode::CONFLICT,
            &why.to_string(),
            None,
        )));
    }
    let doc: SandboxDoc = egress_policy::from_json(&text).map_err(|e| {
        let why = format!("line {line_no}: {}", e.message);
        let field = e.path.trim_start_matches('.');
        Box::new(error(StatusCode::BAD_REQUEST, &why, Some(field)))
    })?;
    docs.push(doc);
    lines.push(line_no);
    Ok(())
}
