//! A recording stand-in for a worker gateway's admin API on loopback: it
//! keeps the pushed sandboxes, moves its generation by one per applied
//! push as the real one does, answers `/readyz` and the list, and records
//! every request, so tests can count what the dispatchers sent.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};

/// What a dispatcher sent.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Put(String, Value),
    Delete(String),
    Resync(usize),
    /// A resync answered `409` ([`State::refuse_resyncs`]).
    RefusedResync,
    /// A document naming a revision, refused ([`State::before_revisions`]).
    RefusedRevision,
    List,
}

#[derive(Debug, Default)]
pub struct State {
    pub epoch: String,
    pub generation: i64,
    pub sandboxes: BTreeMap<String, Value>,
    pub events: Vec<Event>,
    /// When set, every push and resync is refused with this status and body.
    pub refuse: Option<(u16, String)>,
    /// When set, every delete and resync is answered `500`: nothing is
    /// forgotten.
    pub refuse_deletes: bool,
    /// When set, a push of this sandbox (not a resync) is answered `500`.
    pub refuse_push_of: Option<String>,
    /// When set, every resync is answered `409` (a sandbox it will not take).
    pub refuse_resyncs: bool,
    /// Pushes of these sandboxes are answered `409` (past the gateway's
    /// `limits.max_sandboxes`, say).
    pub conflict_on: std::collections::HashSet<String>,
    /// Pushes of these sandboxes are answered `409` on `revision`, as the
    /// gateway answers one naming a revision below the one it holds.
    pub stale_on: std::collections::HashSet<String>,
    /// The query of every delete (`revision=N`), in order.
    pub delete_queries: Vec<String>,
    /// When set, the next resync is followed at once by another client's
    /// push (the sandbox `sb-outside`), before `/readyz` is asked again.
    pub push_after_next_resync: bool,
    /// A resync's answer says no generation (a gateway of an earlier build).
    pub resync_answers_no_generation: bool,
    /// A gateway of a build before revisions: its `/readyz` says nothing of
    /// them, and it refuses a document with the field (`400`, as it
    /// refuses any unknown field), recorded as [`Event::RefusedRevision`].
    pub before_revisions: bool,
}

