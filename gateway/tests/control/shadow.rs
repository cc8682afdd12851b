//! Shadow policies over the control API: validation and 404s, a push that
//! keeps the shadow, the shadow across a restart, promotion, and a deleted
//! sandbox taking its shadow with it.

use serde_json::json;

use crate::support::*;

const SANDBOX: &str = "127.0.0.2";
const ACTIVE: &str = r#"{"allow": [{"ip": "127.0.0.1"}]}"#;
const CANDIDATE: &str = r#"{"allow": [{"domain": "api.example.test"}]}"#;

async fn call(
    gw: &egress_gateway::Gateway,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> (u16, serde_json::Value) {
    let (status, body) = http(gw.bound().admin, method, path, None, body).await;
    (status, serde_json::from_str(&body).unwrap_or(json!(body)))
}

#[tokio::test]
async fn validation_and_not_found() {
    let dir = tempfile::tempdir().expect("dir");
    let gw = start(config(dir.path(), ""), echo().await).await;
    let shadow = format!(r#"{{"policy": {CANDIDATE}}}"#);
    let (status, _) = call(&gw, "PUT", "/v1/sandboxes/nope/shadow", Some(&shadow)).await;
    assert_eq!(status, 404, "no such sandbox");
    let push = format!(r#"{{"addresses": ["{SANDBOX}"], "policy": {ACTIVE}}}"#);
    assert_eq!(
        call(&gw, "PUT", "/v1/sandboxes/sb", Some(&push)).await.0,
        200
    );
    for (method, path) in [
        ("GET", "/v1/sandboxes/sb/shadow"),
        ("DELETE", "/v1/sandboxes/sb/shadow"),
        ("GET", "/v1/sandboxes/sb/shadow/report"),
        ("POST", "/v1/sandboxes/sb/shadow/promote"),
        ("GET", "/v1/sandboxes/nope/shadow/report"),
    ] {
        assert_eq!(
            call(&gw, method, path, None).await.0,
            404,
            "{method} {path}"
        );
    }
    let bad = r#"{"policy": {"allow": [{"domain": "not a name"}]}}"#;
    let (status, v) = call(&gw, "PUT", "/v1/sandboxes/sb/shadow", Some(bad)).await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["field"]
            .as_str()
            .unwrap_or("")
            .starts_with("policy.allow[0]"),
        "the field path like a push's: {v}"
    );
    let unknown = r#"{"policy": {}, "extra": 1}"#;
    let (status, _) = call(&gw, "PUT", "/v1/sandboxes/sb/shadow", Some(unknown)).await;
    assert_eq!(status, 400, "unknown fields are refused");
    assert_eq!(
        call(&gw, "GET", "/v1/sandboxes/sb/shadow", None).await.0,
        404,
        "nothing applied"
    );
    gw.run_until(async {}).await;
}

#[tokio::test]
async fn kept_by_pushes_and_restarts_promoted_and_deleted() {
    let dir = tempfile::tempdir().expect("dir");
    let origin = echo().await;
    let gw = start(config(dir.path(), ""), origin).await;
    let push = format!(r#"{{"addresses": ["{SANDBOX}"], "policy": {ACTIVE}}}"#);
    assert_eq!(
        call(&gw, "PUT", "/v1/sandboxes/sb", Some(&push)).await.0,
        200
    );
    let shadow = format!(r#"{{"policy": {CANDIDATE}}}"#);
    let (status, put) = call(&gw, "PUT", "/v1/sandboxes/sb/shadow", Some(&shadow)).await;
    assert_eq!(status, 200, "{put}");
    assert_eq!(put["sandbox"], "sb");
    assert_eq!(put["policy"]["allow"][0]["domain"], "api.example.test");
    assert!(
        put["since"].as_str().is_some_and(|s| s.ends_with('Z')),
        "{put}"
    );

    // A new push of the active policy keeps the shadow.
    assert_eq!(
        call(&gw, "PUT", "/v1/sandboxes/sb", Some(&push)).await.0,
        200
    );
    let (status, got) = call(&gw, "GET", "/v1/sandboxes/sb/shadow", None).await;
    assert_eq!((status, &got), (200, &put), "kept as it was");
    gw.run_until(async {}).await;

    // A restart keeps it too.
    let gw = start(config(dir.path(), ""), origin).await;
    let (status, got) = call(&gw, "GET", "/v1/sandboxes/sb/shadow", None).await;
    assert_eq!((status, &got), (200, &put), "restored from the journal");
    let (status, report) = call(&gw, "GET", "/v1/sandboxes/sb/shadow/report", None).await;
    assert_eq!(status, 200);
    assert_eq!(
        (report["flows"].clone(), report["since"].clone()),
        (json!(0), put["since"].clone())
    );
    // The report says it counts from the restart, not from `since`.
    let at = |v: &serde_json::Value| {
        let text = v.as_str().expect("a time");
        time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339)
            .expect("RFC 3339")
    };
    assert!(
        at(&report["counting_since"]) > at(&put["since"]),
        "{report}"
    );
    assert_eq!(report["evicted"], 0);

    // Promotion: the candidate is the policy, the addresses as they were.
    let (status, promoted) = call(&gw, "POST", "/v1/sandboxes/sb/shadow/promote", None).await;
    assert_eq!(status, 200, "{promoted}");
    assert_eq!(promoted["policy"], put["policy"]);
    assert_eq!(promoted["addresses"], json!([SANDBOX]));
    assert_eq!(
        call(&gw, "GET", "/v1/sandboxes/sb/shadow", None).await.0,
        404,
        "dropped"
    );
    assert_eq!(
        call(&gw, "GET", "/v1/sandboxes/sb", None).await.1["policy"],
        put["policy"]
    );

    // A deleted sandbox takes its shadow with it.
    assert_eq!(
        call(&gw, "PUT", "/v1/sandboxes/sb/shadow", Some(&shadow))
            .await
            .0,
        200
    );
    assert_eq!(
        call(&gw, "DELETE", "/v1/sandboxes/sb/shadow", None).await.0,
        200
    );
    assert_eq!(
        call(&gw, "GET", "/v1/sandboxes/sb/shadow", None).await.0,
        404
    );
    assert_eq!(
        call(&gw, "PUT", "/v1/sandboxes/sb/shadow", Some(&shadow))
            .await
            .0,
        200
    );
    assert_eq!(call(&gw, "DELETE", "/v1/sandboxes/sb", None).await.0, 200);
    assert_eq!(
        call(&gw, "PUT", "/v1/sandboxes/sb", Some(&push)).await.0,
        200
    );
    assert_eq!(
        call(&gw, "GET", "/v1/sandboxes/sb/shadow", None).await.0,
        404,
        "gone with it"
    );
    gw.run_until(async {}).await;
    let gw = start(config(dir.path(), ""), origin).await;
    assert_eq!(
        call(&gw, "GET", "/v1/sandboxes/sb/shadow", None).await.0,
        404,
        "after a restart too"
    );
    gw.run_until(async {}).await;
}

#[tokio::test]
async fn a_shadow_whose_policy_changed_is_held_across_a_restart() {
    let dir = tempfile::tempdir().expect("dir");
    let origin = echo().await;
    let gw = start(config(dir.path(), ""), origin).await;
    let push = |policy: &str| format!(r#"{{"addresses": ["{SANDBOX}"], "policy": {policy}}}"#);
    let shadow = format!(r#"{{"policy": {CANDIDATE}}}"#);
    for (method, path, body) in [
        ("PUT", "/v1/sandboxes/sb", push(ACTIVE)),
        ("PUT", "/v1/sandboxes/sb/shadow", shadow),
        (
            "PUT",
            "/v1/sandboxes/sb",
            push(r#"{"allow": [{"ip": "127.0.0.3"}]}"#),
        ),
    ] {
        let (status, v) = call(&gw, method, path, Some(&body)).await;
        assert_eq!(status, 200, "{method} {path}: {v}");
    }
    let (_, before) = call(&gw, "GET", "/v1/sandboxes/sb/shadow", None).await;
    assert!(before["policy_changed"].is_string(), "{before}");
    gw.run_until(async {}).await;

    let gw = start(config(dir.path(), ""), origin).await;
    let (status, after) = call(&gw, "GET", "/v1/sandboxes/sb/shadow", None).await;
    assert_eq!(
        (status, &after),
        (200, &before),
        "restored from the journal"
    );
    let (status, v) = call(&gw, "POST", "/v1/sandboxes/sb/shadow/promote", None).await;
    assert_eq!(status, 409, "{v}");
    assert_eq!(
        call(&gw, "GET", "/v1/sandboxes/sb", None).await.1["policy"]["allow"][0]["ip"],
        "127.0.0.3"
    );
    gw.run_until(async {}).await;
}
