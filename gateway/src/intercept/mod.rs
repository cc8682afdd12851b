//! Intercept: terminate TLS with a minted leaf, serve HTTP/1.1 and HTTP/2,
//! apply policy per request, and forward each request over a verified TLS
//! connection to the original destination with the client's server name.
//!
//! Bodies stream both ways; WebSocket upgrades are bridged; the gateway never
//! dials a name from SNI or Host — only the original destination address.
//!
//! A request passes the stages of `request.rs` (authority → judge → rules →
//! credentials → budget) and, let through, the forward stage of
//! `forward.rs`. Each request fills a [`RequestRecord`] of its own; the
//! connection folds them into its [`Tally`], which becomes the flow's
//! [`Served`] when the connection ends.

mod bridge;
mod charge;
mod forward;
mod request;
mod serve;

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use egress_policy::Hostname;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use crate::fault::{Fault, Side};
use crate::io::{Counted, Counts, Rewind};
use crate::pool::{PoolKey, Sender};
use crate::registry::Sandbox;
use crate::state::Dataplane;
use crate::upstream::{server_tls, Upstreams};

use charge::BudgetCharge;
use request::RequestRecord;
use serve::{serve, Rest};

/// How long requests in flight on a connection whose sandbox is gone may
/// still take before the connection ends under them.
pub(crate) const REMOVED_GRACE: Duration = Duration::from_secs(5);

/// How long requests in flight on a connection run on once a push refuses
/// one of them (the connection stops at its next boundary at once): a
/// response nearly done is finished, a stream that never ends is cut.
const WITHDRAWN_GRACE: Duration = Duration::from_secs(1);

/// How a flow's HTTP reached the gateway.
pub(crate) enum Framing {
    /// In TLS, terminated here with a minted leaf; the ClientHello's server
    /// name, if it had one.
    Tls(Option<Hostname>),
    /// In plain HTTP, forwarded in plain.
    Plain,
}

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
    /// Why the flow ended badly, if it did.
    pub(crate) error: Option<Ended>,
    /// A bridged WebSocket cut past its byte budget: why (`budget_exceeded:
    /// budgets[i] …`), as a spliced flow's cut says it. No fault: a budget
    /// is counted as `egress_budget_exceeded_total`.
    pub(crate) budget_cut: Option<String>,
}

/// Why a served flow ended badly: whose fault it was (counted once, where
/// the flow's record is written) and what happened, for the flow log
/// (`tls_handshake: …`, `idle_timeout`, `non_http: …`, …).
#[derive(Debug)]
pub(crate) struct Ended {
    pub(crate) fault: Fault,
    pub(crate) detail: String,
}

/// What a connection's requests have told the flow log so far: each
/// request's [`RequestRecord`] folded in as it ends.
#[derive(Debug, Default)]
struct Tally {
    requests: u64,
    /// The last request's host (kept only with a flow log).
    host: Option<String>,
    /// Why the last refused request was refused (`400`).
    refused: Option<String>,
    /// Requests refused by policy, a credential or a budget.
    denied: u64,
    /// The first of them, and the first an audit rule would have refused.
    request_denied: Option<String>,
    would_deny: Option<String>,
}

