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
