//! Per-request qualifiers of allow and deny entries: which methods and paths
//! a rule covers, and whether it is enforced or only audited.
//!
//! ```json
//! {"domain": "github.com", "http": "read_only"}
//! {"domain": "api.github.com", "http": {"methods": ["POST"], "paths": ["/gists"]}, "mode": "audit"}
//! ```
//!
//! Paths are matched on the request's *normal* path: unreserved characters
//! percent-decoded, dot-segments removed, empty segments dropped, so
//! `/a/%2e%2e//b/./c` is `/b/c`. A path that servers could read two ways —
//! an encoded `/`, `\`, `%` or control character, a raw `\` or `;`, a broken
//! escape — has no normal form, and a rule that needs the path refuses it.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::ser::{SerializeMap, Serializer};
use serde::{Deserialize, Serialize};

/// Methods the `read_only` preset allows.
pub const READ_ONLY_METHODS: [&str; 3] = ["GET", "HEAD", "OPTIONS"];

/// Longest method name a rule may list (and the most of a request's
/// method the gateway shows).
pub const MAX_METHOD_LEN: usize = 32;
/// Most methods or paths in one qualifier.
const MAX_ITEMS: usize = 256;
/// Longest path pattern.
const MAX_PATTERN_LEN: usize = 1024;

/// Whether a qualified rule blocks (`enforce`, the default) or only records
/// what it would have blocked (`audit`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    #[default]
    Enforce,
    Audit,
}

/// Which requests a rule covers.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum HttpMatch {
    /// `"read_only"`: GET, HEAD and OPTIONS, any path.
    ReadOnly,
    /// `{"methods": [...], "paths": [...]}`; an omitted list covers everything.
    Requests {
        methods: Vec<String>,
        paths: Vec<PathPattern>,
    },
}

/// A path pattern: a prefix of whole segments, where a `*` segment matches
/// any one segment (`/repos/*/issues` covers `/repos/a/issues/7`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PathPattern {
    text: String,
    segments: Vec<Segment>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Segment {
    Literal(String),
    Any,
}

/// Why an `http` qualifier was refused. Every message names the value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HttpError {
    #[error("unknown preset {0:?}: expected \"read_only\" or an object with methods and/or paths")]
    Preset(String),
    #[error("an http qualifier needs methods, paths or both")]
    Empty,
    #[error("{field}: empty list: omit the field to cover every {what}")]
    EmptyList {
        field: &'static str,
        what: &'static str,
    },
    #[error("{field}: more than {MAX_ITEMS} entries")]
    TooMany { field: &'static str },
    #[error("invalid method {0:?}: expected an upper-case HTTP method such as GET or POST")]
    Method(String),
    #[error("method {0:?} listed twice")]
    DuplicateMethod(String),
    #[error("invalid path {value:?}: {reason}")]
    Path { value: String, reason: String },
    #[error("path {value:?} is not in normal form: write {normal:?}")]
    NotNormal { value: String, normal: String },
}

/// Why a request path has no normal form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("the path does not start with /")]
    NotAbsolute,
    #[error("a percent escape is not two hex digits")]
    BadEscape,
    #[error("an encoded /, \\, %, ;, ?, # or control character reads two ways")]
    EncodedDelimiter,
    #[error("a \\ or ; reads two ways")]
    AmbiguousChar,
    /// Origins resolve a `.` or `..` segment (RFC 3986 §5.2.4, itself read
    /// two ways after an empty segment) or route it as it is.
    #[error("a . or .. segment reads two ways")]
    DotSegment,
    /// Origins that read the target as a URI reference (Node's `URL`,
    /// Python's `urlsplit`, Java's `URI`) take `//x/admin` for the path
    /// `/admin` on host `x`.
    #[error("a path that starts with // reads as an authority")]
    LeadingSlashes,
}

/// Whether `method` is one `read_only` covers. Methods are compared without
/// regard to case, here and in `methods` lists: HTTP says they are
/// case-sensitive, but servers that upper-case them (Django, Werkzeug) act
/// on `delete` as on `DELETE`.
fn read_only(method: &str) -> bool {
    READ_ONLY_METHODS
        .iter()
        .any(|m| m.eq_ignore_ascii_case(method))
}

