//! In-kernel splice: once a flow is decided *splice*, the kernel moves its
//! bytes, socket to socket, without waking the gateway for each of them.
//!
//! The maps and the `sk_skb` verdict program are `egress-sockmap`'s, loaded
//! once at start. A flow's two sockets are each other's peers there; what
//! one receives, the program redirects to the other's send side, up to a
//! limit the gateway raises as the destination takes the bytes. Past it, or
//! while bytes it passed are still waiting, the program passes segments to
//! the socket's own receive queue instead; this task copies those on, after
//! everything redirected before them has been written.
//!
//! What the kernel does not do, this task does:
//!
//! - **Memory, bounded where the kernel lets it be.** An `sk_skb` redirect
//!   has no back-pressure of its own: the receiving socket's window stays
//!   open while the bytes queue in kernel memory before the other socket
//!   (measured here: a sender whose receiver never reads queued 845 MiB in
//!   3 s). With the limit, bytes redirected and not yet written to the
//!   destination stay under [`WINDOW`] (plus one segment); passed bytes
//!   fill the source's receive buffer and then wait in the kernel's retry
//!   queue, which nothing bounds (126 MiB measured for a half-closed flow
//!   whose reader stopped, before the program dropped a FIN that comes
//!   alone; not measured since). A direction sealed by the other side's FIN
//!   has no back-pressure at all: [`HALF_CLOSED_CAP`] resets it. That is
//!   why this path is off by default.
//! - **Half-close.** A FIN is not redirected (the program drops a FIN that
//!   comes alone: handed on, it would break the kernel's worker; see
//!   `egress_sockmap::program`). When a source has sent its FIN and all it
//!   sent is written to the destination, the destination is shut down for
//!   writing.
//! - **Counts and idle.** Read from the sockets (`TCP_INFO`): the bytes
//!   written to each side (`bytes_sent - bytes_retrans + notsent_bytes`) are
//!   the flow's counts, exact; no change in what either side received or
//!   was written for `idle` closes the flow.
//!
//! Bytes already queued on a socket when it joins are pushed through the
//! program at once (`SO_RCVLOWAT`), so a server that speaks first is not left
//! waiting. Where the program cannot be loaded (no CAP_BPF, an old kernel)
//! or a flow cannot join (the maps are full, a socket already closing), the
//! flow is spliced by the user-space copy in [`crate::splice`].

use std::io;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use egress_sockmap::{
    cookie, kick, peek, recv, shutdown_write, tcp_info, Gate, Sockmap, Tally, TcpInfo, TCP_CLOSE,
    TCP_ESTABLISHED, TCP_FIN_WAIT1, TCP_FIN_WAIT2,
};
use tokio::io::Interest;
use tokio::net::TcpStream;

use crate::fault::{Fault, Side};
use crate::spliced::Spliced;

/// Sockets each map holds: 32,768 kernel-spliced flows; beyond, the user-space copy.
const SOCKETS: u32 = 65_536;

/// Bytes a direction may have redirected and not yet written to its
/// destination: the kernel memory one flow may hold, per direction (what one
/// socket's send buffer may hold at the kernel's default maximum, 4 MiB, is
/// more). A flow moving more than an eighth of this between two looks is
/// looked at every millisecond, so that the limit rises before the program
/// reaches it: at 1 GiB/s, 1 MiB a millisecond.
pub(crate) const WINDOW: u64 = 2 * 1024 * 1024;

/// Largest copy of passed bytes at once.
const COPY: usize = 64 * 1024;

/// How often a flow waiting for the kernel to write its redirected bytes
/// (before copying passed ones, or before a FIN) looks again.
const BUSY_TICK: Duration = Duration::from_millis(1);

/// The most a sealed direction (its destination half-closed, see [`seal`])
/// may have redirected and not written: past it the reader is too slow and
/// the flow is reset (`splice_backlog`).
const HALF_CLOSED_CAP: u64 = 16 * 1024 * 1024;

