//! Suggestions: rules that would let through what the kernel refused (or, in
//! audit, would have refused), merged with the current rules, within the
//! limits.
//!
//! Each refused destination first gets a `/32` rule of its own per
//! protocol and port. When an address would carry more than
//! [`MAX_ENTRIES_PER_NETWORK`] entries (its own and those of the current
//! rules around it), the ports of one protocol are widened to `<proto>/any`,
//! then of both, then to `any`. When the rules would number more than
//! [`MAX_RULES`], the added rules are aggregated block by block, the blocks
//! saving the most rules first, into `/24`, then `/16`, `/8` and `/0`; then
//! their entries are widened; then everything goes to one `0.0.0.0/0` rule.
//!
//! Added rules never overlap one another, so each can be checked against the
//! current rules alone: its network, and every current network inside it,
//! must stay within the entry limit. Every observed destination ends up
//! allowed — except where no rule can do it without changing the current
//! rules: an address whose current rules already carry the most entries, or
//! no room left for one more rule. Those are returned in
//! [`Suggestion::uncovered`] and named in the notes.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::net::Ipv4Addr;

use ipnet::Ipv4Net;

use super::{
    Entry, MachineEgress, Mode, Problem, Proto, Rule, MAX_ENTRIES_PER_NETWORK, MAX_NOTE_CHARS,
    MAX_RULES,
};

/// One destination the kernel refused (or, in audit, would have refused).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observed {
    pub addr: Ipv4Addr,
    pub proto: Proto,
    /// 0 is taken as every port of `proto`: a rule cannot name port 0.
    pub port: u16,
    /// DNS names attributed to `addr`; may be empty.
    pub names: Vec<String>,
    /// How often it was seen.
    pub count: u64,
}

/// What [`suggest`] proposes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Suggestion {
    /// The current rules, then the added ones; always valid when the current
    /// policy is.
    pub policy: MachineEgress,
    /// The rules added to the current ones, in the order appended.
    pub added: Vec<Rule>,
    /// For people: mode changes, what was aggregated or widened and why,
    /// what could not be added.
    pub notes: Vec<String>,
    /// The observed destinations (merged, one per address, proto and port)
    /// that the suggested rules still do not allow: see the module docs.
    pub uncovered: Vec<Observed>,
}

/// The prefix lengths added rules are aggregated to, in turn.
const LEVELS: [u8; 4] = [24, 16, 8, 0];

/// How many items of a list a note spells out.
const NOTE_LIST: usize = 8;

type Entries = BTreeSet<Entry>;

/// Rules that would allow what was observed, merged with the current rules
/// (kept first, in order) and within the limits; see the module docs.
///
/// Under `open` nothing is suggested; `loopback` becomes `allowlist` when
/// rules are added; `audit` and `allowlist` stay.
pub fn suggest(current: &MachineEgress, observed: &[Observed]) -> Suggestion {
    let (dests, allowed) = refused(current, observed);
    let (mut notes, budget) = match room(current, &dests, allowed) {
        Ok(room) => room,
        Err(unchanged) => return unchanged,
    };

    let cur = Current::new(&current.rules);
    let mut plan = Plan::per_address(&cur, &dests, &mut notes);
    plan.fit(&cur, &dests, budget, &mut notes);
    let added = plan.rules(&dests, &mut notes);

    let policy = MachineEgress {
        mode: mode_after(current.mode, &added, &mut notes),
        rules: current.rules.iter().chain(&added).cloned().collect(),
    };
    if let Err(problems) = policy.validate() {
        // A bug, not an input: refuse to suggest an invalid policy.
        notes.push(format!(
            "internal error: the suggestion did not validate, nothing added: {}",
            joined(&problems)
        ));
        return unchanged(current, notes, &dests);
    }
    let mut uncovered: Vec<&Dest> = plan.uncovered.iter().map(|&i| &dests[i]).collect();
    uncovered.sort_by_key(|d| d.key());
    Suggestion {
        policy,
        added,
        notes,
        uncovered: uncovered.into_iter().map(Dest::observed).collect(),
    }
}

