//! The machine (L4) egress policy of a user-mode VM (`spec.network.egress`).
//!
//! ```json
//! {
//!   "mode": "allowlist",
//!   "rules": [
//!     {"cidr": "10.0.0.0/8", "proto": "tcp", "port": 5151, "note": "Veyron API"},
//!     {"cidr": "91.189.88.0/21", "proto": "tcp", "port": 80},
//!     {"cidr": "0.0.0.0/0", "proto": "udp", "port": 53}
//!   ]
//! }
//! ```
//!
//! Modes: `loopback` lets nothing leave (and is what an unset `mode` means
//! when no rules are given); `allowlist` lets only the rules through (the
//! default when rules are given); `audit` lets everything through and records
//! what the allowlist would have dropped; `open` lets everything through.
//!
//! A rule is a network (`cidr`, IPv4 only; a bare address is a `/32`), an
//! optional `proto` and, with it, an optional `port`. Its [`Entry`] is what it
//! allows on its network: `any`, `tcp/any` or `tcp/443`.
//!
//! [`MachineEgress::from_json`] and [`MachineEgress::from_value`] parse once
//! into validated types and collect every [`Problem`], each naming the rule
//! it belongs to. The limits are those of the kernel's tables:
//! [`MAX_RULES`] rules, and [`MAX_ENTRIES_PER_NETWORK`] distinct entries per
//! network counting the entries of every network that contains it — a
//! longest-prefix lookup returns only the most specific network, whose entry
//! list must carry what it inherits.
//!
//! [`MachineEgress::kernel_sets`] reduces the rules for the kernel; [`check`]
//! is the validation report the CLI, API and webhook share; [`suggest`]
//! proposes rules for what the kernel refused.
//!
//! Pure: no I/O, no clock.

mod parse;
mod suggest;

use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

use ipnet::Ipv4Net;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{json, Value};

pub use self::suggest::{suggest, Observed, Suggestion};

/// At most this many rules.
pub const MAX_RULES: usize = 256;
/// At most this many distinct entries per network, the entries of every
/// network containing it included.
pub const MAX_ENTRIES_PER_NETWORK: usize = 4;
/// A note is at most this many characters (not bytes).
pub const MAX_NOTE_CHARS: usize = 256;

/// What leaves the machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Nothing leaves.
    Loopback,
    /// Only what the rules allow leaves.
    Allowlist,
    /// Everything leaves; what an allowlist would have dropped is recorded.
    Audit,
    /// Everything leaves.
    Open,
}

impl Mode {
    pub const ALL: [Self; 4] = [Self::Loopback, Self::Allowlist, Self::Audit, Self::Open];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Loopback => "loopback",
            Self::Allowlist => "allowlist",
            Self::Audit => "audit",
            Self::Open => "open",
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A string that is not a mode.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown mode {0:?}: expected loopback, allowlist, audit or open")]
pub struct UnknownMode(pub String);

impl FromStr for Mode {
    type Err = UnknownMode;

    fn from_str(s: &str) -> Result<Self, UnknownMode> {
        Self::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| UnknownMode(s.to_owned()))
    }
}

/// A transport protocol a rule can name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Proto {
    Tcp,
    Udp,
}

impl Proto {
    pub const ALL: [Self; 2] = [Self::Tcp, Self::Udp];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Udp => "udp",
        }
    }
}

impl fmt::Display for Proto {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A string that is not a protocol.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown proto {0:?}: expected tcp or udp")]
pub struct UnknownProto(pub String);

impl FromStr for Proto {
    type Err = UnknownProto;

    fn from_str(s: &str) -> Result<Self, UnknownProto> {
        Self::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| UnknownProto(s.to_owned()))
    }
}

/// What a rule allows on its network, displayed `any`, `tcp/any`, `tcp/443`.
///
/// The order (`any` first, then per protocol `any` before ports) is the one
/// the kernel sets and the suggestions are sorted in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Entry {
    /// Every protocol and port.
    Any,
    /// Every port of one protocol.
    Proto(Proto),
    /// One port of one protocol.
    Port(Proto, u16),
}

impl Entry {
    /// Whether everything `other` allows, `self` allows too: `any` covers
    /// everything, `tcp/any` covers itself and every `tcp/<port>`.
    pub fn covers(self, other: Self) -> bool {
        match (self, other) {
            (Self::Any, _) => true,
            (Self::Proto(p), Self::Proto(q) | Self::Port(q, _)) => p == q,
            (Self::Port(p, n), Self::Port(q, m)) => p == q && n == m,
            _ => false,
        }
    }

