//! The forward stage: a request let through goes to the original
//! destination (never a name from SNI or Host), over the flow's upstream
//! connection or a bridged upgrade.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use egress_policy::Hostname;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode, Uri};
use http_body_util::BodyExt;
use tokio::sync::OwnedSemaphorePermit;

use super::serve::ClientBody;
use super::Conn;
use crate::fault::Fault;
use crate::h2client::H2Sender;
use crate::pool::{Body, PoolKey, Sender};
use crate::reply::text;
use crate::upstream::ForwardError;
use crate::upstream_proxy::Route;

impl Conn {
    /// The forward stage: upgrades are bridged; any other request is sent
    /// on, hop-by-hop headers stripped both ways. A failure is counted and
    /// answered with whose fault it was.
    pub(super) async fn pass(
        &self,
        mut req: Request<ClientBody>,
        (verify_as, route): (Option<&Hostname>, &Route),
        authority: &str,
    ) -> Response<Body> {
        // A tunnel inside a terminated flow would carry bytes no per-request
        // rule reads (over HTTP/2 the client's DATA frames would go on as
        // its body): never forwarded.
        if req.method() == http::Method::CONNECT {
            return text(
                StatusCode::METHOD_NOT_ALLOWED,
                "CONNECT is not forwarded from an intercepted or plain HTTP flow\n",
            );
        }
        // An origin that answers TRACE echoes the request it received, the
        // credentials the gateway put in among it: never forwarded, in any
        // case, nor named by a method override.
        let target = req.uri().path_and_query().map_or("", |pq| pq.as_str());
        let (mut trace, mut not_safe) = (false, false);
        for m in crate::decide::override_values(req.headers(), target) {
            trace |= m.eq_ignore_ascii_case("TRACE");
            not_safe |= !is_safe(&m);
        }
        // A transfer coding but chunked (`gzip, chunked`): hyper reads the
        // chunks, and the header goes as hop-by-hop, so the coded bytes
        // would reach the origin unmarked. (HTTP/2 has no transfer coding:
        // a request naming one is malformed there.)
        if req.version() < http::Version::HTTP_2 && transfer_coded(req.headers()) {
            return text(
                StatusCode::BAD_REQUEST,
                "a request's transfer coding other than chunked is not forwarded\n",
            );
        }
        if trace || req.method().as_str().eq_ignore_ascii_case("TRACE") {
            return text(
                StatusCode::METHOD_NOT_ALLOWED,
                "TRACE is not forwarded: the origin would echo the request, credentials included\n",
            );
        }
        // Only a WebSocket is bridged. Any other upgrade (`h2c` above all,
        // whose bridge would carry HTTP/2 requests no stage judges) goes on
        // as a plain request: `Upgrade` is hop-by-hop, and stripped.
        if is_websocket(&req) {
            return self.upgrade(req, (verify_as, route), authority).await;
        }
        let trailers = asks_for_trailers(req.headers());
        strip_hop_by_hop(req.headers_mut());
        if trailers {
            // The one `TE` HTTP/2 allows (RFC 9113 §8.2.2), which gRPC
            // servers require: passed on as asked.
            let value = HeaderValue::from_static("trailers");
            req.headers_mut().insert(header::TE, value);
        }
        let replay = !not_safe;
        let answer = self
            .forward(req, (verify_as, route), authority, replay)
            .await;
        self.passed_back(answer)
    }

    /// The origin's answer as it goes back, or the failure's: counted.
    fn passed_back(&self, answer: Result<Response<Body>, ForwardError>) -> Response<Body> {
        match answer {
            // A transfer coding but chunked (the request asked for none):
            // its bytes would go on unmarked once the header is stripped.
            Ok(resp) if transfer_coded(resp.headers()) => {
                self.dp.metrics.fault(Fault::UPSTREAM_HTTP);
                text(
                    StatusCode::BAD_GATEWAY,
                    "the origin used a transfer coding other than chunked\n",
                )
            }
            Ok(mut resp) => {
                // Framed by its chunks (RFC 9112 6.3): a length beside them
                // would frame what goes on once the coding is stripped.
                if resp.headers().contains_key(header::TRANSFER_ENCODING) {
                    resp.headers_mut().remove(header::CONTENT_LENGTH);
                }
                strip_hop_by_hop(resp.headers_mut());
                resp
            }
            Err(e) => {
                self.dp.metrics.fault(e.fault());
                e.response("")
            }
        }
    }

