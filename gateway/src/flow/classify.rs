//! What the first bytes are: a TLS ClientHello, an HTTP/1.x request head or
//! opaque bytes (see [`crate::peek`]), and the claims they make.

use std::net::SocketAddr;
use std::time::Instant;

use egress_policy::Protocol;
use tokio::net::TcpStream;

use super::Refusal;
use crate::config::Config;
use crate::decide::Claims;
use crate::peek::{peek, Classified};
use crate::state::Dataplane;

/// Peeks within `limits.peek_bytes` and `timeouts.peek`; the bytes read are
/// handed back for the chosen path to replay.
pub(super) async fn classify(
    dp: &Dataplane,
    config: &Config,
    stream: &mut TcpStream,
) -> Result<(Classified, Vec<u8>), Refusal> {
    let started = Instant::now();
    let peeked = peek(stream, config.limits.peek_bytes, config.timeouts.peek).await;
    dp.metrics
        .peek_seconds
        .observe(started.elapsed().as_secs_f64());
    peeked.map_err(Refusal::Peek)
}

impl Classified {
    /// The claims of this flow to `dst`.
    pub(crate) fn claims(&self, dst: SocketAddr) -> Claims<'_> {
        let (protocol, sni, host, ech) = match self {
            Self::Tls(ch) => (Protocol::Tls, ch.sni.as_ref(), None, ch.ech),
            Self::Http { host } => (Protocol::Http, None, host.as_ref(), false),
            Self::Opaque(kind) => (Protocol::Opaque(*kind), None, None, false),
        };
        Claims {
            dst,
            protocol,
            sni,
            host,
            ech,
        }
    }
}
