//! Creates: admission of `X-Space-Egress-Profiles`, queued composition,
//! idempotency, E2B translation, the admission metric, retries.

use serde_json::{json, Value};

use crate::db;
use crate::support::*;

const TEMPLATE: &str = r#"{"default": "deny", "tls_interception": "on"}"#;

fn template() -> Value {
    serde_json::from_str(TEMPLATE).expect("json")
}

async fn create(
    api: &ApiProcess,
    token: &str,
    headers: &[(&str, &str)],
    body: Value,
) -> (u16, Value) {
    call(
        api.addr,
        "POST",
        "/v1/sandboxes",
        Some(token),
        headers,
        Some(body),
    )
    .await
}

#[tokio::test]
async fn a_native_create_is_queued_composed_at_execution_and_pushed_to_its_gateway() {
    let url = db!();
    let w = world(
        &url,
        deployment(Some(PROFILES), Some(EXEMPTIONS)),
        template(),
    )
    .await;
    let (gw, api) = (&w.gw, &w.api);

    // A worker named that is none: refused at once, naming it (before, it
    // was queued, retried for minutes, and the sandbox failed).
    let body = json!({"template": "base", "worker": "nope"});
    let (s, v) = create(api, FEDERATED, &[], body).await;
    assert_eq!(s, 400, "{v}");
    assert_eq!(
        v["error"],
        json!("worker: \"nope\" is not registered"),
        "{v}"
    );

    let (s, v) = create(
        api,
        FEDERATED,
        &[("X-Space-Egress-Profiles", "+sensor")],
        json!({"template": "base"}),
    )
    .await;
    assert_eq!(s, 202, "{v}");
    let op = settled(api, FEDERATED, v["operation"].as_str().expect("op")).await;
    assert_eq!(op["state"], json!("succeeded"), "{op}");
    let id = v["sandbox"].as_str().expect("id");
    let (_, doc) = call(
        api.addr,
        "GET",
        &format!("/v1/sandboxes/{id}"),
        Some(FEDERATED),
        &[],
        None,
    )
    .await;
    assert_eq!(
        doc["egress_profiles"],
        json!(["audit", "sensor"]),
        "defaults plus the selection: {doc}"
    );
    assert_eq!(doc["state"], json!("running"));
    assert_eq!(doc["addresses"], json!(["100.64.10.1"]));
    assert_eq!(
        doc["inherits_template"],
        json!(false),
        "composition added rules"
    );
    let allow = &doc["policy"]["allow"];
    for d in [
        json!({"domain": "audit.example.test"}),
        json!({"domain": "sensor.example.test"}),
        json!({"ip": "8.8.8.8"}),
    ] {
        assert!(
            allow.as_array().is_some_and(|a| a.contains(&d)),
            "{d} in {allow}"
        );
    }
    let exemptions = &doc["policy"]["tls_interception_exemptions"];
    assert_eq!(
        exemptions,
        &json!([{"domain": "sensor.example.test"}, {"wildcard_domain": "*.relay.example.test"}]),
        "profile then deployment exemptions"
    );
    assert!(
        doc["provenance"]
            .as_array()
            .is_some_and(|p| p.iter().any(|a| a["source"] == json!("profile:sensor"))),
        "{doc}"
    );
    let pushed = on_gateway(gw, id).await;
    assert_eq!(
        pushed["policy"], doc["policy"],
        "the gateway enforces the saved policy"
    );
    assert_eq!(pushed["addresses"], json!(["100.64.10.1"]));
}