    /// Sends the request on the flow's upstream
    /// connection to the original destination, in the form its protocol
    /// wants (absolute URI on HTTP/2, origin form and `Host` on HTTP/1.1).
    async fn forward(
        &self,
        req: Request<ClientBody>,
        (verify_as, route): (Option<&Hostname>, &Route),
        authority: &str,
        replay: bool,
    ) -> Result<Response<Body>, ForwardError> {
        let h2 = req.version() == http::Version::HTTP_2;
        let asked = std::time::Instant::now();
        let (mut guard, slot) = self.locked_upstream(h2).await?;
        self.hold_upstream(&mut guard, (verify_as, route), (h2, asked))
            .await?;
        let (parts, body) = req.into_parts();
        let mut out = Request::from_parts(parts, boxed(body));
        match guard.as_mut().map(|(_, s)| s) {
            Some(Sender::H2(s)) => {
                let s = s.clone();
                drop(guard);
                *out.uri_mut() = absolute(out.uri(), authority);
                out.headers_mut().remove(header::HOST);
                let again = replay.then(|| replayable(&out)).flatten();
                match (s.send(out).await, again) {
                    (Err(e), Some(again)) if unprocessed(&e) => {
                        self.dp.metrics.upstream_retries.inc();
                        self.send_again(again, (verify_as, route), &s).await
                    }
                    (sent, _) => from_h2(sent),
                }
            }
            Some(Sender::H1(s)) => {
                *out.uri_mut() = origin_form(out.uri());
                set_host(out.headers_mut(), authority);
                *out.version_mut() = http::Version::HTTP_11;
                // HTTP/1.1 carries one request at a time: the next request
                // waits for this one's headers, then uses a fresh connection
                // if this one is still busy with a body.
                let again = replay.then(|| replayable(&out)).flatten();
                // Known before the next request takes the connection lock.
                let slot = slot.or_else(|| h2.then(|| self.first_h1_slot()).flatten());
                let (out, slot) = slot_held(out, slot);
                let fut = s.try_send_request(out);
                drop(guard);
                let resp = match fut.await {
                    Ok(resp) => Ok(resp.map(boxed)),
                    // A pooled connection the origin closed as it was taken
                    // again: what it did not send, or a request that may be
                    // repeated, goes once more on another.
                    Err(mut e) => match e.take_message().or(again) {
                        Some(req) => self.h1_again(req, (verify_as, route), h2).await,
                        None => Err(ForwardError::Http(e.into_error().to_string())),
                    },
                };
                resp.map(|resp| resp.map(|body| holding(body, slot)))
            }
            None => Err(ForwardError::Http("no upstream connection".into())),
        }
    }

    /// Sends `req` once more over HTTP/1.1, on the connection the flow holds
    /// if it can take it, else one from the pool or a fresh one (the one
    /// that failed it is closed, or still busy).
    async fn h1_again(
        &self,
        req: Request<Body>,
        to: (Option<&Hostname>, &Route),
        h2: bool,
    ) -> Result<Response<Body>, ForwardError> {
        self.dp.metrics.upstream_retries.inc();
        let mut guard = self.upstream.lock().await;
        let asked = std::time::Instant::now();
        self.hold_upstream(&mut guard, to, (h2, asked)).await?;
        let Some((_, Sender::H1(s))) = guard.as_mut() else {
            let why = "the origin closed the connection, and no HTTP/1.1 connection took the request again";
            return Err(ForwardError::Http(why.into()));
        };
        let fut = s.send_request(req);
        drop(guard);
        fut.await
            .map(|resp| resp.map(boxed))
            .map_err(|e| ForwardError::Http(e.to_string()))
    }

