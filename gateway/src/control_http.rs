//! The control listener's HTTP pieces, shared by its two routers — the
//! sandbox routes (`admin.rs`) and the machine egress routes
//! (`machine/api.rs`) — so that neither borrows from the other: the reply
//! type, JSON replies and errors, and the capped body reader.

use bytes::Bytes;
use http::{header, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use serde_json::{json, Value};

/// What every control route answers.
pub(crate) type Reply = Response<Full<Bytes>>;

/// Largest request body accepted (a streamed NDJSON resync caps each line).
pub(crate) const MAX_BODY: usize = 1 << 20;

/// Reads a body of at most 1 MiB of UTF-8 (`413` beyond, `400` otherwise).
pub(crate) async fn body_text(req: Request<Incoming>) -> Result<String, Reply> {
    let bytes = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e)
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            return Err(error(
                StatusCode::PAYLOAD_TOO_LARGE,
                &format!("body larger than {MAX_BODY} bytes"),
                None,
            ));
        }
        Err(e) => {
            return Err(error(
                StatusCode::BAD_REQUEST,
                &format!("reading the body: {e}"),
                None,
            ))
        }
    };
    String::from_utf8(bytes.to_vec())
        .map_err(|_| error(StatusCode::BAD_REQUEST, "body is not UTF-8", None))
}

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

pub(crate) fn error(status: StatusCode, message: &str, field: Option<&str>) -> Reply {
    let mut v = json!({ "error": message });
    if let Some(f) = field {
        v["field"] = json!(f);
    }
    json_reply(status, &v)
}
