//! Dispatchers at fleet scale (docs/controller.md, "The dispatcher"): the
//! workers split among dispatchers by shard leases, addresses allocated
//! without a scan, drift found by generation, and pruning.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use sqlx::Connection;

use crate::db;
use crate::fake_gateway::{Event, FakeGateway};
use crate::support::*;

const BIN: &str = env!("CARGO_BIN_EXE_egress-controller");

async fn put(api: &ApiProcess, path: &str, body: Value) {
    let (s, v) = call(api.addr, "PUT", path, Some(ADMIN), &[], Some(body)).await;
    assert_eq!(s, 200, "{path}: {v}");
}

async fn register(api: &ApiProcess, id: &str, gw: &FakeGateway, pool: &str) {
    let body = json!({"admin_url": format!("http://{}", gw.addr), "token": "", "pool": pool});
    put(api, &format!("/v1/workers/{id}"), body).await;
}

/// Polls `sql` (one bigint) until `want` holds (≤ 20 s).
async fn db_until(url: &str, sql: &str, want: impl Fn(i64) -> bool) -> i64 {
    let mut conn = sqlx::PgConnection::connect(url).await.expect("db");
    let mut last = 0;
    for _ in 0..400 {
        last = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .fetch_one(&mut conn)
            .await
            .expect("query");
        if want(last) {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("never held: {sql} (last {last})");
}

/// The holder of the shard of worker `id` (a live lease).
async fn holder(url: &str, id: &str) -> Option<String> {
    let mut conn = sqlx::PgConnection::connect(url).await.expect("db");
    sqlx::query_scalar(
        "SELECT holder FROM dispatcher_shards WHERE shard = egress_worker_shard($1) AND expires > now()",
    )
    .bind(id)
    .fetch_one(&mut conn)
    .await
    .expect("holder")
}

/// A metric's value in a dispatcher's text exposition (0 when absent).
fn metric(d: &DispatcherTask, line_prefix: &str) -> f64 {
    d.metrics
        .encode()
        .lines()
        .find_map(|l| l.strip_prefix(line_prefix))
        .map_or(0.0, |v| v.trim().parse().unwrap_or(0.0))
}

/// Worker ids (`w0`, `w1`, …) whose shards `a` and `b` hold: two each.
async fn workers_of(url: &str, a: &str, b: &str) -> Vec<(String, String)> {
    let mut picked = Vec::new();
    let mut per = BTreeMap::<String, usize>::new();
    for i in 0..200 {
        let id = format!("w{i}");
        if let Some(h) = holder(url, &id).await.filter(|h| h == a || h == b) {
            let n = per.entry(h.clone()).or_default();
            if *n < 2 {
                *n += 1;
                picked.push((id, h));
            }
        }
        if picked.len() == 4 {
            return picked;
        }
    }
    panic!("no two workers for each of {a} and {b}: {picked:?}");
}

/// The version `vN` a pushed policy allows (`vN.example.test`).
fn version(doc: &Value) -> u32 {
    let text = doc["policy"].to_string();
    let at = text.find(".example.test").expect("a versioned policy");
    let start = text[..at].rfind('v').expect("v");
    text[start + 1..at].parse().expect("a version")
}

/// Two dispatchers split the workers: each executes the creates that name
/// the workers of its shards and pushes to them, and every change of every
/// sandbox reaches its gateway once, in order (versions strictly rising, no
/// repeats), with no resync beyond the first.
#[tokio::test]
async fn two_dispatchers_split_the_workers_and_push_each_change_once_in_order() {
    let url = db!();
    let api = api(&url, deployment(None, None)).await;
    put(
        &api,
        "/v1/templates/base",
        json!({"policy": {"default": "allow"}}),
    )
    .await;
    let da = dispatcher(&url, deployment(None, None), limits(5, 60_000, 100)).await;
    let db = dispatcher(&url, deployment(None, None), limits(5, 60_000, 100)).await;
    let live = "SELECT count(DISTINCT holder) * 100 + count(*) FROM dispatcher_shards WHERE expires > now()";
    db_until(&url, live, |v| v == 264).await;
    let mut conn = sqlx::PgConnection::connect(&url).await.expect("db");
    let holders: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT holder FROM dispatcher_shards WHERE expires > now() ORDER BY holder",
    )
    .fetch_all(&mut conn)
    .await
    .expect("holders");
    let workers = workers_of(&url, &holders[0], &holders[1]).await;
    let mut gateways = Vec::new();
    for (i, (id, _)) in workers.iter().enumerate() {
        let gw = FakeGateway::start().await;
        register(&api, id, &gw, &format!("100.64.{i}.0/24")).await;
        gateways.push(gw);
    }
    let mut sandboxes: Vec<(usize, String)> = Vec::new();
    for (i, (id, _)) in workers.iter().enumerate() {
        for _ in 0..5 {
            let body = json!({"template": "base", "worker": id,
                "policy": {"default": "deny", "allow": [{"domain": "v0.example.test"}]}});
            let (s, v) = call(
                api.addr,
                "POST",
                "/v1/sandboxes",
                Some(FEDERATED),
                &[],
                Some(body),
            )
            .await;
            assert_eq!(s, 202, "{v}");
            let op = v["operation"].as_str().expect("op").to_owned();
            assert_eq!(
                settled(&api, FEDERATED, &op).await["state"],
                json!("succeeded")
            );
            sandboxes.push((i, v["sandbox"].as_str().expect("id").to_owned()));
        }
    }
    for n in 1..=3 {
        for (_, id) in &sandboxes {
            let policy =
                json!({"default": "deny", "allow": [{"domain": format!("v{n}.example.test")}]});
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
    }
    db_until(
        &url,
        "SELECT count(*) FROM sandboxes WHERE generation > pushed_generation",
        |n| n == 0,
    )
    .await;
    for (i, gw) in gateways.iter().enumerate() {
        let events = gw.events();
        let resyncs = events
            .iter()
            .filter(|e| matches!(e, Event::Resync(_)))
            .count();
        assert_eq!(resyncs, 1, "worker {i}: {events:?}");
        let mut seen: BTreeMap<String, Vec<u32>> = BTreeMap::new();
        for e in &events {
            if let Event::Put(id, doc) = e {
                seen.entry(id.clone()).or_default().push(version(doc));
            }
        }
        let mine: BTreeSet<&String> = sandboxes
            .iter()
            .filter(|(w, _)| *w == i)
            .map(|(_, s)| s)
            .collect();
        assert_eq!(seen.keys().collect::<BTreeSet<_>>(), mine, "worker {i}");
        for (id, versions) in &seen {
            assert!(
                versions.windows(2).all(|w| w[0] < w[1]),
                "{id}: {versions:?}"
            );
            assert_eq!(versions.last(), Some(&3), "{id}: {versions:?}");
        }
    }
    // Each ran the creates of its own workers: ten each.
    let ok = r#"egress_controller_operations_total{outcome="succeeded"} "#;
    assert_eq!((metric(&da, ok), metric(&db, ok)), (10.0, 10.0));
    let once: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM operations WHERE state = 'succeeded' AND attempts = 1",
    )
    .fetch_one(&mut conn)
    .await
    .expect("count");
    assert_eq!(once, 20);
}

/// Creates `n` sandboxes through the E2B route and waits until their
/// gateway has every change.
async fn created_and_pushed(api: std::net::SocketAddr, url: &str, n: usize) {
    for _ in 0..n {
        let (s, v) = e2b_create(api).await;
        assert_eq!(s, 201, "{v}");
    }
    let pending = "SELECT count(*) FROM sandboxes WHERE generation > pushed_generation";
    db_until(url, pending, |n| n == 0).await;
}

/// Destroys sandbox `id` through the API: the status and the answer.
async fn destroy(api: std::net::SocketAddr, id: &str) -> (u16, Value) {
    let path = format!("/v1/sandboxes/{id}");
    call(api, "DELETE", &path, Some(FEDERATED), &[], None).await
}

async fn e2b_create(api: std::net::SocketAddr) -> (u16, Value) {
    call(
        api,
        "POST",
        "/sandboxes",
        Some(FEDERATED),
        &[],
        Some(json!({"templateID": "base"})),
    )
    .await
}

async fn address(api: &ApiProcess, id: &str) -> String {
    let (s, v) = call(
        api.addr,
        "GET",
        &format!("/v1/sandboxes/{id}"),
        Some(FEDERATED),
        &[],
        None,
    )
    .await;
    assert_eq!(s, 200, "{v}");
    v["addresses"][0].as_str().expect("an address").to_owned()
}

/// 30 concurrent creates on a pool of 30 hosts get 30 distinct addresses;
/// a 31st finds none; five destroyed, five concurrent creates get exactly
/// the five released addresses.
#[tokio::test]
async fn allocation_never_hands_an_address_twice_and_reuses_freed_ones() {
    let url = db!();
    let gw = FakeGateway::start().await;
    let api = allow_all_api(&url, gw.addr, "100.64.20.0/27").await;
    let _d = dispatcher(&url, deployment(None, None), limits(5, 60_000, 100)).await;
    let created = futures_all((0..30).map(|_| e2b_create(api.addr))).await;
    let mut ids = Vec::new();
    for (s, v) in created {
        assert_eq!(s, 201, "{v}");
        ids.push(v["sandboxID"].as_str().expect("id").to_owned());
    }
    let mut held = BTreeSet::new();
    for id in &ids {
        assert!(
            held.insert(address(&api, id).await),
            "an address handed out twice"
        );
    }
    let pool: ipnet::IpNet = "100.64.20.0/27".parse().expect("pool");
    let hosts: BTreeSet<String> = pool.hosts().map(|a| a.to_string()).collect();
    assert_eq!(held, hosts, "every host of the pool, once");
    let (s, v) = e2b_create(api.addr).await;
    assert_eq!(s, 503, "a full pool: {v}");
    let mut freed = BTreeSet::new();
    for id in &ids[..5] {
        freed.insert(address(&api, id).await);
        let (s, v) = destroy(api.addr, id).await;
        assert_eq!(s, 200, "{v}");
    }
    // Handed out again once the gateway has forgotten them.
    db_until(&url, UNFORGOTTEN, |n| n == 0).await;
    let again = futures_all((0..5).map(|_| e2b_create(api.addr))).await;
    let mut reused = BTreeSet::new();
    for (s, v) in again {
        assert_eq!(s, 201, "{v}");
        reused.insert(address(&api, v["sandboxID"].as_str().expect("id")).await);
    }
    assert_eq!(reused, freed, "the released addresses, each once");
}

/// Ended sandboxes whose forget no gateway has taken yet.
const UNFORGOTTEN: &str = "SELECT count(*) FROM sandboxes WHERE state IN ('destroyed', 'failed') AND generation > pushed_generation";

/// A destroyed sandbox's address is not handed out while its gateway has
/// not forgotten it: the gateway would judge the new sandbox's traffic
/// under the old one's policy. Once the forget lands, it is.
#[tokio::test]
async fn an_address_waits_for_its_gateway_to_forget_its_last_holder() {
    let url = db!();
    let gw = FakeGateway::start().await;
    let api = allow_all_api(&url, gw.addr, "100.64.21.0/30").await;
    let _d = dispatcher(&url, deployment(None, None), limits(5, 60_000, 100)).await;
    let (s, v) = e2b_create(api.addr).await;
    assert_eq!(s, 201, "{v}");
    let first = v["sandboxID"].as_str().expect("id").to_owned();
    let held = address(&api, &first).await;
    gw.state.lock().expect("state").refuse_deletes = true;
    let (s, v) = destroy(api.addr, &first).await;
    assert_eq!(s, 200, "{v}");
    db_until(
        &url,
        "SELECT count(*) FROM sandboxes WHERE state = 'destroyed'",
        |n| n == 1,
    )
    .await;
    let (s, v) = e2b_create(api.addr).await;
    assert_eq!(s, 201, "{v}");
    let second = address(&api, v["sandboxID"].as_str().expect("id")).await;
    assert_ne!(second, held, "the other host of the pool");
    let (s, v) = e2b_create(api.addr).await;
    assert_eq!(s, 503, "the gateway still holds {held}: {v}");

    gw.state.lock().expect("state").refuse_deletes = false;
    db_until(&url, UNFORGOTTEN, |n| n == 0).await;
    let (s, v) = e2b_create(api.addr).await;
    assert_eq!(s, 201, "{v}");
    assert_eq!(
        address(&api, v["sandboxID"].as_str().expect("id")).await,
        held
    );
}

/// A dispatcher whose lease of a worker's shard lapsed during a slow call
/// records nothing of what that call saw: another may hold the shard and
/// have pushed since, and an acknowledgement of the late call's generation
/// would hide from it that the gateway moved.
#[tokio::test]
async fn a_dispatcher_without_the_lease_records_nothing_of_the_gateway() {
    use egress_controller::store;
    let url = db!();
    let gw = FakeGateway::start().await;
    let _api = allow_all_api(&url, gw.addr, "100.64.23.0/24").await;
    let pool = sqlx::PgPool::connect(&url).await.expect("pool");
    let seen = || async {
        sqlx::query_as::<_, (Option<i64>, Option<String>)>(
            "SELECT acked_generation, epoch FROM workers WHERE id = 'w1'",
        )
        .fetch_one(&pool)
        .await
        .expect("worker")
    };
    let term = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT handovers FROM dispatcher_shards WHERE shard = egress_worker_shard('w1')",
        )
        .fetch_one(&pool)
        .await
        .expect("term")
    };
    let record = |generation: i64, term: i64| {
        let pool = pool.clone();
        async move {
            let (g, e) = (Some(generation), format!("e-{generation}"));
            let lease = store::Lease {
                holder: "d-late".into(),
                term,
            };
            store::acknowledge(&pool, "w1", g, 0, Some(&lease))
                .await
                .expect("ack");
            let read = store::worker(&pool, "w1").await.expect("read").expect("w1");
            let w = store::WorkerRow {
                lease: Some(lease),
                ..read
            };
            store::worker_seen(&pool, &w, (Some(&e), Some(false), None))
                .await
                .expect("seen");
        }
    };
    let lease = |expires: &'static str| {
        let pool = pool.clone();
        async move {
            let sql = format!("UPDATE dispatcher_shards SET holder = 'd-late', expires = {expires}, handovers = handovers + 1 WHERE shard = egress_worker_shard('w1')");
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .execute(&pool)
                .await
                .expect("lease");
        }
    };
    let before = seen().await;
    record(41, term().await).await;
    assert_eq!(seen().await, before, "a shard nobody holds");
    lease("now() + interval '1 minute'").await;
    let first = term().await;
    record(42, first).await;
    assert_eq!(seen().await, (Some(42), Some("e-42".to_owned())), "held");
    lease("now() - interval '1 second'").await;
    record(43, first).await;
    assert_eq!(seen().await, (Some(42), Some("e-42".to_owned())), "lapsed");
    // Taken again (another term): what was read under the first records nothing.
    lease("now() + interval '1 minute'").await;
    record(44, first).await;
    assert_eq!(
        seen().await,
        (Some(42), Some("e-42".to_owned())),
        "an old term"
    );
    record(45, term().await).await;
    assert_eq!(
        seen().await,
        (Some(45), Some("e-45".to_owned())),
        "this term"
    );
}