    /// The lock on the flow's upstream connection, and for an HTTP/2
    /// request whose origin is known to speak HTTP/1.1, a slot
    /// ([`Conn::h1_slot`]), taken before the lock: a stream waiting for one
    /// holds up no other. Found to speak it while the request waited for the
    /// lock: the lock is let go, a slot taken, and the lock taken again.
    async fn locked_upstream(
        &self,
        h2: bool,
    ) -> Result<(UpstreamGuard<'_>, Option<OwnedSemaphorePermit>), ForwardError> {
        let mut slot = None;
        loop {
            if let (true, None, Some(slots)) = (h2, &slot, self.h1_slots.get()) {
                slot = Some(self.h1_slot(slots.clone()).await?);
            }
            let guard = self.upstream.lock().await;
            if !h2 || slot.is_some() || self.h1_slots.get().is_none() {
                return Ok((guard, slot));
            }
        }
    }

    /// A place among the origin connections an HTTP/2 client's requests
    /// may hold at once when its origin speaks HTTP/1.1 (one connection a
    /// request in flight: without a bound, its concurrent streams, up to
    /// hyper's 200, would open as many origin connections each). Waits for
    /// one to end, up to `timeouts.connect`.
    async fn h1_slot(
        &self,
        slots: Arc<tokio::sync::Semaphore>,
    ) -> Result<OwnedSemaphorePermit, ForwardError> {
        let wait = self.dp.config().timeouts.connect;
        match tokio::time::timeout(wait, slots.acquire_owned()).await {
            Ok(Ok(slot)) => Ok(slot),
            _ => Err(ForwardError::Http(format!(
                "the origin speaks HTTP/1.1, and this connection's {H1_SLOTS} requests in flight to it held every origin connection it may use for {wait:?}"
            ))),
        }
    }

    /// The first HTTP/2 request found to reach an HTTP/1.1 origin: from
    /// now on the client's requests share [`H1_SLOTS`] origin connections,
    /// this one holding the first.
    fn first_h1_slot(&self) -> Option<OwnedSemaphorePermit> {
        let slots = self
            .h1_slots
            .get_or_init(|| Arc::new(tokio::sync::Semaphore::new(H1_SLOTS)));
        slots.clone().try_acquire_owned().ok()
    }

    /// Sends `again` (a copy of a request the origin refused unprocessed,
    /// see [`replayable`]) once more, on another HTTP/2 connection than
    /// `refused`, the one that refused it: after a GOAWAY it takes no new
    /// stream, so the pool hands out or opens another; after a stream reset
    /// with `REFUSED_STREAM` it still would, so another is opened.
    async fn send_again(
        &self,
        again: Request<Body>,
        (verify_as, route): (Option<&Hostname>, &Route),
        refused: &H2Sender,
    ) -> Result<Response<Body>, ForwardError> {
        let none = || {
            ForwardError::Http(
                "the origin refused the request unprocessed, and no HTTP/2 connection took it again"
                    .into(),
            )
        };
        let mut guard = self.upstream.lock().await;
        let asked = std::time::Instant::now();
        self.hold_upstream(&mut guard, (verify_as, route), (true, asked))
            .await?;
        let s = match guard.as_mut() {
            Some((_, Sender::H2(s))) if !s.same(refused) => s.clone(),
            Some((key, held @ Sender::H2(_))) => {
                match self.connect(route, verify_as, true).await? {
                    Sender::H2(fresh) => {
                        self.up.pool.put(key.clone(), Sender::H2(fresh.clone()));
                        *held = Sender::H2(fresh.clone());
                        fresh
                    }
                    Sender::H1(_) => return Err(none()),
                }
            }
            _ => return Err(none()),
        };
        drop(guard);
        from_h2(s.send(again).await)
    }

