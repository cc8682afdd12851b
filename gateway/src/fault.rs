//! Whose fault a failure after the verdict was: the client's, the
//! upstream's, or the gateway's own (a limit it enforces). Each fault is a
//! (side, kind) pair from a fixed list — the label set of
//! `egress_flow_errors_total` — so an operator can tell a broken origin from
//! a misbehaving sandbox without reading logs.

use std::io;

use crate::upstream_proxy::ProxyFailure;

/// Who caused it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Side {
    Client,
    Upstream,
    Gateway,
}

impl Side {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Client => "client",
            Self::Upstream => "upstream",
            Self::Gateway => "gateway",
        }
    }
}

/// One failure: who, and what.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Fault {
    pub(crate) side: Side,
    pub(crate) kind: &'static str,
}

/// Every fault counted; the metric's series exist from the start.
pub(crate) const ALL: &[Fault] = &[
    Fault::upstream("connect_refused"),
    Fault::upstream("connect_timeout"),
    Fault::upstream("connect_unreachable"),
    Fault::upstream("connect_failed"),
    Fault::upstream("tls_verify"),
    Fault::upstream("tls_failed"),
    Fault::upstream("http"),
    Fault::upstream("reset"),
    Fault::upstream("proxy_unreachable"),
    Fault::upstream("proxy_refused"),
    Fault::upstream("proxy_closed"),
    Fault::upstream("proxy_timeout"),
    Fault::upstream("proxy_bad_response"),
    Fault::client("tls_handshake"),
    Fault::client("head_timeout"),
    Fault::client("reset"),
    Fault::client("bad_request"),
    Fault::client("non_http"),
    Fault::client("hello_retry"),
    Fault::client("http"),
    Fault::gateway("idle_timeout"),
    Fault::gateway("splice_backlog"),
    Fault::gateway("splice_broken"),
    Fault::gateway("sandbox_removed"),
    Fault::gateway("policy_withdrawn"),
    Fault::gateway("drain_deadline"),
    Fault::gateway("proxy_unavailable"),
];

impl Fault {
    const fn client(kind: &'static str) -> Self {
        Self {
            side: Side::Client,
            kind,
        }
    }

    const fn upstream(kind: &'static str) -> Self {
        Self {
            side: Side::Upstream,
            kind,
        }
    }

    const fn gateway(kind: &'static str) -> Self {
        Self {
            side: Side::Gateway,
            kind,
        }
    }

    pub(crate) const IDLE_TIMEOUT: Self = Self::gateway("idle_timeout");
    /// A kernel-spliced flow, half-closed, whose reader fell too far behind.
    pub(crate) const SPLICE_BACKLOG: Self = Self::gateway("splice_backlog");
    /// A kernel-spliced flow the kernel stopped moving: it refused a write
    /// to a socket whose peer had not reset it, or never wrote bytes it had
    /// redirected, or the maps could not be read. Bytes may be lost.
    pub(crate) const SPLICE_BROKEN: Self = Self::gateway("splice_broken");
    /// The flow's sandbox was deleted, or its source address taken from
    /// it, while the flow ran: cut (reset both ways).
    pub(crate) const SANDBOX_REMOVED: Self = Self::gateway("sandbox_removed");
    /// A spliced or opaque flow its sandbox's policy no longer lets run
    /// (an entry taken out or past its `until`, a deny or an exemption's
    /// removal pushed): cut (reset both ways).
    pub(crate) const POLICY_WITHDRAWN: Self = Self::gateway("policy_withdrawn");
    /// Still open when the drain's time ran out: reset, not closed.
    pub(crate) const DRAIN_DEADLINE: Self = Self::gateway("drain_deadline");
    pub(crate) const CLIENT_TLS: Self = Self::client("tls_handshake");
    /// A spliced TLS flow whose second ClientHello (after a
    /// HelloRetryRequest) names another server, adds an encrypted
    /// ClientHello, does not parse or does not come: reset.
    pub(crate) const HELLO_RETRY: Self = Self::client("hello_retry");
    pub(crate) const HEAD_TIMEOUT: Self = Self::client("head_timeout");
    pub(crate) const BAD_REQUEST: Self = Self::client("bad_request");
    pub(crate) const NON_HTTP: Self = Self::client("non_http");
    pub(crate) const UPSTREAM_HTTP: Self = Self::upstream("http");
    /// The origin's TLS failed: here, its first handshake message did not
    /// come or could not be passed on.
    pub(crate) const UPSTREAM_TLS: Self = Self::upstream("tls_failed");
    pub(crate) const CLIENT_HTTP: Self = Self::client("http");
    pub(crate) const CLIENT_RESET: Self = Self::client("reset");

