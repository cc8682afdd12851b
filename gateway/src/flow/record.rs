//! The flow's log line and metrics, filled in from each stage's value and
//! written once when the flow ends. Strings only the log reads are built only
//! when there is a log.

use std::net::SocketAddr;
use std::time::Instant;

use tokio::net::TcpStream;

use super::{Accepted, Refusal};
use crate::decide::{Claims, Decided};
use crate::flowlog::FlowRecord;
use crate::intercept::Served;
use crate::registry::Sandbox;
use crate::spliced::Spliced;
use crate::state::Dataplane;

/// One flow's record in the making; counted as active while it lives.
pub(crate) struct Record<'a> {
    dp: &'a Dataplane,
    started: Instant,
    logging: bool,
    line: FlowRecord,
}

impl<'a> Record<'a> {
    pub(crate) fn start(dp: &'a Dataplane, peer: SocketAddr) -> Self {
        dp.metrics.active.inc();
        Self {
            dp,
            started: Instant::now(),
            logging: dp.flow_log.enabled(),
            line: FlowRecord {
                src: Some(peer),
                verdict: "deny",
                ..FlowRecord::default()
            },
        }
    }

    pub(crate) fn accepted(&mut self, a: &Accepted) {
        self.line.dst = Some(a.dst);
        if self.logging {
            self.line.sandbox = Some(a.sandbox.id.to_string());
        }
    }

    /// Ends the flow refused: tells the client and writes the line.
    pub(crate) async fn refused(mut self, stream: &mut TcpStream, refusal: Refusal) {
        refusal.answer(stream).await;
        if let Some(dst) = refusal.dst() {
            self.line.dst = Some(dst);
        }
        self.line.reason = refusal.code();
        self.line.detail = refusal.detail();
        self.finish();
    }

    pub(crate) fn decided(&mut self, claims: &Claims<'_>, decided: &Decided, sandbox: &Sandbox) {
        self.line.verdict = decided.verdict.name();
        self.line.reason = decided.verdict.code();
        self.line.protocol = Some(claims.protocol.as_str());
        self.shadow(claims, decided, sandbox);
        if self.logging {
            self.line.sni = claims.sni.map(ToString::to_string);
            self.line.host = claims.host.map(ToString::to_string);
            self.line.attributed = decided
                .lookup
                .names()
                .iter()
                .map(ToString::to_string)
                .collect();
            self.line.detail = decided.verdict.describe(&sandbox.policy);
        }
    }

    /// Judges the flow under the sandbox's shadow policy, if it has one,
    /// on the evidence the active policy was judged on.
    fn shadow(&mut self, claims: &Claims<'_>, decided: &Decided, sandbox: &Sandbox) {
        let Some(shadow) = &sandbox.shadow else {
            return;
        };
        let judge = crate::shadow::Judge {
            doh: &self.dp.doh_names,
            diffs: &self.dp.shadow_diffs,
        };
        let outcome = crate::shadow::flow(&judge, shadow, claims, decided, self.line.src);
        self.line.shadow = Some(outcome);
    }

    pub(crate) fn served(&mut self, out: Served) {
        self.line.bytes_up = out.bytes_up;
        self.line.bytes_down = out.bytes_down;
        self.line.requests = Some(out.requests);
        self.line.denied_requests = (out.denied_requests > 0).then_some(out.denied_requests);
        self.line.request_denied = out.request_denied;
        self.line.would_deny = out.would_deny;
        if out.host.is_some() {
            self.line.host = out.host;
        }
        self.line.error = out.error.map(|ended| {
            self.dp.metrics.fault(ended.fault);
            ended.detail
        });
        if out.budget_cut.is_some() {
            self.line.error = out.budget_cut;
            self.dp.metrics.budget_exceeded(crate::budget::Over::Bytes);
        }
    }

    pub(crate) fn spliced(&mut self, moved: Result<Spliced, String>) {
        match moved {
            Ok(moved) => {
                self.line.bytes_up = moved.up;
                self.line.bytes_down = moved.down;
                if let Some(f) = moved.fault {
                    self.dp.metrics.fault(f);
                }
                if let Some(why) = moved.budget_cut {
                    self.line.error = Some(format!("budget_exceeded: {why}"));
                    self.dp.metrics.budget_exceeded(crate::budget::Over::Bytes);
                } else if moved.idle_timeout {
                    self.line.error = Some("idle_timeout".into());
                } else if let Some(f) = moved.fault {
                    self.line.error = Some(format!("{}_{}", f.side.as_str(), f.kind));
                }
            }
            Err(e) => self.line.error = Some(e),
        }
    }

    /// Ends a flow the policy let through but a budget refused (the client
    /// was reset): the verdict becomes `deny`, the reason `budget_exceeded`.
    pub(crate) fn budget_refused(mut self, detail: String) {
        self.line.verdict = "deny";
        self.line.reason = "budget_exceeded";
        self.line.detail = detail;
        self.finish();
    }

    /// Counts the flow in the metrics and writes its line.
    pub(crate) fn finish(mut self) {
        self.line.duration_ms = self.started.elapsed().as_millis() as u64;
        let line = std::mem::take(&mut self.line);
        self.dp
            .metrics
            .flow(line.verdict, line.reason, line.bytes_up, line.bytes_down);
        self.dp.flow_log.write(line);
    }
}

impl Drop for Record<'_> {
    fn drop(&mut self) {
        self.dp.metrics.active.dec();
    }
}