    /// Makes `held` a usable connection to the destination, verified as
    /// `verify_as`: the one held if it still is, else one from the pool or
    /// a fresh one (the one held goes back to the pool). HTTP/2 is offered
    /// to the origin only for an HTTP/2 client (`h2`). A connect that
    /// failed after the request began waiting (`asked`) for the lock is its
    /// answer too: the streams that waited behind one connect to an origin
    /// that does not answer each get its error, instead of each trying in
    /// turn, one connect timeout after another.
    async fn hold_upstream(
        &self,
        held: &mut Option<(PoolKey, Sender)>,
        (verify_as, route): (Option<&Hostname>, &Route),
        (h2, asked): (bool, std::time::Instant),
    ) -> Result<(), ForwardError> {
        // Plain connections verify nothing: no name in their key.
        let name = verify_as.filter(|_| self.tls);
        // `route` is the way out the registration names now: a push that
        // names another applies from the next request.
        let same =
            |k: &PoolKey| k.is(self.dst, self.tls, name, h2) && k.via.as_ref() == route.proxy();
        if held.as_ref().is_some_and(|(k, s)| same(k) && s.usable()) {
            return Ok(());
        }
        // An HTTP/2 connection at its origin's limit of streams, to queue
        // on once this client connection has opened as many as it may.
        let full = match held.as_ref() {
            Some((k, Sender::H2(s))) if same(k) && s.open() => Some((k.clone(), s.clone())),
            _ => None,
        };
        if let Some((old_key, old)) = held.take() {
            self.up.pool.put(old_key, old);
        }
        let key = PoolKey {
            sandbox: self.sandbox.id.clone(),
            serial: self.sandbox.serial,
            dst: self.dst,
            tls: self.tls,
            name: name.cloned(),
            via: route.proxy().cloned(),
            h2,
        };
        let spent = h2 && self.h2_opened.load(Ordering::Relaxed) >= H2_CONNS;
        let sender = match (self.up.pool.take(&key), full) {
            (Some(s), _) => s,
            (None, Some((full_key, full))) if spent => {
                *held = Some((full_key, Sender::H2(full)));
                return Ok(());
            }
            // The one it held was given back at a lull: any open one, full
            // or not, rather than a connection more.
            (None, _) if spent => match self.up.pool.open_h2(&key) {
                Some(open) => open,
                None => self.fresh(&key, (verify_as, route), asked).await?,
            },
            (None, _) => self.fresh(&key, (verify_as, route), asked).await?,
        };
        *held = Some((key, sender));
        Ok(())
    }

    /// A new connection for `key` ([`Conn::hold_upstream`]), unless a connect
    /// failed after `asked`. An HTTP/2 one multiplexes: pooled at once, the
    /// sandbox's other client connections to the same destination and name
    /// take it, instead of each idle client connection pinning an upstream
    /// connection of its own. The key holds the sandbox: never another's.
    async fn fresh(
        &self,
        key: &PoolKey,
        (verify_as, route): (Option<&Hostname>, &Route),
        asked: std::time::Instant,
    ) -> Result<Sender, ForwardError> {
        if let Some(failed) = self.failed_since(key, asked) {
            return Err(failed);
        }
        let fresh = self
            .connect(route, verify_as, key.h2)
            .await
            .inspect_err(|e| self.note_failure(key, e))?;
        if let Sender::H2(h2) = &fresh {
            self.up.pool.put(key.clone(), Sender::H2(h2.clone()));
            self.h2_opened.fetch_add(1, Ordering::Relaxed);
        }
        Ok(fresh)
    }

    /// Remembers a connect for `key` that failed ([`Conn::hold_upstream`]).
    fn note_failure(&self, key: &PoolKey, e: &ForwardError) {
        let failed = Failure {
            key: key.clone(),
            at: std::time::Instant::now(),
            fault: e.fault(),
            message: e.to_string(),
            proxy: e.proxy_header(),
        };
        *self
            .connect_failed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(failed);
    }

    /// The connect for `key` that failed after `asked`, if one did (one
    /// for another name, verified as another, is not this request's).
    fn failed_since(&self, key: &PoolKey, asked: std::time::Instant) -> Option<ForwardError> {
        let failed = self
            .connect_failed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let failed = failed.as_ref()?;
        (failed.at >= asked && failed.key == *key).then(|| ForwardError::Failed {
            fault: failed.fault,
            message: failed.message.clone(),
            proxy: failed.proxy.clone(),
        })
    }

    /// Bridges a WebSocket upgrade over a fresh HTTP/1.1 connection: the
    /// request goes with its hop-by-hop headers stripped but the upgrade's
    /// own, and only a `101` that switches to `websocket` is bridged.
    async fn upgrade(
        &self,
        mut req: Request<ClientBody>,
        (verify_as, route): (Option<&Hostname>, &Route),
        authority: &str,
    ) -> Response<Body> {
        let client_side = hyper::upgrade::on(&mut req);
        let mut sender = match self.connect(route, verify_as, false).await {
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
        let mut out = Request::from_parts(parts, boxed(body));
        *out.uri_mut() = origin_form(out.uri());
        let headers = out.headers_mut();
        strip_hop_by_hop(headers);
        set_host(headers, authority);
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
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
            if !upgrades_to_websocket(resp.headers()) {
                self.dp.metrics.fault(Fault::UPSTREAM_HTTP);
                return text(
                    StatusCode::BAD_GATEWAY,
                    "the origin switched to a protocol other than websocket\n",
                );
            }
            // Bridged in the flow's task, once hyper hands the client's
            // connection over after this 101 (`bridge.rs`).
            self.set_bridge(client_side, hyper::upgrade::on(&mut resp));
        } else {
            // Refused: an answer like any other (its framing as any other's).
            return self.passed_back(Ok(resp.map(boxed)));
        }
        resp.map(boxed)
    }

