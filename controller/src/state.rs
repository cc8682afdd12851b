//! A sandbox's lifecycle state and an operation's kind and state: the
//! database keeps the text (`sandboxes.state`, `operations.kind`,
//! `operations.state`, `approvals.scope`), read through `FromStr` at the boundary, so an
//! unknown value is an error, never a guess.

use std::fmt;
use std::str::FromStr;

/// The states a sandbox can be in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SandboxState {
    Creating,
    Running,
    Stopped,
    Paused,
    Suspended,
    Failed,
    Destroyed,
}

impl SandboxState {
    /// Every state, in the order the API lists them.
    pub const ALL: [Self; 7] = [
        Self::Creating,
        Self::Running,
        Self::Stopped,
        Self::Paused,
        Self::Suspended,
        Self::Failed,
        Self::Destroyed,
    ];

    /// The text the database and the API carry.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Creating => "creating",
            Self::Running => "running",
            Self::Stopped => "stopped",
            Self::Paused => "paused",
            Self::Suspended => "suspended",
            Self::Failed => "failed",
            Self::Destroyed => "destroyed",
        }
    }

    /// Placed and alive: running, stopped, paused or suspended.
    pub fn is_live(self) -> bool {
        matches!(
            self,
            Self::Running | Self::Stopped | Self::Paused | Self::Suspended
        )
    }

    /// Gone from its gateway: failed or destroyed.
    pub fn is_ended(self) -> bool {
        matches!(self, Self::Failed | Self::Destroyed)
    }

    /// The state `action` leads to from this one, if it is allowed.
    pub fn after(self, action: &str) -> Option<Self> {
        use SandboxState::*;
        Some(match (action, self) {
            ("stop", Running | Paused) => Stopped,
            ("start", Stopped) => Running,
            ("pause", Running) => Paused,
            ("resume", Paused) => Running,
            ("suspend", Running | Paused) => Suspended,
            ("restore", Suspended) => Running,
            ("rollback", s @ (Running | Stopped | Paused)) => s,
            ("destroy", Running | Stopped | Paused | Suspended | Failed | Creating) => Destroyed,
            _ => return None,
        })
    }
}

impl fmt::Display for SandboxState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SandboxState {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|state| state.as_str() == s)
            .ok_or_else(|| format!("sandbox state {s:?} is not one of {}", names()))
    }
}

impl serde::Serialize for SandboxState {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// What a queued operation does (`operations.kind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OperationKind {
    Create,
    Fork,
    Claim,
}

impl OperationKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Create => "create",
            Self::Fork => "fork",
            Self::Claim => "claim",
        }
    }
}

impl FromStr for OperationKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        [Self::Create, Self::Fork, Self::Claim]
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| format!("unknown operation kind {s:?}"))
    }
}

/// Where a queued operation is (`operations.state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OperationState {
    Queued,
    Succeeded,
    Failed,
}

impl OperationState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
        }
    }
}

impl fmt::Display for OperationState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for OperationState {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        [Self::Queued, Self::Succeeded, Self::Failed]
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| format!("operation state {s:?} is not one of queued, succeeded, failed"))
    }
}

impl serde::Serialize for OperationState {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// What an approval reaches (`approvals.scope`): the sandbox, its
/// template within the tenant, or the whole tenant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    Sandbox,
    Template,
    Tenant,
}

impl Scope {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Sandbox => "sandbox",
            Self::Template => "template",
            Self::Tenant => "tenant",
        }
    }
}

impl FromStr for Scope {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        [Self::Sandbox, Self::Template, Self::Tenant]
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| format!("approval scope {s:?} is not one of sandbox, template, tenant"))
    }
}

/// The states' names, comma-separated.
pub fn names() -> String {
    let all: Vec<&str> = SandboxState::ALL.iter().map(|s| s.as_str()).collect();
    all.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_round_trips_and_unknown_is_refused() {
        for s in SandboxState::ALL {
            assert_eq!(s.as_str().parse::<SandboxState>(), Ok(s));
        }
        assert!("Running".parse::<SandboxState>().is_err());
        assert!("".parse::<SandboxState>().is_err());
        for k in [
            OperationKind::Create,
            OperationKind::Fork,
            OperationKind::Claim,
        ] {
            assert_eq!(k.as_str().parse::<OperationKind>(), Ok(k));
        }
        assert_eq!(
            "delete".parse::<OperationKind>(),
            Err("unknown operation kind \"delete\"".to_owned())
        );
        for s in [
            OperationState::Queued,
            OperationState::Succeeded,
            OperationState::Failed,
        ] {
            assert_eq!(s.as_str().parse::<OperationState>(), Ok(s));
        }
        assert!("done".parse::<OperationState>().is_err());
        for s in [Scope::Sandbox, Scope::Template, Scope::Tenant] {
            assert_eq!(s.as_str().parse::<Scope>(), Ok(s));
            assert_eq!(serde_json::to_value(s).ok(), Some(s.as_str().into()));
        }
        assert!("world".parse::<Scope>().is_err());
    }

    #[test]
    fn transitions_follow_the_table() {
        use SandboxState::*;
        assert_eq!(Running.after("stop"), Some(Stopped));
        assert_eq!(Paused.after("rollback"), Some(Paused));
        assert_eq!(Suspended.after("rollback"), None);
        assert_eq!(Creating.after("destroy"), Some(Destroyed));
        assert_eq!(Destroyed.after("destroy"), None);
        assert_eq!(Running.after("fly"), None);
    }
}