// === impl HttpMatch ===

impl HttpMatch {
    /// Whether the rule needs the request's path.
    pub fn needs_path(&self) -> bool {
        matches!(self, Self::Requests { paths, .. } if !paths.is_empty())
    }

    /// Whether `method` and the normal `path` (segments, from [`normalize`])
    /// are covered.
    pub fn covers(&self, method: &str, path: &[&str]) -> bool {
        match self {
            Self::ReadOnly => read_only(method),
            Self::Requests { methods, paths } => {
                (methods.is_empty() || methods.iter().any(|m| m.eq_ignore_ascii_case(method)))
                    && (paths.is_empty() || paths.iter().any(|p| p.covers(path)))
            }
        }
    }

    /// The path patterns (none: any path).
    pub fn paths(&self) -> &[PathPattern] {
        match self {
            Self::ReadOnly => &[],
            Self::Requests { paths, .. } => paths,
        }
    }

    /// Whether `method` alone is covered (the path is not needed or not known).
    pub fn covers_method(&self, method: &str) -> bool {
        match self {
            Self::ReadOnly => read_only(method),
            Self::Requests { methods, .. } => {
                methods.is_empty() || methods.iter().any(|m| m.eq_ignore_ascii_case(method))
            }
        }
    }

    fn validate(methods: Vec<String>, paths: Vec<String>) -> Result<Self, HttpError> {
        if methods.len() > MAX_ITEMS {
            return Err(HttpError::TooMany { field: "methods" });
        }
        if paths.len() > MAX_ITEMS {
            return Err(HttpError::TooMany { field: "paths" });
        }
        let mut seen = Vec::with_capacity(methods.len());
        for m in &methods {
            let ok = !m.is_empty()
                && m.len() <= MAX_METHOD_LEN
                && m.bytes()
                    .all(|b| b.is_ascii_uppercase() || b == b'-' || b == b'_');
            if !ok {
                return Err(HttpError::Method(m.clone()));
            }
            if seen.contains(&m) {
                return Err(HttpError::DuplicateMethod(m.clone()));
            }
            seen.push(m);
        }
        let paths = paths
            .into_iter()
            .map(|p| PathPattern::parse(&p))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self::Requests { methods, paths })
    }
}

impl fmt::Display for HttpMatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ReadOnly => f.write_str("read_only"),
            Self::Requests { methods, paths } => {
                let methods = if methods.is_empty() {
                    "any method".to_owned()
                } else {
                    methods.join("|")
                };
                let paths = if paths.is_empty() {
                    "any path".to_owned()
                } else {
                    paths
                        .iter()
                        .map(|p| p.text.as_str())
                        .collect::<Vec<_>>()
                        .join("|")
                };
                write!(f, "{methods} {paths}")
            }
        }
    }
}

impl Serialize for HttpMatch {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::ReadOnly => s.serialize_str("read_only"),
            Self::Requests { methods, paths } => {
                let len = usize::from(!methods.is_empty()) + usize::from(!paths.is_empty());
                let mut map = s.serialize_map(Some(len))?;
                if !methods.is_empty() {
                    map.serialize_entry("methods", methods)?;
                }
                if !paths.is_empty() {
                    let texts: Vec<&str> = paths.iter().map(|p| p.text.as_str()).collect();
                    map.serialize_entry("paths", &texts)?;
                }
                map.end()
            }
        }
    }
}

impl<'de> Deserialize<'de> for HttpMatch {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct HttpVisitor;

