//! A WebSocket bridged through interception, within its flow. The forward
//! stage builds the bridge when the origin switches to `websocket`
//! ([`Conn::set_bridge`]); the flow's task runs it once hyper has handed
//! the client's connection over ([`bridged`]), so the flow's slot, its log
//! line and its byte counts last as long as the bridge. The bridge ends at
//! the flow's idle timeout and, at a tick of the idle watch, once its
//! sandbox is gone (`gateway_sandbox_removed`). With a byte budget on the
//! last request's entry, every chunk is charged as it moves, as a spliced
//! flow's are: one that does not fit cuts the bridge (`budget_exceeded`).
//! A drain lets a bridge run to the drain's end, as it lets a spliced flow.
//! When its sandbox's policy changes (a push, an entry's `until`), the
//! request that opened it is judged again, at the next tick, on what it was
//! judged on (its name, the names attributed then, its method overrides and
//! target): one the new policy refuses ends the bridge
//! (`gateway_policy_withdrawn`).

use std::io;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};

use egress_policy::{CompiledPolicy, Hostname, Verdict};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::charge::entries_of;
use super::serve::finish;
use super::serve::ClientBody;
use super::{client_fault, ended, Conn, Ended, Served};
use crate::budget::Meter;
use crate::fault::Fault;
use crate::io::{Quiet, Watch};

/// Both sides copied until one ends: the error it ended in, and why the
/// byte budget cut it, if it did.
pub(super) type Bridge =
    Pin<Box<dyn std::future::Future<Output = (Option<Ended>, Option<String>)> + Send>>;

/// What a request let through on a connection was judged on (the last one
/// on HTTP/1.1, the one that opened a WebSocket once one is open; each
/// stream in flight on HTTP/2), and the policy last found to let it
/// through with the platform's count of changes then.
pub(super) struct Opened {
    method: hyper::Method,
    host: Option<Hostname>,
    /// The names attributed then, as they were (shared, not copied).
    lookup: dns_attrib::Lookup,
    overrides: Vec<String>,
    target: Option<http::uri::PathAndQuery>,
    /// It names another path in a header ([`crate::decide::path_override`]):
    /// refused wherever per-request rules judge the target.
    path_override: bool,
    last: (Arc<CompiledPolicy>, u64),
}

impl Conn {
    /// Keeps what a request let through under `sb`'s policy was judged on:
    /// the connection (and a bridge the request opens) is judged again on
    /// it when the policy changes, so a push that refuses it ends what is
    /// in flight too ([`Conn::withdrawn`]).
    pub(super) fn opening(
        &self,
        sb: &crate::registry::Sandbox,
        req: &hyper::Request<ClientBody>,
        (host, lookup): (Option<&Hostname>, &dns_attrib::Lookup),
        overrides: &[String],
    ) {
        let opened = Opened {
            method: req.method().clone(),
            host: host.cloned(),
            lookup: lookup.clone(),
            // Read whether or not the policy judges them now (a push that
            // adds a per-request rule judges them then).
            overrides: overrides.to_vec(),
            target: req.uri().path_and_query().cloned(),
            // Under per-request rules such a request was refused: only a
            // policy without them lets one through, so only then is it read.
            path_override: !sb.policy.has_request_rules()
                && crate::decide::path_override(req.headers()).is_some(),
            // Judged again at the first tick: the platform's addresses may
            // have changed since the request was judged.
            last: (
                sb.policy.clone(),
                sb.policy.platform().changes().wrapping_sub(1),
            ),
        };
        let stream = req.body().stream();
        let mut all = self
            .opened
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match stream {
            // Each stream in flight is judged again, until its end.
            Some(token) => all.push((token, opened)),
            // One request at a time: the last.
            None => {
                all.clear();
                all.push((0, opened));
            }
        }
    }

    /// Forgets what the last request was judged on (a request on HTTP/1.1
    /// starts: the one before is no longer in flight).
    pub(super) fn forget_opening(&self) {
        self.opened
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clear();
    }

    /// Forgets what an HTTP/2 stream was judged on: it ended. The list's
    /// order means nothing, so the last entry takes its place: removing
    /// one of many in flight moves one entry, not every one after it.
    /// What it held is freed after the lock is let go.
    pub(super) fn forget_stream(&self, token: u64) {
        let mut all = self
            .opened
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let at = all.iter().position(|(t, _)| *t == token);
        let gone = at.map(|at| all.swap_remove(at));
        drop(all);
        drop(gone);
    }

    /// Whether the sandbox's policy now refuses a request let through on
    /// this connection and still in flight (the last on HTTP/1.1, the one
    /// that opened a bridge once one is open, any stream on HTTP/2): its
    /// flow's verdict, or a per-request rule on its method (and those its
    /// overrides name) and target. Each is judged only when the policy or
    /// the platform's addresses changed since it was last let through.
    pub(super) fn withdrawn(&self) -> bool {
        let Some(now) = self.sandbox_now() else {
            return false; // gone: `removed` says so
        };
        let mut opened = self
            .opened
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Every one judged (each keeps what let it through), any refusal
        // withdrawing the connection.
        opened
            .iter_mut()
            .fold(false, |refused, (_, o)| self.refuses(&now, o) || refused)
    }

