//! A request head after termination: one request target (HTTP/2
//! `:authority`, absolute-form, authority-form, origin-form, `*`, or raw),
//! zero to three `Host` values and an optional SNI, judged by
//! `authority::of_request_target` and `authority::judge`.
//!
//! Properties:
//!
//! - two or more `Host` values are always refused, whatever they say;
//! - one reading only: when `judge` gives `Ok(Some(a))`, every claim given,
//!   judged alone, names the same target as `a`; `a`'s own value judges to
//!   `a`; and where the `http` crate (what hyper reads an authority with)
//!   parses a claim, its host, lower-cased and without one trailing dot, is
//!   `a`'s host;
//! - the SNI and the judged name are the same `Hostname` exactly when they
//!   are the same name up to ASCII case and one trailing dot;
//! - the peek (`classify_bytes`) on an HTTP/1.x head built from the same
//!   parts refuses it exactly when the judgement does, with the same
//!   error, and otherwise reports the judged name.
#![no_main]

use arbitrary::Arbitrary;
use egress_gateway::authority::{judge, of_request_target, server_name, AuthorityError, Target};
use egress_gateway::peek::{classify_bytes, Classified, PeekError};
use libfuzzer_sys::fuzz_target;

/// Claims a client might send, valid or not, with the odd forms parsers
/// read differently.
const POOL: &[&str] = &[
    "api.example.test",
    "API.Example.Test.",
    "api.example.test:8443",
    "api.example.test.:443",
    "evil.test",
    "[2001:db8::1]",
    "[2001:DB8::1]:443",
    "[::ffff:198.51.100.1]",
    "198.51.100.1",
    "198.51.100.1:80",
    "127.1",
    "0x7f.0.0.1",
    "user@api.example.test",
    "api.example.test@evil.test",
    "api.example.test\0.evil.test",
    "api.example.test:",
    "api.example.test:65536",
    "xn--bcher-kva.example.test",
    "a..test",
    "",
];

#[derive(Arbitrary, Debug)]
enum Claim {
    Pool(u8),
    /// A pool entry changed: case, a trailing dot, a port.
    Varied {
        base: u8,
        upper: bool,
        dot: bool,
        port: Option<u16>,
    },
    Text(String),
}

#[derive(Arbitrary, Debug)]
enum RequestTarget {
    Origin(String),
    Star,
    Absolute {
        https: bool,
        authority: Claim,
        path: String,
    },
    AuthorityForm(Claim),
    Raw(String),
    /// HTTP/2 `:authority`: no request line.
    H2(Claim),
}

#[derive(Arbitrary, Debug)]
struct Input {
    target: RequestTarget,
    hosts: Vec<Claim>,
    sni: Option<Claim>,
    http10: bool,
}

fn text(c: &Claim) -> String {
    let pool = |i: u8| POOL[usize::from(i) % POOL.len()];
    match c {
        Claim::Pool(i) => pool(*i).to_owned(),
        Claim::Varied {
            base,
            upper,
            dot,
            port,
        } => {
            let mut s = pool(*base).to_owned();
            if *upper {
                s = s.to_ascii_uppercase();
            }
            if *dot {
                s.push('.');
            }
            if let Some(p) = port {
                s.push_str(&format!(":{p}"));
            }
            s
        }
        Claim::Text(s) => s.clone(),
    }
}

/// The host part of a claim as a comparison would read it: lower-cased,
/// brackets and one trailing dot dropped.
fn host_of(authority: &http::uri::Authority) -> String {
    let host = authority.host();
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase()
}

fn same_target(t: &Target, host: &str) -> bool {
    match t {
        Target::Name(h) => h.as_str() == host,
        Target::Ip(ip) => host.parse::<std::net::IpAddr>().ok() == Some(*ip),
    }
}

