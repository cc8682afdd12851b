//! Replacing a running gateway without a window: its successor takes over
//! its listening sockets, its pushed state and its DNS attribution.
//!
//! The running gateway listens on `state_dir/handover.sock` (mode 0600, in a
//! 0700 directory). A successor started with `egress-gateway run
//! --take-over` and the same configuration connects and asks, naming its
//! listen addresses and listener copies; a successor whose listeners would
//! differ is refused and the running gateway goes on as if nothing happened.
//! A compatible one gets, in order:
//!
//! 1. The running gateway stops accepting flows, DNS queries and admin
//!    calls, and seals its commit thread: every push acknowledged so far is
//!    in the journal, and none is acknowledged after (a thread that has
//!    not sealed within 8 s fails the handover: it may still write, so the
//!    lock is kept and nothing is sent). Its listening sockets
//!    stay open (duplicates are kept for this), so connections and queries
//!    that arrive now wait in the kernel's queues.
//! 2. It releases `state_dir/gateway.lock`.
//! 3. It sends one line naming the sockets, with the sockets themselves
//!    (`SCM_RIGHTS`), then one line per attributed address with the names
//!    and the exact time each has left (read from the cache a sandbox at a
//!    time as they are sent, then a line of their count: no copy of the
//!    whole is made), then the budget states.
//! 4. The successor tells systemd it is the service's main process
//!    (`MAINPID=`) and answers `taken`; the running gateway waits for that
//!    before it drains, so the service never loses its main process.
//! 5. The successor takes the lock, recovers the snapshot and journal,
//!    restores the attribution (lifetimes unchanged: nothing is extended)
//!    and serves on the very sockets, starting with what queued meanwhile.
//!
//! 6. While the running gateway drains, the successor tells it over the
//!    same connection which of its sandboxes change ([`changes`]): their
//!    flows there end; the connection's end ends the drain.
//!
//! Every connection is accepted by exactly one of the two; none is refused.
//! If the successor dies after step 4, it is the main process: a supervisor
//! starts a gateway again from the same state (connections wait or are
//! refused meanwhile, fail closed). If the running gateway never hears
//! `taken`, it drains and exits with a failure.

use std::io::{self, BufRead, BufReader, IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::net::IpAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use egress_policy::SandboxId;

use crate::budget::Spent;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use serde::{Deserialize, Serialize};

use crate::config::{Config, Listen};

/// The socket's file name in `state_dir`.
pub const SOCKET_FILE: &str = "handover.sock";

/// What both sides speak; a successor of another version is refused.
const VERSION: u32 = 1;

/// Most sockets one handover carries (the kernel's `SCM_MAX_FD` is 253):
/// five per listener copy and the admin listener.
const MAX_SOCKETS: usize = 250;

/// Each read and write of the handover, on either side.
const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest request or header line.
const MAX_LINE: usize = 64 * 1024;

pub(crate) mod changes;

/// What a listening socket is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    Transparent,
    DnsUdp,
    DnsTcp,
    DnsAltUdp,
    DnsAltTcp,
    Admin,
}

/// The successor's question.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Request {
    version: u32,
    listen: Listen,
    /// Sets of transparent and DNS listeners (`limits.thread_per_core`).
    copies: usize,
    /// The successor takes budget states too (absent from one that does
    /// not: it is sent none, and would not read them).
    #[serde(default)]
    budgets: bool,
    /// The successor tells systemd it is the service's main process as soon
    /// as it holds the sockets, and then says `taken`: the running gateway
    /// waits for that before it drains and exits, so the service never
    /// loses its main process in between (absent from one that does not:
    /// nothing is waited for).
    #[serde(default)]
    acknowledges: bool,
    /// The successor tells, over the same connection, which of the running
    /// gateway's sandboxes change while it drains ([`changes`]); absent
    /// from one that does not: the drain runs its course as before.
    #[serde(default)]
    tells: bool,
    /// The successor reads the attribution as a stream ended by a line of
    /// its count ([`End`]): the running gateway writes each sandbox's
    /// lines as it reads them, holding no copy of the whole (absent from
    /// one that does not: the lines are counted in the header, all of them
    /// read first).
    #[serde(default)]
    streams: bool,
}

/// What the successor says once it holds the sockets and told systemd.
const TAKEN: &[u8] = b"taken\n";

