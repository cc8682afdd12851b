//! The one client of a gateway's admin API: one request over a fresh
//! HTTP/1.1 connection, bounded in time as a whole and in the size of its
//! reply. The controller's pushes and the cluster components' VM calls both
//! go through it.

use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;

/// Why a call got no answer (each names the step; `to` is kept for the
/// caller). A status, even `5xx`, is an answer.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("connect {to}: {message}")]
    Connect { to: String, message: String },
    #[error("{message}")]
    Exchange { to: String, message: String },
    #[error("no answer within {timeout:?}")]
    TimedOut { to: String, timeout: Duration },
    #[error("the reply is larger than {max} bytes")]
    TooLarge { to: String, max: usize },
}

/// One request: its method, path (and query), and body with its type.
#[derive(Debug, Clone)]
pub struct Call<'a> {
    pub method: Method,
    pub path: &'a str,
    /// `(content type, body)`; `None`: no body.
    pub body: Option<(&'static str, Bytes)>,
}

/// Where to send it and the bounds.
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    /// `host:port`.
    pub authority: &'a str,
    /// Sent as `Authorization: Bearer …` when set.
    pub token: Option<&'a str>,
    pub timeout: Duration,
    /// The longest reply read.
    pub max_reply: usize,
}

/// The answer: its status, content type and body.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub content_type: Option<header::HeaderValue>,
    pub body: Bytes,
}

/// Sends `call` to `to` and reads the whole answer, within `to.timeout`.
/// A connection not made in that time is [`CallError::Connect`] (nothing
/// was sent); one made, and no whole answer in it, [`CallError::TimedOut`].
pub async fn exchange(to: Target<'_>, call: Call<'_>) -> Result<Answer, CallError> {
    let deadline = tokio::time::Instant::now() + to.timeout;
    let connecting = tokio::net::TcpStream::connect(to.authority);
    let connected = match tokio::time::timeout_at(deadline, connecting).await {
        Ok(connected) => connected,
        Err(_) => Err(std::io::Error::other(format!(
            "no connection within {:?}",
            to.timeout
        ))),
    };
    let stream = connected.map_err(|e| CallError::Connect {
        to: to.authority.to_owned(),
        message: e.to_string(),
    })?;
    tokio::time::timeout_at(deadline, exchange_on(stream, to, call))
        .await
        .map_err(|_| CallError::TimedOut {
            to: to.authority.to_owned(),
            timeout: to.timeout,
        })?
}

async fn exchange_on(
    stream: tokio::net::TcpStream,
    to: Target<'_>,
    call: Call<'_>,
) -> Result<Answer, CallError> {
    let failed = |message: String| CallError::Exchange {
        to: to.authority.to_owned(),
        message,
    };
    let _ = stream.set_nodelay(true);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| failed(format!("handshake: {e}")))?;
    let conn = tokio::spawn(conn);
    let req = request(to, call).map_err(|e| failed(format!("building the request: {e}")))?;
    let resp = sender
        .send_request(req)
        .await
        .map_err(|e| failed(format!("exchange: {e}")))?;
    let status = resp.status();
    let content_type = resp.headers().get(header::CONTENT_TYPE).cloned();
    let body = match Limited::new(resp.into_body(), to.max_reply).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e)
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            return Err(CallError::TooLarge {
                to: to.authority.to_owned(),
                max: to.max_reply,
            });
        }
        Err(e) => return Err(failed(format!("reading the reply: {e}"))),
    };
    conn.abort();
    Ok(Answer {
        status,
        content_type,
        body,
    })
}

fn request(to: Target<'_>, call: Call<'_>) -> Result<Request<Full<Bytes>>, http::Error> {
    let mut req = Request::builder()
        .method(call.method)
        .uri(call.path)
        .header(header::HOST, to.authority);
    if let Some(t) = to.token.filter(|t| !t.is_empty()) {
        req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let body = match call.body {
        Some((content_type, body)) => {
            req = req.header(header::CONTENT_TYPE, content_type);
            body
        }
        None => Bytes::new(),
    };
    req.body(Full::new(body))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reply::json_reply;
    use hyper::body::Incoming;
    use tokio::net::TcpListener;

    fn target(authority: &str, max_reply: usize) -> Target<'_> {
        Target {
            authority,
            token: Some("t0ken"),
            timeout: Duration::from_secs(10),
            max_reply,
        }
    }

    #[tokio::test]
    async fn sends_the_token_and_body_and_reads_the_answer() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address").to_string();
        let server = tokio::spawn(crate::serve::serve(
            listener,
            "test",
            |req: Request<Incoming>| async move {
                let auth = req.headers()[header::AUTHORIZATION].clone();
                let body = req.into_body().collect().await.expect("body").to_bytes();
                let v = serde_json::json!({"auth": auth.to_str().ok(), "len": body.len()});
                json_reply(StatusCode::CREATED, &v)
            },
        ));
        let call = Call {
            method: Method::PUT,
            path: "/v1/x",
            body: Some(("application/json", Bytes::from_static(b"{}"))),
        };
        let a = exchange(target(&addr, 1024), call.clone())
            .await
            .expect("an answer");
        assert_eq!(a.status, StatusCode::CREATED);
        let v: serde_json::Value = serde_json::from_slice(&a.body).expect("JSON");
        assert_eq!(v, serde_json::json!({"auth": "Bearer t0ken", "len": 2}));
        let small = exchange(target(&addr, 8), call).await;
        assert!(
            matches!(small, Err(CallError::TooLarge { max: 8, .. })),
            "{small:?}"
        );
        server.abort();
    }

    #[tokio::test]
    async fn a_closed_port_is_a_connect_error() {
        let (addr, _held) = egress_testkit::closed_port();
        let addr = addr.to_string();
        let call = Call {
            method: Method::GET,
            path: "/",
            body: None,
        };
        let r = exchange(target(&addr, 8), call).await;
        assert!(matches!(r, Err(CallError::Connect { .. })), "{r:?}");
    }
}