fuzz_target!(|input: Input| {
    let hosts: Vec<String> = input.hosts.iter().take(3).map(text).collect();
    let host_bytes = || hosts.iter().map(|h| h.as_bytes());
    let (line_target, claimed) = match &input.target {
        RequestTarget::H2(c) => (None, Ok(Some(text(c)))),
        other => {
            let t = match other {
                RequestTarget::Origin(p) => format!("/{p}"),
                RequestTarget::Star => "*".to_owned(),
                RequestTarget::Absolute {
                    https,
                    authority,
                    path,
                } => {
                    let scheme = if *https { "https" } else { "http" };
                    format!("{scheme}://{}/{path}", text(authority))
                }
                RequestTarget::AuthorityForm(c) => text(c),
                RequestTarget::Raw(s) => s.clone(),
                RequestTarget::H2(_) => unreachable!("matched above"),
            };
            let claimed = of_request_target(&t);
            (Some(t), claimed)
        }
    };

    // Two Host headers are refused, whatever they say and whatever the target.
    let target_claim = claimed.clone().ok().flatten();
    if hosts.len() >= 2 {
        assert_eq!(
            judge(target_claim.as_deref(), host_bytes()),
            Err(AuthorityError::SeveralHosts)
        );
    }

    let judged = claimed
        .clone()
        .and_then(|t| judge(t.as_deref(), host_bytes()));
    if let Ok(Some(a)) = &judged {
        let value = a.value();
        assert_eq!(
            judge(Some(&value), std::iter::empty()).as_ref(),
            Ok(&Some(a.clone()))
        );
        assert_eq!(
            judge(None, std::iter::once(value.as_bytes())).as_ref(),
            Ok(&Some(a.clone()))
        );
        let claims = target_claim.iter().chain(hosts.iter());
        for c in claims {
            let alone = judge(Some(c), std::iter::empty())
                .unwrap_or_else(|e| panic!("claim {c:?} alone is refused ({e}) but judged {value}"))
                .unwrap_or_else(|| panic!("claim {c:?} alone names nothing"));
            assert_eq!(alone.target, a.target, "claim {c:?} alone vs {value}");
            if let Ok(parsed) = c.parse::<http::uri::Authority>() {
                let host = host_of(&parsed);
                assert!(
                    same_target(&a.target, &host),
                    "the http crate reads claim {c:?} as host {host:?}, the gateway as {value}"
                );
            }
        }
        if let Some(sni) = input.sni.as_ref().map(text) {
            if let (Ok(Some(s)), Some(name)) = (server_name(&sni), a.name()) {
                let raw = sni.strip_suffix('.').unwrap_or(&sni);
                assert_eq!(
                    &s == name,
                    raw.eq_ignore_ascii_case(name.as_str()),
                    "SNI {sni:?} vs {value}"
                );
            }
        }
    }

    // The peek on the same parts as an HTTP/1.x head.
    let Some(line_target) = line_target else {
        return;
    };
    let minor = if input.http10 { 0 } else { 1 };
    let mut head = format!("GET {line_target} HTTP/1.{minor}\r\n");
    for h in &hosts {
        head.push_str(&format!("Host: {h}\r\n"));
    }
    head.push_str("\r\n");
    let peeked = classify_bytes(head.as_bytes());
    // Only where httparse reads back exactly these parts do they compare.
    let mut headers = [httparse::EMPTY_HEADER; 8];
    let mut req = httparse::Request::new(&mut headers);
    let Ok(httparse::Status::Complete(_)) = req.parse(head.as_bytes()) else {
        return;
    };
    let read_hosts: Vec<&[u8]> = req.headers.iter().map(|h| h.value).collect();
    if req.path != Some(line_target.as_str()) || read_hosts != host_bytes().collect::<Vec<_>>() {
        return;
    }
    let expected = judged.and_then(|a| match a {
        None if minor == 1 => Err(AuthorityError::Missing),
        a => Ok(a),
    });
    match (&expected, &peeked) {
        (Err(e), Err(PeekError::MalformedRequest(p))) => assert_eq!(e, p),
        (Ok(a), Ok(Some(Classified::Http { host }))) => {
            assert_eq!(host.as_ref(), a.as_ref().and_then(|a| a.name()), "{head:?}")
        }
        _ => panic!("judge says {expected:?}, the peek {peeked:?} for {head:?}"),
    }
});