    /// Opens a connection to the original destination (see
    /// [`Upstreams::connect`](crate::upstream::Upstreams::connect)).
    /// Its future (a TCP connect, a TLS handshake, an HTTP handshake: 5 kB)
    /// is boxed, so that every request's future, which may connect but
    /// mostly does not, is that much smaller to build and move.
    async fn connect(
        &self,
        route: &Route,
        verify_as: Option<&Hostname>,
        allow_h2: bool,
    ) -> Result<Sender, ForwardError> {
        let config = self.dp.config();
        Box::pin(self.up.connect(
            (self.dst, route, self.sandbox.serial),
            self.tls,
            verify_as,
            allow_h2,
            &config.timeouts,
            &self.dp.metrics,
        ))
        .await
    }
}

/// A connect to the origin that failed ([`Conn::hold_upstream`]).
pub(super) struct Failure {
    key: PoolKey,
    at: std::time::Instant,
    fault: Fault,
    message: String,
    proxy: Option<HeaderValue>,
}

/// The lock on a client connection's upstream connection.
type UpstreamGuard<'a> = tokio::sync::MutexGuard<'a, Option<(PoolKey, Sender)>>;

/// HTTP/2 origin connections one client connection may open beside one at
/// its origin's limit of concurrent streams; past them a request waits for
/// a stream on one of them (an origin that allows one stream would
/// otherwise get a connection per stream, up to 200 a client connection).
const H2_CONNS: usize = 4;

/// Origin connections an HTTP/2 client connection's requests may hold at
/// once when its origin speaks HTTP/1.1.
const H1_SLOTS: usize = 8;

/// `out`, its body holding `slot` (if any), and the slot for its answer's
/// body to hold too: an origin that answers before it has read an upload
/// is still busy with it.
fn slot_held(
    out: Request<Body>,
    slot: Option<OwnedSemaphorePermit>,
) -> (Request<Body>, Option<Arc<OwnedSemaphorePermit>>) {
    match slot.map(Arc::new) {
        Some(slot) => {
            let held = Some(slot.clone());
            (out.map(|body| holding(body, held)), Some(slot))
        }
        None => (out, None),
    }
}

/// `body`, holding `slot` (if any) until it is dropped: the origin
/// connection it goes or comes on is in use until then.
fn holding(body: Body, slot: Option<Arc<OwnedSemaphorePermit>>) -> Body {
    match slot {
        Some(slot) => body
            .map_frame(move |frame| {
                let _held = &slot;
                frame
            })
            .boxed(),
        None => body,
    }
}

/// A body hyper read, as the gateway passes bodies on.
fn boxed<B>(body: B) -> Body
where
    B: hyper::body::Body<Data = bytes::Bytes, Error = hyper::Error> + Send + Sync + 'static,
{
    body.map_err(Into::into).boxed()
}

/// An HTTP/2 origin's answer as the gateway passes answers on.
fn from_h2(
    sent: Result<Response<crate::h2client::Received>, h2::Error>,
) -> Result<Response<Body>, ForwardError> {
    sent.map(|resp| resp.map(|body| body.map_err(Into::into).boxed()))
        .map_err(|e| ForwardError::Http(e.to_string()))
}

/// Whether a method may be repeated as `replayable` requires.
fn is_safe(m: &str) -> bool {
    ["GET", "HEAD", "OPTIONS"]
        .iter()
        .any(|s| s.eq_ignore_ascii_case(m))
}