    /// A failed TCP connect to the origin.
    pub(crate) fn connect(e: &io::Error) -> Self {
        Self::upstream(match e.kind() {
            io::ErrorKind::ConnectionRefused => "connect_refused",
            io::ErrorKind::TimedOut => "connect_timeout",
            io::ErrorKind::HostUnreachable | io::ErrorKind::NetworkUnreachable => {
                "connect_unreachable"
            }
            _ => "connect_failed",
        })
    }

    /// The operator's upstream proxy gave no tunnel: its fault (the
    /// upstream side), or the gateway's own when the proxy is unusable here
    /// (its password unreadable, or not configured).
    pub(crate) fn proxy(f: &ProxyFailure) -> Self {
        match f {
            ProxyFailure::Connect(..) => Self::upstream("proxy_unreachable"),
            ProxyFailure::Refused { .. } => Self::upstream("proxy_refused"),
            ProxyFailure::Closed(_) => Self::upstream("proxy_closed"),
            ProxyFailure::TimedOut { .. } => Self::upstream("proxy_timeout"),
            ProxyFailure::BadResponse { .. } => Self::upstream("proxy_bad_response"),
            ProxyFailure::Missing | ProxyFailure::NoPassword => Self::gateway("proxy_unavailable"),
        }
    }

    /// A failed TLS handshake with the origin: its certificate did not
    /// verify, or anything else.
    pub(crate) fn upstream_tls(e: &io::Error) -> Self {
        let rustls = e
            .get_ref()
            .and_then(|inner| inner.downcast_ref::<rustls::Error>());
        Self::upstream(match rustls {
            Some(rustls::Error::InvalidCertificate(_)) => "tls_verify",
            _ => "tls_failed",
        })
    }

    /// An I/O error on one side of a flow that was moving bytes.
    pub(crate) fn io(side: Side, e: &io::Error) -> Option<Self> {
        let kind = match e.kind() {
            io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe => "reset",
            _ => return None,
        };
        Some(Self { side, kind })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_errors_map_to_their_side_and_kind() {
        let refused = io::Error::from(io::ErrorKind::ConnectionRefused);
        assert_eq!(Fault::connect(&refused), Fault::upstream("connect_refused"));
        let timeout = io::Error::from(io::ErrorKind::TimedOut);
        assert_eq!(Fault::connect(&timeout), Fault::upstream("connect_timeout"));
        let reset = io::Error::from(io::ErrorKind::ConnectionReset);
        assert_eq!(
            Fault::io(Side::Client, &reset),
            Some(Fault::client("reset"))
        );
        assert_eq!(
            Fault::io(Side::Client, &io::Error::other("x")),
            None,
            "only resets are counted from the copy loop"
        );
        let bad_cert = io::Error::new(
            io::ErrorKind::InvalidData,
            rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer),
        );
        assert_eq!(
            Fault::upstream_tls(&bad_cert),
            Fault::upstream("tls_verify")
        );
        for f in [Fault::connect(&refused), Fault::upstream_tls(&bad_cert)] {
            assert!(ALL.contains(&f), "{f:?} is declared");
        }
    }
}
