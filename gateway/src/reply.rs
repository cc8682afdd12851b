//! The answers the gateway gives itself (400, 403, 421, 502, …): one plain
//! text body, the same whether hyper serves it after termination or the
//! gateway writes it on a connection it never handed to hyper.

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Response, StatusCode};
use http_body_util::{BodyExt, Full};

use crate::pool::Body;

const CONTENT_TYPE: &str = "text/plain; charset=utf-8";

/// A response with `body` as plain text.
pub(crate) fn text(status: StatusCode, body: &str) -> Response<Body> {
    let mut resp = Response::new(
        Full::new(Bytes::from(body.to_owned()))
            .map_err(|never| match never {})
            .boxed(),
    );
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE));
    resp
}

/// The same answer as whole HTTP/1.1 bytes that close the connection.
pub(crate) fn closing(status: StatusCode, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {} {}\r\ncontent-type: {CONTENT_TYPE}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        status.as_u16(),
        status.canonical_reason().unwrap_or(""),
        body.len()
    )
    .into_bytes()
}

/// The header that tells a client a request was refused by policy, not by
/// a failure: `x-egress-denied: <code>; rule=<n>`.
pub(crate) const DENIED_HEADER: &str = "x-egress-denied";

/// Why the gateway refused a request, machine-readable.
#[derive(Clone, Debug)]
pub(crate) struct Denial {
    pub(crate) status: StatusCode,
    /// A bounded reason code (`http_deny`, `tenant_deny`, …).
    pub(crate) code: &'static str,
    /// The index of the deciding entry in its list, when one decided.
    pub(crate) rule: Option<u32>,
    /// The list it is in and its text (`deny[0] domain …`), or the reason.
    pub(crate) detail: String,
}

impl Denial {
    fn header(&self) -> String {
        match self.rule {
            Some(n) => format!("{}; rule={n}", self.code),
            None => self.code.to_owned(),
        }
    }

    fn body(&self) -> String {
        let mut v = serde_json::json!({
            "error": "egress denied",
            "code": self.code,
            "detail": self.detail,
        });
        if let Some(n) = self.rule {
            v["rule"] = serde_json::json!(n);
        }
        let mut body = v.to_string();
        body.push('\n');
        body
    }

    /// The answer hyper serves.
    pub(crate) fn response(&self) -> Response<Body> {
        let mut resp = Response::new(
            Full::new(Bytes::from(self.body()))
                .map_err(|never| match never {})
                .boxed(),
        );
        *resp.status_mut() = self.status;
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Ok(v) = HeaderValue::from_str(&self.header()) {
            h.insert(DENIED_HEADER, v);
        }
        resp
    }

    /// The same answer as whole HTTP/1.1 bytes that close the connection.
    pub(crate) fn closing(&self) -> Vec<u8> {
        let body = self.body();
        format!(
            "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\n{DENIED_HEADER}: {}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            self.status.as_u16(),
            self.status.canonical_reason().unwrap_or(""),
            self.header(),
            body.len()
        )
        .into_bytes()
    }
}
