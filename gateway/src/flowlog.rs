//! The flow log: one JSON line per flow, the input of the replay tool too.

use std::io::Write;
use std::net::SocketAddr;
use std::sync::Mutex;

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
    pub attributed: Vec<String>,
    /// `deny`, `allow`, `splice` or `intercept`.
    pub verdict: &'static str,
    /// A bounded reason code (see the README).
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
}

/// Where flow lines go.
pub struct FlowLog {
    sink: Option<Mutex<Box<dyn Write + Send>>>,
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
        Ok(Self {
            sink: sink.map(Mutex::new),
        })
    }

    /// A log that hands lines to `w` (tests).
    pub fn to_writer(w: Box<dyn Write + Send>) -> Self {
        Self {
            sink: Some(Mutex::new(w)),
        }
    }

    /// Whether lines are written at all: with `off`, the per-flow strings
    /// that only the log reads are not built.
    pub fn enabled(&self) -> bool {
        self.sink.is_some()
    }

    pub fn write(&self, mut record: FlowRecord) {
        let Some(sink) = &self.sink else { return };
        record.ts = time::OffsetDateTime::now_utc()
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default();
        let Ok(mut line) = serde_json::to_vec(&record) else {
            return;
        };
        line.push(b'\n');
        let mut w = sink
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Err(e) = w.write_all(&line).and_then(|()| w.flush()) {
            tracing::warn!(error = %e, "flow log write failed");
        }
    }
}

impl std::fmt::Debug for FlowLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlowLog")
            .field("enabled", &self.sink.is_some())
            .finish()
    }
}