/// How often a sealed direction is looked at while it moves nothing; once
/// it moves, every millisecond. At 1 GB/s, 10 MB past the cap at most.
const SEALED_TICK: Duration = Duration::from_millis(10);

/// Redirected bytes unwritten for that long, with nothing written, nothing
/// received, and both sockets' send queues empty and acknowledged (see
/// [`idle_queues`]): the kernel will write no more (they were dropped, or
/// it failed the destination), and the flow ends.
const STALLED: Duration = Duration::from_secs(2);

/// The loaded program and its maps.
#[derive(Debug)]
pub(crate) struct KernelSplice {
    map: Sockmap,
    /// Looks at joined flows, all flows together (how often the gateway
    /// woke for the kernel path).
    looks: AtomicU64,
    /// A test's step between the two sockets' joins: an error fails the
    /// second.
    #[cfg(test)]
    before_second_join: BetweenJoins,
}

/// A test's step: an error fails what follows it.
#[cfg(test)]
type Step = Box<dyn Fn() -> io::Result<()> + Send + Sync>;

/// Run between the two joins (tests only).
#[cfg(test)]
#[derive(Default)]
struct BetweenJoins(std::sync::Mutex<Option<Step>>);

#[cfg(test)]
impl std::fmt::Debug for BetweenJoins {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BetweenJoins")
    }
}

/// The oldest kernel whose sockmap runs a verdict program with no stream
/// parser (as this one is attached): on older ones the program loads and
/// attaches, and never runs, so every flow would stall.
const OLDEST_KERNEL: (u32, u32) = (5, 10);

/// Whether a kernel release (`/proc/sys/kernel/osrelease`, `6.1.0-28-amd64`)
/// is at least [`OLDEST_KERNEL`]; one that does not read as a version is not.
fn kernel_suffices(release: &str) -> bool {
    let mut parts = release.trim().split(['.', '-', '+']);
    let mut number = || parts.next().and_then(|p| p.parse::<u32>().ok());
    match (number(), number()) {
        (Some(major), Some(minor)) => (major, minor) >= OLDEST_KERNEL,
        _ => false,
    }
}

/// The in-kernel splice as `mode` asks, or `None` (the user-space copy);
/// said once in the log either way.
pub(crate) fn load(mode: crate::config::KernelSplice) -> Option<KernelSplice> {
    if mode != crate::config::KernelSplice::On {
        return None;
    }
    match KernelSplice::load() {
        Ok(k) => {
            tracing::warn!("splice: in the kernel (sockmap, sk_skb verdict): experimental, its memory is not bounded for a reader that stops (docs/architecture.md)");
            Some(k)
        }
        Err(e) => {
            tracing::warn!(error = %e, "splice: the kernel path cannot be loaded here; spliced flows are copied in user space");
            None
        }
    }
}

impl KernelSplice {
    pub(crate) fn load() -> io::Result<Self> {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease")?;
        if !kernel_suffices(&release) {
            return Err(io::Error::other(format!(
                "kernel {} is older than {}.{}, whose sockmap runs a verdict program without a parser",
                release.trim(),
                OLDEST_KERNEL.0,
                OLDEST_KERNEL.1
            )));
        }
        Ok(Self {
            map: Sockmap::load(SOCKETS)?,
            looks: AtomicU64::new(0),
            #[cfg(test)]
            before_second_join: BetweenJoins::default(),
        })
    }

