//! The flow log: one JSON line per flow, the input of the replay tool too.

use std::io::{BufWriter, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

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
/// Names of `attributed` a line lists.
pub const MAX_NAMES: usize = 8;
/// Characters of `detail`, `error`, `request_denied` and `would_deny` a
/// line keeps (a rule's text can be long: 256 paths of 1 KiB).
pub const MAX_TEXT: usize = 1024;

/// Where flow lines go. A flow's task only queues its record; a thread of
/// the log's own formats the lines and writes them through a buffer,
/// flushing whenever the queue runs dry, so a line is on disk within
/// moments of its flow's end and the flows never wait on the file.
pub struct FlowLog {
    sink: Option<Writer>,
}

struct Writer {
    tx: Mutex<Option<SyncSender<Queued>>>,
    /// The text of the lines queued now ([`FlowRecord::weight`]).
    queued: Arc<AtomicUsize>,
    thread: Mutex<Option<JoinHandle<()>>>,
    dropped: Arc<AtomicU64>,
}

impl FlowLog {
    /// `stdout`, `off`, or a file path (appended to).
    pub fn open(target: &str) -> std::io::Result<Self> {
        let sink: Option<Box<dyn Write + Send>> = match target {
            "off" => None,
            "stdout" => Some(Box::new(std::io::stdout())),
            path => Some(Box::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)?,
            )),
        };
        sink.map(Writer::start)
            .transpose()
            .map(|sink| Self { sink })
    }

    /// A log that hands lines to `w` (tests).
    pub fn to_writer(w: Box<dyn Write + Send>) -> Self {
        Self {
            sink: Writer::start(w).ok(),
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
        let weight = record.weight();
        let room = sink.queued.fetch_add(weight, Ordering::Relaxed) + weight <= QUEUE_BYTES;
        let tx = sink.tx.lock().unwrap_or_else(PoisonError::into_inner);
        let queued = room
            && tx.as_ref().is_some_and(|tx| {
                tx.try_send((OffsetDateTime::now_utc(), record, weight))
                    .is_ok()
            });
        if !queued {
            sink.queued.fetch_sub(weight, Ordering::Relaxed);
            sink.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Lines dropped because the writer fell behind (or had stopped).
    pub fn dropped(&self) -> Arc<AtomicU64> {
        self.sink
            .as_ref()
            .map_or_else(Arc::default, |s| s.dropped.clone())
    }

    /// Writes out every queued line and stops the writer (at shutdown,
    /// after the flows have drained); later lines are dropped.
    pub fn close(&self) {
        let Some(sink) = &self.sink else { return };
        drop(
            sink.tx
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take(),
        );
        if let Some(thread) = sink
            .thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            let _ = thread.join();
        }
    }
}

impl Writer {
    fn start(w: Box<dyn Write + Send>) -> std::io::Result<Self> {
        let (tx, rx) = sync_channel::<Queued>(QUEUE);
        let queued = Arc::new(AtomicUsize::new(0));
        let taken = queued.clone();
        let thread = std::thread::Builder::new()
            .name("flow-log".into())
            .spawn(move || write_lines(&rx, w, &taken))?;
        Ok(Self {
            tx: Mutex::new(Some(tx)),
            queued,
            thread: Mutex::new(Some(thread)),
            dropped: Arc::default(),
        })
    }
}

/// The writer thread: until every sender is gone, a line per record,
/// flushed each time the queue is empty.
fn write_lines(rx: &Receiver<Queued>, w: Box<dyn Write + Send>, queued: &AtomicUsize) {
    let mut out = BufWriter::with_capacity(64 * 1024, w);
    let mut line = Vec::with_capacity(1024);
    let mut failed = false;
    while let Ok(first) = rx.recv() {
        let mut next = Some(first);
        while let Some((at, mut record, weight)) = next.take() {
            queued.fetch_sub(weight, Ordering::Relaxed);
            record.ts = at.format(&Rfc3339).unwrap_or_default();
            line.clear();
            if serde_json::to_writer(&mut line, &record).is_ok() {
                line.push(b'\n');
                if let Err(e) = out.write_all(&line) {
                    warn_once(&mut failed, &e);
                }
            }
            next = rx.try_recv().ok();
        }
        if let Err(e) = out.flush() {
            warn_once(&mut failed, &e);
        } else {
            failed = false;
        }
    }
    let _ = out.flush();
}

/// A line queued: when its flow ended, the record, its weight.
type Queued = (OffsetDateTime, FlowRecord, usize);

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
        log.close();
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
        log.close();
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
}
