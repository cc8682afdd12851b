//! A VM's open flows forgotten with its addresses. An open flow passes on
//! its connection-tracking entry alone (`ct state established accept`,
//! before any dispatch), so an entry kept after the address left its VM
//! (the VM removed, or registered again without it) would let the next VM
//! given that address ride the flows the earlier one opened: a UDP flow at
//! once, from the same source port, to a destination its own policy
//! refuses. So when an address leaves a VM, and again when one is given to
//! a VM, the entries with it at either end of their original direction
//! are deleted (`conntrack -D -s A`, then `-d A`), under the state lock.
//! The second covers what the first cannot: the flows an address opened
//! while no VM held it (its packets are then not judged), a delete that
//! failed, a gateway stopped between the two.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use crate::nft::{run_command, Ran};

/// The conntrack command (`machine_egress.conntrack`).
#[derive(Clone, Debug)]
pub struct Conntrack {
    argv: Vec<String>,
    timeout: Duration,
}

/// How long the deletes of one change may take in all: a table of a
/// million entries is walked in a few seconds, and they run under the
/// state lock.
const TIMEOUT: Duration = Duration::from_secs(30);

impl Conntrack {
    pub fn new(argv: Vec<String>) -> Self {
        Self {
            argv,
            timeout: TIMEOUT,
        }
    }

    /// Deletes the entries whose original source or destination is one of
    /// `addrs`, all within the one time limit; the number deleted, or what
    /// failed (by address; every address is tried while time is left).
    pub fn forget(&self, addrs: &[IpAddr]) -> Result<u64, String> {
        let deadline = Instant::now() + self.timeout;
        let mut deleted = 0;
        let mut failed = Vec::new();
        for addr in addrs {
            let shown = addr.to_string();
            for end in ["-s", "-d"] {
                let left = deadline.saturating_duration_since(Instant::now());
                let outcome = match left.is_zero() {
                    true => Err(format!("not tried: {:?} were spent", self.timeout)),
                    false => self
                        .run(&["-D", end, &shown], left)
                        .and_then(|ran| deleted_by(&ran).ok_or_else(|| said(&ran))),
                };
                match outcome {
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

    /// Whether the command runs (`--version`): what failed, if it does not.
    pub fn probe(&self) -> Result<(), String> {
        let ran = self.run(&["--version"], self.timeout)?;
        match ran.success {
            true => Ok(()),
            false => Err(said(&ran)),
        }
    }

    fn run(&self, args: &[&str], within: Duration) -> Result<Ran, String> {
        let key = "machine_egress.conntrack";
        run_command(&self.argv, key, (args, None), false, within).map_err(|e| e.message)
    }
}

/// What a run said on its error output, within a bound.
fn said(ran: &Ran) -> String {
    egress_api::text::bounded(ran.stderr.trim(), 300)
}

/// The entries a `conntrack -D` run says it deleted (`… N flow entries
/// have been deleted.`). It ends with status 1 when none matched, so a
/// failure is told by what it says, not by its status alone.
fn deleted_by(ran: &Ran) -> Option<u64> {
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
            signal: None,
            stdout: String::new(),
            stderr: stderr.into(),
        }
    }

    #[test]
    fn the_count_is_read_from_what_conntrack_says() {
        let said = "conntrack v1.4.7 (conntrack-tools): 3 flow entries have been deleted.\n";
        assert_eq!(deleted_by(&ran(true, said)), Some(3));
        let none = "conntrack v1.4.7 (conntrack-tools): 0 flow entries have been deleted.\n";
        assert_eq!(
            deleted_by(&ran(false, none)),
            Some(0),
            "none matched: status 1"
        );
        let failed = "conntrack v1.4.7 (conntrack-tools): Operation failed: invalid parameters\n";
        assert_eq!(deleted_by(&ran(false, failed)), None);
        assert_eq!(deleted_by(&ran(true, "")), None, "said nothing");
        assert_eq!(
            deleted_by(&ran(false, said)),
            None,
            "a count with a failure"
        );
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
        assert!(c.probe().is_err_and(|e| e.contains("cannot run")));
        assert_eq!(Conntrack::new(Vec::new()).forget(&[]), Ok(0));
    }

    /// The deletes of one change share one time limit: once it is spent,
    /// the addresses left are not tried, and said so.
    #[test]
    fn the_deletes_of_a_change_share_one_time_limit() {
        let slow = vec![
            "sh".into(),
            "-c".into(),
            "sleep 5".into(),
            "conntrack".into(),
        ];
        let mut c = Conntrack::new(slow);
        c.timeout = Duration::from_millis(300);
        let addrs: Vec<IpAddr> = ["198.51.100.7", "198.51.100.8"]
            .iter()
            .map(|a| a.parse().expect("addr"))
            .collect();
        let started = Instant::now();
        let why = c.forget(&addrs).expect_err("too slow");
        assert!(started.elapsed() < Duration::from_secs(4), "{why}");
        assert!(why.contains("-s 198.51.100.7: did not finish"), "{why}");
        assert!(why.contains("-d 198.51.100.8: not tried"), "{why}");
    }
}