/// The successor's side: tells systemd this process is now the service's
/// main process, then says so on the handover stream.
fn acknowledge(mut stream: &UnixStream) -> io::Result<()> {
    crate::systemd::notify(&format!("MAINPID={}", std::process::id()));
    stream.write_all(TAKEN)
}

/// The running gateway's side: waits (at most [`IO_TIMEOUT`]) for the
/// successor's `taken`.
fn await_acknowledgement(stream: &UnixStream) -> io::Result<()> {
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    let mut got = [0u8; TAKEN.len()];
    (&*stream).read_exact(&mut got)?;
    if got != TAKEN {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the successor did not say it took over",
        ));
    }
    Ok(())
}

/// The running gateway's answer: the sockets (in the order of the
/// descriptors sent with it) and how many attribution lines follow, or why not.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Header {
    version: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    refused: Option<String>,
    #[serde(default)]
    sockets: Vec<Kind>,
    #[serde(default)]
    attributed: usize,
    /// The attribution lines are a stream ended by an [`End`] line (for a
    /// successor that [`Request::streams`]); `attributed` is 0 then.
    #[serde(default)]
    streamed: bool,
    /// Budget state lines after the attribution lines.
    #[serde(default)]
    budgets: usize,
}

/// The line that ends a streamed attribution: how many lines it had
/// (that key alone: no address's line reads as one).
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct End {
    end: usize,
}

/// One attributed address of one sandbox: its live names, each with the
/// milliseconds it has left. Read back through `SandboxId::parse` and
/// `Hostname::parse`: a line either does not pass is dropped.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub struct Attributed {
    pub sandbox: String,
    pub ip: IpAddr,
    pub names: Vec<(String, u64)>,
}

/// What a successor took over.
#[derive(Debug)]
pub struct Taken {
    pub(crate) sockets: Vec<(Kind, OwnedFd)>,
    pub(crate) attribution: Vec<Attributed>,
    pub(crate) budgets: Vec<Spent>,
    /// When the successor asked, before the lines were exported: the
    /// lifetimes they carry are counted from then, not from when they were
    /// read or restored.
    pub(crate) received: std::time::Instant,
    /// The handover connection, kept to tell the predecessor which of its
    /// sandboxes change while it drains ([`changes`]).
    pub(crate) predecessor: Option<UnixStream>,
}

/// Why a takeover failed. Before the running gateway accepted, it goes on
/// serving; the error says which.
#[derive(Debug, thiserror::Error)]
pub enum HandoverError {
    #[error("cannot reach the running gateway at {path}: {source} (is one running with this state_dir?)")]
    Connect { path: String, source: io::Error },
    #[error("the running gateway refused the takeover and goes on serving: {0}")]
    Refused(String),
    #[error("takeover: {0}")]
    Protocol(String),
    #[error("takeover: {0}")]
    Io(#[from] io::Error),
}

// === the successor's side ===

/// Asks the gateway running on `config.state_dir` for its sockets and
/// attribution. Blocking, with a timeout on every wait.
pub fn take_over(config: &Config) -> Result<Taken, HandoverError> {
    let path = config.state_dir.join(SOCKET_FILE);
    let mut stream = UnixStream::connect(&path).map_err(|source| HandoverError::Connect {
        path: path.display().to_string(),
        source,
    })?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let request = Request {
        version: VERSION,
        listen: config.listen.clone(),
        copies: copies(config),
        budgets: true,
        acknowledges: true,
        tells: true,
        streams: true,
    };
    let mut line =
        serde_json::to_vec(&request).map_err(|e| HandoverError::Protocol(e.to_string()))?;
    line.push(b'\n');
    stream.write_all(&line)?;
    // Before the running gateway exports: the lifetimes it sends are
    // counted from here, so however long the export, the sending and the
    // reading take, they come out shorter, never longer.
    let asked = std::time::Instant::now();
    let (header, fds, rest) = receive_header(&stream)?;
    if let Some(why) = header.refused {
        return Err(HandoverError::Refused(why));
    }
    if header.version != VERSION || header.sockets.len() != fds.len() {
        let why = format!(
            "version {} with {} socket kinds for {} descriptors",
            header.version,
            header.sockets.len(),
            fds.len()
        );
        return Err(HandoverError::Protocol(why));
    }
    let sockets = header.sockets.into_iter().zip(fds).collect();
    let answer = stream.try_clone()?;
    let mut lines = BufReader::new(rest.chain(stream)).lines();
    let attribution = match header.streamed {
        true => receive_stream(&mut lines)?,
        false => receive_lines(&mut lines, header.attributed, "attribution")?,
    };
    let budgets = budget_lines(&mut lines, header.budgets)?;
    acknowledge(&answer)?;
    Ok(Taken {
        sockets,
        attribution,
        budgets,
        received: asked,
        predecessor: Some(answer),
    })
}

/// The header, the descriptors that came with it, and the bytes read past it.
type Received = (Header, Vec<OwnedFd>, io::Cursor<Vec<u8>>);

/// Reads up to the header's newline, collecting the descriptors that come
/// with it; returns the bytes read past the line.
fn receive_header(stream: &UnixStream) -> Result<Received, HandoverError> {
    let mut bytes = Vec::new();
    let mut fds = Vec::new();
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_SOCKETS))];
    loop {
        let mut chunk = [0u8; 16 * 1024];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let got = rustix::net::recvmsg(
            stream,
            &mut [IoSliceMut::new(&mut chunk)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        )
        .map_err(io::Error::from)?;
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = message {
                fds.extend(received);
            }
        }
        if got.bytes == 0 {
            return Err(HandoverError::Protocol(
                "the running gateway closed the connection before answering".into(),
            ));
        }
        bytes.extend_from_slice(&chunk[..got.bytes]);
        if let Some(end) = bytes.iter().position(|&b| b == b'\n') {
            let header = serde_json::from_slice(&bytes[..end])
                .map_err(|e| HandoverError::Protocol(format!("bad header: {e}")))?;
            let rest = io::Cursor::new(bytes[end + 1..].to_vec());
            return Ok((header, fds, rest));
        }
        if bytes.len() > MAX_LINE {
            return Err(HandoverError::Protocol("header line too long".into()));
        }
    }
}

