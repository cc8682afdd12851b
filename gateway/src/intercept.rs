//! Intercept: terminate TLS with a minted leaf, serve HTTP/1.1 and HTTP/2,
//! apply policy per request, and forward each request over a verified TLS
//! connection to the original destination with the client's server name.
//!
//! Bodies stream both ways; WebSocket upgrades are bridged; the gateway never
//! dials a name from SNI or Host — only the original destination address.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use egress_certs::LeafResolver;
use egress_policy::{Denied, Flow, Hostname, Protocol, Verdict};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use crate::authority::{self, Authority, AuthorityError, Target};
use crate::gateway::Shared;
use crate::io::{quiet_for, Counts};
use crate::pool::{Body, PoolKey, Sender};
use crate::registry::Sandbox;

/// What happened on an intercepted flow.
#[derive(Debug, Default)]
pub(crate) struct Intercepted {
    pub(crate) requests: u64,
    /// The last request's Host.
    pub(crate) host: Option<String>,
    /// Why the flow ended badly, if it did (`tls_handshake`, `non_http`, …).
    pub(crate) error: Option<String>,
}

/// One terminated client connection.
struct Conn {
    shared: Arc<Shared>,
    sandbox: Arc<Sandbox>,
    dst: SocketAddr,
    sni: Option<Hostname>,
    /// TLS was terminated (else: plain HTTP, forwarded in plain).
    tls: bool,
    requests: AtomicU64,
    host: Mutex<Option<String>>,
    /// Why the last refused request was refused (`400`), for the flow log.
    refused: Mutex<Option<String>>,
    /// The upstream connection this client connection uses, and what it was verified as.
    upstream: tokio::sync::Mutex<Option<(PoolKey, Sender)>>,
}

/// Why a request could not be forwarded: the client gets a 502 saying so.
#[derive(Debug, thiserror::Error)]
enum UpstreamError {
    #[error("cannot connect to {0}: {1}")]
    Connect(SocketAddr, String),
    #[error("upstream TLS failed for {name}: {reason}")]
    Tls { name: String, reason: String },
    #[error("upstream HTTP failed: {0}")]
    Http(String),
}

/// Terminates `client` (whose first bytes were peeked and are replayed by it) and serves it.
pub(crate) async fn intercept<S>(
    shared: Arc<Shared>,
    sandbox: Arc<Sandbox>,
    dst: SocketAddr,
    sni: Option<Hostname>,
    client: S,
    activity: Arc<Counts>,
) -> Intercepted
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    // With an SNI the leaf is minted for it and the shared config (and its
    // session cache) serves; without one the leaf is for the destination
    // address, which only this flow knows.
    let config = match sni {
        Some(_) => shared.server_tls.clone(),
        None => server_tls(&shared.minter, Some(dst.ip())),
    };
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let handshake_started = Instant::now();
    let accepted = tokio::time::timeout(
        shared.config().timeouts.tls_handshake,
        acceptor.accept(client),
    )
    .await;
    shared
        .metrics
        .handshake_seconds
        .observe(handshake_started.elapsed().as_secs_f64());
    let tls = match accepted {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => return failed(format!("tls_handshake: {e}")),
        Err(_) => return failed("tls_handshake: timed out".into()),
    };
    let conn = Conn::new(shared, sandbox, dst, sni, true);
    serve(conn, tls, &activity).await
}

/// Sessions the shared terminating config remembers for resumption.
const RESUMABLE_SESSIONS: usize = 10_000;

/// The terminating TLS config. `fallback_ip`: mint for this address when the
/// client sends no SNI — such a config is per flow, so it neither keeps
/// sessions nor issues tickets. The shared one (no fallback) keeps up to
/// [`RESUMABLE_SESSIONS`], so a client that reconnects skips the full
/// handshake; a resumed session decides nothing — each request is still
/// judged on the flow's SNI and Host.
pub(crate) fn server_tls(
    minter: &Arc<egress_certs::LeafMinter>,
    fallback_ip: Option<IpAddr>,
) -> Arc<rustls::ServerConfig> {
    let mut config = rustls::ServerConfig::builder()
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(LeafResolver::new(minter.clone(), fallback_ip)));
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    // No 0-RTT: early data could be replayed before policy sees the request.
    config.max_early_data_size = 0;
    if fallback_ip.is_some() {
        config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        config.send_tls13_tickets = 0;
    } else {
        config.session_storage = rustls::server::ServerSessionMemoryCache::new(RESUMABLE_SESSIONS);
    }
    Arc::new(config)
}

