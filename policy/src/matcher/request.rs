//! Per-request rules: the `http` qualifiers of allow and deny entries, and
//! the hosts whose credentials the gateway injects.
//!
//! - A qualified deny denies the requests it covers, on any name it matches.
//! - For allows, the most specific level that has allow entries for the
//!   request's name decides (the exact name, else the nearest wildcard): if
//!   one entry there is unqualified the request passes; otherwise it must be
//!   covered by one of that level's qualified entries. A name no allow entry
//!   names keeps the flow's verdict (address rule or default). An entry with
//!   `streams` is about opaque streams and no level's entry.
//! - An audited entry never blocks: a request is judged once with the
//!   enforced entries (audited ones then act as if unqualified) and, if it
//!   passes, again with every entry enforced; a deny of the second judgement
//!   is what the audit would have blocked.
//! - A flow whose requests cannot be seen (spliced with interception off, or
//!   bytes that are not HTTP) to a name with enforced request rules or
//!   credentials is denied; with interception on, one an exemption would
//!   splice is terminated instead. A stream whose protocol an entry's
//!   `streams` names is held back only by a qualified deny.

use std::borrow::Cow;
use std::collections::HashMap;

use crate::dest::Destination;
use crate::http::{normal_path, segments_of, HttpMatch, Mode, READ_ONLY_METHODS};
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

/// The entries of one level (one exact name, or one wildcard suffix), their
/// path patterns in a segment trie, so finding the entries that cover a
/// path costs one step per segment of the path, not one per entry; and the
/// first entry for each method, so finding one that covers a method costs
/// a lookup, not one step per entry (a level may hold tens of thousands).
#[derive(Debug, Default)]
struct Level {
    /// The level's first entry.
    first: First,
    /// Qualified entries without path patterns (method-only, read_only),
    /// by method.
    no_path: ByMethod,
    /// Entries with path patterns, by method (for a path that reads two
    /// ways: the first that would have needed it).
    with_path: ByMethod,
    /// Entries with path patterns.
    paths: PathTrie,
    /// The patterns put in `paths` at once, sorted, once every entry is
    /// read ([`PathTrie::build`]).
    pending: Vec<(Vec<Option<Box<str>>>, RuleIdx)>,
    /// An entry here is unqualified: every request to the name passes.
    open: bool,
    /// An entry here is unqualified or audited: every request passes
    /// while audited entries are not enforced.
    open_enforced: bool,
}

/// Entries grouped by the level of name they match at.
#[derive(Debug, Default)]
struct Levels {
    exact: HashMap<Hostname, Level>,
    /// Keyed by the suffix after `*.`.
    wildcard: HashMap<Hostname, Level>,
    /// Path literals in lower case, looked up with the path in lower case
    /// (denies: an origin that routes without regard to case, as Express,
    /// ASP.NET and IIS do, takes `/ADMIN` for `/admin`, so a deny must too).
    fold_case: bool,
}

impl Levels {
    fn insert(&mut self, r: &Rule, rule: RuleIdx) {
        if r.streams.is_some() {
            // An entry with `streams` speaks for opaque streams only: beside
            // a qualified entry for the same name it must not open the
            // name's requests (the error for `streams` beside `http` tells
            // the tenant to write exactly that pair).
            return;
        }
        let level = match &r.dest {
            Destination::Domain(h) => self.exact.entry(h.clone()).or_default(),
            Destination::WildcardDomain(w) => self.wildcard.entry(w.suffix().clone()).or_default(),
            Destination::Ip(_) | Destination::Cidr(_) => return,
        };
        let enforced = r.mode == Mode::Enforce;
        level.first.note(rule, enforced);
        level.open |= r.http.is_none();
        level.open_enforced |= !r.enforced_http();
        let paths = r.http.as_ref().map_or(&[][..], |h| h.paths());
        if let Some(http) = &r.http {
            match paths.is_empty() {
                true => level.no_path.note(http, rule, enforced),
                false => level.with_path.note(http, rule, enforced),
            }
        }
        for p in paths {
            let segments = p.segments().map(|s| {
                s.map(|s| match self.fold_case {
                    true => fold_case(s).into_boxed_str(),
                    false => s.into(),
                })
            });
            level.pending.push((segments.collect(), rule));
        }
    }

