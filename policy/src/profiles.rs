//! `SPACE_EGRESS_PROFILES`: named, additive operator policies
//! (spec/operator-egress-profiles.txt).
//!
//! ```json
//! {"audit":  {"default": true, "allow": [{"domain": "audit.example.test"}]},
//!  "sensor": {"allow": [{"domain": "sensor.example.test"}, {"cidr": "192.0.2.0/24"}],
//!             "tls_interception_exemptions": [{"domain": "sensor.example.test"}]}}
//! ```
//!
//! Unset or `{}` disables profiles. Names are lowercase letters, digits and
//! hyphens; `default` is false unless set; `allow` must be nonempty; both
//! lists take IP, CIDR and exact domain only.

use std::borrow::Borrow;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::dest::ProfileDestination;
use crate::json::{self, Entries, JsonError};

/// The environment variable this module reads.
pub const PROFILES_ENV: &str = "SPACE_EGRESS_PROFILES";

/// A valid profile name: one or more of `a-z`, `0-9`, `-`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct ProfileName(Arc<str>);

/// One operator profile.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Profile {
    /// Selected when a create sends no `X-Space-Egress-Profiles` header.
    pub default: bool,
    /// Never empty.
    pub allow: Vec<ProfileDestination>,
    pub tls_interception_exemptions: Vec<ProfileDestination>,
}

/// The configured profiles, by name. Empty means profiles are disabled.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Profiles {
    by_name: BTreeMap<ProfileName, Profile>,
}

/// Why `SPACE_EGRESS_PROFILES` was refused. Each message names the profile and field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProfilesError {
    #[error("{PROFILES_ENV}: not valid JSON: {0}")]
    Syntax(JsonError),
    #[error("{PROFILES_ENV}: {}", describe_path(.0))]
    Invalid(JsonError),
    #[error("{PROFILES_ENV}: invalid profile name {0:?}: expected one or more lowercase letters, digits and hyphens")]
    InvalidName(String),
    #[error("{PROFILES_ENV}: duplicate profile name {0:?}")]
    DuplicateName(String),
    #[error(
        "{PROFILES_ENV}: profile {0:?}: field \"allow\": must be a nonempty list of destinations"
    )]
    EmptyAllow(String),
}

/// `sensor.allow[1]` → `profile "sensor": field "allow[1]": <message>`.
fn describe_path(e: &JsonError) -> String {
    let path = e.path.trim_start_matches('.');
    if path.is_empty() {
        return e.message.clone();
    }
    let (profile, field) = match path.find(['.', '[']) {
        Some(i) => (&path[..i], path[i..].trim_start_matches('.')),
        None => (path, ""),
    };
    if field.is_empty() {
        format!("profile {profile:?}: {}", e.message)
    } else {
        format!("profile {profile:?}: field {field:?}: {}", e.message)
    }
}

#[derive(Deserialize)]
#[serde(remote = "Self", deny_unknown_fields)]
struct RawProfile {
    #[serde(default)]
    default: bool,
    // Absent and empty are the same mistake; both are reported as `EmptyAllow`.
    #[serde(default)]
    allow: Vec<ProfileDestination>,
    #[serde(default)]
    tls_interception_exemptions: Vec<ProfileDestination>,
}

json::object_only!(RawProfile);

// === impl ProfileName ===

impl ProfileName {
    pub fn parse(s: &str) -> Option<Self> {
        let valid = !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        valid.then(|| Self(Arc::from(s)))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for ProfileName {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ProfileName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for ProfileName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

// === impl Profiles ===

impl Profiles {
    /// Parses the variable's value; `None` (unset) and `{}` give no profiles.
    pub fn from_env_value(value: Option<&str>) -> Result<Self, ProfilesError> {
        let Some(text) = value else {
            return Ok(Self::default());
        };
        let entries: Entries<RawProfile> = json::parse(text).map_err(|e| {
            if e.syntax {
                ProfilesError::Syntax(e)
            } else {
                ProfilesError::Invalid(e)
            }
        })?;
        let mut by_name = BTreeMap::new();
        for (name, raw) in entries.0 {
            let Some(key) = ProfileName::parse(&name) else {
                return Err(ProfilesError::InvalidName(name));
            };
            if raw.allow.is_empty() {
                return Err(ProfilesError::EmptyAllow(name));
            }
            let profile = Profile {
                default: raw.default,
                allow: raw.allow,
                tls_interception_exemptions: raw.tls_interception_exemptions,
            };
            if by_name.insert(key, profile).is_some() {
                return Err(ProfilesError::DuplicateName(name));
            }
        }
        Ok(Self { by_name })
    }

    /// Builds a set directly (tests, tools); names must be unique.
    pub fn from_profiles(profiles: impl IntoIterator<Item = (ProfileName, Profile)>) -> Self {
        Self {
            by_name: profiles.into_iter().collect(),
        }
    }

    pub fn is_enabled(&self) -> bool {
        !self.by_name.is_empty()
    }

    pub fn get(&self, name: &str) -> Option<&Profile> {
        self.by_name.get(name)
    }

    /// The configured name equal to `name`, for use in labels without echoing input.
    pub fn name(&self, name: &str) -> Option<&ProfileName> {
        self.by_name.get_key_value(name).map(|(k, _)| k)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&ProfileName, &Profile)> {
        self.by_name.iter()
    }

    /// Names of the profiles with `default: true`, sorted.
    pub fn defaults(&self) -> impl Iterator<Item = &ProfileName> {
        self.by_name
            .iter()
            .filter(|(_, p)| p.default)
            .map(|(n, _)| n)
    }

    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }
}

#[cfg(test)]
mod tests;
