//! Pushes, resync after a gateway restart, a gateway that is down, shard
//! takeover between dispatcher processes, and configuration checks at start.

use std::net::SocketAddr;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use sqlx::Connection;

use crate::db;
use crate::support::*;

async fn create(api: &ApiProcess) -> (String, String) {
    let (s, v) = call(
        api.addr,
        "POST",
        "/v1/sandboxes",
        Some(FEDERATED),
        &[],
        Some(json!({"template": "base"})),
    )
    .await;
    assert_eq!(s, 202, "{v}");
    (
        v["sandbox"].as_str().expect("id").to_owned(),
        v["operation"].as_str().expect("op").to_owned(),
    )
}

#[tokio::test]
async fn a_restarted_gateway_is_resynced_without_waiting_for_a_change() {
    let url = db!();
    let admin = format!("127.0.0.1:{}", free_port());
    let dir = tempfile::tempdir().expect("dir");
    let gw = gateway(dir.path(), &admin).await;
    let d = deployment(None, None);
    let api = api(&url, d.clone()).await;
    setup(
        &api,
        json!({"default": "allow"}),
        gw.bound().admin,
        "100.64.10.0/24",
    )
    .await;
    let _dispatcher = dispatcher(&url, d, limits(5, 60_000, 100)).await;
    let (id, op) = create(&api).await;
    settled(&api, FEDERATED, &op).await;
    on_gateway(&gw, &id).await;
    // The gateway restarts with its state lost (a new disk, say).
    assert_eq!(gw.run_until(async {}).await, 0);
    let fresh = tempfile::tempdir().expect("dir");
    let gw = gateway(fresh.path(), &admin).await;
    assert!(gw
        .registry()
        .get(&egress_policy::SandboxId::new(&id))
        .is_none());
    let back = on_gateway(&gw, &id).await;
    assert_eq!(
        back["addresses"],
        json!(["100.64.10.1"]),
        "resynced: {back}"
    );
}

/// A gateway that is down: its admin port closes every connection
/// unanswered, and counts them.
async fn down_gateway() -> (SocketAddr, Arc<AtomicUsize>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    let contacted = Arc::new(AtomicUsize::new(0));
    let count = contacted.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            drop(s);
        }
    });
    (addr, contacted)
}

/// A create, answered; the bound only turns a create that waits on the
/// gateway (which never comes back) into a failure instead of a hang.
async fn answered_create(api: &ApiProcess) -> String {
    tokio::time::timeout(Duration::from_secs(60), create(api))
        .await
        .expect("a create answered while the gateway is down")
        .1
}