        impl<'de> Visitor<'de> for HttpVisitor {
            type Value = HttpMatch;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("\"read_only\" or an object with methods and/or paths")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<HttpMatch, E> {
                match v {
                    "read_only" => Ok(HttpMatch::ReadOnly),
                    other => Err(E::custom(HttpError::Preset(other.to_owned()))),
                }
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<HttpMatch, A::Error> {
                let mut methods: Option<Vec<String>> = None;
                let mut paths: Option<Vec<String>> = None;
                while let Some(key) = map.next_key::<String>()? {
                    let (slot, field, what) = match key.as_str() {
                        "methods" => (&mut methods, "methods", "method"),
                        "paths" => (&mut paths, "paths", "path"),
                        _ => return Err(de::Error::unknown_field(&key, &["methods", "paths"])),
                    };
                    if slot.is_some() {
                        return Err(de::Error::custom(format_args!("duplicate field `{field}`")));
                    }
                    let list: Vec<String> = map.next_value()?;
                    if list.is_empty() {
                        return Err(de::Error::custom(HttpError::EmptyList { field, what }));
                    }
                    *slot = Some(list);
                }
                if methods.is_none() && paths.is_none() {
                    return Err(de::Error::custom(HttpError::Empty));
                }
                HttpMatch::validate(methods.unwrap_or_default(), paths.unwrap_or_default())
                    .map_err(de::Error::custom)
            }
        }

        d.deserialize_any(HttpVisitor)
    }
}

// === impl PathPattern ===

impl PathPattern {
    /// Parses a pattern: an absolute path in normal form whose segments are
    /// literal or exactly `*`. A trailing `/` is dropped (`/gists/` is `/gists`).
    pub fn parse(text: &str) -> Result<Self, HttpError> {
        let bad = |reason: &str| HttpError::Path {
            value: text.to_owned(),
            reason: reason.to_owned(),
        };
        if text.len() > MAX_PATTERN_LEN {
            return Err(bad("longer than 1024 bytes"));
        }
        if text.contains('?') || text.contains('#') {
            return Err(bad("a pattern matches the path only: no ? or #"));
        }
        let normal = normal_form(text, Delimiters::KeptEscaped)
            .map(Cow::into_owned)
            .map_err(|e| bad(&e.to_string()))?;
        let trimmed = text
            .strip_suffix('/')
            .filter(|t| !t.is_empty())
            .unwrap_or(text);
        if normal != trimmed {
            return Err(HttpError::NotNormal {
                value: text.to_owned(),
                normal,
            });
        }
        let mut segments = Vec::new();
        for seg in segments_of(&normal) {
            if seg == "*" {
                segments.push(Segment::Any);
            } else if seg.contains('*') {
                return Err(bad("a * must be a whole segment"));
            } else {
                segments.push(Segment::Literal(seg.to_owned()));
            }
        }
        Ok(Self {
            text: normal,
            segments,
        })
    }

    /// Whether the pattern's segments are a prefix of `path`'s.
    pub fn covers(&self, path: &[&str]) -> bool {
        self.segments.len() <= path.len()
            && self.segments.iter().zip(path).all(|(s, p)| match s {
                Segment::Any => true,
                Segment::Literal(l) => l == p,
            })
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The segments: `Some(literal)`, or `None` for `*`.
    pub fn segments(&self) -> impl Iterator<Item = Option<&str>> {
        self.segments.iter().map(|s| match s {
            Segment::Literal(l) => Some(l.as_str()),
            Segment::Any => None,
        })
    }
}

impl fmt::Display for PathPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// The segments of a normal path (`/` has none).
pub fn segments_of(normal: &str) -> impl Iterator<Item = &str> {
    normal.split('/').filter(|s| !s.is_empty())
}

/// The normal form of a request target's path (the query is dropped):
/// escapes decoded, so a character and its escape read alike, as the
/// origin that decodes them reads them; empty segments dropped. An escaped
/// `;`, `?` or `#` has none ([`decode_path`]). `*` (asterisk-form) stays `*`. A `.` or `..` segment, raw or
/// escaped, has no normal form: origins resolve it or route it as it is;
/// nor has a path that starts with `//`.
pub fn normalize(target: &str) -> Result<String, PathError> {
    normal_path(target).map(Cow::into_owned)
}

/// [`normalize`], borrowing the target when its path is already normal
/// (the common case: no escapes, no dot or empty segments).
pub fn normal_path(target: &str) -> Result<Cow<'_, str>, PathError> {
    normal_form(target, Delimiters::Refused)
}

