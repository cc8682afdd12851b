//! `X-Space-Egress-Profiles`: which operator profiles a create selects, and
//! the admission results behind
//! `space.sandbox.egress_profile_admission{profile,outcome,reason}`.
//!
//! An absent header selects the profiles with `default: true`. A present one
//! is tokens `+name` / `-name` separated by single spaces, applied to the
//! defaults. A non-federated create ignores the header and selects nothing,
//! not even the defaults.

use std::collections::BTreeSet;
use std::fmt;

use serde::Serialize;

use crate::profiles::{ProfileName, Profiles};

/// The header this module reads.
pub const PROFILES_HEADER: &str = "X-Space-Egress-Profiles";

/// The `profile` label for a name that is not configured: untrusted input is
/// never echoed into metric labels.
pub const UNKNOWN_PROFILE_LABEL: &str = "unknown";

/// Why a selection was refused (the API answers 400 for each).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SelectionErrorKind {
    /// The header is present with an empty value.
    Empty,
    /// A leading, trailing or doubled space, or a token that is not `+name` / `-name`.
    Malformed,
    /// The same token twice.
    Repeated,
    /// `+name` and `-name` together.
    Conflicting,
    /// A name that is not configured.
    Unknown,
}

/// A refused selection.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{PROFILES_HEADER}: {message}")]
pub struct SelectionError {
    pub kind: SelectionErrorKind,
    pub message: String,
    pub admissions: Vec<Admission>,
}

/// A successful selection: the names (sorted) and their admissions.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selection {
    pub profiles: Vec<ProfileName>,
    pub admissions: Vec<Admission>,
}

/// One admission result, with the labels of the admission metric.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct Admission {
    /// A configured name, a previously admitted saved name, or `unknown`.
    pub profile: String,
    pub outcome: Outcome,
    pub reason: AdmissionReason,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Ok,
    Failed,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AdmissionReason {
    Ready,
    InvalidRequest,
    Unconfigured,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Sign {
    Plus,
    Minus,
}

// === impl SelectionErrorKind ===

impl SelectionErrorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Empty => "empty",
            Self::Malformed => "malformed",
            Self::Repeated => "repeated",
            Self::Conflicting => "conflicting",
            Self::Unknown => "unknown",
        }
    }
}

impl fmt::Display for SelectionErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

// === impl Admission ===

impl Admission {
    pub fn ready(name: &ProfileName) -> Self {
        Self {
            profile: name.to_string(),
            outcome: Outcome::Ok,
            reason: AdmissionReason::Ready,
        }
    }

    pub fn invalid_request(label: &str) -> Self {
        Self {
            profile: label.to_owned(),
            outcome: Outcome::Failed,
            reason: AdmissionReason::InvalidRequest,
        }
    }

    /// A saved name that is no longer configured; labelled with that
    /// (previously admitted, hence trusted) name.
    pub fn unconfigured(saved_name: &str) -> Self {
        Self {
            profile: saved_name.to_owned(),
            outcome: Outcome::Failed,
            reason: AdmissionReason::Unconfigured,
        }
    }
}

// === select ===

/// Chooses the profiles for a create from the header value (`None` when absent).
pub fn select(
    profiles: &Profiles,
    header: Option<&str>,
    federated: bool,
) -> Result<Selection, SelectionError> {
    if !federated {
        // Ignored, but a caller that sent it is told through the metric.
        let admissions = header
            .map(|_| vec![Admission::invalid_request(UNKNOWN_PROFILE_LABEL)])
            .unwrap_or_default();
        return Ok(Selection {
            profiles: Vec::new(),
            admissions,
        });
    }
    let Some(header) = header else {
        let chosen: Vec<ProfileName> = profiles.defaults().cloned().collect();
        return Ok(ready(chosen));
    };
    let tokens = tokenize(header)?;
    check_tokens(profiles, &tokens)?;
    Ok(ready(apply_tokens(profiles, &tokens)))
}