    /// Puts `client` and `origin` in the maps: from here, what either
    /// receives goes to the other, bytes already queued too. On error
    /// nothing is left in the maps; the sockets are as they were
    /// ([`JoinError::Untouched`]) unless the program redirected bytes of
    /// the one that joined, which leaving the maps drops.
    fn join(&self, client: &TcpStream, origin: &TcpStream) -> Result<Joined<'_>, JoinError> {
        let socks = [client, origin];
        let untouched = JoinError::Untouched;
        let mut joined = Joined {
            map: &self.map,
            looks: &self.looks,
            cookies: [
                cookie(client).map_err(untouched)?,
                cookie(origin).map_err(untouched)?,
            ],
            entered: 0,
        };
        // Both peers before either joins: the program never meets a
        // socket without one (it would drop the bytes).
        self.map
            .set_peer(joined.cookies[0], origin.as_fd())
            .map_err(untouched)?;
        self.map
            .set_peer(joined.cookies[1], client.as_fd())
            .map_err(untouched)?;
        for (side, sock) in socks.into_iter().enumerate() {
            let as_far = |e| match joined.entered {
                0 => JoinError::Untouched(e),
                // The client is in: out of the program first, then what it
                // redirected of it. Nothing (the usual case: the origin's
                // FIN raced its join) leaves the stream whole for the copy;
                // passed bytes wait in the client's own queue.
                _ => {
                    self.map.unjoin(joined.cookies[0]);
                    match self.map.tally(joined.cookies[0]) {
                        Ok(t) if t.taken == 0 => JoinError::Untouched(e),
                        _ => JoinError::Entered(e),
                    }
                }
            };
            #[cfg(test)]
            if side == 1 {
                let step = self.before_second_join.0.lock().expect("hook");
                if let Some(Err(e)) = step.as_ref().map(|f| f()) {
                    return Err(as_far(e));
                }
            }
            self.map
                .join(joined.cookies[side], sock.as_fd(), WINDOW)
                .map_err(as_far)?;
            joined.entered = side + 1;
        }
        for sock in socks {
            kick(sock).map_err(JoinError::Entered)?;
        }
        Ok(joined)
    }
}

/// Why a flow did not join.
#[derive(Debug)]
enum JoinError {
    /// Before either socket joined: the flow can be copied in user space.
    Untouched(io::Error),
    /// After one joined: bytes the kernel took may be lost, so the flow
    /// can only be ended.
    Entered(io::Error),
}

/// A flow's sockets in the maps; they leave on drop.
#[derive(Debug)]
struct Joined<'k> {
    map: &'k Sockmap,
    /// [`KernelSplice::looks`].
    looks: &'k AtomicU64,
    /// Client, origin.
    cookies: [u64; 2],
    /// How many of the two joined.
    entered: usize,
}

impl Drop for Joined<'_> {
    fn drop(&mut self) {
        // Out of `joined` first: the program never meets a socket without a peer.
        for c in &self.cookies[..self.entered] {
            self.map.leave(*c);
        }
        for c in self.cookies {
            self.map.remove_peer(c);
        }
    }
}