/// The next `expected` lines of `what`, each one JSON document.
fn receive_lines<T: serde::de::DeserializeOwned>(
    lines: &mut impl Iterator<Item = io::Result<String>>,
    expected: usize,
    what: &str,
) -> Result<Vec<T>, HandoverError> {
    let mut out = Vec::with_capacity(expected.min(1 << 20));
    for line in lines.take(expected) {
        let entry = serde_json::from_str(&line?)
            .map_err(|e| HandoverError::Protocol(format!("bad {what} line: {e}")))?;
        out.push(entry);
    }
    if out.len() != expected {
        let why = format!(
            "{} {what} lines of {expected}: the stream was cut",
            out.len()
        );
        return Err(HandoverError::Protocol(why));
    }
    Ok(out)
}

/// The lines of a streamed attribution, up to its [`End`], whose count
/// must be theirs. A line that is neither names its number and what did
/// not read.
fn receive_stream(
    lines: &mut impl Iterator<Item = io::Result<String>>,
) -> Result<Vec<Attributed>, HandoverError> {
    let mut out = Vec::new();
    for line in lines {
        let line = line?;
        if let Ok(End { end }) = serde_json::from_str::<End>(&line) {
            if end == out.len() {
                return Ok(out);
            }
            let why = format!(
                "{} attribution lines where their end counts {end}",
                out.len()
            );
            return Err(HandoverError::Protocol(why));
        }
        let entry = serde_json::from_str(&line).map_err(|e| {
            let n = out.len() + 1;
            HandoverError::Protocol(format!("bad attribution line {n}: {e}"))
        })?;
        out.push(entry);
    }
    let why = format!(
        "{} attribution lines and no end: the stream was cut",
        out.len()
    );
    Err(HandoverError::Protocol(why))
}

/// The next `expected` lines, budget states: a line this build does not
/// read as one drops that state alone (a destination another build wrote
/// differently); a line that is not JSON, or not a state at all (no
/// `destination`: the counts and the lines disagree), is an error.
fn budget_lines(
    lines: &mut impl Iterator<Item = io::Result<String>>,
    expected: usize,
) -> Result<Vec<Spent>, HandoverError> {
    let states: Vec<serde_json::Value> = receive_lines(lines, expected, "budget")?;
    if let Some(n) = states.iter().position(|v| v.get("destination").is_none()) {
        let why = format!("budget line {n} is not a budget state");
        return Err(HandoverError::Protocol(why));
    }
    Ok(crate::budget::each_read(states, "the predecessor"))
}