/// Serves plain HTTP/1.x: each request on the connection is judged on its
/// own `Host` and forwarded to the original destination, so a later request
/// on a keep-alive connection cannot ride on the first one's verdict.
pub(crate) async fn serve_plain_http<S>(
    shared: Arc<Shared>,
    sandbox: Arc<Sandbox>,
    dst: SocketAddr,
    client: S,
    activity: Arc<Counts>,
) -> Intercepted
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let conn = Conn::new(shared, sandbox, dst, None, false);
    serve(conn, client, &activity).await
}

/// Runs the HTTP server over `io` until the client is done, idle, or gone.
async fn serve<I>(conn: Arc<Conn>, io: I, activity: &Counts) -> Intercepted
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let shared = conn.shared.clone();
    let service_conn = conn.clone();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let conn = service_conn.clone();
        async move { Ok::<_, std::convert::Infallible>(conn.handle(req).await) }
    });
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    // Bounded request heads: a larger one is answered 431 and never forwarded.
    let max_head = shared.config().limits.max_request_head;
    builder.http1().max_buf_size(max_head);
    builder
        .http2()
        .max_header_list_size(u32::try_from(max_head).unwrap_or(u32::MAX));
    let serving = builder.serve_connection_with_upgrades(TokioIo::new(io), service);
    let idle = shared.config().timeouts.idle;
    let served = tokio::select! {
        r = serving => r,
        () = quiet_for(activity, idle) => {
            return Intercepted {
                requests: conn.requests.load(Ordering::Relaxed),
                host: conn.host.lock().map(|h| h.clone()).unwrap_or_default(),
                error: Some("idle_timeout".into()),
            };
        }
    };
    if let Some((key, sender)) = conn.upstream.lock().await.take() {
        shared.pool.put(key, sender);
    }
    let error = served.err().map(|e| {
        let text = e.to_string();
        // hyper answers bytes that are not HTTP with 400 and closes: the
        // protocol the spec's exemptions exist for.
        if text.contains("parse") || text.contains("invalid") || text.contains("malformed") {
            format!("non_http: {text}")
        } else {
            text
        }
    });
    let host = conn.host.lock().map(|h| h.clone()).unwrap_or_default();
    let refused = conn.refused.lock().map(|r| r.clone()).unwrap_or_default();
    let error = error.or_else(|| refused.map(|r| format!("bad_request: {r}")));
    Intercepted {
        requests: conn.requests.load(Ordering::Relaxed),
        host,
        error,
    }
}

fn failed(error: String) -> Intercepted {
    Intercepted {
        error: Some(error),
        ..Intercepted::default()
    }
}

// === impl Conn ===

impl Conn {
    fn new(
        shared: Arc<Shared>,
        sandbox: Arc<Sandbox>,
        dst: SocketAddr,
        sni: Option<Hostname>,
        tls: bool,
    ) -> Arc<Self> {
        Arc::new(Self {
            shared,
            sandbox,
            dst,
            sni,
            tls,
            requests: AtomicU64::new(0),
            host: Mutex::new(None),
            refused: Mutex::new(None),
            upstream: tokio::sync::Mutex::new(None),
        })
    }

    async fn handle(&self, mut req: Request<Incoming>) -> Response<Body> {
        self.requests.fetch_add(1, Ordering::Relaxed);
        let claims = authority::judge(
            req.uri().authority().map(http::uri::Authority::as_str),
            req.headers()
                .get_all(header::HOST)
                .iter()
                .map(HeaderValue::as_bytes),
        );
        let authority = match claims {
            Ok(Some(a)) => a,
            // Plain HTTP/1.0 without Host: judged on the address and attribution alone.
            Ok(None) if !self.tls && req.version() == http::Version::HTTP_10 => {
                Authority::of_ip(self.dst.ip())
            }
            Ok(None) => return self.refuse(&req, AuthorityError::Missing.to_string()),
            Err(e) => return self.refuse(&req, e.to_string()),
        };
        // An address where the TLS server name named a host is another claim.
        if self.sni.is_some() && authority.name().is_none() {
            return misdirected();
        }
        if self.shared.flow_log.enabled() {
            if let Ok(mut h) = self.host.lock() {
                *h = Some(match &authority.target {
                    Target::Name(n) => n.to_string(),
                    Target::Ip(ip) => ip.to_string(),
                });
            }
        }
        // An IP literal names no domain: the request is judged on the address.
        let host = authority.name().cloned();
        let lookup = self.shared.cache.names_for(&self.sandbox.id, self.dst.ip());
        let names = lookup.names();
        let verdict = self.sandbox.policy.decide(&Flow {
            dst: self.dst,
            protocol: if self.tls {
                Protocol::Tls
            } else {
                Protocol::Http
            },
            sni: self.sni.as_ref(),
            host: host.as_ref(),
            attributed: &names,
            attribution_gap: lookup.gap(),
        });
        match verdict {
            Verdict::Deny(Denied::Misdirected) => return misdirected(),
            Verdict::Deny(_) => {
                let reason = verdict.describe(&self.sandbox.policy);
                return text(StatusCode::FORBIDDEN, &format!("egress denied: {reason}\n"));
            }
            Verdict::Allow(_) | Verdict::Splice(..) | Verdict::Intercept(..) => {}
        }
        // The name the origin's certificate must carry (none: its address).
        let verify_as = self.sni.as_ref().or(host.as_ref());
        if is_upgrade(&req) {
            return self.upgrade(req, verify_as, &authority.raw).await;
        }
        strip_hop_by_hop(req.headers_mut());
        match self.forward(req, verify_as, &authority.raw).await {
            Ok(mut resp) => {
                strip_hop_by_hop(resp.headers_mut());
                resp.map(BodyExt::boxed)
            }
            Err(e) => text(StatusCode::BAD_GATEWAY, &format!("{e}\n")),
        }
    }

