//! After a handover, the predecessor drains the flows it had open under the
//! registrations it had; pushes go to the successor. So that a change there
//! (a delete, a narrower policy) is not ignored by those flows, the two keep
//! the handover connection: the successor sends, one JSON line each, the id
//! of every sandbox the predecessor knew whose registration it changed or
//! took out, and the predecessor takes that sandbox out of its own registry
//! (in memory: its commit thread is sealed), which ends its flows there
//! within a tick; their clients reconnect to the successor. Addresses its
//! sandboxes take that they did not hold are sent too: the predecessor
//! denies them as destinations from then on, as it does its own
//! sandboxes' (its draining spliced flows to one are cut), and so are the
//! addresses VMs claim there (machine egress). When the
//! connection ends before the drain does (the successor stopped, or speaks
//! no such lines), the predecessor cannot know what changed: it ends its
//! drain, as when `timeouts.drain` runs out.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use egress_policy::SandboxId;

use crate::registry::{Generation, Registry};

/// One line the successor tells: a sandbox of the predecessor's that
/// changed, or addresses its sandboxes hold now that they did not.
#[derive(serde::Deserialize)]
#[serde(untagged)]
enum Told {
    Changed(String),
    Registered { addresses: Vec<std::net::IpAddr> },
}

/// Most addresses on one line: an IPv6 address in full is 41 bytes quoted.
const ADDRESSES_PER_LINE: usize = 1_000;

/// How often the successor looks for changes to tell.
const TELL_EVERY: Duration = Duration::from_millis(100);

/// The successor's side, on a thread of its own: every [`TELL_EVERY`], the
/// ids of the sandboxes changed since the last look among those the
/// predecessor had, and the addresses registered or claimed by a VM
/// since. Ends when the
/// predecessor has gone (it closed the connection, or a write fails or
/// waits past the handover's I/O timeout). `had`: the registry as the
/// predecessor left it (before anything here changed it).
pub(crate) fn tell(stream: UnixStream, registry: &Registry, had: Arc<Generation>) {
    let mut known = had;
    // VMs' addresses are told each once, from the first look: those the
    // predecessor's VMs held too are denied there already.
    let mut claimed = std::collections::HashSet::new();
    let mut out = &stream;
    loop {
        std::thread::sleep(TELL_EVERY);
        if gone(&stream) {
            return;
        }
        let now = registry.checkpoint();
        let mut registered: Vec<std::net::IpAddr> = registry
            .vm_claimed()
            .into_iter()
            .filter(|a| claimed.insert(*a))
            .collect();
        if Arc::ptr_eq(&now, &known) && registered.is_empty() {
            continue;
        }
        let changed = now.changed_since(&known);
        registered.extend(now.registered_since(&known));
        known = now;
        let mut lines = Vec::new();
        for id in &changed {
            if serde_json::to_writer(&mut lines, id.as_str()).is_err() {
                return;
            }
            lines.push(b'\n');
        }
        // Lines well under the predecessor's longest (64 KiB).
        for chunk in registered.chunks(ADDRESSES_PER_LINE) {
            let line = serde_json::json!({ "addresses": chunk });
            if serde_json::to_writer(&mut lines, &line).is_err() {
                return;
            }
            lines.push(b'\n');
        }
        if !lines.is_empty() && out.write_all(&lines).is_err() {
            return;
        }
    }
}

/// Whether the peer closed the connection (or it failed); without waiting.
fn gone(stream: &UnixStream) -> bool {
    use rustix::net::RecvFlags;
    let mut byte = [0u8; 1];
    match rustix::net::recv(stream, &mut byte, RecvFlags::PEEK | RecvFlags::DONTWAIT) {
        Ok((_, n)) => n == 0,
        Err(e) => e != rustix::io::Errno::AGAIN && e != rustix::io::Errno::INTR,
    }
}

/// The predecessor's side, on a thread of its own while it drains: takes
/// out of `registry` each sandbox the successor names, and denies the
/// addresses it registered. Returns when the connection ends (or carries
/// a line it does not read, or more addresses than are kept): the caller
/// then ends the drain.
pub(crate) fn listen(stream: UnixStream, registry: &Registry) -> String {
    if let Err(e) = stream.set_read_timeout(None) {
        return format!("the handover connection: {e}");
    }
    let mut reader = BufReader::new(stream);
    loop {
        let mut line = String::new();
        let read = (&mut reader)
            .take(super::MAX_LINE as u64)
            .read_line(&mut line);
        match read {
            Ok(0) => return "the successor closed the handover connection".into(),
            Err(e) => return format!("the handover connection: {e}"),
            Ok(_) => {}
        }
        let head: String = line.chars().take(100).collect();
        let told = match line.strip_suffix('\n') {
            Some(l) => serde_json::from_str::<Told>(l).map_err(|e| e.to_string()),
            None => Err("cut short".into()),
        };
        match told {
            Ok(Told::Changed(id)) => match SandboxId::parse(&id) {
                Ok(id) => {
                    if registry.remove(&id) {
                        tracing::info!(sandbox = %id, "the sandbox changed on the successor: its flows draining here end");
                    }
                }
                Err(e) => return format!("the successor named no sandbox ({e}): {head:?}"),
            },
            Ok(Told::Registered { addresses }) => {
                if !registry.add_foreign(&addresses) {
                    return "the successor registered more addresses than are kept".into();
                }
            }
            Err(e) => {
                return format!("the successor sent a line that does not read ({e}): {head:?}")
            }
        }
    }
}

#[cfg(test)]
mod tests;