    /// The most specific level naming `name`.
    fn most_specific(&self, name: &Hostname) -> Option<&Level> {
        if let Some(l) = self.exact.get(name.as_str()) {
            return Some(l);
        }
        name.parents().find_map(|p| self.wildcard.get(p))
    }

    /// Every level naming `name`.
    fn all<'a>(&'a self, name: &'a Hostname) -> impl Iterator<Item = &'a Level> + 'a {
        let exact = self.exact.get(name.as_str()).into_iter();
        exact.chain(name.parents().filter_map(|p| self.wildcard.get(p)))
    }
}

impl Level {
    /// The entries whose path patterns cover the normal path `segments`,
    /// the method aside.
    fn covering(&self, segments: &[&str], out: &mut Vec<RuleIdx>) {
        out.clear();
        self.paths.covering(segments, out);
    }

    /// [`Self::covering`] for denies: the path, and the path with its last
    /// segment cut at its first `.` past the first character. Rails routes
    /// `/admin.json` to `/admin` (a format), and Spring's suffix pattern
    /// matching `/admin.anything`, so a deny of `/admin` covers them.
    fn covering_for_deny(&self, segments: &[&str], out: &mut Vec<RuleIdx>) {
        self.covering(segments, out);
        let Some((last, before)) = segments.split_last() else {
            return;
        };
        let Some((dot, _)) = last.char_indices().skip(1).find(|(_, c)| *c == '.') else {
            return;
        };
        let mut stem: Vec<&str> = before.to_vec();
        stem.push(&last[..dot]);
        self.paths.covering(&stem, out);
    }
}

/// The first entry (the lowest index) of a kind: among the enforced ones,
/// and among all.
#[derive(Clone, Copy, Debug, Default)]
struct First([Option<RuleIdx>; 2]);

impl First {
    /// Entries are noted in the order of their indexes.
    fn note(&mut self, rule: RuleIdx, enforced: bool) {
        if enforced {
            self.0[0].get_or_insert(rule);
        }
        self.0[1].get_or_insert(rule);
    }

    /// The first enforced entry; with `audit`, the first of all.
    fn get(&self, audit: bool) -> Option<RuleIdx> {
        self.0[usize::from(audit)]
    }
}

/// Qualified entries by the methods they cover.
#[derive(Debug, Default)]
struct ByMethod {
    /// Entries that name no method (any method).
    any: First,
    /// By method in upper case (methods are compared without regard to
    /// ASCII case, [`HttpMatch::covers_method`]).
    methods: HashMap<Box<str>, First>,
}

impl ByMethod {
    fn note(&mut self, http: &HttpMatch, rule: RuleIdx, enforced: bool) {
        let methods: &[String] = match http {
            HttpMatch::ReadOnly => {
                for m in READ_ONLY_METHODS {
                    self.methods
                        .entry(m.into())
                        .or_default()
                        .note(rule, enforced);
                }
                return;
            }
            HttpMatch::Requests { methods, .. } => methods,
        };
        if methods.is_empty() {
            self.any.note(rule, enforced);
        }
        for m in methods {
            let key = m.to_ascii_uppercase().into_boxed_str();
            self.methods.entry(key).or_default().note(rule, enforced);
        }
    }

    /// The first entry covering `method` (enforced; with `audit`, any).
    fn first(&self, method: &str, audit: bool) -> Option<RuleIdx> {
        let named = self.methods.get(&*method_key(method));
        let named = named.and_then(|f| f.get(audit));
        lowest(self.any.get(audit), named)
    }

    /// [`Self::first`] for denies: a deny of `GET` covers `HEAD` too
    /// ([`covers_for_deny`]).
    fn first_for_deny(&self, method: &str, audit: bool) -> Option<RuleIdx> {
        let head = method.eq_ignore_ascii_case("HEAD");
        let get = head.then(|| self.first("GET", audit)).flatten();
        lowest(self.first(method, audit), get)
    }
}

/// A method as [`ByMethod`] keys it.
fn method_key(method: &str) -> Cow<'_, str> {
    match method.bytes().any(|b| b.is_ascii_lowercase()) {
        true => Cow::Owned(method.to_ascii_uppercase()),
        false => Cow::Borrowed(method),
    }
}

