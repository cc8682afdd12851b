//! Host-bound credentials (`egress_gateway::credentials::apply`): a secret
//! reaches only the hosts it is for.
//!
//! Setup, once: three credentials whose values are read from the gateway's
//! environment (`EGRESS_CREDENTIAL_A`, `_B`): `alpha`, required, injected
//! into `authorization` for `api.x.test`; `bravo`, replaced in every header
//! for `*.x.test`; `charlie`, injected into `x-api-key` for `other.test`
//! and `api.x.test`, with alpha's value. The values share no character with
//! each other or with a placeholder, so none can be spelled by the others.
//!
//! Input (`arbitrary`): the names (one verified among `api.x.test`,
//! `b.x.test`, `other.test`, `x.test`, or any of them unverified), a target
//! and headers (names from a pool or raw bytes; values from text, raw
//! bytes and placeholders, some characters percent-escaped once or twice),
//! and `max_head`.
//!
//! Properties (the module doc and `apply`'s):
//!
//! - a refused request's headers are unchanged, byte for byte;
//! - unverified names get no value: the headers are unchanged;
//! - for a verified name, a value shows up in a header (more often than the
//!   sandbox wrote it itself) only if one of its credentials' hosts names it;
//! - a request that passes carried no placeholder of a credential not for
//!   its name, in the target or a header, raw or percent-decoded up to
//!   three times;
//! - when values went in, the head (each header `name: value` and its line
//!   end) is at most `max_head`.
#![no_main]

use std::sync::OnceLock;

use arbitrary::Arbitrary;
use egress_gateway::credentials::{apply, Credential, CredentialSources, Names, Secrets};
use egress_policy::Hostname;
use http::{HeaderMap, HeaderName, HeaderValue};
use libfuzzer_sys::fuzz_target;

const SECRET_A: &str = "fake-ace-bad-jam";
const SECRET_B: &str = "nop.qrs.tuv.wxyz";
const CREDENTIALS: &str = r#"[
  {"name": "alpha", "placeholder": "EGRESS_PH_ALPHA", "hosts": ["api.x.test"],
   "inject": {"header": "authorization", "format": "Bearer {value}"},
   "source": {"env": "EGRESS_CREDENTIAL_A"}, "require": true},
  {"name": "bravo", "placeholder": "EGRESS_PH_BRAVO", "hosts": ["*.x.test"],
   "inject": {"replace": "headers"}, "source": {"env": "EGRESS_CREDENTIAL_B"}},
  {"name": "charlie", "placeholder": "EGRESS_PH_CHARLIE", "hosts": ["other.test", "api.x.test"],
   "inject": {"header": "x-api-key", "format": "{value}"},
   "source": {"env": "EGRESS_CREDENTIAL_A"}, "require": false}]"#;
/// Each credential's placeholder, value and hosts, as the model reads them.
const MODEL: &[(&str, &str, &[&str])] = &[
    ("EGRESS_PH_ALPHA", SECRET_A, &["api.x.test"]),
    ("EGRESS_PH_BRAVO", SECRET_B, &["*.x.test"]),
    ("EGRESS_PH_CHARLIE", SECRET_A, &["other.test", "api.x.test"]),
];
const NAMES: &[&str] = &["api.x.test", "b.x.test", "other.test", "x.test"];
const HEADERS: &[&str] = &["authorization", "x-api-key", "cookie", "x-note", "Accept"];
const TEXT: &[&str] = &["Bearer ", "key=", " ", ",", "%", "%25", "5F", "/", "?k="];

#[derive(Arbitrary, Debug)]
enum Piece {
    Text(u8),
    Raw(Vec<u8>),
    /// A placeholder; bit i of `escape` escapes its i-th character
    /// (as `%25XX` when `twice`), in lower-case hex when `lower`.
    Placeholder {
        which: u8,
        escape: u32,
        twice: bool,
        lower: bool,
    },
}

#[derive(Arbitrary, Debug)]
enum Name {
    Pool(u8),
    Raw(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
enum Who {
    Verified(u8),
    /// Bit i: `NAMES[i]`.
    Unverified(u8),
}

#[derive(Arbitrary, Debug)]
struct Input {
    who: Who,
    target: Vec<Piece>,
    headers: Vec<(Name, Vec<Piece>)>,
    max_head: u16,
}

/// The credentials, their values, and the hosts of `NAMES`.
fn setup() -> &'static (Vec<Credential>, Secrets, Vec<Hostname>) {
    static S: OnceLock<(Vec<Credential>, Secrets, Vec<Hostname>)> = OnceLock::new();
    S.get_or_init(|| {
        std::env::set_var("EGRESS_CREDENTIAL_A", SECRET_A);
        std::env::set_var("EGRESS_CREDENTIAL_B", SECRET_B);
        let list: Vec<Credential> = serde_json::from_str(CREDENTIALS).expect("credentials");
        egress_gateway::credentials::validate(&list).expect("valid credentials");
        let secrets = Secrets::new(CredentialSources {
            files_under: Vec::new(),
            env_prefix: "EGRESS_CREDENTIAL_".into(),
        });
        secrets.load(&list).expect("values in the environment");
        let hosts = NAMES.iter().map(|n| Hostname::parse(n).expect(n)).collect();
        (list, secrets, hosts)
    })
}

fn bytes(pieces: &[Piece]) -> Vec<u8> {
    let mut out = Vec::new();
    for p in pieces.iter().take(8) {
        match p {
            Piece::Text(i) => out.extend_from_slice(TEXT[usize::from(*i) % TEXT.len()].as_bytes()),
            Piece::Raw(b) => out.extend_from_slice(b),
            Piece::Placeholder {
                which,
                escape,
                twice,
                lower,
            } => {
                let ph = MODEL[usize::from(*which) % MODEL.len()].0;
                for (i, c) in ph.bytes().enumerate() {
                    let pct = format!("{}{c:02X}", if *twice { "%25" } else { "%" });
                    let pct = if *lower { pct.to_lowercase() } else { pct };
                    match escape >> (i % 32) & 1 {
                        0 => out.push(c),
                        _ => out.extend_from_slice(pct.as_bytes()),
                    }
                }
            }
        }
    }
    out
}

fn header_map(headers: &[(Name, Vec<Piece>)]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, value) in headers.iter().take(8) {
        let name = match name {
            Name::Pool(i) => {
                HeaderName::from_bytes(HEADERS[usize::from(*i) % HEADERS.len()].as_bytes())
            }
            Name::Raw(b) => HeaderName::from_bytes(b),
        };
        if let (Ok(n), Ok(v)) = (name, HeaderValue::from_bytes(&bytes(value))) {
            map.append(n, v);
        }
    }
    map
}

