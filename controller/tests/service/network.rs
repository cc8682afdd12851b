//! Network policy replacement, reset to the template, lifecycle and forks.

use serde_json::{json, Value};

use crate::db;
use crate::support::*;

/// A running sandbox created with `+sensor` on a deny-by-default template with interception on.
async fn running(api: &ApiProcess, gw: &egress_gateway::Gateway) -> String {
    let (s, v) = call(
        api.addr,
        "POST",
        "/v1/sandboxes",
        Some(FEDERATED),
        &[("X-Space-Egress-Profiles", "+sensor")],
        Some(
            json!({"template": "base", "policy": {"default": "deny", "tls_interception": "on",
            "allow": [{"domain": "tenant.example.test"}],
            "tls_interception_exemptions": [{"domain": "kept.example.test"}]}}),
        ),
    )
    .await;
    assert_eq!(s, 202, "{v}");
    let op = settled(api, FEDERATED, v["operation"].as_str().expect("op")).await;
    assert_eq!(op["state"], json!("succeeded"), "{op}");
    let id = v["sandbox"].as_str().expect("id").to_owned();
    on_gateway(gw, &id).await;
    id
}

async fn doc(api: &ApiProcess, id: &str) -> Value {
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
async fn replacement_resolves_saved_names_now_and_never_re_applies_defaults() {
    let url = db!();
    let w = world(
        &url,
        deployment(Some(PROFILES), Some(EXEMPTIONS)),
        json!({"default": "allow"}),
    )
    .await;
    let (gw, api) = (&w.gw, &w.api);
    let id = running(api, gw).await;
    let before = doc(api, &id).await;
    assert_eq!(before["egress_profiles"], json!(["audit", "sensor"]));
    // A fresh tenant base: saved names resolved, deployment exemptions
    // appended (interception on), existing ones kept, no duplicates.
    let base = json!({"default": "deny", "tls_interception": "on",
        "tls_interception_exemptions": [{"domain": "kept.example.test"}, {"wildcard_domain": "*.relay.example.test"}]});
    let (s, after) = call(
        api.addr,
        "PUT",
        &format!("/v1/sandboxes/{id}/network"),
        Some(FEDERATED),
        &[],
        Some(json!({"policy": base})),
    )
    .await;
    assert_eq!(s, 200, "{after}");
    assert_eq!(
        after["policy"]["tls_interception_exemptions"],
        json!([{"domain": "kept.example.test"}, {"wildcard_domain": "*.relay.example.test"}, {"domain": "sensor.example.test"}]),
        "kept, then the profile's; the deployment's already there"
    );
    let allow = after["policy"]["allow"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(
        allow.contains(&json!({"domain": "audit.example.test"})),
        "saved names, defaults included: {after}"
    );
    assert!(
        !allow.contains(&json!({"domain": "tenant.example.test"})),
        "the old base is gone"
    );
    let pushed = {
        let mut got = on_gateway(gw, &id).await;
        for _ in 0..100 {
            if got["policy"] == after["policy"] {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            got = on_gateway(gw, &id).await;
        }
        got
    };
    assert_eq!(pushed["policy"], after["policy"], "pushed to the gateway");
    // Interception off: no deployment exemption is appended.
    let (s, off) = call(
        api.addr,
        "PUT",
        &format!("/v1/sandboxes/{id}/network"),
        Some(FEDERATED),
        &[],
        Some(json!({"policy": {"default": "allow"}})),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(
        off["policy"]["tls_interception_exemptions"],
        json!([{"domain": "sensor.example.test"}])
    );
    // Inheriting the template: its default, composed; an override only because composition changed it.
    let (s, inherited) = call(
        api.addr,
        "PUT",
        &format!("/v1/sandboxes/{id}/network"),
        Some(FEDERATED),
        &[],
        Some(json!({"inherit_template": true})),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(
        inherited["inherits_template"],
        json!(false),
        "profiles added rules: {inherited}"
    );
    let (s, _) = call(
        api.addr,
        "PUT",
        &format!("/v1/sandboxes/{id}/network"),
        Some(FEDERATED),
        &[],
        Some(json!({"policy": {"allow": [{"domain": "bad_name"}]}})),
    )
    .await;
    assert_eq!(s, 400);
}

#[tokio::test]
async fn a_missing_saved_name_is_503_and_the_old_policy_stays() {
    let url = db!();
    let w = world(
        &url,
        deployment(Some(PROFILES), Some(EXEMPTIONS)),
        json!({"default": "allow"}),
    )
    .await;
    let (gw, api) = (&w.gw, &w.api);
    let id = running(api, gw).await;
    let before = doc(api, &id).await;
    // Another API replica, configured without `sensor`.
    let stale = api_without_sensor(&url).await;
    for body in [
        json!({"policy": {"default": "allow"}}),
        json!({"inherit_template": true}),
    ] {
        let (s, v) = call(
            stale.addr,
            "PUT",
            &format!("/v1/sandboxes/{id}/network"),
            Some(FEDERATED),
            &[],
            Some(body),
        )
        .await;
        assert_eq!(s, 503, "{v}");
        assert_eq!(v["missing_profiles"], json!(["sensor"]));
    }
    assert_eq!(doc(api, &id).await, before, "nothing changed");
    let text = stale.metrics.encode();
    assert!(
        text.contains(r#"{profile="sensor",outcome="failed",reason="unconfigured"} 2"#),
        "{text}"
    );
}

/// A key twice in one object is refused: the API must not keep one of the
/// document's two readings (`serde_json::Value` would keep the last).
#[tokio::test]
async fn a_document_with_a_key_twice_is_refused() {
    let url = db!();
    let w = world(
        &url,
        deployment(Some(PROFILES), Some(EXEMPTIONS)),
        json!({"default": "allow"}),
    )
    .await;
    let (gw, api) = (&w.gw, &w.api);
    let id = running(api, gw).await;
    let before = doc(api, &id).await;
    let path = format!("/v1/sandboxes/{id}/network");
    for body in [
        r#"{"policy": {"default": "deny", "default": "allow"}}"#,
        r#"{"policy": {"deny": [{"domain": "x.test"}], "deny": []}}"#,
        r#"{"policy": {"default": "deny"}, "policy": {"default": "allow"}}"#,
    ] {
        let (s, v) = call_text(api.addr, ("PUT", &path), Some(FEDERATED), &[], body.into()).await;
        assert_eq!(s, 400, "{body}: {v}");
        assert!(v.to_string().contains("duplicate key"), "{body}: {v}");
    }
    assert_eq!(doc(api, &id).await, before, "nothing changed");
}

async fn api_without_sensor(url: &str) -> ApiProcess {
    api(
        url,
        deployment(
            Some(r#"{"audit": {"default": true, "allow": [{"domain": "audit.example.test"}]}}"#),
            None,
        ),
    )
    .await
}

#[tokio::test]
async fn lifecycle_operations_keep_the_saved_effective_policy() {
    let url = db!();
    let w = world(
        &url,
        deployment(Some(PROFILES), Some(EXEMPTIONS)),
        json!({"default": "allow"}),
    )
    .await;
    let (gw, api) = (&w.gw, &w.api);
    let id = running(api, gw).await;
    let policy = doc(api, &id).await["policy"].clone();
    for (action, state) in [
        ("stop", "stopped"),
        ("start", "running"),
        ("pause", "paused"),
        ("resume", "running"),
        ("suspend", "suspended"),
        ("restore", "running"),
        ("rollback", "running"),
    ] {
        let (s, v) = call(
            api.addr,
            "POST",
            &format!("/v1/sandboxes/{id}/{action}"),
            Some(FEDERATED),
            &[],
            None,
        )
        .await;
        assert_eq!(
            (s, v["state"].clone()),
            (200, json!(state)),
            "{action}: {v}"
        );
        assert_eq!(v["policy"], policy, "{action} keeps the policy");
    }
    let (s, _) = call(
        api.addr,
        "POST",
        &format!("/v1/sandboxes/{id}/restore"),
        Some(FEDERATED),
        &[],
        None,
    )
    .await;
    assert_eq!(s, 409, "restore needs a suspended sandbox");
    // Not an action (a mistyped one, PUT's route by POST, destroy's by
    // POST): no such route, not a 409 about the sandbox's state.
    for action in ["stopp", "shadow", "destroy"] {
        let path = format!("/v1/sandboxes/{id}/{action}");
        let (s, v) = call(api.addr, "POST", &path, Some(FEDERATED), &[], None).await;
        assert_eq!(s, 404, "{action}: {v}");
    }
    // Destroy: the gateway forgets it.
    let (s, _) = call(
        api.addr,
        "DELETE",
        &format!("/v1/sandboxes/{id}"),
        Some(FEDERATED),
        &[],
        None,
    )
    .await;
    assert_eq!(s, 200);
    let sid = egress_policy::SandboxId::new(&id);
    for _ in 0..600 {
        if gw.registry().get(&sid).is_none() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("the gateway still holds the destroyed sandbox");
}

#[tokio::test]
async fn a_fork_carries_the_names_and_the_policy_and_composes_deployment_exemptions() {
    let url = db!();
    let dir = tempfile::tempdir().expect("dir");
    let gw = gateway(dir.path(), "127.0.0.1:0").await;
    // The source is created before the deployment has exemptions...
    let plain = deployment(Some(PROFILES), None);
    let api1 = api(&url, plain.clone()).await;
    setup(
        &api1,
        json!({"default": "allow"}),
        gw.bound().admin,
        "100.64.10.0/24",
    )
    .await;
    let d1 = dispatcher(&url, plain, limits(5, 60_000, 100)).await;
    let id = running(&api1, &gw).await;
    drop(d1);
    let source = doc(&api1, &id).await;
    // ...and forked after they were configured.
    let d = deployment(Some(PROFILES), Some(EXEMPTIONS));
    let api2 = api(&url, d.clone()).await;
    let _d2 = dispatcher(&url, d, limits(5, 60_000, 100)).await;
    let (s, v) = call(
        api2.addr,
        "POST",
        &format!("/v1/sandboxes/{id}/fork"),
        Some(FEDERATED),
        &[],
        None,
    )
    .await;
    assert_eq!(s, 202, "{v}");
    settled(&api2, FEDERATED, v["operation"].as_str().expect("op")).await;
    let fork = doc(&api2, v["sandbox"].as_str().expect("id")).await;
    assert_eq!(fork["egress_profiles"], source["egress_profiles"]);
    assert_eq!(fork["policy"]["allow"], source["policy"]["allow"]);
    let mut want = source["policy"]["tls_interception_exemptions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    want.push(json!({"wildcard_domain": "*.relay.example.test"}));
    assert_eq!(fork["policy"]["tls_interception_exemptions"], json!(want));
    assert_ne!(fork["addresses"], source["addresses"]);
    assert_eq!(
        doc(&api2, &id).await["policy"],
        source["policy"],
        "the source is untouched"
    );
    // A fork under an Idempotency-Key is made once: a retry replays it, and
    // the key for another request is refused.
    let fork_with = |key: &'static str, of: String| {
        let addr = api2.addr;
        async move {
            let path = format!("/v1/sandboxes/{of}/fork");
            let key = [("Idempotency-Key", key)];
            call(addr, "POST", &path, Some(FEDERATED), &key, None).await
        }
    };
    let (s1, first) = fork_with("fork-1", id.clone()).await;
    let (s2, again) = fork_with("fork-1", id.clone()).await;
    assert_eq!((s1, s2), (202, 202), "{first} {again}");
    assert_eq!(first, again, "a retried fork is the first one");
    let other = v["sandbox"].as_str().expect("id").to_owned();
    let (s, refused) = fork_with("fork-1", other).await;
    assert_eq!(s, 409, "{refused}");
    // The source destroyed, a retry still gets the fork it made.
    let gone = format!("/v1/sandboxes/{id}");
    let (s, v) = call(api2.addr, "DELETE", &gone, Some(FEDERATED), &[], None).await;
    assert_eq!(s, 200, "{v}");
    let destroyed = |doc: Value| doc["state"] == json!("destroyed");
    for _ in 0..100 {
        if destroyed(doc(&api2, &id).await) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(destroyed(doc(&api2, &id).await));
    let (s, late) = fork_with("fork-1", id.clone()).await;
    assert_eq!((s, late), (202, first));
}

/// A policy larger than a gateway takes is refused when it is written; it
/// was saved before, the gateway refused its push (`413`), kept the old
/// policy, and the pushes queued behind it waited.
#[tokio::test]
async fn a_policy_too_large_for_a_gateway_is_refused_and_the_old_one_stays() {
    let url = db!();
    let w = world(
        &url,
        deployment(Some(PROFILES), Some(EXEMPTIONS)),
        json!({"default": "allow"}),
    )
    .await;
    let (gw, api) = (&w.gw, &w.api);
    let id = running(api, gw).await;
    // Just under the API's body cap (1 MiB), over what a gateway takes
    // once the addresses (and the profile) are added.
    let entries: Vec<Value> = (0..31_900)
        .map(|i| json!({"domain": format!("n{i}.example.test")}))
        .collect();
    let body = json!({"policy": {"default": "deny", "allow": entries}});
    let size = body.to_string().len();
    assert!(size < 1 << 20 && size > (1 << 20) - 16 * 1024, "{size}");
    let (s, v) = call(
        api.addr,
        "PUT",
        &format!("/v1/sandboxes/{id}/network"),
        Some(FEDERATED),
        &[],
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
    // Nothing changed: the saved policy and the gateway's are the old one.
    let saved = doc(api, &id).await;
    assert!(
        saved["policy"]["allow"]
            .to_string()
            .contains("tenant.example.test"),
        "{saved}"
    );
    assert!(on_gateway(gw, &id).await["policy"]["allow"]
        .to_string()
        .contains("tenant.example.test"));
}