/// How an escaped `;`, `?` or `#` reads.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Delimiters {
    /// In a request's path: refused ([`PathError::EncodedDelimiter`]).
    Refused,
    /// In a pattern: kept escaped, upper-cased, the normal form requests
    /// had before they were refused; so a pattern stored then still parses
    /// (and matches no request: none carrying one has a normal form).
    KeptEscaped,
}

fn normal_form(target: &str, delimiters: Delimiters) -> Result<Cow<'_, str>, PathError> {
    let path = target.split(['?', '#']).next().unwrap_or("");
    if path == "*" {
        return Ok(Cow::Borrowed(path));
    }
    if !path.starts_with('/') {
        return Err(PathError::NotAbsolute);
    }
    if path.starts_with("//") {
        return Err(PathError::LeadingSlashes);
    }
    if is_normal(path) {
        return Ok(Cow::Borrowed(path));
    }
    // Decode first, so an encoded dot is a dot when segments are read.
    let decoded = decode_path(path, delimiters)?;
    let normal = join_segments(&decoded)?;
    // Escapes of bytes that are no UTF-8 read no way at all.
    String::from_utf8(normal)
        .map(Cow::Owned)
        .map_err(|_| PathError::BadEscape)
}

/// Percent-decodes an absolute path; refuses bad escapes, encoded
/// delimiters and characters that read two ways. An escaped `;`, `?` or `#`
/// is a delimiter too: a front proxy that decodes the path and escapes it
/// again without them (nginx leaves `;`) hands the origin `/admin;x` for
/// `/admin%3Bx`, which Tomcat and Spring route to `/admin`.
fn decode_path(path: &str, delimiters: Delimiters) -> Result<Vec<u8>, PathError> {
    let bytes = path.as_bytes();
    let mut decoded: Vec<u8> = Vec::with_capacity(path.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        match b {
            b'%' => {
                let hex = bytes.get(i + 1..i + 3).ok_or(PathError::BadEscape)?;
                let (Some(hi), Some(lo)) = (hex_val(hex[0]), hex_val(hex[1])) else {
                    return Err(PathError::BadEscape);
                };
                let v = hi << 4 | lo;
                let kept = delimiters == Delimiters::KeptEscaped && b";?#".contains(&v);
                if kept {
                    const HEX: &[u8; 16] = b"0123456789ABCDEF";
                    decoded.extend_from_slice(&[b'%', HEX[usize::from(hi)], HEX[usize::from(lo)]]);
                } else if b"/\\%;?#".contains(&v) || v < 0x20 || v == 0x7f {
                    return Err(PathError::EncodedDelimiter);
                } else {
                    decoded.push(v);
                }
                i += 3;
            }
            b'\\' | b';' => return Err(PathError::AmbiguousChar),
            _ if b < 0x20 || b == 0x7f => return Err(PathError::AmbiguousChar),
            // Other bytes (multi-byte UTF-8 included) pass through as they are.
            _ => {
                decoded.push(b);
                i += 1;
            }
        }
    }
    Ok(decoded)
}

/// Joins the segments of a decoded path into one buffer, empty segments
/// dropped; `/` if none is left. A `.` or `..` segment is refused.
fn join_segments(decoded: &[u8]) -> Result<Vec<u8>, PathError> {
    let mut normal: Vec<u8> = Vec::with_capacity(decoded.len() + 1);
    for seg in decoded.split(|&c| c == b'/') {
        match seg {
            b"" => {}
            b"." | b".." => return Err(PathError::DotSegment),
            s => {
                normal.push(b'/');
                normal.extend_from_slice(s);
            }
        }
    }
    if normal.is_empty() {
        normal.push(b'/');
    }
    Ok(normal)
}

/// Whether an absolute path is its own normal form: no escape, no
/// character that reads two ways, no empty, `.` or `..` segment, no
/// trailing `/` (except the root).
fn is_normal(path: &str) -> bool {
    let b = path.as_bytes();
    if b.len() > 1 && b.ends_with(b"/") {
        return false;
    }
    if b.iter()
        .any(|&c| matches!(c, b'%' | b'\\' | b';') || c < 0x20 || c == 0x7f)
    {
        return false;
    }
    path == "/"
        || path[1..]
            .split('/')
            .all(|seg| !seg.is_empty() && seg != "." && seg != "..")
}

