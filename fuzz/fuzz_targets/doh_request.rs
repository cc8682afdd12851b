//! The DoH request reader (`dns_attrib::doh::query`), as the gateway calls
//! it for a request on a flow to a reserved resolver.
//!
//! Input: `[method][ct][split_hi][split_lo][rest…]`; the method byte picks
//! (mod 4) GET, POST, PUT, DELETE; the `ct` byte (mod 3) no content-type,
//! `application/dns-message`, or the rest's first line; the split cuts the
//! rest into the request target (lossy UTF-8) and the body.
//!
//! Properties: reading is deterministic; an accepted query is a whole DNS
//! header at least and at most a DNS message; a query read from a GET reads
//! back the same from the canonical GET (its unpadded base64url) and from a
//! POST; a refusal's status is one a DoH server gives.
#![no_main]

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use dns_attrib::doh::{query, DNS_MESSAGE, MAX_QUERY};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let [m, ct, hi, lo, rest @ ..] = input else {
        return;
    };
    let method = ["GET", "POST", "PUT", "DELETE"][usize::from(*m) % 4];
    let split = (usize::from(*hi) << 8 | usize::from(*lo)).min(rest.len());
    let (target, body) = rest.split_at(split);
    let target = String::from_utf8_lossy(target);
    let content_type: Option<&[u8]> = match ct % 3 {
        0 => None,
        1 => Some(DNS_MESSAGE.as_bytes()),
        _ => Some(body.split(|&b| b == b'\n').next().unwrap_or(b"")),
    };
    let first = query(method, &target, content_type, body);
    assert_eq!(
        first,
        query(method, &target, content_type, body),
        "not deterministic"
    );
    match &first {
        Ok(q) => {
            assert!(q.len() >= 12 && q.len() <= MAX_QUERY, "{} bytes", q.len());
            let canonical = format!("/dns-query?dns={}", URL_SAFE_NO_PAD.encode(q));
            assert_eq!(query("GET", &canonical, None, b"").as_ref(), Ok(q));
            let posted = query("POST", "/dns-query", Some(DNS_MESSAGE.as_bytes()), q);
            assert_eq!(posted.as_ref(), Ok(q));
        }
        Err(e) => assert!([400, 404, 405, 413, 415].contains(&e.status()), "{e}"),
    }
});
