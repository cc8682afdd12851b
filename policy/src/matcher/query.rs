//! What `"dns": {"resolve": "policy"}` does with a question name: the same
//! name lists that judge flows, asked before the name is looked up.
//!
//! A name the platform or the tenant denies (an unqualified deny: a
//! qualified one refuses requests, not the name) is answered NXDOMAIN; with
//! `default: "deny"`, so is a name no domain or wildcard allow covers, since
//! no flow to it could be allowed by its name. Address allows do not count:
//! they allow an address, not a name.

use super::CompiledPolicy;
use crate::name::Hostname;
use crate::policy::DefaultAction;

/// The judgement on one question name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NameVerdict {
    /// Look it up.
    Resolve,
    /// A platform deny names it.
    PlatformDeny,
    /// A tenant deny names it.
    TenantDeny,
    /// `default: "deny"` and no domain or wildcard allow covers it.
    NoAllowMatch,
}

impl NameVerdict {
    /// The reason code of an NXDOMAIN (the flow reasons of the same cases).
    pub fn code(self) -> &'static str {
        match self {
            Self::Resolve => "resolve",
            Self::PlatformDeny => "platform_deny",
            Self::TenantDeny => "tenant_deny",
            Self::NoAllowMatch => "no_allow_match",
        }
    }
}

impl CompiledPolicy {
    /// Whether `name` may be looked up under `resolve: "policy"`.
    pub fn judge_name(&self, name: &Hostname) -> NameVerdict {
        if self.platform.rules.names.lookup(name).is_some() {
            return NameVerdict::PlatformDeny;
        }
        if self.deny.names.lookup(name).is_some() {
            return NameVerdict::TenantDeny;
        }
        if self.policy.default == DefaultAction::Deny && self.allow.names.lookup(name).is_none() {
            return NameVerdict::NoAllowMatch;
        }
        NameVerdict::Resolve
    }
}