fn lowest(a: Option<RuleIdx>, b: Option<RuleIdx>) -> Option<RuleIdx> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Path patterns by segment: a node holds the entries whose pattern ends
/// there (covering every path below it), a child per literal segment
/// (sorted, searched by halves: a map per node cost some 400 bytes each,
/// and a policy's patterns may make hundreds of thousands of nodes), and
/// one for `*`.
#[derive(Debug, Default)]
struct PathTrie {
    rules: Vec<RuleIdx>,
    literal: Vec<(Box<str>, Self)>,
    any: Option<Box<Self>>,
}

impl PathTrie {
    /// Puts in every pattern of `pending`, sorted first: each child then
    /// comes after every one already in its list, so no insertion moves
    /// the others (a policy's patterns in descending order would move
    /// every child at every insertion: the square of their number).
    fn build(&mut self, mut pending: Vec<(Vec<Option<Box<str>>>, RuleIdx)>) {
        pending.sort_unstable();
        for (segments, rule) in &pending {
            self.insert(segments.iter().map(Option::as_deref), *rule);
        }
        self.shrink();
    }

    fn insert<'a>(&mut self, mut segments: impl Iterator<Item = Option<&'a str>>, rule: RuleIdx) {
        match segments.next() {
            None => {
                if self.rules.last() != Some(&rule) {
                    self.rules.push(rule);
                }
            }
            Some(Some(literal)) => {
                let at = match self.literal.binary_search_by(|(k, _)| (**k).cmp(literal)) {
                    Ok(at) => at,
                    Err(at) => {
                        self.literal.insert(at, (literal.into(), Self::default()));
                        at
                    }
                };
                self.literal[at].1.insert(segments, rule);
            }
            Some(None) => self.any.get_or_insert_default().insert(segments, rule),
        }
    }

    /// Gives back what the children's lists hold beyond their length,
    /// once every pattern is in.
    fn shrink(&mut self) {
        self.literal.shrink_to_fit();
        for (_, child) in &mut self.literal {
            child.shrink();
        }
        if let Some(any) = &mut self.any {
            any.shrink();
        }
    }

    fn covering(&self, path: &[&str], out: &mut Vec<RuleIdx>) {
        out.extend_from_slice(&self.rules);
        if let Some((first, rest)) = path.split_first() {
            if let Ok(at) = self.literal.binary_search_by(|(k, _)| (**k).cmp(*first)) {
                self.literal[at].1.covering(rest, out);
            }
            if let Some(any) = &self.any {
                any.covering(rest, out);
            }
        }
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
    /// Whether any qualified entry names paths (else the path is never read).
    any_paths: bool,
    /// Whether any qualified deny names paths (else no path is lower-cased).
    deny_paths: bool,
    /// Whether any qualified entry is audited (else a passing request is
    /// not judged a second time).
    any_audit: bool,
}

