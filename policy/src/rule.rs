//! An entry of a tenant's `allow` or `deny` list: a destination, and for a
//! domain or wildcard optionally an `http` qualifier and its `mode`; for an
//! allow entry optionally the opaque `streams` it lets through.
//!
//! ```json
//! {"domain": "github.com", "http": "read_only"}
//! {"wildcard_domain": "*.github.com", "http": {"methods": ["POST"], "paths": ["/gists"]}, "mode": "audit"}
//! {"cidr": "203.0.113.0/24", "streams": ["ssh"]}
//! ```
//!
//! An entry without `http` and `streams` is exactly the destination it
//! names, as before. An allow entry may carry `until` (RFC 3339): from
//! then on it is out of force, as if it were not there (an approval's
//! rule, so the gateway closes it on time even when no push comes).

use std::fmt;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::ser::{SerializeMap, Serializer};
use serde::{Deserialize, Serialize};
use time::format_description::well_known::Rfc3339;

use crate::dest::{Destination, DestinationError, Kind, ALL_KINDS};
use crate::http::{HttpMatch, Mode};
use crate::stream::Streams;

/// One allow or deny entry.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Rule {
    pub dest: Destination,
    /// Which requests the entry covers; `None`: the whole destination.
    pub http: Option<HttpMatch>,
    /// Enforced or audited; only a qualified entry may be audited.
    pub mode: Mode,
    /// The opaque streams (neither TLS nor HTTP) an allow entry lets
    /// through; `None`: as the gateway's `opaque_streams` says. Never on a
    /// deny entry, never beside `http`.
    pub streams: Option<Streams>,
    /// When an allow entry goes out of force; `None`: never. Never on a
    /// deny entry (a deny that lapsed would open what it closed).
    pub until: Option<time::OffsetDateTime>,
}

impl Rule {
    /// Whether the entry has a qualifier that is enforced.
    pub fn enforced_http(&self) -> bool {
        self.http.is_some() && self.mode == Mode::Enforce
    }

    /// Whether the entry is in force at `now` (before its `until`).
    pub fn in_force(&self, now: time::OffsetDateTime) -> bool {
        self.until.is_none_or(|until| now < until)
    }
}

impl From<Destination> for Rule {
    fn from(dest: Destination) -> Self {
        Self {
            dest,
            http: None,
            mode: Mode::Enforce,
            streams: None,
            until: None,
        }
    }
}

impl PartialEq<Destination> for Rule {
    /// Exactly the destination: no qualifier, no streams, and no `until`
    /// (an entry that lapses is not the permanent grant a profile adds).
    fn eq(&self, other: &Destination) -> bool {
        self.http.is_none() && self.streams.is_none() && self.until.is_none() && self.dest == *other
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.dest, f)?;
        if let Some(http) = &self.http {
            write!(f, " http {http}")?;
        }
        if self.mode == Mode::Audit {
            f.write_str(" (audit)")?;
        }
        if let Some(streams) = &self.streams {
            write!(f, " streams {streams}")?;
        }
        if let Some(until) = self.until.and_then(|u| u.format(&Rfc3339).ok()) {
            write!(f, " until {until}")?;
        }
        Ok(())
    }
}