/// A resync clears its worker's flag only if the worker was not
/// registered again since the row it resynced from was read: a
/// registration during the resync (its gateway moved, say) keeps the flag
/// raised for the next round, which resyncs the gateway as registered now.
#[tokio::test]
async fn a_registration_during_a_resync_keeps_the_worker_flagged() {
    use egress_controller::store;
    let url = db!();
    let gw = FakeGateway::start().await;
    let _api = allow_all_api(&url, gw.addr, "100.64.24.0/24").await;
    let pool = sqlx::PgPool::connect(&url).await.expect("pool");
    let admin = format!("http://{}", gw.addr);
    let register = || store::put_worker(&pool, "w1", &admin, "", "100.64.24.0/24");
    let flag = || async {
        let row = store::worker(&pool, "w1").await.expect("read");
        row.expect("w1").needs_resync
    };
    let resynced = (None, Some(false), None);
    register().await.expect("put").expect("registered");
    let read = store::worker(&pool, "w1").await.expect("read").expect("w1");
    store::worker_seen(&pool, &read, resynced)
        .await
        .expect("seen");
    assert!(!flag().await, "a resync of the row as registered clears it");
    // Read, registered again, then the resync of what was read ends.
    let read = store::worker(&pool, "w1").await.expect("read").expect("w1");
    register().await.expect("put").expect("registered again");
    store::worker_seen(&pool, &read, resynced)
        .await
        .expect("seen");
    assert!(flag().await, "registered during the resync: still flagged");
    // A failure or a push records no flag and keeps the raised one.
    store::worker_seen(&pool, &read, (None, None, Some("x")))
        .await
        .expect("seen");
    assert!(flag().await, "kept by a push's record");
    let read = store::worker(&pool, "w1").await.expect("read").expect("w1");
    store::worker_seen(&pool, &read, resynced)
        .await
        .expect("seen");
    assert!(
        !flag().await,
        "the next resync, of the row as registered now"
    );
    // A registration by an earlier build (a replica not yet upgraded),
    // which does not count itself, moving the gateway: counted all the same.
    let read = store::worker(&pool, "w1").await.expect("read").expect("w1");
    let earlier = "INSERT INTO workers (id, admin_url, token, pool) VALUES ('w1', 'http://127.0.0.1:9', '', '100.64.24.0/24') ON CONFLICT (id) DO UPDATE SET admin_url = EXCLUDED.admin_url, token = EXCLUDED.token, pool = EXCLUDED.pool, needs_resync = true, updated_at = now()";
    sqlx::query(earlier)
        .execute(&pool)
        .await
        .expect("an earlier build's registration");
    store::worker_seen(&pool, &read, resynced)
        .await
        .expect("seen");
    assert!(flag().await, "moved by an earlier build: still flagged");
    // This build's registration moving it back counts once, not twice.
    let before = store::worker(&pool, "w1").await.expect("read").expect("w1");
    register().await.expect("put").expect("moved back");
    let after = store::worker(&pool, "w1").await.expect("read").expect("w1");
    assert_eq!(after.registrations, before.registrations + 1);
}