    /// Whether a packet of `proto` to `port` is allowed by this entry.
    pub fn allows(self, proto: Proto, port: u16) -> bool {
        match self {
            Self::Any => true,
            Self::Proto(p) => p == proto,
            Self::Port(p, n) => p == proto && n == port,
        }
    }

    /// The entry's protocol, `None` for `any`.
    pub fn proto(self) -> Option<Proto> {
        match self {
            Self::Any => None,
            Self::Proto(p) | Self::Port(p, _) => Some(p),
        }
    }

    /// The entry's port, `None` for `any` and `<proto>/any`.
    pub fn port(self) -> Option<u16> {
        match self {
            Self::Port(_, n) => Some(n),
            Self::Any | Self::Proto(_) => None,
        }
    }
}

impl fmt::Display for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Any => f.write_str("any"),
            Self::Proto(p) => write!(f, "{p}/any"),
            Self::Port(p, n) => write!(f, "{p}/{n}"),
        }
    }
}

/// One rule: traffic to `net` matching its [`Entry`] may leave.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    /// The destination network, host bits clear.
    pub net: Ipv4Net,
    /// `None`: every protocol.
    pub proto: Option<Proto>,
    /// `None`: every port. Only meaningful with `proto`; validation refuses
    /// a port without one.
    pub port: Option<u16>,
    /// Free text for people, printable, at most [`MAX_NOTE_CHARS`] characters.
    pub note: Option<String>,
}

impl Rule {
    /// A rule allowing `entry` on `net`.
    pub fn new(net: Ipv4Net, entry: Entry, note: Option<String>) -> Self {
        Self {
            net,
            proto: entry.proto(),
            port: entry.port(),
            note,
        }
    }

    /// What the rule allows on its network. A port without a proto (which
    /// validation refuses) is ignored.
    pub fn entry(&self) -> Entry {
        match (self.proto, self.port) {
            (None, _) => Entry::Any,
            (Some(p), None) => Entry::Proto(p),
            (Some(p), Some(n)) => Entry::Port(p, n),
        }
    }

    /// Whether the rule allows a packet of `proto` to `addr:port`.
    pub fn allows(&self, addr: Ipv4Addr, proto: Proto, port: u16) -> bool {
        self.net.contains(&addr) && self.entry().allows(proto, port)
    }

    /// The rule's normal form: `cidr` always with its prefix length, absent
    /// optional fields omitted.
    fn to_value(&self) -> Value {
        let mut m = serde_json::Map::new();
        m.insert("cidr".into(), Value::String(self.net.to_string()));
        if let Some(p) = self.proto {
            m.insert("proto".into(), Value::String(p.as_str().into()));
        }
        if let Some(n) = self.port {
            m.insert("port".into(), Value::from(n));
        }
        if let Some(note) = &self.note {
            m.insert("note".into(), Value::String(note.clone()));
        }
        Value::Object(m)
    }
}

/// A validated machine egress policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MachineEgress {
    pub mode: Mode,
    /// In the order given. Empty under `loopback` and `open`.
    pub rules: Vec<Rule>,
}

/// One thing wrong with a policy document.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Problem {
    /// The 0-based index into `rules` of the rule it concerns; `None` for the
    /// document as a whole.
    pub rule: Option<usize>,
    /// What is wrong, naming the field and the value.
    pub message: String,
}

impl Problem {
    fn top(message: impl Into<String>) -> Self {
        Self {
            rule: None,
            message: message.into(),
        }
    }

