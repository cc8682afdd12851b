//! Fuzzed per-request rules against a model of them
//! (`Policy::from_json`, `CompiledPolicy::judge_request`).
//!
//! Input (`arbitrary`): 2–6 allow or deny entries, each for `api.test`,
//! `x.test`, `*.x.test` or `*.test`, without `http`, with `read_only`, or
//! with methods from GET, POST, DELETE and up to two paths of up to three
//! segments from `a`, `b`, `admin`, `ADMIN`, `*`, enforced or audited; a
//! request: one or two names, a method, path segments (`.` and empty ones
//! among them), perhaps a query, and which of its unreserved characters a
//! second spelling percent-encodes, with hex digits in which case.
//!
//! Properties (docs/policy.md, "Per-request rules"):
//!
//! - deny model: the judgement's `deny` is the enforced qualified deny with
//!   the lowest index whose destination matches one of the names and which
//!   covers the method (any case) and the normal path, both in lower case (a
//!   deny's path is matched without regard to case; and the path with its
//!   last segment cut at its first `.` past the first character, a Rails
//!   format or Spring suffix, too); `ambiguous_path` when
//!   the path has no normal form and that deny needs it. With no such deny
//!   the judgement names no deny; and when the request passes, `would_deny`
//!   is the same model with audited denies counted. The model reads the
//!   entries as written, not the segment trie of `matcher/request.rs`.
//! - spellings: a target and its spelling with unreserved characters
//!   percent-encoded are judged the same.
#![no_main]

use std::sync::{Arc, OnceLock};

use arbitrary::Arbitrary;
use egress_policy::http::{normalize, segments_of};
use egress_policy::{
    CompiledPolicy, Hostname, PlatformDenies, Policy, RequestCode, RequestDenial, RuleRef,
};
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Value};

const DESTS: &[&str] = &["api.test", "x.test", "*.x.test", "*.test"];
const NAMES: &[&str] = &["api.test", "x.test", "a.x.test", "b.a.x.test", "other.test"];
const RULE_METHODS: &[&str] = &["GET", "POST", "DELETE"];
const METHODS: &[&str] = &["GET", "POST", "DELETE", "get", "Delete", "PUT", "HEAD"];
const PATTERN_SEGS: &[&str] = &["a", "b", "admin", "ADMIN", "*"];
const SEGS: &[&str] = &[
    "a", "b", "admin", "ADMIN", "Admin", "c~d", "*", ".", "", "a.b", "admin.json", ".admin",
    "Admin.", "b.c.d",
];

#[derive(Arbitrary, Debug)]
enum Http {
    ReadOnly,
    /// A method mask (bit i: `RULE_METHODS[i]`; none: any) and paths.
    Requests(u8, Vec<Vec<u8>>),
}

#[derive(Arbitrary, Debug)]
struct Entry {
    deny: bool,
    dest: u8,
    http: Option<Http>,
    audit: bool,
}

#[derive(Arbitrary, Debug)]
struct Input {
    entries: Vec<Entry>,
    names: (u8, Option<u8>),
    method: u8,
    segments: Vec<u8>,
    query: bool,
    encode: u64,
    upper: u64,
}

fn pick<'a>(pool: &[&'a str], i: u8) -> &'a str {
    pool[usize::from(i) % pool.len()]
}

impl Http {
    fn methods(&self) -> Vec<&'static str> {
        match self {
            Self::ReadOnly => vec!["GET", "HEAD", "OPTIONS"],
            Self::Requests(methods, _) => (0..RULE_METHODS.len())
                .filter(|b| methods & (1 << b) != 0)
                .map(|b| RULE_METHODS[b])
                .collect(),
        }
    }

    /// Path patterns as segments: at most two, of at most three segments.
    fn paths(&self) -> Vec<Vec<&'static str>> {
        let Self::Requests(_, paths) = self else {
            return Vec::new();
        };
        let seg = |s: &u8| pick(PATTERN_SEGS, *s);
        paths
            .iter()
            .take(2)
            .map(|p| p.iter().take(3).map(seg).collect())
            .collect()
    }

    /// The qualifier as written; an empty list is left out.
    fn to_json(&self) -> Value {
        if let Self::ReadOnly = self {
            return json!("read_only");
        }
        let paths: Vec<String> = self
            .paths()
            .iter()
            .map(|p| format!("/{}", p.join("/")))
            .collect();
        let mut q = json!({"methods": self.methods(), "paths": paths});
        let non_empty = |v: &Value| v.as_array().is_some_and(|a| !a.is_empty());
        q.as_object_mut()
            .expect("an object")
            .retain(|_, v| non_empty(v));
        q
    }

    /// The model: methods without regard to case; paths as prefixes of whole
    /// segments, `*` any one segment, in lower case, of the path or of the
    /// path with its last segment's format suffix (from a `.` past its
    /// first character) taken off (a deny's rule).
    fn covers(&self, method: &str, path: &[String]) -> bool {
        let mut stem = path.to_vec();
        if let Some(last) = stem.last_mut() {
            if let Some(dot) = last.char_indices().skip(1).find(|(_, c)| *c == '.') {
                last.truncate(dot.0);
            }
        }
        let prefix = |path: &[String], p: &Vec<&str>| {
            p.len() <= path.len()
                && p.iter()
                    .zip(path)
                    .all(|(s, seg)| *s == "*" || s.to_lowercase() == *seg)
        };
        let paths = self.paths();
        self.covers_method(method)
            && (paths.is_empty()
                || paths.iter().any(|p| prefix(path, p) || prefix(&stem, p)))
    }

    /// Methods without regard to case; a deny of `GET` covers `HEAD` too
    /// (the model is of denies).
    fn covers_method(&self, method: &str) -> bool {
        let methods = self.methods();
        let named =
            |m: &str| methods.is_empty() || methods.iter().any(|r| r.eq_ignore_ascii_case(m));
        named(method) || (method.eq_ignore_ascii_case("HEAD") && named("GET"))
    }
}