/// Joins `client` and `origin` and lets the kernel move their bytes until
/// both directions have closed, an error, or `idle` passes with no byte
/// received. Counts are the bytes written to each side, including any
/// written before they joined. A flow that cannot join is handed back,
/// untouched, for the user-space copy.
pub(crate) async fn splice(
    kernel: &KernelSplice,
    (client, origin, peeked): (TcpStream, TcpStream, u64),
    ends: (Duration, &(dyn Fn() -> Option<Fault> + Sync)),
) -> Result<Spliced, (TcpStream, TcpStream, io::Error)> {
    // What the gateway wrote to the origin's socket before the flow's
    // bytes: an operator's proxy's CONNECT head, not the flow's.
    let mut heads = [0u64; 2];
    let (fault, ways) = {
        // Each destination's count before the join: what the gateway wrote
        // itself. Read after, it would take in what the join pushed at once
        // (bytes queued before it), which the program counts too.
        let written = |s: &TcpStream| tcp_info(s).map(|i| i.written).unwrap_or(0);
        let before = written(&origin);
        heads[0] = before.saturating_sub(peeked);
        let bases = [before - heads[0], written(&client)];
        let joined = kernel.join(&client, &origin);
        let joined = match joined {
            Ok(j) => j,
            Err(JoinError::Untouched(e)) => return Err((client, origin, e)),
            Err(JoinError::Entered(e)) => return Ok(broken_joining(&client, &origin, heads, &e)),
        };
        let mut ways = bases.map(|base| Way {
            base,
            ..Way::default()
        });
        let fault = watch(&joined, [&client, &origin], ends, &mut ways).await;
        // Idle with bytes held (read and not written, passed and not read,
        // or redirected and not written: leaving the maps drops those) is
        // a stream cut short, as any other end but a clean idle one.
        let held = || {
            ways.iter().any(|w| !w.buf.is_empty() || w.queued() > 0)
                || behind(&ways, [&client, &origin])
        };
        if fault.is_some_and(|f| f != Fault::IDLE_TIMEOUT || held()) {
            // Broken, not finished: neither side may take the end of the
            // stream for a complete one (a FIN would say so).
            crate::io::reset(&client);
            crate::io::reset(&origin);
        }
        tracing::debug!(
            up_taken = ways[0].tally.taken,
            up_passed = ways[0].tally.passed,
            down_taken = ways[1].tally.taken,
            down_passed = ways[1].tally.passed,
            "kernel splice ended"
        );
        (fault, ways)
    };
    // What each socket took: no more than it was handed (the gateway's
    // writes and the program's redirects), nor than TCP_INFO says it has
    // (a FIN may count there; bytes redirected to a socket that was reset
    // are not).
    let moved = |s: &TcpStream, way: &Way, head: u64| {
        let handed = way.base + way.tally.taken + way.consumed();
        tcp_info(s).map_or(handed, |i| i.written.saturating_sub(head).min(handed))
    };
    Ok(Spliced {
        up: moved(&origin, &ways[0], heads[0]),
        down: moved(&client, &ways[1], heads[1]),
        idle_timeout: fault == Some(Fault::IDLE_TIMEOUT),
        fault,
        budget_cut: None,
    })
}

/// A flow whose join failed after one socket joined: the kernel may have
/// taken bytes that leaving the maps dropped, so a copy in user space could
/// carry the stream on with a gap. Both sides are reset instead.
fn broken_joining(
    client: &TcpStream,
    origin: &TcpStream,
    heads: [u64; 2],
    e: &io::Error,
) -> Spliced {
    tracing::warn!(error = %e, "kernel splice: joining failed halfway; the flow is reset");
    let written =
        |s: &TcpStream, head: u64| tcp_info(s).map_or(0, |i| i.written.saturating_sub(head));
    let spliced = Spliced {
        up: written(origin, heads[0]),
        down: written(client, heads[1]),
        fault: Some(Fault::SPLICE_BROKEN),
        ..Spliced::default()
    };
    crate::io::reset(client);
    crate::io::reset(origin);
    spliced
}

/// One direction of a kernel-spliced flow, source to destination.
#[derive(Debug, Default)]
struct Way {
    /// Bytes written to the destination before the flow joined.
    base: u64,
    /// The program's gate for the source, as last set.
    gate: Gate,
    /// Bytes read from the source by the gateway: passed ones, and all
    /// after it left the program.
    read: u64,
    /// Read and not yet written to the destination.
    buf: Vec<u8>,
    /// What the program counted.
    tally: Tally,
    /// The source sent its FIN (one sequence number, no byte).
    eof: bool,
    /// The destination was shut down for writing.
    closed: bool,
}

impl Way {
    /// Bytes read and written to the destination: the gate's `consumed`
    /// while the program runs.
    fn consumed(&self) -> u64 {
        self.read - self.buf.len() as u64
    }

    /// Passed bytes not read yet: they wait in the source's own queue.
    fn queued(&self) -> u64 {
        self.tally.passed.saturating_sub(self.read)
    }
}

/// Whether bytes the program redirected are not all written yet, either
/// way (as [`step`] counts them).
fn behind(ways: &[Way; 2], socks: [&TcpStream; 2]) -> bool {
    (0..2).any(|src| {
        let way = &ways[src];
        let written = tcp_info(socks[1 - src]).map_or(0, |i| i.written);
        let redirected_written = written.saturating_sub(way.base + way.consumed());
        way.tally.taken > redirected_written
    })
}

