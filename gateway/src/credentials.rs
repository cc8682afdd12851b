//! Host-bound credentials: the sandbox holds a placeholder, the gateway the
//! real value, and the value goes upstream only to the credential's hosts.
//!
//! ```json
//! {"name": "github", "placeholder": "EGRESS_PLACEHOLDER_GITHUB",
//!  "hosts": ["api.github.test", "*.github.test"],
//!  "inject": {"header": "authorization", "format": "Bearer {value}"},
//!  "source": {"file": "/run/secrets/github"}, "require": true}
//! ```
//!
//! - The value is read by the gateway from its own side (a file, or its own
//!   environment), when the sandbox is pushed or restored and again on
//!   SIGHUP. The policy document and the snapshot carry only the reference.
//! - On an intercepted request to one of `hosts` (the request's name, which
//!   the gateway verifies in the origin's certificate), the placeholder is
//!   replaced by the value in the configured header (`inject`, which also
//!   adds the header when the sandbox sent none) or in every header
//!   (`replace`).
//! - A request that carries a placeholder (in a header or the request
//!   target) anywhere else is refused `credential_host_mismatch`: the
//!   placeholder is leaving for a host it is not for. Plain HTTP never gets
//!   a value: nothing verifies its host, and the value would travel in clear.
//! - `require`: a request to the hosts without the placeholder is refused
//!   `credential_required`, so the sandbox cannot use a key of its own there.
//! - An answer to a request that carried a value has the value replaced by
//!   its placeholder wherever the origin sent it back ([`Carried`]).
//! - The value never appears in logs, metrics, errors or explain output:
//!   [`Secret`] has no `Debug` or `Display` that shows it.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::Arc;

use std::path::PathBuf;

use arc_swap::ArcSwap;
use egress_policy::Hostname;
use http::header::{HeaderMap, HeaderName, HeaderValue};

pub use crate::config::CredentialSources;
pub use egress_api::gateway::credentials::{
    validate, Credential, HostPattern, Inject, Source, MAX_CREDENTIALS,
};

/// Largest value read from a file or the environment.
const MAX_VALUE: usize = 8 * 1024;

/// A credential's value. Shows as `<redacted>`, never as itself.
#[derive(Clone)]
pub struct Secret(Arc<[u8]>);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// How long a value a push loaded outlives reloads whose registry does not
/// name it yet: far longer than a push takes to commit.
const FRESH_FOR: std::time::Duration = std::time::Duration::from_secs(60);

/// The values the gateway holds, by source. Read when a sandbox is pushed
/// or restored, and again on SIGHUP, from the sources `credentials` allows.
pub struct Secrets {
    values: ArcSwap<HashMap<Source, Secret>>,
    /// Taken to write `values`; holds the sources pushes loaded in the last
    /// [`FRESH_FOR`], and when (their sandboxes may not be registered yet).
    write: std::sync::Mutex<HashMap<Source, std::time::Instant>>,
    /// Reloads done (under `write`): a push's values read meanwhile may be
    /// older than the reload's.
    reloads: std::sync::atomic::AtomicU64,
    allowed: CredentialSources,
}

impl Default for Secrets {
    fn default() -> Self {
        Self::new(CredentialSources::default())
    }
}

impl fmt::Debug for Secrets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Secrets")
            .field("sources", &self.values.load().len())
            .finish()
    }
}

impl Secrets {
    pub fn new(allowed: CredentialSources) -> Self {
        Self {
            values: ArcSwap::default(),
            write: std::sync::Mutex::new(HashMap::new()),
            reloads: std::sync::atomic::AtomicU64::new(0),
            allowed,
        }
    }

    /// Reads the values of `list` (a push): the first that cannot be read
    /// is the error, naming the credential and its source, and nothing is kept.
    pub fn load(&self, list: &[Credential]) -> Result<(), String> {
        self.load_all([list]).map_err(|(_, why)| why)
    }

