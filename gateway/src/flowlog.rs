//! The flow log: one JSON line per flow, the input of the replay tool too.

use std::collections::HashMap;
use std::io::{BufWriter, Write};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use dns_attrib::held::{share_with_reserve, Held, Holds};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

use serde::Serialize;

/// One flow, as logged.
#[derive(Clone, Debug, Default, Serialize)]
pub struct FlowRecord {
    /// RFC 3339, UTC, when the flow ended.
    pub ts: String,
    pub sandbox: Option<String>,
    pub src: Option<SocketAddr>,
    pub dst: Option<SocketAddr>,
    pub sni: Option<String>,
    pub host: Option<String>,
    /// At most [`MAX_NAMES`] of the names attributed to the address.
    pub attributed: Vec<String>,
    /// How many more names were attributed than `attributed` lists.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attributed_left_out: Option<usize>,
    /// What the first bytes were: `tls`, `http`, a stream protocol the
    /// gateway names (`ssh`), or `opaque`; absent when the flow ended
    /// before it was classified.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub protocol: Option<&'static str>,
    /// `deny`, `allow`, `splice` or `intercept`.
    pub verdict: &'static str,
    /// A bounded reason code (docs/reason-codes.md).
    pub reason: &'static str,
    /// The readable reason, naming the rule.
    pub detail: String,
    pub bytes_up: u64,
    pub bytes_down: u64,
    pub duration_ms: u64,
    /// What went wrong after the verdict, if anything (`non_http`, `upstream_connect`, …).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Requests served on an intercepted flow.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub requests: Option<u64>,
    /// Requests refused with 403 on a flow that was let through.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub denied_requests: Option<u64>,
    /// The first of them: `<code> <rule>: <method> <path>`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_denied: Option<String>,
    /// The first request an audited rule would have refused (it was let
    /// through): `<code> <rule>: <method> <path>`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub would_deny: Option<String>,
    /// The flow under the sandbox's shadow policy, when it has one:
    /// `{verdict, reason}`, or `"unobservable"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shadow: Option<crate::shadow::Outcome>,
}

/// Lines queued for the writer before new ones are dropped (and counted).
const QUEUE: usize = 65_536;
/// Bytes of text queued for the writer before new lines are dropped (and
/// counted): the sandbox chooses much of a line (its names, its paths).
const QUEUE_BYTES: usize = 32 << 20;
/// The fewest queued bytes a source may hold however many hold some.
const MIN_QUEUE_SHARE: usize = 1 << 20;
/// A source holding fewer queued bytes takes from the queue's reserve too.
const QUEUE_NEWCOMER: usize = 64 << 10;
/// The fewest bytes of a capped file a source may write however many do.
const MIN_FILE_SHARE: u64 = 4 << 20;
/// A source that wrote fewer bytes since the file was rotated takes from
/// the file's reserve too.
const FILE_NEWCOMER: u64 = 1 << 20;
/// Sources counted apart in a capped file; past that, new ones share one
/// count.
const MAX_FILE_SOURCES: usize = 65_536;
/// Names of `attributed` a line lists.
pub const MAX_NAMES: usize = 8;
/// Characters of `detail`, `error`, `request_denied` and `would_deny` a
/// line keeps (a rule's text can be long: 256 paths of 1 KiB).
pub const MAX_TEXT: usize = 1024;

/// Where flow lines go. A flow's task only queues its record; a thread of
/// the log's own formats the lines and writes them through a buffer,
/// flushing whenever the queue runs dry, so a line is on disk within
/// moments of its flow's end and the flows never wait on the file.
///
/// One sandbox ending flows in a loop cannot take the log from the others:
/// a source address holds at most its share of the queue's bytes, and of
/// a capped file's bytes since it was last rotated (a fair share, the last
/// eighth kept for sources that hold little: [`share_with_reserve`]). Its
/// lines past that are dropped and counted; the others' are still written.
pub struct FlowLog {
    sink: Option<Writer>,
}

struct Writer {
    tx: Mutex<Option<SyncSender<Queued>>>,
    /// The text of the lines queued now ([`FlowRecord::weight`]).
    queued: Arc<AtomicUsize>,
    /// The same, per source.
    per_source: Holds<Option<IpAddr>>,
    /// The lines queued, or written to the buffer but not yet flushed.
    pending: Arc<AtomicUsize>,
    thread: Mutex<Option<(JoinHandle<()>, Receiver<()>)>>,
    dropped: Arc<AtomicU64>,
}

/// How long [`FlowLog::close`] waits for the writer to write out what is
/// queued (a stalled pipe or a hung mount must not hold the exit).
const CLOSE_WAIT: Duration = Duration::from_secs(5);
/// How often the writer looks at the file's size against its cap.
const SIZE_CHECK: Duration = Duration::from_secs(1);

