//! Durable state under a push storm: the gateway process is killed (SIGKILL)
//! at random points while pushers run; after each restart — the last one
//! too — every acknowledged push is there (or a later version of the same
//! sandbox that was durable but not yet acknowledged), and nothing is
//! half-applied. Also: concurrent pushes share commits, and a streamed NDJSON
//! resync larger than the body cap applies atomically.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
        "PUT /v1/sandboxes/{id} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{doc}",
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

/// An admin address for a gateway process: kept across its restarts, so
/// not one the kernel could hand an outgoing connection meanwhile.
fn free_admin() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], egress_testkit::spare_port()))
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

/// Highest acknowledged version per sandbox, across every round.
type Acked = Arc<Mutex<HashMap<String, u64>>>;

/// Every acknowledged push is in the state the gateway on `admin` recovered,
/// at its version or later; every recovered policy is whole.
async fn assert_recovered(admin: SocketAddr, acked: &Acked, when: &str) {
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
            "{when}: {id} acknowledged at v{v}, recovered {have:?}"
        );
    }
}

/// Eight pushers, each over its own 20 sandboxes with rising versions from
/// `version`, until `stop` or the gateway is gone; `acks` counts acknowledgements.
fn pushers(
    admin: SocketAddr,
    version: u64,
    acked: &Acked,
    acks: &Arc<AtomicU64>,
    stop: &Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..8u64)
        .map(|p| {
            let (acked, acks, stop) = (acked.clone(), acks.clone(), stop.clone());
            let mut v = version + p * 1_000_000;
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    v += 1;
                    let slot = v % 20;
                    let id = format!("p{p}-{slot}");
                    let addr = format!("100.64.{p}.{}", slot + 1);
                    match try_push(admin, &id, &versioned(&addr, v)).await {
                        Some(200) => {
                            let mut a = acked.lock().expect("lock");
                            let e = a.entry(id).or_insert(0);
                            *e = (*e).max(v);
                            acks.fetch_add(1, Ordering::SeqCst);
                        }
                        Some(_) => {}
                        None => return, // the gateway is gone
                    }
                }
            })
        })
        .collect()
}

/// The kill points' seed: `EGRESS_KILL_SEED` to repeat a run, else new each run.
fn kill_seed() -> u64 {
    std::env::var("EGRESS_KILL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            now.as_secs() ^ u64::from(now.subsec_nanos()) ^ u64::from(std::process::id())
        })
}

