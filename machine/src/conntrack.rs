//! A VM's open flows forgotten with its addresses. An open flow passes on
//! its connection-tracking entry alone (`ct state established accept`,
//! before any dispatch), so an entry kept after the address left its VM
//! (the VM removed, or registered again without it) would let the next VM
//! given that address ride the flows the earlier one opened: a UDP flow at
//! once, from the same source port, to a destination its own policy
//! refuses. So when an address leaves a VM, the entries with it at either
//! end of their original direction are deleted (`conntrack -D -s A`, then
//! `-d A`), under the state lock, before any VM can be given it again.

use std::net::IpAddr;
use std::time::Duration;

use crate::nft::{run_command, Ran};

/// The conntrack command (`machine_egress.conntrack`).
#[derive(Clone, Debug)]
pub struct Conntrack {
    argv: Vec<String>,
    timeout: Duration,
}

/// How long one run may take: a table of a million entries is walked in
/// a few seconds.
const TIMEOUT: Duration = Duration::from_secs(30);

impl Conntrack {
    pub fn new(argv: Vec<String>) -> Self {
        Self {
            argv,
            timeout: TIMEOUT,
        }
    }

    /// Deletes the entries whose original source or destination is one of
    /// `addrs`; the number deleted, or what failed (by address; every
    /// address is tried).
    pub fn forget(&self, addrs: &[IpAddr]) -> Result<u64, String> {
        let mut deleted = 0;
        let mut failed = Vec::new();
        for addr in addrs {
            let shown = addr.to_string();
            for end in ["-s", "-d"] {
                match self.delete(&[end, &shown]) {
                    Ok(n) => deleted += n,
                    Err(why) => failed.push(format!("{end} {shown}: {why}")),
                }
            }
        }
        match failed.is_empty() {
            true => Ok(deleted),
            false => Err(failed.join("; ")),
        }
    }

    fn delete(&self, filter: &[&str]) -> Result<u64, String> {
        let args = [&["-D"], filter].concat();
        let key = "machine_egress.conntrack";
        let ran =
            run_command(&self.argv, key, (&args, None), self.timeout).map_err(|e| e.message)?;
        deleted(&ran).ok_or_else(|| egress_api::text::bounded(ran.stderr.trim(), 300))
    }
}

/// The entries a `conntrack -D` run says it deleted (`… N flow entries
/// have been deleted.`). It ends with status 1 when none matched, so a
/// failure is told by what it says, not by its status alone.
fn deleted(ran: &Ran) -> Option<u64> {
    let line = ran
        .stderr
        .lines()
        .find(|l| l.trim_end().ends_with("flow entries have been deleted."))?;
    let head = line
        .trim_end()
        .strip_suffix("flow entries have been deleted.")?;
    let n: u64 = head.split_whitespace().last()?.parse().ok()?;
    (ran.success || n == 0).then_some(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ran(success: bool, stderr: &str) -> Ran {
        Ran {
            success,
            stdout: String::new(),
            stderr: stderr.into(),
        }
    }

    #[test]
    fn the_count_is_read_from_what_conntrack_says() {
        let said = "conntrack v1.4.7 (conntrack-tools): 3 flow entries have been deleted.\n";
        assert_eq!(deleted(&ran(true, said)), Some(3));
        let none = "conntrack v1.4.7 (conntrack-tools): 0 flow entries have been deleted.\n";
        assert_eq!(
            deleted(&ran(false, none)),
            Some(0),
            "none matched: status 1"
        );
        let failed = "conntrack v1.4.7 (conntrack-tools): Operation failed: invalid parameters\n";
        assert_eq!(deleted(&ran(false, failed)), None);
        assert_eq!(deleted(&ran(true, "")), None, "said nothing");
        assert_eq!(deleted(&ran(false, said)), None, "a count with a failure");
    }

    #[test]
    fn a_command_that_cannot_run_is_named() {
        let c = Conntrack::new(vec!["/nonexistent/conntrack".into()]);
        let why = c
            .forget(&["198.51.100.7".parse().expect("addr")])
            .expect_err("fails");
        assert!(
            why.starts_with("-s 198.51.100.7: cannot run /nonexistent/conntrack")
                && why.contains("; -d 198.51.100.7: "),
            "{why}"
        );
        assert_eq!(Conntrack::new(Vec::new()).forget(&[]), Ok(0));
    }
}