/// The request's normal path as segments; `None`: it reads two ways (or,
/// when no rule needs a path, it was never read). The second: the same in
/// lower case, for denies.
struct Path<'a>(Option<&'a [&'a str]>, Option<&'a [&'a str]>);

impl RequestRules {
    /// `None` when the policy has no qualified entry and no credentials:
    /// the matcher then never looks here.
    pub(crate) fn new<'a>(
        allow: &[Rule],
        deny: &[Rule],
        credentials: impl IntoIterator<Item = (RuleIdx, &'a Destination)>,
        now: time::OffsetDateTime,
    ) -> Option<Self> {
        let mut rules = Self::default();
        rules.deny.fold_case = true;
        if allow.iter().any(|r| r.http.is_some()) {
            // An entry past its `until` is not there.
            for (i, r) in allow.iter().enumerate().filter(|(_, r)| r.in_force(now)) {
                rules.allow.insert(r, idx(i));
            }
        }
        for (i, r) in deny.iter().enumerate().filter(|(_, r)| r.http.is_some()) {
            rules.deny.insert(r, idx(i));
        }
        for levels in [&mut rules.allow, &mut rules.deny] {
            for level in levels
                .exact
                .values_mut()
                .chain(levels.wildcard.values_mut())
            {
                let pending = std::mem::take(&mut level.pending);
                level.paths.build(pending);
            }
        }
        for (i, d) in credentials {
            match d {
                Destination::Domain(h) => rules.credentials.insert_exact(h, i),
                Destination::WildcardDomain(w) => rules.credentials.insert_wildcard(w, i),
                Destination::Ip(_) | Destination::Cidr(_) => {}
            }
        }
        let qualified = allow
            .iter()
            .chain(deny)
            .filter_map(|r| Some((r.http.as_ref()?, r.mode)));
        for (http, mode) in qualified {
            rules.any_paths |= http.needs_path();
            rules.any_audit |= mode == Mode::Audit;
        }
        rules.deny_paths = deny
            .iter()
            .filter_map(|r| r.http.as_ref())
            .any(HttpMatch::needs_path);
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
    fn allow_restriction(&self, name: &Hostname, audit: bool) -> Option<&Level> {
        let level = self.allow.most_specific(name)?;
        let open = if audit {
            level.open
        } else {
            level.open_enforced
        };
        (!open).then_some(level)
    }

    /// A rule with requests the gateway must see for one of `names`, for a
    /// flow it cannot see the requests of: enforced ones only (`audit`
    /// false) or any (true, to decide whether to terminate rather than splice).
    /// For a stream an entry's `streams` names (`named`), only a qualified
    /// deny counts: the tenant let that protocol through, and the allow
    /// qualifiers and credentials of the name are about its HTTP requests.
    pub(crate) fn needs_requests<'n>(
        &self,
        names: impl Iterator<Item = &'n Hostname> + Clone,
        audit: bool,
        named: bool,
    ) -> Option<RuleRef> {
        for name in names.clone() {
            if let Some(i) = self.deny.all(name).find_map(|l| l.first.get(audit)) {
                return Some(RuleRef::Deny(i));
            }
            if named {
                continue;
            }
            if let Some(level) = self.allow_restriction(name, audit) {
                return level.first.get(true).map(RuleRef::Allow);
            }
        }
        if named {
            return None;
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
        // Normalised once, and only if a rule needs the path.
        let normal = self.any_paths.then(|| normal_path(target));
        let segments: Option<Vec<&str>> = match &normal {
            Some(Ok(n)) => Some(segments_of(n).collect()),
            _ => None,
        };
        // Lower case for denies that name paths, only when a letter changes.
        let fold = |s: &str| s.chars().any(|c| c.is_uppercase() || !c.is_ascii());
        let owned: Option<Vec<String>> = segments
            .as_ref()
            .filter(|segs| self.deny_paths && segs.iter().any(|s| fold(s)))
            .map(|segs| segs.iter().map(|s| fold_case(s)).collect());
        let refs: Option<Vec<&str>> = owned
            .as_ref()
            .map(|o| o.iter().map(String::as_str).collect());
        let folded = refs.as_deref().or(segments.as_deref());
        let path = Path(segments.as_deref(), folded);
        let deny_now = self.refusal(allow, deny, names, method, &path, false);
        let would_deny = match deny_now {
            Some(_) => None,
            None if self.any_audit => self.refusal(allow, deny, names, method, &path, true),
            None => None,
        };
        RequestJudgement {
            deny: deny_now,
            would_deny,
        }
    }

    /// The refusal of one judgement: the covering deny with the lowest index,
    /// else the first name whose allow rules restrict requests and do not
    /// cover this one. `audit` judges audited rules as if enforced.
    fn refusal(
        &self,
        allow: &[Rule],
        deny: &[Rule],
        names: &[&Hostname],
        method: &str,
        path: &Path<'_>,
        audit: bool,
    ) -> Option<RequestDenial> {
        let mut covering = Vec::new();
        self.denied(deny, names, method, path, audit, &mut covering)
            .or_else(|| self.not_allowed(allow, names, method, path, audit, &mut covering))
    }

    /// The deny with the lowest index that covers the request, on any name.
    fn denied(
        &self,
        deny: &[Rule],
        names: &[&Hostname],
        method: &str,
        path: &Path<'_>,
        audit: bool,
        covering: &mut Vec<RuleIdx>,
    ) -> Option<RequestDenial> {
        let mut denied: Option<RequestDenial> = None;
        let mut consider = |i: Option<RuleIdx>, code: RequestCode| match i {
            Some(i) if denied.is_none_or(|d| i < d.rule.index()) => {
                denied = Some(RequestDenial {
                    code,
                    rule: RuleRef::Deny(i),
                });
            }
            _ => {}
        };
        for name in names {
            for level in self.deny.all(name) {
                let no_path = level.no_path.first_for_deny(method, audit);
                consider(no_path, RequestCode::HttpDeny);
                let Some(segs) = path.1 else {
                    let with_path = level.with_path.first_for_deny(method, audit);
                    consider(with_path, RequestCode::AmbiguousPath);
                    continue;
                };
                level.covering_for_deny(segs, covering);
                for &i in covering.iter() {
                    let covers =
                        http_of(deny, i, audit).is_some_and(|h| covers_for_deny(h, method));
                    if covers {
                        consider(Some(i), RequestCode::HttpDeny);
                    }
                }
            }
        }
        denied
    }

    /// The first name whose allow level restricts requests and has no rule
    /// covering this one.
    fn not_allowed(
        &self,
        allow: &[Rule],
        names: &[&Hostname],
        method: &str,
        path: &Path<'_>,
        audit: bool,
        covering: &mut Vec<RuleIdx>,
    ) -> Option<RequestDenial> {
        names.iter().find_map(|name| {
            let level = self.allow_restriction(name, audit)?;
            level_refusal(level, allow, method, path, audit, covering)
        })
    }
}

/// Whether one allow level covers the request: `None` if a rule does,
/// else the denial — ambiguous if a rule would have covered it but needs
/// the path, which could not be normalised.
fn level_refusal(
    level: &Level,
    allow: &[Rule],
    method: &str,
    path: &Path<'_>,
    audit: bool,
    covering: &mut Vec<RuleIdx>,
) -> Option<RequestDenial> {
    if level.no_path.first(method, audit).is_some() {
        return None;
    }
    let ambiguous = match path.0 {
        Some(segs) => {
            level.covering(segs, covering);
            let covers =
                |&i: &RuleIdx| http_of(allow, i, audit).is_some_and(|h| h.covers_method(method));
            if covering.iter().any(covers) {
                return None;
            }
            None
        }
        None => level.with_path.first(method, audit),
    };
    let first = level.first.get(true).unwrap_or_default();
    Some(match ambiguous {
        Some(i) => RequestDenial {
            code: RequestCode::AmbiguousPath,
            rule: RuleRef::Allow(i),
        },
        None => RequestDenial {
            code: RequestCode::HttpNotAllowed,
            rule: RuleRef::Allow(first),
        },
    })
}

/// The `http` qualifier of rule `i`, if it has one and applies to this
/// judgement (enforced, or any rule when `audit`).
fn http_of(list: &[Rule], i: RuleIdx, audit: bool) -> Option<&HttpMatch> {
    rule(list, i)
        .filter(|r| audit || r.mode == Mode::Enforce)
        .and_then(|r| r.http.as_ref())
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

/// Whether a deny's `http` covers `method`: a deny of `GET` covers `HEAD`
/// too, which most servers route to the `GET` handler (Express, Rails,
/// Flask, Django's views, Go's `ServeMux`): it runs, and only its body is
/// dropped. An allow is read as written.
fn covers_for_deny(http: &crate::http::HttpMatch, method: &str) -> bool {
    http.covers_method(method) || (method.eq_ignore_ascii_case("HEAD") && http.covers_method("GET"))
}

/// A path segment in lower case as origins that fold case read it: Rust's
/// lower case, and the three letters whose case Java folds to ASCII where
/// Rust's does not (`İ` lowers to `i` in `Character.toLowerCase`; `ı` and
/// `ſ` upper to `I` and `S` in `equalsIgnoreCase`): a deny of `/admin` is
/// not passed by `/ADMİN` or `/admın`.
fn fold_case(segment: &str) -> String {
    let mut out = String::with_capacity(segment.len());
    for c in segment.chars() {
        match c {
            '\u{130}' | '\u{131}' => out.push('i'),
            '\u{17f}' => out.push('s'),
            c => out.extend(c.to_lowercase()),
        }
    }
    out
}
