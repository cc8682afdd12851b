//! JSON replies shared by the webhook and the relay.

use bytes::Bytes;
use http::{header, Response, StatusCode};
use http_body_util::Full;
use serde_json::{json, Value};

pub(crate) type Reply = Response<Full<Bytes>>;

/// `v` as the body, one line, `application/json`.
pub(crate) fn json_reply(status: StatusCode, v: &Value) -> Reply {
    let mut body = serde_json::to_vec(v).unwrap_or_default();
    body.push(b'\n');
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    r
}

/// `{"error": message}`.
pub(crate) fn error(status: StatusCode, message: &str) -> Reply {
    json_reply(status, &json!({ "error": message }))
}

/// `413` for a body over `max` bytes.
pub(crate) fn too_large(max: usize) -> Reply {
    error(
        StatusCode::PAYLOAD_TOO_LARGE,
        &format!("body larger than {max} bytes"),
    )
}