/// Sets of transparent and DNS listeners a configuration binds.
pub(crate) fn copies(config: &Config) -> usize {
    if config.limits.thread_per_core {
        config.limits.threads()
    } else {
        1
    }
}

// === the running gateway's side ===

/// A successor the running gateway accepted: its stream, whether it takes
/// budget states, whether it says when it took over.
pub(crate) struct Successor {
    stream: UnixStream,
    pub(crate) budgets: bool,
    acknowledges: bool,
    tells: bool,
    streams: bool,
    /// When its request was read: it waits [`IO_TIMEOUT`] for the answer.
    asked: std::time::Instant,
}

impl Successor {
    /// How long the running gateway may still take before it answers (a
    /// second kept for the sending), counted from the successor's request.
    pub(crate) fn answer_within(&self) -> Duration {
        IO_TIMEOUT
            .saturating_sub(self.asked.elapsed())
            .saturating_sub(Duration::from_secs(1))
    }
}

/// The offer a running gateway keeps open: its socket and duplicates of
/// every listening socket.
pub(crate) struct Offer {
    listener: tokio::net::UnixListener,
    sockets: Vec<(Kind, OwnedFd)>,
    expected: Request,
}

impl Offer {
    /// Listens on `state_dir/handover.sock`. The caller holds the state
    /// directory's lock, so a file already there is a dead gateway's.
    pub(crate) fn listen(config: &Config, sockets: Vec<(Kind, OwnedFd)>) -> io::Result<Self> {
        let path = config.state_dir.join(SOCKET_FILE);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let listener = tokio::net::UnixListener::bind(&path)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
        Ok(Self {
            listener,
            sockets,
            expected: Request {
                version: VERSION,
                listen: config.listen.clone(),
                copies: copies(config),
                budgets: true,
                acknowledges: true,
                tells: true,
                streams: true,
            },
        })
    }

    /// Waits for a successor whose listeners are these; refuses any other
    /// (it is told why) and keeps waiting.
    pub(crate) async fn successor(&self) -> Successor {
        loop {
            let Ok((stream, _)) = self.listener.accept().await else {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            };
            let Ok(stream) = stream.into_std() else {
                continue;
            };
            let request = tokio::task::spawn_blocking(move || read_request(stream)).await;
            let Ok(Ok((mut stream, request))) = request else {
                continue;
            };
            match self.refusal(&request) {
                None => {
                    return Successor {
                        stream,
                        budgets: request.budgets,
                        acknowledges: request.acknowledges,
                        tells: request.tells,
                        streams: request.streams,
                        asked: std::time::Instant::now(),
                    }
                }
                Some(why) => {
                    tracing::warn!(%why, "refused a takeover; serving on");
                    let _ = send_header(
                        &mut stream,
                        &Header {
                            refused: Some(why),
                            ..Header::default()
                        },
                        &[],
                    );
                }
            }
        }
    }

    fn refusal(&self, r: &Request) -> Option<String> {
        let e = &self.expected;
        if r.version != e.version {
            return Some(format!(
                "handover version {} (this gateway speaks {})",
                r.version, e.version
            ));
        }
        if r.listen != e.listen {
            return Some(format!(
                "its [listen] {:?} differs from this gateway's {:?}",
                r.listen, e.listen
            ));
        }
        if r.copies != e.copies {
            return Some(format!(
                "{} listener copies (limits.thread_per_core) where this gateway has {}",
                r.copies, e.copies
            ));
        }
        // Refused while this gateway still serves: past this check it stops
        // accepting and seals its state, and the sockets would not fit the
        // one message that carries them.
        if self.sockets.len() > MAX_SOCKETS {
            return Some(format!(
                "{} listening sockets (listener copies, limits.thread_per_core) are more than the {MAX_SOCKETS} a handover carries: restart the gateway instead",
                self.sockets.len()
            ));
        }
        None
    }

