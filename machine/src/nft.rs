//! Running nft for machine egress, and reading back what the kernel saw.
//!
//! The rules themselves are written by [`rules`]: one table for the node,
//! `inet egress_machine`, with a chain, sets and counters per VM.

pub mod rules;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::net::IpAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

use egress_policy::machine::Proto;

use rules::{OBSERVED_TIMEOUT, TABLE};

/// Why nft failed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("nft: {message}")]
pub struct NftError {
    pub message: String,
    /// The run was stopped before nft said how it ended (killed at its
    /// time limit): a transaction it was sending may have been committed.
    pub unsure: bool,
}

impl NftError {
    /// nft (or the command) said it failed: nothing was committed.
    fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            unsure: false,
        }
    }
}

/// The nftables command (`machine_egress.nft`).
#[derive(Clone, Debug)]
pub struct Nft {
    argv: Vec<String>,
    /// How long one run may take before it is killed (and fails).
    timeout: Duration,
}

/// How long one nft run may take: a whole node table of 500 VMs loads in
/// well under a second; one that hangs (an `nsenter` target stuck, say)
/// would otherwise hold the state lock, and with it every VM call and the
/// observer, for good.
const NFT_TIMEOUT: Duration = Duration::from_secs(30);

/// One element of a VM's `observed` set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelObserved {
    pub addr: IpAddr,
    pub proto: Proto,
    pub port: u16,
    /// Packets since the element was added.
    pub packets: u64,
    /// How long ago the last packet was (timeout minus time left).
    pub idle: Duration,
}

impl Nft {
    pub fn new(argv: Vec<String>) -> Self {
        Self {
            argv,
            timeout: NFT_TIMEOUT,
        }
    }

    /// With another limit on how long one run may take.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Applies a ruleset in one transaction (`nft -f -`).
    pub fn apply(&self, ruleset: &str) -> Result<(), NftError> {
        self.run(&["-f", "-"], Some(ruleset)).map(drop)
    }

    /// Tables of the earlier layout (`egress_vm_<id>`, one per VM), which
    /// the node table replaces.
    pub fn legacy_tables(&self) -> Result<Vec<String>, NftError> {
        let out = self.run(&["-j", "list", "tables", "inet"], None)?;
        let doc: serde_json::Value = serde_json::from_str(&out)
            .map_err(|e| NftError::new(format!("unreadable `nft -j list tables`: {e}")))?;
        Ok(items(&doc, "table")
            .filter_map(|t| t.get("name")?.as_str())
            .filter(|n| n.starts_with("egress_vm_"))
            .map(str::to_owned)
            .collect())
    }

    /// The chains of the node table (`inet egress_machine`) beyond its
    /// base ones: a VM's (`vm_<key>`, `link_<key>`, …). None when there is
    /// no such table.
    pub fn vm_chains(&self) -> Result<Vec<String>, NftError> {
        let out = self.run(&["-j", "list", "chains", "inet"], None)?;
        let doc: serde_json::Value = serde_json::from_str(&out)
            .map_err(|e| NftError::new(format!("unreadable `nft -j list chains`: {e}")))?;
        Ok(items(&doc, "chain")
            .filter(|c| c.get("table").and_then(|t| t.as_str()) == Some(TABLE))
            .filter_map(|c| c.get("name")?.as_str())
            .filter(|n| !["prerouting", "forward", "output"].contains(n))
            .map(str::to_owned)
            .collect())
    }

    /// The elements of the `inet` set `table`.`set` of names (`ifname`
    /// and the like): an absent table or set is an error.
    pub fn set_names(&self, table: &str, set: &str) -> Result<Vec<String>, NftError> {
        let out = self.run(&["-j", "list", "set", "inet", table, set], None)?;
        let doc: serde_json::Value = serde_json::from_str(&out)
            .map_err(|e| NftError::new(format!("unreadable `nft -j list set`: {e}")))?;
        Ok(items(&doc, "set")
            .filter_map(|s| s.get("elem")?.as_array())
            .flatten()
            .filter_map(|e| e.as_str().map(str::to_owned))
            .collect())
    }

    /// The named counters of the tables `egress_machine` of `families`
    /// (the node table, `inet`, and the links' table, `netdev`): name
    /// (`refused_<key>`, `spoofed_<key>`) → packets.
    pub fn counters(&self, families: &[&str]) -> Result<BTreeMap<String, u64>, NftError> {
        let mut all = BTreeMap::new();
        for family in families {
            let out = self.run(&["-j", "list", "counters", "table", family, TABLE], None)?;
            let doc: serde_json::Value = serde_json::from_str(&out)
                .map_err(|e| NftError::new(format!("unreadable `nft -j list counters`: {e}")))?;
            all.extend(
                items(&doc, "counter")
                    .filter(|c| c.get("table").and_then(|t| t.as_str()) == Some(TABLE))
                    .filter_map(|c| {
                        let name = c.get("name")?.as_str()?;
                        Some((name.to_owned(), c.get("packets")?.as_u64()?))
                    }),
            );
        }
        Ok(all)
    }

