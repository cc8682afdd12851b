//! Shadow policies through the controller: put on the worker's gateway,
//! reported, promoted through the store, scoped by tenant; template rollouts.

use std::time::Duration;

use egress_gateway::Gateway;
use egress_policy::SandboxId;
use serde_json::{json, Value};

use crate::db;
use crate::support::*;

/// A sandbox created by `token` on `worker` (`policy` absent: it inherits).
async fn created(api: &ApiProcess, gw: &Gateway, token: &str, body: Value) -> String {
    let (s, v) = call(
        api.addr,
        "POST",
        "/v1/sandboxes",
        Some(token),
        &[],
        Some(body),
    )
    .await;
    assert_eq!(s, 202, "{v}");
    let op = settled(api, token, v["operation"].as_str().expect("op")).await;
    assert_eq!(op["state"], json!("succeeded"), "{op}");
    let id = v["sandbox"].as_str().expect("id").to_owned();
    on_gateway(gw, &id).await;
    id
}

/// The gateway's shadow of `id` (its policy), if any.
fn shadow_on(gw: &Gateway, id: &str) -> Option<Value> {
    let s = gw.registry().get(&SandboxId::new(id))?;
    let shadow = s.shadow.as_ref()?;
    serde_json::to_value(shadow.policy.policy()).ok()
}