impl Serialize for Rule {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let len = 1
            + usize::from(self.http.is_some())
            + usize::from(self.mode == Mode::Audit)
            + usize::from(self.streams.is_some())
            + usize::from(self.until.is_some());
        let mut map = s.serialize_map(Some(len))?;
        map.serialize_entry(self.dest.kind().as_str(), &self.dest.value())?;
        if let Some(http) = &self.http {
            map.serialize_entry("http", http)?;
        }
        if self.mode == Mode::Audit {
            map.serialize_entry("mode", &self.mode)?;
        }
        if let Some(streams) = &self.streams {
            map.serialize_entry("streams", streams)?;
        }
        if let Some(until) = self.until {
            let text = until.format(&Rfc3339).map_err(serde::ser::Error::custom)?;
            map.serialize_entry("until", &text)?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for Rule {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(RuleVisitor)
    }
}

struct RuleVisitor;

impl<'de> Visitor<'de> for RuleVisitor {
    type Value = Rule;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "an object with exactly one of {ALL_KINDS}, and optionally http and mode, or streams"
        )
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Rule, A::Error> {
        let shape = || {
            de::Error::custom(DestinationError::Shape {
                expected: ALL_KINDS,
            })
        };
        let mut dest: Option<(Kind, String)> = None;
        let mut http: Option<HttpMatch> = None;
        let mut mode: Option<Mode> = None;
        let mut streams: Option<Streams> = None;
        let mut until: Option<time::OffsetDateTime> = None;
        while let Some(key) = map.next_key::<String>()? {
            match key.as_str() {
                "until" if until.is_some() => {
                    return Err(de::Error::custom(DestinationError::DuplicateKey { key }))
                }
                "until" => until = Some(read_until(&map.next_value::<String>()?)?),
                "streams" if streams.is_some() => {
                    return Err(de::Error::custom(DestinationError::DuplicateKey { key }))
                }
                "streams" => streams = Some(map.next_value()?),
                "http" if http.is_some() => {
                    return Err(de::Error::custom(DestinationError::DuplicateKey { key }))
                }
                "http" => http = Some(map.next_value()?),
                "mode" if mode.is_some() => {
                    return Err(de::Error::custom(DestinationError::DuplicateKey { key }))
                }
                "mode" => mode = Some(map.next_value()?),
                _ => {
                    let Some(kind) = Kind::from_key(&key) else {
                        return Err(de::Error::custom(DestinationError::UnsupportedSelector {
                            selector: key,
                            expected: ALL_KINDS,
                        }));
                    };
                    match &dest {
                        Some((k, _)) if *k == kind => {
                            return Err(de::Error::custom(DestinationError::DuplicateKey { key }))
                        }
                        Some(_) => return Err(shape()),
                        None => dest = Some((kind, map.next_value()?)),
                    }
                }
            }
        }
        let (kind, value) = dest.ok_or_else(shape)?;
        let dest = Destination::parse(kind, &value).map_err(de::Error::custom)?;
        let rule = Rule {
            dest,
            http,
            mode: mode.unwrap_or_default(),
            streams,
            until,
        };
        rule.check(mode.is_some()).map_err(de::Error::custom)?;
        Ok(rule)
    }
}

impl Rule {
    /// The checks between fields; `mode_given`: the entry spelled `mode`.
    fn check(&self, mode_given: bool) -> Result<(), String> {
        let (kind, value) = (self.dest.kind(), self.dest.value());
        if self.http.is_some() && !self.dest.is_name() {
            return Err(format!(
                "http applies to domain and wildcard_domain entries, not {kind} {value:?}: \
                 a request is qualified by the name it is for"
            ));
        }
        if mode_given && self.http.is_none() {
            return Err(
                "mode applies only to an entry with http: a whole destination is always enforced"
                    .into(),
            );
        }
        if self.streams.is_some() && self.http.is_some() {
            return Err(format!(
                "streams and http on one entry ({kind} {value:?}): http qualifies HTTP requests, \
                 streams lets opaque streams through; give each an entry of its own"
            ));
        }
        Ok(())
    }
}

/// An entry's `until`: RFC 3339 with its offset (`2026-12-05T10:00:00Z`).
fn read_until<E: de::Error>(text: &str) -> Result<time::OffsetDateTime, E> {
    time::OffsetDateTime::parse(text, &Rfc3339).map_err(|e| {
        E::custom(format_args!(
            "until {text:?}: expected an RFC 3339 time with its offset ({e})"
        ))
    })
}

