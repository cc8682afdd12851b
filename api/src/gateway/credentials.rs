//! A host-bound credential as pushed: a reference to where the gateway
//! reads its value, never the value, and the hosts the value may go to.
//! The gateway's `credentials` module holds the values and applies them.

use std::fmt;
use std::path::PathBuf;

use egress_policy::{Destination, Hostname, Kind};
use http::header::{HeaderName, HeaderValue};
use serde::{Deserialize, Serialize};

/// Most credentials per sandbox.
pub const MAX_CREDENTIALS: usize = 32;
/// Most hosts per credential.
const MAX_HOSTS: usize = 64;
/// Shortest placeholder: a short one could occur in ordinary text.
const MIN_PLACEHOLDER: usize = 8;
const MAX_PLACEHOLDER: usize = 256;

/// One credential of a sandbox, as pushed (no value).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Credential {
    pub name: String,
    pub placeholder: String,
    pub hosts: Vec<HostPattern>,
    pub inject: Inject,
    pub source: Source,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub require: bool,
}

/// A host a credential is for: `api.github.test` or `*.github.test`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostPattern(Destination);

/// Where the value goes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawInject", into = "RawInject")]
pub enum Inject {
    /// The placeholder is replaced in this header; the header is added
    /// (`format` with `{value}`) when the sandbox sent none.
    Header { header: HeaderName, format: String },
    /// The placeholder is replaced in every header.
    ReplaceHeaders,
}

/// Where the gateway reads the value.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "RawSource", into = "RawSource")]
pub enum Source {
    File(PathBuf),
    Env(String),
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawInject {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    header: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    format: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    replace: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSource {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    file: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    env: Option<String>,
}

/// Headers a credential may not be injected into: they frame or route the
/// request, and the gateway sets or strips them itself.
const FORBIDDEN_HEADERS: &[&str] = &[
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "te",
    "trailer",
    "upgrade",
    "proxy-authorization",
    "proxy-authenticate",
];

// === impl HostPattern ===

impl HostPattern {
    pub fn destination(&self) -> &Destination {
        &self.0
    }

    pub fn matches(&self, name: &Hostname) -> bool {
        match &self.0 {
            Destination::Domain(d) => d == name,
            Destination::WildcardDomain(w) => w.matches(name),
            Destination::Ip(_) | Destination::Cidr(_) => false,
        }
    }
}

impl Serialize for HostPattern {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0.value())
    }
}

impl<'de> Deserialize<'de> for HostPattern {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        let kind = if text.starts_with("*.") {
            Kind::WildcardDomain
        } else {
            Kind::Domain
        };
        Destination::parse(kind, &text)
            .map(Self)
            .map_err(serde::de::Error::custom)
    }
}

// === impl Inject / Source ===

impl TryFrom<RawInject> for Inject {
    type Error = String;
    fn try_from(raw: RawInject) -> Result<Self, String> {
        const SHAPE: &str = r#"expected {"header": "<name>", "format": "... {value} ..."} or {"replace": "headers"}"#;
        match raw {
            RawInject {
                header: Some(header),
                format: Some(format),
                replace: None,
            } => {
                let name = HeaderName::from_bytes(header.as_bytes())
                    .map_err(|_| format!("invalid header name {header:?}"))?;
                if FORBIDDEN_HEADERS.contains(&name.as_str()) {
                    return Err(format!(
                        "header {header:?} frames or routes the request: a credential cannot go there"
                    ));
                }
                if format.matches("{value}").count() != 1 {
                    return Err(format!(
                        "format {format:?} must contain {{value}} exactly once"
                    ));
                }
                if HeaderValue::from_str(&format.replace("{value}", "")).is_err() {
                    return Err(format!("format {format:?} is not a valid header value"));
                }
                Ok(Self::Header {
                    header: name,
                    format,
                })
            }
            RawInject {
                header: None,
                format: None,
                replace: Some(r),
            } if r == "headers" => Ok(Self::ReplaceHeaders),
            RawInject {
                replace: Some(r), ..
            } if r != "headers" => Err(format!("unknown replace {r:?}: {SHAPE}")),
            _ => Err(SHAPE.to_owned()),
        }
    }
}

impl From<Inject> for RawInject {
    fn from(i: Inject) -> Self {
        match i {
            Inject::Header { header, format } => Self {
                header: Some(header.as_str().to_owned()),
                format: Some(format),
                replace: None,
            },
            Inject::ReplaceHeaders => Self {
                header: None,
                format: None,
                replace: Some("headers".into()),
            },
        }
    }
}

impl TryFrom<RawSource> for Source {
    type Error = String;
    fn try_from(raw: RawSource) -> Result<Self, String> {
        match raw {
            RawSource {
                file: Some(path),
                env: None,
            } if path.is_absolute() => Ok(Self::File(path)),
            RawSource {
                file: Some(path),
                env: None,
            } => Err(format!("file {path:?} must be an absolute path")),
            RawSource {
                file: None,
                env: Some(name),
            } => {
                let ok = name
                    .bytes()
                    .next()
                    .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
                    && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
                    && name.len() <= 128;
                if ok {
                    Ok(Self::Env(name))
                } else {
                    Err(format!("invalid environment variable name {name:?}"))
                }
            }
            _ => Err(r#"expected {"file": "/path"} or {"env": "NAME"}"#.to_owned()),
        }
    }
}

impl From<Source> for RawSource {
    fn from(s: Source) -> Self {
        match s {
            Source::File(p) => Self {
                file: Some(p),
                env: None,
            },
            Source::Env(n) => Self {
                file: None,
                env: Some(n),
            },
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::File(p) => write!(f, "file {:?}", p.display().to_string()),
            Self::Env(n) => write!(f, "environment variable {n:?}"),
        }
    }
}

/// Checks a sandbox's credentials; the error names the field and the value
/// (never a credential's value: the document does not hold one).
pub fn validate(list: &[Credential]) -> Result<(), String> {
    if list.len() > MAX_CREDENTIALS {
        return Err(format!("credentials: more than {MAX_CREDENTIALS}"));
    }
    for (i, c) in list.iter().enumerate() {
        let at = |field: &str| format!("credentials[{i}].{field}");
        let name_ok = !c.name.is_empty()
            && c.name.len() <= 64
            && c.name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        if !name_ok {
            return Err(format!(
                "{}: invalid name {:?}: 1 to 64 letters, digits, '-', '_' or '.'",
                at("name"),
                c.name
            ));
        }
        let p = &c.placeholder;
        let placeholder_ok = (MIN_PLACEHOLDER..=MAX_PLACEHOLDER).contains(&p.len())
            && p.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        if !placeholder_ok {
            return Err(format!(
                "{}: invalid placeholder {p:?}: {MIN_PLACEHOLDER} to {MAX_PLACEHOLDER} letters, digits, '-', '_' or '.'",
                at("placeholder")
            ));
        }
        if c.hosts.is_empty() || c.hosts.len() > MAX_HOSTS {
            return Err(format!("{}: 1 to {MAX_HOSTS} hosts", at("hosts")));
        }
        for (j, other) in list.iter().enumerate().take(i) {
            if other.name == c.name {
                return Err(format!(
                    "{}: name {:?} is also credentials[{j}]'s",
                    at("name"),
                    c.name
                ));
            }
            if other.placeholder.contains(p.as_str()) || p.contains(other.placeholder.as_str()) {
                return Err(format!(
                    "{}: placeholder {p:?} overlaps credentials[{j}]'s {:?}: each must be distinct and neither inside the other",
                    at("placeholder"),
                    other.placeholder
                ));
            }
        }
    }
    Ok(())
}