    /// [`Self::load`] of many sandboxes' lists (a resync), each source read
    /// once and the values kept in one step: the first that cannot be read
    /// is the error, with its list's index. (Kept list by list, a resync of
    /// N sandboxes with sources of their own copied the table N times.)
    /// Values read while a reload (SIGHUP) ran are read again, so a value
    /// rotated meanwhile does not come back; the last try reads under the
    /// lock.
    pub fn load_all<'a>(
        &self,
        lists: impl IntoIterator<Item = &'a [Credential]>,
    ) -> Result<(), (usize, String)> {
        let lists: Vec<&[Credential]> = lists.into_iter().collect();
        for attempt in 0..3 {
            let last = attempt == 2;
            let reloads = self.reloads.load(std::sync::atomic::Ordering::Acquire);
            let early = (!last).then(|| self.read_all(&lists));
            let mut fresh = self.lock();
            let read = match early {
                Some(_) if self.reloads.load(std::sync::atomic::Ordering::Acquire) != reloads => {
                    continue;
                }
                Some(read) => read?,
                None => self.read_all(&lists)?,
            };
            if read.is_empty() {
                return Ok(());
            }
            let mut next = (**self.values.load()).clone();
            let now = std::time::Instant::now();
            fresh.extend(read.keys().map(|s| (s.clone(), now)));
            next.extend(read);
            self.values.store(Arc::new(next));
            return Ok(());
        }
        Ok(())
    }

    /// Every source of `lists`, read once.
    fn read_all(
        &self,
        lists: &[&[Credential]],
    ) -> Result<HashMap<Source, Secret>, (usize, String)> {
        let mut read: HashMap<Source, Secret> = HashMap::new();
        for (n, list) in lists.iter().enumerate() {
            for (i, c) in list.iter().enumerate() {
                if read.contains_key(&c.source) {
                    continue;
                }
                let value = read_source(&c.source, &self.allowed).map_err(|e| {
                    let why = format!("credentials[{i}].source: {} ({}): {e}", c.source, c.name);
                    (n, why)
                })?;
                read.insert(c.source.clone(), value);
            }
        }
        Ok(read)
    }

    /// Reads every source again (SIGHUP): one that cannot be read is
    /// dropped, and requests that need it are refused until it can be.
    /// Returns the sources that failed, with why. A source a push loaded in
    /// the last [`FRESH_FOR`] is read again too though `sources` (the
    /// registry as it was read before) does not name it: that push may be
    /// committing, and a value rotated or revoked meanwhile must not stay.
    pub fn reload<'a>(&self, sources: impl IntoIterator<Item = &'a Source>) -> Vec<String> {
        let mut fresh = self.lock();
        fresh.retain(|_, at| at.elapsed() < FRESH_FOR);
        let mut next = HashMap::new();
        let mut seen: HashSet<Source> = HashSet::new();
        let mut failed = Vec::new();
        let mut read = |s: &Source| {
            if !seen.insert(s.clone()) {
                return;
            }
            match read_source(s, &self.allowed) {
                Ok(v) => {
                    next.insert(s.clone(), v);
                }
                Err(e) => failed.push(format!("{s}: {e}")),
            }
        };
        sources.into_iter().for_each(&mut read);
        fresh.keys().for_each(&mut read);
        self.values.store(Arc::new(next));
        self.reloads
            .fetch_add(1, std::sync::atomic::Ordering::Release);
        failed
    }

    pub fn get(&self, source: &Source) -> Option<Secret> {
        self.values.load().get(source).cloned()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Source, std::time::Instant>> {
        self.write
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Reads one value: a file's contents without its final line break, or an
/// environment variable of this process. It must fit in a header, and come
/// from a source `allowed` names: a pushed source is read with the
/// gateway's rights, so `/etc/shadow` or `HOME` would otherwise be sent to
/// whichever host the pusher chose.
fn read_source(source: &Source, allowed: &CredentialSources) -> Result<Secret, String> {
    let mut bytes = match source {
        Source::File(path) => {
            let real = allowed_file(path, &allowed.files_under)?;
            egress_api::file::warn_if_open("a credential's file", &real);
            let meta = std::fs::metadata(&real).map_err(|e| e.to_string())?;
            if meta.len() > MAX_VALUE as u64 {
                return Err(format!("larger than {MAX_VALUE} bytes"));
            }
            // Bounded as read too: a file that grows, or a device that never
            // ends, stops one byte past the most a value may hold.
            let mut bytes = Vec::new();
            std::fs::File::open(&real)
                .and_then(|f| {
                    std::io::Read::read_to_end(
                        &mut std::io::Read::take(f, MAX_VALUE as u64 + 1),
                        &mut bytes,
                    )
                })
                .map_err(|e| e.to_string())?;
            bytes
        }
        Source::Env(name) => {
            if !name.starts_with(&allowed.env_prefix) {
                return Err(format!(
                    "not read: the name does not start with credentials.env_prefix {:?}",
                    allowed.env_prefix
                ));
            }
            std::env::var_os(name)
                .ok_or_else(|| "not set in the gateway's environment".to_owned())?
                .into_encoded_bytes()
        }
    };
    if bytes.ends_with(b"\n") {
        bytes.pop();
        if bytes.ends_with(b"\r") {
            bytes.pop();
        }
    }
    if bytes.is_empty() {
        return Err("empty".into());
    }
    if bytes.len() > MAX_VALUE {
        return Err(format!("larger than {MAX_VALUE} bytes"));
    }
    if !bytes
        .iter()
        .all(|&b| (0x20..0x7f).contains(&b) || b == b'\t')
    {
        return Err("holds a byte a header value cannot carry (control or non-ASCII)".into());
    }
    Ok(Secret(bytes.into()))
}

/// `path` with its links resolved, when that lies under one of `dirs` (each
/// resolved too; one that does not exist holds nothing). A path not under
/// one as written (or with a `..` in it) is refused before anything on the
/// host is looked at, and no refusal says where a path leads: a token
/// holder could otherwise map which files exist on the host, and where
/// its links point.
fn allowed_file(path: &std::path::Path, dirs: &[PathBuf]) -> Result<PathBuf, String> {
    let refused = || {
        format!(
            "not read: {} is not under credentials.files_under {dirs:?} (once its links are resolved)",
            path.display()
        )
    };
    let resolved: Vec<PathBuf> = dirs
        .iter()
        .filter_map(|d| std::fs::canonicalize(d).ok())
        .collect();
    let dotted = path.components().any(|c| {
        matches!(
            c,
            std::path::Component::ParentDir | std::path::Component::CurDir
        )
    });
    let written_under = dirs.iter().chain(&resolved).any(|d| path.starts_with(d));
    if dotted || !written_under {
        return Err(refused());
    }
    let real = std::fs::canonicalize(path).map_err(|e| e.to_string())?;
    if !resolved.iter().any(|d| real.starts_with(d)) {
        return Err(refused());
    }
    Ok(real)
}

/// Why a request was refused for a credential.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// A placeholder is on its way to a host it is not for.
    HostMismatch,
    /// A request to the credential's hosts without its placeholder.
    Required,
    /// The value could not be read: nothing to put in the placeholder's place.
    Unavailable,
    /// With the values in, the head would pass `limits.max_request_head`.
    TooLarge,
    /// The answer to a request that carried a value came in a coding the
    /// gateway cannot read for it (`gzip`, …): not passed on.
    ResponseEncoded,
}

impl Refusal {
    pub const CODES: &'static [&'static str] = &[
        "credential_host_mismatch",
        "credential_required",
        "credential_unavailable",
        "credential_head_too_large",
        "credential_response_encoded",
    ];

    pub fn code(self) -> &'static str {
        match self {
            Self::HostMismatch => "credential_host_mismatch",
            Self::Required => "credential_required",
            Self::Unavailable => "credential_unavailable",
            Self::TooLarge => "credential_head_too_large",
            Self::ResponseEncoded => "credential_response_encoded",
        }
    }
}