fn dest_matches(dest: &str, name: &str) -> bool {
    match dest.strip_prefix("*.") {
        Some(suffix) => name.len() > suffix.len() + 1 && name.ends_with(&format!(".{suffix}")),
        None => name == dest,
    }
}

fn policy_json(entries: &[Entry]) -> String {
    let (mut allow, mut deny) = (Vec::new(), Vec::new());
    for e in entries {
        let dest = pick(DESTS, e.dest);
        let key = ["domain", "wildcard_domain"][usize::from(dest.starts_with('*'))];
        let mut v = json!({ key: dest });
        if let Some(http) = &e.http {
            v["http"] = http.to_json();
            v["mode"] = json!(if e.audit { "audit" } else { "enforce" });
        }
        if e.deny { &mut deny } else { &mut allow }.push(v);
    }
    json!({"tls_interception": "on", "allow": allow, "deny": deny}).to_string()
}

/// The deny model: `path` is the normal path in lower case, `None` when it
/// has no normal form; `audit` counts audited denies too.
fn model_deny(
    entries: &[Entry],
    names: &[&str],
    method: &str,
    path: Option<&[String]>,
    audit: bool,
) -> Option<RequestDenial> {
    for (i, e) in entries.iter().filter(|e| e.deny).enumerate() {
        let Some(http) = e.http.as_ref().filter(|_| audit || !e.audit) else {
            continue;
        };
        if !names.iter().any(|n| dest_matches(pick(DESTS, e.dest), n)) {
            continue;
        }
        let rule = RuleRef::Deny(u32::try_from(i).expect("few entries"));
        let code = match path {
            Some(p) if http.covers(method, p) => RequestCode::HttpDeny,
            Some(_) => continue,
            None if !http.covers_method(method) => continue,
            None if http.paths().is_empty() => RequestCode::HttpDeny,
            None => RequestCode::AmbiguousPath,
        };
        return Some(RequestDenial { code, rule });
    }
    None
}

/// The crate's answer `got` is the model's deny, or names no deny when the
/// model has none.
fn agrees(model: Option<RequestDenial>, got: Option<RequestDenial>) -> bool {
    match model {
        Some(_) => got == model,
        None => !got.is_some_and(|d| matches!(d.rule, RuleRef::Deny(_))),
    }
}

/// `target` with the unreserved characters `encode` picks percent-encoded.
fn respell(target: &str, encode: u64, upper: u64) -> String {
    let mut out = String::new();
    for (i, c) in target.chars().enumerate() {
        let bit = |m: u64| m.rotate_right(i as u32 % 64) & 1 == 1;
        let unreserved = c.is_ascii_alphanumeric() || "-._~".contains(c);
        let hex = format!("%{:02X}", c as u8);
        match (unreserved && bit(encode), bit(upper)) {
            (false, _) => out.push(c),
            (true, true) => out.push_str(&hex),
            (true, false) => out.push_str(&hex.to_lowercase()),
        }
    }
    out
}

fuzz_target!(|input: Input| {
    if !(2..=6).contains(&input.entries.len()) || input.segments.len() > 6 {
        return;
    }
    let Ok(policy) = Policy::from_json(&policy_json(&input.entries)) else {
        return;
    };
    static PLATFORM: OnceLock<Arc<PlatformDenies>> = OnceLock::new();
    let platform = PLATFORM.get_or_init(|| Arc::new(PlatformDenies::builtin()));
    let compiled = CompiledPolicy::new(policy, platform.clone());
    let mut names = vec![pick(NAMES, input.names.0)];
    names.extend(input.names.1.map(|n| pick(NAMES, n)));
    let hosts: Vec<Hostname> = names
        .iter()
        .map(|n| Hostname::parse(n).expect("valid"))
        .collect();
    let refs: Vec<&Hostname> = hosts.iter().collect();
    let method = pick(METHODS, input.method);
    let segs: Vec<&str> = input.segments.iter().map(|&s| pick(SEGS, s)).collect();
    let query = if input.query { "?q=/admin" } else { "" };
    let target = format!("/{}{query}", segs.join("/"));
    let judged = compiled.judge_request(&refs, method, &target);

    let lower: Option<Vec<String>> = normalize(&target)
        .ok()
        .map(|n| segments_of(&n).map(str::to_lowercase).collect());
    let path = lower.as_deref();
    let model = |audit| model_deny(&input.entries, &names, method, path, audit);
    let (now, audit) = (model(false), model(true));
    let said = || format!("{method} {target:?} to {names:?}: {judged:?}, model {now:?}, {audit:?}");
    assert!(agrees(now, judged.deny), "{}", said());
    assert!(
        judged.deny.is_some() || agrees(audit, judged.would_deny),
        "{}",
        said()
    );

    let second = respell(&target, input.encode, input.upper);
    assert_eq!(
        judged,
        compiled.judge_request(&refs, method, &second),
        "{method} {target:?} and {second:?} to {names:?} are judged differently"
    );
});