/// A copy of a request to send again if the origin refuses it unprocessed
/// (or an HTTP/1.1 connection fails it): only a bodyless `GET`, `HEAD` or
/// `OPTIONS`, which RFC 9110 (§9.2.2) lets a client repeat, and none whose
/// method overrides (headers, `_method`) name another method, which an
/// origin may have acted on (the caller asks only for a request whose
/// overrides, read once in [`Conn::pass`], name none); anything else is
/// answered 502 as before.
fn replayable(req: &Request<Body>) -> Option<Request<Body>> {
    let safe = matches!(
        *req.method(),
        http::Method::GET | http::Method::HEAD | http::Method::OPTIONS
    );
    if !safe || !hyper::body::Body::is_end_stream(req.body()) {
        return None;
    }
    let mut copy = Request::new(http_body_util::Empty::new().map_err(|n| match n {}).boxed());
    *copy.method_mut() = req.method().clone();
    *copy.uri_mut() = req.uri().clone();
    *copy.version_mut() = req.version();
    *copy.headers_mut() = req.headers().clone();
    Some(copy)
}

/// Whether an HTTP/2 origin ended the stream without processing it: a
/// GOAWAY whose last stream is below it (h2 reports the GOAWAY), or a
/// `REFUSED_STREAM` reset (RFC 9113 §8.7).
fn unprocessed(e: &h2::Error) -> bool {
    e.is_remote() && (e.is_go_away() || e.reason() == Some(h2::Reason::REFUSED_STREAM))
}

/// A WebSocket opening handshake (RFC 6455 §4.1): an HTTP/1.1 `GET` whose
/// one `Upgrade` value is `websocket`, and nothing else beside it that the
/// origin could pick instead.
pub(super) fn is_websocket(req: &Request<ClientBody>) -> bool {
    req.version() == http::Version::HTTP_11
        && req.method() == http::Method::GET
        && upgrades_to_websocket(req.headers())
}

/// The message's `Upgrade` is one value, `websocket` (in any case).
fn upgrades_to_websocket(headers: &HeaderMap) -> bool {
    let mut values = headers.get_all(header::UPGRADE).iter();
    match (values.next(), values.next()) {
        (Some(v), None) => v.as_bytes().trim_ascii().eq_ignore_ascii_case(b"websocket"),
        _ => false,
    }
}

/// The fixed connection-specific headers (RFC 9110 §7.6.1).
const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Whether the request's `TE` is exactly `trailers`, once.
fn asks_for_trailers(headers: &HeaderMap) -> bool {
    let mut te = headers.get_all(header::TE).iter();
    te.next()
        .is_some_and(|v| v.as_bytes().trim_ascii().eq_ignore_ascii_case(b"trailers"))
        && te.next().is_none()
}

/// Connection-specific headers never cross a proxy (RFC 9110 §7.6.1): the
/// fixed ones, and every header a `Connection` value names. One look at each
/// name the message carries and one at each `Connection` token; only the
/// names found are removed (a message usually carries none, or only
/// `Connection`), and nothing is allocated unless a token names a header
/// outside the fixed set that the message carries.
/// Whether an answer's `transfer-encoding` names a coding but `chunked`.
fn transfer_coded(headers: &HeaderMap) -> bool {
    crate::credentials::codings_but(headers, &header::TRANSFER_ENCODING, b"chunked")
}

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let mut named: Vec<HeaderName> = Vec::new();
    // Read as bytes: a value with a byte outside ASCII still names the
    // headers its other tokens spell.
    for value in headers.get_all(header::CONNECTION) {
        for token in value
            .as_bytes()
            .split(|&b| b == b',')
            .map(<[u8]>::trim_ascii)
        {
            if HOP_BY_HOP
                .iter()
                .any(|h| h.as_str().as_bytes().eq_ignore_ascii_case(token))
            {
                continue;
            }
            // A token that is no header name names no header.
            match HeaderName::from_bytes(token) {
                Ok(name) if headers.contains_key(&name) => named.push(name),
                _ => {}
            }
        }
    }
    let mut fixed = 0u8;
    for name in headers.keys() {
        // A standard name compares as a tag, not as bytes.
        if let Some(i) = HOP_BY_HOP.iter().position(|h| h == name) {
            fixed |= 1 << i;
        }
    }
    for (i, name) in HOP_BY_HOP.iter().enumerate() {
        if fixed & (1 << i) != 0 {
            headers.remove(name);
        }
    }
    for name in named {
        headers.remove(name);
    }
}