/// A request refused for credential `index`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refused {
    pub why: Refusal,
    pub index: usize,
}

/// What [`apply`] did: how many values went in, and which (to be looked
/// for in the answer).
#[derive(Clone, Debug, Default)]
pub struct Applied {
    pub injected: usize,
    pub carried: Option<Carried>,
}

/// The names a request is for, as far as the gateway knows them.
#[derive(Clone, Copy, Debug)]
pub enum Names<'a> {
    /// Its name, verified in the origin's certificate (intercepted TLS).
    Verified(&'a Hostname),
    /// Not verified (plain HTTP, or an address): every name it may be for,
    /// its claimed `Host` and the names attributed to its address.
    Unverified(&'a [&'a Hostname]),
}

/// What the credentials stage refuses of a request whatever its headers
/// (explain asks with none): a placeholder in the target on its way to a
/// host it is not for, or an unverified name a required credential
/// covers. `None`: the stage would let it through, headers permitting.
pub fn refused_whatever_the_headers(
    list: &[Credential],
    names: Names<'_>,
    target: &str,
) -> Option<Refused> {
    host_credentials(list, names, target, &HeaderMap::new()).err()
}

/// Applies a sandbox's credentials to one request's headers.
///
/// A value goes in only where the name is verified; where it is not, a
/// placeholder is a mismatch, and a request that may be for a credential's
/// hosts is refused if the credential is required (the sandbox would use a
/// key of its own there, in clear). `target` is the request target as sent. A head that would
/// be larger than `max_head` with the values in is refused: a placeholder
/// repeated in a head within the limit could otherwise grow it by the
/// value's length each time. Nothing is changed when the request is refused.
pub fn apply(
    list: &[Credential],
    secrets: &Secrets,
    names: Names<'_>,
    target: &str,
    headers: &mut HeaderMap,
    max_head: usize,
) -> Result<Applied, Refused> {
    let mine = host_credentials(list, names, target, headers)?;
    // A value the sandbox may have put in a header the origin keeps (with
    // `replace: "headers"` it chooses the header: object metadata, say)
    // may come back in any later answer of the host, not only in the
    // answer to the request that carried it, and over plain HTTP or to
    // its address too: every answer is scrubbed.
    let kept: Vec<(usize, Secret, &str)> = list
        .iter()
        .enumerate()
        .filter(|(_, c)| matches!(c.inject, Inject::ReplaceHeaders) && may_be_for(c, names))
        .filter_map(|(i, c)| Some((i, secrets.get(&c.source)?, c.placeholder.as_str())))
        .collect();
    // Judge every credential of the host before changing anything.
    let plan = plan(mine, secrets, headers)?;
    if let Some(index) = too_large(&plan, target, headers, max_head) {
        return Err(Refused {
            why: Refusal::TooLarge,
            index,
        });
    }
    for (c, secret, absent, _) in &plan {
        inject(headers, c, secret, *absent);
    }
    let first = plan.first().map(|p| p.3).or(kept.first().map(|k| k.0));
    let planned = plan
        .iter()
        .map(|(c, secret, _, i)| (*i, secret, c.placeholder.as_str()));
    let unplanned = kept
        .iter()
        .filter(|(i, ..)| !plan.iter().any(|p| p.3 == *i))
        .map(|(i, secret, placeholder)| (*i, secret, *placeholder));
    let carried = Carried::new(
        planned
            .chain(unplanned)
            .map(|(_, secret, placeholder)| (secret, placeholder)),
        first.unwrap_or(0),
    );
    Ok(Applied {
        injected: plan.len(),
        carried,
    })
}

