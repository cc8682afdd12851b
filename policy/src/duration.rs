//! Durations as operators write them in configuration: a whole number and
//! one unit, `"500ms"`, `"30s"`, `"5m"`, `"24h"`, `"7d"`. Nothing else
//! (no spaces, no fractions, no sums), so a value reads one way only.

use std::time::Duration;

use serde::{Deserialize, Deserializer};

/// Reads `"30s"`; `None` for anything else, or a value that overflows.
pub fn parse(s: &str) -> Option<Duration> {
    let split = s.find(|c: char| !c.is_ascii_digit())?;
    let (n, unit) = s.split_at(split);
    let n: u64 = n.parse().ok()?;
    let secs = |k: u64| n.checked_mul(k).map(Duration::from_secs);
    match unit {
        "ms" => Some(Duration::from_millis(n)),
        "s" => secs(1),
        "m" => secs(60),
        "h" => secs(3600),
        "d" => secs(86_400),
        _ => None,
    }
}

/// `#[serde(deserialize_with = "egress_policy::duration::deserialize")]`:
/// a string [`parse`] reads, or an error that quotes it.
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let s = String::deserialize(d)?;
    parse(&s).ok_or_else(|| {
        serde::de::Error::custom(format!(
            "invalid duration {s:?}: expected a whole number with ms, s, m, h or d, e.g. \"30s\""
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse("7d"), Some(Duration::from_secs(7 * 86_400)));
        for bad in [
            "",
            "s",
            "5",
            "5 s",
            "-5s",
            "5x",
            "99999999999999999999d",
            "1.5s",
        ] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }
}
