//! Warm pools: a create that names its template's pool claims a sandbox
//! created ahead of time; the selection is admitted and composed as for a
//! create, concurrent claims never share a sandbox, idempotency keys
//! replay, an empty pool falls back to a create, and the pool refills.

use std::collections::HashSet;
use std::time::Duration;

use serde_json::{json, Value};
use sqlx::PgPool;

use crate::db;
use crate::support::*;

fn template() -> Value {
    json!({"default": "deny", "tls_interception": "on"})
}

/// The refill task, stopped when dropped.
struct Refill(tokio::task::JoinHandle<()>);

impl Drop for Refill {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn refill(pool: &PgPool) -> Refill {
    Refill(tokio::spawn(egress_controller::pool::refill_forever(
        pool.clone(),
    )))
}

/// The pool of `base` filled to `size` ready sandboxes, then left
/// unrefilled (what a claim takes stays taken); the store, to read it.
async fn filled(url: &str, api: &ApiProcess, size: i32) -> PgPool {
    let pool = egress_controller::store::connect(url).await.expect("store");
    let refilling = refill(&pool).await;
    set_size(api, size).await;
    ready(api, i64::from(size)).await;
    drop(refilling);
    pool
}

async fn set_size(api: &ApiProcess, size: i32) {
    let (s, v) = call(
        api.addr,
        "PUT",
        "/v1/templates/base/pool",
        Some(ADMIN),
        &[],
        Some(json!({"size": size})),
    )
    .await;
    assert_eq!(s, 200, "{v}");
}

/// Polls the pool until `ready` sandboxes are on their gateway (≤ 20 s).
async fn ready(api: &ApiProcess, want: i64) {
    let mut last = Value::Null;
    for _ in 0..400 {
        let (_, v) = call(
            api.addr,
            "GET",
            "/v1/templates/base/pool",
            Some(ADMIN),
            &[],
            None,
        )
        .await;
        if v["ready"] == json!(want) {
            return;
        }
        last = v;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the pool never had {want} ready: {last}");
}

/// The pooled sandboxes now: id → addresses.
async fn pooled(pool: &PgPool) -> Vec<(String, Vec<String>)> {
    sqlx::query_as("SELECT id, addresses FROM sandboxes WHERE warm_pool = 'base' ORDER BY id")
        .fetch_all(pool)
        .await
        .expect("pooled")
}

async fn claim(api: &ApiProcess, headers: &[(&str, &str)], body: Value) -> (u16, Value) {
    let mut all = vec![("X-Space-Warm-Pool", "base")];
    all.extend_from_slice(headers);
    call(
        api.addr,
        "POST",
        "/v1/sandboxes",
        Some(FEDERATED),
        &all,
        Some(body),
    )
    .await
}

async fn document(api: &ApiProcess, id: &str) -> Value {
    call(
        api.addr,
        "GET",
        &format!("/v1/sandboxes/{id}"),
        Some(FEDERATED),
        &[],
        None,
    )
    .await
    .1
}

#[tokio::test]
async fn a_claim_takes_a_pooled_sandbox_composes_its_selection_like_a_create_and_the_pool_refills()
{
    let url = db!();
    let w = world(
        &url,
        deployment(Some(PROFILES), Some(EXEMPTIONS)),
        template(),
    )
    .await;
    let pool = egress_controller::store::connect(&url)
        .await
        .expect("store");
    let _refill = refill(&pool).await;
    set_size(&w.api, 2).await;
    ready(&w.api, 2).await;
    let before = pooled(&pool).await;
    for (id, _) in &before {
        let pushed = on_gateway(&w.gw, id).await;
        assert_eq!(
            pushed["policy"]["tls_interception_exemptions"],
            json!([{"wildcard_domain": "*.relay.example.test"}]),
            "a pooled sandbox runs the template's policy, deployment exemptions composed"
        );
    }

    // A selection the create would refuse is refused, and claims nothing.
    let (s, v) = claim(
        &w.api,
        &[("X-Space-Egress-Profiles", "+nope")],
        json!({"template": "base"}),
    )
    .await;
    assert_eq!((s, &v["reason"]), (400, &json!("unknown")), "{v}");
    let (s, v) = call(
        w.api.addr,
        "POST",
        "/v1/sandboxes",
        Some(FEDERATED),
        &[("X-Space-Warm-Pool", "other")],
        Some(json!({"template": "base"})),
    )
    .await;
    assert_eq!(s, 400, "a pool that is not the template's: {v}");
    assert_eq!(pooled(&pool).await, before, "nothing was claimed");

    let headers = [("X-Space-Egress-Profiles", "+sensor")];
    let (s, v) = claim(&w.api, &headers, json!({"template": "base"})).await;
    assert_eq!(s, 202, "{v}");
    let id = v["sandbox"].as_str().expect("id").to_owned();
    let addresses = before
        .iter()
        .find(|(p, _)| *p == id)
        .map(|(_, a)| a.clone())
        .expect("the claim took a pooled sandbox");
    let op = settled(&w.api, FEDERATED, v["operation"].as_str().expect("op")).await;
    assert_eq!(
        (&op["state"], &op["kind"]),
        (&json!("succeeded"), &json!("claim")),
        "{op}"
    );

    // The same selection through a plain create composes the same policy.
    let (s, v) = call(
        w.api.addr,
        "POST",
        "/v1/sandboxes",
        Some(FEDERATED),
        &headers,
        Some(json!({"template": "base"})),
    )
    .await;
    assert_eq!(s, 202, "{v}");
    settled(&w.api, FEDERATED, v["operation"].as_str().expect("op")).await;
    let created = document(&w.api, v["sandbox"].as_str().expect("id")).await;
    let claimed = document(&w.api, &id).await;
    for field in [
        "egress_profiles",
        "policy",
        "inherits_template",
        "provenance",
        "state",
    ] {
        assert_eq!(
            claimed[field], created[field],
            "{field}: a claim composes like a create"
        );
    }
    assert_eq!(claimed["egress_profiles"], json!(["audit", "sensor"]));
    assert_eq!(
        claimed["addresses"],
        json!(addresses),
        "the claim keeps its place"
    );
    let metrics = w.api.metrics.encode();
    assert!(
        metrics.contains(r#"space_sandbox_egress_profile_admission_total{profile="sensor",outcome="ok",reason="ready"} 2"#),
        "the claim is admitted (and counted) as a create: {metrics}"
    );
    assert!(
        metrics.contains(r#"egress_controller_pool_claims_total{outcome="claimed"} 1"#),
        "{metrics}"
    );

    // The gateway enforces the composed policy on the claimed sandbox.
    for _ in 0..600 {
        if on_gateway(&w.gw, &id).await["policy"] == claimed["policy"] {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(on_gateway(&w.gw, &id).await["policy"], claimed["policy"]);

    // The pool refills behind the claim.
    ready(&w.api, 2).await;
    let after = pooled(&pool).await;
    assert!(
        after.iter().all(|(p, _)| *p != id),
        "a claimed sandbox leaves the pool"
    );
}

#[tokio::test]
async fn concurrent_claims_never_share_a_sandbox_and_an_empty_pool_falls_back_to_a_create() {
    let url = db!();
    let w = world(&url, deployment(Some(PROFILES), None), template()).await;
    let pool = egress_controller::store::connect(&url)
        .await
        .expect("store");
    let refilling = refill(&pool).await;
    let (s, _) = call(
        w.api.addr,
        "PUT",
        "/v1/templates/base/pool",
        Some(FEDERATED),
        &[],
        Some(json!({"size": 5})),
    )
    .await;
    assert_eq!(s, 403, "a pool is set by an admin");
    set_size(&w.api, 5).await;
    ready(&w.api, 5).await;
    drop(refilling);
    let pooled_ids: HashSet<String> = pooled(&pool).await.into_iter().map(|(id, _)| id).collect();

    let mut claims = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let addr = w.api.addr;
        claims.spawn(async move {
            let headers = [("X-Space-Warm-Pool", "base")];
            call(
                addr,
                "POST",
                "/v1/sandboxes",
                Some(FEDERATED),
                &headers,
                Some(json!({"template": "base"})),
            )
            .await
        });
    }
    let answers = claims.join_all().await;
    let mut ids = HashSet::new();
    let mut from_pool = 0;
    for (s, v) in answers {
        assert_eq!(s, 202, "{v}");
        let id = v["sandbox"].as_str().expect("id").to_owned();
        let op = settled(&w.api, FEDERATED, v["operation"].as_str().expect("op")).await;
        assert_eq!(op["state"], json!("succeeded"), "{op}");
        if pooled_ids.contains(&id) {
            assert_eq!(op["kind"], json!("claim"));
            from_pool += 1;
        } else {
            assert_eq!(
                op["kind"],
                json!("create"),
                "an empty pool falls back to a create"
            );
        }
        assert!(ids.insert(id), "two claims got the same sandbox");
    }
    assert_eq!(from_pool, 5, "every pooled sandbox was claimed once");
    let metrics = w.api.metrics.encode();
    assert!(
        metrics.contains(r#"egress_controller_pool_claims_total{outcome="empty"} 3"#),
        "{metrics}"
    );
    let tenants: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT tenant FROM sandboxes WHERE id = ANY($1)")
            .bind(ids.into_iter().collect::<Vec<_>>())
            .fetch_all(&pool)
            .await
            .expect("tenants");
    assert_eq!(
        tenants,
        vec!["t1".to_owned()],
        "every claimed sandbox is the tenant's"
    );
}

#[tokio::test]
async fn an_idempotency_key_replays_a_claim_and_refuses_another_request() {
    let url = db!();
    let w = world(&url, deployment(Some(PROFILES), None), template()).await;
    let pool = filled(&url, &w.api, 3).await;

    let key = [
        ("Idempotency-Key", "claim-1"),
        ("X-Space-Egress-Profiles", "+sensor"),
    ];
    let body = json!({"template": "base"});
    let (a, b) = tokio::join!(
        claim(&w.api, &key, body.clone()),
        claim(&w.api, &key, body.clone())
    );
    assert_eq!((a.0, b.0), (202, 202), "{a:?} {b:?}");
    assert_eq!(a.1, b.1, "concurrent requests with one key get one claim");
    let (s, again) = claim(&w.api, &key, body).await;
    assert_eq!(
        (s, &again),
        (202, &a.1),
        "a replay returns the original claim"
    );
    assert_eq!(pooled(&pool).await.len(), 2, "one sandbox left the pool");

    let (s, v) = claim(&w.api, &key[..1], json!({"template": "base"})).await;
    assert_eq!(s, 409, "another selection under the key: {v}");
    let (s, v) = call(
        w.api.addr,
        "POST",
        "/v1/sandboxes",
        Some(FEDERATED),
        &key,
        Some(json!({"template": "base"})),
    )
    .await;
    assert_eq!(
        s, 409,
        "the same create without the pool is another request: {v}"
    );
    assert_eq!(
        pooled(&pool).await.len(),
        2,
        "refused requests claim nothing"
    );
    let op = settled(&w.api, FEDERATED, a.1["operation"].as_str().expect("op")).await;
    assert_eq!(op["state"], json!("succeeded"), "{op}");
}

#[tokio::test]
async fn an_e2b_create_claims_from_the_pool_and_the_controller_composes_it() {
    let url = db!();
    let w = world(
        &url,
        deployment(Some(PROFILES), Some(EXEMPTIONS)),
        json!({"default": "allow", "tls_interception": "on"}),
    )
    .await;
    // Not refilled after this one is claimed: the pool stays empty.
    let pool = filled(&url, &w.api, 1).await;
    let before = pooled(&pool).await;

    let body = json!({"templateID": "base", "network": {"denyOut": ["0.0.0.0/0", "::/0"], "allowOut": ["api.example.test"]}});
    let headers = [
        ("X-Space-Warm-Pool", "base"),
        ("X-Space-Egress-Profiles", "+sensor"),
    ];
    let (s, v) = call(
        w.api.addr,
        "POST",
        "/sandboxes",
        Some(FEDERATED),
        &headers,
        Some(body.clone()),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    let id = v["sandboxID"].as_str().expect("id").to_owned();
    assert_eq!(before[0].0, id, "the E2B create took the pooled sandbox");
    let op = settled(&w.api, FEDERATED, v["operation"].as_str().expect("op")).await;
    assert_eq!(
        (&op["state"], &op["kind"]),
        (&json!("succeeded"), &json!("claim")),
        "{op}"
    );

    // The same E2B create without the pool, composed by the API.
    let (s, v) = call(
        w.api.addr,
        "POST",
        "/sandboxes",
        Some(FEDERATED),
        &headers[1..],
        Some(body),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    let created = document(&w.api, v["sandboxID"].as_str().expect("id")).await;
    let claimed = document(&w.api, &id).await;
    for field in [
        "egress_profiles",
        "policy",
        "inherits_template",
        "provenance",
    ] {
        assert_eq!(claimed[field], created[field], "{field}");
    }
    assert_eq!(claimed["policy"]["default"], json!("deny"), "{claimed}");

    // With the pool empty, a create with a key is composed in its request
    // (E2B) or queued (native); retried, it gets its first answer again:
    // no operation for the E2B one, its queued create's for the native.
    assert_eq!(pooled(&pool).await, [], "the pool is empty");
    for (path, body, want) in [
        ("/sandboxes", json!({"templateID": "base"}), 201),
        ("/v1/sandboxes", json!({"template": "base"}), 202),
    ] {
        let headers = [headers[0], ("Idempotency-Key", path)];
        let mut answers = Vec::new();
        for _ in 0..2 {
            let (s, v) = call(
                w.api.addr,
                "POST",
                path,
                Some(FEDERATED),
                &headers,
                Some(body.clone()),
            )
            .await;
            assert_eq!(s, want, "{v}");
            answers.push(v);
        }
        assert_eq!(
            answers[0], answers[1],
            "{path}: a retry gets the first answer"
        );
        let operation = answers[0].get("operation");
        assert_eq!(
            operation.is_some_and(|o| o.is_string()),
            want == 202,
            "{path}: {}",
            answers[0]
        );
    }
}

/// An E2B create through the pool whose translation is larger than a
/// gateway takes is refused `400` before it claims, as without the pool:
/// the pooled sandbox stays in the pool. (Before: `201`, the claim then
/// failed for good and used the sandbox up.)
#[tokio::test]
async fn an_e2b_claim_too_large_for_a_gateway_is_refused_before_it_claims() {
    let url = db!();
    let w = world(&url, deployment(None, None), template()).await;
    let pool = filled(&url, &w.api, 1).await;
    let before = pooled(&pool).await;
    let body = oversized_e2b_create();
    let (s, v) = call(
        w.api.addr,
        "POST",
        "/sandboxes",
        Some(FEDERATED),
        &[("X-Space-Warm-Pool", "base")],
        Some(body),
    )
    .await;
    assert_eq!(s, 400, "{v}");
    assert!(
        v["error"]
            .as_str()
            .is_some_and(|e| e.contains("bytes in normal form")),
        "{v}"
    );
    assert_eq!(pooled(&pool).await, before, "the pooled sandbox was taken");
}

/// A claim whose saved name the dispatcher cannot resolve fails like a
/// create (after its attempts), and the pooled sandbox is off its gateway.
#[tokio::test]
async fn a_claim_that_fails_leaves_the_sandbox_failed_and_off_its_gateway() {
    let url = db!();
    let dir = tempfile::tempdir().expect("dir");
    let gw = gateway(dir.path(), "127.0.0.1:0").await;
    let api = api(&url, deployment(Some(PROFILES), None)).await;
    setup(&api, template(), gw.bound().admin, "100.64.10.0/24").await;
    // The dispatcher's deployment no longer configures `sensor`.
    let without = r#"{"audit": {"default": true, "allow": [{"domain": "audit.example.test"}]}}"#;
    let _d = dispatcher(&url, deployment(Some(without), None), limits(2, 60_000, 50)).await;
    let pool = egress_controller::store::connect(&url)
        .await
        .expect("store");
    let refilling = refill(&pool).await;
    set_size(&api, 1).await;
    ready(&api, 1).await;
    drop(refilling);
    let (s, v) = claim(
        &api,
        &[("X-Space-Egress-Profiles", "+sensor")],
        json!({"template": "base"}),
    )
    .await;
    assert_eq!(s, 202, "{v}");
    let id = v["sandbox"].as_str().expect("id").to_owned();
    let op = settled(&api, FEDERATED, v["operation"].as_str().expect("op")).await;
    assert_eq!(op["state"], json!("failed"), "{op}");
    // The sandbox is marked failed just after its operation (another statement).
    for _ in 0..600 {
        if document(&api, &id).await["state"] == json!("failed") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(document(&api, &id).await["state"], json!("failed"));
    let sid = egress_policy::SandboxId::new(&id);
    for _ in 0..600 {
        if gw.registry().get(&sid).is_none() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        gw.registry().get(&sid).is_none(),
        "the failed claim is taken off its gateway"
    );
}

/// A pool whose creates fail (here: marked failed, as when no worker has a
/// free address) is not refilled at every round: a failed pooled sandbox
/// keeps its place for a minute. Every round queued the pool's size again
/// before, failed rows piling up without end.
#[tokio::test]
async fn failed_pooled_creates_are_tried_again_after_a_minute_not_every_round() {
    let url = db!();
    let api = api(&url, deployment(Some(PROFILES), None)).await;
    let down = free_addr();
    setup(&api, template(), down, "100.64.10.0/24").await;
    let pool = egress_controller::store::connect(&url)
        .await
        .expect("store");
    set_size(&api, 2).await;
    let round = || egress_controller::pool::refill(&pool);
    assert_eq!(round().await.expect("round"), 2);
    let fail = "UPDATE sandboxes SET state = 'failed', changed_at = now() WHERE warm_pool = 'base'";
    sqlx::query(fail).execute(&pool).await.expect("failed");
    assert_eq!(
        round().await.expect("round"),
        0,
        "the failures hold their places"
    );
    let earlier =
        "UPDATE sandboxes SET changed_at = now() - interval '61 seconds' WHERE warm_pool = 'base'";
    sqlx::query(earlier).execute(&pool).await.expect("earlier");
    assert_eq!(round().await.expect("round"), 2, "a minute on, tried again");
    // The failures past their minute left the pool: it holds what it
    // tries now, not every failure since it was made.
    let held: (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE warm_pool = 'base'), count(*) FILTER (WHERE state = 'failed' AND warm_pool IS NULL) FROM sandboxes",
    )
    .fetch_one(&pool)
    .await
    .expect("count");
    assert_eq!(held, (2, 2), "(in the pool, failed and out of it)");
}