    /// Whether `now`'s policy refuses what `o` was let through on; if not,
    /// `o` remembers the policy it was let through under.
    fn refuses(&self, now: &crate::registry::Sandbox, o: &mut Opened) -> bool {
        let changes = now.policy.platform().changes();
        if Arc::ptr_eq(&o.last.0, &now.policy) && o.last.1 == changes {
            return false;
        }
        let policy = &now.policy;
        let claims = self.claims(o.host.as_ref());
        let attributed = o.lookup.names();
        let gap = o.lookup.gap();
        let flow = crate::decide::judge(policy, &claims, &attributed, gap, &self.dp.doh_names);
        let refused = matches!(flow, Verdict::Deny(_))
            || (policy.has_request_rules() && o.path_override)
            || (policy.has_request_rules() && {
                let names = crate::decide::request_names(self.tls, o.host.as_ref(), &attributed);
                let method = (o.method.as_str(), &o.overrides[..]);
                let target = o.target.as_ref().map_or("", |pq| pq.as_str());
                let (judged, _) = crate::decide::judge_methods(policy, &names, method, target);
                judged.deny.is_some()
            });
        if !refused {
            o.last = (now.policy.clone(), changes);
        }
        refused
    }

    /// Keeps the bridge between `client` and `origin` (the two sides of a
    /// `101` to `websocket`) for the flow's task to run.
    pub(super) fn set_bridge(&self, client: OnUpgrade, origin: OnUpgrade) {
        let meter = self.bridge_meter();
        let bridge = async move {
            let (c, o) = match (client.await, origin.await) {
                (Ok(c), Ok(o)) => (c, o),
                (Err(e), _) | (_, Err(e)) => {
                    return (
                        Some(ended(Fault::UPSTREAM_HTTP, format!("upgrade: {e}"))),
                        None,
                    )
                }
            };
            let mut c = TokioIo::new(c);
            let mut o = Metered {
                inner: TokioIo::new(o),
                meter: meter.as_ref(),
                prepaid: 0,
            };
            let copied = tokio::io::copy_bidirectional(&mut c, &mut o).await;
            if let Some(m) = meter.as_ref().filter(|m| m.crossed()) {
                return (None, Some(format!("budget_exceeded: {}", m.describe())));
            }
            let error = copied
                .err()
                .map(|e| ended(client_fault(&e), format!("websocket: {e}")));
            (error, None)
        };
        *self
            .bridge
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Box::pin(bridge));
    }

    /// The bridge the last request set, if any.
    pub(super) fn take_bridge(&self) -> Option<Bridge> {
        self.bridge
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }

    /// A meter on the last request's budget entries that limit bytes, if
    /// any: from here on it charges the bridge's bytes, chunk by chunk.
    fn bridge_meter(&self) -> Option<Meter> {
        let sandbox = self.sandbox_now()?;
        let last = self.budget.last()?;
        let metered: Vec<_> = entries_of(&last, &sandbox.policy.policy().budgets)
            .into_iter()
            .filter(|(_, b)| b.bytes_per_hour.is_some())
            .map(|(rule, b)| (rule, b.clone()))
            .collect();
        if metered.is_empty() {
            return None;
        }
        let table = (self.dp.budgets.clone(), self.dp.cache.clone());
        Some(Meter::new(table, sandbox.id.clone(), metered))
    }
}

/// Runs `bridge` in the flow's task until it ends, its flow falls idle, its
/// sandbox is gone, or its policy refuses the request that opened it.
pub(super) async fn bridged(conn: &Arc<Conn>, mut bridge: Bridge, watch: &mut Watch<'_>) -> Served {
    // What moved up to the `101` is the upgrade request's, charged before
    // the bridge moves a byte.
    conn.charge_rest();
    // The connection's earlier requests went on a pooled connection of
    // their own: given back now, not held for the bridge's life.
    conn.release_upstream();
    let (error, cut) = loop {
        tokio::select! {
            biased;
            ended = &mut bridge => break ended,
            // A bridge has no boundary: it ends as a spliced flow does.
            why = watch.next(|| conn.removed() || conn.dp.drain_over.load(Ordering::Acquire) || conn.withdrawn()) => match why {
                Quiet::Idle => break (Some(ended(Fault::IDLE_TIMEOUT, "idle_timeout".into())), None),
                Quiet::Stop => {
                    let withdrawn = || ended(Fault::POLICY_WITHDRAWN, "gateway_policy_withdrawn".into());
                    break (conn.end_cause().or_else(|| Some(withdrawn())), None);
                }
                Quiet::Lull | Quiet::Rest => {}
            },
        }
    };
    // The bridge's bytes were charged by its meter, if its entry limits
    // bytes, and are nobody's to charge otherwise: not charged again.
    conn.budget.settle();
    let mut served = finish(conn, error).await;
    served.budget_cut = cut;
    served
}

/// The origin's side of a bridge, each chunk charged to `meter` before it
/// is passed on: a chunk that does not fit fails the copy (read from the
/// origin: not handed to the client; to be written to it: not written).
struct Metered<'a, S> {
    inner: S,
    meter: Option<&'a Meter>,
    /// Bytes charged for a write not yet taken by the origin's side (a
    /// write that was pending, or taken in part, is not charged twice).
    prepaid: usize,
}

impl<S> Metered<'_, S> {
    fn charge(&self, n: usize) -> io::Result<()> {
        match self.meter {
            Some(m) if n > 0 && !m.spend(n) => Err(io::Error::other("byte budget exceeded")),
            _ => Ok(()),
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Metered<'_, S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            let n = buf.filled().len() - before;
            if let Err(e) = self.charge(n) {
                buf.set_filled(before);
                return Poll::Ready(Err(e));
            }
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Metered<'_, S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if buf.len() > self.prepaid {
            self.charge(buf.len() - self.prepaid)?;
            self.prepaid = buf.len();
        }
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = polled {
            self.prepaid = self.prepaid.saturating_sub(n);
        }
        polled
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
