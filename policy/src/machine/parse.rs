//! Reading a policy document: every field checked, every problem collected.
//!
//! Documents are read into [`Json`], a JSON tree whose objects keep their
//! entries in order with duplicates, so a repeated field is refused instead
//! of the last one silently winning.

use std::collections::HashSet;
use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};

use ipnet::{Ipv4Net, Ipv6Net};
use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Number, Value};

use super::{
    Entry, MachineEgress, Mode, Problem, Proto, Rule, MAX_ENTRIES_PER_NETWORK, MAX_NOTE_CHARS,
    MAX_RULES,
};

/// A JSON value whose objects keep repeated keys.
#[derive(Debug)]
pub(super) enum Json {
    Null,
    Bool(bool),
    Number(Number),
    String(String),
    Array(Vec<Self>),
    Object(Vec<(String, Self)>),
}

impl From<&Value> for Json {
    fn from(v: &Value) -> Self {
        match v {
            Value::Null => Self::Null,
            Value::Bool(b) => Self::Bool(*b),
            Value::Number(n) => Self::Number(n.clone()),
            Value::String(s) => Self::String(s.clone()),
            Value::Array(a) => Self::Array(a.iter().map(Self::from).collect()),
            Value::Object(o) => {
                Self::Object(o.iter().map(|(k, v)| (k.clone(), v.into())).collect())
            }
        }
    }
}

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(JsonVisitor)
    }
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }

    fn visit_none<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Json, D::Error> {
        Json::deserialize(d)
    }

    fn visit_bool<E>(self, b: bool) -> Result<Json, E> {
        Ok(Json::Bool(b))
    }

    fn visit_u64<E>(self, n: u64) -> Result<Json, E> {
        Ok(Json::Number(n.into()))
    }

    fn visit_i64<E>(self, n: i64) -> Result<Json, E> {
        Ok(Json::Number(n.into()))
    }

    fn visit_f64<E: serde::de::Error>(self, n: f64) -> Result<Json, E> {
        Number::from_f64(n)
            .map(Json::Number)
            .ok_or_else(|| E::custom("not a finite number"))
    }

    fn visit_str<E>(self, s: &str) -> Result<Json, E> {
        Ok(Json::String(s.to_owned()))
    }

    fn visit_string<E>(self, s: String) -> Result<Json, E> {
        Ok(Json::String(s))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
        let mut out = Vec::new();
        while let Some(v) = seq.next_element()? {
            out.push(v);
        }
        Ok(Json::Array(out))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let mut out = Vec::new();
        while let Some(entry) = map.next_entry()? {
            out.push(entry);
        }
        Ok(Json::Object(out))
    }
}

/// What a value is, for messages: `a number (5)`, `a string ("80")`, `null`.
fn describe(v: &Json) -> String {
    match v {
        Json::Null => "null".into(),
        Json::Bool(b) => format!("a boolean ({b})"),
        Json::Number(n) => format!("a number ({n})"),
        Json::String(s) => format!("a string ({s:?})"),
        Json::Array(_) => "an array".into(),
        Json::Object(_) => "an object".into(),
    }
}

/// The fields of an object, each once, and a message for each repeated one
/// (whose later occurrences are skipped).
fn unique_fields(fields: &[(String, Json)]) -> (Vec<(&str, &Json)>, Vec<String>) {
    let mut seen = HashSet::with_capacity(fields.len());
    let mut keep = Vec::with_capacity(fields.len());
    let mut repeated = Vec::new();
    for (k, v) in fields {
        if seen.insert(k.as_str()) {
            keep.push((k.as_str(), v));
        } else {
            repeated.push(format!("repeated field {k:?}"));
        }
    }
    (keep, repeated)
}

/// Validates a whole document.
pub(super) fn policy(doc: &Json) -> Result<MachineEgress, Vec<Problem>> {
    let Json::Object(fields) = doc else {
        return Err(vec![Problem::top(format!(
            "policy must be a JSON object, found {}",
            describe(doc)
        ))]);
    };
    let (top, mut problems) = top_fields(fields);
    let raw_rules = top.rules;
    let mode = mode_of(&top, &mut problems);
    let rules = rules_of(raw_rules, &mut problems);

    if problems.is_empty() {
        Ok(MachineEgress { mode, rules })
    } else {
        // The document's problems first, then each rule's in rule order.
        problems.sort_by_key(|p| p.rule.map_or(0, |i| i + 1));
        Err(problems)
    }
}

/// A document's top-level fields, as far as they could be read.
struct Top<'a> {
    /// The mode named, if it was valid.
    mode: Option<Mode>,
    /// Whether a mode was named but refused.
    mode_refused: bool,
    /// The rules, not yet validated; empty if absent or not an array.
    rules: &'a [Json],
}

