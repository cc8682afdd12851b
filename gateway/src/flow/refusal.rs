//! Why a flow ended before policy could judge it. Every refusal is a deny
//! with a bounded reason code; the policy's own codes are
//! [`egress_policy::Verdict::CODES`].

use std::net::{IpAddr, SocketAddr};

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use crate::peek::PeekError;

/// A flow refused before its verdict.
#[derive(Debug)]
pub(crate) enum Refusal {
    /// The redirect's original destination could not be read.
    NoOriginalDst(String),
    /// The destination is the listener itself: the connection bypassed the redirect.
    NotRedirected(SocketAddr),
    /// No sandbox has this source address.
    UnknownSandbox(SocketAddr, IpAddr),
    /// The first bytes could not be classified, or read two ways.
    Peek(PeekError),
}

/// Whether a flow-log `reason` is one the policy never gave: the flow was
/// refused before the policy was asked (a peek that timed out, an unknown
/// sandbox, a malformed hello), or cut by a budget. What judges recorded
/// decisions again (`egress-replay --shadow`) leaves those out.
pub fn not_judged_by_policy(reason: &str) -> bool {
    reason == "budget_exceeded" || Refusal::CODES.contains(&reason)
}

impl Refusal {
    /// Every code [`Refusal::code`] returns: declared as metric series at
    /// start, and checked against docs/reason-codes.md.
    pub(crate) const CODES: &'static [&'static str] = &[
        "no_original_dst",
        "not_redirected",
        "unknown_sandbox",
        "peek_timeout",
        "closed_early",
        "client_hello_too_large",
        "malformed_client_hello",
        "malformed_request",
        "client_error",
    ];

    /// A bounded reason label for metrics and the flow log.
    pub(crate) fn code(&self) -> &'static str {
        match self {
            Self::NoOriginalDst(_) => "no_original_dst",
            Self::NotRedirected(_) => "not_redirected",
            Self::UnknownSandbox(..) => "unknown_sandbox",
            Self::Peek(PeekError::Timeout) => "peek_timeout",
            Self::Peek(PeekError::Closed) => "closed_early",
            Self::Peek(PeekError::TooLarge) => "client_hello_too_large",
            Self::Peek(PeekError::Malformed(_)) => "malformed_client_hello",
            Self::Peek(PeekError::MalformedRequest(_)) => "malformed_request",
            Self::Peek(PeekError::Io(_)) => "client_error",
        }
    }

    /// The readable reason.
    pub(crate) fn detail(&self) -> String {
        match self {
            Self::NoOriginalDst(e) => format!("original destination unknown: {e}"),
            Self::NotRedirected(_) => {
                "the connection was not redirected: its destination is the gateway itself".into()
            }
            Self::UnknownSandbox(_, src) => format!("no sandbox has source address {src}"),
            Self::Peek(e) => e.to_string(),
        }
    }

    /// The destination, when it was learned.
    pub(super) fn dst(&self) -> Option<SocketAddr> {
        match self {
            Self::NoOriginalDst(_) => None,
            Self::NotRedirected(dst) | Self::UnknownSandbox(dst, _) => Some(*dst),
            Self::Peek(_) => None,
        }
    }

    /// Tells the client: `400` for a request head that reads two ways, a reset otherwise.
    pub(super) async fn answer(&self, stream: &mut TcpStream) {
        if let Self::Peek(e @ PeekError::MalformedRequest(_)) = self {
            let body = format!("{e}\n");
            let _ = stream
                .write_all(&crate::reply::closing(http::StatusCode::BAD_REQUEST, &body))
                .await;
            let _ = stream.shutdown().await;
        } else {
            crate::io::reset(stream);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_lists_every_code() {
        let all = [
            Refusal::NoOriginalDst(String::new()),
            Refusal::NotRedirected(([127, 0, 0, 1], 1).into()),
            Refusal::UnknownSandbox(([127, 0, 0, 1], 1).into(), [127, 0, 0, 1].into()),
            Refusal::Peek(PeekError::Timeout),
            Refusal::Peek(PeekError::Closed),
            Refusal::Peek(PeekError::TooLarge),
            Refusal::Peek(PeekError::Malformed("x")),
            Refusal::Peek(PeekError::MalformedRequest(
                crate::authority::AuthorityError::SeveralHosts,
            )),
            Refusal::Peek(PeekError::Io(String::new())),
        ];
        let codes: Vec<&str> = all.iter().map(Refusal::code).collect();
        assert_eq!(codes, Refusal::CODES);
    }

    /// The operator's list of reason codes names every code the gateway emits.
    #[test]
    fn the_docs_explain_every_reason_code() {
        let doc = include_str!("../../../docs/reason-codes.md");
        let codes = Refusal::CODES
            .iter()
            .chain(egress_policy::Verdict::CODES)
            .chain(egress_policy::RequestCode::CODES)
            .chain(crate::credentials::Refusal::CODES);
        for code in codes {
            assert!(
                doc.contains(&format!("`{code}`")),
                "docs/reason-codes.md lacks {code}"
            );
        }
    }
}
