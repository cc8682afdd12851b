//! Who and where: the original destination the redirect recorded, and the
//! sandbox the source address belongs to.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpStream;

use super::Refusal;
use crate::registry::Sandbox;
use crate::state::Dataplane;

/// A connection from a known sandbox to a real destination.
#[derive(Debug)]
pub(crate) struct Accepted {
    pub(crate) sandbox: Arc<Sandbox>,
    pub(crate) dst: SocketAddr,
}

impl Accepted {
    /// The sandbox and the destination, for the path that serves the flow.
    pub(crate) fn target(&self) -> (Arc<Sandbox>, SocketAddr) {
        (self.sandbox.clone(), self.dst)
    }
}

pub(super) fn identify(
    dp: &Dataplane,
    stream: &TcpStream,
    peer: SocketAddr,
) -> Result<Accepted, Refusal> {
    let dst = dp
        .orig_dst
        .original_dst(stream)
        .map_err(|e| Refusal::NoOriginalDst(e.to_string()))?;
    // A connection that reached the listener without the redirect reports
    // the listener itself as its destination: dialling it would loop.
    // Compared in canonical form: on a `[::]` listener an IPv4 peer's
    // addresses are IPv4-mapped.
    let canonical = |a: SocketAddr| (a.ip().to_canonical(), a.port());
    if stream
        .local_addr()
        .is_ok_and(|local| canonical(local) == canonical(dst))
    {
        return Err(Refusal::NotRedirected(dst));
    }
    let sandbox = dp
        .registry
        .lookup(peer.ip())
        .ok_or(Refusal::UnknownSandbox(dst, peer.ip()))?;
    Ok(Accepted { sandbox, dst })
}

/// The flow's registration as it is after the peek, which may take up to
/// `timeouts.peek`: the flow is decided under the policy it has now (a push
/// acknowledged meanwhile applies to it), and refused as an unknown sandbox
/// if the address no longer belongs to that registration.
pub(super) fn still(
    dp: &Dataplane,
    accepted: &Accepted,
    peer: SocketAddr,
) -> Result<Accepted, Refusal> {
    match dp.registry.lookup(peer.ip()) {
        Some(sandbox)
            if sandbox.id == accepted.sandbox.id && sandbox.serial == accepted.sandbox.serial =>
        {
            Ok(Accepted {
                sandbox,
                dst: accepted.dst,
            })
        }
        _ => Err(Refusal::UnknownSandbox(accepted.dst, peer.ip())),
    }
}
