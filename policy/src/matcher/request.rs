//! Per-request rules: the `http` qualifiers of allow and deny entries, and
//! the hosts whose credentials the gateway injects.
//!
//! - A qualified deny denies the requests it covers, on any name it matches.
//! - For allows, the most specific level that has allow entries for the
//!   request's name decides (the exact name, else the nearest wildcard): if
//!   one entry there is unqualified the request passes; otherwise it must be
//!   covered by one of that level's qualified entries. A name no allow entry
//!   names keeps the flow's verdict (address rule or default).
//! - An audited entry never blocks: a request is judged once with the
//!   enforced entries (audited ones then act as if unqualified) and, if it
//!   passes, again with every entry enforced; a deny of the second judgement
//!   is what the audit would have blocked.
//! - A flow whose requests cannot be seen (spliced with interception off, or
//!   bytes that are not HTTP) to a name with enforced request rules or
//!   credentials is denied; with interception on, one an exemption would
//!   splice is terminated instead.

use std::collections::HashMap;

use crate::dest::Destination;
use crate::http::{normalize, segments_of, Mode, PathError};
use crate::name::Hostname;
use crate::rule::Rule;

use super::ipset::RuleIdx;
use super::names::NameSet;

/// The rule that makes a request or a flow subject to per-request judgement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuleRef {
    /// An index into `allow`.
    Allow(RuleIdx),
    /// An index into `deny`.
    Deny(RuleIdx),
    /// An index into the sandbox's credentials.
    Credential(RuleIdx),
}

/// Why a request was (or, audited, would have been) refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestCode {
    /// A qualified deny covers the request.
    HttpDeny,
    /// The name's allow entries are all qualified and none covers the request.
    HttpNotAllowed,
    /// A rule needs the path, and the path reads two ways.
    AmbiguousPath,
}

/// A refusal of one request, naming the rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestDenial {
    pub code: RequestCode,
    pub rule: RuleRef,
}

/// The judgement of one request by the per-request rules.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RequestJudgement {
    /// Refused by an enforced rule.
    pub deny: Option<RequestDenial>,
    /// Passed, but an audited rule would have refused it.
    pub would_deny: Option<RequestDenial>,
}

/// Entries grouped by the level of name they match at.
#[derive(Debug, Default)]
struct Levels {
    exact: HashMap<Hostname, Vec<RuleIdx>>,
    /// Keyed by the suffix after `*.`.
    wildcard: HashMap<Hostname, Vec<RuleIdx>>,
}

impl Levels {
    fn insert(&mut self, d: &Destination, rule: RuleIdx) {
        match d {
            Destination::Domain(h) => self.exact.entry(h.clone()).or_default().push(rule),
            Destination::WildcardDomain(w) => {
                self.wildcard
                    .entry(w.suffix().clone())
                    .or_default()
                    .push(rule);
            }
            Destination::Ip(_) | Destination::Cidr(_) => {}
        }
    }

    /// The entries of the most specific level naming `name`.
    fn most_specific(&self, name: &Hostname) -> Option<&[RuleIdx]> {
        if let Some(r) = self.exact.get(name.as_str()) {
            return Some(r);
        }
        name.parents()
            .find_map(|p| self.wildcard.get(p))
            .map(Vec::as_slice)
    }

    /// Every entry naming `name`, at any level.
    fn all<'a>(&'a self, name: &'a Hostname) -> impl Iterator<Item = RuleIdx> + 'a {
        let exact = self.exact.get(name.as_str()).into_iter().flatten();
        let wild = name
            .parents()
            .filter_map(|p| self.wildcard.get(p))
            .flatten();
        exact.chain(wild).copied()
    }
}

/// The compiled per-request rules of one policy.
#[derive(Debug, Default)]
pub(crate) struct RequestRules {
    /// Every allow entry for a name, when any allow entry is qualified.
    allow: Levels,
    /// Qualified deny entries.
    deny: Levels,
    /// Hosts of the sandbox's credentials, by credential index.
    credentials: NameSet,
}

/// The request's path, normalised at most once and only if a rule needs it.
struct Path<'a> {
    target: &'a str,
    normal: Option<Result<String, PathError>>,
}

impl Path<'_> {
    /// The normal path's segments, or `None` if it reads two ways.
    fn segments(&mut self) -> Option<Vec<&str>> {
        let target = self.target;
        let normal = self.normal.get_or_insert_with(|| normalize(target));
        normal.as_ref().ok().map(|n| segments_of(n).collect())
    }
}

impl RequestRules {
    /// `None` when the policy has no qualified entry and no credentials:
    /// the matcher then never looks here.
    pub(crate) fn new<'a>(
        allow: &[Rule],
        deny: &[Rule],
        credentials: impl IntoIterator<Item = (RuleIdx, &'a Destination)>,
    ) -> Option<Self> {
        let mut rules = Self::default();
        if allow.iter().any(|r| r.http.is_some()) {
            for (i, r) in allow.iter().enumerate() {
                rules.allow.insert(&r.dest, idx(i));
            }
        }
        for (i, r) in deny.iter().enumerate().filter(|(_, r)| r.http.is_some()) {
            rules.deny.insert(&r.dest, idx(i));
        }
        for (i, d) in credentials {
            match d {
                Destination::Domain(h) => rules.credentials.insert_exact(h, i),
                Destination::WildcardDomain(w) => rules.credentials.insert_wildcard(w, i),
                Destination::Ip(_) | Destination::Cidr(_) => {}
            }
        }
        let empty = rules.allow.exact.is_empty()
            && rules.allow.wildcard.is_empty()
            && rules.deny.exact.is_empty()
            && rules.deny.wildcard.is_empty()
            && rules.credentials.is_empty();
        (!empty).then_some(rules)
    }

