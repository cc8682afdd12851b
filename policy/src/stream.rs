//! Streams the gateway cannot read: flows that are neither TLS nor HTTP.
//!
//! The seed's meaning of an address allow is "every stream to it", so by
//! default such a stream passes like any other. An operator who wants to see
//! what leaves can refuse them (`policy.opaque_streams = "deny"` in the
//! gateway configuration, [`OpaqueStreams`]); a tenant's allow entry can
//! still name the protocols it lets through (`"streams": ["ssh"]`,
//! [`Streams`]), which the gateway recognises from a stream's first bytes
//! ([`StreamProtocol`]). An entry with `streams` lets exactly those through,
//! whatever the setting; an entry without follows the setting.

use std::fmt;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};

/// A protocol an opaque stream is recognised as from its first bytes, where
/// they admit one reading only.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StreamProtocol {
    /// An SSH-2.0 identification string (RFC 4253 §4.2).
    Ssh,
}

/// The gateway's setting for streams it cannot read (`policy.opaque_streams`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OpaqueStreams {
    /// An allow lets every stream through, as the seed defines an address
    /// allow; an entry's `streams` narrows it to the protocols it names.
    #[default]
    Allow,
    /// Only a stream whose protocol an allow entry's `streams` names passes;
    /// others, and every stream the `default` alone would allow, are refused
    /// (`unreadable_stream`).
    Deny,
}

/// The protocols an allow entry lets through as opaque streams, in normal
/// form (sorted). Empty: none.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize)]
pub struct Streams(Vec<StreamProtocol>);

// === impl StreamProtocol ===

impl StreamProtocol {
    /// Every protocol, in the order of [`StreamProtocol::index`].
    pub const ALL: [Self; 1] = [Self::Ssh];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ssh => "ssh",
        }
    }

    /// Its position in [`StreamProtocol::ALL`].
    pub fn index(self) -> usize {
        match self {
            Self::Ssh => 0,
        }
    }
}

impl fmt::Display for StreamProtocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

// === impl OpaqueStreams ===

impl OpaqueStreams {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Allow => "allow",
            Self::Deny => "deny",
        }
    }
}

// === impl Streams ===

impl Streams {
    pub fn new(mut list: Vec<StreamProtocol>) -> Result<Self, String> {
        list.sort_unstable();
        if let Some(w) = list.windows(2).find(|w| w[0] == w[1]) {
            return Err(format!("streams lists {:?} twice", w[0].as_str()));
        }
        Ok(Self(list))
    }

    pub fn contains(&self, p: StreamProtocol) -> bool {
        self.0.contains(&p)
    }

    pub fn as_slice(&self) -> &[StreamProtocol] {
        &self.0
    }
}

impl fmt::Display for Streams {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.0.iter().map(|p| p.as_str()).collect();
        write!(f, "[{}]", names.join(", "))
    }
}

impl<'de> Deserialize<'de> for Streams {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ListVisitor;
        impl<'de> Visitor<'de> for ListVisitor {
            type Value = Streams;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list of stream protocols (\"ssh\")")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Streams, A::Error> {
                let mut list = Vec::new();
                while let Some(p) = seq.next_element::<StreamProtocol>()? {
                    list.push(p);
                }
                Streams::new(list).map_err(de::Error::custom)
            }
        }
        d.deserialize_seq(ListVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_parse_in_normal_form_and_refuse_repeats_and_unknown_names() {
        let s: Streams = serde_json::from_str(r#"["ssh"]"#).expect("valid");
        assert_eq!(s.as_slice(), [StreamProtocol::Ssh]);
        assert_eq!(serde_json::to_string(&s).expect("ser"), r#"["ssh"]"#);
        let none: Streams = serde_json::from_str("[]").expect("valid");
        assert_eq!(none.as_slice(), []);
        for (text, needle) in [
            (r#"["ssh", "ssh"]"#, "streams lists \"ssh\" twice"),
            (r#"["telnet"]"#, "unknown variant `telnet`, expected `ssh`"),
            (r#"["SSH"]"#, "unknown variant `SSH`"),
            (r#""ssh""#, "a list of stream protocols"),
        ] {
            let e = serde_json::from_str::<Streams>(text)
                .expect_err(text)
                .to_string();
            assert!(e.contains(needle), "{text}: {e}");
        }
    }

    #[test]
    fn every_protocol_has_its_index() {
        for (i, p) in StreamProtocol::ALL.iter().enumerate() {
            assert_eq!(p.index(), i);
        }
    }
}