pub struct FakeGateway {
    pub addr: SocketAddr,
    pub state: Arc<Mutex<State>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeGateway {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakeGateway {
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let state = Arc::new(Mutex::new(State {
            epoch: egress_controller::ids::new("e"),
            ..State::default()
        }));
        let shared = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let state = shared.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let state = state.clone();
                        async move { Ok::<_, std::convert::Infallible>(answer(req, &state).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Self { addr, state, task }
    }

    pub fn events(&self) -> Vec<Event> {
        self.state.lock().expect("state").events.clone()
    }

    /// Waits (up to 5 s) until `check` holds of it; panics naming `what`
    /// and the events otherwise.
    pub async fn until(&self, what: &str, check: impl Fn(&Self) -> bool) {
        for _ in 0..500 {
            if check(self) {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        panic!("no {what}: {:?}", self.events());
    }

    /// The id of a sandbox it holds (the first by id); it must hold one.
    pub fn any_sandbox(&self) -> String {
        let s = self.state.lock().expect("state");
        s.sandboxes.keys().next().cloned().expect("a sandbox held")
    }
}

async fn answer(
    req: Request<hyper::body::Incoming>,
    state: &Mutex<State>,
) -> Response<Full<Bytes>> {
    let (method, path) = (req.method().clone(), req.uri().path().to_owned());
    let query = req.uri().query().unwrap_or_default().to_owned();
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let mut s = state.lock().expect("state");
    if method == hyper::Method::DELETE {
        s.delete_queries.push(query);
    }
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let refused = s.refuse.clone().filter(|_| method == hyper::Method::PUT);
    let (status, out) = match (method.as_str(), segments.as_slice()) {
        _ if refused.is_some() => refused.unwrap_or_default(),
        ("GET", ["readyz"]) => {
            let revisions = if s.before_revisions {
                ""
            } else {
                " revisions=1"
            };
            let ready = format!(
                "ready epoch={} generation={}{revisions}\n",
                s.epoch, s.generation
            );
            (200, ready)
        }
        ("PUT", _)
            if s.before_revisions && String::from_utf8_lossy(&body).contains("\"revision\"") =>
        {
            s.events.push(Event::RefusedRevision);
            let why = r#"{"error": "unknown field `revision`"}"#;
            (400, why.to_owned())
        }
        ("GET", ["v1", "sandboxes"]) => {
            s.events.push(Event::List);
            let list: Vec<Value> = s
                .sandboxes
                .iter()
                .map(|(id, doc)| json!({"id": id, "addresses": doc["addresses"], "policy": doc["policy"]}))
                .collect();
            let doc = json!({"epoch": s.epoch, "generation": s.generation, "sandboxes": list});
            (200, doc.to_string())
        }
        ("PUT", ["v1", "sandboxes"]) if s.refuse_resyncs => {
            s.events.push(Event::RefusedResync);
            let why = r#"{"error": "100.64.31.9 is VM vm1's address", "field": "sandboxes"}"#;
            (409, why.to_owned())
        }
        ("PUT", ["v1", "sandboxes"]) if s.refuse_deletes => {
            s.events.push(Event::Resync(0));
            (500, "{}".to_owned())
        }
        ("PUT", ["v1", "sandboxes"]) => {
            let text = String::from_utf8_lossy(&body);
            let docs: Vec<Value> = text
                .lines()
                .filter_map(|l| serde_json::from_str(l).ok())
                .collect();
            s.events.push(Event::Resync(docs.len()));
            s.sandboxes = docs
                .into_iter()
                .filter_map(|d| Some((d["id"].as_str()?.to_owned(), d)))
                .collect();
            s.generation += 1;
            let mut answer = json!({"sandboxes": s.sandboxes.len(), "generation": s.generation});
            if s.resync_answers_no_generation {
                answer = json!({"sandboxes": s.sandboxes.len()});
            }
            if std::mem::take(&mut s.push_after_next_resync) {
                let outside = json!({"addresses": [], "policy": {"default": "allow"}});
                s.sandboxes.insert("sb-outside".into(), outside);
                s.generation += 1;
            }
            (200, answer.to_string())
        }
        ("PUT", ["v1", "sandboxes", id]) if s.conflict_on.contains(*id) => {
            s.events.push(Event::Put((*id).to_owned(), Value::Null));
            (
                409,
                r#"{"error": "the gateway holds its limit of sandboxes"}"#.to_owned(),
            )
        }
        ("PUT", ["v1", "sandboxes", id]) if s.stale_on.contains(*id) => {
            s.events.push(Event::Put((*id).to_owned(), Value::Null));
            let why = r#"{"error": "not applied: the gateway holds revision 99 of this sandbox", "field": "revision"}"#;
            (409, why.to_owned())
        }
        ("PUT", ["v1", "sandboxes", id]) if s.refuse_push_of.as_deref() == Some(*id) => {
            s.events.push(Event::Put((*id).to_owned(), Value::Null));
            (500, "{}".to_owned())
        }
        ("PUT", ["v1", "sandboxes", id]) => {
            let doc: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            s.events.push(Event::Put((*id).to_owned(), doc.clone()));
            s.sandboxes.insert((*id).to_owned(), doc);
            s.generation += 1;
            (200, "{}".to_owned())
        }
        ("DELETE", ["v1", "sandboxes", id]) if s.refuse_deletes => {
            s.events.push(Event::Delete((*id).to_owned()));
            (500, "{}".to_owned())
        }
        ("DELETE", ["v1", "sandboxes", id]) => {
            s.events.push(Event::Delete((*id).to_owned()));
            if s.sandboxes.remove(*id).is_some() {
                s.generation += 1;
                (200, "{}".to_owned())
            } else {
                (404, "{}".to_owned())
            }
        }
        _ => (404, "{}".to_owned()),
    };
    let mut r = Response::new(Full::new(Bytes::from(out)));
    *r.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or_default();
    r
}
