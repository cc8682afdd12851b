//! Which way out a sandbox's traffic takes: `"direct"`, or one of the
//! operator's upstream proxies by name.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// The registration value that bypasses every proxy, the worker-wide one included.
pub const DIRECT: &str = "direct";

/// Longest proxy name.
pub const MAX_NAME: usize = 64;

/// A proxy's name: 1–64 letters, digits, `-`, `_`, `.`; never `direct`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProxyName(Arc<str>);

impl ProxyName {
    pub fn parse(s: &str) -> Result<Self, String> {
        let ok = (1..=MAX_NAME).contains(&s.len())
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
        if !ok {
            return Err(format!(
                "invalid proxy name {s:?}: 1 to {MAX_NAME} letters, digits, '-', '_', '.'"
            ));
        }
        if s == DIRECT {
            return Err(format!("{DIRECT:?} is reserved: it means no proxy"));
        }
        Ok(Self(s.into()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ProxyName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A sandbox's own way out (its registration's `upstream_proxy`): `"direct"`
/// or a configured proxy's name. Absent: the worker's default.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum ProxyChoice {
    Direct,
    Via(ProxyName),
}

impl TryFrom<String> for ProxyChoice {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        if s == DIRECT {
            return Ok(Self::Direct);
        }
        ProxyName::parse(&s).map(Self::Via)
    }
}

impl From<ProxyChoice> for String {
    fn from(c: ProxyChoice) -> Self {
        match c {
            ProxyChoice::Direct => DIRECT.to_owned(),
            ProxyChoice::Via(name) => name.0.to_string(),
        }
    }
}