/// The notes so far and how many rules may be added, or the unchanged
/// policy when nothing can be: mode open, an invalid current policy,
/// nothing refused, or no room for another rule.
fn room(
    current: &MachineEgress,
    dests: &[Dest],
    allowed: usize,
) -> Result<(Vec<String>, usize), Suggestion> {
    if current.mode == Mode::Open {
        return Err(unchanged(
            current,
            vec![
                "mode open allows everything: no rules to suggest; use mode audit to \
                  record what an allowlist would drop"
                    .into(),
            ],
            &[],
        ));
    }
    if let Err(problems) = current.validate() {
        return Err(unchanged(
            current,
            vec![format!(
                "the current policy is not valid, fix it first: {}",
                joined(&problems)
            )],
            dests,
        ));
    }

    let mut notes = Vec::new();
    if allowed > 0 {
        notes.push(format!(
            "{} already allowed by the current rules",
            plural(allowed, "observed destination")
        ));
    }
    if current.mode == Mode::Audit {
        notes.push("mode stays audit: set mode allowlist to enforce".into());
    }
    if dests.is_empty() {
        notes.push("nothing to add: every observed destination is already allowed".into());
        return Err(unchanged(current, notes, &[]));
    }
    let budget = MAX_RULES.saturating_sub(current.rules.len());
    if budget == 0 {
        notes.push(format!(
            "the current policy already has {} rules, the most allowed: nothing could be added",
            current.rules.len()
        ));
        return Err(unchanged(current, notes, dests));
    }
    Ok((notes, budget))
}

/// The current policy as the suggestion, with `notes`, and `uncovered` as
/// what it still does not allow.
fn unchanged(current: &MachineEgress, notes: Vec<String>, uncovered: &[Dest]) -> Suggestion {
    Suggestion {
        policy: current.clone(),
        added: Vec::new(),
        notes,
        uncovered: uncovered.iter().map(Dest::observed).collect(),
    }
}

/// The suggested mode: `loopback` becomes `allowlist` when rules are added
/// (noted), any other mode stays.
fn mode_after(mode: Mode, added: &[Rule], notes: &mut Vec<String>) -> Mode {
    match mode {
        Mode::Loopback if !added.is_empty() => {
            notes.push(
                "mode loopback becomes allowlist: under loopback nothing leaves, whatever the rules"
                    .into(),
            );
            Mode::Allowlist
        }
        m => m,
    }
}

fn joined(problems: &[Problem]) -> String {
    let text: Vec<String> = problems.iter().map(Problem::to_string).collect();
    text.join("; ")
}

/// One observed destination, merged.
struct Dest {
    addr: Ipv4Addr,
    proto: Proto,
    port: u16,
    names: Vec<String>,
    count: u64,
}

impl Dest {
    fn key(&self) -> (Ipv4Addr, Proto, u16) {
        (self.addr, self.proto, self.port)
    }

    fn entry(&self) -> Entry {
        match self.port {
            0 => Entry::Proto(self.proto),
            n => Entry::Port(self.proto, n),
        }
    }

    fn observed(&self) -> Observed {
        Observed {
            addr: self.addr,
            proto: self.proto,
            port: self.port,
            names: self.names.clone(),
            count: self.count,
        }
    }
}

/// The observed destinations the current rules refuse, merged and sorted by
/// address, proto and port; and how many distinct ones they allow.
fn refused(current: &MachineEgress, observed: &[Observed]) -> (Vec<Dest>, usize) {
    let mut merged: BTreeMap<(Ipv4Addr, Proto, u16), Dest> = BTreeMap::new();
    for o in observed {
        let d = merged.entry((o.addr, o.proto, o.port)).or_insert(Dest {
            addr: o.addr,
            proto: o.proto,
            port: o.port,
            names: Vec::new(),
            count: 0,
        });
        d.count = d.count.saturating_add(o.count);
        for name in &o.names {
            let name = printable(name);
            if !name.is_empty() && !d.names.contains(&name) {
                d.names.push(name);
            }
        }
    }
    let total = merged.len();
    let dests: Vec<Dest> = merged
        .into_values()
        .filter(|d| {
            !current
                .rules
                .iter()
                .any(|r| r.net.contains(&d.addr) && r.entry().covers(d.entry()))
        })
        .collect();
    let allowed = total - dests.len();
    (dests, allowed)
}

/// `name` with every control character replaced, so it can go in a note.
fn printable(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_control() {
                char::REPLACEMENT_CHARACTER
            } else {
                c
            }
        })
        .collect()
}

/// The current rules as the entry limit sees them.
struct Current {
    rules: Vec<(Ipv4Net, Entry)>,
    /// Each distinct network with the entries it carries.
    nets: Vec<(Ipv4Net, Entries)>,
}

impl Current {
    fn new(rules: &[Rule]) -> Self {
        let mut cur = Self {
            rules: rules.iter().map(|r| (r.net, r.entry())).collect(),
            nets: Vec::new(),
        };
        for &(net, _) in &cur.rules {
            if !cur.nets.iter().any(|(n, _)| *n == net) {
                cur.nets.push((net, cur.carried(net)));
            }
        }
        cur
    }

