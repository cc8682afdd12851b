//! The in-kernel splice's system calls, and nothing else: the gateway's
//! `ksplice` module decides when to use them.
//!
//! [`Sockmap`]: four maps and an `sk_skb` stream-verdict program, assembled
//! in [`program`] (43 instructions; no BPF toolchain is needed to build
//! it) and loaded with bpf(2).
//!
//! - `peers` (sockhash): a socket's cookie → the socket its received bytes
//!   go to. `joined` (sockhash): the sockets whose received bytes go through
//!   the program (it is attached to this map).
//! - `tally` (hash, written by the program): per socket, the bytes it
//!   redirected (`taken`) and the bytes it passed to the socket's own
//!   receive queue (`passed`).
//! - `gate` (hash, written by the gateway): per socket, how far the program
//!   may redirect (`limit`, in `taken` bytes) and how many passed bytes the
//!   gateway has copied on (`consumed`).
//!
//! The program drops a segment of no bytes (a FIN alone; see [`program`]).
//! It redirects a segment only while nothing passed is waiting
//! (`passed == consumed`) and `taken < limit`; otherwise it passes it. That
//! is the back-pressure an `sk_skb` redirect lacks on its own (the kernel
//! queues redirected bytes before a slow receiver without bound): passed
//! bytes are charged to the receiving socket, so its TCP window closes, and
//! they make the socket readable, which wakes the gateway to copy them on,
//! after the redirected bytes before them, and to raise the limit. And it
//! keeps the order: once a segment is passed, none is redirected until the
//! gateway has written every passed byte.
//!
//! [`cookie`], [`kick`], [`tcp_info`], [`peek`], [`shutdown_write`]: the
//! socket options and calls the gateway reads and steers a kernel-spliced
//! flow by, on any socket it can borrow the descriptor of.
//!
//! This is the only crate of the workspace with `unsafe`: each block is a
//! system call whose buffers are owned locally and sized as passed.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// The program and its maps. Dropping it unloads them; sockets still in the
/// maps leave them as they close.
#[derive(Debug)]
pub struct Sockmap {
    peers: OwnedFd,
    joined: OwnedFd,
    tally: OwnedFd,
    gate: OwnedFd,
    _program: OwnedFd,
}

/// What the program counted for one socket.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Bytes redirected to the peer.
    pub taken: u64,
    /// Bytes passed to the socket's own receive queue, for the gateway.
    pub passed: u64,
}

/// What the gateway allows the program, for one socket.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Gate {
    /// The program redirects while `taken` is below this.
    pub limit: u64,
    /// Passed bytes the gateway has written to the peer.
    pub consumed: u64,
}

// bpf(2) commands, map and program types, helpers (linux/bpf.h).
const BPF_MAP_CREATE: i32 = 0;
const BPF_MAP_LOOKUP_ELEM: i32 = 1;
const BPF_MAP_UPDATE_ELEM: i32 = 2;
const BPF_MAP_DELETE_ELEM: i32 = 3;
const BPF_PROG_LOAD: i32 = 5;
const BPF_PROG_ATTACH: i32 = 8;
const BPF_MAP_TYPE_HASH: u32 = 1;
const BPF_MAP_TYPE_SOCKHASH: u32 = 18;
const BPF_PROG_TYPE_SK_SKB: u32 = 14;
const BPF_SK_SKB_STREAM_VERDICT: u32 = 5;
const BPF_FUNC_MAP_LOOKUP_ELEM: i32 = 1;
const BPF_FUNC_GET_SOCKET_COOKIE: i32 = 46;
const BPF_FUNC_SK_REDIRECT_HASH: i32 = 72;
const BPF_PSEUDO_MAP_FD: u8 = 1;
const SK_DROP: i32 = 0;
const SK_PASS: i32 = 1;

/// `union bpf_attr`, as bytes: each command's fields are at fixed offsets.
struct Attr([u8; 128]);

