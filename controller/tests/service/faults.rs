//! Faults that lose nothing (docs/reliability.md, "The controller under
//! faults"): PostgreSQL restarted mid-queue, a gateway that stalls or is cut
//! off while creates continue. Each test prints its figures.

use std::net::SocketAddr;
use std::process::Command;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use sqlx::Connection;

use crate::support::*;

// === a PostgreSQL cluster of the test's own ===

/// A throwaway cluster on a port of its own (made by `.ci/pg.sh`), so the
/// test can stop and start it; removed when dropped.
struct OwnCluster {
    dir: String,
    port: u16,
    bindir: String,
}

impl OwnCluster {
    /// `None` (skipped) where the shared test cluster is not configured.
    fn start() -> Option<Self> {
        if std::env::var("DATABASE_URL").is_err() {
            egress_testkit::skip("the PostgreSQL restart test", "DATABASE_URL is not set");
            return None;
        }
        let port = egress_testkit::spare_port();
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../.ci/pg.sh");
        let out = Command::new(script)
            .arg("start")
            .env("PGPORT_TEST", port.to_string())
            .output()
            .expect("run .ci/pg.sh");
        assert!(
            out.status.success(),
            "pg.sh: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let dir = text
            .lines()
            .find_map(|l| l.strip_prefix("export EGRESS_PG_DIR="))
            .expect("EGRESS_PG_DIR")
            .to_owned();
        let bindir = std::fs::read_dir("/usr/lib/postgresql")
            .expect("PostgreSQL is installed")
            .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
            .max()
            .expect("a PostgreSQL version")
            .display()
            .to_string();
        Some(Self { dir, port, bindir })
    }

    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// `pg_ctl` with `args`, as the `postgres` user when running as root.
    fn pg_ctl(&self, args: &str) {
        let line = format!("'{}/pg_ctl' -D '{}/data' {args}", self.bindir, self.dir);
        let root = std::env::var("USER").is_ok_and(|u| u == "root")
            || Command::new("id")
                .arg("-u")
                .output()
                .is_ok_and(|o| o.stdout.starts_with(b"0"));
        let status = if root {
            Command::new("su")
                .args(["postgres", "-s", "/bin/sh", "-c", &line])
                .status()
        } else {
            Command::new("sh").args(["-c", &line]).status()
        };
        assert!(status.is_ok_and(|s| s.success()), "pg_ctl {args}");
    }

    fn stop(&self) {
        self.pg_ctl("-m fast -w stop");
    }

    fn restart(&self) {
        self.pg_ctl(&format!(
            "-l '{dir}/server.log' -w -t 60 -o \"-c listen_addresses=127.0.0.1 -p {port} -k '{dir}' -c max_connections=400 -c fsync=off\" start",
            dir = self.dir,
            port = self.port
        ));
    }
}

impl Drop for OwnCluster {
    fn drop(&mut self) {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../.ci/pg.sh");
        let _ = Command::new(script).args(["stop", &self.dir]).status();
    }
}

/// One request: the status, `Retry-After`, and the JSON body.
async fn call_with_retry_after(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<Value>,
) -> (u16, Option<String>, Value) {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .expect("http");
    tokio::spawn(conn);
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "api")
        .header("authorization", format!("Bearer {FEDERATED}"));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let bytes = body.map(|b| b.to_string()).unwrap_or_default();
    let resp = sender
        .send_request(req.body(Full::new(Bytes::from(bytes))).expect("request"))
        .await
        .expect("answer");
    let status = resp.status().as_u16();
    let retry = resp
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let bytes = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .expect("body")
        .to_bytes();
    (
        status,
        retry,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

async fn keyed_create(api: &ApiProcess, key: &str, worker: &str) -> (u16, Option<String>, Value) {
    call_with_retry_after(
        api.addr,
        "POST",
        "/v1/sandboxes",
        &[("Idempotency-Key", key)],
        Some(json!({"template": "base", "worker": worker})),
    )
    .await
}

/// Each of the `n` sandboxes was placed once (generation 1, an address of
/// its own) by an operation that succeeded.
async fn assert_placed_once(url: &str, n: i64) {
    let mut conn = sqlx::PgConnection::connect(url).await.expect("db");
    let row: (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM operations WHERE state = 'succeeded'), \
         (SELECT count(*) FROM sandboxes WHERE generation <> 1), \
         (SELECT count(DISTINCT addresses) FROM sandboxes)",
    )
    .fetch_one(&mut conn)
    .await
    .expect("counts");
    assert_eq!(row, (n, 0, n), "every operation ran, and exactly once");
}

/// Ordered, not timed: 120 creates are queued before a dispatcher runs;
/// PostgreSQL is stopped (fast shutdown: sessions are cut) once the
/// dispatcher has run a few, so it dies mid-queue. While it is down the API
/// answers 503 with `Retry-After`; a create refused then is retried with
/// its key after the restart. Nothing is lost or run twice.
#[tokio::test]
async fn postgresql_restarted_mid_queue_loses_no_operation_and_runs_none_twice() {
    let Some(cluster) = OwnCluster::start() else {
        return;
    };
    let url = cluster.url();
    let dir = tempfile::tempdir().expect("dir");
    let gw = gateway(dir.path(), "127.0.0.1:0").await;
    let api = allow_all_api(&url, gw.bound().admin, "100.64.0.0/16").await;
    let n = 120;
    let mut ops = Vec::new();
    for i in 0..n {
        let (s, _, v) = keyed_create(&api, &format!("k{i}"), "w1").await;
        assert_eq!(s, 202, "{v}");
        ops.push(v);
    }
    let d = dispatcher(&url, deployment(None, None), limits(20, 600_000, 100)).await;
    settled(&api, FEDERATED, ops[3]["operation"].as_str().expect("op")).await;
    let stopped = Instant::now();
    cluster.stop();
    let (s, retry, v) = keyed_create(&api, "during", "w1").await;
    assert_eq!(
        (s, retry.as_deref()),
        (503, Some("1")),
        "a create while the database is down: {v}"
    );
    let path = format!(
        "/v1/operations/{}",
        ops[n - 1]["operation"].as_str().expect("op")
    );
    let (s, retry, _) = call_with_retry_after(api.addr, "GET", &path, &[], None).await;
    assert_eq!((s, retry.as_deref()), (503, Some("1")));
    cluster.restart();
    let outage = stopped.elapsed();
    let restarted = Instant::now();
    let mut during = Value::Null;
    for _ in 0..600 {
        let (s, _, v) = keyed_create(&api, "during", "w1").await;
        if s == 202 {
            during = v;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let first_202 = restarted.elapsed();
    ops.push(during);
    let (s, _, replay) = keyed_create(&api, "k0", "w1").await;
    assert_eq!(
        (s, &replay),
        (202, &ops[0]),
        "a key queued before the restart replays"
    );
    for v in &ops {
        let op = settled(&api, FEDERATED, v["operation"].as_str().expect("op")).await;
        assert_eq!(op["state"], json!("succeeded"), "{op}");
        on_gateway(&gw, v["sandbox"].as_str().expect("id")).await;
    }
    let drained = restarted.elapsed();
    assert_placed_once(&url, n as i64 + 1).await;
    println!(
        "FIGURES postgresql restart: {n} queued, stopped after the 4th ran; down {outage:.1?}; \
         first 202 {first_202:.1?} after the restart; all {} enforced {drained:.1?} after it",
        n + 1
    );
    drop(d);
}

// === a gateway that stalls or is cut off ===

/// What a [`Front`] does with a connection.
const FORWARD: u8 = 0;
const STALL: u8 = 1;
const CUT: u8 = 2;

/// A loopback front for a gateway's admin API: forwards connections, or
/// holds them without an answer (stall), or closes them at once (cut).
struct Front {
    addr: SocketAddr,
    /// Every address it listens on (`addr` first): one gateway is one
    /// worker's, so workers that share a front are given one each.
    addrs: Vec<SocketAddr>,
    mode: Arc<AtomicU8>,
    /// Stalled connections the client gave up on (closed).
    given_up: Arc<AtomicUsize>,
    /// Connections accepted while stalled.
    held: Arc<AtomicUsize>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Front {
    fn drop(&mut self) {
        self.tasks.iter().for_each(|t| t.abort());
    }
}

async fn front(upstream: SocketAddr, mode: u8) -> Front {
    fronts(upstream, mode, 1).await
}

/// A [`front`] listening on `n` ports at once.
async fn fronts(upstream: SocketAddr, mode: u8, n: usize) -> Front {
    let mode = Arc::new(AtomicU8::new(mode));
    let (given_up, held) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (mut addrs, mut tasks) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        addrs.push(l.local_addr().expect("addr"));
        let (m, g, h) = (mode.clone(), given_up.clone(), held.clone());
        tasks.push(tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                match m.load(Ordering::SeqCst) {
                    STALL => {
                        h.fetch_add(1, Ordering::SeqCst);
                        tokio::spawn(hold(s, g.clone()));
                    }
                    CUT => drop(s),
                    _ => {
                        tokio::spawn(forward(s, upstream));
                    }
                }
            }
        }));
    }
    Front {
        addr: addrs[0],
        addrs,
        mode,
        given_up,
        held,
        tasks,
    }
}

