//! DNS over HTTPS (RFC 8484) as the reserved resolvers' HTTPS side: the
//! reader that turns one HTTP request into the DNS query it carries, and
//! the shape of the answer.
//!
//! Browsers and some libraries upgrade 8.8.8.8 and 1.1.1.1 to DoH on their
//! own (`https://dns.google/dns-query`, `https://cloudflare-dns.com/dns-query`).
//! Those lookups would never reach the DNS proxy, so nothing they resolve
//! would be attributed. The gateway terminates such a flow and hands each
//! request here; the query then takes the proxy's own path
//! ([`crate::DnsProxy::answer`]): the same admission, the same CNAME-chain
//! attribution committed before the answer is returned.
//!
//! The reader is strict, because a request two readers could take two ways
//! is no request: exactly one `dns` parameter of unpadded base64url for
//! `GET`; `content-type: application/dns-message` and a body for `POST`;
//! nothing over a DNS message's 65,535 bytes. Pure: no I/O.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;

/// The path the well-known DoH servers serve (RFC 8484's example, and what
/// Chromium, Firefox and curl use for dns.google and Cloudflare).
pub const DOH_PATH: &str = "/dns-query";

/// The media type of a DoH query and answer.
pub const DNS_MESSAGE: &str = "application/dns-message";

/// The largest DNS message (its TCP length prefix is 16 bits).
pub const MAX_MESSAGE: usize = 65_535;

/// The largest query taken over HTTPS: what the UDP listener takes. A query
/// is one question and an OPT (padded, RFC 8467, to a block of 128), and the
/// proxy sends no more upstream; a bigger body is only memory a sandbox
/// makes the gateway hold while it reads.
pub const MAX_QUERY: usize = 4_096;

/// Why a request carries no query; each maps to the status a DoH server
/// answers with.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DohError {
    #[error("no such path: DNS over HTTPS is served on {DOH_PATH}")]
    NotFound,
    #[error("method {0} is not allowed: use GET or POST")]
    Method(String),
    #[error("content-type must be {DNS_MESSAGE}")]
    MediaType,
    #[error("a DNS query over HTTPS is at most {MAX_QUERY} bytes")]
    TooLarge,
    #[error("bad request: {0}")]
    Bad(&'static str),
}

impl DohError {
    /// The HTTP status for this refusal.
    pub fn status(&self) -> u16 {
        match self {
            Self::NotFound => 404,
            Self::Method(_) => 405,
            Self::MediaType => 415,
            Self::TooLarge => 413,
            Self::Bad(_) => 400,
        }
    }
}

/// The DNS query a DoH request carries. `target` is the request's
/// origin-form target (`/dns-query?dns=…`); `body` is what was read of the
/// body (the caller caps it at [`MAX_QUERY`] + 1 bytes).
pub fn query(
    method: &str,
    target: &str,
    content_type: Option<&[u8]>,
    body: &[u8],
) -> Result<Vec<u8>, DohError> {
    let (path, params) = target.split_once('?').unwrap_or((target, ""));
    if path != DOH_PATH {
        return Err(DohError::NotFound);
    }
    let message = match method {
        "GET" => get_param(params)?,
        "POST" => {
            let dns_message = |c: &[u8]| media_type(c).eq_ignore_ascii_case(DNS_MESSAGE.as_bytes());
            if !content_type.is_some_and(dns_message) {
                return Err(DohError::MediaType);
            }
            if body.len() > MAX_QUERY {
                return Err(DohError::TooLarge);
            }
            body.to_vec()
        }
        other => return Err(DohError::Method(other.to_owned())),
    };
    if message.len() > MAX_QUERY {
        return Err(DohError::TooLarge);
    }
    if message.len() < 12 {
        return Err(DohError::Bad("not a DNS message (shorter than its header)"));
    }
    Ok(message)
}

/// The one `dns` parameter, decoded.
fn get_param(params: &str) -> Result<Vec<u8>, DohError> {
    let mut found = None;
    for pair in params.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        if key != "dns" {
            continue;
        }
        if found.replace(value).is_some() {
            return Err(DohError::Bad("more than one dns parameter"));
        }
    }
    let value = found.ok_or(DohError::Bad("no dns parameter"))?;
    // base64url without padding (RFC 8484 §4.1): its decoded length is
    // bounded by the encoded one, so this is checked before decoding (and
    // the decoded length after).
    if value.len() > MAX_QUERY.div_ceil(3) * 4 {
        return Err(DohError::TooLarge);
    }
    URL_SAFE_NO_PAD
        .decode(value)
        .map_err(|_| DohError::Bad("the dns parameter is not unpadded base64url"))
}

/// A content-type's media type, without parameters or case.
fn media_type(value: &[u8]) -> &[u8] {
    let end = value.iter().position(|&b| b == b';').unwrap_or(value.len());
    value[..end].trim_ascii()
}

/// The `cache-control` max-age for an answer: its smallest TTL (RFC 8484
/// §5.1), no longer than `most` (what an attribution lasts at most,
/// `dns.max_ttl`: a client caching longer would reach the address with the
/// evidence gone), or none for an answer without records.
pub fn max_age(answer: &[u8], most: u32) -> Option<u32> {
    let message = hickory_proto::op::Message::from_vec(answer).ok()?;
    message
        .answers
        .iter()
        .chain(&message.authorities)
        .map(|r| crate::chain::ttl_of(r.ttl).min(most))
        .min()
}

#[cfg(test)]
mod tests;
