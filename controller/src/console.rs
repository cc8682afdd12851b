//! The operator console (docs/console.md): one HTML page, one script and
//! one stylesheet, embedded in the binary and served under `/console/`
//! with a strict Content-Security-Policy. The assets carry no data: the
//! script reads everything through the JSON API with the bearer token the
//! operator typed (kept in the tab's `sessionStorage`, sent in the
//! `Authorization` header, never a cookie), so the console has no access
//! the API would not give the same token, and a forged cross-site request
//! carries no credentials.

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Response, StatusCode};
use http_body_util::Full;

const INDEX: &str = include_str!("console/index.html");
const SCRIPT: &str = include_str!("console/app.js");
const STYLE: &str = include_str!("console/app.css");
/// The reason codes the denials link to, served as they are in the repository.
const REASON_CODES: &str = include_str!("../../docs/reason-codes.md");

/// Scripts, styles and fetches from this origin only; no inline script or
/// style, no frames, no plugins, no form posts.
pub const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self'; \
     img-src 'self'; connect-src 'self'; object-src 'none'; base-uri 'none'; \
     form-action 'none'; frame-ancestors 'none'";

/// The asset a `GET /console/…` names (`segments` of the path), or `404`.
pub fn asset(segments: &[&str]) -> Response<Full<Bytes>> {
    let found = match segments {
        ["console"] | ["console", "index.html"] => Some((INDEX, "text/html; charset=utf-8")),
        ["console", "app.js"] => Some((SCRIPT, "text/javascript; charset=utf-8")),
        ["console", "app.css"] => Some((STYLE, "text/css; charset=utf-8")),
        ["console", "reason-codes.md"] => Some((REASON_CODES, "text/plain; charset=utf-8")),
        _ => None,
    };
    let (body, kind) = found.unwrap_or(("no such console asset\n", "text/plain; charset=utf-8"));
    let mut r = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    if found.is_none() {
        *r.status_mut() = StatusCode::NOT_FOUND;
    }
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}