    /// The entries of the current rules whose network contains `net`.
    fn carried(&self, net: Ipv4Net) -> Entries {
        self.rules
            .iter()
            .filter(|(n, _)| n.contains(&net))
            .map(|&(_, e)| e)
            .collect()
    }

    /// Whether rules for `entries` on `net`, overlapping no other added
    /// rule, keep `net` and every current network inside it within the limit.
    fn fits(&self, net: Ipv4Net, entries: &Entries) -> bool {
        union_len(&self.carried(net), entries) <= MAX_ENTRIES_PER_NETWORK
            && self
                .nets
                .iter()
                .filter(|(n, _)| *n != net && net.contains(n))
                .all(|(_, carried)| union_len(carried, entries) <= MAX_ENTRIES_PER_NETWORK)
    }

    /// The narrowest way to allow `exact` on `net` within the limit.
    fn narrowest(&self, net: Ipv4Net, exact: &Entries) -> Option<Entries> {
        options(exact).into_iter().find(|o| self.fits(net, o))
    }
}

fn union_len(a: &Entries, b: &Entries) -> usize {
    a.len() + b.difference(a).count()
}

/// Without entries another entry of the set covers.
fn normalize(mut e: Entries) -> Entries {
    if e.contains(&Entry::Any) {
        return Entries::from([Entry::Any]);
    }
    for p in Proto::ALL {
        if e.contains(&Entry::Proto(p)) {
            e.retain(|x| !matches!(x, Entry::Port(q, _) if *q == p));
        }
    }
    e
}

/// `e` with the ports of `protos` widened to `<proto>/any`.
fn widen(e: &Entries, protos: &[Proto]) -> Entries {
    normalize(
        e.iter()
            .map(|&x| match x {
                Entry::Port(p, _) if protos.contains(&p) => Entry::Proto(p),
                x => x,
            })
            .collect(),
    )
}

/// The ways to allow at least `exact`, narrowest first: as is; the ports of
/// one protocol (the one with more first) widened; of both; `any`.
fn options(exact: &Entries) -> Vec<Entries> {
    let ports = |p: Proto| {
        exact
            .iter()
            .filter(|e| matches!(e, Entry::Port(q, _) if *q == p))
            .count()
    };
    let (first, second) = if ports(Proto::Udp) > ports(Proto::Tcp) {
        (Proto::Udp, Proto::Tcp)
    } else {
        (Proto::Tcp, Proto::Udp)
    };
    let mut out: Vec<Entries> = Vec::with_capacity(5);
    for o in [
        exact.clone(),
        widen(exact, &[first]),
        widen(exact, &[second]),
        widen(exact, &Proto::ALL),
        Entries::from([Entry::Any]),
    ] {
        if !out.contains(&o) {
            out.push(o);
        }
    }
    out
}

/// Added rules on one network: `entries` on `net` for the destinations `dests`.
struct Group {
    net: Ipv4Net,
    /// Indices into the destinations.
    dests: Vec<usize>,
    /// What the destinations need.
    exact: Entries,
    /// What is allowed: `exact` or a widening of it.
    entries: Entries,
}

/// The added rules being worked out: groups on pairwise disjoint networks.
struct Plan {
    groups: Vec<Group>,
    /// Destinations no rule could be added for.
    uncovered: Vec<usize>,
}

impl Plan {
    /// One `/32` group per address, its entries widened as the limit needs.
    fn per_address(cur: &Current, dests: &[Dest], notes: &mut Vec<String>) -> Self {
        let mut plan = Self {
            groups: Vec::new(),
            uncovered: Vec::new(),
        };
        let indices: Vec<usize> = (0..dests.len()).collect();
        for same in indices.chunk_by(|&a, &b| dests[a].addr == dests[b].addr) {
            let net = Ipv4Net::from(dests[same[0]].addr);
            let exact = normalize(same.iter().map(|&i| dests[i].entry()).collect());
            match cur.narrowest(net, &exact) {
                Some(entries) => plan.groups.push(Group {
                    net,
                    dests: same.to_vec(),
                    exact,
                    entries,
                }),
                None => plan.uncovered.extend_from_slice(same),
            }
        }
        if !plan.uncovered.is_empty() {
            notes.push(format!(
                "could not add {} ({}): the current rules for their addresses already carry \
                 {MAX_ENTRIES_PER_NETWORK} entries, the most a network may, and a rule for any \
                 of them would add one more; widen those rules instead",
                plural(plan.uncovered.len(), "observed destination"),
                named(dests, &plan.uncovered)
            ));
        }
        plan
    }

