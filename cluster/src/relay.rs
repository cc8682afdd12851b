//! The console relay: the console's machine egress routes, bearer
//! authenticated, onto the worker's admin API.
//!
//! | route | worker |
//! | --- | --- |
//! | `GET`/`PUT`/`DELETE /vm-egress/{runtimeID}` | `/v1/vms/{id}/network/egress` |
//! | `GET /vm-egress-observed/{runtimeID}` | `/v1/vms/{id}/network/egress/observed` |
//! | `POST /vm-egress-suggest/{runtimeID}[?apply=true]` | `/v1/vms/{id}/network/egress/suggest` |
//! | `GET`/`PUT /egress-defaults[?apply_running=true]` | `/v1/network/egress/defaults` |
//!
//! The runtime id is the last path segment, so a caller that appends it
//! needs no special case; it must be 1–64 of `[A-Za-z0-9._-]` (not `.` or
//! `..`) and is passed on as it is, the query string unchanged. Every route
//! needs `Authorization: Bearer <token>` (`401` otherwise); bodies are capped
//! at 64 KiB (`413`). The worker's status and body come back as they are; a
//! worker that cannot be reached is `502 {"error": "worker unreachable: …"}`,
//! and one that took the request and gave no whole answer is
//! `502 {"error": "no answer from the worker: …"}` (`504` when the timeout
//! ran out), and one whose answer is larger than [`MAX_REPLY`] is `502
//! {"error": "worker's answer to … is unreadable: …"}`; for a change each
//! says it may have been made.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use tokio::net::TcpListener;

use egress_api::reply::{error, too_large, Reply};

/// Largest request body relayed.
pub const MAX_BODY: usize = 64 * 1024;
/// Largest worker reply relayed (an observed list is well below it).
pub const MAX_REPLY: usize = crate::worker::MAX_REPLY;
/// Shortest caller token accepted by [`load_tokens`].
pub const MIN_TOKEN_CHARS: usize = 16;
/// The caller's request body must arrive within this.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest runtime id.
pub const MAX_ID: usize = 64;

/// What the relay needs.
#[derive(Clone)]
pub struct RelayConfig {
    /// The worker's admin listener.
    pub worker: SocketAddr,
    /// The bearer token sent to the worker, when it requires one.
    pub worker_token: Option<String>,
    /// The caller tokens accepted (any one of them).
    pub tokens: Vec<String>,
    /// Bounds the whole exchange with the worker: connect, request, reply.
    pub timeout: Duration,
}

impl std::fmt::Debug for RelayConfig {
    /// Without the tokens.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayConfig")
            .field("worker", &self.worker)
            .field("worker_token", &self.worker_token.as_ref().map(|_| "…"))
            .field("tokens", &self.tokens.len())
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// The token file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TokensError {
    #[error("{path}: cannot read: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: no tokens (one per line)")]
    Empty { path: String },
    #[error("{path}: line {line}: a token must be at least {MIN_TOKEN_CHARS} characters")]
    Short { path: String, line: usize },
}

/// The caller tokens: one per non-empty line, trimmed. An empty file, or a
/// token shorter than 16 characters, is an error naming the file (and the
/// line, never the token).
pub fn load_tokens(path: impl AsRef<Path>) -> Result<Vec<String>, TokensError> {
    let path = path.as_ref();
    egress_api::file::warn_if_open("--tokens-file", path);
    let shown = || path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| TokensError::Read {
        path: shown(),
        source,
    })?;
    let mut tokens = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let token = line.trim();
        if token.is_empty() {
            continue;
        }
        if token.chars().count() < MIN_TOKEN_CHARS {
            return Err(TokensError::Short {
                path: shown(),
                line: i + 1,
            });
        }
        tokens.push(token.to_owned());
    }
    if tokens.is_empty() {
        return Err(TokensError::Empty { path: shown() });
    }
    Ok(tokens)
}