/// The origin sees exactly the authority the gateway judged: every `Host`
/// the client sent is replaced by it (they agreed, or the request was refused).
fn set_host(headers: &mut HeaderMap, authority: &str) {
    // Usually the client sent one Host, the authority byte for byte: kept.
    let mut hosts = headers.get_all(header::HOST).iter();
    if let (Some(only), None) = (hosts.next(), hosts.next()) {
        if only.as_bytes() == authority.as_bytes() {
            return;
        }
    }
    match HeaderValue::from_str(authority) {
        // `insert` replaces every value the name had.
        Ok(v) => drop(headers.insert(header::HOST, v)),
        Err(_) => drop(headers.remove(header::HOST)),
    }
}

fn origin_form(uri: &Uri) -> Uri {
    uri.path_and_query()
        .map_or_else(|| Uri::from_static("/"), |pq| Uri::from(pq.clone()))
}

/// The request's URI as the origin gets it over HTTP/2: `https`, the judged
/// authority and the client's path. Usually the client's URI is that already
/// (the same authority, byte for byte), and is kept as it is.
fn absolute(uri: &Uri, authority: &str) -> Uri {
    let same = uri.scheme() == Some(&http::uri::Scheme::HTTPS)
        && uri.authority().is_some_and(|a| a.as_str() == authority)
        && uri.path_and_query().is_some();
    if same {
        return uri.clone();
    }
    // Built from its parts, never by parsing a concatenation: a path that
    // does not start with `/` (`OPTIONS *`) would otherwise be read as part
    // of the authority.
    let pq = uri
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/"));
    Uri::builder()
        .scheme(http::uri::Scheme::HTTPS)
        .authority(authority)
        .path_and_query(pq)
        .build()
        .unwrap_or_else(|_| origin_form(uri))
}

