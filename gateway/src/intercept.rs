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

use dns_attrib::Lookup;
use egress_policy::{Denied, Hostname, Protocol, RequestCode, RequestDenial, RuleRef, Verdict};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode, Uri};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use crate::authority::{self, Authority, AuthorityError, Target};
use crate::config::Config;
use crate::credentials;
use crate::decide::{decide, request_names, Claims};
use crate::fault::{Fault, Side};
use crate::io::{quiet_for, Counted, Counts, Rewind};
use crate::metrics::CodeLabels;
use crate::pool::{Body, PoolKey, Sender};
use crate::registry::Sandbox;
use crate::reply::{text, Denial};
use crate::state::Dataplane;
use crate::upstream::{server_tls, ForwardError, Upstreams};
use crate::upstream_proxy::Route;

/// What the HTTP path (intercepted TLS or plain HTTP) reports of a flow.
#[derive(Debug, Default)]
pub(crate) struct Served {
    pub(crate) requests: u64,
    pub(crate) bytes_up: u64,
    pub(crate) bytes_down: u64,
    /// The last request's host.
    pub(crate) host: Option<String>,
    /// Requests refused with 403 (the flow itself was let through).
    pub(crate) denied_requests: u64,
    /// The first refused request: `<code> <rule>: <method> <path>`.
    pub(crate) request_denied: Option<String>,
    /// The first request an audited rule would have refused, likewise.
    pub(crate) would_deny: Option<String>,
    /// Why the flow ended badly, if it did (`tls_handshake`, `non_http`, …).
    pub(crate) error: Option<String>,
}

/// Why a request's authority is refused.
enum Refused {
    BadRequest(String),
    Misdirected,
}

/// One client connection served request by request.
struct Conn {
    dp: Arc<Dataplane>,
    up: Arc<Upstreams>,
    sandbox: Arc<Sandbox>,
    dst: SocketAddr,
    sni: Option<Hostname>,
    /// TLS was terminated (else: plain HTTP, forwarded in plain).
    tls: bool,
    requests: AtomicU64,
    host: Mutex<Option<String>>,
    /// Why the last refused request was refused (`400`), for the flow log.
    refused: Mutex<Option<String>>,
    denied_requests: AtomicU64,
    /// The first request refused by policy, and the first an audit rule
    /// would have refused, for the flow log.
    request_denied: Mutex<Option<String>>,
    would_deny: Mutex<Option<String>>,
    /// The upstream connection this client connection uses, and what it was verified as.
    upstream: tokio::sync::Mutex<Option<(PoolKey, Sender)>>,
    /// DNS over HTTPS to a reserved resolver, from this sandbox address:
    /// every request is answered by the gateway's DNS proxy, none forwarded.
    doh_from: Option<IpAddr>,
    /// The flow's byte counts, and what of them budgets were charged for.
    budget: BudgetCharge,
}

/// What a terminated flow has charged to its sandbox's byte budgets: the
/// bytes it moved up to each request are charged to that request's entry.
struct BudgetCharge {
    activity: Arc<Counts>,
    charged: AtomicU64,
    /// The last request's entry (`u32::MAX`: none), charged the rest at the end.
    rule: std::sync::atomic::AtomicU32,
}