    /// Answers `400` without forwarding anything; an HTTP/1 connection is
    /// closed after it, since the client and the gateway no longer agree on
    /// what the bytes mean.
    fn refuse(&self, req: &Request<Incoming>, why: String) -> Response<Body> {
        let mut resp = text(StatusCode::BAD_REQUEST, &format!("{why}\n"));
        if req.version() < http::Version::HTTP_2 {
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        if let Ok(mut r) = self.refused.lock() {
            *r = Some(why);
        }
        resp
    }

    async fn forward(
        &self,
        req: Request<Incoming>,
        verify_as: Option<&Hostname>,
        authority: &str,
    ) -> Result<Response<Incoming>, UpstreamError> {
        // Plain connections verify nothing: no name in their key.
        let name = verify_as.filter(|_| self.tls);
        let mut guard = self.upstream.lock().await;
        let reusable = guard
            .as_ref()
            .is_some_and(|(k, s)| k.is(self.dst, self.tls, name) && s.usable());
        if !reusable {
            if let Some((old_key, old)) = guard.take() {
                self.shared.pool.put(old_key, old);
            }
            let key = PoolKey {
                dst: self.dst,
                tls: self.tls,
                name: name.cloned(),
            };
            let sender = match self.shared.pool.take(&key) {
                Some(s) => s,
                None => self.connect(verify_as, true).await?,
            };
            *guard = Some((key, sender));
        }
        let (parts, body) = req.into_parts();
        let mut out = Request::from_parts(parts, body.boxed());
        match guard.as_mut().map(|(_, s)| s) {
            Some(Sender::H2(s)) => {
                let mut s = s.clone();
                drop(guard);
                *out.uri_mut() = absolute(out.uri(), authority);
                out.headers_mut().remove(header::HOST);
                s.send_request(out)
                    .await
                    .map_err(|e| UpstreamError::Http(e.to_string()))
            }
            Some(Sender::H1(s)) => {
                *out.uri_mut() = origin_form(out.uri());
                set_host(out.headers_mut(), authority);
                *out.version_mut() = http::Version::HTTP_11;
                // HTTP/1.1 carries one request at a time: the next request
                // waits for this one's headers, then uses a fresh connection
                // if this one is still busy with a body.
                let fut = s.send_request(out);
                drop(guard);
                fut.await.map_err(|e| UpstreamError::Http(e.to_string()))
            }
            None => Err(UpstreamError::Http("no upstream connection".into())),
        }
    }

    /// Bridges an HTTP/1.1 upgrade (WebSocket) over a fresh HTTP/1.1 connection.
    async fn upgrade(
        &self,
        mut req: Request<Incoming>,
        verify_as: Option<&Hostname>,
        authority: &str,
    ) -> Response<Body> {
        let client_side = hyper::upgrade::on(&mut req);
        let Ok(Sender::H1(mut sender)) = self.connect(verify_as, false).await else {
            return text(
                StatusCode::BAD_GATEWAY,
                "cannot reach the origin for the upgrade\n",
            );
        };
        let (parts, body) = req.into_parts();
        let mut out = Request::from_parts(parts, body.boxed());
        *out.uri_mut() = origin_form(out.uri());
        set_host(out.headers_mut(), authority);
        let mut resp = match sender.send_request(out).await {
            Ok(r) => r,
            Err(e) => {
                return text(
                    StatusCode::BAD_GATEWAY,
                    &format!("upstream HTTP failed: {e}\n"),
                )
            }
        };
        if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
            let origin_side = hyper::upgrade::on(&mut resp);
            tokio::spawn(async move {
                if let (Ok(c), Ok(o)) = (client_side.await, origin_side.await) {
                    let (mut c, mut o) = (TokioIo::new(c), TokioIo::new(o));
                    let _ = tokio::io::copy_bidirectional(&mut c, &mut o).await;
                }
            });
        }
        resp.map(BodyExt::boxed)
    }

