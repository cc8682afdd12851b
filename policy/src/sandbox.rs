//! A sandbox's identity: the key the controller pushes policies under and
//! the gateway's registry and attribution cache are kept by.

use std::borrow::Borrow;
use std::fmt;
use std::sync::Arc;

/// Longest sandbox id.
const MAX_LEN: usize = 128;

/// A sandbox id: 1 to 128 letters, digits, `-`, `_` or `.`. Cheap to clone.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SandboxId(Arc<str>);

/// Why a string is not a sandbox id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid sandbox id {shown:?}: expected 1 to 128 letters, digits, '-', '_' or '.'")]
pub struct SandboxIdError {
    /// The id, cut to 64 characters.
    shown: String,
}

impl SandboxId {
    /// Parses an id from outside (an API path, a snapshot).
    pub fn parse(id: &str) -> Result<Self, SandboxIdError> {
        let ok = !id.is_empty()
            && id.len() <= MAX_LEN
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        if ok {
            Ok(Self(Arc::from(id)))
        } else {
            Err(SandboxIdError {
                shown: id.chars().take(64).collect(),
            })
        }
    }

    /// An id to look up or compare with; no validation, since a lookup of
    /// an invalid id simply finds nothing.
    pub fn new(id: &str) -> Self {
        Self(Arc::from(id))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for SandboxId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SandboxId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for SandboxId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_short_and_plain() {
        for ok in ["a", "sb-1_x.y", &"a".repeat(128)] {
            assert_eq!(
                SandboxId::parse(ok).map(|i| i.to_string()),
                Ok(ok.to_owned())
            );
        }
        for bad in ["", "a/b", "a b", "é", &"a".repeat(129), "../x"] {
            let e = SandboxId::parse(bad).expect_err(bad);
            assert!(e.to_string().contains("invalid sandbox id"), "{e}");
        }
    }
}