/// The resyncs the fake gateway was sent.
fn resyncs(gw: &FakeGateway) -> usize {
    gw.events()
        .iter()
        .filter(|e| matches!(e, Event::Resync(_)))
        .count()
}

/// The lists the fake gateway was asked for.
fn lists(gw: &FakeGateway) -> usize {
    gw.events().iter().filter(|e| **e == Event::List).count()
}

/// Runs the futures concurrently on this task's runtime.
async fn futures_all<F: std::future::Future<Output = T> + Send + 'static, T: Send + 'static>(
    futures: impl Iterator<Item = F>,
) -> Vec<T> {
    let tasks: Vec<_> = futures.map(tokio::spawn).collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("task"));
    }
    out
}

/// A gateway that refuses pushes with a huge answer: the error the store
/// keeps for the worker (and the dispatcher logs) holds at most 512 bytes
/// of it, cut with `…`.
#[tokio::test]
async fn a_refused_push_keeps_a_bounded_part_of_the_gateways_answer() {
    let url = db!();
    let gw = FakeGateway::start().await;
    let huge = json!({"error": "x".repeat(100_000)}).to_string();
    gw.state.lock().expect("state").refuse = Some((400, huge));
    let api = allow_all_api(&url, gw.addr, "100.64.31.0/24").await;
    let d = dispatcher(&url, deployment(None, None), limits(5, 60_000, 100)).await;
    let (s, v) = e2b_create(api.addr).await;
    assert_eq!(s, 201, "{v}");
    let sql = "SELECT COALESCE(length(last_error), 0)::bigint FROM workers WHERE id = 'w1'";
    let chars = db_until(&url, sql, |n| n > 0).await;
    let mut conn = sqlx::PgConnection::connect(&url).await.expect("db");
    let error: String = sqlx::query_scalar("SELECT last_error FROM workers WHERE id = 'w1'")
        .fetch_one(&mut conn)
        .await
        .expect("last_error");
    let prefix = "400 Bad Request: {\"error\":\"xxx";
    assert!(error.starts_with(prefix), "{error}");
    assert!(error.ends_with("xxx…"), "{error}");
    assert_eq!(
        error.len(),
        "400 Bad Request: ".len() + 512 + '…'.len_utf8()
    );
    assert_eq!(chars, i64::try_from(error.chars().count()).expect("count"));
    drop(d);
}

