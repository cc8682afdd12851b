//! Composition of an effective policy from a tenant base, the selected
//! operator profiles and the deployment's TLS exemptions.
//!
//! - Profile allows and exemptions are appended, skipping ones already there.
//! - A default-deny base that receives profiles also receives the resolver
//!   allowances (8.8.8.8 and 1.1.1.1), so the names the profiles allow can be
//!   resolved — and attributed — through the reserved resolvers.
//! - Deployment exemptions are appended only when `tls_interception` is `on`;
//!   they never add allows.
//! - Denies are never touched: an allow composed here still loses to them.
//! - `budgets` (like `dns`) are the base's, unchanged: a profile cannot
//!   carry any, so no layer removes or loosens a budget the base set.

use std::net::{IpAddr, Ipv4Addr};

use crate::dest::Destination;
use crate::exemptions::DeploymentExemptions;
use crate::policy::{DefaultAction, Policy, TlsInterception};
use crate::profiles::{Profile, ProfileName, Profiles};
use crate::rule::Rule;
use crate::select::Admission;

/// The reserved resolvers whose DNS the gateway intercepts and attributes.
pub const RESERVED_RESOLVERS: [IpAddr; 2] = [
    IpAddr::V4(Ipv4Addr::new(8, 8, 8, 8)),
    IpAddr::V4(Ipv4Addr::new(1, 1, 1, 1)),
];

/// The result of composition.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Composed {
    pub policy: Policy,
    /// Whether anything was added to the base.
    pub changed: bool,
    /// Whether an exemption was added (profile or deployment). An inherited
    /// template policy becomes a sandbox override only when this is true or
    /// profiles added allows, i.e. when `changed` is.
    pub exemptions_added: bool,
}

/// A saved profile name that is no longer configured (the API answers 503
/// and keeps the old policy).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("saved egress profile {missing:?} is not configured on this process")]
pub struct MissingProfile {
    /// The first missing name.
    pub missing: String,
    /// `failed/unconfigured` for every missing name.
    pub admissions: Vec<Admission>,
}

/// Resolves saved names against the current configuration. Defaults are
/// never added here: they apply only at admission.
pub fn resolve_saved<'a>(
    profiles: &'a Profiles,
    saved: &[impl AsRef<str>],
) -> Result<Vec<(&'a ProfileName, &'a Profile)>, MissingProfile> {
    let mut found = Vec::with_capacity(saved.len());
    let mut missing = Vec::new();
    for name in saved {
        let name = name.as_ref();
        match profiles.name(name).zip(profiles.get(name)) {
            Some(hit) => found.push(hit),
            None => missing.push(name),
        }
    }
    match missing.first() {
        None => Ok(found),
        Some(first) => Err(MissingProfile {
            missing: (*first).to_owned(),
            admissions: missing.iter().map(|n| Admission::unconfigured(n)).collect(),
        }),
    }
}

/// Composes `base` with `profiles` (in the order given) and the deployment exemptions.
pub fn compose<'a>(
    base: &Policy,
    profiles: impl IntoIterator<Item = &'a Profile>,
    deployment: Option<&DeploymentExemptions>,
) -> Composed {
    let mut policy = base.clone();
    let mut any_profile = false;
    for profile in profiles {
        any_profile = true;
        for d in &profile.allow {
            push_new_rule(&mut policy.allow, d.get());
        }
        for d in &profile.tls_interception_exemptions {
            push_new(&mut policy.tls_interception_exemptions, d.get());
        }
    }
    if any_profile && policy.default == DefaultAction::Deny {
        for ip in RESERVED_RESOLVERS {
            push_new_rule(&mut policy.allow, &Destination::Ip(ip));
        }
    }
    if let Some(list) = deployment {
        if policy.tls_interception == TlsInterception::On {
            for d in list.iter() {
                push_new(&mut policy.tls_interception_exemptions, d.get());
            }
        }
    }
    Composed {
        changed: policy != *base,
        exemptions_added: policy.tls_interception_exemptions.len()
            != base.tls_interception_exemptions.len(),
        policy,
    }
}

/// Adds `d` as a whole-destination allow unless one is there already (a
/// qualified entry for the same name does not count: it allows less).
fn push_new_rule(list: &mut Vec<Rule>, d: &Destination) {
    if !list.iter().any(|r| r == d) {
        list.push(Rule::from(d.clone()));
    }
}

fn push_new(list: &mut Vec<Destination>, d: &Destination) {
    if !list.contains(d) {
        list.push(d.clone());
    }
}

#[cfg(test)]
mod tests;