/// Polls the dispatcher's metrics until `want` holds (a generous bound
/// turns "never" into a failure).
async fn metrics_until(d: &DispatcherTask, what: &str, want: impl Fn(&str) -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let text = d.metrics.encode();
        if want(&text) {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "never {what}: {text}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn push_lag(metrics: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("egress_controller_push_lag_seconds "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(0.0)
}

/// Ordered, not timed: creates are answered before any dispatcher runs
/// (so the API cannot be waiting on a push) and the gateway is not
/// contacted; then again once the dispatcher has failed to push. The lag
/// is waited for until it passes a second.
#[tokio::test]
async fn a_gateway_that_is_down_never_blocks_the_api_and_its_lag_shows() {
    let url = db!();
    let d = deployment(None, None);
    let api = api(&url, d.clone()).await;
    let (down, contacted) = down_gateway().await;
    setup(&api, json!({"default": "allow"}), down, "100.64.10.0/24").await;
    let mut ops = Vec::new();
    for _ in 0..3 {
        ops.push(answered_create(&api).await);
    }
    assert_eq!(
        contacted.load(Ordering::SeqCst),
        0,
        "the API itself contacted the gateway"
    );
    let dispatcher = dispatcher(&url, d, limits(5, 60_000, 100)).await;
    metrics_until(&dispatcher, "a failed push", |t| {
        t.contains(r#"egress_controller_pushes_total{outcome="failed"}"#)
    })
    .await;
    assert!(
        contacted.load(Ordering::SeqCst) > 0,
        "pushed to the gateway"
    );
    for _ in 0..2 {
        ops.push(answered_create(&api).await);
    }
    for op in &ops {
        assert_eq!(
            settled(&api, FEDERATED, op).await["state"],
            json!("succeeded")
        );
    }
    metrics_until(&dispatcher, "a push lag of a second", |t| {
        push_lag(t) >= 1.0
    })
    .await;
}

async fn wait_for(log: &std::path::Path, needle: &str) {
    for _ in 0..600 {
        if std::fs::read_to_string(log).is_ok_and(|t| t.contains(needle)) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!(
        "{} never said {needle:?}: {}",
        log.display(),
        std::fs::read_to_string(log).unwrap_or_default()
    );
}

/// Operations the dispatcher serving metrics on `addr` has run to success.
async fn succeeded_by(addr: SocketAddr) -> u64 {
    let (status, text) = call(addr, "GET", "/metrics", None, &[], None).await;
    assert_eq!(status, 200, "{text}");
    let text = text.as_str().expect("the metrics text");
    text.lines()
        .find_map(|l| l.strip_prefix(r#"egress_controller_operations_total{outcome="succeeded"} "#))
        .map_or(0, |v| v.trim().parse().expect("a count"))
}

/// Two dispatcher processes share the shards; one is SIGKILLed while they
/// work through 40 operations. Its leases expire and the other takes every
/// shard over; the 10 queued after the kill are run by the survivor, each
/// operation ran exactly once, and every sandbox reached the gateway
/// (whichever of the two held its worker's shard before).
#[tokio::test]
async fn a_dead_dispatchers_shards_are_taken_over_and_no_operation_runs_twice() {
    let url = db!();
    let dir = tempfile::tempdir().expect("dir");
    let gw = gateway(dir.path(), "127.0.0.1:0").await;
    let api = allow_all_api(&url, gw.bound().admin, "100.64.0.0/16").await;
    let a = spawn_dispatcher(&url, dir.path(), "a", free_addr(), &[]);
    wait_for(&a.log, "shards rebalanced").await;
    let metrics_b = free_addr();
    let b = spawn_dispatcher(&url, dir.path(), "b", metrics_b, &[]);
    holders_until(&url, "two dispatchers share the shards", |h| h.len() == 2).await;
    let mut ops = Vec::new();
    let mut sandboxes = Vec::new();
    for _ in 0..40 {
        let (sandbox, op) = create(&api).await;
        sandboxes.push(sandbox);
        ops.push(op);
    }
    settled(&api, FEDERATED, &ops[3]).await;
    drop(a); // SIGKILL one of them
    holders_until(&url, "the survivor holds every shard", |h| {
        h.len() == 1 && h.values().sum::<i64>() == 64
    })
    .await;
    let before = succeeded_by(metrics_b).await;
    for _ in 0..10 {
        let (sandbox, op) = create(&api).await;
        sandboxes.push(sandbox);
        ops.push(op);
    }
    for op in &ops {
        assert_eq!(
            settled(&api, FEDERATED, op).await["state"],
            json!("succeeded"),
            "{op}"
        );
    }
    let by_b = succeeded_by(metrics_b).await;
    assert!(
        by_b >= before + 10,
        "the survivor ran {by_b} (had {before}): want the 10 after the kill"
    );
    assert_executed_once(&url, 50).await;
    for s in &sandboxes {
        on_gateway(&gw, s).await;
    }
    drop(b);
}

/// Polls the live leases (holder → shards) until `want` holds (≤ 20 s).
async fn holders_until(
    url: &str,
    what: &str,
    want: impl Fn(&std::collections::BTreeMap<String, i64>) -> bool,
) {
    let mut conn = sqlx::PgConnection::connect(url).await.expect("db");
    let mut last = Default::default();
    for _ in 0..400 {
        let rows: Vec<(String, i64)> = sqlx::query_as(
            "SELECT holder, count(*) FROM dispatcher_shards WHERE holder IS NOT NULL AND expires > now() GROUP BY holder",
        )
        .fetch_all(&mut conn)
        .await
        .expect("leases");
        last = rows.into_iter().collect();
        if want(&last) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("never: {what} (leases: {last:?})");
}

/// Every one of the `n` operations succeeded on its first attempt, and each
/// sandbox got its own address at generation 1.
async fn assert_executed_once(url: &str, n: i64) {
    let mut conn = sqlx::PgConnection::connect(url).await.expect("db");
    let once: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM operations WHERE state = 'succeeded' AND attempts = 1",
    )
    .fetch_one(&mut conn)
    .await
    .expect("count");
    let generations: i64 =
        sqlx::query_scalar("SELECT count(*) FROM sandboxes WHERE generation <> 1")
            .fetch_one(&mut conn)
            .await
            .expect("count");
    let distinct: i64 = sqlx::query_scalar("SELECT count(DISTINCT addresses) FROM sandboxes")
        .fetch_one(&mut conn)
        .await
        .expect("count");
    assert_eq!(
        (once, generations, distinct),
        (n, 0, n),
        "each operation executed exactly once"
    );
}

#[tokio::test]
async fn invalid_configuration_stops_both_roles_and_a_standby_before_it_leads() {
    let url = db!();
    let dir = tempfile::tempdir().expect("dir");
    let tenants = tenants_file(dir.path());
    let bad_profiles = r#"{"Sensor": {"allow": [{"ip": "198.51.100.1"}]}}"#;
    let bad_exemptions = r#"[{"cidr": "198.51.100.0/24"}]"#;
    for (role, var, value, needle) in [
        ("api", "SPACE_EGRESS_PROFILES", bad_profiles, "Sensor"),
        (
            "dispatcher",
            "SPACE_EGRESS_PROFILES",
            bad_profiles,
            "Sensor",
        ),
        (
            "api",
            "SPACE_TLS_INTERCEPTION_EXEMPTIONS",
            bad_exemptions,
            "SPACE_TLS_INTERCEPTION_EXEMPTIONS",
        ),
        (
            "dispatcher",
            "SPACE_TLS_INTERCEPTION_EXEMPTIONS",
            "[]",
            "empty",
        ),
    ] {
        let out = Command::new(BIN)
            .args([role, "--tenants"])
            .arg(&tenants)
            .env("DATABASE_URL", &url)
            .env(var, value)
            .output()
            .expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{role} with {var}={value} started");
        assert!(err.contains(var) && err.contains(needle), "{role}: {err}");
    }
    // A leader holds the lock; a standby with bad configuration still refuses to start.
    let leader = spawn_dispatcher(&url, dir.path(), "leader", free_addr(), &[]);
    wait_for(&leader.log, "leading").await;
    let standby = Command::new(BIN)
        .args(["dispatcher", "--tenants"])
        .arg(&tenants)
        .env("DATABASE_URL", &url)
        .env("SPACE_EGRESS_PROFILES", bad_profiles)
        .output()
        .expect("run");
    assert!(!standby.status.success());
    assert!(String::from_utf8_lossy(&standby.stderr).contains("Sensor"));
    drop(leader);
    // The tenants file is checked too, naming the field.
    std::fs::write(
        &tenants,
        r#"{"tokens": {"0123456789abcdef": {"tenant": "t", "admim": true}}}"#,
    )
    .expect("write");
    let out = Command::new(BIN)
        .args(["api", "--tenants"])
        .arg(&tenants)
        .env("DATABASE_URL", &url)
        .output()
        .expect("run");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("admim"));
}