    fn len(&self) -> usize {
        self.groups.iter().map(|g| g.entries.len()).sum()
    }

    /// Brings the number of added rules within `budget`: aggregation level by
    /// level, then wider entries, then one `0.0.0.0/0` group, then dropping
    /// the groups seen least.
    fn fit(&mut self, cur: &Current, dests: &[Dest], budget: usize, notes: &mut Vec<String>) {
        for len in LEVELS {
            if self.len() <= budget {
                return;
            }
            self.aggregate(cur, len, budget);
        }
        if self.len() > budget {
            self.coarsen(cur, budget);
        }
        if self.len() > budget {
            self.everywhere(cur, budget);
        }
        if self.len() > budget {
            self.drop_least_seen(dests, budget, notes);
        }
    }

    /// Merges the groups inside `/len` blocks, the blocks saving the most
    /// rules first, until the plan fits `budget` or no block saves any.
    fn aggregate(&mut self, cur: &Current, len: u8, budget: usize) {
        let mut blocks: BTreeMap<Ipv4Net, Vec<usize>> = BTreeMap::new();
        for (i, g) in self.groups.iter().enumerate() {
            if g.net.prefix_len() > len {
                let block = Ipv4Net::new_assert(g.net.network(), len).trunc();
                blocks.entry(block).or_default().push(i);
            }
        }
        let mut merges = Vec::new();
        for (block, members) in blocks {
            let exact = normalize(
                members
                    .iter()
                    .flat_map(|&i| self.groups[i].exact.iter().copied())
                    .collect(),
            );
            let Some(entries) = cur.narrowest(block, &exact) else {
                continue;
            };
            let before: usize = members.iter().map(|&i| self.groups[i].entries.len()).sum();
            if entries.len() < before {
                merges.push((before - entries.len(), block, members, exact, entries));
            }
        }
        merges.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut excess = self.len().saturating_sub(budget);
        let mut merged = vec![false; self.groups.len()];
        let mut new = Vec::new();
        for (saving, net, members, exact, entries) in merges {
            if excess == 0 {
                break;
            }
            excess = excess.saturating_sub(saving);
            let mut group_dests = Vec::new();
            for i in members {
                merged[i] = true;
                group_dests.extend_from_slice(&self.groups[i].dests);
            }
            new.push(Group {
                net,
                dests: group_dests,
                exact,
                entries,
            });
        }
        let old = std::mem::take(&mut self.groups);
        self.groups = old
            .into_iter()
            .zip(merged)
            .filter_map(|(g, m)| (!m).then_some(g))
            .chain(new)
            .collect();
    }

    /// Widens the entries of groups, those saving the most first, until the
    /// plan fits `budget` or none can save more.
    fn coarsen(&mut self, cur: &Current, budget: usize) {
        let mut order: Vec<(usize, usize, Vec<Entries>)> = Vec::new();
        for (i, g) in self.groups.iter().enumerate() {
            let valid: Vec<Entries> = options(&g.exact)
                .into_iter()
                .filter(|o| o.len() < g.entries.len() && cur.fits(g.net, o))
                .collect();
            if let Some(fewest) = valid.iter().map(BTreeSet::len).min() {
                order.push((g.entries.len() - fewest, i, valid));
            }
        }
        order.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut excess = self.len().saturating_sub(budget);
        for (most, i, valid) in order {
            if excess == 0 {
                break;
            }
            let g = &mut self.groups[i];
            let have = g.entries.len();
            // The narrowest that is enough, else the one saving the most.
            let pick = valid
                .iter()
                .find(|o| have - o.len() >= excess)
                .or_else(|| valid.iter().find(|o| have - o.len() == most));
            if let Some(pick) = pick {
                excess = excess.saturating_sub(have - pick.len());
                g.entries = pick.clone();
            }
        }
    }

    /// Replaces every group with one on `0.0.0.0/0`, when that fits.
    fn everywhere(&mut self, cur: &Current, budget: usize) {
        let net = Ipv4Net::default();
        let exact = normalize(
            self.groups
                .iter()
                .flat_map(|g| g.exact.iter().copied())
                .collect(),
        );
        let Some(entries) = options(&exact)
            .into_iter()
            .find(|o| o.len() <= budget && cur.fits(net, o))
        else {
            return;
        };
        let dests = self
            .groups
            .iter()
            .flat_map(|g| g.dests.iter().copied())
            .collect();
        self.groups = vec![Group {
            net,
            dests,
            exact,
            entries,
        }];
    }