/// Refuses a repeated token, a profile both added and removed, and a
/// profile that is not configured.
fn check_tokens(profiles: &Profiles, tokens: &[(Sign, &str)]) -> Result<(), SelectionError> {
    let mut seen: BTreeSet<(bool, &str)> = BTreeSet::new();
    for &(sign, name) in tokens {
        if !seen.insert((sign == Sign::Plus, name)) {
            return Err(refuse(
                profiles,
                tokens,
                SelectionErrorKind::Repeated,
                format!("token {:?} is repeated", token(sign, name)),
            ));
        }
    }
    for &(sign, name) in tokens {
        if sign == Sign::Plus && seen.contains(&(false, name)) {
            return Err(refuse(
                profiles,
                tokens,
                SelectionErrorKind::Conflicting,
                format!("profile {name:?} is both added and removed"),
            ));
        }
    }
    if let Some(&(_, name)) = tokens.iter().find(|(_, n)| profiles.get(n).is_none()) {
        return Err(refuse(
            profiles,
            tokens,
            SelectionErrorKind::Unknown,
            format!("profile {name:?} is not configured"),
        ));
    }
    Ok(())
}

/// The defaults with the checked tokens applied in order: `+` adds, `-` removes.
fn apply_tokens(profiles: &Profiles, tokens: &[(Sign, &str)]) -> Vec<ProfileName> {
    let mut chosen: BTreeSet<ProfileName> = profiles.defaults().cloned().collect();
    for &(sign, name) in tokens {
        // Checked by `check_tokens`: every name is configured.
        let Some(configured) = profiles.name(name) else {
            continue;
        };
        match sign {
            Sign::Plus => chosen.insert(configured.clone()),
            Sign::Minus => chosen.remove(configured),
        };
    }
    chosen.into_iter().collect()
}

fn ready(profiles: Vec<ProfileName>) -> Selection {
    let admissions = profiles.iter().map(Admission::ready).collect();
    Selection {
        profiles,
        admissions,
    }
}

/// Splits on single spaces; any empty token means a leading, trailing or doubled space.
fn tokenize(header: &str) -> Result<Vec<(Sign, &str)>, SelectionError> {
    let syntax = |kind, message: String| SelectionError {
        kind,
        message,
        admissions: vec![Admission::invalid_request(UNKNOWN_PROFILE_LABEL)],
    };
    if header.is_empty() {
        return Err(syntax(SelectionErrorKind::Empty, "empty value".into()));
    }
    header
        .split(' ')
        .map(|tok| {
            if tok.is_empty() {
                return Err(syntax(
                    SelectionErrorKind::Malformed,
                    "tokens must be separated by single spaces, with none leading or trailing"
                        .into(),
                ));
            }
            let parsed = tok
                .strip_prefix('+')
                .map(|name| (Sign::Plus, name))
                .or_else(|| tok.strip_prefix('-').map(|name| (Sign::Minus, name)));
            match parsed {
                Some((sign, name)) if ProfileName::parse(name).is_some() => Ok((sign, name)),
                _ => Err(syntax(
                    SelectionErrorKind::Malformed,
                    format!("token {:?} is not +name or -name", truncate(tok)),
                )),
            }
        })
        .collect()
}

/// Refuses a well-formed selection; labels name configured profiles and
/// `unknown` for anything else.
fn refuse(
    profiles: &Profiles,
    tokens: &[(Sign, &str)],
    kind: SelectionErrorKind,
    message: String,
) -> SelectionError {
    let labels: BTreeSet<&str> = tokens
        .iter()
        .map(|(_, n)| {
            profiles
                .name(n)
                .map_or(UNKNOWN_PROFILE_LABEL, ProfileName::as_str)
        })
        .collect();
    SelectionError {
        kind,
        message,
        admissions: labels.into_iter().map(Admission::invalid_request).collect(),
    }
}

fn token(sign: Sign, name: &str) -> String {
    match sign {
        Sign::Plus => format!("+{name}"),
        Sign::Minus => format!("-{name}"),
    }
}

/// Keeps error messages bounded when the header is long.
fn truncate(s: &str) -> &str {
    const MAX: usize = 64;
    match s.char_indices().nth(MAX) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

#[cfg(test)]
mod tests;