    /// The rule that restricts requests to `name` at its allow level: none
    /// if an entry there lets every request through (an unqualified one, or
    /// an audited one when `audit` is false).
    fn allow_restriction(
        &self,
        allow: &[Rule],
        name: &Hostname,
        audit: bool,
    ) -> Option<&[RuleIdx]> {
        let level = self.allow.most_specific(name)?;
        let open = level.iter().any(|&i| {
            rule(allow, i).is_none_or(|r| r.http.is_none() || (r.mode == Mode::Audit && !audit))
        });
        (!open).then_some(level)
    }

    /// A rule with requests the gateway must see for one of `names`, for a
    /// flow it cannot see the requests of: enforced ones only (`audit`
    /// false) or any (true, to decide whether to terminate rather than splice).
    pub(crate) fn needs_requests<'n>(
        &self,
        allow: &[Rule],
        deny: &[Rule],
        names: impl Iterator<Item = &'n Hostname> + Clone,
        audit: bool,
    ) -> Option<RuleRef> {
        let counts = |r: Option<&Rule>| r.is_some_and(|r| audit || r.mode == Mode::Enforce);
        for name in names.clone() {
            if let Some(i) = self.deny.all(name).find(|&i| counts(rule(deny, i))) {
                return Some(RuleRef::Deny(i));
            }
            if let Some(level) = self.allow_restriction(allow, name, audit) {
                return level.first().map(|&i| RuleRef::Allow(i));
            }
        }
        self.credentials
            .lookup_any(names)
            .map(|(_, i)| RuleRef::Credential(i))
    }

    /// Judges one request to `names` (the request's name; every name the
    /// destination may be, when its name is not verified).
    pub(crate) fn judge(
        &self,
        allow: &[Rule],
        deny: &[Rule],
        names: &[&Hostname],
        method: &str,
        target: &str,
    ) -> RequestJudgement {
        let mut path = Path {
            target,
            normal: None,
        };
        let deny_now = self.refusal(allow, deny, names, method, &mut path, false);
        let would_deny = match deny_now {
            Some(_) => None,
            None => self.refusal(allow, deny, names, method, &mut path, true),
        };
        RequestJudgement {
            deny: deny_now,
            would_deny,
        }
    }

    fn refusal(
        &self,
        allow: &[Rule],
        deny: &[Rule],
        names: &[&Hostname],
        method: &str,
        path: &mut Path<'_>,
        audit: bool,
    ) -> Option<RequestDenial> {
        let applies = |r: &Rule| audit || r.mode == Mode::Enforce;
        for name in names {
            for i in self.deny.all(name) {
                let Some(r) = rule(deny, i).filter(|r| applies(r)) else {
                    continue;
                };
                let Some(http) = &r.http else { continue };
                if !http.covers_method(method) {
                    continue;
                }
                let code = if !http.needs_path() {
                    RequestCode::HttpDeny
                } else {
                    match path.segments() {
                        Some(segs) if http.covers(method, &segs) => RequestCode::HttpDeny,
                        Some(_) => continue,
                        None => RequestCode::AmbiguousPath,
                    }
                };
                return Some(RequestDenial {
                    code,
                    rule: RuleRef::Deny(i),
                });
            }
        }
        for name in names {
            let Some(level) = self.allow_restriction(allow, name, audit) else {
                continue;
            };
            let mut ambiguous = None;
            let mut covered = false;
            for &i in level {
                let Some(http) = rule(allow, i)
                    .filter(|r| applies(r))
                    .and_then(|r| r.http.as_ref())
                else {
                    continue;
                };
                if !http.covers_method(method) {
                    continue;
                }
                if !http.needs_path() {
                    covered = true;
                    break;
                }
                match path.segments() {
                    Some(segs) if http.covers(method, &segs) => {
                        covered = true;
                        break;
                    }
                    Some(_) => {}
                    None => ambiguous = ambiguous.or(Some(i)),
                }
            }
            if !covered {
                let first = level.first().copied().unwrap_or_default();
                return Some(match ambiguous {
                    Some(i) => RequestDenial {
                        code: RequestCode::AmbiguousPath,
                        rule: RuleRef::Allow(i),
                    },
                    None => RequestDenial {
                        code: RequestCode::HttpNotAllowed,
                        rule: RuleRef::Allow(first),
                    },
                });
            }
        }
        None
    }
}

fn idx(i: usize) -> RuleIdx {
    RuleIdx::try_from(i).unwrap_or(RuleIdx::MAX)
}

fn rule(list: &[Rule], i: RuleIdx) -> Option<&Rule> {
    list.get(usize::try_from(i).ok()?)
}

// === impl RequestCode ===

impl RequestCode {
    /// Every code: the bounded label set.
    pub const CODES: &'static [&'static str] = &["http_deny", "http_not_allowed", "ambiguous_path"];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::HttpDeny => "http_deny",
            Self::HttpNotAllowed => "http_not_allowed",
            Self::AmbiguousPath => "ambiguous_path",
        }
    }
}

impl RuleRef {
    /// The index in its list.
    pub fn index(self) -> RuleIdx {
        match self {
            Self::Allow(i) | Self::Deny(i) | Self::Credential(i) => i,
        }
    }

    /// `allow[2]`, `deny[0]`, `credentials[1]`.
    pub fn label(self) -> String {
        match self {
            Self::Allow(i) => format!("allow[{i}]"),
            Self::Deny(i) => format!("deny[{i}]"),
            Self::Credential(i) => format!("credentials[{i}]"),
        }
    }
}