/// Reads the top-level fields, with the problems found in them.
fn top_fields(fields: &[(String, Json)]) -> (Top<'_>, Vec<Problem>) {
    let mut found = Top {
        mode: None,
        mode_refused: false,
        rules: &[],
    };
    let (fields, mut top) = unique_fields(fields);
    for (key, value) in fields {
        match key {
            "mode" => match value {
                Json::String(s) => match s.parse::<Mode>() {
                    Ok(m) => found.mode = Some(m),
                    Err(e) => {
                        found.mode_refused = true;
                        top.push(e.to_string());
                    }
                },
                other => {
                    found.mode_refused = true;
                    top.push(format!(
                        "mode: expected a string (loopback, allowlist, audit or open), found {}",
                        describe(other)
                    ));
                }
            },
            "rules" => match value {
                Json::Array(a) => found.rules = a,
                other => top.push(format!(
                    "rules: expected an array of rules, found {}",
                    describe(other)
                )),
            },
            other => top.push(format!("unknown field {other:?}: expected mode or rules")),
        }
    }
    (found, top.into_iter().map(Problem::top).collect())
}

/// The document's mode — `loopback` without rules and `allowlist` with them
/// when none is named — reporting too many rules, and rules the mode would
/// ignore.
fn mode_of(top: &Top<'_>, problems: &mut Vec<Problem>) -> Mode {
    let raw_rules = top.rules;
    if raw_rules.len() > MAX_RULES {
        problems.push(Problem::top(format!(
            "{} rules: at most {MAX_RULES} are allowed",
            raw_rules.len()
        )));
    }
    let mode = match top.mode {
        Some(m) => m,
        None if raw_rules.is_empty() => Mode::Loopback,
        None => Mode::Allowlist,
    };
    if !top.mode_refused && !raw_rules.is_empty() && matches!(mode, Mode::Loopback | Mode::Open) {
        let what = match mode {
            Mode::Loopback => "nothing leaves",
            _ => "everything leaves",
        };
        problems.push(Problem::top(format!(
            "mode {mode}: {what}, so the {} rules would be ignored; \
             remove them, or use mode allowlist or audit",
            raw_rules.len()
        )));
    }
    mode
}

/// Validates every rule, reporting into `problems`, then the entries per
/// network; returns the valid rules.
fn rules_of(raw_rules: &[Json], problems: &mut Vec<Problem>) -> Vec<Rule> {
    let mut rules = Vec::with_capacity(raw_rules.len().min(MAX_RULES));
    let mut valid = Vec::with_capacity(raw_rules.len().min(MAX_RULES));
    for (i, raw) in raw_rules.iter().enumerate() {
        if let Some(rule) = rule(i, raw, problems) {
            valid.push((i, rule.net, rule.entry()));
            rules.push(rule);
        }
    }
    // Quadratic in the rules: only within the limit.
    if raw_rules.len() <= MAX_RULES {
        problems.extend(entry_overflows(&valid));
    }
    rules
}

/// Validates rule `i`, reporting into `problems`; `Some` when it is valid.
fn rule(i: usize, raw: &Json, problems: &mut Vec<Problem>) -> Option<Rule> {
    let Json::Object(fields) = raw else {
        problems.push(Problem::at(
            i,
            format!(
                "expected a rule object such as {{\"cidr\": \"10.0.0.0/8\"}}, found {}",
                describe(raw)
            ),
        ));
        return None;
    };
    let (mut net, mut proto, mut port, mut note) = (None, None, None, None);
    let (mut has_cidr, mut has_proto, mut has_port) = (false, false, false);
    let (fields, mut msgs) = unique_fields(fields);
    for (key, value) in fields {
        let parsed = match key {
            "cidr" => {
                has_cidr = true;
                cidr(value).map(|n| net = Some(n))
            }
            "proto" => {
                has_proto = true;
                parse_proto(value).map(|p| proto = Some(p))
            }
            "port" => {
                has_port = true;
                parse_port(value).map(|n| port = Some(n))
            }
            "note" => parse_note(value).map(|n| note = Some(n)),
            other => Err(format!(
                "unknown field {other:?}: expected cidr, proto, port or note"
            )),
        };
        if let Err(m) = parsed {
            msgs.push(m);
        }
    }
    if !has_cidr {
        msgs.push("cidr is required: an IPv4 address or network such as 10.0.0.0/8".into());
    }
    if has_port && !has_proto {
        let which = port.map_or_else(String::new, |n| format!(" {n}"));
        msgs.push(format!(
            "port{which} needs a proto (tcp or udp): a rule without proto allows every port"
        ));
    }
    if !msgs.is_empty() {
        problems.extend(msgs.into_iter().map(|m| Problem::at(i, m)));
        return None;
    }
    Some(Rule {
        net: net?,
        proto,
        port,
        note,
    })
}