    /// Opens a connection to the original destination: TLS verified for
    /// `verify_as` (or, without a name, for the address), or plain HTTP.
    async fn connect(
        &self,
        verify_as: Option<&Hostname>,
        allow_h2: bool,
    ) -> Result<Sender, UpstreamError> {
        let config = self.shared.config();
        let timeouts = &config.timeouts;
        let connect_started = Instant::now();
        let tcp = tokio::time::timeout(timeouts.connect, TcpStream::connect(self.dst)).await;
        self.shared
            .metrics
            .upstream_connect_seconds
            .observe(connect_started.elapsed().as_secs_f64());
        let tcp = tcp
            .map_err(|_| UpstreamError::Connect(self.dst, "timed out".into()))?
            .map_err(|e| UpstreamError::Connect(self.dst, e.to_string()))?;
        let _ = tcp.set_nodelay(true);
        if !self.tls {
            let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
                .await
                .map_err(|e| UpstreamError::Http(e.to_string()))?;
            tokio::spawn(conn.with_upgrades());
            return Ok(Sender::H1(sender));
        }
        let config = if allow_h2 {
            self.shared.upstream_tls.clone()
        } else {
            self.shared.upstream_tls_h1.clone()
        };
        let (name, server_name) = match verify_as {
            Some(n) => (
                n.to_string(),
                ServerName::try_from(n.as_str().to_owned()).map_err(|e| UpstreamError::Tls {
                    name: n.to_string(),
                    reason: e.to_string(),
                })?,
            ),
            None => (
                self.dst.ip().to_string(),
                ServerName::IpAddress(self.dst.ip().into()),
            ),
        };
        let tls = tokio::time::timeout(
            timeouts.tls_handshake,
            tokio_rustls::TlsConnector::from(config).connect(server_name, tcp),
        )
        .await
        .map_err(|_| UpstreamError::Tls {
            name: name.clone(),
            reason: "handshake timed out".into(),
        })?
        .map_err(|e| UpstreamError::Tls {
            name: name.clone(),
            reason: e.to_string(),
        })?;
        let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
        let io = TokioIo::new(tls);
        if h2 {
            let (sender, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
                .await
                .map_err(|e| UpstreamError::Http(e.to_string()))?;
            tokio::spawn(conn);
            Ok(Sender::H2(sender))
        } else {
            let (sender, conn) = hyper::client::conn::http1::handshake(io)
                .await
                .map_err(|e| UpstreamError::Http(e.to_string()))?;
            tokio::spawn(conn.with_upgrades());
            Ok(Sender::H1(sender))
        }
    }
}

fn is_upgrade(req: &Request<Incoming>) -> bool {
    req.version() == http::Version::HTTP_11 && req.headers().contains_key(header::UPGRADE)
}

/// Connection-specific headers never cross a proxy (RFC 9110 §7.6.1).
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named {
        headers.remove(n);
    }
    for n in [
        header::CONNECTION,
        HeaderName::from_static("keep-alive"),
        header::PROXY_AUTHENTICATE,
        header::PROXY_AUTHORIZATION,
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
    ] {
        headers.remove(n);
    }
}

/// The origin sees exactly the authority the gateway judged: every `Host`
/// the client sent is replaced by it (they agreed, or the request was refused).
fn set_host(headers: &mut HeaderMap, authority: &str) {
    headers.remove(header::HOST);
    if let Ok(v) = HeaderValue::from_str(authority) {
        headers.insert(header::HOST, v);
    }
}

fn origin_form(uri: &Uri) -> Uri {
    uri.path_and_query()
        .map_or_else(|| Uri::from_static("/"), |pq| Uri::from(pq.clone()))
}

fn absolute(uri: &Uri, authority: &str) -> Uri {
    let pq = uri.path_and_query().map_or("/", |pq| pq.as_str());
    format!("https://{authority}{pq}")
        .parse()
        .unwrap_or_else(|_| origin_form(uri))
}

fn misdirected() -> Response<Body> {
    text(
        StatusCode::MISDIRECTED_REQUEST,
        "Host does not match the TLS server name\n",
    )
}

fn text(status: StatusCode, body: &str) -> Response<Body> {
    let mut resp = Response::new(
        Full::new(Bytes::from(body.to_owned()))
            .map_err(|never| match never {})
            .boxed(),
    );
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}