/// The `cookie` fields of an HTTP/2 request, which may carry one pair
/// each, as one field joined with `"; "` (RFC 9113 8.2.3), before anything
/// reads them: an HTTP/1.1 origin may read one `Cookie` line only, and a
/// required cookie credential is judged on the whole header.
pub(super) fn join_cookies(headers: &mut HeaderMap) {
    if headers.get_all(header::COOKIE).iter().nth(1).is_none() {
        return;
    }
    let pairs: Vec<&[u8]> = headers
        .get_all(header::COOKIE)
        .iter()
        .map(HeaderValue::as_bytes)
        .collect();
    if let Ok(joined) = HeaderValue::from_bytes(&pairs.join(&b"; "[..])) {
        headers.insert(header::COOKIE, joined);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::header_map as map;

    #[test]
    fn an_http2_requests_cookie_fields_are_one() {
        let mut m = map(&[("cookie", "s=PH"), ("cookie", "a=1"), ("cookie", "b=2")]);
        join_cookies(&mut m);
        let all: Vec<_> = m.get_all("cookie").iter().collect();
        assert_eq!(all, ["s=PH; a=1; b=2"]);
        let mut one = map(&[("cookie", "s=PH; a=1")]);
        join_cookies(&mut one);
        assert_eq!(
            one.get_all("cookie").iter().collect::<Vec<_>>(),
            ["s=PH; a=1"]
        );
    }

    fn names(m: &HeaderMap) -> Vec<&str> {
        let mut v: Vec<&str> = m.keys().map(HeaderName::as_str).collect();
        v.sort_unstable();
        v
    }

    #[test]
    fn a_transfer_coding_but_chunked_is_found() {
        let coded = |v: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(header::TRANSFER_ENCODING, HeaderValue::from_static(v));
            transfer_coded(&h)
        };
        assert!(coded("gzip, chunked"));
        assert!(coded("x-custom"));
        assert!(!coded("chunked"));
        assert!(!coded("Chunked"));
        assert!(!transfer_coded(&HeaderMap::new()));
    }

    #[test]
    fn the_fixed_hop_by_hop_headers_go_and_the_rest_stay() {
        let mut m = map(&[
            ("connection", "keep-alive"),
            ("keep-alive", "timeout=5"),
            ("proxy-authorization", "Basic eA=="),
            ("proxy-authenticate", "Basic"),
            ("te", "trailers"),
            ("trailer", "x-sum"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "h2c"),
            ("content-type", "text/plain"),
            ("set-cookie", "a=1"),
            ("set-cookie", "b=2"),
        ]);
        strip_hop_by_hop(&mut m);
        assert_eq!(names(&m), ["content-type", "set-cookie"]);
        assert_eq!(m.get_all("set-cookie").iter().count(), 2);
    }

    #[test]
    fn headers_a_connection_value_names_go_in_any_case_and_every_value() {
        let mut m = map(&[
            ("connection", "X-Secret , close"),
            ("connection", "x-other"),
            ("x-secret", "1"),
            ("x-secret", "2"),
            ("x-other", "3"),
            ("x-kept", "4"),
        ]);
        strip_hop_by_hop(&mut m);
        assert_eq!(names(&m), ["x-kept"]);
    }

    #[test]
    fn a_connection_value_with_a_byte_outside_ascii_still_names_its_headers() {
        let mut m = map(&[("x-secret", "1"), ("x-kept", "2")]);
        m.append(
            header::CONNECTION,
            HeaderValue::from_bytes(b"x-secret, \xff").expect("obs-text is a valid value"),
        );
        strip_hop_by_hop(&mut m);
        assert_eq!(names(&m), ["x-kept"]);
    }

    #[test]
    fn a_message_without_hop_by_hop_headers_is_left_as_it_was() {
        let mut m = map(&[("host", "a.test"), ("accept", "*/*"), ("x-connection", "1")]);
        let before = m.clone();
        strip_hop_by_hop(&mut m);
        assert_eq!(m, before);
    }

    #[test]
    fn the_origin_gets_the_judged_authority_over_http2() {
        let judged = "origin.test:8443";
        for (client, expect) in [
            (
                "https://origin.test:8443/a?b=c",
                "https://origin.test:8443/a?b=c",
            ),
            (
                "https://Origin.Test:8443/a?b=c",
                "https://origin.test:8443/a?b=c",
            ),
            ("http://origin.test:8443/a", "https://origin.test:8443/a"),
            ("https://origin.test/a", "https://origin.test:8443/a"),
            ("https://origin.test:8443", "https://origin.test:8443/"),
            ("/a?b", "https://origin.test:8443/a?b"),
        ] {
            let uri: Uri = client.parse().expect("a URI");
            assert_eq!(absolute(&uri, judged).to_string(), expect, "{client}");
        }
        // `OPTIONS *` over HTTP/2: the asterisk stays the path.
        let star = Uri::builder()
            .scheme("http")
            .authority("Origin.Test:8443")
            .path_and_query("*")
            .build()
            .expect("an asterisk URI");
        let out = absolute(&star, judged);
        assert_eq!(
            out.authority().map(http::uri::Authority::as_str),
            Some(judged),
            "{out}"
        );
        assert_eq!(out.path_and_query().map(|pq| pq.as_str()), Some("*"));
    }

    #[test]
    fn every_host_is_replaced_by_the_judged_authority() {
        let mut m = map(&[("host", "a.test"), ("host", "b.test"), ("accept", "*/*")]);
        set_host(&mut m, "a.test:8443");
        let hosts: Vec<_> = m.get_all(header::HOST).iter().collect();
        assert_eq!(hosts, ["a.test:8443"]);
        let mut twice = map(&[("host", "a.test"), ("host", "b.test")]);
        set_host(&mut twice, "a.test");
        let hosts: Vec<_> = twice.get_all(header::HOST).iter().collect();
        assert_eq!(
            hosts,
            ["a.test"],
            "the first of two Hosts agreeing is not enough"
        );
        let mut once = map(&[("host", "a.test")]);
        set_host(&mut once, "a.test");
        let hosts: Vec<_> = once.get_all(header::HOST).iter().collect();
        assert_eq!(hosts, ["a.test"]);
        set_host(&mut once, "A.test");
        let hosts: Vec<_> = once.get_all(header::HOST).iter().collect();
        assert_eq!(hosts, ["A.test"], "replaced unless equal byte for byte");
        set_host(&mut m, "bad\u{7f}");
        assert!(
            m.get(header::HOST).is_none(),
            "no Host rather than the old one"
        );
        assert_eq!(names(&m), ["accept"]);
    }
}