/// Serves the relay (plain HTTP/1.1 and HTTP/2) on `listener` until the
/// task is dropped.
pub async fn serve(listener: TcpListener, config: Arc<RelayConfig>) {
    serve_until(listener, config, std::future::pending()).await;
}

/// [`serve`] until `stop` completes (SIGTERM): then no connection is taken
/// and the requests in flight are answered first
/// ([`egress_api::serve::serve_until`]).
pub async fn serve_until(
    listener: TcpListener,
    config: Arc<RelayConfig>,
    stop: impl std::future::Future<Output = ()>,
) {
    let handle = move |req| {
        let config = config.clone();
        async move { handle(req, &config).await }
    };
    egress_api::serve::serve_until(listener, "relay", handle, stop).await;
}

/// A relayed route: the worker path (without the query) and the runtime id.
struct Target {
    route: &'static str,
    id: Option<String>,
    path: String,
}

async fn handle(req: Request<Incoming>, config: &RelayConfig) -> Reply {
    let method = req.method().clone();
    let (reply, route, id) = relay(req, config).await;
    tracing::info!(
        %method,
        route,
        id = id.as_deref(),
        status = reply.status().as_u16(),
        "relay"
    );
    reply
}

/// The reply, the route name and the runtime id, for the log.
async fn relay(
    req: Request<Incoming>,
    config: &RelayConfig,
) -> (Reply, &'static str, Option<String>) {
    if !authorized(&req, &config.tokens) {
        let mut r = error(
            StatusCode::UNAUTHORIZED,
            "missing or wrong bearer token",
            None,
        );
        r.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return (r, "-", None);
    }
    let target = match target(req.method(), req.uri().path()) {
        Ok(t) => t,
        Err((r, route)) => return (*r, route, None),
    };
    let (route, id) = (target.route, target.id.clone());
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY as u64) {
        return (too_large(MAX_BODY), route, id);
    }
    let path_and_query = match req.uri().query() {
        Some(q) => format!("{}?{q}", target.path),
        None => target.path,
    };
    let method = req.method().clone();
    let collected = tokio::time::timeout(
        BODY_TIMEOUT,
        egress_api::body::bytes(req.into_body(), MAX_BODY),
    );
    let body = match collected.await {
        Ok(Ok(b)) => b,
        Ok(Err(r)) => return (r, route, id),
        Err(_) => {
            let why = "the body did not arrive in time";
            return (error(StatusCode::REQUEST_TIMEOUT, why, None), route, id);
        }
    };
    let reply = match forward(config, method, &path_and_query, body).await {
        Ok(r) => r,
        Err((status, why)) => error(status, &why, None),
    };
    (reply, route, id)
}

