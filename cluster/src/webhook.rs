//! The admission webhook: a `ValidatingWebhookConfiguration` sends every
//! `Machine` CREATE and UPDATE here (`deploy/machine-webhook.yaml`) and a
//! policy the worker would refuse is refused before it is stored.
//!
//! [`review`] is the decision, a pure function of the `AdmissionReview`
//! (`admission.k8s.io/v1`); [`serve`] is the HTTPS listener around it
//! (`POST /validate`, HTTP/1.1 and HTTP/2). The check is
//! `egress_policy::machine`'s, the one the worker and
//! `egress-gateway machine-egress check` run, so the webhook and the worker
//! never disagree about a policy.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use egress_policy::machine::MachineEgress;
use http::{header, Method, Request, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use kube::core::response::StatusSummary;
use kube::core::DynamicObject;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::Value;
use tokio::net::TcpListener;

use crate::resource::MANAGED_ANNOTATION;
use egress_api::reply::{error, json_reply, too_large, Reply};

/// The API group of the `Machine` resource.
pub const GROUP: &str = "kairon.zyvor.dev";
/// The `Machine` kind.
pub const KIND: &str = "Machine";
/// The only `AdmissionReview` version served (`admissionReviewVersions: [v1]`).
pub const REVIEW_API_VERSION: &str = "admission.k8s.io/v1";
/// Largest request body accepted; the API server's reviews are far smaller.
pub const MAX_BODY: usize = 1 << 20;
/// A TLS handshake (and the request head after it) must complete within this.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once; past it a new one is closed. The API server
/// keeps a few; anyone else in the cluster could otherwise open thousands.
pub const MAX_CONNECTIONS: usize = 256;
/// Longest a review waits for one of the [`MAX_REVIEWS`] slots.
pub const REVIEW_WAIT: Duration = Duration::from_secs(2);
/// Longest a review's body may take once it holds a slot: the API server
/// sends it with the head, so anyone holding slots with bodies that do not
/// come frees each within this, well inside another review's
/// [`REVIEW_WAIT`] (the slots are handed out in order).
pub const BODY_WAIT: Duration = Duration::from_secs(1);
/// Reviews whose bodies are read and decided at once (each up to
/// [`MAX_BODY`]): the bodies held are bounded, whatever the number of
/// connections and HTTP/2 streams.
pub const MAX_REVIEWS: usize = 16;
/// Reviews parsed at once: a parsed body takes many times its size (a
/// one-entry JSON object is a tree node of some 600 bytes), and the pod's
/// memory limit is 128 MiB.
pub const MAX_PARSING: usize = 2;
/// JSON objects and arrays a review may hold: a Machine's, with 256 rules
/// and its managed fields, twice (object and old object), holds a few
/// thousand. 1 MiB of `[{"":0},…]` would hold 150,000, some 100 MB parsed.
pub const MAX_CONTAINERS: usize = 16_384;
/// Members and elements (commas) a review may hold, for the same reason.
pub const MAX_ITEMS: usize = 131_072;

/// The reconciler's user as the API server names it in `userInfo`: the
/// service account of `deploy/kubernetes/reconciler.yaml`.
pub const RECONCILER_USER: &str = "system:serviceaccount:kairon-system:egress-cluster-reconciler";

/// The body is not an `AdmissionReview` the webhook can answer.
#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    #[error("body is not JSON: {0}")]
    Json(#[source] serde_json::Error),
    #[error("not an {REVIEW_API_VERSION} AdmissionReview: {0}")]
    NotReview(String),
}

/// Decides one `AdmissionReview`: the response review (`apiVersion`
/// `admission.k8s.io/v1`, `kind` `AdmissionReview`, the request's `uid`).
///
/// A `Machine` (group `kairon.zyvor.dev`) CREATE or UPDATE is allowed when
/// `spec.network.egress` is absent or null, or when it is a valid machine
/// egress policy; otherwise it is denied (`status.code` 400) with every
/// problem, joined by `"; "`, each naming its field
/// (`spec.network.egress.rules[i]: …` or `spec.network.egress: …`). Other
/// operations and other kinds are allowed.
///
/// A request by `reconciler` (the node reconciler's user) is allowed only
/// when it is an update that changes nothing but the annotation
/// [`MANAGED_ANNOTATION`]: RBAC cannot narrow its `patch` to one field,
/// and a reconciler's token taken on one node could otherwise rewrite
/// every Machine's policy in the cluster.
///
/// Malformed input (not JSON, not a v1 `AdmissionReview`, no `request`, no
/// `uid`) is an error, never a panic.
pub fn review(body: &[u8], reconciler: &str) -> Result<Value, ReviewError> {
    let not = |m: String| ReviewError::NotReview(m);
    let (containers, items) = shape(body);
    if containers > MAX_CONTAINERS || items > MAX_ITEMS {
        return Err(not(format!(
            "the body holds {containers} JSON objects and arrays and {items} members and elements, more than an AdmissionReview of a {KIND} may ({MAX_CONTAINERS} and {MAX_ITEMS})"
        )));
    }
    let doc: Value = serde_json::from_slice(body).map_err(ReviewError::Json)?;
    let Some(top) = doc.as_object() else {
        return Err(not("the body is not a JSON object".into()));
    };
    let kind = top.get("kind").and_then(Value::as_str);
    if kind != Some("AdmissionReview") {
        return Err(not(format!("kind is {}", shown(top.get("kind")))));
    }
    let api_version = top.get("apiVersion").and_then(Value::as_str);
    if api_version != Some(REVIEW_API_VERSION) {
        return Err(not(format!(
            "apiVersion is {}",
            shown(top.get("apiVersion"))
        )));
    }
    if top.get("request").is_none_or(Value::is_null) {
        return Err(not("no request".into()));
    }
    let review: AdmissionReview<DynamicObject> =
        serde_json::from_value(doc).map_err(|e| not(e.to_string()))?;
    let req: AdmissionRequest<DynamicObject> =
        review.try_into().map_err(|_| not("no request".into()))?;
    if req.uid.is_empty() {
        return Err(not("request.uid is empty".into()));
    }
    let response = decide(&req, reconciler)?;
    serde_json::to_value(response.into_review()).map_err(|e| not(e.to_string()))
}

/// The JSON objects and arrays of `body`, and its commas, outside strings:
/// what its parse would build, counted without building it. (Malformed
/// JSON is counted all the same; the parse refuses it.)
fn shape(body: &[u8]) -> (usize, usize) {
    // The bytes by value: quote, backslash, braces, brackets, comma.
    const QUOTE: u8 = 0x22;
    const BACKSLASH: u8 = 0x5c;
    const OPENS: [u8; 2] = [0x7b, 0x5b];
    const COMMA: u8 = 0x2c;
    let (mut containers, mut items) = (0, 0);
    let (mut in_string, mut escaped) = (false, false);
    for &b in body {
        match (in_string, b) {
            (true, _) if escaped => escaped = false,
            (true, BACKSLASH) => escaped = true,
            (_, QUOTE) => in_string = !in_string,
            (false, b) if OPENS.contains(&b) => containers += 1,
            (false, COMMA) => items += 1,
            _ => {}
        }
    }
    (containers, items)
}

/// The verdict on one request.
fn decide(
    req: &AdmissionRequest<DynamicObject>,
    reconciler: &str,
) -> Result<AdmissionResponse, ReviewError> {
    let allowed = AdmissionResponse::from(req);
    let machine = req.kind.group == GROUP && req.kind.kind == KIND;
    if !machine || !matches!(req.operation, Operation::Create | Operation::Update) {
        return Ok(allowed);
    }
    let Some(object) = &req.object else {
        return Err(ReviewError::NotReview(format!(
            "{:?} of a {KIND} without request.object",
            req.operation
        )));
    };
    let user = req.user_info.username.as_deref().unwrap_or_default();
    if is_reconciler(user, reconciler) {
        return Ok(match beyond_the_annotation(req.old_object.as_ref(), object) {
            None => allowed,
            Some(what) => refused(
                allowed,
                403,
                "Forbidden",
                format!("{user} may change only the annotation {MANAGED_ANNOTATION} (the node reconciler's account); this request changes {what}"),
            ),
        });
    }
    let egress = object.data.pointer("/spec/network/egress");
    let Some(egress) = egress.filter(|v| !v.is_null()) else {
        return Ok(allowed);
    };
    // An update that leaves the policy as stored (a Machine being deleted
    // has its finalizer removed so) is not the policy's to refuse: a policy
    // stored before a stricter check would otherwise block every later
    // update, the deletion's included. The worker still refuses it. One
    // that changes the policy is checked, on a Machine being deleted too.
    if req.operation == Operation::Update {
        let old = req.old_object.as_ref();
        if old.and_then(|o| o.data.pointer("/spec/network/egress")) == Some(egress) {
            return Ok(allowed);
        }
    }
    match MachineEgress::from_value(egress) {
        Ok(_) => Ok(allowed),
        Err(problems) => {
            let message: Vec<String> = problems
                .iter()
                .map(|p| match p.rule {
                    Some(i) => format!("spec.network.egress.rules[{i}]: {}", p.message),
                    None => format!("spec.network.egress: {}", p.message),
                })
                .collect();
            Ok(refused(allowed, 400, "BadRequest", message.join("; ")))
        }
    }
}

/// Whether `user` is the reconciler's (`reconciler`), or a service account
/// of the same name in another namespace: one deployed elsewhere without
/// `--reconciler-user` is bound all the same, never let through as any
/// other user.
fn is_reconciler(user: &str, reconciler: &str) -> bool {
    const ACCOUNT: &str = "system:serviceaccount:";
    let name = |u: &str| Some(u.strip_prefix(ACCOUNT)?.split_once(':')?.1.to_owned());
    user == reconciler || name(reconciler).is_some_and(|n| name(user).as_deref() == Some(&*n))
}

/// `allowed` turned into a denial.
fn refused(
    allowed: AdmissionResponse,
    code: u16,
    reason: &str,
    message: String,
) -> AdmissionResponse {
    let mut denied = allowed.deny(message);
    denied.result.status = Some(StatusSummary::Failure);
    denied.result.code = code;
    denied.result.reason = reason.into();
    denied
}

/// What an update from `old` to `new` changes besides the annotation
/// [`MANAGED_ANNOTATION`] (and what the API server itself keeps:
/// `resourceVersion`, `managedFields`, `generation`), if anything. A
/// create (no `old`) is a change of everything.
fn beyond_the_annotation(old: Option<&DynamicObject>, new: &DynamicObject) -> Option<String> {
    let Some(old) = old else {
        return Some("everything: it creates the Machine".into());
    };
    if old.data != new.data {
        return Some("the Machine's fields (spec, status)".into());
    }
    let (o, n) = (&old.metadata, &new.metadata);
    let others = |m: &kube::core::ObjectMeta| {
        let mut a = m.annotations.clone().unwrap_or_default();
        a.remove(MANAGED_ANNOTATION);
        a
    };
    let differs = [
        ("labels", o.labels != n.labels),
        ("other annotations", others(o) != others(n)),
        ("finalizers", o.finalizers != n.finalizers),
        ("ownerReferences", o.owner_references != n.owner_references),
        ("name", o.name != n.name || o.namespace != n.namespace),
    ];
    differs
        .iter()
        .find(|(_, d)| *d)
        .map(|(what, _)| format!("metadata.{what}"))
}

/// A JSON value for an error message, `absent` when missing.
fn shown(v: Option<&Value>) -> String {
    v.map_or_else(|| "absent".to_owned(), Value::to_string)
}

/// The certificate or key cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: {message}")]
    File { path: String, message: String },
    #[error("the certificate {cert} and the key {key} do not make a TLS configuration: {source}")]
    Config {
        cert: String,
        key: String,
        #[source]
        source: rustls::Error,
    },
}