/// Polls until the gateway's active policy of `id` is `policy` and it has no shadow.
async fn active_without_shadow(gw: &Gateway, id: &str, policy: &Value) {
    for _ in 0..600 {
        let got = on_gateway(gw, id).await;
        if &got["policy"] == policy && shadow_on(gw, id).is_none() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the gateway never ran {policy} without a shadow for {id}");
}

async fn path(
    api: &ApiProcess,
    method: &str,
    p: &str,
    token: &str,
    body: Option<Value>,
) -> (u16, Value) {
    call(api.addr, method, p, Some(token), &[], body).await
}

/// FEDERATED puts `candidate` as sandbox `id`'s shadow: the answer (`200`).
async fn shadow_put(api: &ApiProcess, id: &str, candidate: &Value) -> Value {
    let shadow = format!("/v1/sandboxes/{id}/shadow");
    let body = Some(json!({"policy": candidate}));
    let (s, put) = path(api, "PUT", &shadow, FEDERATED, body).await;
    assert_eq!(s, 200, "{put}");
    put
}

#[tokio::test]
async fn a_shadow_is_composed_put_on_the_gateway_reported_and_promoted() {
    let url = db!();
    let w = world(
        &url,
        deployment(Some(PROFILES), Some(EXEMPTIONS)),
        json!({"default": "allow"}),
    )
    .await;
    let (gw, api) = (&w.gw, &w.api);
    let id = created(
        api,
        gw,
        FEDERATED,
        json!({"template": "base", "policy": {"default": "deny", "allow": [{"domain": "tenant.example.test"}]}}),
    )
    .await;
    let shadow = format!("/v1/sandboxes/{id}/shadow");
    let candidate = json!({"default": "deny",
        "allow": [{"domain": "tenant.example.test"}, {"domain": "new.example.test"}]});
    let put = shadow_put(api, &id, &candidate).await;
    let effective = put["effective"].clone();
    let allow = effective["allow"].as_array().cloned().unwrap_or_default();
    assert!(
        allow.contains(&json!({"domain": "audit.example.test"})),
        "composed with the saved names like a replacement: {put}"
    );
    assert_eq!(
        shadow_on(gw, &id),
        Some(effective.clone()),
        "on the gateway"
    );
    // Validated like a replacement: the field is named, nothing changes.
    let (s, bad) = path(
        api,
        "PUT",
        &shadow,
        FEDERATED,
        Some(json!({"policy": {"default": "maybe"}})),
    )
    .await;
    assert_eq!(s, 400, "{bad}");
    assert!(
        bad["error"]
            .as_str()
            .is_some_and(|e| e.starts_with("policy")),
        "{bad}"
    );
    // Another tenant sees no such sandbox.
    for (method, p) in [
        ("PUT", shadow.clone()),
        ("GET", format!("{shadow}/report")),
        ("POST", format!("{shadow}/promote")),
        ("DELETE", shadow.clone()),
    ] {
        let (s, v) = path(api, method, &p, PLAIN, Some(json!({"policy": candidate}))).await;
        assert_eq!(s, 404, "{method} {p}: {v}");
    }
    let (s, report) = path(api, "GET", &format!("{shadow}/report"), FEDERATED, None).await;
    assert_eq!(s, 200, "{report}");
    assert_eq!(report["sandbox"], json!(id));
    assert_eq!(report["differences"], json!([]));
    // Promotion: the store's policy is the candidate, composed; the gateway
    // runs it, without a shadow.
    let (s, promoted) = path(api, "POST", &format!("{shadow}/promote"), FEDERATED, None).await;
    assert_eq!(s, 200, "{promoted}");
    assert_eq!(promoted["policy"], effective);
    let (_, stored) = path(api, "GET", &format!("/v1/sandboxes/{id}"), FEDERATED, None).await;
    assert_eq!(stored["policy"], effective);
    active_without_shadow(gw, &id, &effective).await;
    let (s, _) = path(api, "POST", &format!("{shadow}/promote"), FEDERATED, None).await;
    assert_eq!(s, 404, "the candidate is gone with its promotion");
    // Put again, then dropped from the gateway and the store.
    let (s, _) = path(
        api,
        "PUT",
        &shadow,
        FEDERATED,
        Some(json!({"policy": {"default": "deny"}})),
    )
    .await;
    assert_eq!(s, 200);
    assert!(shadow_on(gw, &id).is_some());
    let (s, v) = path(api, "DELETE", &shadow, FEDERATED, None).await;
    assert_eq!(s, 200, "{v}");
    assert!(shadow_on(gw, &id).is_none());
    let (s, _) = path(api, "DELETE", &shadow, FEDERATED, None).await;
    assert_eq!(s, 404);
    let (s, _) = path(api, "GET", &format!("{shadow}/report"), FEDERATED, None).await;
    assert_eq!(s, 404);
}

#[tokio::test]
async fn a_template_rollout_reaches_every_inheriting_sandbox_on_every_worker() {
    let url = db!();
    let d = deployment(Some(PROFILES), Some(EXEMPTIONS));
    let w = world(&url, d, json!({"default": "allow"})).await;
    let (gw1, api) = (&w.gw, &w.api);
    let dir = tempfile::tempdir().expect("dir");
    let gw2 = gateway(dir.path(), "127.0.0.1:0").await;
    let (s, v) = path(
        api,
        "PUT",
        "/v1/workers/w2",
        ADMIN,
        Some(json!({"admin_url": format!("http://{}", gw2.bound().admin), "token": "", "pool": "100.64.11.0/24"})),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    // Tenant t2 selects no profiles: its sandboxes run the template's policy as it is.
    let a = created(api, gw1, PLAIN, json!({"template": "base", "worker": "w1"})).await;
    let b = created(
        api,
        &gw2,
        PLAIN,
        json!({"template": "base", "worker": "w2"}),
    )
    .await;
    let own = created(
        api,
        gw1,
        FEDERATED,
        json!({"template": "base", "worker": "w1", "policy": {"default": "allow"}}),
    )
    .await;
    // Rollouts list sandboxes by id.
    let both = {
        let mut v = vec![a.clone(), b.clone()];
        v.sort();
        json!(v)
    };
    let candidate =
        json!({"policy": {"default": "deny", "allow": [{"domain": "kept.example.test"}]}});
    let (s, _) = path(
        api,
        "PUT",
        "/v1/templates/base/shadow",
        FEDERATED,
        Some(candidate.clone()),
    )
    .await;
    assert_eq!(s, 403, "an admin route");
    let (s, put) = path(
        api,
        "PUT",
        "/v1/templates/base/shadow",
        ADMIN,
        Some(candidate),
    )
    .await;
    assert_eq!(s, 200, "{put}");
    assert_eq!(put["sandboxes"], both, "{put}");
    assert_eq!(put["failed"], json!([]));
    let on_a = shadow_on(gw1, &a).expect("a's shadow");
    assert!(on_a["allow"]
        .as_array()
        .is_some_and(|l| l.contains(&json!({"domain": "kept.example.test"}))));
    assert!(
        shadow_on(&gw2, &b).is_some(),
        "b's shadow, on the other worker"
    );
    assert!(
        shadow_on(gw1, &own).is_none(),
        "a sandbox with its own policy is left alone"
    );
    let (s, report) = path(api, "GET", "/v1/templates/base/shadow/report", ADMIN, None).await;
    assert_eq!(s, 200, "{report}");
    assert_eq!(report["sandboxes"], both);
    assert_eq!(report["missing"], json!([]));
    assert_eq!(report["flows"], json!(0));
    assert_eq!(report["differences"], json!([]));
    // A sandbox given a policy of its own since is no longer the
    // template's to judge: left out of the report, its shadow still
    // removed with the rollout (below).
    let (s, v) = path(
        api,
        "PUT",
        &format!("/v1/sandboxes/{b}/network"),
        PLAIN,
        Some(json!({"policy": {"default": "allow"}})),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let (s, report) = path(api, "GET", "/v1/templates/base/shadow/report", ADMIN, None).await;
    assert_eq!(s, 200, "{report}");
    assert_eq!(report["sandboxes"], json!([a.clone()]), "{report}");
    // A rollout's shadow is promoted through the template, not the sandbox.
    let (s, v) = path(
        api,
        "POST",
        &format!("/v1/sandboxes/{a}/shadow/promote"),
        PLAIN,
        None,
    )
    .await;
    assert_eq!(s, 409, "{v}");
    let (s, v) = path(api, "DELETE", "/v1/templates/base/shadow", ADMIN, None).await;
    assert_eq!(s, 200, "{v}");
    assert!(shadow_on(gw1, &a).is_none() && shadow_on(&gw2, &b).is_none());
    let (s, _) = path(api, "GET", "/v1/templates/base/shadow/report", ADMIN, None).await;
    assert_eq!(s, 404);
}

/// A destroyed sandbox's shadow goes at pruning, as its policy does: a
/// tenant creating, shadowing and destroying sandboxes in a loop leaves no
/// rows of a megabyte. Before, the shadow's row (the candidate and the
/// policy it was put over) stayed for good.
#[tokio::test]
async fn a_destroyed_sandboxes_shadow_is_pruned() {
    let url = db!();
    let w = world(&url, deployment(None, None), json!({"default": "allow"})).await;
    let (gw, api) = (&w.gw, &w.api);
    let body = json!({"template": "base", "policy": {"default": "deny"}});
    let id = created(api, gw, FEDERATED, body).await;
    let candidate = json!({"default": "deny", "allow": [{"domain": "new.example.test"}]});
    shadow_put(api, &id, &candidate).await;
    let (s, v) = path(
        api,
        "DELETE",
        &format!("/v1/sandboxes/{id}"),
        FEDERATED,
        None,
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let pool = egress_controller::store::connect(&url)
        .await
        .expect("store");
    let rows = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM sandbox_shadows WHERE sandbox = $1")
            .bind(&id)
            .fetch_one(&pool)
            .await
            .expect("count")
    };
    assert_eq!(rows().await, 1, "kept until the gateway has forgotten it");
    let zero = Duration::ZERO;
    for _ in 0..100 {
        egress_controller::store::prune(&pool, zero, zero, 1000)
            .await
            .expect("prune");
        if rows().await == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(rows().await, 0, "pruned once its gateway forgot it");
}