fn snapshot(h: &HeaderMap) -> Vec<(String, Vec<u8>)> {
    h.iter()
        .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
        .collect()
}

fn count(hay: &[u8], needle: &str) -> usize {
    hay.windows(needle.len())
        .filter(|w| *w == needle.as_bytes())
        .count()
}

fn counts(h: &[(String, Vec<u8>)], needle: &str) -> usize {
    h.iter().map(|(_, v)| count(v, needle)).sum()
}

fn host_matches(pattern: &str, name: &str) -> bool {
    match pattern.strip_prefix("*.") {
        Some(suffix) => name.len() > suffix.len() + 1 && name.ends_with(&format!(".{suffix}")),
        None => pattern == name,
    }
}

/// What the sandbox sent (header values, the target), then three rounds of
/// percent-decoding it, as origins that decode may read it.
fn readings(headers: &[(String, Vec<u8>)], target: &str) -> Vec<Vec<u8>> {
    let mut sent: Vec<Vec<u8>> = headers.iter().map(|(_, v)| v.clone()).collect();
    sent.push(target.as_bytes().to_vec());
    for i in 0..3 * sent.len() {
        let next = decode(&sent[i]);
        sent.push(next);
    }
    sent
}

/// `text` percent-decoded once (a bad escape kept as it is).
fn decode(text: &[u8]) -> Vec<u8> {
    let hex = |i: usize| text.get(i).and_then(|&b| char::from(b).to_digit(16));
    let (mut out, mut i) = (Vec::new(), 0);
    while i < text.len() {
        if let (b'%', Some(hi), Some(lo)) = (text[i], hex(i + 1), hex(i + 2)) {
            out.extend(u8::try_from(hi * 16 + lo));
            i += 3;
        } else {
            out.push(text[i]);
            i += 1;
        }
    }
    out
}

fuzz_target!(|input: Input| {
    let (list, secrets, hosts) = setup();
    let (verified, mask) = match input.who {
        Who::Verified(i) => (Some(usize::from(i) % NAMES.len()), 0),
        Who::Unverified(m) => (None, m),
    };
    let may_be: Vec<&Hostname> = hosts
        .iter()
        .enumerate()
        .filter(|(i, _)| mask >> i & 1 == 1)
        .map(|(_, h)| h)
        .collect();
    let names = verified.map_or(Names::Unverified(&may_be), |v| Names::Verified(&hosts[v]));
    let target = String::from_utf8_lossy(&bytes(&input.target)).into_owned();
    let mut headers = header_map(&input.headers);
    let before = snapshot(&headers);
    let max_head = usize::from(input.max_head);
    let out = apply(list, secrets, names, &target, &mut headers, max_head);
    let after = snapshot(&headers);

    if out.is_err() || verified.is_none() {
        assert_eq!(
            before, after,
            "{names:?} {target:?}: {out:?} changed the headers"
        );
    }
    let mine =
        |hosts: &[&str]| verified.is_some_and(|v| hosts.iter().any(|p| host_matches(p, NAMES[v])));
    for (_, secret, hosts) in MODEL {
        let for_name = MODEL.iter().any(|(_, s, h)| s == secret && mine(h));
        assert!(
            for_name || counts(&after, secret) <= counts(&before, secret),
            "{names:?}: {hosts:?}'s value went in"
        );
    }
    let Ok(applied) = out else { return };
    let sent = readings(&before, &target);
    for (ph, _, hosts) in MODEL.iter().filter(|(_, _, h)| !mine(h)) {
        let carried = sent.iter().any(|r| count(r, ph) > 0);
        assert!(
            !carried,
            "{names:?} {target:?}: {ph} (for {hosts:?}) passed"
        );
    }
    let head: usize = after.iter().map(|(n, v)| n.len() + v.len() + 4).sum();
    assert!(
        applied.injected == 0 || head <= max_head,
        "{head} > {max_head} with {applied:?}"
    );
});