    /// Whether the kernel binds an ingress chain to a device by its name:
    /// one transaction makes a chain on a device that does not exist and
    /// takes it away again (nothing is left either way). Kernels before
    /// Linux 6.16 refuse it (the device must exist, and a chain bound to one
    /// is not bound again to a device made later under the same name).
    pub fn binds_ingress_by_name(&self) -> Result<(), NftError> {
        // A name no device has: 15 characters, the kernel's longest.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let device = format!(
            "egp{:06x}{:06x}",
            std::process::id() & 0xff_ffff,
            nanos & 0xff_ffff
        );
        let probe = "egress_machine_probe";
        self.apply(&format!(
            "table netdev {probe}\ndelete table netdev {probe}\n\
             table netdev {probe} {{\n    chain c {{\n        type filter hook ingress device \"{device}\" priority 0; policy accept;\n    }}\n}}\n\
             delete table netdev {probe}\n"
        ))
    }

    /// The elements of a VM's observed sets (IPv4 and IPv6).
    pub fn observed(&self, vm: &str) -> Result<Vec<KernelObserved>, NftError> {
        let k = rules::key(vm);
        let mut all = Vec::new();
        for set in [format!("obs_{k}"), format!("obs6_{k}")] {
            let out = self.run(&["-j", "list", "set", "inet", TABLE, &set], None)?;
            let doc: serde_json::Value = serde_json::from_str(&out)
                .map_err(|e| NftError::new(format!("unreadable `nft -j list set`: {e}")))?;
            all.extend(
                items(&doc, "set")
                    .filter_map(|s| s.get("elem")?.as_array())
                    .flatten()
                    .filter_map(element),
            );
        }
        Ok(all)
    }

    /// Removes elements from a VM's observed sets (evicted by the gateway).
    pub fn forget(&self, vm: &str, keys: &[(IpAddr, Proto, u16)]) -> Result<(), NftError> {
        if keys.is_empty() {
            return Ok(());
        }
        let k = rules::key(vm);
        let mut text = String::new();
        for (v6, set) in [(false, format!("obs_{k}")), (true, format!("obs6_{k}"))] {
            let list: Vec<String> = keys
                .iter()
                .filter(|(a, _, _)| a.is_ipv6() == v6)
                .map(|(a, p, port)| format!("{a} . {p} . {port}"))
                .collect();
            for chunk in list.chunks(512) {
                let _ = writeln!(
                    text,
                    "delete element inet {TABLE} {set} {{ {} }}",
                    chunk.join(", ")
                );
            }
        }
        self.apply(&text)
    }

    fn run(&self, args: &[&str], stdin: Option<&str>) -> Result<String, NftError> {
        let key = "machine_egress.nft";
        let ran = run_command(&self.argv, key, (args, stdin), true, self.timeout)?;
        if ran.success {
            return Ok(ran.stdout);
        }
        // Killed (the OOM killer, a signal from elsewhere) after its batch
        // may have reached the kernel, while it read the answers: it never
        // said how it ended.
        if let Some(signal) = ran.signal {
            return Err(NftError {
                message: format!("killed by signal {signal}; {}", ran.stderr.trim()),
                unsure: true,
            });
        }
        Err(NftError::new(ran.stderr.trim()))
    }
}

/// How a command run by [`run_command`] ended.
pub(crate) struct Ran {
    pub(crate) success: bool,
    /// The signal that ended it, if one did.
    pub(crate) signal: Option<i32>,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
}