/// Serves a flow request by request: intercepted TLS (`tls` is the
/// ClientHello's SNI, if any) or plain HTTP (`None`), each request judged on
/// its own authority, so a later request on a keep-alive connection cannot
/// ride on the first one's verdict. The peeked bytes are replayed first.
pub(crate) async fn http_flow(
    dp: &Arc<Dataplane>,
    up: &Arc<Upstreams>,
    (sandbox, dst): (Arc<Sandbox>, SocketAddr),
    tls: Option<Option<Hostname>>,
    stream: TcpStream,
    peeked: Vec<u8>,
    doh: bool,
) -> Served {
    // A DoH query is admitted as DNS from the sandbox's own address.
    let doh_from = match (doh, stream.peer_addr()) {
        (false, _) => None,
        (true, Ok(peer)) => Some(peer.ip()),
        (true, Err(e)) => return failed(format!("peer_address: {e}")),
    };
    let counts = Arc::new(Counts::default());
    let peeked_len = peeked.len() as u64;
    let client = Rewind::new(peeked, Counted::new(stream, counts.clone()));
    let mut out = match tls {
        Some(sni) => {
            let target = (sandbox, dst, doh_from);
            intercept(dp, up, target, sni, client, counts.clone()).await
        }
        None => {
            let target = (sandbox, dst, None);
            let conn = Conn::new(
                (dp.clone(), up.clone()),
                target,
                None,
                false,
                counts.clone(),
            );
            serve(conn, client, &counts).await
        }
    };
    out.bytes_up = peeked_len + counts.read.load(Ordering::Relaxed);
    out.bytes_down = counts.written.load(Ordering::Relaxed);
    out
}

/// A refused request's answer, for the shadow's comparison.
/// The per-request stage that refused a request: the policy's rules, or a
/// host-bound credential (which a shadow policy shares, so never a
/// difference between the two).
enum Stage {
    Rules(Denial),
    Credentials(Denial),
}

impl Stage {
    fn into_denial(self) -> Denial {
        match self {
            Self::Rules(d) | Self::Credentials(d) => d,
        }
    }
}

fn deny_of(d: &Denial) -> crate::shadow::Judged {
    crate::shadow::Judged {
        verdict: "deny",
        reason: d.code,
    }
}

/// Terminates `client` with a minted leaf and serves it.
async fn intercept<S>(
    dp: &Arc<Dataplane>,
    up: &Arc<Upstreams>,
    target: (Arc<Sandbox>, SocketAddr, Option<IpAddr>),
    sni: Option<Hostname>,
    client: S,
    activity: Arc<Counts>,
) -> Served
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    // With an SNI the leaf is minted for it and the shared config (and its
    // session cache) serves; without one the leaf is for the destination
    // address, which only this flow knows.
    let config = match sni {
        Some(_) => up.server_tls.clone(),
        None => server_tls(&up.minter, Some(target.1.ip())),
    };
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let started = Instant::now();
    let handshake = dp.config().timeouts.tls_handshake;
    let accepted = tokio::time::timeout(handshake, acceptor.accept(client)).await;
    dp.metrics
        .handshake_seconds
        .observe(started.elapsed().as_secs_f64());
    let tls = match accepted {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => {
            dp.metrics.fault(Fault::CLIENT_TLS);
            return failed(format!("tls_handshake: {e}"));
        }
        Err(_) => {
            dp.metrics.fault(Fault::CLIENT_TLS);
            return failed("tls_handshake: timed out".into());
        }
    };
    let conn = Conn::new(
        (dp.clone(), up.clone()),
        target,
        sni,
        true,
        activity.clone(),
    );
    serve(conn, tls, &activity).await
}

/// Runs the HTTP server over `io` until the client is done, idle, or gone.
async fn serve<I>(conn: Arc<Conn>, io: I, activity: &Counts) -> Served
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service_conn = conn.clone();
    // Boxed: hyper keeps a slot for the service's future for the whole
    // connection, sized for it; the request's future (~9 kB, the upstream
    // connect inline) then exists only while a request is in flight, and an
    // idle connection holds a pointer (benches/RESULTS.md, Scale).
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let conn = service_conn.clone();
        Box::pin(async move { Ok::<_, std::convert::Infallible>(conn.handle(req).await) })
            as std::pin::Pin<Box<dyn std::future::Future<Output = _> + Send>>
    });
    let config = conn.dp.config();
    let builder = http_server(&config);
    let serving = builder.serve_connection_with_upgrades(TokioIo::new(io), service);
    let served = tokio::select! {
        r = serving => r,
        () = quiet_for(activity, config.timeouts.idle) => {
            conn.dp.metrics.fault(Fault::IDLE_TIMEOUT);
            return conn.served(Some("idle_timeout".into()));
        }
    };
    if let Some((key, sender)) = conn.upstream.lock().await.take() {
        conn.up.pool.put(key, sender);
    }
    let error = served.err().map(|e| connection_error(&conn, &*e));
    let refused = conn.refused.lock().map(|r| r.clone()).unwrap_or_default();
    if error.is_none() && refused.is_some() {
        conn.dp.metrics.fault(Fault::BAD_REQUEST);
    }
    conn.served(error.or_else(|| refused.map(|r| format!("bad_request: {r}"))))
}