/// The credentials for a verified name, with their index in `list`; a
/// placeholder of any other credential, in the target or a header, refuses
/// the request ([`Refusal::HostMismatch`]), and then a required credential
/// an unverified request may be for ([`Refusal::Required`]).
fn host_credentials<'a>(
    list: &'a [Credential],
    names: Names<'_>,
    target: &str,
    headers: &HeaderMap,
) -> Result<Vec<(usize, &'a Credential)>, Refused> {
    let mut mine = Vec::new();
    let mut required = None;
    // The target and the header values as an origin that decodes them
    // reads them: a placeholder written in escapes (`EGRESS%5FPH`) is the
    // placeholder there. Each stage of decoding, read once for every
    // credential.
    let mut forms = decodings(target.as_bytes());
    for v in headers.values() {
        forms.extend(decodings(v.as_bytes()).into_iter().skip(1));
    }
    for (index, c) in list.iter().enumerate() {
        match names {
            Names::Verified(_) if may_be_for(c, names) => {
                mine.push((index, c));
                continue;
            }
            Names::Unverified(_) if c.require && may_be_for(c, names) => {
                required = required.or(Some(index));
            }
            _ => {}
        }
        let needle = c.placeholder.as_bytes();
        let escaped = forms.iter().any(|f| contains(f, needle));
        if escaped || carries(c, headers) {
            return Err(Refused {
                why: Refusal::HostMismatch,
                index,
            });
        }
    }
    match required {
        Some(index) => Err(Refused {
            why: Refusal::Required,
            index,
        }),
        None => Ok(mine),
    }
}