/// Runs `argv` (the command and its leading arguments, from the key
/// `key`) with `args`, `stdin` its input, within `timeout`; its output
/// is kept when `stdout` (else thrown away unread: conntrack prints every
/// entry it deletes). Err: it could not be run, its input not written, or
/// it was killed at its time limit (`unsure`: it may have done what it was
/// asked).
pub(crate) fn run_command(
    argv: &[String],
    key: &str,
    (args, stdin): (&[&str], Option<&str>),
    stdout: bool,
    timeout: Duration,
) -> Result<Ran, NftError> {
    let (program, lead) = argv
        .split_first()
        .ok_or_else(|| NftError::new(format!("{key} is empty")))?;
    let input = match stdin {
        Some(text) => Stdio::from(whole(text)?),
        None => Stdio::null(),
    };
    let mut child = Command::new(program)
        .args(lead)
        .args(args)
        .stdin(input)
        .stdout(if stdout {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| NftError::new(format!("cannot run {program}: {e}")))?;
    // The output is read while it runs (a full pipe would stall it), in
    // a thread of its own, and it is waited for however the run ends.
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    // Past the limit the threads are left to end when the pipes close
    // (a process the command started may still hold them).
    let status = wait_within(&mut child, timeout).map_err(|e| NftError {
        message: e.to_string(),
        unsure: true,
    })?;
    let (stdout, stderr) = (joined(stdout), joined(stderr));
    Ok(Ran {
        success: status.success(),
        signal: std::os::unix::process::ExitStatusExt::signal(&status),
        stdout,
        stderr,
    })
}

/// `text` whole in an unnamed file in memory (or, where memfd is refused,
/// in the temporary directory), read from its start: the
/// command's input. Fed through a pipe while it ran, a gateway killed
/// halfway through a write would leave nft an input cut short at a line's
/// end, which it would take as a whole transaction (the start of a table:
/// its chains flushed, half its VMs) and commit.
fn whole(text: &str) -> Result<std::fs::File, NftError> {
    use std::io::Seek;
    let cannot = |e: std::io::Error| NftError::new(format!("writing the ruleset: {e}"));
    use rustix::fs::{Mode, OFlags};
    let fd = match rustix::fs::memfd_create(c"egress-ruleset", rustix::fs::MemfdFlags::CLOEXEC) {
        Ok(fd) => fd,
        // A runtime that refuses memfd (a strict seccomp profile): an
        // unnamed file in the temporary directory instead.
        Err(_) => rustix::fs::open(
            std::env::temp_dir(),
            OFlags::TMPFILE | OFlags::RDWR | OFlags::CLOEXEC,
            Mode::RUSR | Mode::WUSR,
        )
        .map_err(|e| cannot(e.into()))?,
    };
    let mut file = std::fs::File::from(fd);
    file.write_all(text.as_bytes()).map_err(cannot)?;
    file.rewind().map_err(cannot)?;
    Ok(file)
}

/// Reads `pipe` to its end in a thread of its own.
fn drain<R: std::io::Read + Send + 'static>(
    pipe: Option<R>,
) -> Option<std::thread::JoinHandle<String>> {
    let mut pipe = pipe?;
    Some(std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut pipe, &mut text);
        text
    }))
}

fn joined(reader: Option<std::thread::JoinHandle<String>>) -> String {
    reader.and_then(|r| r.join().ok()).unwrap_or_default()
}

/// Waits for `child` until `timeout`, then kills it (and waits for that).
fn wait_within(
    child: &mut std::process::Child,
    timeout: Duration,
) -> std::io::Result<std::process::ExitStatus> {
    let deadline = std::time::Instant::now() + timeout;
    let mut pause = Duration::from_millis(1);
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if std::time::Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("did not finish within {timeout:?}: killed"),
            ));
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

/// The objects of one kind in `nft -j` output: `{"nftables": [{kind: {..}}]}`.
fn items<'a>(
    doc: &'a serde_json::Value,
    kind: &'a str,
) -> impl Iterator<Item = &'a serde_json::Value> + 'a {
    doc.get("nftables")
        .and_then(|v| v.as_array())
        .into_iter()
        .flatten()
        .filter_map(move |o| o.get(kind))
}

/// One set element: `{"elem": {"val": {"concat": [addr, proto, port]},
/// "expires": s, "counter": {"packets": n}}}`.
fn element(e: &serde_json::Value) -> Option<KernelObserved> {
    let elem = e.get("elem")?;
    let concat = elem.get("val")?.get("concat")?.as_array()?;
    let [addr, proto, port] = concat.as_slice() else {
        return None;
    };
    let addr: IpAddr = addr.as_str()?.parse().ok()?;
    let proto = match proto {
        serde_json::Value::String(s) => s.parse().ok()?,
        serde_json::Value::Number(n) => match n.as_u64()? {
            6 => Proto::Tcp,
            17 => Proto::Udp,
            _ => return None,
        },
        _ => return None,
    };
    let port = u16::try_from(port.as_u64()?).ok()?;
    let packets = elem
        .get("counter")
        .and_then(|c| c.get("packets"))
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(0);
    let expires = elem
        .get("expires")
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(OBSERVED_TIMEOUT.as_secs());
    let idle = OBSERVED_TIMEOUT.saturating_sub(Duration::from_secs(expires));
    Some(KernelObserved {
        addr,
        proto,
        port,
        packets,
        idle,
    })
}

#[cfg(test)]
mod tests;