/// Maps a relay path onto the worker's, or the error reply.
fn target(method: &Method, path: &str) -> Result<Target, (Box<Reply>, &'static str)> {
    const VM: [Method; 3] = [Method::GET, Method::PUT, Method::DELETE];
    const DEFAULTS: [Method; 2] = [Method::GET, Method::PUT];
    type Route = (&'static str, &'static [Method], &'static str);
    // (prefix the id follows, methods, worker path with {id})
    const PER_VM: [Route; 3] = [
        ("/vm-egress/", &VM, "/v1/vms/{id}/network/egress"),
        (
            "/vm-egress-observed/",
            &[Method::GET],
            "/v1/vms/{id}/network/egress/observed",
        ),
        (
            "/vm-egress-suggest/",
            &[Method::POST],
            "/v1/vms/{id}/network/egress/suggest",
        ),
    ];
    if path == "/egress-defaults" {
        let route = "/egress-defaults";
        allowed(method, &DEFAULTS).map_err(|r| (r, route))?;
        return Ok(Target {
            route,
            id: None,
            path: "/v1/network/egress/defaults".into(),
        });
    }
    for (prefix, methods, worker) in PER_VM {
        let Some(id) = path.strip_prefix(prefix) else {
            continue;
        };
        let route = prefix.trim_end_matches('/');
        allowed(method, methods).map_err(|r| (r, route))?;
        if !valid_id(id) {
            let shown: String = id.chars().take(MAX_ID + 1).collect();
            let msg = format!("runtime id {shown:?}: expected 1 to {MAX_ID} of A-Z a-z 0-9 . _ -");
            return Err((Box::new(error(StatusCode::BAD_REQUEST, &msg, None)), route));
        }
        return Ok(Target {
            route,
            id: Some(id.to_owned()),
            path: worker.replace("{id}", id),
        });
    }
    let msg = format!("no route {method} {path}");
    Err((Box::new(error(StatusCode::NOT_FOUND, &msg, None)), "-"))
}

/// `405` with `Allow` unless `method` is one of `methods`.
fn allowed(method: &Method, methods: &[Method]) -> Result<(), Box<Reply>> {
    if methods.contains(method) {
        return Ok(());
    }
    let list: Vec<&str> = methods.iter().map(Method::as_str).collect();
    let list = list.join(", ");
    let mut r = error(
        StatusCode::METHOD_NOT_ALLOWED,
        &format!("{method} is not allowed here: use {list}"),
        None,
    );
    if let Ok(v) = HeaderValue::from_str(&list) {
        r.headers_mut().insert(header::ALLOW, v);
    }
    Err(Box::new(r))
}

/// 1–64 of `[A-Za-z0-9._-]`, and not `.` or `..` (a path step, not an id).
pub(crate) fn valid_id(id: &str) -> bool {
    (1..=MAX_ID).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        && id != "."
        && id != ".."
}

/// Whether the request presents one of `tokens`. Every token is compared,
/// each in time independent of where the bytes differ.
fn authorized<B>(req: &Request<B>, tokens: &[String]) -> bool {
    let Some(value) = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let Some((scheme, presented)) = value.split_once(' ') else {
        return false;
    };
    if !scheme.eq_ignore_ascii_case("bearer") {
        return false;
    }
    let presented = presented.trim().as_bytes();
    let mut any = 0u8;
    for token in tokens {
        any |= u8::from(constant_time_eq(presented, token.as_bytes()));
    }
    any == 1 && !presented.is_empty()
}

/// Equality whose time depends only on the lengths, not on the contents.
fn constant_time_eq(presented: &[u8], token: &[u8]) -> bool {
    let mut diff = usize::from(presented.len() != token.len());
    for (i, t) in token.iter().enumerate() {
        diff |= usize::from(presented.get(i).copied().unwrap_or(0) ^ t);
    }
    diff == 0
}

/// One exchange with the worker ([`crate::worker::exchange`]); `Err` is
/// the status to answer and why.
async fn forward(
    config: &RelayConfig,
    method: Method,
    path_and_query: &str,
    body: Bytes,
) -> Result<Reply, (StatusCode, String)> {
    let body = (!body.is_empty()).then_some(body);
    let changes = method != Method::GET;
    let answer = crate::worker::exchange(
        config.worker,
        config.worker_token.as_deref(),
        method,
        path_and_query,
        body,
        config.timeout,
    )
    .await
    .map_err(|e| failed_exchange(&e, changes))?;
    let mut r = Response::new(Full::new(answer.body));
    *r.status_mut() = answer.status;
    if let Some(ct) = answer.content_type {
        r.headers_mut().insert(header::CONTENT_TYPE, ct);
    }
    Ok(r)
}

/// The status and error for an exchange that failed: a request sent and
/// not answered may have changed something, and a change says so.
fn failed_exchange(e: &crate::worker::WorkerError, changes: bool) -> (StatusCode, String) {
    use crate::worker::WorkerError;
    let status = match e {
        WorkerError::NoAnswer {
            timed_out: true, ..
        } => StatusCode::GATEWAY_TIMEOUT,
        _ => StatusCode::BAD_GATEWAY,
    };
    let sent = !matches!(e, WorkerError::Unreachable(_));
    let why = if sent && changes {
        format!("{e} (the change may have been made: read it back before trying again)")
    } else {
        e.to_string()
    };
    (status, why)
}