/// Whether a request to `names` may be for one of `c`'s hosts: its
/// verified name is one, or one of the names it may be for is.
fn may_be_for(c: &Credential, names: Names<'_>) -> bool {
    let covers = |n: &Hostname| c.hosts.iter().any(|p| p.matches(n));
    match names {
        Names::Verified(h) => covers(h),
        Names::Unverified(may_be) => may_be.iter().any(|n| covers(n)),
    }
}

/// What goes in, before anything changes: each credential of the host
/// whose placeholder the request carries, or whose header it lacks (then
/// `true`: the header is added whole), with its value. A required
/// credential the request does not use, or a value that cannot be read,
/// refuses the request.
fn plan<'a>(
    mine: Vec<(usize, &'a Credential)>,
    secrets: &Secrets,
    headers: &HeaderMap,
) -> Result<Vec<Planned<'a>>, Refused> {
    let mut plan = Vec::with_capacity(mine.len());
    for (index, c) in mine {
        let refused = |why| Refused { why, index };
        let present = match &c.inject {
            Inject::Header { header, format } => {
                let mut values = headers.get_all(header).iter();
                let with = |v: &HeaderValue| contains(v.as_bytes(), c.placeholder.as_bytes());
                if c.require {
                    // Required: the header carries the credential and nothing
                    // else, or a second value (a key of the sandbox's own)
                    // could be the one the origin reads; nor does a header
                    // that reads as it with `_` for `-` (`X_Api_Key`).
                    let twin = headers.keys().any(|n| {
                        n != header
                            && crate::decide::folded(n.as_str())
                                == crate::decide::folded(header.as_str())
                    });
                    if twin {
                        return Err(refused(Refusal::Required));
                    }
                    // Each value is the format with the placeholder, and
                    // no more: `Bearer mine PH` could be read as `mine`. One
                    // line may hold a list too (`Bearer mine, Bearer PH`,
                    // or `Cookie: s=PH; s=mine`): as two lines would, it
                    // is refused, past what the format holds.
                    let needle = &c.placeholder;
                    let alone = |v: &HeaderValue| !not_the_format(header, format, v, needle);
                    values.next().is_some_and(alone) && values.all(alone)
                } else {
                    values.any(with)
                }
            }
            Inject::ReplaceHeaders => carries(c, headers),
        };
        let absent =
            matches!(&c.inject, Inject::Header { header, .. } if !headers.contains_key(header));
        if !present && !absent {
            if c.require {
                return Err(refused(Refusal::Required));
            }
            continue;
        }
        let secret = secrets
            .get(&c.source)
            .ok_or_else(|| refused(Refusal::Unavailable))?;
        plan.push((c, secret, absent, index));
    }
    Ok(plan)
}