/// The webhook's TLS configuration from a PEM certificate chain (leaf first)
/// and a PEM private key; ALPN offers `h2` and `http/1.1`. Errors name the
/// file. The files are read again at a handshake after either changed (a
/// renewal by cert-manager, say): one that does not make a key then keeps
/// the one in service, said in the log.
pub fn tls_config(
    cert_pem_path: impl AsRef<Path>,
    key_pem_path: impl AsRef<Path>,
) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let (cert_path, key_path) = (cert_pem_path.as_ref(), key_pem_path.as_ref());
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let key = certified_key(cert_path, key_path, &provider)?;
    let resolver = Reloading {
        paths: (cert_path.to_owned(), key_path.to_owned()),
        provider: provider.clone(),
        current: std::sync::Mutex::new((stamps(cert_path, key_path), Arc::new(key))),
    };
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Config {
            cert: cert_path.display().to_string(),
            key: key_path.display().to_string(),
            source,
        })?
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(resolver));
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The two files' modification times (`None`: unreadable).
type Stamps = (Option<std::time::SystemTime>, Option<std::time::SystemTime>);

fn stamps(cert: &Path, key: &Path) -> Stamps {
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    (modified(cert), modified(key))
}

/// The certificate in service, read again when its files change.
#[derive(Debug)]
struct Reloading {
    paths: (std::path::PathBuf, std::path::PathBuf),
    provider: Arc<rustls::crypto::CryptoProvider>,
    current: std::sync::Mutex<(Stamps, Arc<rustls::sign::CertifiedKey>)>,
}