/// Reads and never answers, until the client closes.
async fn hold(mut s: tokio::net::TcpStream, given_up: Arc<AtomicUsize>) {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 4096];
    while let Ok(n) = s.read(&mut buf).await {
        if n == 0 {
            break;
        }
    }
    given_up.fetch_add(1, Ordering::SeqCst);
}

async fn forward(mut s: tokio::net::TcpStream, upstream: SocketAddr) {
    if let Ok(mut u) = tokio::net::TcpStream::connect(upstream).await {
        let _ = tokio::io::copy_bidirectional(&mut s, &mut u).await;
    }
}

async fn register_worker(api: &ApiProcess, id: &str, admin: SocketAddr, pool: &str) {
    let (s, v) = call(
        api.addr,
        "PUT",
        &format!("/v1/workers/{id}"),
        Some(ADMIN),
        &[],
        Some(json!({"admin_url": format!("http://{admin}"), "token": "", "pool": pool})),
    )
    .await;
    assert_eq!(s, 200, "{v}");
}

async fn create_on(api: &ApiProcess, worker: &str) -> String {
    let (s, v) = call(
        api.addr,
        "POST",
        "/v1/sandboxes",
        Some(FEDERATED),
        &[],
        Some(json!({"template": "base", "worker": worker})),
    )
    .await;
    assert_eq!(s, 202, "{v}");
    v["sandbox"].as_str().expect("id").to_owned()
}