/// What the request line holds besides its target (a method, the version,
/// spaces and its end), counted as the most a common one takes.
const REQUEST_LINE: usize = 32;

/// Whether `v` is other than the credential's `format` with `{value}` as
/// the placeholder: not that text (outer spaces and the case of the
/// format's own letters aside); in `cookie`, whose
/// pairs `;` separates, more `,` than `format` holds, or the credential's
/// pair (the one `format` puts `{value}` in) named more than once or other
/// than the format's pair.
fn not_the_format(header: &HeaderName, format: &str, v: &HeaderValue, placeholder: &str) -> bool {
    if header != http::header::COOKIE {
        // The format's own text without regard to ASCII case (`bearer`:
        // an auth scheme is read so, RFC 9110 11.1), the placeholder as it is.
        let expected = format.replace("{value}", placeholder);
        let v = v.as_bytes().trim_ascii();
        let same = v.eq_ignore_ascii_case(expected.trim_ascii().as_bytes());
        return !same || !contains(v, placeholder.as_bytes());
    }
    let count = |bytes: &[u8], sep: u8| bytes.iter().filter(|&&b| b == sep).count();
    if count(v.as_bytes(), b',') > count(format.as_bytes(), b',') {
        return true;
    }
    let name_of = |pair: &[u8]| -> Vec<u8> {
        let name = pair.split(|&b| b == b'=').next().unwrap_or_default();
        name.trim_ascii().to_vec()
    };
    let Some(pair) = format.split(';').find(|p| p.contains("{value}")) else {
        return true;
    };
    let ours = name_of(pair.as_bytes());
    let expected = pair.replace("{value}", placeholder);
    let named: Vec<&[u8]> = v
        .as_bytes()
        .split(|&b| b == b';')
        .filter(|p| name_of(p) == ours)
        .collect();
    named.len() != 1 || named[0].trim_ascii() != expected.trim_ascii().as_bytes()
}

/// One credential to put in: its value, whether its header is added whole,
/// and its index in the sandbox's list.
type Planned<'a> = (&'a Credential, Secret, bool, usize);

/// The first planned credential with which the head would pass `max_head`
/// bytes: the request line (the target, and [`REQUEST_LINE`] for the rest),
/// and each header counted as `name: value` and its line end.
fn too_large(
    plan: &[Planned<'_>],
    target: &str,
    headers: &HeaderMap,
    max_head: usize,
) -> Option<usize> {
    let line = |name: &HeaderName, len: usize| name.as_str().len() + len + 4;
    let fields: usize = headers.iter().map(|(n, v)| line(n, v.len())).sum();
    let mut size = fields.saturating_add(target.len() + REQUEST_LINE);
    for (c, secret, absent, index) in plan {
        let grown = match &c.inject {
            Inject::Header { header, format } if *absent => {
                line(header, format.len() + secret.0.len())
            }
            Inject::Header { header, .. } => replaced(headers.get_all(header).iter(), c, secret),
            Inject::ReplaceHeaders => replaced(headers.values(), c, secret),
        };
        size = size.saturating_add(grown);
        if size > max_head {
            return Some(*index);
        }
    }
    None
}

/// Puts one credential's value in: its header, from its format, when the
/// request lacks that header (`absent`); otherwise in its placeholder's
/// place.
fn inject(headers: &mut HeaderMap, c: &Credential, secret: &Secret, absent: bool) {
    match &c.inject {
        Inject::Header { header, format } if absent => {
            let mut value = Vec::with_capacity(format.len() + secret.0.len());
            let (before, after) = format.split_once("{value}").unwrap_or((format, ""));
            value.extend_from_slice(before.as_bytes());
            value.extend_from_slice(&secret.0);
            value.extend_from_slice(after.as_bytes());
            if let Some(v) = sensitive(&value) {
                headers.insert(header.clone(), v);
            }
        }
        Inject::Header { header, .. } => replace_in(headers, Some(header), c, secret),
        Inject::ReplaceHeaders => replace_in(headers, None, c, secret),
    }
}

/// Whether any header value carries `c`'s placeholder.
fn carries(c: &Credential, headers: &HeaderMap) -> bool {
    headers
        .values()
        .any(|v| contains(v.as_bytes(), c.placeholder.as_bytes()))
}

/// `text` as sent, then each of its percent-decodings that changes it, at
/// most three (an escape of an escape, `%2545`, is an `E` to an origin
/// that decodes twice): every reading an origin may act on.
fn decodings(text: &[u8]) -> Vec<std::borrow::Cow<'_, [u8]>> {
    let mut out = vec![std::borrow::Cow::Borrowed(text)];
    for _ in 0..3 {
        let Some(last) = out.last().filter(|l| l.contains(&b'%')) else {
            break;
        };
        let next: Vec<u8> = percent_encoding::percent_decode(last).collect();
        if next[..] == last[..] {
            break;
        }
        out.push(std::borrow::Cow::Owned(next));
    }
    out
}