fn hex_val(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_paths_cannot_be_dodged() {
        for (raw, normal) in [
            ("/", "/"),
            ("/gists", "/gists"),
            ("/gists/", "/gists"),
            ("/a//b", "/a/b"),
            ("/%67ists", "/gists"),
            ("/gists?x=/../y", "/gists"),
            // A character and its escape read alike, as a decoding origin
            // reads them.
            ("/a%20b/c", "/a b/c"),
            ("/user%3Ax", "/user:x"),
            ("/user:x", "/user:x"),
            ("/caf%C3%A9", "/café"),
            ("/a.b/..c/.d", "/a.b/..c/.d"),
            ("*", "*"),
        ] {
            assert_eq!(normalize(raw).as_deref(), Ok(normal), "{raw}");
        }
    }

    /// The bound on a pattern counts bytes, as its message says: `/` and
    /// 512 two-byte characters (513 characters, 1,025 bytes) are past it.
    #[test]
    fn a_patterns_length_is_counted_in_bytes() {
        let long = format!("/{}", "é".repeat(512));
        let e = PathPattern::parse(&long).expect_err("1025 bytes");
        assert!(e.to_string().contains("longer than 1024 bytes"), "{e}");
        assert!(PathPattern::parse(&format!("/{}", "é".repeat(511))).is_ok());
    }

    #[test]
    fn the_fast_path_agrees_with_the_slow_one() {
        for raw in [
            "/", "/a", "/a/b", "/a/", "/a//b", "/a/.b", "/a/..b", "/a%41", "/a b",
        ] {
            let fast = normal_path(raw).map(|c| matches!(c, Cow::Borrowed(_)));
            let normal = normalize(raw).expect(raw);
            assert_eq!(fast.is_ok_and(|b| b), normal == raw, "{raw}");
        }
    }

    proptest::proptest! {
        /// A normal path is its own normal form, has no dot or empty
        /// segment, and the fast path recognises it.
        #[test]
        fn normal_forms_are_fixed_points(raw in "/[a/.%2eEfF5c;~?]{0,24}") {
            if let Ok(n) = normalize(&raw) {
                let again = normalize(&n);
                proptest::prop_assert_eq!(again.as_deref(), Ok(n.as_str()));
                // The fast path is conservative: it leaves escapes to the slow one.
                proptest::prop_assert!(is_normal(&n) || n.contains('%') || n == "*", "{} -> {}", raw, n);
                proptest::prop_assert!(segments_of(&n).all(|s| s != "." && s != ".."));
            }
        }
    }

    #[test]
    fn paths_that_read_two_ways_have_no_normal_form() {
        for (raw, err) in [
            ("gists", PathError::NotAbsolute),
            ("//gists", PathError::LeadingSlashes),
            ("//x/gists?y", PathError::LeadingSlashes),
            ("/a%2fb", PathError::EncodedDelimiter),
            ("/a%2Fb", PathError::EncodedDelimiter),
            ("/a%5cb", PathError::EncodedDelimiter),
            ("/a%252e%252e/b", PathError::EncodedDelimiter),
            ("/a%00", PathError::EncodedDelimiter),
            // `/admin;x` once a front proxy decodes it: `/admin` to Tomcat.
            ("/admin%3Bx", PathError::EncodedDelimiter),
            ("/admin%3bx", PathError::EncodedDelimiter),
            ("/admin%3Fx", PathError::EncodedDelimiter),
            ("/admin%23x", PathError::EncodedDelimiter),
            ("/a\\b", PathError::AmbiguousChar),
            ("/gists;x", PathError::AmbiguousChar),
            ("/a%2", PathError::BadEscape),
            ("/a%zz", PathError::BadEscape),
            ("/a%ff", PathError::BadEscape),
            // Dot segments: `/public//../secret` is `/public/secret` to
            // RFC 3986, `/secret` to an origin that merges slashes first,
            // and under `/public` to one that routes it as it is.
            ("/public//../secret", PathError::DotSegment),
            ("/./gists", PathError::DotSegment),
            ("/x/../gists", PathError::DotSegment),
            ("/x/%2e%2e/gists", PathError::DotSegment),
            ("/x/%2E%2e/gists", PathError::DotSegment),
            ("/x/.%2e/gists", PathError::DotSegment),
            ("/%2e/gists", PathError::DotSegment),
            ("/a/..", PathError::DotSegment),
            ("/../../gists", PathError::DotSegment),
        ] {
            assert_eq!(normalize(raw), Err(err), "{raw}");
        }
    }

    /// A pattern with an escaped `;`, `?` or `#`, stored when requests had
    /// such a normal form, still parses, and matches no request: a request
    /// carrying one has no normal form.
    #[test]
    fn a_pattern_with_an_escaped_delimiter_still_parses_and_matches_nothing() {
        let p = PathPattern::parse("/files/a%3Bb").expect("parses as it did");
        assert_eq!(p.text, "/files/a%3Bb");
        assert_eq!(
            PathPattern::parse("/files/a%3bb").map(|p| p.text),
            Err(HttpError::NotNormal {
                value: "/files/a%3bb".into(),
                normal: "/files/a%3Bb".into()
            })
        );
        assert_eq!(normalize("/files/a%3Bb"), Err(PathError::EncodedDelimiter));
    }

    #[test]
    fn patterns_are_segment_prefixes_with_whole_segment_globs() {
        let p = PathPattern::parse("/repos/*/issues").expect("valid");
        let covers =
            |path: &str| p.covers(&segments_of(&normalize(path).expect(path)).collect::<Vec<_>>());
        assert!(covers("/repos/a/issues"));
        assert!(covers("/repos/a/issues/7/comments"));
        assert!(!covers("/repos/a/issuesx"));
        assert!(!covers("/repos/issues"));
        assert!(!covers("/repos"));
        let root = PathPattern::parse("/").expect("valid");
        assert!(root.covers(&[]));
        assert!(root.covers(&["a"]));
        assert_eq!(
            PathPattern::parse("/gists/").expect("valid").as_str(),
            "/gists"
        );
    }

    #[test]
    fn bad_patterns_name_the_value() {
        for (text, needle) in [
            ("gists", "does not start with /"),
            ("/a/../b", "reads two ways"),
            ("//a", "reads as an authority"),
            ("/a*b", "whole segment"),
            ("/a?x", "no ? or #"),
            ("/a%2fb", "reads two ways"),
        ] {
            let e = PathPattern::parse(text).expect_err(text).to_string();
            assert!(e.contains(text) && e.contains(needle), "{text}: {e}");
        }
    }

    #[test]
    fn qualifiers_parse_and_round_trip() {
        let m: HttpMatch = serde_json::from_str(r#""read_only""#).expect("preset");
        assert_eq!(m, HttpMatch::ReadOnly);
        assert!(m.covers("GET", &[]) && m.covers("HEAD", &["x"]) && !m.covers("POST", &[]));
        let m: HttpMatch =
            serde_json::from_str(r#"{"methods": ["POST"], "paths": ["/gists", "/repos/*/forks"]}"#)
                .expect("object");
        assert!(m.covers("POST", &["gists", "1"]));
        assert!(!m.covers("GET", &["gists"]));
        assert!(!m.covers("POST", &["repos"]));
        assert_eq!(
            serde_json::to_value(&m).expect("serialises"),
            serde_json::json!({"methods": ["POST"], "paths": ["/gists", "/repos/*/forks"]})
        );
        for (text, needle) in [
            (r#""write_only""#, "unknown preset \"write_only\""),
            (r#"{}"#, "needs methods, paths or both"),
            (r#"{"methods": []}"#, "methods: empty list"),
            (r#"{"methods": ["get"]}"#, "invalid method \"get\""),
            (r#"{"methods": ["GET", "GET"]}"#, "listed twice"),
            (r#"{"verbs": ["GET"]}"#, "unknown field `verbs`"),
            (r#"{"paths": ["/a/./b"]}"#, "reads two ways"),
        ] {
            let e = serde_json::from_str::<HttpMatch>(text)
                .expect_err(text)
                .to_string();
            assert!(e.contains(needle), "{text}: {e}");
        }
    }
}
