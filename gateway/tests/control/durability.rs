//! Durable state under a push storm: the gateway process is killed (SIGKILL)
//! at random points while pushers run; after each restart every
//! acknowledged push is there (or a later version of the same sandbox that
//! was durable but not yet acknowledged), and nothing is half-applied.
//! Also: concurrent pushes share commits, and a streamed NDJSON resync
//! larger than the body cap applies atomically.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::support::*;

/// A gateway process, killed (by its PID) when the test lets go of it,
/// however the test ends.
struct Running(std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The gateway binary on `admin`, state in `state`; ready once `/readyz` answers.
async fn spawn(dir: &std::path::Path, admin: SocketAddr) -> Running {
    let cfg = dir.join("gw.toml");
    std::fs::write(
        &cfg,
        format!(
            "state_dir = \"{}\"\n[listen]\ntransparent = \"127.0.0.1:0\"\ndns = \"127.0.0.1:0\"\ndns_alt = \"127.0.0.1:0\"\nadmin = \"{admin}\"\n[log]\nflow_log = \"off\"\n",
            dir.join("state").display()
        ),
    )
    .expect("config");
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_egress-gateway"))
        .args(["run", "--config"])
        .arg(&cfg)
        .stderr(std::fs::File::create(dir.join("gw.log")).expect("log"))
        .spawn()
        .expect("start");
    let child = Running(child);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ready(admin).await {
        assert!(
            Instant::now() < deadline,
            "not ready: {}",
            std::fs::read_to_string(dir.join("gw.log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    child
}

/// Whether the admin listener answers `/readyz` with 200 (no panic while it is down).
async fn ready(admin: SocketAddr) -> bool {
    if tokio::net::TcpStream::connect(admin).await.is_err() {
        return false;
    }
    http(admin, "GET", "/readyz", None, None).await.0 == 200
}

/// A push that may meet a dead gateway: `None` then.
async fn try_push(admin: SocketAddr, id: &str, doc: &str) -> Option<u16> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(admin).await.ok()?;
    let req = format!(
        "PUT /v1/sandboxes/{id} HTTP/1.1\r\nHost: admin\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{doc}",
        doc.len()
    );
    s.write_all(req.as_bytes()).await.ok()?;
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out))
        .await
        .ok()?
        .ok()?;
    std::str::from_utf8(out.get(9..12)?).ok()?.parse().ok()
}

fn free_admin() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
}

/// The policy of version `v`: its allow list names the version.
fn versioned(addr: &str, v: u64) -> String {
    format!(
        r#"{{"addresses": ["{addr}"], "policy": {{"allow": [{{"domain": "v{v}.example.test"}}]}}}}"#
    )
}

fn version_of(doc: &Value) -> Option<u64> {
    doc["policy"]["allow"][0]["domain"]
        .as_str()?
        .strip_prefix('v')?
        .split('.')
        .next()?
        .parse()
        .ok()
}

#[tokio::test]
async fn every_acknowledged_push_survives_a_kill_at_random_points() {
    let dir = tempfile::tempdir().expect("dir");
    let admin = free_admin();
    // Highest acknowledged version per sandbox, across every round.
    let acked: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
    let mut version = 0u64;
    for round in 0..4u64 {
        let child = spawn(dir.path(), admin).await;
        // Recovered: every acknowledged push is there, at its version or later.
        let (_, body) = http(admin, "GET", "/v1/sandboxes", None, None).await;
        let list: Value = serde_json::from_str(&body).expect("json");
        let got: HashMap<String, u64> = list["sandboxes"]
            .as_array()
            .expect("list")
            .iter()
            .map(|s| {
                (
                    s["id"].as_str().unwrap_or_default().to_owned(),
                    version_of(s).expect("a whole policy"),
                )
            })
            .collect();
        for (id, v) in acked.lock().expect("lock").iter() {
            let have = got.get(id).copied();
            assert!(
                have.is_some_and(|h| h >= *v),
                "round {round}: {id} acknowledged at v{v}, recovered {have:?}"
            );
        }
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut pushers = Vec::new();
        for p in 0..8u64 {
            let (acked, stop) = (acked.clone(), stop.clone());
            let base = version + p * 1_000_000;
            pushers.push(tokio::spawn(async move {
                let mut v = base;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    v += 1;
                    let slot = v % 20;
                    let id = format!("p{p}-{slot}");
                    let addr = format!("100.64.{p}.{}", slot + 1);
                    match try_push(admin, &id, &versioned(&addr, v)).await {
                        Some(200) => {
                            let mut a = acked.lock().expect("lock");
                            let e = a.entry(id).or_insert(0);
                            *e = (*e).max(v);
                        }
                        Some(_) => {}
                        None => return, // the gateway is gone
                    }
                }
            }));
        }
        // Kill at a point that differs per round.
        tokio::time::sleep(Duration::from_millis(150 + 97 * round)).await;
        drop(child); // SIGKILL
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for p in pushers {
            let _ = p.await;
        }
        version += 10_000_000;
    }
    assert!(
        acked.lock().expect("lock").len() >= 20,
        "the storm pushed something"
    );
}