/// What a look at a direction asks of the loop.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Wants {
    /// To write buffered bytes when the destination can take them.
    writable: bool,
    /// To look again soon: the kernel still writes what it redirected.
    soon: bool,
    /// Bytes redirected and not yet written to the destination.
    behind: bool,
}

/// Watches a joined flow, keeping each direction's state in `ways`;
/// `Some(fault)` if a reset, the idle timeout, the kernel's failure
/// ([`Fault::SPLICE_BROKEN`]) or `stop` (the fault it names,
/// looked at each tick) ended it, `None` when both directions closed.
async fn watch(
    joined: &Joined<'_>,
    socks: [&TcpStream; 2],
    (idle, stop): (Duration, &(dyn Fn() -> Option<Fault> + Sync)),
    ways: &mut [Way; 2],
) -> Option<Fault> {
    for way in ways.iter_mut() {
        way.gate = Gate {
            limit: WINDOW,
            consumed: 0,
        };
    }
    // At most a second: a deleted sandbox's flow ends within one, as on
    // every splice path.
    let slow = (idle / 8).clamp(Duration::from_millis(10), Duration::from_secs(1));
    let mut last_moved = [0u64; 4];
    let mut last_taken = [0u64; 2];
    let mut heard = Instant::now();
    loop {
        joined.looks.fetch_add(1, Ordering::Relaxed);
        // Readiness first, so that nothing arriving from here is missed.
        for (side, way) in ways.iter().enumerate() {
            if !way.eof {
                clear(socks[side]);
            }
        }
        let info = match (tcp_info(socks[0]), tcp_info(socks[1])) {
            (Ok(c), Ok(o)) => [c, o],
            (Err(e), _) => return io_fault(Side::Client, &e),
            (_, Err(e)) => return io_fault(Side::Upstream, &e),
        };
        // A reset ends the flow, whichever direction was busy.
        for (side, who) in [Side::Client, Side::Upstream].into_iter().enumerate() {
            if info[side].state == TCP_CLOSE {
                if let Err(e) = peek(socks[side]) {
                    if e.kind() != io::ErrorKind::WouldBlock {
                        return io_fault(who, &e);
                    }
                }
            }
        }
        let mut wants = [Wants::default(); 2];
        for (src, wanted) in wants.iter_mut().enumerate() {
            match step(joined, socks, ways, src, &info) {
                Ok(w) => *wanted = w,
                Err(fault) => return fault,
            }
        }
        if ways.iter().all(|w| w.closed) {
            return None;
        }
        let moved = [
            info[0].received,
            info[1].received,
            info[0].written,
            info[1].written,
        ];
        // A direction whose FIN waited on the other's buffered bytes, which
        // the other's look just wrote: sealed at the next look, not at the
        // slow tick (its look came first, and saw them still buffered).
        let flushed = (0..2).any(|s| {
            let (way, other) = (&ways[s], &ways[1 - s]);
            way.eof && !way.closed && way.buf.is_empty() && other.buf.is_empty()
        });
        let waiting = wants.iter().any(|w| w.soon) || flushed;
        let behind = wants.iter().any(|w| w.behind);
        if let Some(fault) = stop() {
            return Some(fault);
        }
        if moved != last_moved {
            last_moved = moved;
            heard = Instant::now();
        } else if heard.elapsed() >= idle {
            return Some(Fault::IDLE_TIMEOUT);
        } else if behind && info.iter().all(idle_queues) && heard.elapsed() >= STALLED {
            tracing::debug!("kernel splice: redirected bytes were never written; ending the flow");
            return Some(Fault::SPLICE_BROKEN);
        }
        let taken = [ways[0].tally.taken, ways[1].tally.taken];
        let hot = (0..2).any(|s| taken[s].saturating_sub(last_taken[s]) >= WINDOW / 8);
        last_taken = taken;
        // A sealed direction has no back-pressure in the kernel: it is
        // looked at often enough that its cap holds (see `seal`).
        let sealed = ways.iter().any(|w| w.gate.limit == u64::MAX && !w.eof);
        let tick = if waiting || hot {
            BUSY_TICK
        } else if sealed {
            SEALED_TICK
        } else {
            slow
        };
        // Woken when the program passes bytes (the source becomes
        // readable), at a FIN or a reset, when a destination can take
        // buffered bytes, or by the tick. A source is listened to only
        // when its bytes would be read now: tokio keeps a closed socket
        // readable, which would otherwise spin.
        let listen = |s: usize| !ways[s].eof && !wants[s].soon && ways[s].buf.is_empty();
        let (listen0, listen1) = (listen(0), listen(1));
        tokio::select! {
            _ = socks[0].readable(), if listen0 => {}
            _ = socks[1].readable(), if listen1 => {}
            _ = socks[1].writable(), if wants[0].writable => {}
            _ = socks[0].writable(), if wants[1].writable => {}
            () = tokio::time::sleep(tick) => {}
        }
    }
}