#[tokio::test]
async fn header_errors_are_400_with_their_reason_and_count_as_invalid_requests() {
    let url = db!();
    let api = api(&url, deployment(Some(PROFILES), None)).await;
    let (s, _) = call(
        api.addr,
        "PUT",
        "/v1/templates/base",
        Some(ADMIN),
        &[],
        Some(json!({"policy": template()})),
    )
    .await;
    assert_eq!(s, 200);
    for (header, reason) in [
        ("", "empty"),
        ("sensor", "malformed"),
        ("+sensor  -audit", "malformed"),
        ("+sensor\t-audit", "malformed"),
        ("+sensor +sensor", "repeated"),
        ("+sensor -sensor", "conflicting"),
        ("+nope", "unknown"),
    ] {
        let (s, v) = create(
            &api,
            FEDERATED,
            &[("X-Space-Egress-Profiles", header)],
            json!({"template": "base"}),
        )
        .await;
        assert_eq!(
            (s, v["reason"].clone()),
            (400, json!(reason)),
            "{header:?}: {v}"
        );
    }
    let (_, metrics) = call(api.addr, "GET", "/metrics", None, &[], None).await;
    let text = metrics.as_str().unwrap_or_default().to_owned();
    assert!(
        text.contains(r#"space_sandbox_egress_profile_admission_total{profile="unknown",outcome="failed",reason="invalid_request"} 5"#),
        "{text}"
    );
    // Repeated and conflicting tokens name a configured (trusted) profile.
    assert!(
        text.contains(r#"space_sandbox_egress_profile_admission_total{profile="sensor",outcome="failed",reason="invalid_request"} 2"#),
        "{text}"
    );
}

#[tokio::test]
async fn a_non_federated_create_ignores_the_header_and_applies_no_profiles_not_even_defaults() {
    let url = db!();
    let w = world(&url, deployment(Some(PROFILES), None), template()).await;
    let api = &w.api;
    let (s, v) = create(
        api,
        PLAIN,
        &[("X-Space-Egress-Profiles", "+sensor")],
        json!({"template": "base"}),
    )
    .await;
    assert_eq!(s, 202, "{v}");
    settled(api, PLAIN, v["operation"].as_str().expect("op")).await;
    let id = v["sandbox"].as_str().expect("id");
    let (_, doc) = call(
        api.addr,
        "GET",
        &format!("/v1/sandboxes/{id}"),
        Some(PLAIN),
        &[],
        None,
    )
    .await;
    assert_eq!(
        doc["egress_profiles"],
        json!([]),
        "an explicit empty array: {doc}"
    );
    let normal = serde_json::to_value(egress_policy::Policy::from_json(TEMPLATE).expect("policy"))
        .expect("json");
    assert_eq!(doc["policy"], normal, "the template's policy, untouched");
    assert_eq!(doc["inherits_template"], json!(true));
    let text = api.metrics.encode();
    assert!(
        text.contains(r#"{profile="unknown",outcome="failed",reason="invalid_request"} 1"#),
        "{text}"
    );
    // Another tenant cannot see it.
    let (s, _) = call(
        api.addr,
        "GET",
        &format!("/v1/sandboxes/{id}"),
        Some(FEDERATED),
        &[],
        None,
    )
    .await;
    assert_eq!(s, 404);
}

#[tokio::test]
async fn the_admission_metric_reports_ok_ready_per_selected_profile() {
    let url = db!();
    let api = api(&url, deployment(Some(PROFILES), None)).await;
    call(
        api.addr,
        "PUT",
        "/v1/templates/base",
        Some(ADMIN),
        &[],
        Some(json!({"policy": template()})),
    )
    .await;
    let (s, _) = create(
        &api,
        FEDERATED,
        &[("X-Space-Egress-Profiles", "+sensor")],
        json!({"template": "base"}),
    )
    .await;
    assert_eq!(s, 202);
    let (s, _) = create(&api, FEDERATED, &[], json!({"template": "base"})).await;
    assert_eq!(s, 202);
    let text = api.metrics.encode();
    for line in [
        r#"space_sandbox_egress_profile_admission_total{profile="audit",outcome="ok",reason="ready"} 2"#,
        r#"space_sandbox_egress_profile_admission_total{profile="sensor",outcome="ok",reason="ready"} 1"#,
    ] {
        assert!(text.contains(line), "{line} in {text}");
    }
}

#[tokio::test]
async fn idempotent_replays_match_on_body_and_nonempty_selections_only() {
    let url = db!();
    let with = api(&url, deployment(Some(PROFILES), None)).await;
    let without = api(&url, deployment(None, None)).await;
    call(
        with.addr,
        "PUT",
        "/v1/templates/base",
        Some(ADMIN),
        &[],
        Some(json!({"policy": template()})),
    )
    .await;
    let body = json!({"template": "base"});
    // Same key, same body, same selection: the original result.
    let (s1, first) = create(
        &with,
        FEDERATED,
        &[
            ("Idempotency-Key", "k1"),
            ("X-Space-Egress-Profiles", "+sensor"),
        ],
        body.clone(),
    )
    .await;
    let (s2, again) = create(
        &with,
        FEDERATED,
        &[
            ("Idempotency-Key", "k1"),
            ("X-Space-Egress-Profiles", "+sensor"),
        ],
        body.clone(),
    )
    .await;
    assert_eq!((s1, s2), (202, 202));
    assert_eq!(first, again, "a replay returns the original operation");
    // A different selection is a different request.
    let (s, v) = create(
        &with,
        FEDERATED,
        &[
            ("Idempotency-Key", "k1"),
            ("X-Space-Egress-Profiles", "-audit"),
        ],
        body.clone(),
    )
    .await;
    assert_eq!(s, 409, "{v}");
    let (s, _) = create(
        &with,
        FEDERATED,
        &[("Idempotency-Key", "k1")],
        json!({"template": "base", "policy": {"default": "allow"}}),
    )
    .await;
    assert_eq!(s, 409, "a different body");
    // An empty selection keeps the fingerprint a create without profiles had:
    // a key first used where no profiles are configured replays here.
    let (s, old) = create(
        &without,
        FEDERATED,
        &[("Idempotency-Key", "k2")],
        body.clone(),
    )
    .await;
    assert_eq!(s, 202);
    let (s, replay) = create(
        &with,
        FEDERATED,
        &[
            ("Idempotency-Key", "k2"),
            ("X-Space-Egress-Profiles", "-audit"),
        ],
        body.clone(),
    )
    .await;
    assert_eq!((s, replay), (202, old));
    // Keys are per tenant.
    let (s, other) = create(&with, PLAIN, &[("Idempotency-Key", "k1")], body).await;
    assert_eq!(s, 202);
    assert_ne!(other["operation"], first["operation"]);
}

#[tokio::test]
async fn queued_creates_retry_a_missing_definition_within_the_attempt_and_deadline_limits() {
    let url = db!();
    let dir = tempfile::tempdir().expect("dir");
    let gw = gateway(dir.path(), "127.0.0.1:0").await;
    let api = api(&url, deployment(Some(PROFILES), None)).await;
    setup(&api, template(), gw.bound().admin, "100.64.10.0/24").await;
    // The dispatcher lacks `sensor`: every attempt is a 503 for it.
    let stale = deployment(
        Some(r#"{"audit": {"default": true, "allow": [{"domain": "audit.example.test"}]}}"#),
        None,
    );
    let dispatcher_task = dispatcher(&url, stale.clone(), limits(3, 60_000, 50)).await;
    let (_, v) = create(
        &api,
        FEDERATED,
        &[("X-Space-Egress-Profiles", "+sensor")],
        json!({"template": "base"}),
    )
    .await;
    let op = settled(&api, FEDERATED, v["operation"].as_str().expect("op")).await;
    assert_eq!(
        (op["state"].clone(), op["attempts"].clone()),
        (json!("failed"), json!(3)),
        "{op}"
    );
    assert!(
        op["error"]
            .as_str()
            .is_some_and(|e| e.contains("sensor") && e.contains("503")),
        "{op}"
    );
    let id = v["sandbox"].as_str().expect("id");
    let (_, doc) = call(
        api.addr,
        "GET",
        &format!("/v1/sandboxes/{id}"),
        Some(FEDERATED),
        &[],
        None,
    )
    .await;
    assert_eq!(doc["state"], json!("failed"));
    let text = dispatcher_task.metrics.encode();
    assert!(
        text.contains(r#"{profile="sensor",outcome="failed",reason="unconfigured"} 3"#),
        "{text}"
    );
    drop(dispatcher_task);
    // The deadline ends retries before the attempts do.
    let _d = dispatcher(&url, stale, limits(1_000, 400, 100)).await;
    let (_, v) = create(
        &api,
        FEDERATED,
        &[("X-Space-Egress-Profiles", "+sensor")],
        json!({"template": "base"}),
    )
    .await;
    let op = settled(&api, FEDERATED, v["operation"].as_str().expect("op")).await;
    assert_eq!(op["state"], json!("failed"));
    let attempts = op["attempts"].as_i64().unwrap_or(0);
    assert!(
        (1..10).contains(&attempts),
        "stopped by the deadline after {attempts}"
    );
}

#[tokio::test]
async fn an_e2b_create_is_translated_and_composed_by_the_api() {
    let url = db!();
    let dir = tempfile::tempdir().expect("dir");
    let gw = gateway(dir.path(), "127.0.0.1:0").await;
    let d = deployment(Some(PROFILES), Some(EXEMPTIONS));
    let api = api(&url, d.clone()).await;
    setup(
        &api,
        json!({"default": "allow", "tls_interception": "on"}),
        gw.bound().admin,
        "100.64.10.0/24",
    )
    .await;
    let _dispatcher = dispatcher(&url, d, limits(5, 60_000, 100)).await;
    let body = json!({"templateID": "base", "timeout": 300, "network": {"allowOut": ["1.1.1.1"], "denyOut": ["0.0.0.0/0"]}});
    let (s, v) = call(
        api.addr,
        "POST",
        "/sandboxes",
        Some(FEDERATED),
        &[("X-Space-Egress-Profiles", "-audit")],
        Some(body),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    assert_eq!(v["templateID"], json!("base"));
    let id = v["sandboxID"].as_str().expect("id");
    let (_, doc) = call(
        api.addr,
        "GET",
        &format!("/v1/sandboxes/{id}"),
        Some(FEDERATED),
        &[],
        None,
    )
    .await;
    assert_eq!(
        doc["state"],
        json!("running"),
        "composed and placed at once: {doc}"
    );
    assert_eq!(doc["policy"]["default"], json!("deny"));
    assert_eq!(doc["policy"]["allow"], json!([{"ip": "1.1.1.1"}]));
    on_gateway(&gw, id).await;
    // No exact translation: 400 with the reason.
    let body = json!({"templateID": "base", "network": {"allowOut": ["api.example.test"], "denyOut": ["203.0.113.0/24"]}});
    let (s, v) = call(
        api.addr,
        "POST",
        "/sandboxes",
        Some(FEDERATED),
        &[],
        Some(body),
    )
    .await;
    assert_eq!(s, 400);
    assert!(
        v["error"]
            .as_str()
            .is_some_and(|e| e.contains("cannot translate exactly")),
        "{v}"
    );
    let (s, _) = call(
        api.addr,
        "POST",
        "/sandboxes",
        Some(FEDERATED),
        &[],
        Some(json!({"templateID": "base", "bogus": 1})),
    )
    .await;
    assert_eq!(s, 400);
}

/// An E2B create with an `Idempotency-Key` (composed in the request, not
/// from a warm pool) retried gets the original sandbox, not a second one;
/// another body under the key is `409`; keys are per tenant.
#[tokio::test]
async fn an_e2b_create_retried_with_its_idempotency_key_gets_the_original_sandbox() {
    let url = db!();
    let api = api(&url, deployment(None, None)).await;
    // A worker that is never reached: an E2B create is placed by the API.
    setup(&api, template(), free_addr(), "100.64.10.0/24").await;
    let e2b = |token: &'static str, key: &'static str, body: Value| {
        let addr = api.addr;
        async move {
            let headers = [("Idempotency-Key", key)];
            call(
                addr,
                "POST",
                "/sandboxes",
                Some(token),
                &headers,
                Some(body),
            )
            .await
        }
    };
    let body = json!({"templateID": "base", "network": {"allowOut": ["1.1.1.1"], "denyOut": ["0.0.0.0/0"]}});
    let (s1, first) = e2b(FEDERATED, "e1", body.clone()).await;
    let (s2, again) = e2b(FEDERATED, "e1", body.clone()).await;
    assert_eq!((s1, s2), (201, 201), "{first} {again}");
    assert_eq!(first, again, "a retry gets the original sandbox");
    let (s, other) = e2b(FEDERATED, "e1", json!({"templateID": "base"})).await;
    assert_eq!(s, 409, "{other}");
    let (s, theirs) = e2b(PLAIN, "e1", body.clone()).await;
    assert_eq!(s, 201, "{theirs}");
    assert_ne!(theirs["sandboxID"], first["sandboxID"]);
    // At a tenant's last place (t3 holds at most 2), a retry racing the
    // create it retries waits for it and replays it, rather than count the
    // place it took (429).
    let (s, v) = e2b(QUOTA, "q0", body.clone()).await;
    assert_eq!(s, 201, "{v}");
    let (a, b) = tokio::join!(e2b(QUOTA, "q1", body.clone()), e2b(QUOTA, "q1", body));
    assert_eq!((a.0, b.0), (201, 201), "{} {}", a.1, b.1);
    assert_eq!(a.1, b.1);
    let (_, list) = call(api.addr, "GET", "/v1/sandboxes", Some(FEDERATED), &[], None).await;
    let ids: Vec<&str> = list["sandboxes"]
        .as_array()
        .expect("sandboxes")
        .iter()
        .filter_map(|s| s["id"].as_str())
        .collect();
    assert_eq!(ids, [first["sandboxID"].as_str().expect("id")], "{list}");
}

/// An E2B create whose translation (its entries in normal form) makes a
/// document larger than a gateway takes is refused `400`, naming the size:
/// acknowledged, it would run with nothing pushed.
#[tokio::test]
async fn an_e2b_create_too_large_for_a_gateway_is_refused() {
    let url = db!();
    let gw = crate::fake_gateway::FakeGateway::start().await;
    let api = allow_all_api(&url, gw.addr, "100.64.22.0/24").await;
    let body = oversized_e2b_create();
    assert!(body.to_string().len() < egress_api::body::MAX_BODY);
    let (s, v) = call(
        api.addr,
        "POST",
        "/sandboxes",
        Some(FEDERATED),
        &[],
        Some(body),
    )
    .await;
    assert_eq!(s, 400, "{v}");
    assert!(
        v["error"]
            .as_str()
            .is_some_and(|e| e.contains("network: ") && e.contains("bytes in normal form")),
        "{v}"
    );
}

/// An E2B create that says nothing of the network gets the template's
/// policy, as a native create without one does. (Before: `default: allow`
/// whatever the template said.)
#[tokio::test]
async fn an_e2b_create_silent_on_the_network_inherits_its_template() {
    let url = db!();
    let w = world(
        &url,
        deployment(None, None),
        json!({"default": "deny", "tls_interception": "on"}),
    )
    .await;
    let (s, v) = call(
        w.api.addr,
        "POST",
        "/sandboxes",
        Some(FEDERATED),
        &[],
        Some(json!({"templateID": "base"})),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    let id = v["sandboxID"].as_str().expect("id");
    let (s, doc) = call(
        w.api.addr,
        "GET",
        &format!("/v1/sandboxes/{id}"),
        Some(FEDERATED),
        &[],
        None,
    )
    .await;
    assert_eq!(s, 200, "{doc}");
    assert_eq!(doc["inherits_template"], json!(true), "{doc}");
    assert_eq!(doc["policy"]["default"], json!("deny"), "{doc}");
}

/// A rolling upgrade: the schema has a migration a newer build applied; a
/// replica of this (older) build restarting against it still starts, and
/// still serves its API.
#[tokio::test]
async fn an_old_replica_starts_against_a_newer_schema() {
    use sqlx::Executor;
    let url = db!();
    let pool = egress_controller::store::connect(&url)
        .await
        .expect("first start");
    // What a newer build's migration leaves: an added column and its row
    // in sqlx's table, with a version this build does not have.
    pool.execute("ALTER TABLE sandboxes ADD COLUMN added_by_a_newer_build TEXT")
        .await
        .expect("alter");
    pool.execute(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES (99990101000000, 'a newer build', true, '\\x00'::bytea, 1)",
    )
    .await
    .expect("record the newer migration");
    pool.close().await;
    let again = egress_controller::store::connect(&url).await;
    assert!(again.is_ok(), "{:?}", again.err());
    // Its API reads the sandboxes table as it now is.
    let api = api(&url, deployment(None, None)).await;
    let (s, v) = call(
        api.addr,
        "GET",
        "/v1/sandboxes/sb-none",
        Some(FEDERATED),
        &[],
        None,
    )
    .await;
    assert_eq!(s, 404, "{v}");
    assert_ne!(v["error"], json!("no such route"), "{v}");
}

/// Work wakes the dispatcher: a queued create notifies `egress_work` (so
/// the leader runs it without waiting for its idle timer), and so does a
/// sandbox whose policy moves a generation.
#[tokio::test]
async fn queued_work_and_policy_changes_notify_the_dispatcher() {
    let url = db!();
    let w = world(&url, deployment(None, None), template()).await;
    let mut listener = sqlx::postgres::PgListener::connect(&url)
        .await
        .expect("listener");
    listener.listen("egress_work").await.expect("listen");
    let (s, v) = create(&w.api, FEDERATED, &[], json!({"template": "base"})).await;
    assert_eq!(s, 202, "{v}");
    assert_eq!(next(&mut listener).await.channel(), "egress_work");
    let op = settled(&w.api, FEDERATED, v["operation"].as_str().expect("op")).await;
    assert_eq!(op["state"], json!("succeeded"), "{op}");
    while listener.next_buffered().is_some() {}
    // A network replacement saves a new generation: another notification.
    let id = v["sandbox"].as_str().expect("id");
    let (s, v) = call(
        w.api.addr,
        "PUT",
        &format!("/v1/sandboxes/{id}/network"),
        Some(FEDERATED),
        &[],
        Some(json!({"policy": {"default": "deny"}})),
    )
    .await;
    assert!(s == 200 || s == 202, "{s} {v}");
    assert_eq!(next(&mut listener).await.channel(), "egress_work");
}

/// The next notification on `l`, within 5 s.
async fn next(l: &mut sqlx::postgres::PgListener) -> sqlx::postgres::PgNotification {
    tokio::time::timeout(std::time::Duration::from_secs(5), l.recv())
        .await
        .expect("a notification within 5 s")
        .expect("recv")
}

/// A sandbox destroyed while its create waits in the queue stays destroyed:
/// the create fails saying so, and no gateway hears of the sandbox. It was
/// placed before, on an address, marked running and pushed.
#[tokio::test]
async fn a_create_queued_for_a_sandbox_destroyed_meanwhile_does_nothing() {
    let url = db!();
    let d = deployment(Some(PROFILES), Some(EXEMPTIONS));
    let dir = tempfile::tempdir().expect("dir");
    let gw = gateway(dir.path(), "127.0.0.1:0").await;
    let api = api(&url, d.clone()).await;
    setup(&api, template(), gw.bound().admin, "100.64.10.0/24").await;
    // No dispatcher yet: the create waits.
    let (s, v) = create(&api, FEDERATED, &[], json!({"template": "base"})).await;
    assert_eq!(s, 202, "{v}");
    let id = v["sandbox"].as_str().expect("id").to_owned();
    let (s, gone) = call(
        api.addr,
        "DELETE",
        &format!("/v1/sandboxes/{id}"),
        Some(FEDERATED),
        &[],
        None,
    )
    .await;
    assert_eq!(s, 200, "{gone}");
    let _dispatcher = dispatcher(&url, d, limits(5, 60_000, 100)).await;
    let op = settled(&api, FEDERATED, v["operation"].as_str().expect("op")).await;
    assert_eq!(op["state"], json!("failed"), "{op}");
    assert!(op.to_string().contains("destroyed: not created"), "{op}");
    let (_, doc) = call(
        api.addr,
        "GET",
        &format!("/v1/sandboxes/{id}"),
        Some(FEDERATED),
        &[],
        None,
    )
    .await;
    assert_eq!(doc["state"], json!("destroyed"), "{doc}");
    assert_eq!(doc["addresses"], json!([]), "{doc}");
    assert!(gw
        .registry()
        .get(&egress_policy::SandboxId::new(&id))
        .is_none());
}

/// A tenant holds at most its `max_sandboxes` at once: a create (native or
/// E2B) or a fork past it is `429`, a destroyed sandbox frees its place,
/// and creates racing at the limit do not both pass. One tenant could take
/// every worker's addresses before.
#[tokio::test]
async fn a_tenant_holds_at_most_its_max_sandboxes() {
    let url = db!();
    let w = world(
        &url,
        deployment(Some(PROFILES), Some(EXEMPTIONS)),
        template(),
    )
    .await;
    let api = &w.api;
    let mut ids = Vec::new();
    for _ in 0..2 {
        let (s, v) = create(api, QUOTA, &[], json!({"template": "base"})).await;
        assert_eq!(s, 202, "{v}");
        let op = settled(api, QUOTA, v["operation"].as_str().expect("op")).await;
        assert_eq!(op["state"], json!("succeeded"), "{op}");
        ids.push(v["sandbox"].as_str().expect("id").to_owned());
    }
    let (s, v) = create(api, QUOTA, &[], json!({"template": "base"})).await;
    assert_eq!(s, 429, "{v}");
    assert!(v.to_string().contains("max_sandboxes (2)"), "{v}");
    let e2b = json!({"templateID": "base"});
    let (s, v) = call(api.addr, "POST", "/sandboxes", Some(QUOTA), &[], Some(e2b)).await;
    assert_eq!(s, 429, "{v}");
    let fork = format!("/v1/sandboxes/{}/fork", ids[0]);
    let (s, v) = call(api.addr, "POST", &fork, Some(QUOTA), &[], None).await;
    assert_eq!(s, 429, "{v}");
    // An admin's fork is the sandbox owner's: counted against t3's.
    let (s, v) = call(api.addr, "POST", &fork, Some(ADMIN), &[], None).await;
    assert_eq!(s, 429, "{v}");
    assert!(
        v["error"].as_str().is_some_and(|e| e.contains("\"t3\"")),
        "{v}"
    );
    // Another tenant is not held back by t3's.
    let (s, v) = create(api, FEDERATED, &[], json!({"template": "base"})).await;
    assert_eq!(s, 202, "{v}");
    let gone = format!("/v1/sandboxes/{}", ids[0]);
    let (s, v) = call(api.addr, "DELETE", &gone, Some(QUOTA), &[], None).await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = create(api, QUOTA, &[], json!({"template": "base"})).await;
    assert_eq!(s, 202, "a destroyed sandbox frees its place: {v}");

    let racing = (0..8).map(|_| {
        let addr = api.addr;
        tokio::spawn(async move {
            let body = Some(json!({"template": "base"}));
            call(addr, "POST", "/v1/sandboxes", Some(QUOTA_RACE), &[], body).await
        })
    });
    let mut created = 0;
    for r in futures::future::join_all(racing).await {
        let (s, v) = r.expect("task");
        assert!(s == 202 || s == 429, "{s} {v}");
        created += usize::from(s == 202);
    }
    assert_eq!(created, 3, "creates racing at the limit");
}

/// A worker's gateway that does not answer is a 502 whose text names its
/// admin URL only to an admin: a tenant reads that it did not answer (the
/// URL is the one the controller reaches with the worker's token).
/// A worker whose pool is used up sends a placement on to the next least
/// loaded one: creates go on while any worker has room. They failed
/// before, once the full worker was the least loaded (ties go by id).
#[tokio::test]
async fn a_full_worker_sends_placements_to_one_with_room() {
    let url = db!();
    let api = api(&url, deployment(Some(PROFILES), Some(EXEMPTIONS))).await;
    let down = free_addr();
    let template = json!({"default": "allow", "tls_interception": "on"});
    // w1 has two addresses, w2 254.
    setup(&api, template, down, "100.64.10.0/30").await;
    let worker = json!({"admin_url": format!("http://{}", free_addr()), "token": "", "pool": "100.64.11.0/24"});
    let (s, v) = call(
        api.addr,
        "PUT",
        "/v1/workers/w2",
        Some(ADMIN),
        &[],
        Some(worker),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let mut on = std::collections::BTreeMap::<String, usize>::new();
    for _ in 0..6 {
        // An E2B create is placed by the API itself: no dispatcher, no push.
        let body = Some(json!({"templateID": "base"}));
        let (s, v) = call(api.addr, "POST", "/sandboxes", Some(FEDERATED), &[], body).await;
        assert_eq!(s, 201, "{v}");
        let path = format!("/v1/sandboxes/{}", v["sandboxID"].as_str().expect("id"));
        let (_, doc) = call(api.addr, "GET", &path, Some(FEDERATED), &[], None).await;
        *on.entry(doc["worker"].as_str().expect("worker").to_owned())
            .or_default() += 1;
    }
    assert_eq!(on.get("w1"), Some(&2), "{on:?}");
    assert_eq!(on.get("w2"), Some(&4), "{on:?}");
}

/// Two workers cannot be registered with one gateway: each worker's
/// dispatcher task resyncs its gateway to that worker's sandboxes alone,
/// so the two would undo each other's, and a sandbox of one would lose its
/// policy at every resync of the other. Before, the second was `200`.
#[tokio::test]
async fn two_workers_cannot_share_one_gateway() {
    let url = db!();
    let api = api(&url, deployment(Some(PROFILES), Some(EXEMPTIONS))).await;
    let (one, two) = (free_addr(), free_addr());
    setup(&api, json!({"default": "allow"}), one, "100.64.10.0/24").await;
    let put = |id: &'static str, admin_url: String| {
        let body = json!({"admin_url": admin_url, "token": "", "pool": "100.64.11.0/24"});
        let api = api.addr;
        async move {
            let path = format!("/v1/workers/{id}");
            call(api, "PUT", &path, Some(ADMIN), &[], Some(body)).await
        }
    };
    // The same gateway, its URL written with a trailing slash.
    let (s, v) = put("w2", format!("http://{one}/")).await;
    assert_eq!(s, 409, "{v}");
    assert_eq!(v["field"], "admin_url", "{v}");
    let said = v["error"].as_str().unwrap_or_default();
    assert!(said.contains("worker \"w1\""), "{v}");
    // Its own registration again is no conflict; another gateway is none.
    let (s, v) = put("w1", format!("http://{one}")).await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = put("w2", format!("http://{two}")).await;
    assert_eq!(s, 200, "{v}");
    // Nor may a worker move onto another's gateway; it keeps its own.
    let (s, v) = put("w2", format!("http://{one}")).await;
    assert_eq!(s, 409, "{v}");
    let (_, listed) = call(api.addr, "GET", "/v1/workers", Some(ADMIN), &[], None).await;
    assert!(
        listed.to_string().contains(&format!("http://{two}")),
        "{listed}"
    );
    let sharing = |listed: &Value| -> Vec<Value> {
        let workers = listed["workers"].as_array().cloned().unwrap_or_default();
        workers
            .iter()
            .map(|w| w["shares_gateway_with"].clone())
            .collect()
    };
    assert_eq!(sharing(&listed), [json!([]), json!([])], "{listed}");
    // A store written before the check may hold two on one gateway (its
    // name written two ways): the list says so of each.
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(&url).await.expect("connect");
    let same = |name: &str| format!("http://{name}:{}", one.port());
    let written = [
        ("w2", same("localhost"), "100.64.11.0/24"),
        ("w3", same("LOCALHOST."), "100.64.12.0/24"),
    ];
    for (id, same, pool) in written {
        sqlx::query("INSERT INTO workers (id, admin_url, token, pool) VALUES ($1, $2, '', $3) ON CONFLICT (id) DO UPDATE SET admin_url = EXCLUDED.admin_url")
            .bind(id)
            .bind(&same)
            .bind(pool)
            .execute(&mut conn)
            .await
            .expect("written");
    }
    let (_, listed) = call(api.addr, "GET", "/v1/workers", Some(ADMIN), &[], None).await;
    assert_eq!(
        sharing(&listed),
        [json!([]), json!(["w3"]), json!(["w2"])],
        "{listed}"
    );
}

#[tokio::test]
async fn a_tenant_is_not_shown_a_workers_admin_url() {
    let url = db!();
    let api = api(&url, deployment(Some(PROFILES), Some(EXEMPTIONS))).await;
    let down = free_addr();
    setup(
        &api,
        json!({"default": "allow", "tls_interception": "on"}),
        down,
        "100.64.10.0/24",
    )
    .await;
    // An E2B create is placed by the API itself: no dispatcher, no push.
    let body = json!({"templateID": "base"});
    let (s, v) = call(
        api.addr,
        "POST",
        "/sandboxes",
        Some(FEDERATED),
        &[],
        Some(body),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    let id = v["sandboxID"].as_str().expect("id");
    let explain = format!("/v1/sandboxes/{id}/explain");
    let question = || Some(json!({"dst": "203.0.113.7:443"}));
    let (s, v) = call(api.addr, "POST", &explain, Some(FEDERATED), &[], question()).await;
    assert_eq!(s, 502, "{v}");
    assert!(!v.to_string().contains(&down.to_string()), "{v}");
    assert!(v.to_string().contains("did not answer"), "{v}");
    let (s, v) = call(api.addr, "POST", &explain, Some(ADMIN), &[], question()).await;
    assert_eq!(s, 502, "{v}");
    assert!(
        v.to_string().contains(&down.to_string()),
        "an admin reads where: {v}"
    );
}

/// A template this build cannot read (a newer build's, during a rolling
/// upgrade) is a `503` to retry, not `400 … is not registered`, which no
/// client retries.
#[tokio::test]
async fn a_template_this_build_cannot_read_is_a_503_to_retry() {
    use sqlx::Connection;
    let url = db!();
    let w = world(&url, deployment(None, None), template()).await;
    let mut conn = sqlx::PgConnection::connect(&url).await.expect("connect");
    sqlx::query("UPDATE templates SET policy = $1 WHERE id = 'base'")
        .bind(sqlx::types::Json(
            json!({"default": "deny", "a_field_of_a_newer_build": 1}),
        ))
        .execute(&mut conn)
        .await
        .expect("saved");
    let (s, v) = create(&w.api, FEDERATED, &[], json!({"template": "base"})).await;
    assert_eq!(s, 503, "{v}");
    let said = v["error"].as_str().unwrap_or_default();
    assert!(
        said.contains("does not read here") && said.contains("retry"),
        "{v}"
    );
}

/// A sandbox whose stored policy this build cannot read (a newer build
/// wrote it, during a rolling upgrade) is forgotten by its gateway, its
/// traffic denied, but its change stays unpushed, through pushes and
/// resyncs alike, so that a dispatcher of the newer build pushes it.
/// Before, the DELETE marked the change pushed (and so did a resync that
/// left the sandbox out): after the upgrade no dispatcher pushed it again,
/// and the sandbox stayed denied everything until its next change.
#[tokio::test]
async fn a_policy_this_build_cannot_read_stays_unpushed_and_its_sandbox_denied() {
    use sqlx::Connection;
    let url = db!();
    let w = world(&url, deployment(None, None), template()).await;
    let (s, v) = create(&w.api, FEDERATED, &[], json!({"template": "base"})).await;
    assert_eq!(s, 202, "{v}");
    let op = settled(&w.api, FEDERATED, v["operation"].as_str().expect("op")).await;
    assert_eq!(op["state"], json!("succeeded"), "{op}");
    let id = v["sandbox"].as_str().expect("id").to_owned();
    on_gateway(&w.gw, &id).await;
    let mut conn = sqlx::PgConnection::connect(&url).await.expect("connect");
    sqlx::query(
        "UPDATE sandboxes SET policy = $2, generation = generation + 1, changed_at = now() WHERE id = $1",
    )
    .bind(&id)
    .bind(sqlx::types::Json(
        json!({"default": "allow", "a_field_of_a_newer_build": 1}),
    ))
    .execute(&mut conn)
    .await
    .expect("saved");
    sqlx::query("SELECT pg_notify('egress_work', '')")
        .execute(&mut conn)
        .await
        .expect("notified");
    let sid = egress_policy::SandboxId::new(&id);
    // Until the gateway forgot it and the push's outcome is recorded: the
    // worker's error, or (before) the change marked pushed.
    let mut said = false;
    for _ in 0..200 {
        let error: Option<String> =
            sqlx::query_scalar("SELECT last_error FROM workers WHERE id = 'w1'")
                .fetch_one(&mut conn)
                .await
                .expect("worker");
        // Naming the sandbox, and the field this build does not know.
        said = error.is_some_and(|e| {
            e.contains(&id) && e.contains("does not read") && e.contains("a_field_of_a_newer_build")
        });
        let forgotten = w.gw.registry().get(&sid).is_none();
        if forgotten && (said || behind(&mut conn, &id).await == 0) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(
        w.gw.registry().get(&sid).is_none(),
        "the gateway still holds {id}"
    );
    assert_eq!(
        behind(&mut conn, &id).await,
        1,
        "the change is left for a build that reads it"
    );
    assert!(said, "the worker's error says why");
    // A resync leaves it out, and unpushed too.
    resynced(&mut conn).await;
    assert!(w.gw.registry().get(&sid).is_none(), "the resync sent {id}");
    assert_eq!(
        behind(&mut conn, &id).await,
        1,
        "the resync marked it pushed"
    );
    // A dispatcher of the newer build pushes it (here, by hand): this one's
    // drift checks do not take it for drift.
    sqlx::query("UPDATE sandboxes SET pushed_generation = generation WHERE id = $1")
        .bind(&id)
        .execute(&mut conn)
        .await
        .expect("pushed");
    let address: Vec<String> = sqlx::query_scalar("SELECT addresses FROM sandboxes WHERE id = $1")
        .bind(&id)
        .fetch_one(&mut conn)
        .await
        .expect("addresses");
    let doc = json!({"addresses": address, "policy": {"default": "allow"}});
    let path = format!("/v1/sandboxes/{id}");
    let (s, v) = call(w.gw.bound().admin, "PUT", &path, None, &[], Some(doc)).await;
    assert_eq!(s, 200, "{v}");
    // Its generation moved: each drift check (every 200 ms) fetches the
    // list and compares.
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    assert!(
        w.gw.registry().get(&sid).is_some(),
        "taken for drift and dropped"
    );
    assert_eq!(behind(&mut conn, &id).await, 0);
    // A resync for another cause leaves it out: queued again, for the
    // newer build to push.
    resynced(&mut conn).await;
    assert!(w.gw.registry().get(&sid).is_none(), "the resync sent {id}");
    for _ in 0..100 {
        if behind(&mut conn, &id).await == 1 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(behind(&mut conn, &id).await, 1, "left out, and settled");
}

/// Flags worker `w1` for a resync and waits until it is done and recorded.
async fn resynced(conn: &mut sqlx::PgConnection) {
    sqlx::query("UPDATE workers SET needs_resync = true WHERE id = 'w1'")
        .execute(&mut *conn)
        .await
        .expect("flagged");
    for _ in 0..200 {
        let flagged: bool = sqlx::query_scalar("SELECT needs_resync FROM workers WHERE id = 'w1'")
            .fetch_one(&mut *conn)
            .await
            .expect("worker");
        if !flagged {
            // The resync's rows are recorded just after the flag is cleared.
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("the worker was never resynced");
}

/// How many generations sandbox `id`'s gateway has not acknowledged.
async fn behind(conn: &mut sqlx::PgConnection, id: &str) -> i64 {
    sqlx::query_scalar("SELECT generation - pushed_generation FROM sandboxes WHERE id = $1")
        .bind(id)
        .fetch_one(conn)
        .await
        .expect("row")
}