impl rustls::server::ResolvesServerCert for Reloading {
    fn resolve(
        &self,
        _: rustls::server::ClientHello<'_>,
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        let (cert, key) = (&self.paths.0, &self.paths.1);
        let now = stamps(cert, key);
        let mut current = self
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if current.0 != now {
            // Looked at once per change, whatever it holds.
            current.0 = now;
            match certified_key(cert, key, &self.provider) {
                Ok(fresh) => {
                    tracing::info!(cert = %cert.display(), "webhook certificate read again");
                    current.1 = Arc::new(fresh);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "the webhook's certificate files changed but do not make a key: the one in service is kept");
                }
            }
        }
        Some(current.1.clone())
    }
}

/// The chain and key in the two PEM files, checked to belong together.
fn certified_key(
    cert_path: &Path,
    key_path: &Path,
    provider: &rustls::crypto::CryptoProvider,
) -> Result<rustls::sign::CertifiedKey, TlsError> {
    let file_err = |path: &Path, message: String| TlsError::File {
        path: path.display().to_string(),
        message,
    };
    let cert_text =
        std::fs::read(cert_path).map_err(|e| file_err(cert_path, format!("cannot read: {e}")))?;
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert_text)
        .collect::<Result<_, _>>()
        .map_err(|e| file_err(cert_path, format!("not a PEM certificate chain: {e}")))?;
    if chain.is_empty() {
        return Err(file_err(cert_path, "no PEM certificate in the file".into()));
    }
    let key_text =
        std::fs::read(key_path).map_err(|e| file_err(key_path, format!("cannot read: {e}")))?;
    let key = PrivateKeyDer::from_pem_slice(&key_text)
        .map_err(|e| file_err(key_path, format!("no usable PEM private key: {e}")))?;
    rustls::sign::CertifiedKey::from_der(chain, key, provider).map_err(|source| TlsError::Config {
        cert: cert_path.display().to_string(),
        key: key_path.display().to_string(),
        source,
    })
}