/// splitmix64: the next number of the sequence `state` is at.
fn next_random(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Each round kills the gateway after a seeded random number of acknowledged
/// pushes (1 to 400), with pushes in flight; the seed is printed, and
/// `EGRESS_KILL_SEED` repeats it. Counted in acknowledgements rather than
/// time, a kill point is the same amount of work however loaded the machine.
#[tokio::test]
async fn every_acknowledged_push_survives_a_kill_at_random_points() {
    let seed = kill_seed();
    eprintln!("kill points from seed {seed} (EGRESS_KILL_SEED={seed} repeats them)");
    let mut random = seed;
    let dir = tempfile::tempdir().expect("dir");
    let admin = free_admin();
    let acked: Acked = Arc::default();
    let mut version = 0u64;
    for round in 0..4u64 {
        let child = spawn(dir.path(), admin).await;
        assert_recovered(admin, &acked, &format!("seed {seed}, round {round}")).await;
        let kill_after = 1 + next_random(&mut random) % 400;
        let (acks, stop) = (
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let running = pushers(admin, version, &acked, &acks, &stop);
        let deadline = Instant::now() + Duration::from_secs(60);
        while acks.load(Ordering::SeqCst) < kill_after {
            assert!(
                Instant::now() < deadline,
                "seed {seed}, round {round}: {} of {kill_after} pushes acknowledged",
                acks.load(Ordering::SeqCst)
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        drop(child); // SIGKILL
        stop.store(true, Ordering::Relaxed);
        for p in running {
            let _ = p.await;
        }
        eprintln!("round {round}: killed after {kill_after} acknowledged pushes");
        version += 10_000_000;
    }
    // The last round's acknowledgements, after one more restart.
    let _child = spawn(dir.path(), admin).await;
    assert_recovered(admin, &acked, &format!("seed {seed}, after the last round")).await;
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
    // So does a repeated id or a bad address, found once the lines are read
    // (blank lines skipped: the third document is on line 5).
    let sandbox = |id: &str, addr: &str| {
        format!("{{\"id\": \"{id}\", \"addresses\": [{addr}], \"policy\": {{}}}}\n")
    };
    for (third, field, why) in [
        (
            sandbox("x", ""),
            "sandboxes[2].id",
            "line 5: sandbox \"x\" appears twice",
        ),
        (
            sandbox("z", "\"0.0.0.0\""),
            "sandboxes[2].addresses",
            "line 5: 0.0.0.0",
        ),
    ] {
        let ndjson = format!("{}\n{}\n{third}", sandbox("x", ""), sandbox("y", ""));
        let (status, body) =
            http_typed(a, "PUT", "/v1/sandboxes", "application/x-ndjson", ndjson).await;
        assert_eq!(
            (status, json(&body)["field"].clone()),
            (400, json!(field)),
            "{body}"
        );
        assert!(
            json(&body)["error"]
                .as_str()
                .is_some_and(|e| e.starts_with(why)),
            "{body}"
        );
    }
    assert_eq!(gw.registry().len(), 1_500);
    // The generation moved, and the gateway reports it.
    let (_, ready) = http(a, "GET", "/readyz", None, None).await;
    assert!(ready.contains("generation=1"), "{ready}");
}

/// The write system calls and bytes of the gateway `pid`'s commit thread
/// (`egress-commit`) so far, from the kernel's per-thread I/O accounting.
fn commit_thread_writes(pid: u32) -> (u64, u64) {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the gateway's threads");
    let commit = tasks
        .filter_map(Result::ok)
        .find(|t| {
            std::fs::read_to_string(t.path().join("comm"))
                .is_ok_and(|c| c.trim() == "egress-commit")
        })
        .expect("the commit thread");
    let io = std::fs::read_to_string(commit.path().join("io")).expect("its I/O accounting");
    let field = |name: &str| -> u64 {
        io.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or_else(|| panic!("{name} in {io}"))
    };
    (field("syscw:"), field("wchar:"))
}

/// The commits the gateway made between two readings of
/// [`commit_thread_writes`], while the journal grew by `journal_bytes`.
///
/// The commit thread writes the journal, one `write` per commit (a group
/// commit's records go out in one buffer, then one fsync), and nothing else
/// but the wake-ups of the tasks it answers: 8 bytes each to the runtime's
/// eventfd. So the bytes beyond the journal's growth are wake-ups, and the
/// other writes are commits. (Compaction, which writes a snapshot, waits for
/// a journal of 4 MiB.)
fn commits_between(before: (u64, u64), after: (u64, u64), journal_bytes: u64) -> u64 {
    let (writes, bytes) = (after.0 - before.0, after.1 - before.1);
    let wake_bytes = bytes - journal_bytes;
    assert_eq!(
        wake_bytes % 8,
        0,
        "{bytes} bytes written, {journal_bytes} to the journal"
    );
    writes - wake_bytes / 8
}

/// 200 pushes at once, to a gateway process of its own (so its commit
/// thread is the only one of its name): every one lands with its own
/// sequence number, in fewer commits than pushes.
#[tokio::test]
async fn concurrent_pushes_all_land_and_share_commits() {
    const PUSHES: u32 = 200;
    let dir = tempfile::tempdir().expect("dir");
    let a = free_admin();
    let child = spawn(dir.path(), a).await;
    let journal = dir.path().join("state").join("journal.log");
    let size = |p: &std::path::Path| std::fs::metadata(p).map_or(0, |m| m.len());
    let (journal_before, writes_before) = (size(&journal), commit_thread_writes(child.0.id()));
    let mut tasks = Vec::new();
    for i in 0..PUSHES {
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
    let commits = commits_between(
        writes_before,
        commit_thread_writes(child.0.id()),
        size(&journal) - journal_before,
    );
    let (_, body) = http(a, "GET", "/v1/sandboxes", None, None).await;
    let v: Value = serde_json::from_str(&body).expect("json");
    assert_eq!(
        v["generation"],
        json!(PUSHES),
        "one sequence number per push"
    );
    assert_eq!(v["sandboxes"].as_array().map(Vec::len), Some(200));
    eprintln!("{PUSHES} pushes in {commits} commits");
    assert!(
        (1..u64::from(PUSHES)).contains(&commits),
        "{PUSHES} concurrent pushes made {commits} commits: none shared one"
    );
}
