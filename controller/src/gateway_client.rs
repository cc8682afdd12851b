//! Talking to a worker's gateway over its admin API (JSON over HTTP/1.1,
//! bearer token), with a bound on every wait.

use std::time::Duration;

use bytes::Bytes;
use egress_api::client::{Call, CallError, Target};
use egress_api::text::bounded;
use http::{Method, StatusCode};
use serde_json::Value;

/// Why a gateway gave no answer: its `admin_url` is unusable, or the call
/// failed (the contract crate's [`CallError`]). The text names the URL.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("admin_url {url:?}: {reason}")]
    AdminUrl { url: String, reason: String },
    #[error("{url}: {source}")]
    Call {
        url: String,
        #[source]
        source: CallError,
    },
}

/// Why a push or a resync did not apply. Its text is what the dispatcher
/// logs and keeps (`workers.last_error`), so it is bounded: a gateway's
/// answer is cut to [`MAX_ERROR_BODY`] bytes.
#[derive(Debug, thiserror::Error)]
pub enum PushError {
    /// The gateway answered with a status that is not success.
    #[error("{status}: {body}")]
    Refused { status: StatusCode, body: String },
    /// The gateway holds a later revision of the sandbox than the push
    /// named (`409` on `revision`): the store is behind what the gateway
    /// was pushed (a store restored from a backup). A resync sets the
    /// store's view again.
    #[error("409 Conflict: {body}")]
    Stale { body: String },
    /// No answer (or no usable `admin_url`).
    #[error(transparent)]
    Unanswered(#[from] GatewayError),
    /// The store's row cannot be carried by the contract; never sent.
    #[error("{0}")]
    Unsendable(String),
}

impl PushError {
    /// A refusal, its body (JSON text) cut to [`MAX_ERROR_BODY`] bytes.
    pub fn refused(status: StatusCode, body: &Value) -> Self {
        let field = body.get("field").and_then(Value::as_str);
        if status == StatusCode::CONFLICT && field == Some(egress_api::gateway::REVISION) {
            return Self::Stale {
                body: bounded(&body.to_string(), MAX_ERROR_BODY),
            };
        }
        Self::Refused {
            status,
            body: bounded(&body.to_string(), MAX_ERROR_BODY),
        }
    }
}

/// The most of a gateway's answer an error keeps.
pub const MAX_ERROR_BODY: usize = 512;

/// Longest a gateway may take to answer one request.
const TIMEOUT: Duration = Duration::from_secs(5);

/// One request to the gateway at `admin_url` (`http://host:port`); the
/// status and the JSON body (`Null` when there is none).
pub async fn call(
    admin_url: &str,
    token: &str,
    method: Method,
    path: &str,
    body: Option<&Value>,
) -> Result<(StatusCode, Value), GatewayError> {
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    // Only a read may bring a gateway's whole list back.
    let max_reply = match method {
        Method::GET => MAX_REPLY,
        _ => MAX_ANSWER,
    };
    let req = Outgoing {
        method,
        path,
        content_type: "application/json",
        body,
    };
    exchange(admin_url, token, req, (TIMEOUT, max_reply)).await
}

/// `GET /v1/sandboxes`: the gateway's whole list, about `expected` bytes
/// long by the store's reckoning ([`crate::store::listed_size`]). The cap
/// and the wait scale with it, as a resync's do with its size: a fixed
/// bound would leave a worker whose list outgrew it inconclusive at every
/// drift check, its drift never repaired. The controller already holds
/// what the list is compared with, so reading twice that is in proportion.
pub async fn list(
    admin_url: &str,
    token: &str,
    expected: u64,
) -> Result<(StatusCode, Value), GatewayError> {
    let (wait, max_reply) = list_bounds(expected);
    let req = Outgoing {
        method: Method::GET,
        path: "/v1/sandboxes",
        content_type: "application/json",
        body: String::new(),
    };
    exchange(admin_url, token, req, (wait, max_reply)).await
}

/// The wait and the cap for a list of about `expected` bytes: twice it
/// (at least [`MAX_REPLY`]), and a second more per MiB expected.
fn list_bounds(expected: u64) -> (Duration, usize) {
    let expected = usize::try_from(expected).unwrap_or(usize::MAX);
    let cap = expected.saturating_mul(2).max(MAX_REPLY);
    (TIMEOUT + Duration::from_secs((expected >> 20) as u64), cap)
}

/// A full resync as NDJSON (one sandbox document per line), streamed by the
/// gateway, so it is not bound by the gateway's body cap. The wait scales
/// with the size.
pub async fn resync(
    admin_url: &str,
    token: &str,
    ndjson: String,
) -> Result<(StatusCode, Value), GatewayError> {
    let wait = TIMEOUT + Duration::from_secs(ndjson.len() as u64 >> 20);
    let req = Outgoing {
        method: Method::PUT,
        path: "/v1/sandboxes",
        content_type: "application/x-ndjson",
        body: ndjson,
    };
    exchange(admin_url, token, req, (wait, MAX_ANSWER)).await
}

/// The longest answer read from a gateway (a full list of its sandboxes,
/// at least: see [`list`]).
const MAX_REPLY: usize = 256 << 20;

/// The longest answer to a change or a question (`PUT`, `DELETE`, `POST`):
/// what was applied (a push's answer echoes its document, up to the
/// gateway's body cap, with its id), or why not.
const MAX_ANSWER: usize = egress_api::body::MAX_BODY + (64 << 10);

struct Outgoing<'a> {
    method: Method,
    path: &'a str,
    content_type: &'static str,
    body: String,
}