/// Serves the webhook over TLS on `listener` until the task is dropped:
/// `POST /validate` (and `POST /`) answer `200` with the response review;
/// a body over 1 MiB is `413`; a body that is not an `AdmissionReview` is
/// `400 {"error": ..}`; other paths `404`, other methods `405`.
///
/// `reconciler` is the node reconciler's user (see [`review`]).
pub async fn serve(listener: TcpListener, tls: Arc<rustls::ServerConfig>, reconciler: String) {
    serve_until(listener, tls, reconciler, std::future::pending()).await;
}

/// [`serve`] until `stop` completes (SIGTERM): then no connection is taken,
/// and the reviews being decided are answered, for up to [`STOP_GRACE`],
/// before it returns (a rolling update resets none half-way).
pub async fn serve_until(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    reconciler: String,
    stop: impl std::future::Future<Output = ()>,
) {
    let reviews = Arc::new(tokio::sync::Semaphore::new(MAX_REVIEWS));
    let (stopping, told) = tokio::sync::watch::channel(false);
    tokio::select! {
        () = accept(listener, tls, reconciler, (reviews.clone(), told)) => {}
        () = stop => {}
    }
    tracing::info!("stopping: answering the reviews in flight");
    // Each connection is closed once its requests in flight are answered:
    // HTTP/2 with a GOAWAY, so the API server sends no more on it.
    let _ = stopping.send(true);
    let all = u32::try_from(MAX_REVIEWS).unwrap_or(u32::MAX);
    let drained = tokio::time::timeout(STOP_GRACE, reviews.acquire_many(all)).await;
    match drained {
        // Their answers are written once their handlers return: a moment
        // for the last to leave.
        Ok(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        Err(_) => tracing::warn!("stopped with reviews still in flight"),
    }
}

/// Longest a stopping webhook waits for the reviews in flight.
pub const STOP_GRACE: Duration = Duration::from_secs(10);

async fn accept(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    reconciler: String,
    (reviews, told): (Arc<tokio::sync::Semaphore>, egress_api::serve::Stop),
) {
    let reconciler: Arc<str> = reconciler.into();
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let parsing = Arc::new(tokio::sync::Semaphore::new(MAX_PARSING));
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                // Out of descriptors, say: do not spin.
                tracing::warn!(error = %e, "webhook accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::warn!(%peer, max = MAX_CONNECTIONS, "webhook connection refused: as many served as may be");
            continue;
        };
        let (acceptor, reviews) = (acceptor.clone(), (reviews.clone(), parsing.clone()));
        let told = told.clone();
        let reconciler = reconciler.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "webhook TLS handshake failed");
                    return;
                }
                Err(_) => {
                    tracing::debug!(%peer, "webhook TLS handshake timed out");
                    return;
                }
            };
            let handle = move |req| {
                let slots = (reviews.0.clone(), reviews.1.clone());
                handle(req, slots, reconciler.clone())
            };
            let limits = ("webhook", peer, egress_api::serve::IDLE_TIMEOUT);
            egress_api::serve::serve_one_until(tls, limits, handle, Some(told)).await;
        });
    }
}