/// With the gateway in step, its generation is all that is compared: no
/// list is fetched. A generation moved behind the store's back has the
/// list fetched (in step: acknowledged, no resync); a sandbox the store
/// does not know is drift: one resync, and it is gone.
#[tokio::test]
async fn drift_is_looked_for_by_generation_and_lists_compared_only_on_mismatch() {
    let url = db!();
    let api = api(&url, deployment(None, None)).await;
    put(
        &api,
        "/v1/templates/base",
        json!({"policy": {"default": "allow"}}),
    )
    .await;
    let gw = FakeGateway::start().await;
    // A pool of addresses no sandbox can hold is refused, naming it.
    for (pool, needle) in [
        (
            "fe80::/64",
            "pool: fe80::/64 overlaps fe80::/10 (fe80::: link-local",
        ),
        (
            "169.254.0.0/16",
            "overlaps 169.254.0.0/16 (169.254.0.0: link-local",
        ),
        ("169.0.0.0/8", "pool: 169.0.0.0/8 overlaps 169.254.0.0/16"),
        (
            "0.0.0.0/0",
            "pool: 0.0.0.0/0 overlaps 0.0.0.0/32 (0.0.0.0: no source address",
        ),
        // The gateway reads a mapped address as IPv4.
        (
            "::ffff:169.254.0.0/112",
            "overlaps ::ffff:169.254.0.0/112 (::ffff:169.254.0.0: link-local",
        ),
    ] {
        let body = json!({"admin_url": format!("http://{}", gw.addr), "token": "", "pool": pool});
        let (s, v) = call(
            api.addr,
            "PUT",
            "/v1/workers/w0",
            Some(ADMIN),
            &[],
            Some(body),
        )
        .await;
        assert_eq!(s, 400, "{pool}: {v}");
        assert!(v.to_string().contains(needle), "{pool}: {v}");
    }
    register(&api, "w1", &gw, "100.64.30.0/24").await;
    let d = dispatcher(&url, deployment(None, None), limits(5, 60_000, 100)).await;
    created_and_pushed(api.addr, &url, 3).await;
    let in_step = r#"egress_controller_gateway_checks_total{outcome="generation"} "#;
    let listed = r#"egress_controller_gateway_checks_total{outcome="listed"} "#;
    // Once a check found it in step (on a loaded machine one taken while
    // the creates were pushed may have fetched the list), five more in
    // step fetch nothing.
    let checks = metric(&d, in_step);
    metric_until(&d, in_step, |v| v >= checks + 1.0).await;
    let (lists_before, listed_before) = (lists(&gw), metric(&d, listed));
    let checks = metric(&d, in_step);
    metric_until(&d, in_step, |v| v >= checks + 5.0).await;
    assert_eq!(
        (
            lists(&gw) - lists_before,
            resyncs(&gw),
            metric(&d, listed) - listed_before
        ),
        (0, 1, 0.0),
        "{:?}",
        gw.events()
    );
    // The generation moves, the list does not.
    gw.state.lock().expect("state").generation += 1;
    metric_until(&d, listed, |v| v >= listed_before + 1.0).await;
    let checks = metric(&d, in_step);
    metric_until(&d, in_step, |v| v >= checks + 3.0).await;
    assert_eq!(
        (lists(&gw) - lists_before, resyncs(&gw)),
        (1, 1),
        "{:?}",
        gw.events()
    );
    // A sandbox the store does not know.
    {
        let mut s = gw.state.lock().expect("state");
        s.sandboxes.insert(
            "sb-stray".into(),
            json!({"addresses": ["100.64.30.200"], "policy": {"default": "allow"}}),
        );
        s.generation += 1;
    }
    for _ in 0..400 {
        if resyncs(&gw) == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(resyncs(&gw), 2, "{:?}", gw.events());
    let s = gw.state.lock().expect("state");
    assert!(!s.sandboxes.contains_key("sb-stray"));
    assert_eq!(s.sandboxes.len(), 3);
}

/// A resync is acknowledged at the generation the gateway answers it was
/// committed at, not at the one `/readyz` reports afterwards: another
/// client's push landing between the two is found as drift, and resynced
/// away, instead of being counted in a generation taken as in step. A
/// gateway of an earlier build, whose answer says none, is acknowledged
/// at its `/readyz` generation.
#[tokio::test]
async fn a_push_landing_right_after_a_resync_is_found_as_drift() {
    let url = db!();
    let (api, gw, _d) = worker_behind_a_fake_gateway(&url, "100.64.32.0/24").await;
    created_and_pushed(api.addr, &url, 2).await;
    let first = resyncs(&gw);
    assert!(first >= 1, "{:?}", gw.events());
    gw.state.lock().expect("state").push_after_next_resync = true;
    // Registered again: resynced.
    register(&api, "w1", &gw, "100.64.32.0/24").await;
    let outside = |gw: &FakeGateway| {
        gw.state
            .lock()
            .expect("state")
            .sandboxes
            .contains_key("sb-outside")
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while resyncs(&gw) < first + 2 || outside(&gw) {
        assert!(
            std::time::Instant::now() < deadline,
            "the push after the resync was not found: {:?}",
            gw.events()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(gw.state.lock().expect("state").sandboxes.len(), 2);
    // A gateway of an earlier build says no generation: the one its
    // `/readyz` reports after the resync is acknowledged, so the checks
    // after it find the gateway in step and fetch no list.
    let pool = sqlx::PgPool::connect(&url).await.expect("pool");
    let acked = || async {
        let row = egress_controller::store::worker(&pool, "w1")
            .await
            .expect("read");
        row.expect("w1").acked_generation
    };
    let (before, listed) = (resyncs(&gw), lists(&gw));
    gw.state.lock().expect("state").resync_answers_no_generation = true;
    register(&api, "w1", &gw, "100.64.32.0/24").await;
    let now = || gw.state.lock().expect("state").generation;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while resyncs(&gw) <= before || acked().await != Some(now()) {
        assert!(
            std::time::Instant::now() < deadline,
            "acknowledged {:?}, the gateway at {}",
            acked().await,
            now()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Five check intervals.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(lists(&gw), listed, "{:?}", gw.events());
}

/// A worker whose changes never all settle is still checked for drift:
/// with one sandbox's push failing for good, a sandbox the store does not
/// know found on the gateway is drift all the same, and a resync takes it
/// away (the pending one is compared on neither side).
#[tokio::test]
async fn drift_is_found_while_a_change_of_the_worker_is_still_pending() {
    let url = db!();
    let (api, gw, _d) = worker_behind_a_fake_gateway(&url, "100.64.31.0/24").await;
    created_and_pushed(api.addr, &url, 2).await;
    let before = resyncs(&gw);
    // One sandbox's push fails from now on, and it has a change to push.
    let stuck = {
        let mut s = gw.state.lock().expect("state");
        let id = s.sandboxes.keys().next().expect("a sandbox").clone();
        s.refuse_push_of = Some(id.clone());
        id
    };
    let mut conn = sqlx::PgConnection::connect(&url).await.expect("db");
    sqlx::query("UPDATE sandboxes SET generation = generation + 1 WHERE id = $1")
        .bind(&stuck)
        .execute(&mut conn)
        .await
        .expect("a change");
    let refused_push = |gw: &FakeGateway| {
        gw.events()
            .iter()
            .any(|e| matches!(e, Event::Put(id, Value::Null) if *id == stuck))
    };
    for _ in 0..400 {
        if refused_push(&gw) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(refused_push(&gw), "{:?}", gw.events());
    // Drift behind the store's back.
    {
        let mut s = gw.state.lock().expect("state");
        s.sandboxes.insert(
            "sb-stray".into(),
            json!({"addresses": ["100.64.31.200"], "policy": {"default": "allow"}}),
        );
        s.generation += 1;
    }
    for _ in 0..400 {
        if !gw
            .state
            .lock()
            .expect("state")
            .sandboxes
            .contains_key("sb-stray")
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        resyncs(&gw) > before,
        "no resync while {stuck} was pending: {:?}",
        gw.events()
    );
    assert!(!gw
        .state
        .lock()
        .expect("state")
        .sandboxes
        .contains_key("sb-stray"));
}

/// Pushes the gateway refuses (`409`: past its `limits.max_sandboxes`),
/// more than a read's worth (256) at the front of the worker's queue, do
/// not stop the changes behind them.
#[tokio::test]
async fn refused_pushes_at_the_front_do_not_hold_up_the_rest() {
    let url = db!();
    let (api, gw, _d) = worker_behind_a_fake_gateway(&url, "100.64.32.0/23").await;
    created_and_pushed(api.addr, &url, 300).await;
    let mut ids: Vec<String> = gw
        .state
        .lock()
        .expect("state")
        .sandboxes
        .keys()
        .cloned()
        .collect();
    ids.sort();
    let survivor = ids.pop().expect("a sandbox");
    gw.state.lock().expect("state").conflict_on = ids.iter().cloned().collect();
    let mut conn = sqlx::PgConnection::connect(&url).await.expect("db");
    // The refused ones change first, then the survivor: it is last in line.
    let sql =
        "UPDATE sandboxes SET generation = generation + 1, changed_at = now() WHERE id = ANY($1)";
    sqlx::query(sql)
        .bind(&ids)
        .execute(&mut conn)
        .await
        .expect(sql);
    tokio::time::sleep(Duration::from_millis(20)).await;
    bump_generation(&url, &survivor).await;
    let pushed = format!(
        "SELECT count(*) FROM sandboxes WHERE id = '{survivor}' AND generation > pushed_generation"
    );
    db_until(&url, &pushed, |n| n == 0).await;
    let refused = gw
        .events()
        .iter()
        .filter(|e| matches!(e, Event::Put(id, Value::Null) if ids.contains(id)))
        .count();
    assert!(
        refused >= ids.len(),
        "each refused push was tried: {refused}"
    );
}

/// A push the gateway refuses for good, alone in its worker's queue, is
/// tried twice and then held back for the resync interval (5 s here), not
/// sent again at every round. Before, a short queue never held it: the
/// start of each pass forgot the refusal before.
#[tokio::test]
async fn a_push_refused_for_good_is_not_sent_again_at_every_round() {
    let url = db!();
    let mut l = limits(5, 60_000, 100);
    l.resync_interval = Duration::from_secs(5);
    let (api, gw, _d) = worker_behind_a_fake_gateway_with(&url, "100.64.33.0/24", l).await;
    created_and_pushed(api.addr, &url, 1).await;
    let id = gw.any_sandbox();
    gw.state.lock().expect("state").conflict_on = [id.clone()].into();
    bump_generation(&url, &id).await;
    let refused = |gw: &FakeGateway| {
        gw.events()
            .iter()
            .filter(|e| matches!(e, Event::Put(p, Value::Null) if *p == id))
            .count()
    };
    for _ in 0..400 {
        if refused(&gw) > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(refused(&gw) > 0, "never pushed: {:?}", gw.events());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let tries = refused(&gw);
    println!("FIGURES a push refused for good: {tries} tries in its first 2 s");
    assert!(tries <= 2, "{tries} tries in 2 s");
}

/// Waits (up to 5 s) for the fake gateway's first delete.
async fn deleted_on(gw: &FakeGateway) {
    let deleted = |gw: &FakeGateway| !gw.state.lock().expect("state").delete_queries.is_empty();
    gw.until("delete", deleted).await;
}

/// Moves sandbox `id`'s generation up by one in the store, as a change
/// the gateway must see does.
async fn bump_generation(url: &str, id: &str) {
    let mut conn = sqlx::PgConnection::connect(url).await.expect("db");
    let sql = "UPDATE sandboxes SET generation = generation + 1, changed_at = now() WHERE id = $1";
    sqlx::query(sql)
        .bind(id)
        .execute(&mut conn)
        .await
        .expect(sql);
}

/// A sandbox's generation in the store.
async fn generation_of(url: &str, id: &str) -> i64 {
    let mut conn = sqlx::PgConnection::connect(url).await.expect("db");
    let sql = "SELECT generation FROM sandboxes WHERE id = $1";
    sqlx::query_scalar::<_, i64>(sql)
        .bind(id)
        .fetch_one(&mut conn)
        .await
        .expect(sql)
}

/// Every push names the sandbox's generation as its revision, and a
/// delete names it in its query. A push the gateway refuses as stale (it
/// holds a later revision than the store: a store restored from a backup)
/// has the worker resynced, which sets the store's view on the gateway;
/// another refusal (`409` on no field) does not.
#[tokio::test]
async fn a_push_refused_as_stale_has_its_gateway_resynced() {
    let url = db!();
    let mut l = limits(5, 60_000, 100);
    l.resync_interval = Duration::from_secs(60);
    let (api, gw, _d) = worker_behind_a_fake_gateway_with(&url, "100.64.34.0/24", l).await;
    created_and_pushed(api.addr, &url, 2).await;
    let (id, doc) = {
        let s = gw.state.lock().expect("state");
        let (id, doc) = s.sandboxes.iter().next().expect("one");
        (id.clone(), doc.clone())
    };
    assert_eq!(
        doc["revision"],
        json!(generation_of(&url, &id).await),
        "{doc}"
    );
    // A resync after the push refused.
    let refused_then_resynced = |gw: &FakeGateway| {
        let events = gw.events();
        let refused = events
            .iter()
            .position(|e| matches!(e, Event::Put(p, Value::Null) if *p == id));
        refused.is_some_and(|at| events[at..].iter().any(|e| matches!(e, Event::Resync(_))))
    };
    // A refusal that is not stale: no resync.
    gw.state.lock().expect("state").conflict_on = [id.clone()].into();
    bump_generation(&url, &id).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!refused_then_resynced(&gw), "{:?}", gw.events());
    // Stale: resynced.
    {
        let mut s = gw.state.lock().expect("state");
        s.conflict_on.clear();
        s.stale_on = [id.clone()].into();
        s.events.clear();
    }
    bump_generation(&url, &id).await;
    gw.until("resync after the stale refusal", refused_then_resynced)
        .await;
    let resynced = gw.state.lock().expect("state").sandboxes[&id].clone();
    assert_eq!(
        resynced["revision"],
        json!(generation_of(&url, &id).await),
        "{resynced}"
    );
    // A destroy names its revision.
    gw.state.lock().expect("state").stale_on.clear();
    let other = {
        let s = gw.state.lock().expect("state");
        s.sandboxes
            .keys()
            .find(|k| **k != id)
            .cloned()
            .expect("two")
    };
    let (s, v) = destroy(api.addr, &other).await;
    assert!((200..300).contains(&s), "{s} {v}");
    deleted_on(&gw).await;
    let deleted_at = generation_of(&url, &other).await;
    let queries = gw.state.lock().expect("state").delete_queries.clone();
    assert_eq!(queries, vec![format!("revision={deleted_at}")]);
}

/// A gateway of a build before revisions (its `/readyz` says nothing of
/// them; it refuses a document with the field, as any unknown field) is
/// pushed and resynced without them, and its deletes name none: a
/// controller upgraded before its gateways keeps them in step.
#[tokio::test]
async fn a_gateway_of_a_build_before_revisions_is_sent_none() {
    let url = db!();
    let fake = FakeGateway::start().await;
    fake.state.lock().expect("state").before_revisions = true;
    let (api, gw, _d) = worker_behind_this_fake_gateway(&url, "100.64.35.0/24", fake).await;
    // Its first check resyncs it (a gateway never seen); then a push.
    created_and_pushed(api.addr, &url, 1).await;
    gw.until("first resync", |gw| resyncs(gw) >= 1).await;
    created_and_pushed(api.addr, &url, 1).await;
    let puts: Vec<Value> = gw
        .events()
        .into_iter()
        .filter_map(|e| match e {
            Event::Put(_, doc) => Some(doc),
            _ => None,
        })
        .collect();
    assert!(!puts.is_empty(), "no push: {:?}", gw.events());
    assert!(puts.iter().all(|d| d.get("revision").is_none()), "{puts:?}");
    // A destroy names no revision.
    let first = gw.any_sandbox();
    let (s, v) = destroy(api.addr, &first).await;
    assert_eq!(s, 200, "{v}");
    deleted_on(&gw).await;
    assert_eq!(
        gw.state.lock().expect("state").delete_queries,
        vec![String::new()]
    );
    // It restarts: the resync names none either.
    gw.state.lock().expect("state").epoch = "e-restarted".into();
    gw.until("resync after the restart", |gw| resyncs(gw) >= 2)
        .await;
    let s = gw.state.lock().expect("state");
    assert!(
        !s.events.contains(&Event::RefusedRevision),
        "{:?}",
        s.events
    );
    assert_eq!(s.sandboxes.len(), 1, "{:?}", s.events);
}

/// A resync the gateway refuses (one sandbox it will not take) does not
/// hold up the worker's other changes: they are pushed meanwhile, and the
/// resync is tried again once per interval.
#[tokio::test]
async fn a_refused_resync_does_not_hold_up_the_workers_pushes() {
    let url = db!();
    let (api, gw, _d) = worker_behind_a_fake_gateway(&url, "100.64.32.0/24").await;
    created_and_pushed(api.addr, &url, 1).await;
    let refusals = |gw: &FakeGateway| {
        gw.events()
            .iter()
            .filter(|e| **e == Event::RefusedResync)
            .count()
    };
    // The gateway restarts (another epoch) and will not take a resync.
    {
        let mut s = gw.state.lock().expect("state");
        s.refuse_resyncs = true;
        s.epoch = "restarted".into();
    }
    for _ in 0..400 {
        if refusals(&gw) > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(refusals(&gw) > 0, "{:?}", gw.events());
    let (s, v) = e2b_create(api.addr).await;
    assert_eq!(s, 201, "{v}");
    let id = v["sandboxID"].as_str().expect("an id").to_owned();
    let pushed = |gw: &FakeGateway| {
        gw.events()
            .iter()
            .any(|e| matches!(e, Event::Put(p, _) if *p == id))
    };
    for _ in 0..400 {
        if pushed(&gw) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(pushed(&gw), "{id} never pushed: {:?}", gw.events());
    // Taken once the gateway takes it again.
    gw.state.lock().expect("state").refuse_resyncs = false;
    let taken = |gw: &FakeGateway| {
        gw.events()
            .iter()
            .any(|e| matches!(e, Event::Resync(n) if *n == 2))
    };
    for _ in 0..400 {
        if taken(&gw) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(taken(&gw), "{:?}", gw.events());
}

/// The API with an allow-all template, worker w1 (its addresses from
/// `pool`) behind a fake gateway, and a dispatcher.
async fn worker_behind_a_fake_gateway(
    url: &str,
    pool: &str,
) -> (ApiProcess, FakeGateway, DispatcherTask) {
    worker_behind_a_fake_gateway_with(url, pool, limits(5, 60_000, 100)).await
}

/// [`worker_behind_a_fake_gateway`] with the dispatcher's `limits`.
async fn worker_behind_a_fake_gateway_with(
    url: &str,
    pool: &str,
    limits: egress_controller::dispatcher::Limits,
) -> (ApiProcess, FakeGateway, DispatcherTask) {
    let gw = FakeGateway::start().await;
    worker_behind(url, pool, limits, gw).await
}

/// [`worker_behind_a_fake_gateway`] with a gateway set up before the
/// dispatcher starts.
async fn worker_behind_this_fake_gateway(
    url: &str,
    pool: &str,
    gw: FakeGateway,
) -> (ApiProcess, FakeGateway, DispatcherTask) {
    worker_behind(url, pool, limits(5, 60_000, 100), gw).await
}

async fn worker_behind(
    url: &str,
    pool: &str,
    limits: egress_controller::dispatcher::Limits,
    gw: FakeGateway,
) -> (ApiProcess, FakeGateway, DispatcherTask) {
    let api = api(url, deployment(None, None)).await;
    put(
        &api,
        "/v1/templates/base",
        json!({"policy": {"default": "allow"}}),
    )
    .await;
    register(&api, "w1", &gw, pool).await;
    let d = dispatcher(url, deployment(None, None), limits).await;
    (api, gw, d)
}

async fn metric_until(d: &DispatcherTask, prefix: &str, want: impl Fn(f64) -> bool) {
    for _ in 0..400 {
        if want(metric(d, prefix)) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{prefix} never held: {}", metric(d, prefix));
}

/// Finished operations are deleted after `--operation-retention`, their
/// idempotency keys forgotten after `--idempotency-retention`: a replay of
/// the key then queues a new create.
#[tokio::test]
async fn finished_operations_and_idempotency_keys_are_pruned_after_their_retention() {
    let url = db!();
    let dir = tempfile::tempdir().expect("dir");
    let gw = gateway(dir.path(), "127.0.0.1:0").await;
    let api = allow_all_api(&url, gw.bound().admin, "100.64.40.0/24").await;
    let mut l = limits(5, 60_000, 100);
    l.operation_retention = Duration::from_secs(2);
    l.idempotency_retention = Duration::from_secs(1);
    let _d = dispatcher(&url, deployment(None, None), l).await;
    let create = || async {
        let (s, v) = call(
            api.addr,
            "POST",
            "/v1/sandboxes",
            Some(FEDERATED),
            &[("Idempotency-Key", "key-1")],
            Some(json!({"template": "base"})),
        )
        .await;
        assert_eq!(s, 202, "{v}");
        v["operation"].as_str().expect("op").to_owned()
    };
    let first = create().await;
    assert_eq!(
        settled(&api, FEDERATED, &first).await["state"],
        json!("succeeded")
    );
    assert_eq!(create().await, first, "replayed while kept");
    let path = format!("/v1/operations/{first}");
    let mut gone = false;
    for _ in 0..400 {
        if call(api.addr, "GET", &path, Some(FEDERATED), &[], None)
            .await
            .0
            == 404
        {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(gone, "{first} was never pruned");
    let second = create().await;
    assert_ne!(second, first, "the key was forgotten: a new create");
    let done = settled(&api, FEDERATED, &second).await;
    assert_eq!(done["state"], json!("succeeded"));
    // A finished operation keeps no payload (a create's whole policy).
    let sql = format!("SELECT count(*) FROM operations WHERE id = '{second}' AND payload = '{{}}'");
    db_until(&url, &sql, |n| n == 1).await;
    // A sandbox destroyed, and forgotten by its gateway, keeps no policy
    // past the retention.
    let id = done["sandbox"].as_str().expect("sandbox").to_owned();
    let (s, v) = destroy(api.addr, &id).await;
    assert!(s == 200 || s == 202, "{s} {v}");
    let sql = format!("SELECT count(*) FROM sandboxes WHERE id = '{id}' AND state = 'destroyed' AND policy IS NULL AND provenance = '[]'");
    db_until(&url, &sql, |n| n == 1).await;
}

/// The retention and lease flags are checked at start, naming the flag.
#[tokio::test]
async fn bad_retention_and_lease_flags_stop_the_dispatcher_naming_the_flag() {
    let dir = tempfile::tempdir().expect("dir");
    let tenants = dir.path().join("tenants.json");
    std::fs::write(
        &tenants,
        format!(r#"{{"tokens": {{"{ADMIN}": {{"tenant": "ops", "admin": true}}}}}}"#),
    )
    .expect("write");
    for (args, needle) in [
        (
            &[
                "--idempotency-retention",
                "2d",
                "--operation-retention",
                "1d",
            ][..],
            "--idempotency-retention 172800000ms: longer than --operation-retention",
        ),
        (
            &["--operation-retention", "0s"][..],
            "--operation-retention 0ms",
        ),
        (&["--lease-ttl", "500ms"][..], "--lease-ttl 500ms"),
        (&["--operation-retention", "1w"][..], "1w"),
        // Each of these started before.
        (&["--attempts", "0"][..], "--attempts 0: must be at least 1"),
        (&["--deadline", "0s"][..], "--deadline 0ms"),
        (&["--resync-interval", "0ms"][..], "--resync-interval 0ms"),
        (
            &["--deadline", "999999999999999999d"][..],
            "\"999999999999999999d\": too long",
        ),
        (
            &["--resync-interval", "200000000000000d"][..],
            "--resync-interval 17280000000000000000000ms: longer than 365d",
        ),
        (
            &["--lease-ttl", "400d"][..],
            "--lease-ttl 34560000000ms: longer than 365d",
        ),
    ] {
        let out = Command::new(BIN)
            .args(["dispatcher", "--tenants"])
            .arg(&tenants)
            .args(args)
            .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
            .env_remove("SPACE_EGRESS_PROFILES")
            .env_remove("SPACE_TLS_INTERCEPTION_EXEMPTIONS")
            .output()
            .expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} started");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

/// Through a rolling upgrade: while a dispatcher of the single-leader kind
/// leads (it holds the old leader lock exclusively), a sharded one neither
/// takes shards nor runs anything; once the old one is gone it works.
#[tokio::test]
async fn a_sharded_dispatcher_waits_while_a_single_leader_dispatcher_leads() {
    let url = db!();
    let dir = tempfile::tempdir().expect("dir");
    let gw = gateway(dir.path(), "127.0.0.1:0").await;
    let api = allow_all_api(&url, gw.bound().admin, "100.64.50.0/24").await;
    let mut old_leader = sqlx::PgConnection::connect(&url).await.expect("db");
    // The key single-leader dispatchers lead with.
    let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(0x6567_7265_7373_i64)
        .fetch_one(&mut old_leader)
        .await
        .expect("lock");
    assert!(got);
    let _d = dispatcher(&url, deployment(None, None), limits(5, 60_000, 100)).await;
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
    let op = v["operation"].as_str().expect("op").to_owned();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut conn = sqlx::PgConnection::connect(&url).await.expect("db");
    let (state, alive): (String, i64) = sqlx::query_as(
        "SELECT (SELECT state FROM operations WHERE id = $1), (SELECT count(*) FROM dispatchers)",
    )
    .bind(&op)
    .fetch_one(&mut conn)
    .await
    .expect("state");
    assert_eq!((state.as_str(), alive), ("queued", 0));
    drop(old_leader);
    assert_eq!(
        settled(&api, FEDERATED, &op).await["state"],
        json!("succeeded")
    );
}

/// The store on `url` with the template `t`, the worker `w1`, and on it
/// `sandboxes` (id, state, addresses, generation, pushed generation), all of
/// tenant `a` on `t`'s policy; and a connection of its own.
async fn seeded(
    url: &str,
    sandboxes: &[(&str, &str, &str, i64, i64)],
) -> (sqlx::PgPool, sqlx::PgConnection) {
    let pool = egress_controller::store::connect(url).await.expect("store");
    let mut conn = sqlx::PgConnection::connect(url).await.expect("db");
    let mut sqls = vec![
        "INSERT INTO templates (id, policy) VALUES ('t', '{\"default\": \"deny\"}')".to_owned(),
        "INSERT INTO workers (id, admin_url, token, pool) VALUES ('w1', 'http://127.0.0.1:9', '', '100.64.0.0/24')".to_owned(),
    ];
    sqls.extend(sandboxes.iter().map(|(id, state, addresses, generation, pushed)| {
        format!(
            "INSERT INTO sandboxes (id, tenant, template, egress_profiles, policy, inherits_template, state, worker, addresses, generation, pushed_generation) \
             VALUES ('{id}', 'a', 't', '{{}}', '{{\"default\": \"deny\"}}', true, '{state}', 'w1', '{addresses}', {generation}, {pushed})"
        )
    }));
    for sql in sqls {
        sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
            .execute(&mut conn)
            .await
            .expect(&sql);
    }
    (pool, conn)
}

/// The drift check compares a gateway's list with the sandboxes whose
/// changes are all pushed, read in one snapshot with the ids of those
/// still pending (left out of both sides: a sandbox placed while the list
/// was fetched is not drift); once they are all acknowledged it gets
/// every live one.
#[tokio::test]
async fn the_drift_check_compares_the_settled_sandboxes() {
    let url = db!();
    let (pool, mut conn) = seeded(
        &url,
        &[
            ("s1", "running", "{100.64.0.2}", 1, 1),
            ("s2", "running", "{100.64.0.3}", 1, 0),
        ],
    )
    .await;
    let settled = egress_controller::store::settled_sandboxes(&pool, "w1")
        .await
        .expect("read");
    let ids: Vec<&str> = settled.rows.iter().map(|s| s.id.as_str()).collect();
    assert_eq!(ids, ["s1"], "s2 is not pushed yet");
    assert_eq!(settled.pending.iter().collect::<Vec<_>>(), ["s2"]);
    sqlx::query("UPDATE sandboxes SET pushed_generation = generation WHERE id = 's2'")
        .execute(&mut conn)
        .await
        .expect("ack");
    let settled = egress_controller::store::settled_sandboxes(&pool, "w1")
        .await
        .expect("read");
    let ids: Vec<&str> = settled.rows.iter().map(|s| s.id.as_str()).collect();
    assert_eq!(ids, ["s1", "s2"], "every change acknowledged");
    assert!(settled.pending.is_empty());
}

/// A resync settles only the destroyed sandboxes it read: one destroyed
/// after its snapshot (the resync may have sent it live) keeps its change
/// to push, so the gateway is told to forget it. Settling every destroyed
/// sandbox of the worker after the resync left such a one on the gateway
/// for good: its generation matched and no drift check looked again.
#[tokio::test]
async fn a_resync_settles_only_the_destroyed_sandboxes_it_read() {
    let url = db!();
    let (pool, mut conn) = seeded(
        &url,
        &[
            ("s1", "running", "{100.64.0.2}", 4, 4),
            ("s2", "destroyed", "{}", 3, 2),
        ],
    )
    .await;
    let view = egress_controller::store::resync_view(&pool, "w1")
        .await
        .expect("read");
    let live: Vec<&str> = view.live.iter().map(|s| s.id.as_str()).collect();
    assert_eq!(live, ["s1"]);
    assert_eq!(view.forgotten, [("s2".to_owned(), 3)]);
    // s1 is destroyed while the resync is on its way.
    let sql = "UPDATE sandboxes SET state = 'destroyed', generation = 5 WHERE id = 's1'";
    sqlx::query(sql).execute(&mut conn).await.expect(sql);
    egress_controller::store::mark_forgotten(&pool, &view.forgotten)
        .await
        .expect("mark");
    let unpushed = egress_controller::store::unpushed(&pool, "w1", (10, 1 << 20), (&[], &[]))
        .await
        .expect("unpushed");
    let ids: Vec<(&str, i64)> = unpushed
        .rows
        .iter()
        .map(|s| (s.id.as_str(), s.generation))
        .collect();
    assert_eq!(
        ids,
        [("s1", 5)],
        "s2 settled, s1's destruction still to push"
    );
}

/// The changes to push are read within a count and a size of policy as
/// stored (the first whatever its size), and a read cut short by either is not
/// taken for the end of the queue (which lets held-back pushes go again).
/// Before, only the count bounded a read: 256 policies of up to 1 MiB in
/// each of 64 workers' tasks at once.
#[tokio::test]
async fn the_changes_to_push_are_read_within_a_count_and_a_size() {
    let url = db!();
    let (pool, mut conn) = seeded(
        &url,
        &[
            ("s1", "running", "{100.64.0.2}", 1, 0),
            ("s2", "running", "{100.64.0.3}", 1, 0),
            ("s3", "running", "{100.64.0.4}", 1, 0),
        ],
    )
    .await;
    // Each seeded policy is `{"default": "deny"}`, this large as stored.
    let size: i32 =
        sqlx::query_scalar("SELECT pg_column_size(policy) FROM sandboxes WHERE id = 's1'")
            .fetch_one(&mut conn)
            .await
            .expect("size");
    let size = i64::from(size);
    for ((limit, bytes), want, end) in [
        ((10, 1 << 20), 3, true),
        ((10, size + size / 2), 2, false),
        ((10, 1), 1, false),
        ((10, 0), 1, false),
        ((2, 1 << 20), 2, false),
        ((3, 1 << 20), 3, false),
    ] {
        let read = egress_controller::store::unpushed(&pool, "w1", (limit, bytes), (&[], &[]))
            .await
            .expect("unpushed");
        let ids: Vec<&str> = read.rows.iter().map(|s| s.id.as_str()).collect();
        assert_eq!(ids, ["s1", "s2", "s3"][..want], "{limit} {bytes}");
        assert_eq!(read.end, end, "{limit} {bytes}");
    }
}

/// The pool's connections bound their statements and their lock waits: a
/// request stuck behind a lock or a slow statement ends in an error (503)
/// instead of holding its caller.
#[tokio::test]
async fn pool_connections_bound_statements_and_lock_waits() {
    let url = db!();
    let pool = egress_controller::store::connect(&url)
        .await
        .expect("store");
    let settings: (String, String) = sqlx::query_as(
        "SELECT current_setting('statement_timeout'), current_setting('lock_timeout')",
    )
    .fetch_one(&pool)
    .await
    .expect("settings");
    assert_eq!(settings, ("30s".to_owned(), "10s".to_owned()));
    // A client gone without a FIN is found by the server's keepalive, and
    // a transaction it left idle ends, its locks with it.
    let idle: (String, String, String, String, bool) = sqlx::query_as(
        "SELECT current_setting('idle_in_transaction_session_timeout'), \
         current_setting('tcp_keepalives_idle'), current_setting('tcp_keepalives_interval'), \
         current_setting('tcp_keepalives_count'), inet_client_addr() IS NOT NULL",
    )
    .fetch_one(&pool)
    .await
    .expect("settings");
    let tcp = idle.4;
    let want = |v: &str| if tcp { v.to_owned() } else { "0".to_owned() };
    assert_eq!(
        idle,
        ("1min".to_owned(), want("10"), want("5"), want("3"), tcp),
        "over TCP: {tcp}"
    );
    let mut other = sqlx::PgConnection::connect(&url).await.expect("db");
    let mut tx = other.begin().await.expect("tx");
    sqlx::query("SELECT pg_advisory_xact_lock(7)")
        .execute(&mut *tx)
        .await
        .expect("lock");
    let waited = std::time::Instant::now();
    let blocked = sqlx::query("SELECT pg_advisory_xact_lock(7)")
        .execute(&pool)
        .await;
    assert!(blocked.is_err_and(|e| e.to_string().contains("lock timeout")));
    assert!(waited.elapsed() < Duration::from_secs(20));
}

/// A worker's live sandboxes (every resync and drift check) are read
/// through an index that holds only them: the ended rows, kept for good,
/// are not scanned, nor other workers' sandboxes. Before, no index led
/// with `worker` for them: the plan read every live sandbox of every
/// worker (through `sandboxes_tenant_live`), filtered and sorted.
#[tokio::test]
async fn a_workers_live_sandboxes_are_read_through_their_own_index() {
    let url = db!();
    let _pool = egress_controller::store::connect(&url)
        .await
        .expect("store");
    let mut conn = sqlx::PgConnection::connect(&url).await.expect("db");
    // The table is small here: the planner is told to prefer an index
    // whenever one can answer, so the plan shows which one can.
    sqlx::query("SET enable_seqscan = off")
        .execute(&mut conn)
        .await
        .expect("set");
    let explain = format!(
        "EXPLAIN (FORMAT JSON) {}",
        egress_controller::store::WORKER_SANDBOXES
    );
    let plan: Value =
        sqlx::query_scalar::<_, sqlx::types::Json<Value>>(sqlx::AssertSqlSafe(explain))
            .bind("w1")
            .fetch_one(&mut conn)
            .await
            .expect("explain")
            .0;
    let text = plan.to_string();
    assert!(
        text.contains("\"Index Name\":\"sandboxes_worker_live\""),
        "{text}"
    );
    assert!(text.contains("\"Index Cond\":\"(worker = "), "{text}");
}

/// The store speaks TLS to PostgreSQL: `sslmode=verify-full` with the
/// server's CA connects over TLS (the server's own view says so), and
/// `sslmode=prefer`, the default, uses TLS where the server offers it.
/// Before, the build had no TLS: `require` and `verify-full` refused to
/// start and `prefer` sent everything, the workers' tokens included, in
/// the clear. Needs the cluster of `.ci/pg.sh` (TLS on, `EGRESS_PG_CA`).
#[tokio::test]
async fn the_store_talks_to_postgresql_over_verified_tls() {
    let url = db!();
    let Ok(ca) = std::env::var("EGRESS_PG_CA") else {
        egress_testkit::skip(
            "PostgreSQL over TLS",
            "EGRESS_PG_CA is not set (a server with TLS and its CA: eval \"$(.ci/pg.sh start)\")",
        );
        return;
    };
    let sep = if url.contains('?') { '&' } else { '?' };
    for extra in [
        format!("sslmode=verify-full&sslrootcert={ca}"),
        String::new(),
    ] {
        let asked = if extra.is_empty() {
            url.clone()
        } else {
            format!("{url}{sep}{extra}")
        };
        let pool = egress_controller::store::connect(&asked)
            .await
            .unwrap_or_else(|e| panic!("{asked}: {e}"));
        let tls: bool =
            sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
                .fetch_one(&pool)
                .await
                .expect("pg_stat_ssl");
        assert!(tls, "{asked}: not over TLS");
    }
    // A CA that did not sign the server's certificate: refused.
    let dir = tempfile::tempdir().expect("temp");
    let other = dir.path().join("other.crt");
    let made = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
        ])
        .args(["-nodes", "-days", "2", "-subj", "/CN=127.0.0.1", "-keyout"])
        .arg(dir.path().join("other.key"))
        .arg("-out")
        .arg(&other)
        .output()
        .expect("openssl");
    assert!(made.status.success(), "{made:?}");
    let asked = format!(
        "{url}{sep}sslmode=verify-full&sslrootcert={}",
        other.display()
    );
    assert!(egress_controller::store::connect(&asked).await.is_err());
}