/// One look at the direction from `src`: copies bytes the program passed
/// (or, once the source left it, all bytes) on once the kernel has written
/// what it redirected before them, raises the limit as the destination
/// takes bytes, notices a FIN or a reset, and passes the FIN on when
/// everything before it is written.
fn step(
    joined: &Joined<'_>,
    socks: [&TcpStream; 2],
    ways: &mut [Way; 2],
    src: usize,
    info: &[TcpInfo; 2],
) -> Result<Wants, Option<Fault>> {
    let dst = 1 - src;
    let sides = [Side::Client, Side::Upstream];
    let cookie = joined.cookies[src];
    let way = &mut ways[src];
    // Read while the source is in the program, and after it left: a
    // segment the program was handling as it left is counted a moment later.
    let broken = |_| Some(Fault::SPLICE_BROKEN);
    way.tally = joined.map.tally(cookie).map_err(broken)?;
    let mut written = info[dst].written;
    // Buffered bytes first: they come before anything still queued.
    if !way.buf.is_empty() {
        written += flush(socks[dst], way).map_err(|e| write_fault(socks[dst], sides[dst], &e))?;
    }
    // What the kernel redirected and has not written yet.
    let redirected_written = written.saturating_sub(way.base + way.consumed());
    let backlog = way.tally.taken.saturating_sub(redirected_written);
    let mut soon = false;
    if way.gate.limit == u64::MAX && backlog > HALF_CLOSED_CAP {
        return Err(Some(Fault::SPLICE_BACKLOG));
    }
    // Copy on until the source has nothing more, or the destination is full.
    while way.buf.is_empty() && way.queued() > 0 {
        if backlog > 0 {
            soon = true;
            break;
        }
        let want = usize::try_from(way.queued()).unwrap_or(COPY).min(COPY);
        let mut buf = vec![0u8; want];
        // Not tokio's `try_read`: the readiness was cleared above.
        match recv(socks[src], &mut buf) {
            Ok(0) => break,
            Ok(n) => {
                buf.truncate(n);
                way.read += n as u64;
                way.buf = buf;
                flush(socks[dst], way).map_err(|e| write_fault(socks[dst], sides[dst], &e))?;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) => return Err(io_fault(sides[src], &e)),
        }
    }
    // The limit follows the destination: at most WINDOW redirected and
    // unwritten. Set with what was copied on: the program redirects again
    // once every passed byte is written.
    let gate = Gate {
        limit: way.gate.limit.max(redirected_written + WINDOW),
        consumed: way.consumed(),
    };
    if gate != way.gate {
        joined.map.set_gate(cookie, gate).map_err(broken)?;
        way.gate = gate;
    }
    let open = matches!(
        info[src].state,
        TCP_ESTABLISHED | TCP_FIN_WAIT1 | TCP_FIN_WAIT2
    );
    if !way.eof && !open && way.queued() == 0 {
        // A FIN or a reset: the one-byte peek tells which.
        match peek(socks[src]) {
            Ok(0) => way.eof = true,
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(io_fault(sides[src], &e)),
        }
    }
    let done = way.eof && !way.closed && way.buf.is_empty();
    let drained = backlog == 0 && way.queued() == 0;
    let writable = !way.buf.is_empty();
    if done {
        if !drained {
            soon = true;
        } else if !seal(joined, &mut ways[dst], dst).map_err(broken)? {
            // Bytes passed to the destination must be read first: looked at
            // again soon, unless they are read and wait on this side's
            // socket taking them (its becoming writable wakes the flow; a
            // reader that stopped would otherwise have it looked at every
            // millisecond until the idle timeout).
            soon = ways[dst].buf.is_empty();
        } else {
            let _ = shutdown_write(socks[dst]);
            ways[src].closed = true;
        }
    }
    Ok(Wants {
        writable,
        soon,
        behind: backlog > 0,
    })
}

