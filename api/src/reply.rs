//! What every route answers, and the helpers that build it.

use bytes::Bytes;
use http::{header, Response, StatusCode};
use http_body_util::Full;
use serde_json::json;

/// A complete reply: the routes of this project never stream an answer.
pub type Reply = Response<Full<Bytes>>;

/// `v` as the body, one line, `application/json`, never stored by a cache
/// (the answers are a tenant's policies and sandboxes) nor read as another
/// type.
pub fn json_reply<T: serde::Serialize + ?Sized>(status: StatusCode, v: &T) -> Reply {
    // Escaped where a terminal would act: an answer may carry a sandbox's
    // request path, and is read with curl.
    let mut body = match crate::text::json_vec(v) {
        Ok(body) => body,
        // Never a success with an empty body.
        Err(e) => {
            return text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("the answer could not be written: {e}\n"),
            )
        }
    };
    body.push(b'\n');
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    let headers = r.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    headers.insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-store"),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        header::HeaderValue::from_static("nosniff"),
    );
    r
}

/// `{"error": message}`, with `"field"` when one field is to blame.
pub fn error(status: StatusCode, message: &str, field: Option<&str>) -> Reply {
    let mut v = json!({ "error": message });
    if let Some(f) = field {
        v["field"] = json!(f);
    }
    json_reply(status, &v)
}

/// A plain-text reply.
pub fn text(status: StatusCode, body: impl Into<Bytes>) -> Reply {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r
}

/// The Prometheus scrape, in the OpenMetrics text format.
pub fn openmetrics(body: String) -> Reply {
    let mut r = text(StatusCode::OK, body);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        ),
    );
    r
}

/// `413` for a body over `max` bytes.
pub fn too_large(max: usize) -> Reply {
    error(
        StatusCode::PAYLOAD_TOO_LARGE,
        &format!("body larger than {max} bytes"),
        None,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    async fn body_of(r: Reply) -> String {
        let bytes = r.into_body().collect().await.expect("full body").to_bytes();
        String::from_utf8(bytes.to_vec()).expect("UTF-8")
    }

    /// A JSON answer carrying a sandbox's path (a proposal's example, say)
    /// holds what a terminal acts on as escapes, read back the same.
    #[tokio::test]
    async fn json_answers_escape_what_a_terminal_acts_on() {
        let path = "/v1/\u{9b}2J";
        let body = body_of(json_reply(
            StatusCode::OK,
            &serde_json::json!({ "path": path }),
        ))
        .await;
        assert_eq!(body, "{\"path\":\"/v1/\\u009b2J\"}\n");
    }

    #[tokio::test]
    async fn errors_name_the_field_only_when_one_is_to_blame() {
        let r = error(StatusCode::BAD_REQUEST, "bad", Some("policy.allow[1]"));
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        assert_eq!(
            r.headers()[header::CONTENT_TYPE],
            "application/json",
            "JSON errors say so"
        );
        assert_eq!(r.headers()[header::CACHE_CONTROL], "no-store");
        assert_eq!(r.headers()[header::X_CONTENT_TYPE_OPTIONS], "nosniff");
        assert_eq!(
            body_of(r).await,
            "{\"error\":\"bad\",\"field\":\"policy.allow[1]\"}\n"
        );
        let r = too_large(10);
        assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(
            body_of(r).await,
            "{\"error\":\"body larger than 10 bytes\"}\n"
        );
    }

    /// An answer that cannot be written as JSON is a server error, never
    /// a success with an empty body.
    #[tokio::test]
    async fn an_answer_that_cannot_be_written_is_a_server_error() {
        // JSON object keys must be strings.
        let unwritable: std::collections::BTreeMap<(u8, u8), u8> = [((1, 2), 3)].into();
        let r = json_reply(StatusCode::OK, &unwritable);
        assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert!(body_of(r)
            .await
            .starts_with("the answer could not be written: "));
    }
}