impl Attr {
    fn new() -> Self {
        Self([0; 128])
    }
    fn u32(mut self, at: usize, v: u32) -> Self {
        self.0[at..at + 4].copy_from_slice(&v.to_ne_bytes());
        self
    }
    fn u64(mut self, at: usize, v: u64) -> Self {
        self.0[at..at + 8].copy_from_slice(&v.to_ne_bytes());
        self
    }
    fn call(mut self, cmd: i32) -> io::Result<i64> {
        #[allow(unsafe_code)]
        // SAFETY: the attribute is 128 bytes, more than any command used
        // here reads; the pointers in it (keys, values, instructions, the
        // log) are borrowed by the caller for the length of the call.
        let r = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                cmd,
                self.0.as_mut_ptr(),
                self.0.len() as libc::c_uint,
            )
        };
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(r)
        }
    }
    fn fd(self, cmd: i32) -> io::Result<OwnedFd> {
        let fd = RawFd::try_from(self.call(cmd)?).map_err(io::Error::other)?;
        #[allow(unsafe_code)]
        // SAFETY: bpf(2) returned a new descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

/// One eBPF instruction: opcode, destination and source registers, offset, immediate.
fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> u64 {
    u64::from(code)
        | (u64::from(dst | (src << 4)) << 8)
        | (u64::from(off as u16) << 16)
        | (u64::from(imm as u32) << 32)
}

/// The verdict program, for the maps with these descriptors. In C:
///
/// ```c
/// SEC("sk_skb/stream_verdict")
/// int verdict(struct __sk_buff *skb) {
///     if (skb->len == 0)
///         return SK_DROP;
///     __u64 cookie = bpf_get_socket_cookie(skb);
///     struct tally *t = bpf_map_lookup_elem(&tally, &cookie);
///     if (!t)
///         return SK_PASS;
///     struct gate *g = bpf_map_lookup_elem(&gate, &cookie);
///     if (g && t->passed == g->consumed && t->taken < g->limit) {
///         t->taken += skb->len;
///         return bpf_sk_redirect_hash(skb, &peers, &cookie, 0);
///     }
///     t->passed += skb->len;
///     return SK_PASS;
/// }
/// ```
///
/// A segment of no bytes is a FIN that came alone. TCP has taken the FIN
/// already (the socket's state and a read's end of stream say so), and
/// handed on, the segment would break the kernel's sockmap worker
/// (`sk_psock_backlog`), which takes the zero bytes it moved for a failed
/// write. It reports `EPIPE` on the socket whose queue held the segment
/// (the peer, for a redirect; by the kernel's code the socket itself too,
/// for a segment passed while redirected ones wait before it) and stops
/// serving that socket for good: segments redirected or passed to it later
/// are dropped. So the program drops the segment instead.
///
/// The counters need no atomics: a socket's segments go through the program
/// one at a time (under the socket's lock), and only the program writes
/// `tally`. A joined socket without a peer would have its bytes dropped
/// (`SK_DROP`): the gateway puts both peers in place before either joins.
pub fn program(peers: RawFd, tally: RawFd, gate: RawFd) -> [u64; 43] {
    const PASS: i16 = 37;
    const PASS_UNCOUNTED: i16 = 41;
    const EXIT: i16 = 42;
    // A jump's offset counts from the instruction after it.
    let to = |target: i16, at: i16| target - at - 1;
    [
        insn(0xb7, 0, 0, 0, SK_DROP),                    // 0: r0 = SK_DROP
        insn(0x61, 2, 1, 0, 0),                          // 1: r2 = skb->len
        insn(0x15, 2, 0, to(EXIT, 2), 0),                // 2: if r2 == 0 goto exit: a FIN alone
        insn(0xbf, 6, 1, 0, 0),                          // 3: r6 = r1 (skb)
        insn(0x85, 0, 0, 0, BPF_FUNC_GET_SOCKET_COOKIE), // 4: r0 = cookie(skb)
        insn(0x7b, 10, 0, -8, 0),                        // 5: *(u64 *)(r10 - 8) = r0
        insn(0x18, 1, BPF_PSEUDO_MAP_FD, 0, tally),      // 6: r1 = &tally
        insn(0, 0, 0, 0, 0),                             // 7
        insn(0xbf, 2, 10, 0, 0),                         // 8: r2 = r10
        insn(0x07, 2, 0, 0, -8),                         // 9: r2 += -8: &cookie
        insn(0x85, 0, 0, 0, BPF_FUNC_MAP_LOOKUP_ELEM),   // 10: r0 = lookup(tally)
        insn(0x15, 0, 0, to(PASS_UNCOUNTED, 11), 0),     // 11: if r0 == 0 goto pass, uncounted
        insn(0xbf, 7, 0, 0, 0),                          // 12: r7 = t
        insn(0x18, 1, BPF_PSEUDO_MAP_FD, 0, gate),       // 13: r1 = &gate
        insn(0, 0, 0, 0, 0),                             // 14
        insn(0xbf, 2, 10, 0, 0),                         // 15: r2 = r10
        insn(0x07, 2, 0, 0, -8),                         // 16: r2 += -8
        insn(0x85, 0, 0, 0, BPF_FUNC_MAP_LOOKUP_ELEM),   // 17: r0 = lookup(gate)
        insn(0x15, 0, 0, to(PASS, 18), 0),               // 18: if r0 == 0 goto pass
        insn(0xbf, 8, 0, 0, 0),                          // 19: r8 = g
        insn(0x61, 2, 6, 0, 0),                          // 20: r2 = skb->len
        insn(0x79, 3, 7, 8, 0),                          // 21: r3 = t->passed
        insn(0x79, 4, 8, 8, 0),                          // 22: r4 = g->consumed
        insn(0x5d, 3, 4, to(PASS, 23), 0),               // 23: if r3 != r4 goto pass
        insn(0x79, 3, 7, 0, 0),                          // 24: r3 = t->taken
        insn(0x79, 4, 8, 0, 0),                          // 25: r4 = g->limit
        insn(0x3d, 3, 4, to(PASS, 26), 0),               // 26: if r3 >= r4 goto pass
        insn(0x0f, 3, 2, 0, 0),                          // 27: r3 += len
        insn(0x7b, 7, 3, 0, 0),                          // 28: t->taken = r3
        insn(0xbf, 1, 6, 0, 0),                          // 29: r1 = skb
        insn(0x18, 2, BPF_PSEUDO_MAP_FD, 0, peers),      // 30: r2 = &peers
        insn(0, 0, 0, 0, 0),                             // 31
        insn(0xbf, 3, 10, 0, 0),                         // 32: r3 = r10
        insn(0x07, 3, 0, 0, -8),                         // 33: r3 += -8: &cookie
        insn(0xb7, 4, 0, 0, 0),                          // 34: r4 = 0: to the peer's send side
        insn(0x85, 0, 0, 0, BPF_FUNC_SK_REDIRECT_HASH), // 35: r0 = redirect(skb, &peers, &cookie, 0)
        insn(0x95, 0, 0, 0, 0),                         // 36: return r0
        insn(0x61, 2, 6, 0, 0),                         // 37 (pass): r2 = skb->len
        insn(0x79, 3, 7, 8, 0),                         // 38: r3 = t->passed
        insn(0x0f, 3, 2, 0, 0),                         // 39: r3 += len
        insn(0x7b, 7, 3, 8, 0),                         // 40: t->passed = r3
        insn(0xb7, 0, 0, 0, SK_PASS),                   // 41 (pass, uncounted): r0 = SK_PASS
        insn(0x95, 0, 0, 0, 0),                         // 42 (exit): return r0
    ]
}

fn hash(entries: u32) -> io::Result<OwnedFd> {
    Attr::new()
        .u32(0, BPF_MAP_TYPE_HASH)
        .u32(4, 8) // key: a socket cookie
        .u32(8, 16) // value: two u64
        .u32(12, entries)
        .fd(BPF_MAP_CREATE)
}

fn sockhash(entries: u32) -> io::Result<OwnedFd> {
    Attr::new()
        .u32(0, BPF_MAP_TYPE_SOCKHASH)
        .u32(4, 8) // key: a socket cookie
        .u32(8, 8) // value: a socket descriptor
        .u32(12, entries)
        .fd(BPF_MAP_CREATE)
}

fn step(what: &'static str) -> impl Fn(io::Error) -> io::Error {
    move |e| io::Error::new(e.kind(), format!("{what}: {e}"))
}

impl Sockmap {
    /// Creates both maps (`entries` sockets each), loads the program and
    /// attaches it; the error names the step (and carries the verifier's log).
    pub fn load(entries: u32) -> io::Result<Self> {
        let peers = sockhash(entries).map_err(step("creating the peers sockhash"))?;
        let joined = sockhash(entries).map_err(step("creating the joined sockhash"))?;
        let tally = hash(entries).map_err(step("creating the tally map"))?;
        let gate = hash(entries).map_err(step("creating the gate map"))?;
        let insns = program(peers.as_raw_fd(), tally.as_raw_fd(), gate.as_raw_fd());
        let license = b"GPL\0";
        let mut log = vec![0u8; 16 * 1024];
        let program = Attr::new()
            .u32(0, BPF_PROG_TYPE_SK_SKB)
            .u32(4, insns.len() as u32)
            .u64(8, insns.as_ptr() as u64)
            .u64(16, license.as_ptr() as u64)
            .u32(24, 1) // log level 1: the verifier says why on failure
            .u32(28, log.len() as u32)
            .u64(32, log.as_mut_ptr() as u64)
            .u32(68, BPF_SK_SKB_STREAM_VERDICT)
            .fd(BPF_PROG_LOAD)
            .map_err(|e| {
                let said = String::from_utf8_lossy(&log);
                let said = said.trim_end_matches('\0').trim();
                io::Error::new(e.kind(), format!("loading the verdict program: {e} {said}"))
            })?;
        Attr::new()
            .u32(0, joined.as_raw_fd() as u32)
            .u32(4, program.as_raw_fd() as u32)
            .u32(8, BPF_SK_SKB_STREAM_VERDICT)
            .call(BPF_PROG_ATTACH)
            .map_err(step("attaching the verdict program"))?;
        Ok(Self {
            peers,
            joined,
            tally,
            gate,
            _program: program,
        })
    }

    /// What the socket with `cookie` receives goes to `peer` (once it joins).
    pub fn set_peer(&self, cookie: u64, peer: BorrowedFd<'_>) -> io::Result<()> {
        update(&self.peers, cookie, peer)
    }

    pub fn remove_peer(&self, cookie: u64) {
        delete(&self.peers, cookie);
    }

    /// The socket's received bytes go through the program (to its peer),
    /// counted from zero, redirected up to `limit`. The kernel refuses a
    /// socket that is not ESTABLISHED (a FIN can race the join); whatever
    /// the join had put in the maps is then taken out again, so a failed
    /// join holds no slot.
    pub fn join(&self, cookie: u64, socket: BorrowedFd<'_>, limit: u64) -> io::Result<()> {
        put(&self.tally, cookie, [0, 0])?;
        let joined = self
            .set_gate(cookie, Gate { limit, consumed: 0 })
            .and_then(|()| update(&self.joined, cookie, socket));
        if joined.is_err() {
            delete(&self.tally, cookie);
            delete(&self.gate, cookie);
        }
        joined
    }

    /// The socket leaves `joined`: what it receives from here stays in its
    /// receive queue, after what the program passed. Its tally stays readable.
    pub fn unjoin(&self, cookie: u64) {
        delete(&self.joined, cookie);
    }

    /// The socket leaves `joined`, and its counters are forgotten.
    pub fn leave(&self, cookie: u64) {
        delete(&self.joined, cookie);
        delete(&self.tally, cookie);
        delete(&self.gate, cookie);
    }

    /// What the program counted for the socket.
    pub fn tally(&self, cookie: u64) -> io::Result<Tally> {
        let mut v = [0u64; 2];
        Attr::new()
            .u32(0, self.tally.as_raw_fd() as u32)
            .u64(8, std::ptr::addr_of!(cookie) as u64)
            .u64(16, v.as_mut_ptr() as u64)
            .call(BPF_MAP_LOOKUP_ELEM)?;
        Ok(Tally {
            taken: v[0],
            passed: v[1],
        })
    }

    /// Replaces the socket's gate (the program reads the old or the new one whole).
    pub fn set_gate(&self, cookie: u64, gate: Gate) -> io::Result<()> {
        put(&self.gate, cookie, [gate.limit, gate.consumed])
    }
}

fn put(map: &OwnedFd, key: u64, value: [u64; 2]) -> io::Result<()> {
    Attr::new()
        .u32(0, map.as_raw_fd() as u32)
        .u64(8, std::ptr::addr_of!(key) as u64)
        .u64(16, value.as_ptr() as u64)
        .call(BPF_MAP_UPDATE_ELEM)
        .map(drop)
}

fn update(map: &OwnedFd, key: u64, fd: BorrowedFd<'_>) -> io::Result<()> {
    let value = fd.as_raw_fd() as u64;
    Attr::new()
        .u32(0, map.as_raw_fd() as u32)
        .u64(8, std::ptr::addr_of!(key) as u64)
        .u64(16, std::ptr::addr_of!(value) as u64)
        .call(BPF_MAP_UPDATE_ELEM)
        .map(drop)
}

/// Removes `key`; a key not there is no error (it left as its socket closed).
fn delete(map: &OwnedFd, key: u64) {
    let _ = Attr::new()
        .u32(0, map.as_raw_fd() as u32)
        .u64(8, std::ptr::addr_of!(key) as u64)
        .call(BPF_MAP_DELETE_ELEM);
}

/// The socket's cookie: its identity for the kernel while it lives.
pub fn cookie(socket: impl AsFd) -> io::Result<u64> {
    let mut c = 0u64;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    #[allow(unsafe_code)]
    // SAFETY: `c` is a u64 and `len` says so.
    let r = unsafe {
        libc::getsockopt(
            socket.as_fd().as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_COOKIE,
            std::ptr::addr_of_mut!(c).cast(),
            &mut len,
        )
    };
    if r == 0 {
        Ok(c)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Sets `SO_RCVLOWAT` to 1, which makes TCP signal "data ready" if any is
/// queued: bytes that arrived before the socket joined go through the
/// program then, in order, instead of waiting for the next segment.
pub fn kick(socket: impl AsFd) -> io::Result<()> {
    let one: libc::c_int = 1;
    #[allow(unsafe_code)]
    // SAFETY: an int option, its size given.
    let r = unsafe {
        libc::setsockopt(
            socket.as_fd().as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            std::ptr::addr_of!(one).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// What `TCP_INFO` says of a socket, the fields the gateway reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TcpInfo {
    /// `TCP_ESTABLISHED` (1), `TCP_CLOSE_WAIT` (8), …
    pub state: u8,
    /// Sequence space received after the handshake: every byte, and one
    /// for a FIN.
    pub received: u64,
    /// Bytes written to the socket: sent (once; retransmissions not
    /// counted) or queued to send. No SYN, no FIN.
    pub written: u64,
    /// Of those, not sent yet.
    pub notsent: u32,
    /// Segments sent and not yet acknowledged.
    pub unacked: u32,
}

pub const TCP_ESTABLISHED: u8 = 1;
pub const TCP_FIN_WAIT1: u8 = 4;
pub const TCP_FIN_WAIT2: u8 = 5;
pub const TCP_CLOSE: u8 = 7;

/// `struct tcp_info` as of Linux 4.19 and its offsets (linux/tcp.h):
/// `tcpi_unacked` 24, `tcpi_bytes_received` 128, `tcpi_notsent_bytes` 144,
/// `tcpi_bytes_sent` 200, `tcpi_bytes_retrans` 208.
const INFO_LEN: usize = 232;

pub fn tcp_info(socket: impl AsFd) -> io::Result<TcpInfo> {
    let mut b = [0u8; INFO_LEN];
    let mut len = INFO_LEN as libc::socklen_t;
    #[allow(unsafe_code)]
    // SAFETY: the kernel writes at most `len` bytes into `b`.
    let r = unsafe {
        libc::getsockopt(
            socket.as_fd().as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            b.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    if (len as usize) < INFO_LEN {
        return Err(io::Error::other(
            "TCP_INFO is short: the kernel is older than 4.19",
        ));
    }
    let u64_at = |at: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[at..at + 8]);
        u64::from_ne_bytes(w)
    };
    let u32_at = |at: usize| u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    let notsent = u32_at(144);
    Ok(TcpInfo {
        state: b[0],
        received: u64_at(128),
        written: u64_at(200)
            .saturating_sub(u64_at(208))
            .saturating_add(u64::from(notsent)),
        notsent,
        unacked: u32_at(24),
    })
}

/// A one-byte `MSG_PEEK`, not waiting: `Ok(0)` at EOF, `WouldBlock` when
/// nothing is queued, the socket's error (a reset) otherwise.
pub fn peek(socket: impl AsFd) -> io::Result<usize> {
    let mut b = [0u8; 1];
    #[allow(unsafe_code)]
    // SAFETY: one byte into a one-byte buffer.
    let r = unsafe {
        libc::recv(
            socket.as_fd().as_raw_fd(),
            b.as_mut_ptr().cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// A `recv` that does not wait: what the program passed to the socket's
/// own receive queue. `WouldBlock` when nothing is there.
pub fn recv(socket: impl AsFd, buf: &mut [u8]) -> io::Result<usize> {
    #[allow(unsafe_code)]
    // SAFETY: at most `buf.len()` bytes into `buf`.
    let r = unsafe {
        libc::recv(
            socket.as_fd().as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// `shutdown(SHUT_WR)`: a FIN after what is queued.
pub fn shutdown_write(socket: impl AsFd) -> io::Result<()> {
    #[allow(unsafe_code)]
    // SAFETY: a plain shutdown of a descriptor the caller borrows.
    let r = unsafe { libc::shutdown(socket.as_fd().as_raw_fd(), libc::SHUT_WR) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instructions_encode_as_the_kernel_reads_them() {
        // `r2 = map` is the two-slot load with the map's descriptor in the
        // first immediate and the pseudo-source register 1.
        let p = program(7, 8, 9);
        assert_eq!(p[30], 0x0000_0007_0000_1218);
        assert_eq!(p[31], 0);
        assert_eq!(p[6], 0x0000_0008_0000_1118);
        // `*(u64 *)(r10 - 8) = r0`: offset -8 as sixteen bits.
        assert_eq!(p[5], 0x0000_0000_fff8_0a7b);
        // `if r2 == 0 goto 42` at 2: 39 instructions on.
        assert_eq!(p[2], 0x0000_0000_0027_0215);
        // `if r0 == 0 goto 41` at 11: 29 instructions on.
        assert_eq!(p[11], 0x0000_0000_001d_0015);
        assert_eq!(p[42], 0x95);
    }

    #[test]
    fn tcp_info_offsets_are_the_kernel_headers() {
        use std::mem::offset_of;
        assert_eq!(offset_of!(libc::tcp_info, tcpi_unacked), 24);
        assert_eq!(offset_of!(libc::tcp_info, tcpi_bytes_received), 128);
        assert_eq!(offset_of!(libc::tcp_info, tcpi_notsent_bytes), 144);
        assert_eq!(offset_of!(libc::tcp_info, tcpi_bytes_sent), 200);
        assert_eq!(offset_of!(libc::tcp_info, tcpi_bytes_retrans), 208);
        assert!(std::mem::size_of::<libc::tcp_info>() >= INFO_LEN);
    }

    fn pair() -> (std::net::TcpStream, std::net::TcpStream) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let c = std::net::TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (s, _) = l.accept().expect("accept");
        (c, s)
    }

    /// Loading needs CAP_BPF; without it (and without `EGRESS_E2E_REQUIRED=1`) the test says so and passes.
    fn loaded() -> Option<Sockmap> {
        match Sockmap::load(64) {
            Ok(m) => Some(m),
            Err(e) => {
                egress_testkit::skip("the sockmap", format!("cannot be loaded here: {e}"));
                None
            }
        }
    }

    #[test]
    fn the_gate_decides_between_redirect_and_pass_and_the_tally_counts_both() {
        use std::io::{Read, Write};
        let Some(m) = loaded() else { return };
        let (mut client, gw_client) = pair();
        let (gw_origin, mut origin) = pair();
        let (c, o) = (
            cookie(&gw_client).expect("cookie"),
            cookie(&gw_origin).expect("cookie"),
        );
        m.set_peer(c, gw_origin.as_fd()).expect("peer");
        m.set_peer(o, gw_client.as_fd()).expect("peer");
        m.join(c, gw_client.as_fd(), 0).expect("join");
        m.join(o, gw_origin.as_fd(), 0).expect("join");
        gw_client
            .set_read_timeout(Some(std::time::Duration::from_secs(2)))
            .expect("timeout");
        origin
            .set_read_timeout(Some(std::time::Duration::from_secs(2)))
            .expect("timeout");
        // Limit 0: passed to the gateway's own socket, counted.
        client.write_all(b"passed").expect("write");
        let mut b = [0u8; 6];
        (&gw_client)
            .read_exact(&mut b)
            .expect("passed bytes are readable");
        assert_eq!(&b, b"passed");
        assert_eq!(
            m.tally(c).expect("tally"),
            Tally {
                taken: 0,
                passed: 6
            }
        );
        // Consumed and a limit: redirected to the origin, counted.
        m.set_gate(
            c,
            Gate {
                limit: 100,
                consumed: 6,
            },
        )
        .expect("gate");
        client.write_all(b"redirected").expect("write");
        let mut b = [0u8; 10];
        origin
            .read_exact(&mut b)
            .expect("redirected bytes reach the peer");
        assert_eq!(&b, b"redirected");
        assert_eq!(
            m.tally(c).expect("tally"),
            Tally {
                taken: 10,
                passed: 6
            }
        );
        // Passed bytes not yet consumed hold the redirect back, whatever the limit.
        m.set_gate(
            c,
            Gate {
                limit: 1_000,
                consumed: 0,
            },
        )
        .expect("gate");
        client.write_all(b"held").expect("write");
        let mut b = [0u8; 4];
        (&gw_client)
            .read_exact(&mut b)
            .expect("passed while bytes wait");
        assert_eq!(&b, b"held");
        assert_eq!(
            m.tally(c).expect("tally"),
            Tally {
                taken: 10,
                passed: 10
            }
        );
        let written = tcp_info(&gw_origin).expect("info").written;
        assert_eq!(written, 10, "TCP_INFO counts what the kernel wrote");
        // A FIN alone, where a segment would be redirected: dropped, not
        // handed to the peer's queue, where the kernel's worker would fail
        // on its zero length and break the peer with EPIPE.
        m.set_gate(
            c,
            Gate {
                limit: 1_000,
                consumed: 10,
            },
        )
        .expect("gate");
        client
            .shutdown(std::net::Shutdown::Write)
            .expect("half-close");
        let mut b = [0u8; 1];
        assert_eq!((&gw_client).read(&mut b).expect("EOF"), 0);
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert_eq!(
            gw_origin.take_error().expect("SO_ERROR").map(|e| e.kind()),
            None,
            "the peer was broken by the FIN"
        );
        assert_eq!(
            m.tally(c).expect("tally"),
            Tally {
                taken: 10,
                passed: 10
            }
        );
        m.leave(c);
        m.leave(o);
    }
}