/// Ordered, not timed: worker w2's gateway sits behind a front that
/// accepts and never answers. Once the dispatcher is stuck on it, creates
/// on w1 are enforced on w1's gateway, every one of them while the stuck
/// push is still outstanding (the front has seen no client give up: a
/// dispatcher that pushed worker by worker would wait for it to time out
/// first). Then the front forwards again and w2's sandboxes arrive too.
#[tokio::test]
async fn a_stalled_gateway_does_not_hold_up_pushes_to_the_others() {
    let url = crate::db!();
    let dir = tempfile::tempdir().expect("dir");
    let (d1, d2) = (dir.path().join("g1"), dir.path().join("g2"));
    std::fs::create_dir_all(&d1).expect("dir");
    std::fs::create_dir_all(&d2).expect("dir");
    let gw1 = gateway(&d1, "127.0.0.1:0").await;
    let gw2 = gateway(&d2, "127.0.0.1:0").await;
    let slow = front(gw2.bound().admin, STALL).await;
    let api = allow_all_api(&url, gw1.bound().admin, "100.64.1.0/24").await;
    register_worker(&api, "w2", slow.addr, "100.64.2.0/24").await;
    let stuck: Vec<String> = [create_on(&api, "w2").await, create_on(&api, "w2").await].into();
    let d = dispatcher(&url, deployment(None, None), limits(5, 600_000, 100)).await;
    for _ in 0..2400 {
        if slow.held.load(Ordering::SeqCst) > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(
        slow.held.load(Ordering::SeqCst) > 0,
        "the dispatcher never reached w2"
    );
    let mut slowest = Duration::ZERO;
    for _ in 0..5 {
        let started = Instant::now();
        let id = create_on(&api, "w1").await;
        on_gateway(&gw1, &id).await;
        slowest = slowest.max(started.elapsed());
    }
    assert_eq!(
        slow.given_up.load(Ordering::SeqCst),
        0,
        "w1's creates were all enforced while the push to w2 was still held"
    );
    slow.mode.store(FORWARD, Ordering::SeqCst);
    let released = Instant::now();
    for id in &stuck {
        on_gateway(&gw2, id).await;
    }
    println!(
        "FIGURES stalled gateway: 5 creates on another worker enforced in at most {slowest:.0?} each \
         while the stalled push was held; w2 caught up {:.1?} after the stall ended (its held push \
         times out after 5 s first)",
        released.elapsed()
    );
    drop(d);
}

/// Ordered, not timed: 100 workers' gateways sit behind one front that
/// accepts and never answers (a lost zone). Once each has been tried and
/// timed out (the first try of each holds one of the permits for the
/// client's 5 s, as any gateway's would), creates on w1 are enforced on its gateway while the silent
/// ones give up fewer tries than the dispatcher has permits: the silent
/// gateways are tried under permits of their own, after a backoff, so they
/// never take those of the gateways that answer. (Before: the first create
/// waited behind every silent gateway's try, each 5 s, and its trust in
/// the leases it was read under ran out while it waited.)
#[tokio::test]
async fn silent_gateways_do_not_take_the_permits_of_those_that_answer() {
    let url = crate::db!();
    let dir = tempfile::tempdir().expect("dir");
    let gw1 = gateway(dir.path(), "127.0.0.1:0").await;
    let silent = fronts(gw1.bound().admin, STALL, 100).await;
    let api = allow_all_api(&url, gw1.bound().admin, "100.64.1.0/24").await;
    for (i, addr) in silent.addrs.iter().enumerate() {
        let pool = format!("100.80.{i}.0/24");
        register_worker(&api, &format!("lost{i}"), *addr, &pool).await;
    }
    let d = dispatcher(&url, deployment(None, None), limits(5, 600_000, 100)).await;
    for _ in 0..2400 {
        if silent.given_up.load(Ordering::SeqCst) >= 100 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let before = silent.given_up.load(Ordering::SeqCst);
    assert!(
        before >= 100,
        "the silent gateways' first tries never timed out"
    );
    for _ in 0..5 {
        let id = create_on(&api, "w1").await;
        on_gateway(&gw1, &id).await;
    }
    let during = silent.given_up.load(Ordering::SeqCst) - before;
    assert!(
        during < 64,
        "{during} tries of silent gateways gave up while w1's creates waited"
    );
    println!(
        "FIGURES silent gateways: 5 creates on w1 enforced while {during} tries of 100 silent gateways gave up"
    );
    drop(d);
}

/// A network policy replacement of sandbox `id`: allow only `domain`.
async fn replace(api: &ApiProcess, id: &str, domain: &str) {
    let policy = json!({"default": "deny", "allow": [{"domain": domain}]});
    let (s, v) = call(
        api.addr,
        "PUT",
        &format!("/v1/sandboxes/{id}/network"),
        Some(FEDERATED),
        &[],
        Some(json!({"policy": policy})),
    )
    .await;
    assert_eq!(s, 200, "{v}");
}

/// The domain a sandbox's policy on the gateway allows, if it is there.
fn allowed_on(gw: &egress_gateway::Gateway, id: &str) -> Option<Value> {
    let s = gw.registry().get(&egress_policy::SandboxId::new(id))?;
    let policy = serde_json::to_value(s.policy.policy()).ok()?;
    Some(policy["allow"][0]["domain"].clone())
}

/// The gateway is cut off (its admin port closes every connection) for
/// `EGRESS_CUT_SECONDS` (30) while creates, replacements and a destroy
/// continue; once the cut heals, the gateway holds exactly the store's
/// latest state: every new sandbox, each replacement's last version, and
/// not the destroyed one.
#[tokio::test]
async fn a_gateway_cut_off_for_30_s_gets_every_change_in_order_once_it_heals() {
    let url = crate::db!();
    let cut_for = std::env::var("EGRESS_CUT_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(Duration::from_secs(30), Duration::from_secs);
    let dir = tempfile::tempdir().expect("dir");
    let gw = gateway(dir.path(), "127.0.0.1:0").await;
    let link = front(gw.bound().admin, FORWARD).await;
    let api = allow_all_api(&url, link.addr, "100.64.0.0/16").await;
    let d = dispatcher(&url, deployment(None, None), limits(5, 600_000, 100)).await;
    let (kept, gone) = (create_on(&api, "w1").await, create_on(&api, "w1").await);
    on_gateway(&gw, &kept).await;
    on_gateway(&gw, &gone).await;

    link.mode.store(CUT, Ordering::SeqCst);
    let cut = Instant::now();
    let (mut created, mut last) = (Vec::new(), String::new());
    let mut i = 0;
    while cut.elapsed() < cut_for {
        created.push(create_on(&api, "w1").await);
        last = format!("v{i}.example.test");
        replace(&api, &kept, &last).await;
        if i == 3 {
            let (s, v) = call(
                api.addr,
                "DELETE",
                &format!("/v1/sandboxes/{gone}"),
                Some(FEDERATED),
                &[],
                None,
            )
            .await;
            assert_eq!(s, 200, "{v}");
        }
        i += 1;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(
        allowed_on(&gw, &created[0]).is_none(),
        "nothing reached the gateway during the cut"
    );
    link.mode.store(FORWARD, Ordering::SeqCst);
    let healed = Instant::now();
    for _ in 0..600 {
        let all = created.iter().all(|id| allowed_on(&gw, id).is_some());
        let latest = allowed_on(&gw, &kept) == Some(json!(last));
        let forgotten = allowed_on(&gw, &gone).is_none();
        if all && latest && forgotten {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let caught_up = healed.elapsed();
    for id in &created {
        on_gateway(&gw, id).await;
    }
    assert_eq!(
        allowed_on(&gw, &kept),
        Some(json!(last)),
        "the last replacement wins"
    );
    assert!(
        allowed_on(&gw, &gone).is_none(),
        "the destroyed sandbox is forgotten"
    );
    let mut conn = sqlx::PgConnection::connect(&url).await.expect("db");
    let mut unpushed: i64 = -1;
    for _ in 0..600 {
        unpushed = sqlx::query_scalar(
            "SELECT count(*) FROM sandboxes WHERE pushed_generation <> generation",
        )
        .fetch_one(&mut conn)
        .await
        .expect("count");
        if unpushed == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(unpushed, 0, "every generation acknowledged");
    println!(
        "FIGURES gateway cut: cut {:.0?}; meanwhile {} creates, {i} replacements, 1 destroy; \
         all enforced {caught_up:.1?} after the cut healed",
        cut_for,
        created.len()
    );
    drop(d);
}

// === dispatcher processes ===

/// The index of the process whose dispatcher holds worker `w1`'s shard
/// now (≤ 60 s: a bound that only turns "never" into a failure on a
/// loaded machine). A dispatcher logs its id when it starts.
async fn pusher(url: &str, ps: &[DispatcherProcess]) -> usize {
    let mut conn = sqlx::PgConnection::connect(url).await.expect("db");
    for _ in 0..1200 {
        let holder: Option<String> = sqlx::query_scalar(
            "SELECT holder FROM dispatcher_shards WHERE shard = egress_worker_shard('w1') AND expires > now()",
        )
        .fetch_optional(&mut conn)
        .await
        .expect("the shard's holder")
        .flatten();
        // The id is random per process: its text alone picks the log.
        let logged = |p: &DispatcherProcess| {
            let log = std::fs::read_to_string(&p.log).unwrap_or_default();
            holder.as_deref().is_some_and(|id| log.contains(id))
        };
        if let Some(i) = (0..ps.len()).find(|&i| logged(&ps[i])) {
            return i;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let holders: Vec<(Option<String>, i64, i64)> = sqlx::query_as(
        "SELECT holder, count(*), count(*) FILTER (WHERE expires > now()) FROM dispatcher_shards GROUP BY holder ORDER BY holder",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap_or_default();
    let alive: Vec<(String, bool)> =
        sqlx::query_as("SELECT id, expires > now() FROM dispatchers ORDER BY id")
            .fetch_all(&mut conn)
            .await
            .unwrap_or_default();
    let tails: Vec<String> = ps
        .iter()
        .map(|p| {
            let log = std::fs::read_to_string(&p.log).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            lines[lines.len().saturating_sub(15)..].join("\n")
        })
        .collect();
    panic!(
        "no dispatcher holds w1's shard; shards by holder (all, unexpired): {holders:?}; dispatchers (id, alive): {alive:?}; the logs' tails:\n{}",
        tails.join("\n----\n")
    );
}

/// Ordered, not timed: three dispatcher processes; the gateway's front
/// holds every push, so the dispatcher holding the worker's shard is
/// SIGKILLed with its pushes in flight. Another takes the shard over once
/// the lease (3 s) expires, the front forwards again, and every sandbox is
/// on the gateway, each placed by one operation run exactly once.
#[tokio::test]
async fn a_dispatcher_sigkilled_mid_push_with_two_others_running_has_exactly_once_effects() {
    let url = crate::db!();
    let dir = tempfile::tempdir().expect("dir");
    let gw = gateway(dir.path(), "127.0.0.1:0").await;
    let link = front(gw.bound().admin, STALL).await;
    let api = allow_all_api(&url, link.addr, "100.64.0.0/16").await;
    let mut ids = Vec::new();
    for _ in 0..30 {
        ids.push(create_on(&api, "w1").await);
    }
    let mut ps: Vec<DispatcherProcess> = ["a", "b", "c"]
        .iter()
        .map(|n| {
            spawn_dispatcher(
                &url,
                dir.path(),
                n,
                free_addr(),
                &["--resync-interval", "200ms"],
            )
        })
        .collect();
    for _ in 0..2400 {
        if link.held.load(Ordering::SeqCst) > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(
        link.held.load(Ordering::SeqCst) > 0,
        "the leader never pushed"
    );
    let first = pusher(&url, &ps).await;
    let killed = Instant::now();
    drop(ps.remove(first)); // SIGKILL, pushes in flight
    let second = pusher(&url, &ps).await;
    link.mode.store(FORWARD, Ordering::SeqCst);
    for id in &ids {
        on_gateway(&gw, id).await;
    }
    let recovered = killed.elapsed();
    assert_placed_once(&url, ids.len() as i64).await;
    assert_eq!(
        pusher(&url, &ps).await,
        second,
        "one dispatcher holds the shard"
    );
    println!(
        "FIGURES dispatcher SIGKILL: 3 dispatchers, 30 creates; the shard's holder killed with {} pushes held; \
         all on the gateway {recovered:.1?} after the kill",
        link.held.load(Ordering::SeqCst)
    );
}