#[tokio::test]
async fn a_streamed_resync_beyond_the_body_cap_applies_at_once() {
    let dir = tempfile::tempdir().expect("dir");
    let gw = start(config(dir.path(), ""), echo().await).await;
    let a = gw.bound().admin;
    // About 3 MiB of sandboxes: over the 1 MiB cap of a JSON body.
    let big = (0..40)
        .map(|i| format!(r#"{{"domain": "allowed-{i}.example.test"}}"#))
        .collect::<Vec<_>>()
        .join(",");
    let mut ndjson = String::new();
    for i in 0..1_500u32 {
        ndjson.push_str(&format!(
            r#"{{"id": "sb-{i}", "addresses": ["100.{}.{}.{}"], "policy": {{"allow": [{big}]}}}}"#,
            64 + i / 65_536,
            (i / 256) % 256,
            i % 256
        ));
        ndjson.push('\n');
    }
    assert!(ndjson.len() > 2 << 20);
    let (status, body) = http_typed(
        a,
        "PUT",
        "/v1/sandboxes",
        "application/x-ndjson",
        ndjson.clone(),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(gw.registry().len(), 1_500);
    // The same as plain JSON is refused by the cap.
    let (status, _) = http_typed(
        a,
        "PUT",
        "/v1/sandboxes",
        "application/json",
        format!(
            "{{\"sandboxes\": [{}]}}",
            ndjson.trim_end().replace('\n', ",")
        ),
    )
    .await;
    assert_eq!(status, 413);
    // A bad line names itself and changes nothing.
    let (status, body) = http_typed(
        a,
        "PUT",
        "/v1/sandboxes",
        "application/x-ndjson",
        "{\"id\": \"x\", \"addresses\": [], \"policy\": {}}\nnot json\n".into(),
    )
    .await;
    assert_eq!(status, 400);
    assert!(body.contains("line 2"), "{body}");
    assert_eq!(gw.registry().len(), 1_500);
    // The generation moved, and the gateway reports it.
    let (_, ready) = http(a, "GET", "/readyz", None, None).await;
    assert!(ready.contains("generation=1"), "{ready}");
}

#[tokio::test]
async fn concurrent_pushes_all_land_and_share_commits() {
    let dir = tempfile::tempdir().expect("dir");
    let gw = start(config(dir.path(), ""), echo().await).await;
    let a = gw.bound().admin;
    let mut tasks = Vec::new();
    for i in 0..200u32 {
        tasks.push(tokio::spawn(async move {
            let doc = format!(
                r#"{{"addresses": ["100.65.{}.{}"], "policy": {{"default": "allow"}}}}"#,
                i / 256,
                i % 256
            );
            http(a, "PUT", &format!("/v1/sandboxes/c-{i}"), None, Some(&doc))
                .await
                .0
        }));
    }
    for t in tasks {
        assert_eq!(t.await.expect("task"), 200);
    }
    let (_, body) = http(a, "GET", "/v1/sandboxes", None, None).await;
    let v: Value = serde_json::from_str(&body).expect("json");
    assert_eq!(v["generation"], json!(200), "one sequence number per push");
    assert_eq!(gw.registry().len(), 200);
}
