//! The worker's VM routes (the gateway's admin API), as the reconciler uses
//! them. One HTTP/1.1 connection per call, every call bounded in time.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use bytes::Bytes;
use egress_api::client::{Call, CallError, Target};
use egress_policy::machine::MachineEgress;
use http::{Method, StatusCode};

use crate::decide::WorkerPolicy;

/// Why a call to the worker failed.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// Not connected: the request never reached the worker.
    #[error("worker unreachable: {0}")]
    Unreachable(String),
    /// Sent, but no whole answer came back: a change may have been made.
    #[error("no answer from the worker: {reason}")]
    NoAnswer { reason: String, timed_out: bool },
    #[error("worker answered {status} to {what}: {body}")]
    Status {
        what: String,
        status: StatusCode,
        body: String,
    },
    #[error("worker's answer to {what} is unreadable: {message}")]
    Unreadable { what: String, message: String },
}

/// The worker's admin API.
#[derive(Clone, Debug)]
pub struct Worker {
    pub admin: SocketAddr,
    /// Sent as `Authorization: Bearer …` when set.
    pub token: Option<String>,
    pub timeout: Duration,
}

/// One exchange's answer.
pub use egress_api::client::Answer;

/// Largest reply read from the worker.
pub const MAX_REPLY: usize = 8 << 20;

/// Sends one request to `addr` over a fresh HTTP/1.1 connection, bounded by
/// `timeout` as a whole and its reply by [`MAX_REPLY`]. The reconciler and
/// the relay both call the worker through it.
pub async fn exchange(
    addr: SocketAddr,
    token: Option<&str>,
    method: Method,
    path_and_query: &str,
    body: Option<Bytes>,
    timeout: Duration,
) -> Result<Answer, WorkerError> {
    let authority = addr.to_string();
    let to = Target {
        authority: &authority,
        token,
        timeout,
        max_reply: MAX_REPLY,
    };
    let call_method = method.clone();
    let call = Call {
        method,
        path: path_and_query,
        body: body.map(|b| ("application/json", b)),
    };
    egress_api::client::exchange(to, call)
        .await
        .map_err(|e| match e {
            CallError::Connect { .. } => WorkerError::Unreachable(e.to_string()),
            CallError::TimedOut { .. } => WorkerError::NoAnswer {
                reason: e.to_string(),
                timed_out: true,
            },
            // An answer came, whole or not: it is too large to read.
            CallError::TooLarge { .. } => WorkerError::Unreadable {
                what: format!("{} {path_and_query}", call_method),
                message: e.to_string(),
            },
            _ => WorkerError::NoAnswer {
                reason: e.to_string(),
                timed_out: false,
            },
        })
}

impl Worker {
    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Bytes>,
    ) -> Result<Answer, WorkerError> {
        exchange(
            self.admin,
            self.token.as_deref(),
            method,
            path,
            body,
            self.timeout,
        )
        .await
    }

    fn ok(what: String, a: Answer) -> Result<serde_json::Value, WorkerError> {
        if !a.status.is_success() {
            return Err(WorkerError::Status {
                what,
                status: a.status,
                body: String::from_utf8_lossy(&a.body).into_owned(),
            });
        }
        serde_json::from_slice(&a.body).map_err(|e| WorkerError::Unreadable {
            what,
            message: e.to_string(),
        })
    }

    /// `GET path`'s document, with what it was for errors (`GET path`);
    /// `None` when the worker has no such VM (`404`).
    async fn get(&self, path: &str) -> Result<Option<(String, serde_json::Value)>, WorkerError> {
        let a = self.call(Method::GET, path, None).await?;
        if a.status == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        let what = format!("GET {path}");
        Self::ok(what.clone(), a).map(|doc| Some((what, doc)))
    }

    /// The VM's policy on the worker; `None` when the worker has no such VM.
    pub async fn policy(&self, vm: &str) -> Result<Option<WorkerPolicy>, WorkerError> {
        let Some((what, doc)) = self.get(&format!("/v1/vms/{vm}/network/egress")).await? else {
            return Ok(None);
        };
        let unreadable = |message: String| WorkerError::Unreadable {
            what: what.clone(),
            message,
        };
        let own = match doc["source"].as_str() {
            Some("vm") => true,
            Some("default") => false,
            other => return Err(unreadable(format!("source {other:?}"))),
        };
        let policy = MachineEgress::from_value(&doc["policy"])
            .map_err(|p| unreadable(format!("policy: {p:?}")))?;
        Ok(Some(WorkerPolicy { own, policy }))
    }

    /// The source addresses the worker holds for the VM; `None` when the
    /// worker has no such VM. A VM matched by cgroup may hold none.
    pub async fn addresses(&self, vm: &str) -> Result<Option<Vec<IpAddr>>, WorkerError> {
        let Some((what, doc)) = self.get(&format!("/v1/vms/{vm}")).await? else {
            return Ok(None);
        };
        serde_json::from_value(doc["addresses"].clone())
            .map(Some)
            .map_err(|e| WorkerError::Unreadable {
                what,
                message: format!("addresses: {e}"),
            })
    }

    /// Sets the VM's own policy.
    pub async fn write(&self, vm: &str, policy: &MachineEgress) -> Result<(), WorkerError> {
        let path = format!("/v1/vms/{vm}/network/egress");
        let body = Bytes::from(policy.to_value().to_string());
        let a = self.call(Method::PUT, &path, Some(body)).await?;
        Self::ok(format!("PUT {path}"), a).map(drop)
    }

    /// Clears the VM's own policy: it follows the node default.
    pub async fn clear(&self, vm: &str) -> Result<(), WorkerError> {
        let path = format!("/v1/vms/{vm}/network/egress");
        let a = self.call(Method::DELETE, &path, None).await?;
        Self::ok(format!("DELETE {path}"), a).map(drop)
    }

    /// The VM create request (registration), carrying its policy.
    pub async fn create(&self, vm: &str, body: &serde_json::Value) -> Result<(), WorkerError> {
        let path = format!("/v1/vms/{vm}");
        let a = self
            .call(Method::PUT, &path, Some(Bytes::from(body.to_string())))
            .await?;
        Self::ok(format!("PUT {path}"), a).map(drop)
    }
}