/// The review slots, and the parsing ones.
type Slots = (Arc<tokio::sync::Semaphore>, Arc<tokio::sync::Semaphore>);

async fn handle(req: Request<Incoming>, (reviews, parsing): Slots, reconciler: Arc<str>) -> Reply {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    // A review waits at most REVIEW_WAIT for one of the slots: past it the
    // answer is 503 at once. Streams that hold slots with bodies that do
    // not come hold each for BODY_WAIT at most, so a review queued behind
    // them gets one within its wait.
    let slot = tokio::time::timeout(REVIEW_WAIT, reviews.acquire_owned()).await;
    let Ok(Ok(_review)) = slot else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "every review slot is taken; retry",
            None,
        );
    };
    let reply = route(req, &reconciler, &parsing).await;
    tracing::info!(%method, %path, status = reply.status().as_u16(), "webhook");
    reply
}

/// A review's body: at most [`MAX_BODY`] (`413`), within [`BODY_WAIT`]
/// (`408`).
async fn review_body(req: Request<Incoming>) -> Result<bytes::Bytes, Reply> {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY as u64) {
        return Err(too_large(MAX_BODY));
    }
    let collected =
        tokio::time::timeout(BODY_WAIT, Limited::new(req.into_body(), MAX_BODY).collect()).await;
    match collected {
        Ok(Ok(b)) => Ok(b.to_bytes()),
        Ok(Err(e))
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            Err(too_large(MAX_BODY))
        }
        Ok(Err(e)) => Err(error(
            StatusCode::BAD_REQUEST,
            &format!("reading the body: {e}"),
            None,
        )),
        Err(_) => Err(error(
            StatusCode::REQUEST_TIMEOUT,
            "the body did not arrive in time",
            None,
        )),
    }
}

async fn route(
    req: Request<Incoming>,
    reconciler: &str,
    parsing: &tokio::sync::Semaphore,
) -> Reply {
    if !matches!(req.uri().path(), "/validate" | "/") {
        return error(
            StatusCode::NOT_FOUND,
            "no such route: use POST /validate",
            None,
        );
    }
    if req.method() != Method::POST {
        let mut r = error(StatusCode::METHOD_NOT_ALLOWED, "use POST", None);
        r.headers_mut()
            .insert(header::ALLOW, header::HeaderValue::from_static("POST"));
        return r;
    }
    let body = match review_body(req).await {
        Ok(body) => body,
        Err(reply) => return reply,
    };
    // Closed never: the semaphore lives as long as the server.
    let Ok(_parsing) = parsing.acquire().await else {
        return error(StatusCode::SERVICE_UNAVAILABLE, "shutting down", None);
    };
    match review(&body, reconciler) {
        Ok(v) => {
            let allowed = v.pointer("/response/allowed").and_then(Value::as_bool);
            let uid = v.pointer("/response/uid").and_then(Value::as_str);
            tracing::info!(uid, allowed, "admission review");
            json_reply(StatusCode::OK, &v)
        }
        Err(e) => error(StatusCode::BAD_REQUEST, &e.to_string(), None),
    }
}