/// One client connection served request by request.
struct Conn {
    dp: Arc<Dataplane>,
    up: Arc<Upstreams>,
    /// The sandbox the flow was accepted for. Each request is judged under
    /// the registration its source address has then ([`Conn::sandbox_now`]).
    sandbox: Arc<Sandbox>,
    /// The client's address.
    src: IpAddr,
    dst: SocketAddr,
    sni: Option<Hostname>,
    /// TLS was terminated (else: plain HTTP, forwarded in plain).
    tls: bool,
    /// Its requests' records, folded.
    tally: Mutex<Tally>,
    /// The upstream connection this client connection uses, and what it was verified as.
    upstream: tokio::sync::Mutex<Option<(PoolKey, Sender)>>,
    /// For an HTTP/2 client whose origin answers in HTTP/1.1 (set when
    /// that is first seen): the origin connections its requests in flight
    /// may use at once, one request each (`forward.rs`).
    h1_slots: std::sync::OnceLock<Arc<tokio::sync::Semaphore>>,
    /// The last connect to the origin that failed: when, whose fault, and
    /// what it said (`forward.rs`, `hold_upstream`).
    connect_failed: Mutex<Option<forward::Failure>>,
    /// The HTTP/2 origin connections it has opened (`forward.rs`, `H2_CONNS`).
    h2_opened: std::sync::atomic::AtomicUsize,
    /// DNS over HTTPS to a reserved resolver: every request is answered by
    /// the gateway's DNS proxy as a query from `src`, none forwarded.
    doh: bool,
    /// The flow's byte counts, and what of them budgets were charged for
    /// (`charge.rs`).
    budget: BudgetCharge,
    /// Whether HTTP/1.1 rests on it (`serve.rs`).
    rest: Rest,
    /// A WebSocket the forward stage switched to, bridged in the flow's
    /// task once hyper has handed the connection over ([`bridge`]).
    bridge: Mutex<Option<bridge::Bridge>>,
    /// What requests let through and in flight were judged on, by stream
    /// (0 on HTTP/1.1: the last, a WebSocket's opening one once bridged;
    /// on HTTP/2 each stream until its end) ([`bridge`]).
    opened: Mutex<Vec<(u64, bridge::Opened)>>,
    /// The last HTTP/2 stream number given (`serve::StreamEnd`).
    streams: std::sync::atomic::AtomicU64,
    /// When a push was first found to refuse a request let through and in
    /// flight: the connection stops then, and ends [`WITHDRAWN_GRACE`] on
    /// ([`Conn::stopping_busy`], [`Conn::withdrawn_past_grace`]).
    withdrawn_at: std::sync::OnceLock<Instant>,
}

/// Serves a flow request by request, in TLS terminated here or in plain
/// HTTP, each request judged on its own authority, so a later request on a
/// keep-alive connection cannot ride on the first one's verdict. The
/// peeked bytes are replayed first.
pub(crate) async fn http_flow(
    dp: &Arc<Dataplane>,
    up: &Arc<Upstreams>,
    (sandbox, dst): (Arc<Sandbox>, SocketAddr),
    framing: Framing,
    stream: TcpStream,
    peeked: Vec<u8>,
    doh: bool,
) -> Served {
    let src = match stream.peer_addr() {
        Ok(peer) => peer.ip(),
        Err(e) => return failed(Fault::CLIENT_RESET, format!("peer_address: {e}")),
    };
    let counts = Arc::new(Counts::default());
    let peeked_len = peeked.len() as u64;
    let client = Rewind::new(peeked, Counted::new(stream, counts.clone()));
    let mut out = match framing {
        Framing::Tls(sni) => {
            let target = (sandbox, (src, dst), doh);
            intercept(dp, up, target, sni, client, counts.clone()).await
        }
        Framing::Plain => {
            let target = (sandbox, (src, dst), false);
            let conn = Conn::new(
                (dp.clone(), up.clone()),
                target,
                Framing::Plain,
                counts.clone(),
            );
            serve(conn, client, &counts).await
        }
    };
    out.bytes_up = peeked_len + counts.read.load(Ordering::Relaxed);
    out.bytes_down = counts.written.load(Ordering::Relaxed);
    out
}

/// Terminates `client` with a minted leaf and serves it.
async fn intercept<S>(
    dp: &Arc<Dataplane>,
    up: &Arc<Upstreams>,
    target: (Arc<Sandbox>, (IpAddr, SocketAddr), bool),
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
        None => server_tls(&up.provider, &up.minter, Some(target.1 .1.ip())),
    };
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let started = Instant::now();
    let handshake = dp.config().timeouts.tls_handshake;
    // The TLS stream (rustls' connection inline, about 1.3 kB) is boxed as
    // it is made: moved by value, it kept a slot in each future it passed
    // through (this one's result, `serve`'s argument, hyper's connection),
    // all of them in the flow's task for the connection's life
    // (benches/RESULTS.md, "Idle intercepted connections").
    let accept = async { acceptor.accept(client).await.map(Box::new) };
    let accepted = tokio::time::timeout(handshake, accept).await;
    dp.metrics
        .handshake_seconds
        .observe(started.elapsed().as_secs_f64());
    let tls = match accepted {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => return failed(Fault::CLIENT_TLS, format!("tls_handshake: {e}")),
        Err(_) => return failed(Fault::CLIENT_TLS, "tls_handshake: timed out".into()),
    };
    let conn = Conn::new(
        (dp.clone(), up.clone()),
        target,
        Framing::Tls(sni),
        activity.clone(),
    );
    // HTTP/2 multiplexes: its responses' frames are written together.
    if tls.get_ref().1.alpn_protocol() == Some(b"h2") {
        serve(conn, crate::io::Coalesce::new(tls), &activity).await
    } else {
        serve(conn, tls, &activity).await
    }
}

