//! Name sets: exact domains and wildcard suffixes in hash maps.
//!
//! A lookup costs one probe for the exact name plus one per parent
//! (`a.b.c` probes `a.b.c`, then wildcards for `b.c` and `c`): bounded by the
//! name's label count, never by the number of rules.

use std::collections::HashMap;

use super::ipset::RuleIdx;
use crate::name::{Hostname, WildcardDomain};

#[derive(Debug, Default)]
pub(crate) struct NameSet {
    exact: HashMap<Hostname, RuleIdx>,
    /// Keyed by the suffix after `*.`.
    wildcard: HashMap<Hostname, RuleIdx>,
}

impl NameSet {
    pub(crate) fn insert_exact(&mut self, name: &Hostname, rule: RuleIdx) {
        self.exact.entry(name.clone()).or_insert(rule);
    }

    pub(crate) fn insert_wildcard(&mut self, w: &WildcardDomain, rule: RuleIdx) {
        self.wildcard.entry(w.suffix().clone()).or_insert(rule);
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.exact.is_empty() && self.wildcard.is_empty()
    }

    /// The rule matching `name`: an exact rule first, then the nearest wildcard.
    pub(crate) fn lookup(&self, name: &Hostname) -> Option<RuleIdx> {
        if let Some(&r) = self.exact.get(name.as_str()) {
            return Some(r);
        }
        if self.wildcard.is_empty() {
            return None;
        }
        name.parents().find_map(|p| self.wildcard.get(p).copied())
    }

    /// The first of `names` that matches, with its rule.
    pub(crate) fn lookup_any<'n>(
        &self,
        names: impl IntoIterator<Item = &'n Hostname>,
    ) -> Option<(&'n Hostname, RuleIdx)> {
        if self.is_empty() {
            return None;
        }
        names
            .into_iter()
            .find_map(|n| self.lookup(n).map(|r| (n, r)))
    }
}