/// `a.b.c.d/len` with host bits clear, or a bare address (`/32`).
fn cidr(v: &Json) -> Result<Ipv4Net, String> {
    let Json::String(s) = v else {
        return Err(format!(
            "cidr: expected a string such as \"10.0.0.0/8\", found {}",
            describe(v)
        ));
    };
    let (addr, len) = match s.split_once('/') {
        Some((a, l)) => (a, Some(l)),
        None => (s.as_str(), None),
    };
    if addr.parse::<Ipv6Addr>().is_ok() || s.parse::<Ipv6Net>().is_ok() {
        return Err(format!(
            "cidr {s:?} is IPv6: IPv6 is not supported, machine egress rules are IPv4 only"
        ));
    }
    let invalid = || {
        format!("cidr {s:?}: expected an IPv4 address or address/prefix-length such as 10.0.0.0/8")
    };
    let addr = addr.parse::<Ipv4Addr>().map_err(|_| invalid())?;
    let len = match len {
        None => 32,
        Some(l) => prefix_len(l).ok_or_else(|| {
            format!("cidr {s:?}: the prefix length must be a number from 0 to 32")
        })?,
    };
    let net = Ipv4Net::new(addr, len).map_err(|_| invalid())?;
    if net.trunc() != net {
        return Err(format!(
            "cidr {s:?} has host bits set: did you mean \"{}\"?",
            net.trunc()
        ));
    }
    Ok(net)
}

/// `0` to `32` in plain decimal: no sign, no leading zero.
fn prefix_len(l: &str) -> Option<u8> {
    let plain = matches!(l.len(), 1 | 2)
        && l.bytes().all(|b| b.is_ascii_digit())
        && !(l.len() == 2 && l.starts_with('0'));
    let n: u8 = l.parse().ok().filter(|_| plain)?;
    (n <= 32).then_some(n)
}

fn parse_proto(v: &Json) -> Result<Proto, String> {
    match v {
        Json::String(s) => s.parse::<Proto>().map_err(|e| e.to_string()),
        other => Err(format!(
            "proto: expected \"tcp\" or \"udp\", found {}",
            describe(other)
        )),
    }
}

fn parse_port(v: &Json) -> Result<u16, String> {
    match v {
        Json::Number(n) => n
            .as_u64()
            .and_then(|p| u16::try_from(p).ok())
            .filter(|&p| p != 0)
            .ok_or_else(|| format!("port {n}: expected an integer from 1 to 65535")),
        other => Err(format!(
            "port: expected an integer from 1 to 65535, found {}",
            describe(other)
        )),
    }
}

fn parse_note(v: &Json) -> Result<String, String> {
    let Json::String(s) = v else {
        return Err(format!("note: expected a string, found {}", describe(v)));
    };
    let chars = s.chars().count();
    let mut wrong = Vec::new();
    if chars > MAX_NOTE_CHARS {
        wrong.push(format!(
            "note is {chars} characters long: at most {MAX_NOTE_CHARS} are allowed"
        ));
    }
    if let Some((at, c)) = s.chars().enumerate().find(|(_, c)| c.is_control()) {
        wrong.push(format!(
            "note has the control character U+{:04X} at character {at}: notes must be printable",
            u32::from(c)
        ));
    }
    if wrong.is_empty() {
        Ok(s.clone())
    } else {
        Err(wrong.join("; "))
    }
}

/// The networks carrying more than [`MAX_ENTRIES_PER_NETWORK`] distinct
/// entries once the entries of every network containing them are counted,
/// each reported once, at the first rule with that network.
///
/// `rules` are the valid rules as (index, network, entry).
fn entry_overflows(rules: &[(usize, Ipv4Net, Entry)]) -> Vec<Problem> {
    let mut problems = Vec::new();
    let mut done: Vec<Ipv4Net> = Vec::new();
    for &(first, net, _) in rules {
        if done.contains(&net) {
            continue;
        }
        done.push(net);
        // Distinct entries in rule order, each with the rules it came from.
        let mut entries: Vec<(Entry, Vec<usize>)> = Vec::new();
        for &(i, covering, entry) in rules {
            if !covering.contains(&net) {
                continue;
            }
            match entries.iter_mut().find(|(e, _)| *e == entry) {
                Some((_, from)) => from.push(i),
                None => entries.push((entry, vec![i])),
            }
        }
        if entries.len() <= MAX_ENTRIES_PER_NETWORK {
            continue;
        }
        let listed: Vec<String> = entries
            .iter()
            .map(|(e, from)| {
                let from: Vec<String> = from.iter().map(usize::to_string).collect();
                let rules = if from.len() == 1 { "rule" } else { "rules" };
                format!("{e} ({rules} {})", from.join(", "))
            })
            .collect();
        problems.push(Problem::at(
            first,
            format!(
                "network {net} carries {} distinct entries, at most {MAX_ENTRIES_PER_NETWORK} are \
                 allowed: {}; the kernel's lookup finds only the most specific network, so its \
                 entries include those of every network that contains it",
                entries.len(),
                listed.join(", ")
            ),
        ));
    }
    problems
}
