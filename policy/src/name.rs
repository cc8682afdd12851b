//! Hostnames and wildcard domains in their normal form.
//!
//! A [`Hostname`] is an ASCII LDH name (letters, digits, hyphens; labels of
//! 1–63 characters that neither start nor end with a hyphen; at most 253
//! characters), lower-cased, with one trailing dot dropped. IP literals and
//! non-ASCII names are refused: a name from the network (SNI, `Host`) that is
//! not a hostname is treated as "no name", never guessed at.

use std::borrow::Borrow;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

/// Longest hostname in presentation form, without the trailing dot (RFC 1035 §2.3.4).
pub(crate) const MAX_NAME_LEN: usize = 253;
/// Longest label (RFC 1035 §2.3.4).
pub(crate) const MAX_LABEL_LEN: usize = 63;

/// Why a string is not a hostname.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("empty name")]
    Empty,
    #[error("longer than {MAX_NAME_LEN} characters")]
    TooLong,
    #[error("empty label (two dots in a row, or a leading dot)")]
    EmptyLabel,
    #[error("label {0:?} is longer than {MAX_LABEL_LEN} characters")]
    LabelTooLong(String),
    #[error("label {0:?} starts or ends with a hyphen")]
    HyphenAtEdge(String),
    #[error("non-ASCII name: use the xn-- (punycode) form")]
    NonAscii,
    #[error("character {0:?} is not a letter, digit, hyphen or dot")]
    BadChar(char),
    #[error("an IP literal is not a hostname")]
    IpLiteral,
    #[error("a wildcard must be `*.` followed by a hostname, e.g. *.relay.example.test")]
    BadWildcard,
}

/// A validated hostname in normal form (see the module docs).
///
/// Cheap to clone (`Arc<str>`); borrows as `str` so maps keyed by `Hostname`
/// can be queried with a `&str` without allocating.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Hostname(Arc<str>);

/// A wildcard domain `*.suffix`: matches names with one or more labels in
/// front of `suffix`, never `suffix` itself (the apex).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WildcardDomain {
    suffix: Hostname,
}

// === impl Hostname ===

/// Reads a TLS server name the way the gateway's peek does (RFC 6066
/// `host_name`): a hostname (`Some`), or an IP literal (`None`, no name);
/// anything else is an error — the gateway resets a ClientHello that
/// carries it.
pub fn server_name(s: &str) -> Result<Option<Hostname>, NameError> {
    // Only digits, hex letters, dots and colons can spell an address.
    let could_be_ip = s
        .bytes()
        .all(|b| b.is_ascii_hexdigit() || b == b'.' || b == b':');
    if could_be_ip && s.parse::<std::net::IpAddr>().is_ok() {
        return Ok(None);
    }
    Hostname::parse(s).map(Some)
}