/// Reads a `deny` list: entries as in `allow`, without `streams` (a deny
/// refuses a destination whole; what passes through an allow is the allow's
/// to say). serde_path_to_error names the entry's index.
pub(crate) fn deny_list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Rule>, D::Error> {
    struct DenyEntry(Rule);
    impl<'de> Deserialize<'de> for DenyEntry {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            let rule = Rule::deserialize(d)?;
            if rule.streams.is_some() {
                return Err(de::Error::custom(format_args!(
                    "streams applies to allow entries only, not to deny {}: a deny refuses \
                     every stream to its destination",
                    rule.dest
                )));
            }
            if rule.until.is_some() {
                return Err(de::Error::custom(format_args!(
                    "until applies to allow entries only, not to deny {}: a deny that \
                     lapsed would open what it closed",
                    rule.dest
                )));
            }
            Ok(Self(rule))
        }
    }
    let list = Vec::<DenyEntry>::deserialize(d)?;
    Ok(list.into_iter().map(|e| e.0).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_entries_are_destinations() {
        let r: Rule = serde_json::from_str(r#"{"domain": "API.example.test."}"#).expect("valid");
        assert_eq!(r.http, None);
        assert_eq!(
            serde_json::to_string(&r).expect("ser"),
            r#"{"domain":"api.example.test"}"#
        );
    }

    #[test]
    fn qualified_entries_round_trip() {
        let text = r#"{"mode":"audit","http":{"methods":["POST"],"paths":["/gists"]},"wildcard_domain":"*.github.test"}"#;
        let r: Rule = serde_json::from_str(text).expect("valid");
        assert_eq!(r.mode, Mode::Audit);
        assert_eq!(
            r.to_string(),
            "wildcard_domain *.github.test http POST /gists (audit)"
        );
        let out = serde_json::to_value(&r).expect("ser");
        assert_eq!(
            out,
            serde_json::json!({"wildcard_domain": "*.github.test", "http": {"methods": ["POST"], "paths": ["/gists"]}, "mode": "audit"})
        );
        let ro: Rule = serde_json::from_str(r#"{"domain": "github.test", "http": "read_only"}"#)
            .expect("valid");
        assert!(ro.enforced_http());
    }

    #[test]
    fn entries_with_streams_round_trip_in_normal_form() {
        for (text, normal, shown) in [
            (
                r#"{"streams": ["ssh"], "cidr": "203.0.113.0/24"}"#,
                r#"{"cidr":"203.0.113.0/24","streams":["ssh"]}"#,
                "cidr 203.0.113.0/24 streams [ssh]",
            ),
            (
                r#"{"domain": "Git.Example.test", "streams": []}"#,
                r#"{"domain":"git.example.test","streams":[]}"#,
                "domain git.example.test streams []",
            ),
        ] {
            let r: Rule = serde_json::from_str(text).expect(text);
            assert_eq!(serde_json::to_string(&r).expect("ser"), normal);
            assert_eq!(r.to_string(), shown);
            let again: Rule = serde_json::from_str(normal).expect(normal);
            assert_eq!(again, r);
            // An entry with streams is not the bare destination: composition
            // adds a profile's whole-destination allow beside it.
            assert!(r != r.dest);
        }
    }

    #[test]
    fn errors_name_the_value() {
        for (text, needle) in [
            (
                r#"{"ip": "203.0.113.1", "http": "read_only"}"#,
                "not ip \"203.0.113.1\"",
            ),
            (
                r#"{"domain": "a.test", "mode": "audit"}"#,
                "mode applies only to an entry with http",
            ),
            (
                r#"{"domain": "a.test", "http": "read_only", "http": "read_only"}"#,
                "duplicate key \"http\"",
            ),
            (
                r#"{"domain": "a.test", "mode": "warn", "http": "read_only"}"#,
                "unknown variant `warn`",
            ),
            (
                r#"{"domain": "a.test", "domain": "b.test"}"#,
                "duplicate key \"domain\"",
            ),
            (
                r#"{"domain": "a.test", "ip": "203.0.113.1"}"#,
                "exactly one of",
            ),
            (r#"{"http": "read_only"}"#, "exactly one of"),
            (
                r#"{"domain": "a.test", "port": 443}"#,
                "unsupported selector \"port\"",
            ),
            (
                r#"{"domain": "a.test", "http": "read_only", "streams": ["ssh"]}"#,
                "streams and http on one entry (domain \"a.test\")",
            ),
            (
                r#"{"ip": "203.0.113.1", "streams": ["ssh"], "streams": []}"#,
                "duplicate key \"streams\"",
            ),
            (
                r#"{"ip": "203.0.113.1", "streams": ["rdp"]}"#,
                "unknown variant `rdp`",
            ),
            (
                r#"{"ip": "203.0.113.1", "streams": "ssh"}"#,
                "a list of stream protocols",
            ),
        ] {
            let e = serde_json::from_str::<Rule>(text)
                .expect_err(text)
                .to_string();
            assert!(e.contains(needle), "{text}: {e}");
        }
    }
}