    /// Sends the sockets, then the attribution and the budget states, to
    /// `successor`, and waits for it to say it took over when it says it
    /// will; blocking. The connection, when the successor said it took
    /// over and tells over it which sandboxes change ([`changes`]), and
    /// the number of attribution lines sent.
    pub(crate) fn hand_over(
        self,
        successor: Successor,
        (attribution, budgets): (&Export, &[Spent]),
    ) -> io::Result<(Option<UnixStream>, usize)> {
        let Successor {
            stream: mut successor,
            acknowledges,
            tells,
            streams,
            ..
        } = successor;
        // A successor that reads a count first is sent a copy made first.
        let listed = (!streams).then(|| attribution.collect());
        let header = Header {
            version: VERSION,
            refused: None,
            sockets: self.sockets.iter().map(|(k, _)| *k).collect(),
            attributed: listed.as_ref().map_or(0, Vec::len),
            streamed: streams,
            budgets: budgets.len(),
        };
        let fds: Vec<_> = self.sockets.iter().map(|(_, fd)| fd.as_fd()).collect();
        send_header(&mut successor, &header, &fds)?;
        let mut out = io::BufWriter::new(successor);
        let sent = match listed {
            Some(listed) => {
                listed.iter().try_for_each(|entry| line(&mut out, entry))?;
                listed.len()
            }
            None => {
                let sent = attribution.each(|entry| line(&mut out, &entry))?;
                line(&mut out, &End { end: sent })?;
                sent
            }
        };
        budgets.iter().try_for_each(|entry| line(&mut out, entry))?;
        let stream = out.into_inner().map_err(io::IntoInnerError::into_error)?;
        match acknowledges {
            true => await_acknowledgement(&stream).map(|()| (tells.then_some(stream), sent)),
            false => Ok((None, sent)),
        }
    }
}

/// One JSON line.
fn line(out: &mut impl Write, entry: &impl Serialize) -> io::Result<()> {
    serde_json::to_writer(&mut *out, entry)?;
    out.write_all(b"\n")
}

fn read_request(stream: UnixStream) -> io::Result<(UnixStream, Request)> {
    // From tokio: non-blocking until told otherwise.
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut line = String::new();
    BufReader::new((&stream).take(MAX_LINE as u64)).read_line(&mut line)?;
    let request = serde_json::from_str(&line).map_err(io::Error::other)?;
    Ok((stream, request))
}

/// One `sendmsg`: the header line, with `fds` attached to its first byte.
fn send_header(
    stream: &mut UnixStream,
    header: &Header,
    fds: &[std::os::fd::BorrowedFd<'_>],
) -> io::Result<()> {
    if fds.len() > MAX_SOCKETS {
        return Err(io::Error::other(format!(
            "{} sockets: more than {MAX_SOCKETS}",
            fds.len()
        )));
    }
    let mut line = serde_json::to_vec(header)?;
    line.push(b'\n');
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_SOCKETS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::other("the descriptors do not fit one message"));
    }
    let sent = rustix::net::sendmsg(
        &*stream,
        &[IoSlice::new(&line)],
        &mut control,
        SendFlags::empty(),
    )
    .map_err(io::Error::from)?;
    // The descriptors went with the first byte; the rest of the line, if
    // the kernel took only part of it, follows as plain bytes.
    stream.write_all(&line[sent..])
}

/// The attribution a running gateway hands over: its sandboxes' entries,
/// read from the cache one sandbox at a time as they are sent.
pub(crate) struct Export {
    pub(crate) cache: std::sync::Arc<dns_attrib::AttributionCache>,
    pub(crate) ids: Vec<SandboxId>,
}

impl Export {
    /// Hands each line to `each`, a sandbox's lines read as it comes to
    /// it: how many there were.
    fn each(&self, mut each: impl FnMut(Attributed) -> io::Result<()>) -> io::Result<usize> {
        let cache = &self.cache;
        let mut n = 0;
        for id in &self.ids {
            for (ip, names) in cache.entries(id) {
                let names = names
                    .into_iter()
                    .map(|(n, left)| {
                        let ms = u64::try_from(left.as_millis()).unwrap_or(u64::MAX);
                        (n.to_string(), ms)
                    })
                    .collect();
                let sandbox = id.as_str().to_owned();
                each(Attributed { sandbox, ip, names })?;
                n += 1;
            }
        }
        Ok(n)
    }

