//! Helpers the unit tests of several modules share.

use http::header::{HeaderMap, HeaderName, HeaderValue};

/// A header map with `pairs` appended in order (a name may repeat).
pub(crate) fn header_map(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut m = HeaderMap::new();
    for (n, v) in pairs {
        m.append(
            HeaderName::from_bytes(n.as_bytes()).expect("a header name"),
            HeaderValue::from_str(v).expect("a header value"),
        );
    }
    m
}