/// Ends the last line of `file` (appended to) when a run before this one
/// left it cut short (a full disk at its exit), so this run's first line
/// is a line of its own; not at or past the cap, where nothing is written
/// anyway. Best effort: the last byte is read through a handle of its own
/// (the log needs only write access), and a failure (the disk still full,
/// the file not readable) is a warning, never a reason not to start.
fn end_a_cut_line(path: &str, file: &std::fs::File, max_bytes: u64) {
    use std::os::unix::fs::FileExt;
    let ended = || -> std::io::Result<()> {
        let len = file.metadata()?.len();
        if len == 0 || len >= max_bytes {
            return Ok(());
        }
        let mut last = [0u8; 1];
        std::fs::File::open(path)?.read_exact_at(&mut last, len - 1)?;
        if last[0] != b'\n' {
            (&*file).write_all(b"\n")?;
        }
        Ok(())
    };
    if let Err(e) = ended() {
        tracing::warn!(%path, error = %e, "could not end the flow log's last line, which an earlier run may have left cut short");
    }
}

impl FlowLog {
    /// `stdout`, `off`, or a file path (appended to). A file is written up
    /// to `max_bytes`; past that, lines are dropped (and counted) until it
    /// is rotated. A file renamed or removed under the log is followed: the
    /// path is opened again (created) within about two seconds, with or
    /// without a line to write.
    pub fn open(target: &str, max_bytes: u64) -> std::io::Result<Self> {
        let (sink, cap): (Box<dyn Write + Send>, _) = match target {
            "off" => return Ok(Self::off()),
            "stdout" => (Box::new(std::io::stdout()), None),
            path => {
                let file = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)?;
                end_a_cut_line(path, &file, max_bytes);
                let cap = SizeCap::new(path, file.try_clone()?, max_bytes);
                (Box::new(file), Some(cap))
            }
        };
        Writer::start(sink, cap).map(|sink| Self { sink: Some(sink) })
    }

    /// A log that writes nothing (`off`).
    pub fn off() -> Self {
        Self { sink: None }
    }

    /// A log that hands lines to `w` (tests).
    pub fn to_writer(w: Box<dyn Write + Send>) -> Self {
        Self {
            sink: Writer::start(w, None).ok(),
        }
    }

    /// Whether lines are written at all: with `off`, the per-flow strings
    /// that only the log reads are not built.
    pub fn enabled(&self) -> bool {
        self.sink.is_some()
    }

    /// Queues one flow's line; never blocks. A full queue drops the line
    /// and counts it ([`FlowLog::dropped`]).
    pub fn write(&self, mut record: FlowRecord) {
        let Some(sink) = &self.sink else { return };
        record.bound();
        // At least the queue's bytes per line: a source's share of the
        // bytes then bounds its lines too, and short lines cannot take the
        // queue's places from the others.
        let weight = record.weight().max(QUEUE_BYTES / QUEUE);
        let used = sink.queued.fetch_add(weight, Ordering::Relaxed);
        sink.pending.fetch_add(1, Ordering::Relaxed);
        let share = |holding| {
            share_with_reserve(QUEUE_BYTES, used, holding, MIN_QUEUE_SHARE, QUEUE_NEWCOMER)
        };
        let held = (used + weight <= QUEUE_BYTES)
            .then(|| Held::take_units(&sink.per_source, source(&record), weight, share))
            .flatten();
        let tx = sink.tx.lock().unwrap_or_else(PoisonError::into_inner);
        let queued = held.is_some_and(|held| {
            tx.as_ref().is_some_and(|tx| {
                let at = OffsetDateTime::now_utc();
                tx.try_send(Queued {
                    at,
                    record,
                    weight,
                    _held: held,
                })
                .is_ok()
            })
        });
        if !queued {
            sink.queued.fetch_sub(weight, Ordering::Relaxed);
            sink.pending.fetch_sub(1, Ordering::Relaxed);
            sink.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Lines dropped: because the writer fell behind (or had stopped), a
    /// write failed, or the file was at its cap.
    pub fn dropped(&self) -> Arc<AtomicU64> {
        self.sink
            .as_ref()
            .map_or_else(Arc::default, |s| s.dropped.clone())
    }

    /// Writes out every queued line and stops the writer (at shutdown,
    /// after the flows have drained); later lines are dropped. Waits at most
    /// [`CLOSE_WAIT`]: what is still queued then is counted as dropped.
    pub fn close(&self) {
        self.close_within(CLOSE_WAIT);
    }

    fn close_within(&self, wait: Duration) {
        let Some(sink) = &self.sink else { return };
        drop(
            sink.tx
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take(),
        );
        let writer = sink
            .thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let Some((thread, done)) = writer else { return };
        if done.recv_timeout(wait) != Err(RecvTimeoutError::Timeout) {
            let _ = thread.join();
            return;
        }
        let left = sink.pending.load(Ordering::Relaxed);
        sink.dropped.fetch_add(left as u64, Ordering::Relaxed);
        tracing::warn!(
            lines = left,
            "the flow log's writer did not finish within {wait:?}; the lines not yet written are lost"
        );
    }
}

impl Writer {
    fn start(w: Box<dyn Write + Send>, cap: Option<SizeCap>) -> std::io::Result<Self> {
        let (tx, rx) = sync_channel::<Queued>(QUEUE);
        let (done_tx, done) = sync_channel::<()>(1);
        let queued = Arc::new(AtomicUsize::new(0));
        let pending = Arc::new(AtomicUsize::new(0));
        let dropped = Arc::<AtomicU64>::default();
        let mut out = Lines {
            out: BufWriter::with_capacity(64 * 1024, w),
            line: Vec::with_capacity(1024),
            failed: false,
            unflushed: 0,
            cap,
            queued: queued.clone(),
            pending: pending.clone(),
            dropped: dropped.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("flow-log".into())
            .spawn(move || {
                out.write_all(&rx);
                let _ = done_tx.send(());
            })?;
        Ok(Self {
            tx: Mutex::new(Some(tx)),
            queued,
            per_source: Holds::default(),
            pending,
            thread: Mutex::new(Some((thread, done))),
            dropped,
        })
    }
}

/// A capped file: its size as last looked at (every [`SIZE_CHECK`]), and
/// what each source wrote to it since it was last rotated.
struct SizeCap {
    path: String,
    file: std::fs::File,
    max_bytes: u64,
    /// When the size was last looked at (`None`: never).
    looked: Option<Instant>,
    size: u64,
    written: HashMap<Option<IpAddr>, u64>,
    /// A source's lines were dropped past its share since the rotation.
    warned: bool,
    /// The path could not be opened again after a rename (warned once).
    unopened: bool,
}

impl SizeCap {
    fn new(path: &str, file: std::fs::File, max_bytes: u64) -> Self {
        Self {
            path: path.to_owned(),
            file,
            max_bytes,
            looked: None,
            size: 0,
            written: HashMap::new(),
            warned: false,
            unopened: false,
        }
    }

    /// Whether the file is at its cap, as of the last look.
    fn full(&self) -> bool {
        self.size >= self.max_bytes
    }

    /// Whether a line of `len` bytes from `source` is written: not past the
    /// source's share of the file.
    fn admits(&mut self, source: Option<IpAddr>, len: usize) -> bool {
        let counted = self.written.len() < MAX_FILE_SOURCES || self.written.contains_key(&source);
        let key = if counted { source } else { None };
        let total = usize::try_from(self.max_bytes).unwrap_or(usize::MAX);
        let used = usize::try_from(self.size).unwrap_or(usize::MAX);
        let floor = usize::try_from(MIN_FILE_SHARE).unwrap_or(usize::MAX);
        let newcomer = usize::try_from(FILE_NEWCOMER).unwrap_or(usize::MAX);
        let holding = self.written.len();
        let share = share_with_reserve(total, used, holding, floor, newcomer) as u64;
        let mine = self.written.entry(key).or_insert(0);
        if *mine + len as u64 > share {
            if !self.warned {
                self.warned = true;
                tracing::warn!(
                    ?source,
                    share,
                    "a source reached its share of the flow log's file: its lines are dropped (and counted) until the file is rotated"
                );
            }
            return false;
        }
        *mine += len as u64;
        true
    }

    /// Looks at the file at most every [`SIZE_CHECK`]. A path that names
    /// another file now, or none (logrotate's rename, with or without
    /// `create`), is opened again: the new file is returned for the writer
    /// to write to from then on. A size smaller than the last one is a
    /// rotation in place (`copytruncate`). Either starts every source's
    /// count again. Warns when the cap is reached or left.
    fn look(&mut self) -> Option<std::fs::File> {
        if self.looked.is_some_and(|at| at.elapsed() < SIZE_CHECK) {
            return None;
        }
        self.looked = Some(Instant::now());
        let reopened = self.follow();
        let size = self.file.metadata().map_or(0, |m| m.len());
        if size < self.size || reopened.is_some() {
            self.written.clear();
            self.warned = false;
        }
        let (was_over, now_over) = (self.size >= self.max_bytes, size >= self.max_bytes);
        self.size = size;
        if now_over && !was_over {
            tracing::warn!(
                size,
                max_bytes = self.max_bytes,
                "the flow log reached log.flow_log_max_bytes: lines are dropped (and counted) until it is rotated"
            );
        } else if was_over && !now_over {
            tracing::info!(size, "the flow log is below its cap again");
        }
        reopened
    }

    /// The path opened again when it no longer names the open file.
    fn follow(&mut self) -> Option<std::fs::File> {
        use std::os::unix::fs::MetadataExt;
        let same =
            |a: &std::fs::Metadata, b: &std::fs::Metadata| (a.dev(), a.ino()) == (b.dev(), b.ino());
        let open = self.file.metadata().ok()?;
        match std::fs::metadata(&self.path) {
            Ok(at_path) if same(&at_path, &open) => return None,
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return None,
            _ => {}
        }
        let opened = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .and_then(|file| Ok((file.try_clone()?, file)));
        match opened {
            Ok((file, for_writer)) => {
                end_a_cut_line(&self.path, &file, self.max_bytes);
                tracing::info!(path = %self.path, "the flow log was renamed or removed: writing to the path again");
                self.unopened = false;
                self.file = file;
                Some(for_writer)
            }
            Err(e) => {
                if !std::mem::replace(&mut self.unopened, true) {
                    tracing::warn!(path = %self.path, error = %e, "the flow log was renamed or removed and its path cannot be opened again: lines go on to the file it was");
                }
                None
            }
        }
    }
}

/// The writer thread's state.
struct Lines {
    out: BufWriter<Box<dyn Write + Send>>,
    line: Vec<u8>,
    /// Writing is failing (warned once per run of failures).
    failed: bool,
    /// Lines in the buffer since the last flush that succeeded.
    unflushed: usize,
    cap: Option<SizeCap>,
    queued: Arc<AtomicUsize>,
    pending: Arc<AtomicUsize>,
    dropped: Arc<AtomicU64>,
}

impl Lines {
    /// Until every sender is gone, a line per record, flushed each time the
    /// queue is empty. A line not written (a failed write, the file at its
    /// cap or the source at its share of it, the last flush failing) is
    /// counted as dropped. A quiet log still looks at its file every
    /// [`SIZE_CHECK`], so a rename is followed without waiting for a line.
    fn write_all(&mut self, rx: &Receiver<Queued>) {
        loop {
            let first = match rx.recv_timeout(SIZE_CHECK) {
                Ok(first) => first,
                Err(RecvTimeoutError::Timeout) => {
                    self.look();
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => break,
            };
            let mut next = Some(first);
            while let Some(queued) = next.take() {
                self.queued.fetch_sub(queued.weight, Ordering::Relaxed);
                self.write(queued.at, queued.record);
                next = rx.try_recv().ok();
            }
            self.flush();
        }
        if self.unflushed > 0 && self.out.flush().is_err() {
            tracing::warn!(
                lines = self.unflushed,
                "the flow log's last lines could not be written"
            );
            self.drop_lines(self.unflushed);
        }
    }

    /// Looks at the capped file ([`SizeCap::look`]), and writes to the
    /// path's new file from then on if it was renamed or removed.
    fn look(&mut self) {
        if let Some(file) = self.cap.as_mut().and_then(SizeCap::look) {
            // What is buffered goes to the file renamed away, the rest to
            // the new one (all of it, if that flush fails).
            self.flush();
            *self.out.get_mut() = Box::new(file);
        }
    }

    fn write(&mut self, at: OffsetDateTime, mut record: FlowRecord) {
        self.look();
        if self.cap.as_ref().is_some_and(SizeCap::full) {
            self.drop_lines(1);
            return;
        }
        record.ts = at.format(&Rfc3339).unwrap_or_default();
        self.line.clear();
        // Escaped where a terminal would act: the line may carry a
        // sandbox's request path, and the default log is stdout.
        if egress_api::text::json_to_writer(&mut self.line, &record).is_err() {
            self.drop_lines(1);
            return;
        }
        self.line.push(b'\n');
        let len = self.line.len();
        if let Some(cap) = &mut self.cap {
            if !cap.admits(source(&record), len) {
                self.drop_lines(1);
                return;
            }
        }
        match self.out.write_all(&self.line) {
            Ok(()) => self.unflushed += 1,
            Err(e) => {
                warn_once(&mut self.failed, &e);
                self.drop_lines(1);
            }
        }
    }

    fn flush(&mut self) {
        match self.out.flush() {
            Ok(()) => {
                self.failed = false;
                self.pending.fetch_sub(self.unflushed, Ordering::Relaxed);
                self.unflushed = 0;
            }
            // The buffer keeps what it could not write, for the next try.
            Err(e) => warn_once(&mut self.failed, &e),
        }
    }

    fn drop_lines(&self, n: usize) {
        self.pending.fetch_sub(n, Ordering::Relaxed);
        self.dropped.fetch_add(n as u64, Ordering::Relaxed);
    }
}

/// The source a line is counted under: its flow's source address.
fn source(record: &FlowRecord) -> Option<IpAddr> {
    record.src.map(|a| a.ip().to_canonical())
}

/// A line queued: when its flow ended, the record, its weight, and its
/// source's hold on that weight (given back once written or dropped).
struct Queued {
    at: OffsetDateTime,
    record: FlowRecord,
    weight: usize,
    _held: Held<Option<IpAddr>>,
}

impl FlowRecord {
    /// Cuts what a sandbox can make long: the names to [`MAX_NAMES`] (the
    /// rest counted), the texts to [`MAX_TEXT`] characters.
    fn bound(&mut self) {
        if self.attributed.len() > MAX_NAMES {
            self.attributed_left_out = Some(self.attributed.len() - MAX_NAMES);
            self.attributed.truncate(MAX_NAMES);
        }
        cut(&mut self.detail);
        for text in [
            &mut self.error,
            &mut self.request_denied,
            &mut self.would_deny,
        ]
        .into_iter()
        .flatten()
        {
            cut(text);
        }
    }

    /// About the bytes its line takes, queued or written.
    fn weight(&self) -> usize {
        let texts = [&self.error, &self.request_denied, &self.would_deny];
        256 + self.detail.len()
            + self.attributed.iter().map(|n| n.len() + 3).sum::<usize>()
            + self.sni.as_ref().map_or(0, String::len)
            + self.host.as_ref().map_or(0, String::len)
            + texts
                .iter()
                .filter_map(|t| t.as_ref())
                .map(String::len)
                .sum::<usize>()
    }
}

/// `text` cut to [`MAX_TEXT`] characters, `…` marking the cut.
fn cut(text: &mut String) {
    if let Some((at, _)) = text.char_indices().nth(MAX_TEXT) {
        text.truncate(at);
        text.push('…');
    }
}

/// Warns when writing starts failing, not on every line.
fn warn_once(failed: &mut bool, e: &std::io::Error) {
    if !*failed {
        tracing::warn!(error = %e, "flow log write failed");
        *failed = true;
    }
}

impl Drop for FlowLog {
    fn drop(&mut self) {
        self.close();
    }
}

impl std::fmt::Debug for FlowLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlowLog")
            .field("enabled", &self.sink.is_some())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A writer that keeps what it is given, and can be held shut.
    #[derive(Clone, Default)]
    struct Held {
        bytes: Arc<Mutex<Vec<u8>>>,
        gate: Arc<(Mutex<bool>, std::sync::Condvar)>,
    }

    impl Write for Held {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let (open, cv) = &*self.gate;
            let mut open = open.lock().unwrap_or_else(PoisonError::into_inner);
            while !*open {
                open = cv.wait(open).unwrap_or_else(PoisonError::into_inner);
            }
            self.bytes
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Held {
        fn open(&self) {
            let (open, cv) = &*self.gate;
            *open.lock().unwrap_or_else(PoisonError::into_inner) = true;
            cv.notify_all();
        }
        fn lines(&self) -> Vec<serde_json::Value> {
            let bytes = self.bytes.lock().unwrap_or_else(PoisonError::into_inner);
            String::from_utf8_lossy(&bytes)
                .lines()
                .map(|l| serde_json::from_str(l).expect("json line"))
                .collect()
        }
    }

    fn record(n: u64) -> FlowRecord {
        FlowRecord {
            verdict: "allow",
            reason: "allow_default",
            bytes_up: n,
            ..FlowRecord::default()
        }
    }

    #[test]
    fn every_line_is_written_in_order_by_close() {
        let w = Held::default();
        w.open();
        let log = FlowLog::to_writer(Box::new(w.clone()));
        for n in 0..1000 {
            log.write(record(n));
        }
        log.close();
        let lines = w.lines();
        assert_eq!(lines.len(), 1000);
        for (n, line) in lines.iter().enumerate() {
            assert_eq!(line["bytes_up"], n as u64);
            assert!(
                line["ts"].as_str().is_some_and(|t| t.ends_with('Z')),
                "{line}"
            );
        }
        assert_eq!(log.dropped().load(Ordering::Relaxed), 0);
        // After close, lines are dropped and counted, never block.
        log.write(record(1));
        assert_eq!(log.dropped().load(Ordering::Relaxed), 1);
    }

    /// A sandbox's request path holding what a terminal acts on (U+009B,
    /// CSI, percent-decoded from `%C2%9B`; a right-to-left override) goes
    /// into the line as escapes: the line read back holds the path as it
    /// was, and shown, it shows the escapes rather than clear the screen.
    #[test]
    fn what_a_terminal_acts_on_is_written_as_escapes() {
        let w = Held::default();
        w.open();
        let log = FlowLog::to_writer(Box::new(w.clone()));
        let denied = "http_not_allowed allow[0]: GET /v1/\u{9b}2J\u{9b}31mOK/\u{202e}fdp.exe";
        log.write(FlowRecord {
            request_denied: Some(denied.to_owned()),
            ..record(1)
        });
        log.close();
        let bytes = w
            .bytes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let text = String::from_utf8(bytes).expect("utf-8");
        let acted = text
            .chars()
            .filter(|c| matches!(c, '\u{80}'..='\u{9f}' | '\u{202e}'));
        assert_eq!(acted.count(), 0, "{text:?}");
        assert!(text.contains(r"GET /v1/\u009b2J"), "{text}");
        assert_eq!(w.lines()[0]["request_denied"], denied);
    }

    #[test]
    fn a_stuck_writer_never_blocks_a_flow_and_drops_are_counted() {
        let w = Held::default();
        let log = FlowLog::to_writer(Box::new(w.clone()));
        // The writer takes lines until its buffer is full, then is stuck;
        // the queue then fills, and the rest are dropped, not waited for.
        let total = QUEUE as u64 * 2;
        for n in 0..total {
            log.write(record(n));
        }
        let dropped = log.dropped().load(Ordering::Relaxed);
        // Unstick the writer before any assertion, so a failure cannot hang.
        w.open();
        // Tens of megabytes to write: a debug build on a busy machine needs
        // more than the close's usual wait, and this test is not about it.
        log.close_within(Duration::from_secs(60));
        assert!(dropped > 0, "a full queue drops");
        assert_eq!(
            w.lines().len() as u64 + dropped,
            total,
            "every line written or counted"
        );
    }

    /// What a sandbox makes long is cut, and the queue holds at most
    /// [`QUEUE_BYTES`] of text, however few lines that is.
    #[test]
    fn a_line_is_bounded_and_so_is_the_queue_in_bytes() {
        let w = Held::default();
        let log = FlowLog::to_writer(Box::new(w.clone()));
        let long = |n: u64| FlowRecord {
            attributed: (0..40)
                .map(|i| format!("n{i}.{}.test", "x".repeat(200)))
                .collect(),
            detail: "allow[0] ".to_owned() + &"/p".repeat(5_000),
            error: Some("e".repeat(10_000)),
            ..record(n)
        };
        let total = 20_000u64;
        for n in 0..total {
            log.write(long(n));
        }
        let dropped = log.dropped().load(Ordering::Relaxed);
        w.open();
        // Tens of megabytes to write: a debug build on a busy machine needs
        // more than the close's usual wait, and this test is not about it.
        log.close_within(Duration::from_secs(60));
        let lines = w.lines();
        // 20,000 lines of about 4 KiB once cut: more than 32 MiB, and fewer
        // lines than the queue's 65,536.
        assert!(dropped > 0, "the byte bound dropped some");
        assert_eq!(lines.len() as u64 + dropped, total);
        let line = &lines[0];
        assert_eq!(line["attributed"].as_array().map(Vec::len), Some(MAX_NAMES));
        assert_eq!(line["attributed_left_out"], 32);
        assert_eq!(
            line["detail"].as_str().map(|d| d.chars().count()),
            Some(MAX_TEXT + 1)
        );
        assert!(line["detail"].as_str().is_some_and(|d| d.ends_with('…')));
        assert_eq!(
            line["error"].as_str().map(|d| d.chars().count()),
            Some(MAX_TEXT + 1)
        );
    }

    /// A writer whose every write fails (a full disk, a closed pipe).
    struct Failing;

    impl Write for Failing {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            Err(std::io::Error::from_raw_os_error(28)) // ENOSPC
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Err(std::io::Error::from_raw_os_error(28))
        }
    }

    #[test]
    fn lines_that_could_not_be_written_are_counted() {
        let log = FlowLog::to_writer(Box::new(Failing));
        for n in 0..10 {
            log.write(record(n));
        }
        log.close();
        assert_eq!(log.dropped().load(Ordering::Relaxed), 10);
    }

    #[test]
    fn a_stalled_writer_holds_the_close_for_a_bounded_time() {
        let w = Held::default();
        let log = FlowLog::to_writer(Box::new(w.clone()));
        for n in 0..3 {
            log.write(record(n));
        }
        log.close_within(Duration::from_secs(1));
        // The writer is stuck in its write: the three lines are counted.
        assert_eq!(log.dropped().load(Ordering::Relaxed), 3);
        w.open();
    }

    #[test]
    fn a_file_at_its_cap_takes_no_more_lines_until_it_is_rotated() {
        let dir = tempfile::tempdir().expect("temp");
        let path = dir.path().join("flows.jsonl");
        std::fs::write(&path, vec![b'x'; 100]).expect("fill");
        let path_str = path.to_str().expect("utf-8");
        let log = FlowLog::open(path_str, 100).expect("open");
        for n in 0..5 {
            log.write(record(n));
        }
        log.close();
        assert_eq!(log.dropped().load(Ordering::Relaxed), 5);
        assert_eq!(std::fs::metadata(&path).expect("stat").len(), 100);
        // Rotated (copytruncate): lines are written again.
        std::fs::File::options()
            .write(true)
            .open(&path)
            .and_then(|f| f.set_len(0))
            .expect("truncate");
        let log = FlowLog::open(path_str, 100).expect("open");
        log.write(record(7));
        log.close();
        assert_eq!(log.dropped().load(Ordering::Relaxed), 0);
        let text = std::fs::read_to_string(&path).expect("read");
        assert!(text.contains("\"bytes_up\":7"), "{text}");
    }

    /// logrotate's default rotation renames the file (and may create the
    /// next): the log writes on to the renamed file for at most a second,
    /// then to the path again, and drops nothing. A removed file likewise.
    #[test]
    fn a_file_renamed_or_removed_under_the_log_is_followed() {
        let dir = tempfile::tempdir().expect("temp");
        let path = dir.path().join("flows.jsonl");
        let rotated = dir.path().join("flows.jsonl.1");
        let log = FlowLog::open(path.to_str().expect("utf-8"), 1 << 20).expect("open");
        let written = lines_in;
        let written_out = |n: usize| {
            let deadline = Instant::now() + Duration::from_secs(10);
            while written(&path).len() + written(&rotated).len() < n {
                assert!(Instant::now() < deadline, "lines not written");
                std::thread::sleep(Duration::from_millis(10));
            }
        };
        log.write(record(1));
        written_out(1);
        std::fs::rename(&path, &rotated).expect("rotate");
        std::thread::sleep(SIZE_CHECK + Duration::from_millis(100));
        log.write(record(2));
        log.write(record(3));
        written_out(3);
        assert_eq!(written(&rotated), [1], "renamed away with its lines");
        assert_eq!(written(&path), [2, 3], "the path written again");
        std::fs::remove_file(&path).expect("remove");
        // Followed with no line to write: the path is there again.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !path.exists() {
            assert!(
                Instant::now() < deadline,
                "a quiet log left the path removed"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        log.write(record(4));
        log.close();
        assert_eq!(written(&path), [4], "created again");
        assert_eq!(log.dropped().load(Ordering::Relaxed), 0);
    }

    /// The lines in the file at `at`, by their `bytes_up`.
    fn lines_in(at: &std::path::Path) -> Vec<u64> {
        let text = std::fs::read_to_string(at).unwrap_or_default();
        let lines = text.lines().map(serde_json::from_str::<serde_json::Value>);
        lines
            .map(|l| l.expect("a whole line")["bytes_up"].as_u64().expect("n"))
            .collect()
    }

    /// The package's rotation (`deploy/debian/egress-gateway/logrotate`,
    /// run by logrotate on a copy naming a temporary path) loses no line:
    /// this build follows the rename with no line to write; a process that
    /// keeps writing to the renamed file (a gateway of an earlier build,
    /// which does not follow one; here a file this test keeps open) gets
    /// its file back under the path, rotated in place; one that only reads
    /// it changes nothing.
    #[test]
    fn the_packaged_rotation_loses_no_line() {
        let found = std::process::Command::new("logrotate")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            egress_testkit::skip("the packaged rotation", "no logrotate here");
            return;
        }
        let stanza = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../deploy/debian/egress-gateway/logrotate"
        );
        let stanza = std::fs::read_to_string(stanza).expect("the packaged stanza");
        let rotate = |dir: &std::path::Path| {
            let path = dir.join("flows.jsonl");
            let conf = dir.join("logrotate.conf");
            let text = stanza.replace(
                "/var/log/egress-gateway/flows.jsonl",
                path.to_str().expect("utf-8"),
            );
            std::fs::write(&conf, text).expect("conf");
            let out = std::process::Command::new("logrotate")
                .arg("-f")
                .arg("-s")
                .arg(dir.join("state"))
                .arg(&conf)
                .output()
                .expect("logrotate");
            let said = String::from_utf8_lossy(&out.stderr).into_owned();
            assert!(out.status.success(), "logrotate: {said}");
            (path, said)
        };
        // This build.
        let dir = tempfile::tempdir().expect("temp");
        let path = dir.path().join("flows.jsonl");
        let log = FlowLog::open(path.to_str().expect("utf-8"), 1 << 20).expect("open");
        log.write(record(1));
        let deadline = Instant::now() + Duration::from_secs(10);
        while lines_in(&path).is_empty() {
            assert!(Instant::now() < deadline, "line 1 not written");
            std::thread::sleep(Duration::from_millis(10));
        }
        let (path, said) = rotate(dir.path());
        log.write(record(2));
        log.close();
        let rotated = dir.path().join("flows.jsonl.1");
        assert_eq!(
            (lines_in(&rotated), lines_in(&path)),
            (vec![1], vec![2]),
            "{said}"
        );
        // A writer that does not follow the rename (or only at its next
        // line): its file is rotated in place, the path never dropped.
        let dir = tempfile::tempdir().expect("temp");
        let path = dir.path().join("flows.jsonl");
        let mut earlier = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .expect("open");
        writeln!(earlier, "{{\"bytes_up\":1}}").expect("line 1");
        let (path, said) = rotate(dir.path());
        writeln!(earlier, "{{\"bytes_up\":2}}").expect("line 2");
        let rotated = dir.path().join("flows.jsonl.1");
        assert_eq!(
            (lines_in(&rotated), lines_in(&path)),
            (vec![1], vec![2]),
            "{said}"
        );
        assert!(said.contains("rotated in place instead"), "{said}");
        // A process that only reads the renamed file (a log shipper) is
        // no writer: the rotation stands.
        let dir = tempfile::tempdir().expect("temp");
        let path = dir.path().join("flows.jsonl");
        std::fs::write(&path, "{\"bytes_up\":1}\n").expect("write");
        let _reading = std::fs::File::open(&path).expect("open");
        let (path, said) = rotate(dir.path());
        let rotated = dir.path().join("flows.jsonl.1");
        assert_eq!(lines_in(&rotated), [1], "{said}");
        assert!(!path.exists(), "{said}");
    }

    #[test]
    fn a_line_cut_short_by_the_run_before_is_ended_first() {
        let dir = tempfile::tempdir().expect("temp");
        let path = dir.path().join("flows.jsonl");
        std::fs::write(&path, b"{\"whole\":1}\n{\"cut").expect("fill");
        let log = FlowLog::open(path.to_str().expect("utf-8"), 1 << 20).expect("open");
        log.write(record(7));
        log.close();
        let text = std::fs::read_to_string(&path).expect("read");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert_eq!(lines[1], "{\"cut");
        let line: serde_json::Value = serde_json::from_str(lines[2]).expect("a line of its own");
        assert_eq!(line["bytes_up"], 7);
        // A file that ends whole gets nothing added.
        let before = std::fs::metadata(&path).expect("stat").len();
        drop(FlowLog::open(path.to_str().expect("utf-8"), 1 << 20).expect("open"));
        assert_eq!(std::fs::metadata(&path).expect("stat").len(), before);
        // One that cannot be ended (not readable here: the log needs only
        // to write) still opens, and takes lines.
        std::fs::write(&path, b"{\"cut").expect("cut again");
        let write_only = std::fs::Permissions::from_mode(0o200);
        std::fs::set_permissions(&path, write_only).expect("chmod");
        let unreadable = std::fs::File::open(&path).is_err();
        let log =
            FlowLog::open(path.to_str().expect("utf-8"), 1 << 20).expect("opens all the same");
        log.write(record(8));
        log.close();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        let text = std::fs::read_to_string(&path).expect("read");
        assert!(text.contains("\"bytes_up\":8"), "{text}");
        if unreadable {
            assert!(
                text.starts_with("{\"cut{"),
                "not ended when it cannot be read: {text}"
            );
        }
    }

    /// A line of about 1.3 KiB queued from `src`.
    fn from(src: &str, n: u64) -> FlowRecord {
        FlowRecord {
            src: Some(src.parse().expect("addr")),
            detail: "p".repeat(1024),
            ..record(n)
        }
    }

    /// A source ending flows in a loop while the writer is stuck holds its
    /// share of the queue's bytes, not the whole queue: another source's
    /// lines are still queued, and written once the writer moves.
    #[test]
    fn one_source_cannot_fill_the_queue_for_the_others() {
        let w = Held::default();
        let log = FlowLog::to_writer(Box::new(w.clone()));
        // 30,000 lines of 1.3 KiB: more than the queue's 32 MiB.
        for n in 0..30_000 {
            log.write(from("100.64.0.2:40000", n));
        }
        let flooded = log.dropped().load(Ordering::Relaxed);
        for n in 0..100 {
            log.write(from("[2001:db8::3]:40000", n));
        }
        let dropped = log.dropped().load(Ordering::Relaxed);
        w.open();
        log.close_within(Duration::from_secs(60));
        assert_eq!(dropped, flooded, "the other source's lines were queued");
        assert!(flooded > 10_000, "past its share: {flooded} dropped");
        let other = w
            .lines()
            .iter()
            .filter(|l| l["src"] == "[2001:db8::3]:40000")
            .count();
        assert_eq!(other, 100);
    }

    /// Two sources ending short flows in a loop (a line of about 300
    /// bytes, fewer than the queue's bytes per place) take no more of the
    /// queue's 65,536 places than of its bytes: a third source's lines are
    /// still queued.
    #[test]
    fn short_lines_cannot_take_the_queues_places() {
        let w = Held::default();
        let log = FlowLog::to_writer(Box::new(w.clone()));
        let short = |src: &str, n| FlowRecord {
            src: Some(src.parse().expect("addr")),
            ..record(n)
        };
        for n in 0..40_000 {
            log.write(short("100.64.0.2:40000", n));
            log.write(short("100.64.0.3:40000", n));
        }
        let flooded = log.dropped().load(Ordering::Relaxed);
        for n in 0..100 {
            log.write(short("[2001:db8::3]:40000", n));
        }
        let dropped = log.dropped().load(Ordering::Relaxed);
        w.open();
        log.close_within(Duration::from_secs(60));
        assert_eq!(dropped, flooded, "the third source's lines were queued");
        assert!(flooded > 20_000, "past their shares: {flooded} dropped");
    }

    /// A source that wrote its share of a capped file since it was rotated
    /// writes no more while others still do; in the file's last eighth only
    /// sources that wrote little do; a rotation starts every count again.
    #[test]
    fn one_source_cannot_fill_the_file_for_the_others() {
        let dir = tempfile::tempdir().expect("temp");
        let path = dir.path().join("flows.jsonl");
        let file = std::fs::File::create(&path).expect("create");
        let path_str = path.to_str().expect("utf-8");
        let mut cap = SizeCap::new(path_str, file.try_clone().expect("clone"), 16 << 20);
        let (a, b, c): (IpAddr, IpAddr, IpAddr) = (
            "100.64.0.2".parse().expect("ip"),
            "100.64.0.3".parse().expect("ip"),
            "100.64.0.4".parse().expect("ip"),
        );
        let lines = std::iter::from_fn(|| cap.admits(Some(a), 1000).then_some(())).count();
        assert_eq!(lines, (8 << 20) / 1000, "alone, half the file");
        assert!(cap.admits(Some(b), 1000), "another source still writes");
        // The file in its last eighth: a source that wrote little still
        // writes (up to 1 MiB), one that wrote its share does not.
        file.set_len(15 << 20).expect("grow");
        cap.looked = None;
        assert!(cap.look().is_none(), "the same file");
        assert!(!cap.full());
        assert!(cap.admits(Some(c), 1000), "a newcomer writes");
        let more = std::iter::from_fn(|| cap.admits(Some(b), 1000).then_some(())).count();
        assert_eq!(more, (FILE_NEWCOMER as usize - 1000) / 1000);
        // Rotated (copytruncate): every source writes again.
        file.set_len(0).expect("truncate");
        cap.looked = None;
        assert!(cap.look().is_none(), "the same file");
        assert!(!cap.full());
        assert!(
            cap.admits(Some(a), 1000),
            "counted again after the rotation"
        );
    }
}
