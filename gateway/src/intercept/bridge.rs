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

use std::io;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};

use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::charge::entries_of;
use super::serve::finish;
use super::{client_fault, ended, Conn, Ended, Served};
use crate::budget::Meter;
use crate::fault::Fault;
use crate::io::{Quiet, Watch};

/// Both sides copied until one ends: the error it ended in, and why the
/// byte budget cut it, if it did.
pub(super) type Bridge =
    Pin<Box<dyn std::future::Future<Output = (Option<Ended>, Option<String>)> + Send>>;

impl Conn {
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

/// Runs `bridge` in the flow's task until it ends, its flow falls idle, or
/// its sandbox is gone.
pub(super) async fn bridged(conn: &Arc<Conn>, mut bridge: Bridge, watch: &mut Watch<'_>) -> Served {
    // What moved up to the `101` is the upgrade request's, charged before
    // the bridge moves a byte.
    conn.charge_rest();
    let (error, cut) = loop {
        tokio::select! {
            biased;
            ended = &mut bridge => break ended,
            // A bridge has no boundary: it ends as a spliced flow does.
            why = watch.next(|| conn.removed() || conn.dp.drain_over.load(Ordering::Acquire)) => match why {
                Quiet::Idle => break (Some(ended(Fault::IDLE_TIMEOUT, "idle_timeout".into())), None),
                Quiet::Stop => break (conn.end_cause(), None),
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