/// The HTTP/1.1 and HTTP/2 server of a client connection. Bounded request
/// heads: a larger one is answered 431 and never forwarded.
fn http_server(config: &Config) -> hyper_util::server::conn::auto::Builder<TokioExecutor> {
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    let max_head = config.limits.max_request_head;
    builder
        .http1()
        .max_buf_size(max_head)
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(config.timeouts.request_head);
    builder
        .http2()
        .max_header_list_size(u32::try_from(max_head).unwrap_or(u32::MAX));
    builder
}

/// Counts the error a client connection ended in and says what it was.
fn connection_error(conn: &Conn, e: &(dyn std::error::Error + Send + Sync + 'static)) -> String {
    if e.downcast_ref::<hyper::Error>()
        .is_some_and(hyper::Error::is_timeout)
    {
        conn.dp.metrics.fault(Fault::HEAD_TIMEOUT);
        return "head_timeout".to_owned();
    }
    let text = e.to_string();
    // hyper answers bytes that are not HTTP with 400 and closes: the
    // protocol the spec's exemptions exist for.
    if text.contains("parse") || text.contains("invalid") || text.contains("malformed") {
        conn.dp.metrics.fault(Fault::NON_HTTP);
        format!("non_http: {text}")
    } else {
        conn.dp.metrics.fault(client_fault(e));
        text
    }
}

/// A client connection that ended in an error: a reset if an I/O error
/// underneath says so, otherwise an HTTP-level failure of the client.
fn client_fault(e: &(dyn std::error::Error + 'static)) -> Fault {
    let mut source = Some(e);
    while let Some(err) = source {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if let Some(f) = Fault::io(Side::Client, io) {
                return f;
            }
        }
        source = err.source();
    }
    Fault::CLIENT_HTTP
}

fn failed(error: String) -> Served {
    Served {
        error: Some(error),
        ..Served::default()
    }
}

// === impl BudgetCharge ===

impl BudgetCharge {
    fn moved(&self) -> u64 {
        self.activity.read.load(Ordering::Relaxed) + self.activity.written.load(Ordering::Relaxed)
    }
}

// === impl Conn ===

impl Conn {
    fn new(
        (dp, up): (Arc<Dataplane>, Arc<Upstreams>),
        (sandbox, dst, doh_from): (Arc<Sandbox>, SocketAddr, Option<IpAddr>),
        sni: Option<Hostname>,
        tls: bool,
        activity: Arc<Counts>,
    ) -> Arc<Self> {
        Arc::new(Self {
            dp,
            up,
            sandbox,
            dst,
            sni,
            tls,
            requests: AtomicU64::new(0),
            host: Mutex::new(None),
            refused: Mutex::new(None),
            denied_requests: AtomicU64::new(0),
            request_denied: Mutex::new(None),
            would_deny: Mutex::new(None),
            upstream: tokio::sync::Mutex::new(None),
            doh_from,
            budget: BudgetCharge {
                activity,
                charged: AtomicU64::new(0),
                rule: std::sync::atomic::AtomicU32::new(u32::MAX),
            },
        })
    }

    /// What the flow reports when its connection ends (its last bytes
    /// charged to its budget).
    fn served(&self, error: Option<String>) -> Served {
        self.charge_rest();
        Served {
            requests: self.requests.load(Ordering::Relaxed),
            host: self.host.lock().map(|h| h.clone()).unwrap_or_default(),
            denied_requests: self.denied_requests.load(Ordering::Relaxed),
            request_denied: self
                .request_denied
                .lock()
                .map(|h| h.clone())
                .unwrap_or_default(),
            would_deny: self
                .would_deny
                .lock()
                .map(|h| h.clone())
                .unwrap_or_default(),
            error,
            ..Served::default()
        }
    }

    /// One request: its authority, its verdict, then upgrade or forward.
    async fn handle(&self, mut req: Request<Incoming>) -> Response<Body> {
        self.requests.fetch_add(1, Ordering::Relaxed);
        if let Some(src) = self.doh_from {
            return match &self.dp.resolver {
                Some(proxy) => crate::doh::answer(proxy, src, self.dst, req).await,
                None => text(StatusCode::SERVICE_UNAVAILABLE, "no DNS proxy\n"),
            };
        }
        let authority = match self.authority(&req) {
            Ok(a) => a,
            Err(Refused::BadRequest(why)) => return self.refuse(&req, why),
            Err(Refused::Misdirected) => return misdirected(),
        };
        let host = authority.name();
        let (lookup, judged) = self.judge(host);
        let allowed = match judged {
            Ok(allowed) => allowed,
            Err(None) => return misdirected(),
            Err(Some(denial)) => {
                self.shadow_request(&req, host, &lookup, deny_of(&denial));
                return refused_after_body(req, denial).await;
            }
        };
        let checked = self.per_request(&mut req, host, &lookup);
        if self.sandbox.shadow.is_some() {
            let active = match &checked {
                Err(Stage::Rules(d)) => deny_of(d),
                // A credential's refusal is not the policy's: the candidate
                // shares the credentials, and would refuse it too.
                Ok(()) | Err(Stage::Credentials(_)) => allowed,
            };
            self.shadow_request(&req, host, &lookup, active);
        }
        let checked = checked.map_err(Stage::into_denial);
        if let Err(denial) = checked.and_then(|()| self.within_budget(host, &lookup)) {
            return refused_after_body(req, denial).await;
        }
        // The name the origin's certificate must carry (none: its address).
        let verify_as = self.sni.as_ref().or(host);
        if is_upgrade(&req) {
            return self.upgrade(req, verify_as, &authority.value()).await;
        }
        strip_hop_by_hop(req.headers_mut());
        match self.forward(req, verify_as, &authority.value()).await {
            Ok(mut resp) => {
                strip_hop_by_hop(resp.headers_mut());
                resp.map(BodyExt::boxed)
            }
            Err(e) => {
                self.dp.metrics.fault(e.fault());
                e.response("")
            }
        }
    }

    /// The one authority every claim of the request agrees on, or why it is
    /// refused (`400`; `421` for an address under a TLS server name).
    fn authority(&self, req: &Request<Incoming>) -> Result<Authority, Refused> {
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
            Ok(None) => return Err(Refused::BadRequest(AuthorityError::Missing.to_string())),
            Err(e) => return Err(Refused::BadRequest(e.to_string())),
        };
        // An address where the TLS server name named a host is another claim.
        if self.sni.is_some() && authority.name().is_none() {
            return Err(Refused::Misdirected);
        }
        if self.dp.flow_log.enabled() {
            if let Ok(mut h) = self.host.lock() {
                *h = Some(match &authority.target {
                    Target::Name(n) => n.to_string(),
                    Target::Ip(ip) => ip.to_string(),
                });
            }
        }
        Ok(authority)
    }

    /// Judges this request under the sandbox's shadow policy, if it has
    /// one, on the evidence the active policy judged it on.
    fn shadow_request(
        &self,
        req: &Request<Incoming>,
        host: Option<&Hostname>,
        lookup: &Lookup,
        active: crate::shadow::Judged,
    ) {
        let Some(shadow) = &self.sandbox.shadow else {
            return;
        };
        let attributed = lookup.names();
        let target = req
            .uri()
            .path_and_query()
            .map_or_else(|| req.uri().path(), |pq| pq.as_str());
        let request = crate::shadow::Request {
            claims: self.claims(host),
            tls: self.tls,
            attributed: &attributed,
            gap: lookup.gap(),
            method: req.method().as_str(),
            target,
        };
        let judge = crate::shadow::Judge {
            doh: &self.dp.doh_names,
            diffs: &self.dp.shadow_diffs,
        };
        crate::shadow::request(&judge, shadow, &request, active);
    }

    /// The claims of a request on this flow (`host`: its name, if any).
    fn claims<'a>(&'a self, host: Option<&'a Hostname>) -> Claims<'a> {
        Claims {
            dst: self.dst,
            protocol: if self.tls {
                Protocol::Tls
            } else {
                Protocol::Http
            },
            sni: self.sni.as_ref(),
            host,
            // The flow is terminated: what a request is for is its own name.
            ech: false,
        }
    }

    /// Decides this request (an IP-literal authority names no domain: `host`
    /// is `None`): the attribution it was judged on, and the request's answer
    /// if let through, or why it is denied (`None`: misdirected).
    fn judge(
        &self,
        host: Option<&Hostname>,
    ) -> (Lookup, Result<crate::shadow::Judged, Option<Denial>>) {
        let claims = self.claims(host);
        let decided = decide(
            &self.dp.cache,
            &self.sandbox.id,
            &self.sandbox.policy,
            &claims,
            &self.dp.doh_names,
        );
        let verdict = decided.verdict;
        let answer = match verdict {
            Verdict::Deny(Denied::Misdirected) => Err(None),
            Verdict::Deny(_) => {
                let seen = crate::proposed::Seen {
                    dst: self.dst,
                    sni: self.sni.as_ref(),
                    host,
                    attributed: &decided.lookup.names(),
                    reason: verdict.code(),
                };
                self.dp.proposed.record(&self.sandbox.id, seen, None);
                self.note_denied(verdict.code(), || {
                    let host = host.map_or_else(|| "-".to_owned(), ToString::to_string);
                    format!("{} (the request's host {host})", verdict.code())
                });
                Err(Some(Denial {
                    status: StatusCode::FORBIDDEN,
                    code: verdict.code(),
                    rule: verdict.deny_rule(),
                    detail: verdict.describe(&self.sandbox.policy),
                }))
            }
            Verdict::Allow(_) | Verdict::Splice(..) | Verdict::Intercept(..) => {
                Ok(crate::shadow::allowed(&verdict))
            }
        };
        (decided.lookup, answer)
    }

    /// The per-request rules and the credentials, for a request its flow's
    /// policy lets through: refused (saying by which stage), or let through
    /// with the credentials of its host in place of their placeholders.
    fn per_request(
        &self,
        req: &mut Request<Incoming>,
        host: Option<&Hostname>,
        lookup: &Lookup,
    ) -> Result<(), Stage> {
        if !self.sandbox.policy.has_request_rules() {
            return Ok(());
        }
        let target = req
            .uri()
            .path_and_query()
            .map_or_else(|| req.uri().path(), |pq| pq.as_str())
            .to_owned();
        let method = req.method().clone();
        let method = method.as_str();
        self.request_rules((host, lookup), method, &target)
            .map_err(Stage::Rules)?;
        self.inject_credentials(req, host, method, &target)
            .map_err(Stage::Credentials)
    }

    /// The rules stage: the sandbox's per-request rules on `method` and
    /// `target`. What an audited rule would have refused is counted (and
    /// the first kept for the flow log); a refusal is proposed, counted and
    /// answered `403`.
    fn request_rules(
        &self,
        (host, lookup): (Option<&Hostname>, &Lookup),
        method: &str,
        target: &str,
    ) -> Result<(), Denial> {
        let policy = &self.sandbox.policy;
        // The request's name counts alone where the origin's certificate
        // verifies it; plain HTTP's Host is a claim, so every name the
        // address may be is judged too.
        let attributed = lookup.names();
        let names = request_names(self.tls, host, &attributed);
        let judged = policy.judge_request(&names, method, target);
        let show = |d: &RequestDenial| {
            let path = target.split('?').next().unwrap_or("");
            let path: String = path.chars().take(256).collect();
            format!("{} {}: {method} {path}", d.code.as_str(), d.rule.label())
        };
        if let Some(w) = &judged.would_deny {
            self.dp
                .metrics
                .requests_would_deny
                .get_or_create(&CodeLabels {
                    code: w.code.as_str(),
                })
                .inc();
            if let Ok(mut slot) = self.would_deny.lock() {
                slot.get_or_insert_with(|| show(w));
            }
        }
        let Some(d) = &judged.deny else {
            return Ok(());
        };
        self.propose_request(d, (host, &attributed[..]), method, target);
        self.note_denied(d.code.as_str(), || show(d));
        Err(Denial {
            status: StatusCode::FORBIDDEN,
            code: d.code.as_str(),
            rule: Some(d.rule.index()),
            detail: policy.describe_request(d),
        })
    }

    /// The credentials stage: the values of the host's credentials in place
    /// of their placeholders (counted), or the request refused for one.
    fn inject_credentials(
        &self,
        req: &mut Request<Incoming>,
        host: Option<&Hostname>,
        method: &str,
        target: &str,
    ) -> Result<(), Denial> {
        if self.sandbox.credentials.is_empty() {
            return Ok(());
        }
        let verified = host.filter(|_| self.tls);
        let applied = credentials::apply(
            &self.sandbox.credentials,
            &self.dp.secrets,
            verified,
            target,
            req.headers_mut(),
        )
        .map_err(|refused| self.credential_refused(refused, method))?;
        self.dp
            .metrics
            .credentials_injected
            .inc_by(applied.injected as u64);
        Ok(())
    }

    /// A request refused for a credential, counted: `403`, or `503` when
    /// its value cannot be read.
    fn credential_refused(&self, refused: credentials::Refused, method: &str) -> Denial {
        let code = refused.why.code();
        let name = &self.sandbox.credentials[refused.index].name;
        let rule = u32::try_from(refused.index).unwrap_or(u32::MAX);
        self.note_denied(code, || {
            format!("{code} credentials[{rule}] {name:?}: {method}")
        });
        let detail = match refused.why {
            credentials::Refusal::HostMismatch => {
                format!("the placeholder of credential {name:?} is only for its hosts")
            }
            credentials::Refusal::Required => {
                format!("requests to these hosts must carry credential {name:?}'s placeholder")
            }
            credentials::Refusal::Unavailable => {
                format!("the value of credential {name:?} cannot be read by the gateway")
            }
        };
        let status = match refused.why {
            credentials::Refusal::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::FORBIDDEN,
        };
        Denial {
            status,
            code,
            rule: Some(rule),
            detail,
        }
    }

    /// Hands a refused request to the sandbox's proposals, with the
    /// destination of the allow entry whose level refused it.
    fn propose_request(
        &self,
        d: &RequestDenial,
        (host, attributed): (Option<&Hostname>, &[Hostname]),
        method: &str,
        target: &str,
    ) {
        let (RequestCode::HttpNotAllowed, RuleRef::Allow(i)) = (d.code, d.rule) else {
            return;
        };
        let Ok(path) = egress_policy::http::normalize(target) else {
            return;
        };
        let level = usize::try_from(i)
            .ok()
            .and_then(|i| self.sandbox.policy.policy().allow.get(i))
            .map(|r| r.dest.clone());
        let seen = crate::proposed::Seen {
            dst: self.dst,
            sni: self.sni.as_ref(),
            host,
            attributed,
            reason: d.code.as_str(),
        };
        let request = egress_policy::proposals::DeniedRequest {
            method: method.to_owned(),
            path,
            level,
        };
        self.dp
            .proposed
            .record(&self.sandbox.id, seen, Some(request));
    }

    /// The budget stage, after the policy let the request through: its
    /// entry's request budget, and the bytes the flow moved so far charged
    /// to it; over either, `429` (`budget_exceeded`). Budgets never allow.
    fn within_budget(&self, host: Option<&Hostname>, lookup: &Lookup) -> Result<(), Denial> {
        let budgets = &self.sandbox.policy.policy().budgets;
        if budgets.is_empty() {
            return Ok(());
        }
        let attributed = lookup.names();
        let names = request_names(self.tls, host, &attributed);
        let Some((rule, budget)) = budgets.find(names.iter().copied()) else {
            return Ok(());
        };
        self.budget.rule.store(rule, Ordering::Relaxed);
        let moved = self.budget.moved();
        let delta = moved.saturating_sub(self.budget.charged.swap(moved, Ordering::Relaxed));
        let now = self.dp.cache.now();
        let key = (&self.sandbox.id, rule);
        let Err(over) = self.dp.budgets.request(key, budget, delta, now) else {
            return Ok(());
        };
        self.dp.metrics.budget_exceeded(over);
        let detail = format!(
            "budgets[{rule}] ({}): {}",
            budget.destination,
            crate::budget::describe(over, budget)
        );
        self.note_denied("budget_exceeded", || format!("budget_exceeded {detail}"));
        Err(Denial {
            status: StatusCode::TOO_MANY_REQUESTS,
            code: "budget_exceeded",
            rule: Some(rule),
            detail,
        })
    }

    /// Charges the bytes moved after the last request to its entry.
    fn charge_rest(&self) {
        let rule = self.budget.rule.load(Ordering::Relaxed);
        let budgets = &self.sandbox.policy.policy().budgets;
        let Some(budget) = budgets.iter().nth(rule as usize) else {
            return;
        };
        let moved = self.budget.moved();
        let delta = moved.saturating_sub(self.budget.charged.swap(moved, Ordering::Relaxed));
        let now = self.dp.cache.now();
        self.dp
            .budgets
            .charge((&self.sandbox.id, rule), budget, delta, now);
    }

    /// Counts a refused request, and keeps the first for the flow log.
    fn note_denied(&self, code: &'static str, show: impl FnOnce() -> String) {
        self.dp
            .metrics
            .requests_denied
            .get_or_create(&CodeLabels { code })
            .inc();
        self.denied_requests.fetch_add(1, Ordering::Relaxed);
        if self.dp.flow_log.enabled() {
            if let Ok(mut slot) = self.request_denied.lock() {
                slot.get_or_insert_with(show);
            }
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

    /// The forward stage: sends the request on the flow's upstream
    /// connection to the original destination, in the form its protocol
    /// wants (absolute URI on HTTP/2, origin form and `Host` on HTTP/1.1).
    async fn forward(
        &self,
        req: Request<Incoming>,
        verify_as: Option<&Hostname>,
        authority: &str,
    ) -> Result<Response<Incoming>, ForwardError> {
        let mut guard = self.upstream.lock().await;
        self.hold_upstream(&mut guard, verify_as).await?;
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
                    .map_err(|e| ForwardError::Http(e.to_string()))
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
                fut.await.map_err(|e| ForwardError::Http(e.to_string()))
            }
            None => Err(ForwardError::Http("no upstream connection".into())),
        }
    }

    /// Makes `held` a usable connection to the destination, verified as
    /// `verify_as`: the one held if it still is, else one from the pool or
    /// a fresh one (the one held goes back to the pool).
    async fn hold_upstream(
        &self,
        held: &mut Option<(PoolKey, Sender)>,
        verify_as: Option<&Hostname>,
    ) -> Result<(), ForwardError> {
        // Plain connections verify nothing: no name in their key.
        let name = verify_as.filter(|_| self.tls);
        let reusable = held
            .as_ref()
            .is_some_and(|(k, s)| k.is(self.dst, self.tls, name) && s.usable());
        if reusable {
            return Ok(());
        }
        if let Some((old_key, old)) = held.take() {
            self.up.pool.put(old_key, old);
        }
        let key = PoolKey {
            sandbox: self.sandbox.id.clone(),
            dst: self.dst,
            tls: self.tls,
            name: name.cloned(),
            via: self.route().proxy().cloned(),
        };
        let sender = match self.up.pool.take(&key) {
            Some(s) => s,
            None => {
                let fresh = self.connect(verify_as, true).await?;
                // An HTTP/2 connection multiplexes: pooled at once, the
                // sandbox's other client connections to the same
                // destination and name take it, instead of each idle
                // client connection pinning an upstream connection of
                // its own. The key holds the sandbox: never another's.
                if let Sender::H2(h2) = &fresh {
                    self.up.pool.put(key.clone(), Sender::H2(h2.clone()));
                }
                fresh
            }
        };
        *held = Some((key, sender));
        Ok(())
    }

    /// Bridges an HTTP/1.1 upgrade (WebSocket) over a fresh HTTP/1.1 connection.
    async fn upgrade(
        &self,
        mut req: Request<Incoming>,
        verify_as: Option<&Hostname>,
        authority: &str,
    ) -> Response<Body> {
        let client_side = hyper::upgrade::on(&mut req);
        let mut sender = match self.connect(verify_as, false).await {
            Ok(Sender::H1(s)) => s,
            Ok(Sender::H2(_)) => {
                self.dp.metrics.fault(Fault::UPSTREAM_HTTP);
                return text(
                    StatusCode::BAD_GATEWAY,
                    "cannot reach the origin for the upgrade\n",
                );
            }
            Err(e) => {
                self.dp.metrics.fault(e.fault());
                return e.response("cannot reach the origin for the upgrade: ");
            }
        };
        let (parts, body) = req.into_parts();
        let mut out = Request::from_parts(parts, body.boxed());
        *out.uri_mut() = origin_form(out.uri());
        set_host(out.headers_mut(), authority);
        let mut resp = match sender.send_request(out).await {
            Ok(r) => r,
            Err(e) => {
                self.dp.metrics.fault(Fault::UPSTREAM_HTTP);
                return text(
                    StatusCode::BAD_GATEWAY,
                    &format!("upstream HTTP failed: {e}\n"),
                );
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

    /// The way out for this sandbox: direct or through the operator's proxy.
    fn route(&self) -> Route {
        self.dp.proxies.route(self.sandbox.upstream_proxy.as_ref())
    }

    /// Opens a connection to the original destination (see [`Upstreams::connect`]).
    async fn connect(
        &self,
        verify_as: Option<&Hostname>,
        allow_h2: bool,
    ) -> Result<Sender, ForwardError> {
        let config = self.dp.config();
        let route = self.route();
        self.up
            .connect(
                (self.dst, &route),
                self.tls,
                verify_as,
                allow_h2,
                &config.timeouts,
                &self.dp.metrics,
            )
            .await
    }
}

/// Answers a refused request once its body is read (up to 64 KiB, for at
/// most a second), so an HTTP/2 client gets the answer rather than a reset
/// stream; a larger or slower body is not waited for.
async fn refused_after_body(req: Request<Incoming>, denial: Denial) -> Response<Body> {
    let body = http_body_util::Limited::new(req.into_body(), 64 * 1024);
    let _ = tokio::time::timeout(std::time::Duration::from_secs(1), body.collect()).await;
    denial.response()
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