    /// Drops the groups seen least until the plan fits `budget`.
    fn drop_least_seen(&mut self, dests: &[Dest], budget: usize, notes: &mut Vec<String>) {
        let seen = |g: &Group| -> u64 {
            g.dests
                .iter()
                .fold(0u64, |n, &i| n.saturating_add(dests[i].count))
        };
        self.groups
            .sort_by(|a, b| seen(b).cmp(&seen(a)).then(a.net.cmp(&b.net)));
        let mut dropped = Vec::new();
        while self.len() > budget {
            let Some(g) = self.groups.pop() else { break };
            self.uncovered.extend_from_slice(&g.dests);
            dropped.extend(g.dests);
        }
        if !dropped.is_empty() {
            dropped.sort_unstable();
            notes.push(format!(
                "could not add {}, those seen least ({}): there is room for only {} more, and \
                 no wider rule covering them keeps the current networks within \
                 {MAX_ENTRIES_PER_NETWORK} entries",
                plural(dropped.len(), "observed destination"),
                named(dests, &dropped),
                plural(budget, "rule"),
            ));
        }
    }

    /// The added rules, by network and entry, with their notes; notes on
    /// what was aggregated and widened go to `notes`.
    fn rules(&mut self, dests: &[Dest], notes: &mut Vec<String>) -> Vec<Rule> {
        self.groups.sort_by_key(|g| g.net);
        let mut aggregated: BTreeMap<u8, (usize, usize)> = BTreeMap::new();
        let mut rules = Vec::new();
        for g in &mut self.groups {
            g.dests.sort_unstable();
            if g.net.prefix_len() < 32 {
                let (d, r) = aggregated.entry(g.net.prefix_len()).or_default();
                *d += g.dests.len();
                *r += g.entries.len();
            }
            if g.entries != g.exact {
                notes.push(format!(
                    "{}: allows {} for the observed {}, to stay within the limits \
                     ({MAX_ENTRIES_PER_NETWORK} entries per network, counting those of the \
                     networks containing it; {MAX_RULES} rules)",
                    g.net,
                    list(&g.entries),
                    list(&g.exact)
                ));
            }
            for &entry in &g.entries {
                let covered = g
                    .dests
                    .iter()
                    .map(|&i| &dests[i])
                    .filter(|d| entry.covers(d.entry()));
                rules.push(Rule::new(g.net, entry, Some(rule_note(covered))));
            }
        }
        for (len, (d, r)) in aggregated.into_iter().rev() {
            notes.push(format!(
                "aggregated {} into {} at /{len} to stay within {MAX_RULES} rules",
                plural(d, "observed destination"),
                plural(r, "rule")
            ));
        }
        for d in dests.iter().filter(|d| d.port == 0) {
            notes.push(format!(
                "{} {} port 0: a rule cannot name port 0, so {} is suggested",
                d.addr,
                d.proto,
                Entry::Proto(d.proto)
            ));
        }
        rules
    }
}

/// `observed: <names, joined>`, at most [`MAX_NOTE_CHARS`] characters.
fn rule_note<'a>(dests: impl Iterator<Item = &'a Dest>) -> String {
    let mut note = String::from("observed");
    let mut seen = HashSet::new();
    let mut sep = ": ";
    for name in dests.flat_map(|d| &d.names) {
        if note.chars().count() > MAX_NOTE_CHARS {
            break;
        }
        if seen.insert(name) {
            note.push_str(sep);
            note.push_str(name);
            sep = ", ";
        }
    }
    if note.chars().count() > MAX_NOTE_CHARS {
        note = note.chars().take(MAX_NOTE_CHARS - 1).collect();
        note.push('…');
    }
    note
}

/// Entries as `tcp/80, udp/53`, abbreviated past [`NOTE_LIST`].
fn list(entries: &Entries) -> String {
    let named: Vec<String> = entries.iter().map(Entry::to_string).collect();
    abbreviated(&named)
}

/// `1 rule`, `2 rules`.
fn plural(n: usize, word: &str) -> String {
    if n == 1 {
        format!("1 {word}")
    } else {
        format!("{n} {word}s")
    }
}

/// Destinations as `10.0.0.1 tcp/80, 10.0.0.2 udp/53`, abbreviated.
fn named(dests: &[Dest], which: &[usize]) -> String {
    let items: Vec<String> = which
        .iter()
        .map(|&i| format!("{} {}", dests[i].addr, dests[i].entry()))
        .collect();
    abbreviated(&items)
}

fn abbreviated(items: &[String]) -> String {
    if items.len() <= NOTE_LIST {
        items.join(", ")
    } else {
        format!(
            "{} and {} more",
            items[..NOTE_LIST].join(", "),
            items.len() - NOTE_LIST
        )
    }
}
