//! A running worker for the cluster tests: a real gateway, started in
//! process, whose admin listener serves the VM routes (`/v1/vms/…`) and
//! whose per-VM nftables tables go into a throwaway network namespace —
//! never the host's. Needs root, `nft` and `ip`; without them
//! [`Worker::start`] prints `SKIPPED` and returns `None` (with
//! `EGRESS_E2E_REQUIRED=1` it panics instead).
//!
//! Use it from a test file with `mod support;`:
//!
//! ```ignore
//! let Some(worker) = support::Worker::start().await else { return };
//! worker.register_vm("vm1", "100.64.50.2").await;
//! let (status, _, body) = support::http(
//!     worker.admin, "GET", "/v1/vms/vm1/network/egress", &worker.auth(), None,
//! ).await;
//! ```
//!
//! Everything is loopback (127.0.0.1); the namespace is deleted on drop.

// `pub` is the API of this module to each test file that includes it.
#![allow(unreachable_pub)]

use std::net::SocketAddr;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use egress_gateway::config::{Admin, Config, Listen, Log, MachineEgressConfig, MachineObserve};
use egress_gateway::flowlog::FlowLog;
use egress_gateway::{Gateway, SoOriginalDst};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::TcpStream;

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// The admin bearer token every [`Worker`] requires.
#[allow(dead_code)]
pub const WORKER_TOKEN: &str = "worker-token-0123456789abcdef";

/// A gateway serving the worker API on 127.0.0.1, its machine egress in
/// the namespace [`Worker::netns`]. Dropping it stops the gateway and
/// deletes the namespace.
pub struct Worker {
    /// The admin listener: the VM routes, `Authorization: Bearer` [`WORKER_TOKEN`].
    pub admin: SocketAddr,
    /// The admin bearer token (= [`WORKER_TOKEN`]).
    pub token: String,
    /// The throwaway network namespace (`egc-<pid>-<n>`) holding the VM tables.
    pub netns: String,
    // Dropped in this order: the gateway (its tasks abort), its state
    // directory, then the namespace.
    _gateway: Gateway,
    _state: tempfile::TempDir,
    _netns: Namespace,
}

/// Whether the worker can run here: root, `nft` and `ip`. Prints `SKIPPED`
/// when not, or panics under `EGRESS_E2E_REQUIRED=1`.
#[allow(dead_code)]
pub fn available() -> bool {
    let ok = |program: &str, arg: &str| {
        Command::new(program)
            .arg(arg)
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.trim_ascii() == b"0");
    let (nft, ip) = (ok("nft", "--version"), ok("ip", "-V"));
    if root && nft && ip {
        return true;
    }
    egress_testkit::skip(
        "the worker tests",
        format!("they need root, nft and ip (root={root} nft={nft} ip={ip})"),
    );
    false
}

impl Worker {
    /// Starts a worker in a fresh namespace; `None` (after printing
    /// `SKIPPED`) when root, `nft` or `ip` is missing.
    #[allow(dead_code)]
    pub async fn start() -> Option<Self> {
        if !available() {
            return None;
        }
        let name = format!(
            "egc-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let netns = Namespace::add(&name);
        let state = tempfile::tempdir().expect("state dir");
        let token_file = state.path().join("admin-token");
        std::fs::write(&token_file, WORKER_TOKEN).expect("write token");
        let loopback: SocketAddr = ([127, 0, 0, 1], 0).into();
        let config = Config {
            state_dir: state.path().join("state"),
            listen: Listen {
                transparent: loopback,
                dns: loopback,
                dns_alt: loopback,
                admin: loopback,
            },
            log: Log {
                flow_log: "off".into(),
                ..Log::default()
            },
            admin: Admin {
                token_file: Some(token_file),
                ..Admin::default()
            },
            // The VM tables go into the throwaway namespace.
            machine_egress: MachineEgressConfig {
                nft: ["ip", "netns", "exec", &name, "nft"]
                    .map(str::to_owned)
                    .to_vec(),
                observe_interval: Duration::from_millis(200),
                // The rules are in another namespace than this process: an
                // NFLOG group read here would never see their events.
                observe: MachineObserve::Sampled,
                ..MachineEgressConfig::default()
            },
            ..Config::default()
        };
        let gateway = Gateway::start(config, Arc::new(SoOriginalDst), FlowLog::off())
            .await
            .expect("the worker starts");
        Some(Self {
            admin: gateway.bound().admin,
            token: WORKER_TOKEN.to_owned(),
            netns: name,
            _gateway: gateway,
            _state: state,
            _netns: netns,
        })
    }

    /// The `Authorization` header the worker wants, for [`http`].
    #[allow(dead_code)]
    pub fn auth(&self) -> [(&'static str, String); 1] {
        [("authorization", format!("Bearer {}", self.token))]
    }

    /// Registers a VM (`PUT /v1/vms/{id}` `{"addresses": [addr]}`; use
    /// addresses in 100.64.0.0/10) and returns the worker's view of it.
    /// Panics unless the worker answers 200.
    #[allow(dead_code)]
    pub async fn register_vm(&self, id: &str, addr: &str) -> Value {
        let doc = serde_json::json!({ "addresses": [addr] }).to_string();
        let (status, _, body) = http(
            self.admin,
            "PUT",
            &format!("/v1/vms/{id}"),
            &self.auth(),
            Some(&doc),
        )
        .await;
        assert_eq!(status, 200, "register {id}: {body}");
        json(&body)
    }

    /// `nft list ruleset` in the worker's namespace.
    #[allow(dead_code)]
    pub fn ruleset(&self) -> String {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.netns, "nft", "list", "ruleset"])
            .output()
            .expect("nft list ruleset");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

/// A network namespace, deleted on drop.
struct Namespace(String);

impl Namespace {
    fn add(name: &str) -> Self {
        let out = Command::new("ip")
            .args(["netns", "add", name])
            .output()
            .expect("ip netns add");
        assert!(
            out.status.success(),
            "ip netns add {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Self(name.to_owned())
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
    }
}

/// No extra headers, for [`http`].
#[allow(dead_code)]
pub const NO_HEADERS: &[(&str, &str)] = &[];

/// One HTTP/1.1 request on a fresh connection (hyper's client):
/// `headers` as given, `body` with its `Content-Length`. The status, the
/// reply headers and the body. Panics when the exchange fails or takes
/// longer than 30 s.
#[allow(dead_code)]
pub async fn http<K: AsRef<str>, V: AsRef<str>>(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(K, V)],
    body: Option<&str>,
) -> (u16, http::HeaderMap, String) {
    let exchange = async {
        let stream = TcpStream::connect(addr).await.expect("connect");
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .expect("handshake");
        tokio::spawn(conn);
        let mut req = http::Request::builder()
            .method(method)
            .uri(path)
            .header("host", addr.to_string());
        for (k, v) in headers {
            req = req.header(k.as_ref(), v.as_ref());
        }
        let body = Bytes::from(body.unwrap_or("").to_owned());
        let req = req.body(Full::new(body)).expect("request");
        let resp = sender.send_request(req).await.expect("response");
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .expect("reply body")
            .to_bytes();
        (
            status,
            headers,
            String::from_utf8_lossy(&bytes).into_owned(),
        )
    };
    tokio::time::timeout(Duration::from_secs(30), exchange)
        .await
        .expect("an answer within 30 s")
}

/// Parses a JSON body, panicking with the body on failure.
#[allow(dead_code)]
pub fn json(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body:?}"))
}