/// How long a client connection moves no byte before it gives its upstream
/// connection back to the pool: short, so a burst of client connections that
/// each make a request and fall quiet hands a few upstream connections on
/// instead of opening one each (benches/RESULTS.md, "Idle intercepted
/// connections").
const RELEASE_AFTER: Duration = Duration::from_millis(250);

/// The error a client connection ended in: whose fault, and what it was.
fn connection_error(e: &(dyn std::error::Error + Send + Sync + 'static)) -> Ended {
    if e.downcast_ref::<hyper::Error>()
        .is_some_and(hyper::Error::is_timeout)
    {
        return ended(Fault::HEAD_TIMEOUT, "head_timeout".to_owned());
    }
    let text = e.to_string();
    // hyper answers bytes that are not HTTP with 400 and closes: the
    // protocol the spec's exemptions exist for.
    if text.contains("parse") || text.contains("invalid") || text.contains("malformed") {
        ended(Fault::NON_HTTP, format!("non_http: {text}"))
    } else {
        ended(client_fault(e), text)
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

fn ended(fault: Fault, detail: String) -> Ended {
    Ended { fault, detail }
}

fn failed(fault: Fault, detail: String) -> Served {
    Served {
        error: Some(ended(fault, detail)),
        ..Served::default()
    }
}

// === impl Tally ===

impl Tally {
    /// Folds in one request's record.
    fn add(&mut self, r: RequestRecord) {
        self.requests += 1;
        if r.host.is_some() {
            self.host = r.host;
        }
        if r.refused.is_some() {
            self.refused = r.refused;
        }
        if r.denied {
            self.denied += 1;
        }
        if self.request_denied.is_none() {
            self.request_denied = r.denied_shown;
        }
        if self.would_deny.is_none() {
            self.would_deny = r.would_deny;
        }
    }
}

// === impl Conn ===

impl Conn {
    fn new(
        (dp, up): (Arc<Dataplane>, Arc<Upstreams>),
        (sandbox, (src, dst), doh): (Arc<Sandbox>, (IpAddr, SocketAddr), bool),
        framing: Framing,
        activity: Arc<Counts>,
    ) -> Arc<Self> {
        Arc::new(Self {
            dp,
            up,
            sandbox,
            src,
            dst,
            tls: matches!(framing, Framing::Tls(_)),
            sni: match framing {
                Framing::Tls(sni) => sni,
                Framing::Plain => None,
            },
            tally: Mutex::new(Tally::default()),
            upstream: tokio::sync::Mutex::new(None),
            h1_slots: std::sync::OnceLock::new(),
            connect_failed: Mutex::new(None),
            h2_opened: std::sync::atomic::AtomicUsize::new(0),
            doh,
            budget: BudgetCharge::new(activity),
            rest: Rest::default(),
            bridge: Mutex::new(None),
            opened: Mutex::new(Vec::new()),
            streams: std::sync::atomic::AtomicU64::new(0),
            withdrawn_at: std::sync::OnceLock::new(),
        })
    }

    /// The requests' records so far (a request that panicked while folding
    /// its record in left a whole tally: kept).
    fn tally(&self) -> std::sync::MutexGuard<'_, Tally> {
        self.tally
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether the gateway drains: connections end at their next request
    /// boundary.
    fn draining(&self) -> bool {
        self.dp.draining.load(Ordering::Acquire)
    }

    /// Whether the connection ends at its next request boundary: the
    /// gateway drains, or its sandbox is gone ([`Conn::sandbox_now`]).
    fn stopping(&self) -> bool {
        self.draining() || self.removed()
    }

    /// [`Conn::stopping`], or, with `busy` (requests in flight), a push
    /// refuses a request let through and in flight ([`Conn::withdrawn`]):
    /// what is in flight runs on for [`WITHDRAWN_GRACE`] at most. An idle
    /// connection is not ended for it: its next request is judged anyway.
    fn stopping_busy(&self, busy: bool) -> bool {
        if self.stopping() {
            return true;
        }
        // Held once found: a request let through later (an HTTP/2 stream
        // opened during the GOAWAY) does not undo the cut.
        busy && self.note_withdrawn()
    }

    /// Whether a push refuses a request let through and in flight
    /// ([`Conn::withdrawn`]); when it first does, noted.
    fn note_withdrawn(&self) -> bool {
        let withdrawn = self.withdrawn();
        if withdrawn {
            let _ = self.withdrawn_at.set(Instant::now());
        }
        withdrawn
    }

    /// Whether a push has refused a request let through and in flight for
    /// [`WITHDRAWN_GRACE`]. Judged here too, not only at the boundary's
    /// check: a connection told to stop for a drain would otherwise carry
    /// a withdrawn request on to the drain's deadline.
    fn withdrawn_past_grace(&self) -> bool {
        if self.withdrawn_at.get().is_none() {
            self.note_withdrawn();
        }
        self.withdrawn_at
            .get()
            .is_some_and(|at| at.elapsed() >= WITHDRAWN_GRACE)
    }

    /// Whether the flow's sandbox is gone (deleted, or its address taken).
    fn removed(&self) -> bool {
        !self.dp.registry.holds(self.src, &self.sandbox)
    }

    /// Whether a connection told to stop at its boundary `since` then must
    /// end now, requests in flight or not: the drain's deadline passed, its
    /// sandbox has been gone for [`REMOVED_GRACE`] (a stream that never
    /// ends would otherwise carry on under the policy and credentials of a
    /// registration that is no more), or a push refused what is in flight
    /// [`WITHDRAWN_GRACE`] ago.
    fn must_end(&self, since: Instant) -> bool {
        self.dp.drain_over.load(Ordering::Acquire)
            || (self.removed() && since.elapsed() >= REMOVED_GRACE)
            || self.withdrawn_past_grace()
    }

    /// Why a connection ended before its boundary ([`Conn::must_end`]).
    fn end_cause(&self) -> Option<Ended> {
        if self.dp.drain_over.load(Ordering::Acquire) {
            Some(ended(Fault::DRAIN_DEADLINE, "drain_deadline".into()))
        } else {
            self.stop_cause()
        }
    }

    /// Why a connection stopped at a boundary ([`Conn::stopping`]): its
    /// sandbox gone (the flow's error, as a spliced flow's), or `None` for
    /// a drain.
    fn stop_cause(&self) -> Option<Ended> {
        if self.removed() {
            return Some(ended(
                crate::fault::Fault::SANDBOX_REMOVED,
                "gateway_sandbox_removed".into(),
            ));
        }
        self.withdrawn_at.get().is_some().then(|| {
            ended(
                crate::fault::Fault::POLICY_WITHDRAWN,
                "gateway_policy_withdrawn".into(),
            )
        })
    }

    /// The registration a request on this connection is judged under: the
    /// one its source address belongs to now, so a push applies from the
    /// next request on. `None` once the flow's sandbox is deleted or the
    /// address is no longer its own: the request is refused, and the
    /// connection ends.
    fn sandbox_now(&self) -> Option<Arc<Sandbox>> {
        self.dp
            .registry
            .lookup(self.src)
            .filter(|now| now.id == self.sandbox.id && now.serial == self.sandbox.serial)
    }

    /// Gives the upstream connection this client connection holds back to
    /// the pool. Skipped while a request is choosing one (it holds the lock):
    /// the next lull tries again.
    fn release_upstream(&self) {
        if let Ok(mut held) = self.upstream.try_lock() {
            if let Some((key, sender)) = held.take() {
                self.up.pool.put(key, sender);
            }
        }
    }

    /// What the flow reports when its connection ends (its last bytes
    /// charged to its budget).
    fn served(&self, error: Option<Ended>) -> Served {
        self.charge_rest();
        let tally = std::mem::take(&mut *self.tally());
        Served {
            requests: tally.requests,
            host: tally.host,
            denied_requests: tally.denied,
            request_denied: tally.request_denied,
            would_deny: tally.would_deny,
            error,
            ..Served::default()
        }
    }
}