/// Whether the socket on `side` may be sent its FIN. Once a socket has
/// sent its FIN and received the peer's, TCP closes it and it leaves the
/// maps, and bytes the program passed to it that the gateway has not read
/// yet would go with it. (Taking it out of the program instead is no
/// better: segments the program is handling as it leaves are dropped.) So
/// before the FIN the socket is sealed: its limit becomes unbounded, so the
/// program passes it nothing more once the gateway has written every
/// passed byte, and the tally, read after the gate is set, says that no
/// segment was passed in between. A sealed direction has no back-pressure
/// in the kernel: [`HALF_CLOSED_CAP`] bounds it instead.
fn seal(joined: &Joined<'_>, way: &mut Way, side: usize) -> io::Result<bool> {
    if !way.buf.is_empty() || way.queued() > 0 {
        return Ok(false);
    }
    let gate = Gate {
        limit: u64::MAX,
        consumed: way.read,
    };
    if way.gate != gate {
        joined.map.set_gate(joined.cookies[side], gate)?;
        way.gate = gate;
    }
    way.tally = joined.map.tally(joined.cookies[side])?;
    Ok(way.tally.passed == way.read)
}

/// The fault an I/O error on `side` ends the flow with: a reset names the
/// side, any other error is the path's own.
fn io_fault(side: Side, e: &io::Error) -> Option<Fault> {
    Fault::io(side, e).or(Some(Fault::SPLICE_BROKEN))
}

/// The fault a refused write to `dst` ends the flow with. A peer's reset
/// closes the socket (`TCP_CLOSE`); a socket still open that refuses a write
/// was failed by the kernel's redirect (it reports its own send errors on
/// the destination, and stops redirecting to it), not by the peer.
fn write_fault(dst: &TcpStream, side: Side, e: &io::Error) -> Option<Fault> {
    let closed = tcp_info(dst).map_or(true, |i| i.state == TCP_CLOSE);
    tracing::debug!(error = %e, peer_closed = closed, "kernel splice: a write to the destination failed");
    if closed {
        io_fault(side, e)
    } else {
        Some(Fault::SPLICE_BROKEN)
    }
}

/// Nothing waits in the socket's send queue (a slow reader leaves bytes
/// there) and nothing sent is unacknowledged (a slow network leaves it in
/// flight).
fn idle_queues(i: &TcpInfo) -> bool {
    i.notsent == 0 && i.unacked == 0
}

/// Writes what `way` holds to `dst`, as much as it takes now; the bytes written.
fn flush(dst: &TcpStream, way: &mut Way) -> io::Result<u64> {
    let mut done = 0;
    while !way.buf.is_empty() {
        match dst.try_write(&way.buf) {
            Ok(n) => {
                way.buf.drain(..n);
                done += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// Forgets the socket's readiness without reading: the kernel took the
/// bytes, or the look that follows will.
fn clear(s: &TcpStream) {
    let _ = s.try_io(Interest::READABLE, || {
        Err::<(), _>(io::ErrorKind::WouldBlock.into())
    });
}

#[cfg(test)]
mod tests;