    fn at(rule: usize, message: impl Into<String>) -> Self {
        Self {
            rule: Some(rule),
            message: message.into(),
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.rule {
            Some(i) => write!(f, "rules[{i}]: {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

/// The rules reduced for the kernel, by entry kind, each list sorted.
///
/// Duplicates and rules made redundant by another rule are gone, so within
/// one list two networks of the same entry never overlap.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelSets {
    /// Networks where everything is allowed.
    pub any: Vec<Ipv4Net>,
    /// Networks where every port of a protocol is allowed.
    pub proto: Vec<(Ipv4Net, Proto)>,
    /// Networks where one port of a protocol is allowed.
    pub port: Vec<(Ipv4Net, Proto, u16)>,
}

impl MachineEgress {
    /// Nothing leaves; no rules.
    pub fn loopback() -> Self {
        Self {
            mode: Mode::Loopback,
            rules: Vec::new(),
        }
    }

    /// Parses and validates a JSON document, collecting every problem.
    pub fn from_json(text: &str) -> Result<Self, Vec<Problem>> {
        let doc = serde_json::from_str::<parse::Json>(text)
            .map_err(|e| vec![Problem::top(format!("not valid JSON: {e}"))])?;
        parse::policy(&doc)
    }

    /// Validates a parsed JSON value, collecting every problem.
    ///
    /// A `Value` cannot hold repeated keys; [`from_json`](Self::from_json)
    /// refuses them.
    pub fn from_value(v: &Value) -> Result<Self, Vec<Problem>> {
        parse::policy(&parse::Json::from(v))
    }

    /// The normal form: `mode` always written out, rules in their order,
    /// `cidr` with its prefix length, absent optional fields omitted.
    pub fn to_value(&self) -> Value {
        json!({
            "mode": self.mode.as_str(),
            "rules": self.rules.iter().map(Rule::to_value).collect::<Vec<_>>(),
        })
    }

    /// Validates a value built in code, through its normal form.
    pub fn validate(&self) -> Result<(), Vec<Problem>> {
        Self::from_value(&self.to_value()).map(drop)
    }

    /// The rule set as an allowlist would judge it, whatever the mode: true
    /// when some rule's network contains `addr` and its entry covers
    /// (`proto`, `port`).
    pub fn rules_allow(&self, addr: Ipv4Addr, proto: Proto, port: u16) -> bool {
        self.rules.iter().any(|r| r.allows(addr, proto, port))
    }

    /// Whether a packet passes under this policy: never under `loopback`,
    /// always under `open` and `audit`, per the rules under `allowlist`.
    pub fn passes(&self, addr: Ipv4Addr, proto: Proto, port: u16) -> bool {
        match self.mode {
            Mode::Loopback => false,
            Mode::Open | Mode::Audit => true,
            Mode::Allowlist => self.rules_allow(addr, proto, port),
        }
    }

    /// The rules reduced for the kernel: a rule is dropped when another
    /// rule's network contains its network and that rule's entry covers its
    /// entry (of identical rules the first stays). What remains is grouped
    /// by entry kind and sorted; it allows exactly what the rules allow.
    pub fn kernel_sets(&self) -> KernelSets {
        let rules: Vec<(Ipv4Net, Entry)> = self.rules.iter().map(|r| (r.net, r.entry())).collect();
        let subsumes =
            |(n, e): (Ipv4Net, Entry), (m, f): (Ipv4Net, Entry)| n.contains(&m) && e.covers(f);
        let mut sets = KernelSets::default();
        for (i, &rule) in rules.iter().enumerate() {
            let redundant = rules.iter().enumerate().any(|(j, &other)| {
                // Subsumption both ways means identical: keep the first.
                j != i && subsumes(other, rule) && (j < i || !subsumes(rule, other))
            });
            if redundant {
                continue;
            }
            match rule {
                (net, Entry::Any) => sets.any.push(net),
                (net, Entry::Proto(p)) => sets.proto.push((net, p)),
                (net, Entry::Port(p, n)) => sets.port.push((net, p, n)),
            }
        }
        sets.any.sort_unstable();
        sets.proto.sort_unstable();
        sets.port.sort_unstable();
        sets
    }
}

impl Serialize for MachineEgress {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.to_value().serialize(s)
    }
}

impl<'de> Deserialize<'de> for MachineEgress {
    /// Validates like [`MachineEgress::from_json`]; the problems are joined
    /// into one message.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let doc = parse::Json::deserialize(d)?;
        parse::policy(&doc).map_err(|problems| {
            let text: Vec<String> = problems.iter().map(Problem::to_string).collect();
            serde::de::Error::custom(text.join("; "))
        })
    }
}

/// The validation report `egress-gateway machine-egress check` prints and the
/// API and webhook reuse: `{"valid": true, "policy": <normal form>}` or
/// `{"valid": false, "errors": [{"rule": <n|null>, "message": ".."}]}`.
pub fn check(text: &str) -> (bool, Value) {
    match MachineEgress::from_json(text) {
        Ok(policy) => (true, json!({"valid": true, "policy": policy.to_value()})),
        Err(problems) => (false, json!({"valid": false, "errors": problems})),
    }
}

#[cfg(test)]
mod tests;
