//! The one name an HTTP request is for.
//!
//! A request can name its host several times: the HTTP/2 `:authority`, an
//! absolute-form (or authority-form) request target, and `Host` headers. The
//! gateway judges one name and the origin routes by another if they differ,
//! so every claim is collected and they must all agree: evidence that two
//! parsers could read two ways is no evidence. One `Host` header at most
//! (RFC 9112 §3.2); each claim a valid authority (no user info, a hostname
//! or an IP literal); names compared in normal form (lower-cased, port and
//! one trailing dot dropped). The peek and the per-request check both judge
//! through [`judge`], so they cannot read a request differently.

use std::net::IpAddr;

use egress_policy::Hostname;

/// What a request's authority names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    Name(Hostname),
    Ip(IpAddr),
}

/// The authority the gateway judged, and forwards as the request's only
/// `Host` (HTTP/1.1) or `:authority` (HTTP/2).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Authority {
    pub target: Target,
    /// The port, if the client gave one.
    pub port: Option<u16>,
}

/// Why a request's authority claims are refused: the request gets `400`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AuthorityError {
    #[error("more than one Host header")]
    SeveralHosts,
    #[error("the request has no Host header and no :authority")]
    Missing,
    #[error("invalid authority {raw:?}: {why}")]
    Invalid { raw: String, why: String },
    #[error("the request names two hosts: {0:?} and {1:?}")]
    Disagree(String, String),
}

impl Authority {
    /// The name, if the authority is not an IP literal.
    pub fn name(&self) -> Option<&Hostname> {
        match &self.target {
            Target::Name(h) => Some(h),
            Target::Ip(_) => None,
        }
    }

    /// An authority for a bare address (HTTP/1.0 without `Host`).
    pub fn of_ip(ip: IpAddr) -> Self {
        Self {
            target: Target::Ip(ip),
            port: None,
        }
    }

    /// The authority in normal form, with the port if the client gave one
    /// (`API.Example.Test.:8443` → `api.example.test:8443`): what the gateway
    /// judged is, byte for byte, what the origin receives.
    pub fn value(&self) -> String {
        let host = match &self.target {
            Target::Name(h) => h.to_string(),
            Target::Ip(IpAddr::V4(v4)) => v4.to_string(),
            Target::Ip(IpAddr::V6(v6)) => format!("[{v6}]"),
        };
        match self.port {
            Some(p) => format!("{host}:{p}"),
            None => host,
        }
    }
}

/// Judges a request's claims: `target` is the request target's authority
/// (HTTP/2 `:authority`, HTTP/1.1 absolute- or authority-form), `hosts` the
/// values of its `Host` headers. `Ok(None)`: the request names no host.
pub fn judge<'a>(
    target: Option<&str>,
    mut hosts: impl Iterator<Item = &'a [u8]>,
) -> Result<Option<Authority>, AuthorityError> {
    let host = hosts.next();
    if hosts.next().is_some() {
        return Err(AuthorityError::SeveralHosts);
    }
    let host = match host {
        None => None,
        Some(bytes) => {
            Some(parse(std::str::from_utf8(bytes).map_err(|_| {
                invalid(&String::from_utf8_lossy(bytes), "not ASCII")
            })?)?)
        }
    };
    let target = target.map(parse).transpose()?;
    match (target, host) {
        (Some(t), Some(h)) if t.target != h.target => {
            Err(AuthorityError::Disagree(t.value(), h.value()))
        }
        (Some(t), _) => Ok(Some(t)),
        (None, h) => Ok(h),
    }
}

/// Reads a server name the way the peek does (see [`egress_policy::server_name`]).
pub use egress_policy::server_name;

/// Judges the authority of a request target as written on the request line
/// (`/path`, `*`, `http://host/path`, or `host:port`).
pub fn of_request_target(target: &str) -> Result<Option<String>, AuthorityError> {
    if target.starts_with('/') || target == "*" {
        return Ok(None);
    }
    let uri: http::Uri = target
        .parse()
        .map_err(|e| invalid(target, &format!("{e}")))?;
    Ok(uri.authority().map(|a| a.as_str().to_owned()))
}

/// What an invalid authority is shown as: `raw` cut to its first 256
/// characters (it is the sandbox's, up to a whole request head, and goes
/// into the flow log), without what may carry a secret: user info before
/// an `@`, a query, a fragment.
fn invalid(raw: &str, why: &str) -> AuthorityError {
    AuthorityError::Invalid {
        raw: shown(raw).chars().take(256).collect(),
        why: why.to_owned(),
    }
}

/// `raw` with everything between its scheme and its last `@` written `…`
/// (user info, however it is spelled), then cut at a `?` or `#`.
fn shown(raw: &str) -> String {
    let start = raw.find("://").map_or(0, |at| at + 3);
    let raw = match raw[start..].rfind('@') {
        Some(at) => format!("{}…{}", &raw[..start], &raw[start + at..]),
        None => raw.to_owned(),
    };
    raw.split(['?', '#']).next().unwrap_or_default().to_owned()
}