/// Replaces the placeholder with the value in `only`'s values, or in every header's.
fn replace_in(headers: &mut HeaderMap, only: Option<&HeaderName>, c: &Credential, secret: &Secret) {
    let needle = c.placeholder.as_bytes();
    let names: Vec<HeaderName> = match only {
        Some(h) => vec![h.clone()],
        None => headers.keys().cloned().collect(),
    };
    for name in names {
        let values: Vec<HeaderValue> = headers.get_all(&name).iter().cloned().collect();
        if !values.iter().any(|v| contains(v.as_bytes(), needle)) {
            continue;
        }
        headers.remove(&name);
        for v in values {
            let replaced = replace_bytes(v.as_bytes(), needle, &secret.0);
            match sensitive(&replaced) {
                Some(nv) => headers.append(name.clone(), nv),
                None => headers.append(name.clone(), v),
            };
        }
    }
}

/// A header value never indexed by HPACK nor shown by `Debug`.
fn sensitive(bytes: &[u8]) -> Option<HeaderValue> {
    let mut v = HeaderValue::from_bytes(bytes).ok()?;
    v.set_sensitive(true);
    Some(v)
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

/// What replacing `c`'s placeholder with `secret` in `values` adds.
fn replaced<'h>(
    values: impl Iterator<Item = &'h HeaderValue>,
    c: &Credential,
    secret: &Secret,
) -> usize {
    let found: usize = values
        .map(|v| occurrences(v.as_bytes(), c.placeholder.as_bytes()))
        .sum();
    found.saturating_mul(secret.0.len().saturating_sub(c.placeholder.len()))
}

/// How many times `needle` occurs in `hay`, without overlap, as
/// [`replace_bytes`] replaces it.
fn occurrences(hay: &[u8], needle: &[u8]) -> usize {
    let (mut i, mut n) = (0, 0);
    while !needle.is_empty() && i + needle.len() <= hay.len() {
        if hay[i..].starts_with(needle) {
            n += 1;
            i += needle.len();
        } else {
            i += 1;
        }
    }
    n
}

fn replace_bytes(hay: &[u8], needle: &[u8], with: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(hay.len() + with.len());
    let mut i = 0;
    while i < hay.len() {
        if hay[i..].starts_with(needle) {
            out.extend_from_slice(with);
            i += needle.len();
        } else {
            out.push(hay[i]);
            i += 1;
        }
    }
    out
}

mod reflect;
pub(crate) use reflect::codings_but;
pub use reflect::Carried;

#[cfg(test)]
mod tests;