    /// Every line, in one copy (for a successor that reads their count
    /// first).
    fn collect(&self) -> Vec<Attributed> {
        let mut out = Vec::new();
        let _ = self.each(|entry| {
            out.push(entry);
            Ok(())
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_carries_sockets_and_a_refusal_carries_none() {
        let (mut a, b) = UnixStream::pair().expect("pair");
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        let fd = OwnedFd::from(l);
        let header = Header {
            version: VERSION,
            sockets: vec![Kind::Transparent],
            attributed: 0,
            ..Header::default()
        };
        send_header(&mut a, &header, &[fd.as_fd()]).expect("send");
        drop(fd);
        let (got, fds, _) = receive_header(&b).expect("receive");
        assert_eq!(got.sockets, vec![Kind::Transparent]);
        assert_eq!(fds.len(), 1);
        // The very socket: still listening on its address after the
        // sender's descriptor closed.
        let l = std::net::TcpListener::from(fds.into_iter().next().expect("fd"));
        assert_eq!(l.local_addr().expect("addr"), addr);
        std::net::TcpStream::connect(addr).expect("connect");
        l.accept()
            .expect("the queued connection is accepted by the receiver");

        let refused = Header {
            refused: Some("no".into()),
            ..Header::default()
        };
        send_header(&mut a, &refused, &[]).expect("send");
        let (got, fds, _) = receive_header(&b).expect("receive");
        assert_eq!((got.refused.as_deref(), fds.len()), (Some("no"), 0));
    }

    /// More listening sockets than one handover message carries: the
    /// successor is refused while the running gateway still serves (it
    /// stopped accepting and sealed its state first, then failed to send).
    #[tokio::test]
    async fn more_sockets_than_a_handover_carries_are_refused_up_front() {
        let dir = tempfile::tempdir().expect("dir");
        let config = Config {
            state_dir: dir.path().to_owned(),
            ..Config::default()
        };
        let sockets: Vec<(Kind, OwnedFd)> = (0..=MAX_SOCKETS)
            .map(|_| {
                let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
                (Kind::Transparent, OwnedFd::from(l))
            })
            .collect();
        let offer = Offer::listen(&config, sockets).expect("listen");
        let asking = config.clone();
        let taking = tokio::task::spawn_blocking(move || take_over(&asking));
        let offered = tokio::time::timeout(Duration::from_secs(2), offer.successor()).await;
        assert!(offered.is_err(), "a successor was offered 251 sockets");
        let refused = taking.await.expect("thread");
        let Err(HandoverError::Refused(why)) = &refused else {
            panic!("not refused: {:?}", refused.map(|_| ()));
        };
        assert!(why.starts_with("251 listening sockets"), "{why}");
    }

    /// The attribution lines, then the budget lines: each group read to
    /// its count, a stream cut short or a line that is not JSON an error. A
    /// budget line this build does not read as a state is dropped alone.
    #[test]
    fn a_cut_attribution_or_budget_stream_is_an_error() {
        let line = serde_json::to_string(&Attributed {
            sandbox: "sb1".into(),
            ip: "203.0.113.10".parse().expect("ip"),
            names: vec![("api.example.test".into(), 2_500)],
        })
        .expect("json");
        let spent = r#"{"sandbox":"sb1","destination":"*","requests":{"units":0,"age_ms":5,"rate":3,"period":60000},"bytes":null}"#;
        let read = |text: String, (a, b): (usize, usize)| {
            let mut lines = BufReader::new(text.as_bytes()).lines();
            let first: Vec<Attributed> = receive_lines(&mut lines, a, "attribution")?;
            let then = budget_lines(&mut lines, b)?;
            Ok::<_, HandoverError>((first.len(), then))
        };
        let (n, budgets) = read(format!("{line}\n{line}\n{spent}\n"), (2, 1)).expect("all");
        assert_eq!((n, budgets[0].sandbox.as_str()), (2, "sb1"));
        assert_eq!(budgets[0].requests.map(|b| b.rate), Some(3));
        // A destination this build refuses, beside a state it reads.
        let refused = spent.replace(r#""destination":"*""#, r#""destination":"bad..name""#);
        let text = format!("{line}\n{line}\n{refused}\n{spent}\n");
        let (n, budgets) = read(text, (2, 2)).expect("taken, less what was dropped");
        assert_eq!((n, budgets.len()), (2, 1), "{budgets:?}");
        for (text, counts) in [
            (format!("{line}\n"), (2, 0)),
            (format!("{line}\n{line}\n"), (2, 1)),
            ("{not json\n".to_owned(), (1, 0)),
            (format!("{line}\n{{not json\n"), (1, 1)),
            (format!("{line}\n{line}\n"), (1, 1)),
        ] {
            assert!(
                matches!(read(text, counts), Err(HandoverError::Protocol(_))),
                "{counts:?}"
            );
        }
    }

    /// An attribution of no sandbox.
    fn nothing_attributed() -> Export {
        let cache = dns_attrib::AttributionCache::new(
            dns_attrib::CacheConfig::default(),
            dns_attrib::ManualClock::new(),
        );
        Export {
            cache: std::sync::Arc::new(cache),
            ids: Vec::new(),
        }
    }

    /// A streamed attribution is read to its end line, whose count must
    /// be the lines'; a stream without its end, or a line that is neither,
    /// is an error.
    #[test]
    fn a_streamed_attribution_is_read_to_its_end_and_counted() {
        let line = serde_json::to_string(&Attributed {
            sandbox: "sb1".into(),
            ip: "203.0.113.10".parse().expect("ip"),
            names: vec![("api.example.test".into(), 2_500)],
        })
        .expect("json");
        let read = |text: String| {
            let mut lines = BufReader::new(text.as_bytes()).lines();
            let got = receive_stream(&mut lines)?;
            let after: Vec<String> = lines.map(|l| l.expect("line")).collect();
            Ok::<_, HandoverError>((got.len(), after))
        };
        let (n, after) = read(format!("{line}\n{line}\n{{\"end\":2}}\nbudget\n")).expect("read");
        assert_eq!((n, after), (2, vec!["budget".to_owned()]));
        assert_eq!(read("{\"end\":0}\n".into()).expect("none").0, 0);
        for text in [
            format!("{line}\n{{\"end\":3}}\n"),
            format!("{line}\n{line}\n"),
            format!("{line}\n{{\"other\":1}}\n{{\"end\":1}}\n"),
            format!("{line}\n{{\"end\":1,\"other\":1}}\n{{\"end\":1}}\n"),
        ] {
            assert!(
                matches!(read(text.clone()), Err(HandoverError::Protocol(_))),
                "{text}"
            );
        }
        // A line that does not read names its number and what did not.
        let bad = format!("{line}\n{{\"sandbox\":\"sb2\",\"ip\":\"x\",\"names\":[]}}\n");
        let Err(HandoverError::Protocol(why)) = read(bad) else {
            panic!("read")
        };
        assert!(why.starts_with("bad attribution line 2: "), "{why}");
        assert!(why.contains("invalid IP address syntax"), "{why}");
    }

    /// The attribution a successor takes over, from the running gateway's
    /// cache: streamed to a successor that reads a stream, and counted in
    /// the header for one of an earlier build that does not.
    #[tokio::test]
    async fn the_attribution_is_handed_over_streamed_or_counted() {
        use egress_policy::Hostname;
        let cache = dns_attrib::AttributionCache::new(
            dns_attrib::CacheConfig::default(),
            dns_attrib::ManualClock::new(),
        );
        let ids: Vec<SandboxId> = ["sb1", "sb2"].map(SandboxId::new).to_vec();
        for (i, id) in ids.iter().enumerate() {
            for host in 1..=3u8 {
                let ip = IpAddr::from([203, 0, 113, host + 10 * i as u8]);
                let name = Hostname::parse(&format!("h{host}.example.test")).expect("name");
                cache.restore(id, ip, &[(name, Duration::from_secs(60))]);
            }
        }
        let export = Export {
            cache: std::sync::Arc::new(cache),
            ids,
        };
        let export = std::sync::Arc::new(export);
        let expected = export.collect();
        assert_eq!(expected.len(), 6);
        for streams in [true, false] {
            let dir = tempfile::tempdir().expect("dir");
            let config = Config {
                state_dir: dir.path().to_owned(),
                ..Config::default()
            };
            let offer = Offer::listen(&config, Vec::new()).expect("listen");
            let mut asked = serde_json::to_value(&offer.expected).expect("json");
            if !streams {
                asked.as_object_mut().expect("object").remove("streams");
            }
            let path = config.state_dir.join(SOCKET_FILE);
            let asking = tokio::task::spawn_blocking(move || {
                let mut stream = UnixStream::connect(path).expect("connect");
                let ask = format!("{asked}\n");
                stream.write_all(ask.as_bytes()).expect("ask");
                let (header, _, rest) = receive_header(&stream).expect("header");
                let answer = stream.try_clone().expect("clone");
                let mut lines = BufReader::new(rest.chain(stream)).lines();
                let got = match header.streamed {
                    true => receive_stream(&mut lines).expect("streamed"),
                    false => receive_lines(&mut lines, header.attributed, "a").expect("counted"),
                };
                acknowledge(&answer).expect("taken");
                (header.streamed, header.attributed, got)
            });
            let successor = offer.successor().await;
            let sending = export.clone();
            let (_, sent) =
                tokio::task::spawn_blocking(move || offer.hand_over(successor, (&sending, &[])))
                    .await
                    .expect("thread")
                    .expect("handed over");
            let (streamed, counted, got) = asking.await.expect("successor");
            assert_eq!(streamed, streams);
            assert_eq!(counted, if streams { 0 } else { 6 });
            assert_eq!((sent, got), (6, export.collect()), "streams: {streams}");
        }
    }

    /// The lifetimes a successor takes over are counted from before the
    /// running gateway exported them, however long the export and the
    /// sending take (here 400 ms).
    #[tokio::test]
    async fn lifetimes_taken_over_are_counted_from_before_the_export() {
        let dir = tempfile::tempdir().expect("dir");
        let config = Config {
            state_dir: dir.path().to_owned(),
            ..Config::default()
        };
        let offer = Offer::listen(&config, Vec::new()).expect("listen");
        let asking = config.clone();
        let taking = tokio::task::spawn_blocking(move || take_over(&asking));
        let successor = offer.successor().await;
        tokio::time::sleep(Duration::from_millis(400)).await;
        let exported = std::time::Instant::now();
        let kept = tokio::task::spawn_blocking(move || {
            offer.hand_over(successor, (&nothing_attributed(), &[]))
        })
        .await
        .expect("thread")
        .expect("handed over");
        assert!(kept.0.is_some(), "kept to hear the successor's changes");
        let taken = taking.await.expect("thread").expect("taken");
        assert!(
            taken.received <= exported,
            "counted from {:?} after the export",
            taken.received - exported
        );
    }

    /// A successor of an earlier build does not say it tells which
    /// sandboxes change: the connection is not kept to hear it (its end
    /// would end the drain at once).
    #[tokio::test]
    async fn a_successor_that_does_not_tell_is_not_heard() {
        let dir = tempfile::tempdir().expect("dir");
        let config = Config {
            state_dir: dir.path().to_owned(),
            ..Config::default()
        };
        let offer = Offer::listen(&config, Vec::new()).expect("listen");
        let mut older = serde_json::to_value(&offer.expected).expect("json");
        older.as_object_mut().expect("object").remove("tells");
        let path = config.state_dir.join(SOCKET_FILE);
        let asking = tokio::task::spawn_blocking(move || {
            let mut stream = UnixStream::connect(path).expect("connect");
            stream
                .write_all(format!("{older}\n").as_bytes())
                .expect("ask");
            let (header, _, _) = receive_header(&stream).expect("header");
            assert!(header.refused.is_none());
            acknowledge(&stream).expect("taken");
            stream
        });
        let successor = offer.successor().await;
        let kept = tokio::task::spawn_blocking(move || {
            offer.hand_over(successor, (&nothing_attributed(), &[]))
        })
        .await
        .expect("thread")
        .expect("handed over");
        assert!(kept.0.is_none());
        drop(asking.await.expect("successor"));
    }

    /// The running gateway waits for the successor's `taken` (which the
    /// successor says once it told systemd it is the main process), and
    /// anything else, or nothing, is an error.
    #[test]
    fn the_running_gateway_waits_until_the_successor_says_it_took_over() {
        let (a, b) = UnixStream::pair().expect("pair");
        let waiting = std::thread::spawn(move || await_acknowledgement(&a));
        std::thread::sleep(Duration::from_millis(300));
        assert!(!waiting.is_finished(), "not before the successor answers");
        acknowledge(&b).expect("answered");
        waiting.join().expect("thread").expect("taken");
        let (a, mut b) = UnixStream::pair().expect("pair");
        b.write_all(b"later\n").expect("write");
        assert!(await_acknowledgement(&a).is_err());
        let (a, b) = UnixStream::pair().expect("pair");
        drop(b);
        assert!(await_acknowledgement(&a).is_err(), "the successor gone");
    }
}