impl Hostname {
    /// Parses and normalises `s`.
    pub fn parse(s: &str) -> Result<Self, NameError> {
        let trimmed = s.strip_suffix('.').unwrap_or(s);
        // The usual name (every request's Host): valid and lower-case, seen
        // in one pass; any other goes through `validate`, which says why.
        if valid_lower_case(trimmed.as_bytes()) {
            return Ok(Self(Arc::from(trimmed)));
        }
        validate(trimmed)?;
        // Names usually arrive lower-case: then one allocation, not two.
        if trimmed.bytes().any(|b| b.is_ascii_uppercase()) {
            Ok(Self(Arc::from(trimmed.to_ascii_lowercase())))
        } else {
            Ok(Self(Arc::from(trimmed)))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The names this one is a strict subdomain of, nearest first:
    /// `a.b.c` yields `b.c`, then `c`. Used for wildcard lookups.
    pub fn parents(&self) -> impl Iterator<Item = &str> {
        let s = self.as_str();
        s.match_indices('.').map(move |(i, _)| &s[i + 1..])
    }
}

/// Whether `s` (a name without its trailing dot) keeps every rule of
/// [`validate`] and has no upper-case letter, in one pass over its bytes.
/// `false` says nothing more: [`validate`] then judges and names the fault.
fn valid_lower_case(s: &[u8]) -> bool {
    if s.is_empty() || s.len() > MAX_NAME_LEN {
        return false;
    }
    // `prev` starts as a dot: a name is read as if after a label's end.
    let (mut prev, mut label_len, mut digits) = (b'.', 0usize, true);
    for &b in s {
        match b {
            b'a'..=b'z' => digits = false,
            b'0'..=b'9' => {}
            b'-' if prev != b'.' => digits = false,
            b'.' if prev != b'.' && prev != b'-' => {
                (prev, label_len, digits) = (b, 0, true);
                continue;
            }
            _ => return false,
        }
        label_len += 1;
        if label_len > MAX_LABEL_LEN {
            return false;
        }
        prev = b;
    }
    // The last label: not empty, no hyphen at its end, not all digits.
    prev != b'.' && prev != b'-' && !digits
}

/// Checks the LDH rules on a name without its trailing dot.
fn validate(s: &str) -> Result<(), NameError> {
    if s.is_empty() {
        return Err(NameError::Empty);
    }
    if !s.is_ascii() {
        return Err(NameError::NonAscii);
    }
    if s.len() > MAX_NAME_LEN {
        return Err(NameError::TooLong);
    }
    // ASCII from here on: one byte is one character, and every index is a
    // character boundary. One pass over the bytes, no allocation unless
    // the name is refused (this runs on every request's Host).
    let bytes = s.as_bytes();
    if let Some(&b) = bytes
        .iter()
        .find(|&&b| !(b.is_ascii_alphanumeric() || b == b'-' || b == b'.'))
    {
        return Err(NameError::BadChar(char::from(b)));
    }
    let mut start = 0;
    for end in (0..bytes.len())
        .filter(|&i| bytes[i] == b'.')
        .chain([bytes.len()])
    {
        let label = &bytes[start..end];
        if label.is_empty() {
            return Err(NameError::EmptyLabel);
        }
        if label.len() > MAX_LABEL_LEN {
            return Err(NameError::LabelTooLong(s[start..end].to_owned()));
        }
        if label[0] == b'-' || label[label.len() - 1] == b'-' {
            return Err(NameError::HyphenAtEdge(s[start..end].to_owned()));
        }
        start = end + 1;
    }
    // An all-numeric last label makes the name read as an IPv4 literal
    // (`10.0.0.1`, `1.2.3`); no top-level domain is numeric (RFC 3696 §2).
    let last = s.rsplit('.').next().unwrap_or(s);
    if last.bytes().all(|b| b.is_ascii_digit()) {
        return Err(NameError::IpLiteral);
    }
    Ok(())
}

impl FromStr for Hostname {
    type Err = NameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl Borrow<str> for Hostname {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for Hostname {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Hostname {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl serde::Serialize for Hostname {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl fmt::Debug for Hostname {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

// === impl WildcardDomain ===

impl WildcardDomain {
    /// Parses `*.suffix`; only `*.` as the whole leading label is accepted.
    pub fn parse(s: &str) -> Result<Self, NameError> {
        let rest = s.strip_prefix("*.").ok_or(NameError::BadWildcard)?;
        if rest.contains('*') {
            return Err(NameError::BadWildcard);
        }
        let suffix = Hostname::parse(rest)?;
        // `*.` adds at least two characters to the name it matches.
        if suffix.as_str().len() + 2 > MAX_NAME_LEN {
            return Err(NameError::TooLong);
        }
        Ok(Self { suffix })
    }

    /// The part after `*.`.
    pub fn suffix(&self) -> &Hostname {
        &self.suffix
    }

    /// Whether `name` has one or more labels in front of the suffix.
    pub fn matches(&self, name: &Hostname) -> bool {
        name.parents().any(|p| p == self.suffix.as_str())
    }
}

impl FromStr for WildcardDomain {
    type Err = NameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Display for WildcardDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "*.{}", self.suffix)
    }
}

impl fmt::Debug for WildcardDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "\"*.{}\"", self.suffix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(s: &str) -> String {
        Hostname::parse(s).expect(s).to_string()
    }

    /// The one-pass check agrees with `validate` (and no upper case) on
    /// every name of up to five characters over the bytes where the rules
    /// differ, and at the length limits.
    #[test]
    fn the_one_pass_check_agrees_with_validate() {
        let agree = |s: &str| {
            let slow = validate(s).is_ok() && !s.bytes().any(|b| b.is_ascii_uppercase());
            assert_eq!(valid_lower_case(s.as_bytes()), slow, "{s:?}");
        };
        let alphabet = ["a", "Z", "7", "-", ".", "_"];
        let (mut level, mut names) = (vec![String::new()], Vec::new());
        for _ in 0..5 {
            level = level
                .iter()
                .flat_map(|n| alphabet.iter().map(move |c| format!("{n}{c}")))
                .collect();
            names.extend(level.iter().cloned());
        }
        assert!(names.len() > 9000, "{}", names.len());
        names.iter().for_each(|n| agree(n));
        let label = |n: usize| "a".repeat(n);
        for s in [
            label(63),
            label(64),
            format!("{}.b", label(63)),
            format!("{}.b", label(64)),
            [label(63), label(63), label(63), label(61)].join("."),
            [label(63), label(63), label(63), label(62)].join("."),
            "1.2.3.4".into(),
            "1.2.3.a4".into(),
            "é.test".into(),
        ] {
            agree(&s);
        }
    }

    #[test]
    fn normal_form() {
        assert_eq!(ok("API.Example.TEST."), "api.example.test");
        assert_eq!(ok("localhost"), "localhost");
        assert_eq!(ok("xn--bcher-kva.example"), "xn--bcher-kva.example");
        assert_eq!(ok("a-b.c1"), "a-b.c1");
        let max_label = "a".repeat(63);
        assert_eq!(
            ok(&format!("{max_label}.test")),
            format!("{max_label}.test")
        );
    }

    #[test]
    fn refusals() {
        let cases: &[(&str, NameError)] = &[
            ("", NameError::Empty),
            (".", NameError::Empty),
            ("a..b", NameError::EmptyLabel),
            (".a.b", NameError::EmptyLabel),
            ("a.b..", NameError::EmptyLabel),
            ("bücher.example", NameError::NonAscii),
            ("a_b.example", NameError::BadChar('_')),
            ("a b.example", NameError::BadChar(' ')),
            ("*.example.test", NameError::BadChar('*')),
            ("api.example.test:443", NameError::BadChar(':')),
            ("-a.example", NameError::HyphenAtEdge("-a".into())),
            ("a-.example", NameError::HyphenAtEdge("a-".into())),
            ("203.0.113.7", NameError::IpLiteral),
            ("1.2.3", NameError::IpLiteral),
            ("::1", NameError::BadChar(':')),
            ("[2001:db8::1]", NameError::BadChar('[')),
        ];
        for (input, want) in cases {
            assert_eq!(Hostname::parse(input).as_ref(), Err(want), "{input:?}");
        }
        let long_label = "a".repeat(64);
        assert!(matches!(
            Hostname::parse(&format!("{long_label}.test")),
            Err(NameError::LabelTooLong(_))
        ));
        let long_name = ["abcdefghi"; 26].join("."); // 259 characters
        assert_eq!(Hostname::parse(&long_name), Err(NameError::TooLong));
    }

    #[test]
    fn wildcard_matches_subdomains_only() {
        let w = WildcardDomain::parse("*.Relay.Example.test").expect("valid");
        assert_eq!(w.to_string(), "*.relay.example.test");
        let m = |s: &str| w.matches(&Hostname::parse(s).expect(s));
        assert!(m("a.relay.example.test"));
        assert!(m("a.b.relay.example.test"));
        assert!(!m("relay.example.test"), "apex never matches");
        assert!(!m("xrelay.example.test"));
        assert!(!m("relay.example.test.evil"));
    }

    #[test]
    fn wildcard_refusals() {
        for bad in [
            "*",
            "*.",
            "**.a.test",
            "a.*.test",
            "*a.test",
            "*.*.a.test",
            "a.test",
            "*.1.2",
        ] {
            assert!(WildcardDomain::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn parents_nearest_first() {
        let h = Hostname::parse("a.b.c").expect("valid");
        assert_eq!(h.parents().collect::<Vec<_>>(), ["b.c", "c"]);
    }
}