fn parse(raw: &str) -> Result<Authority, AuthorityError> {
    let invalid = |why: &str| invalid(raw, why);
    if raw.contains('@') {
        return Err(invalid("user info in an authority"));
    }
    let (target, port) = match raw.strip_prefix('[') {
        Some(rest) => {
            let (v6, port) = rest
                .split_once(']')
                .ok_or_else(|| invalid("bad IPv6 literal"))?;
            let ip = v6.parse().map_err(|_| invalid("bad IPv6 literal"))?;
            (Target::Ip(IpAddr::V6(ip)), port)
        }
        None => {
            let (host, port) = raw.rfind(':').map_or((raw, ""), |i| raw.split_at(i));
            // Only digits and dots can spell an IPv4 address.
            let dotted = host.bytes().all(|b| b.is_ascii_digit() || b == b'.');
            let v4 = dotted
                .then(|| host.parse::<std::net::Ipv4Addr>().ok())
                .flatten();
            let target = match v4 {
                Some(v4) => Target::Ip(IpAddr::V4(v4)),
                None => Target::Name(Hostname::parse(host).map_err(|e| invalid(&e.to_string()))?),
            };
            (target, port)
        }
    };
    let port = match port {
        "" => None,
        p => Some(
            p.strip_prefix(':')
                .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|d| d.parse::<u16>().ok())
                .ok_or_else(|| invalid("bad port"))?,
        ),
    };
    Ok(Authority { target, port })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(target: Option<&str>, hosts: &[&str]) -> Result<Option<Authority>, AuthorityError> {
        judge(target, hosts.iter().map(|h| h.as_bytes()))
    }

    fn name(s: &str) -> Target {
        Target::Name(Hostname::parse(s).expect("name"))
    }

    #[test]
    fn an_invalid_authority_is_shown_without_its_secrets() {
        fn shown<T: std::fmt::Debug>(r: Result<T, AuthorityError>) -> String {
            r.expect_err("refused").to_string()
        }
        let e = shown(one(None, &["user:s3cret@api.test"]));
        assert!(!e.contains("s3cret") && e.contains("…@api.test"), "{e}");
        let e = shown(of_request_target(
            "http://u:s3cret@api\"test/p?token=s3cret",
        ));
        assert!(
            !e.contains("s3cret") && e.contains(r#"http://…@api\"test/p"#),
            "{e}"
        );
        let e = shown(one(Some("a b?token=s3cret"), &[]));
        assert!(!e.contains("s3cret"), "{e}");
        assert_eq!(shown_raw("http://h/p@x?q"), "http://…@x");
        assert_eq!(shown_raw("a@b@c:1"), "…@c:1");
        assert_eq!(shown_raw("user:pa/ss@api.test"), "…@api.test");
        assert_eq!(shown_raw("u:s3?cret@api.test"), "…@api.test");
        assert_eq!(shown_raw("api.test/p?token=x"), "api.test/p");
    }

    fn shown_raw(raw: &str) -> String {
        super::shown(raw)
    }

    #[test]
    fn agreeing_claims_give_one_name() {
        let a = one(None, &["Api.Example.Test.:8443"])
            .expect("ok")
            .expect("some");
        assert_eq!(
            (a.value().as_str(), a.target),
            ("api.example.test:8443", name("api.example.test"))
        );
        let a = one(Some("api.example.test"), &["API.example.test.:443"])
            .expect("ok")
            .expect("some");
        assert_eq!(
            (a.value().as_str(), a.target),
            ("api.example.test", name("api.example.test"))
        );
        let a = one(Some("[2001:DB8::1]:443"), &[])
            .expect("ok")
            .expect("some");
        assert_eq!(a.target, Target::Ip("2001:db8::1".parse().expect("ip")));
        assert_eq!(a.value(), "[2001:db8::1]:443");
        assert_eq!(a.name(), None);
        assert_eq!(one(None, &[]), Ok(None));
    }

    #[test]
    fn two_hosts_or_two_names_are_refused() {
        assert_eq!(
            one(None, &["a.test", "a.test"]),
            Err(AuthorityError::SeveralHosts)
        );
        assert_eq!(
            one(None, &["a.test", "b.test"]),
            Err(AuthorityError::SeveralHosts)
        );
        assert_eq!(
            one(Some("allowed.test"), &["denied.test"]),
            Err(AuthorityError::Disagree(
                "allowed.test".into(),
                "denied.test".into()
            ))
        );
        assert!(matches!(
            one(Some("198.51.100.1"), &["a.test"]),
            Err(AuthorityError::Disagree(..))
        ));
    }

    #[test]
    fn claims_that_are_not_authorities_are_refused() {
        for bad in [
            "",
            "user@a.test",
            "a.test/x",
            "a test",
            "a.test:port",
            "a_b.test",
            "[2001:db8::1",
            "[not-v6]",
            "a.test\0.evil.test",
            "ex\u{e4}mple.test",
        ] {
            assert!(
                matches!(one(None, &[bad]), Err(AuthorityError::Invalid { .. })),
                "{bad:?}"
            );
            assert!(
                matches!(one(Some(bad), &[]), Err(AuthorityError::Invalid { .. })),
                "target {bad:?}"
            );
        }
        assert!(matches!(
            judge(None, [&b"a.test\xff"[..]].into_iter()),
            Err(AuthorityError::Invalid { .. })
        ));
    }

    #[test]
    fn request_targets() {
        assert_eq!(of_request_target("/x?y"), Ok(None));
        assert_eq!(of_request_target("*"), Ok(None));
        assert_eq!(
            of_request_target("http://evil.test:8080/x"),
            Ok(Some("evil.test:8080".into()))
        );
        assert_eq!(
            of_request_target("evil.test:443"),
            Ok(Some("evil.test:443".into()))
        );
        assert!(of_request_target("http://a b/").is_err());
    }
}