/// One exchange through the contract crate's client; the JSON answer
/// (text that is not JSON as a string, nothing as `Null`).
async fn exchange(
    admin_url: &str,
    token: &str,
    out: Outgoing<'_>,
    (timeout, max_reply): (Duration, usize),
) -> Result<(StatusCode, Value), GatewayError> {
    let bad_url = |reason: String| GatewayError::AdminUrl {
        url: admin_url.to_owned(),
        reason,
    };
    let uri: http::Uri = admin_url.parse().map_err(|e| bad_url(format!("{e}")))?;
    let authority = uri
        .authority()
        .ok_or_else(|| bad_url("no host".to_owned()))?;
    let to = Target {
        authority: authority.as_str(),
        token: Some(token),
        timeout,
        max_reply,
    };
    let call = Call {
        method: out.method,
        path: out.path,
        body: Some((out.content_type, Bytes::from(out.body))),
    };
    let answer = egress_api::client::exchange(to, call)
        .await
        .map_err(|source| GatewayError::Call {
            url: admin_url.to_owned(),
            source,
        })?;
    let bytes = answer.body;
    let json = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()))
    };
    Ok((answer.status, json))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A gateway stand-in that answers every request with `body`, on loopback.
    async fn answering(body: Vec<u8>) -> std::net::SocketAddr {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr");
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let body = body.clone();
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match s.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    let top = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                        body.len()
                    );
                    let _ = s.write_all(top.as_bytes()).await;
                    let _ = s.write_all(&body).await;
                });
            }
        });
        addr
    }

    /// Only a read may bring a large answer back: the answer to a change is
    /// refused past the body cap and a little more, so 64 pushes at once cannot each hold a list's worth.
    #[tokio::test]
    async fn only_a_read_brings_a_large_answer_back() {
        let big = format!("\"{}\"", "x".repeat(MAX_ANSWER + 1)).into_bytes();
        let url = format!("http://{}", answering(big).await);
        let read = call(&url, "", Method::GET, "/v1/sandboxes", None).await;
        assert!(
            matches!(read, Ok((StatusCode::OK, Value::String(_)))),
            "{read:?}"
        );
        for method in [Method::PUT, Method::DELETE, Method::POST] {
            let answer = call(&url, "", method.clone(), "/v1/sandboxes/sb", None).await;
            assert!(
                matches!(
                    &answer,
                    Err(GatewayError::Call {
                        source: egress_api::client::CallError::TooLarge { .. },
                        ..
                    })
                ),
                "{method}: {}",
                format!("{answer:?}").chars().take(120).collect::<String>()
            );
        }
    }

    /// A list larger than the fixed bounds is still read: before, every
    /// list was cut at 256 MiB and 5 s, and a worker past them was
    /// inconclusive at every drift check.
    #[test]
    fn a_lists_bounds_grow_with_the_size_the_store_expects() {
        assert_eq!(list_bounds(0), (TIMEOUT, MAX_REPLY));
        assert_eq!(
            list_bounds(1 << 20),
            (TIMEOUT + Duration::from_secs(1), MAX_REPLY)
        );
        let big = 300u64 << 20;
        assert_eq!(
            list_bounds(big),
            (TIMEOUT + Duration::from_secs(300), 600 << 20)
        );
        assert_eq!(list_bounds(u64::MAX).1, usize::MAX);
    }

    #[test]
    fn a_refusal_keeps_at_most_the_bound_of_the_body() {
        let huge = Value::String("x".repeat(1 << 20));
        let e = PushError::refused(StatusCode::BAD_REQUEST, &huge);
        let text = e.to_string();
        assert!(
            text.starts_with("400 Bad Request: \"xxx"),
            "{}",
            &text[..40]
        );
        assert!(text.ends_with('…'));
        let prefix = "400 Bad Request: ".len();
        assert_eq!(text.len(), prefix + MAX_ERROR_BODY + '…'.len_utf8());
        let small = PushError::refused(StatusCode::CONFLICT, &serde_json::json!({"error": "no"}));
        assert_eq!(small.to_string(), r#"409 Conflict: {"error":"no"}"#);
    }
}
