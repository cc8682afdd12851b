//! The admin API over real HTTP.

use serde_json::json;

use crate::support::*;

const POLICY: &str =
    r#"{"default": "deny", "allow": [{"cidr": "127.0.0.16/28"}, {"domain": "API.example.test"}]}"#;

#[tokio::test]
async fn put_get_list_delete() {
    let dir = tempfile::tempdir().expect("dir");
    let gw = start(config(dir.path(), ""), echo().await).await;
    let a = gw.bound().admin;
    let doc = format!(r#"{{"addresses": ["{SANDBOX}", "fd00:64::2"], "policy": {POLICY}}}"#);
    let (status, body) = http(a, "PUT", "/v1/sandboxes/sb-1", None, Some(&doc)).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = http(a, "GET", "/v1/sandboxes/sb-1", None, None).await;
    assert_eq!(status, 200);
    let got = json(&body);
    assert_eq!(got["addresses"], json!([SANDBOX, "fd00:64::2"]));
    assert_eq!(
        got["policy"]["allow"][1],
        json!({"domain": "api.example.test"}),
        "normal form"
    );
    let (_, body) = http(a, "GET", "/v1/sandboxes", None, None).await;
    assert_eq!(json(&body)["sandboxes"].as_array().map(Vec::len), Some(1));
    assert!(
        dir.path().join("snapshot.json").exists(),
        "every accepted push is persisted"
    );
    let (status, _) = http(a, "DELETE", "/v1/sandboxes/sb-1", None, None).await;
    assert_eq!(status, 200);
    let (status, _) = http(a, "GET", "/v1/sandboxes/sb-1", None, None).await;
    assert_eq!(status, 404);
    let (status, _) = http(a, "DELETE", "/v1/sandboxes/sb-1", None, None).await;
    assert_eq!(status, 404);
}

#[tokio::test]
async fn validation_errors_name_the_field() {
    let dir = tempfile::tempdir().expect("dir");
    let gw = start(config(dir.path(), ""), echo().await).await;
    let a = gw.bound().admin;
    let cases = [
        (
            r#"{"addresses": ["127.0.0.2"], "policy": {"allow": [{"cidr": "10.0.0.1/8"}]}}"#,
            "policy.allow[0]",
            "10.0.0.0/8",
        ),
        (
            r#"{"addresses": ["127.0.0.2"], "policy": {"tls_interception": "maybe"}}"#,
            "policy.tls_interception",
            "maybe",
        ),
        (
            r#"{"adresses": ["127.0.0.2"], "policy": {}}"#,
            "adresses",
            "unknown field",
        ),
        (
            r#"{"addresses": ["not-an-ip"], "policy": {}}"#,
            "addresses[0]",
            "invalid IP",
        ),
        (
            r#"{"addresses": ["127.0.0.2"]}"#,
            "",
            "missing field `policy`",
        ),
        ("not json", "", "expected"),
    ];
    for (doc, field, needle) in cases {
        let (status, body) = http(a, "PUT", "/v1/sandboxes/x", None, Some(doc)).await;
        assert_eq!(status, 400, "{doc}: {body}");
        let v = json(&body);
        assert_eq!(v["field"].as_str().unwrap_or(""), field, "{doc}: {body}");
        assert!(
            v["error"].as_str().is_some_and(|e| e.contains(needle)),
            "{doc}: {body}"
        );
    }
    let (status, body) = http(
        a,
        "PUT",
        "/v1/sandboxes/bad%20id",
        None,
        Some(r#"{"addresses": [], "policy": {}}"#),
    )
    .await;
    assert_eq!((status, json(&body)["field"].clone()), (400, json!("id")));
    let (_, body) = http(a, "GET", "/v1/sandboxes", None, None).await;
    assert_eq!(json(&body)["sandboxes"], json!([]), "nothing applied");
}

#[tokio::test]
async fn an_address_belongs_to_one_sandbox() {
    let dir = tempfile::tempdir().expect("dir");
    let gw = start(config(dir.path(), ""), echo().await).await;
    let a = gw.bound().admin;
    let doc = format!(r#"{{"addresses": ["{SANDBOX}"], "policy": {{}}}}"#);
    assert_eq!(
        http(a, "PUT", "/v1/sandboxes/one", None, Some(&doc))
            .await
            .0,
        200
    );
    let (status, body) = http(a, "PUT", "/v1/sandboxes/two", None, Some(&doc)).await;
    assert_eq!(status, 409);
    assert!(body.contains("already belongs to sandbox one"), "{body}");
}

#[tokio::test]
async fn the_token_guards_everything_but_healthz() {
    let dir = tempfile::tempdir().expect("dir");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "s3cret-token-0123456789\n").expect("write");
    let extra = format!("[admin]\ntoken_file = \"{}\"", token_file.display());
    let gw = start(config(dir.path(), &extra), echo().await).await;
    let a = gw.bound().admin;
    assert_eq!(http(a, "GET", "/healthz", None, None).await.0, 200);
    assert_eq!(http(a, "GET", "/v1/sandboxes", None, None).await.0, 401);
    assert_eq!(
        http(
            a,
            "GET",
            "/v1/sandboxes",
            Some("wrong-token-0123456789"),
            None
        )
        .await
        .0,
        401
    );
    assert_eq!(http(a, "GET", "/metrics", None, None).await.0, 401);
    assert_eq!(
        http(
            a,
            "GET",
            "/v1/sandboxes",
            Some("s3cret-token-0123456789"),
            None
        )
        .await
        .0,
        200
    );
}

#[tokio::test]
async fn oversized_bodies_are_413() {
    let dir = tempfile::tempdir().expect("dir");
    let gw = start(config(dir.path(), ""), echo().await).await;
    let big = format!(
        r#"{{"addresses": [], "policy": {{"allow": [{}]}}}}"#,
        vec![r#"{"ip": "203.0.113.7"}"#; 60_000].join(",")
    );
    assert!(big.len() > 1 << 20);
    let (status, _) = http(gw.bound().admin, "PUT", "/v1/sandboxes/x", None, Some(&big)).await;
    assert_eq!(status, 413);
}

#[tokio::test]
async fn resync_replaces_everything_atomically() {
    let dir = tempfile::tempdir().expect("dir");
    let gw = start(config(dir.path(), ""), echo().await).await;
    let a = gw.bound().admin;
    let first = r#"{"sandboxes": [{"id": "a", "addresses": ["127.0.0.2"], "policy": {}}, {"id": "b", "addresses": ["127.0.0.3"], "policy": {}}]}"#;
    assert_eq!(
        http(a, "PUT", "/v1/sandboxes", None, Some(first)).await.0,
        200
    );
    let conflicting = r#"{"sandboxes": [{"id": "c", "addresses": ["127.0.0.4"], "policy": {}}, {"id": "d", "addresses": ["127.0.0.4"], "policy": {}}]}"#;
    assert_eq!(
        http(a, "PUT", "/v1/sandboxes", None, Some(conflicting))
            .await
            .0,
        409
    );
    let dup = r#"{"sandboxes": [{"id": "c", "addresses": [], "policy": {}}, {"id": "c", "addresses": [], "policy": {}}]}"#;
    let (status, body) = http(a, "PUT", "/v1/sandboxes", None, Some(dup)).await;
    assert_eq!(
        (status, json(&body)["field"].clone()),
        (400, json!("sandboxes[1].id"))
    );
    let (_, body) = http(a, "GET", "/v1/sandboxes", None, None).await;
    let ids: Vec<_> = json(&body)["sandboxes"]
        .as_array()
        .expect("list")
        .iter()
        .map(|s| s["id"].clone())
        .collect();
    assert_eq!(
        ids,
        [json!("a"), json!("b")],
        "failed resyncs left the state untouched"
    );
    let second = r#"{"sandboxes": [{"id": "z", "addresses": ["127.0.0.2"], "policy": {}}]}"#;
    assert_eq!(
        http(a, "PUT", "/v1/sandboxes", None, Some(second)).await.0,
        200
    );
    let (_, body) = http(a, "GET", "/v1/sandboxes", None, None).await;
    assert_eq!(json(&body)["sandboxes"][0]["id"], json!("z"));
    assert_eq!(json(&body)["sandboxes"].as_array().map(Vec::len), Some(1));
}

#[tokio::test]
async fn explain_and_attribution() {
    let dir = tempfile::tempdir().expect("dir");
    let gw = start(config(dir.path(), ""), echo().await).await;
    let a = gw.bound().admin;
    let doc = format!(
        r#"{{"addresses": ["{SANDBOX}"], "policy": {{"allow": [{{"domain": "api.example.test"}}], "tls_interception": "on",
            "tls_interception_exemptions": [{{"domain": "api.example.test"}}]}}}}"#
    );
    assert_eq!(
        http(a, "PUT", "/v1/sandboxes/sb", None, Some(&doc)).await.0,
        200
    );
    let ask =
        r#"{"sandbox": "sb", "dst": "203.0.113.7:443", "tls": true, "sni": "api.example.test"}"#;
    let (status, body) = http(a, "POST", "/v1/explain", None, Some(ask)).await;
    assert_eq!(status, 200);
    let v = json(&body);
    assert_eq!(
        (v["verdict"].clone(), v["reason"].clone()),
        (json!("intercept"), json!("needs_verification"))
    );
    assert_eq!(v["attributed"], json!([]));

    // What the DNS proxy would record after an answer through 8.8.8.8.
    let cache = &gw.shared().cache;
    cache.record(
        &dns_attrib::SandboxId::new("sb"),
        &dns_attrib::Attribution {
            names: vec![egress_policy::Hostname::parse("api.example.test").expect("name")],
            addrs: vec!["203.0.113.7".parse().expect("ip")],
            ttl: 120,
        },
    );
    let (_, body) = http(a, "POST", "/v1/explain", None, Some(ask)).await;
    let v = json(&body);
    assert_eq!(
        (v["verdict"].clone(), v["reason"].clone()),
        (json!("splice"), json!("exempt"))
    );
    assert_eq!(v["attributed"], json!(["api.example.test"]));
    assert!(
        v["detail"]
            .as_str()
            .is_some_and(|d| d.contains("exempt from interception by domain api.example.test")),
        "{v}"
    );

    let (status, body) = http(a, "GET", "/v1/sandboxes/sb/attribution", None, None).await;
    assert_eq!(status, 200);
    let v = json(&body);
    assert_eq!(v["entries"][0]["ip"], json!("203.0.113.7"));
    assert_eq!(
        v["entries"][0]["names"][0]["name"],
        json!("api.example.test")
    );
    assert!(
        v["entries"][0]["names"][0]["ttl_remaining_s"]
            .as_u64()
            .is_some_and(|t| (110..=120).contains(&t)),
        "{v}"
    );
    assert_eq!(
        http(
            a,
            "POST",
            "/v1/explain",
            None,
            Some(r#"{"sandbox": "nope", "dst": "203.0.113.7:443"}"#)
        )
        .await
        .0,
        404
    );
    assert_eq!(
        http(a, "GET", "/v1/sandboxes/nope/attribution", None, None)
            .await
            .0,
        404
    );
}

#[tokio::test]
async fn metrics_count_flows_bytes_and_pushes() {
    let dir = tempfile::tempdir().expect("dir");
    let origin = echo().await;
    let gw = start(config(dir.path(), ""), origin).await;
    let a = gw.bound().admin;
    let doc = format!(
        r#"{{"addresses": ["{SANDBOX}"], "policy": {{"allow": [{{"ip": "{ECHO_IP}"}}]}}}}"#
    );
    assert_eq!(
        http(a, "PUT", "/v1/sandboxes/sb", None, Some(&doc)).await.0,
        200
    );
    assert_eq!(
        http(a, "PUT", "/v1/sandboxes/sb", None, Some("{}")).await.0,
        400
    );
    assert_eq!(
        flow(&gw, SANDBOX, b"hello echo").await.as_deref(),
        Some(&b"hello echo"[..])
    );
    assert_eq!(
        flow(&gw, "127.0.0.9", b"who am i").await,
        None,
        "unknown sandbox"
    );
    // Flows are counted when they end.
    let mut m = std::collections::HashMap::new();
    for _ in 0..50 {
        let (status, text) = http(a, "GET", "/metrics", None, None).await;
        assert_eq!(status, 200);
        m = metrics(&text);
        if m.get(r#"egress_flows_total{verdict="allow",reason="allow_address"}"#) == Some(&1.0) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(
        m.get(r#"egress_flows_total{verdict="allow",reason="allow_address"}"#),
        Some(&1.0),
        "{m:?}"
    );
    assert_eq!(
        m.get(r#"egress_flows_total{verdict="deny",reason="unknown_sandbox"}"#),
        Some(&1.0),
        "{m:?}"
    );
    assert_eq!(m.get(r#"egress_bytes_total{direction="up"}"#), Some(&10.0));
    assert_eq!(
        m.get(r#"egress_bytes_total{direction="down"}"#),
        Some(&10.0)
    );
    assert_eq!(
        m.get(r#"egress_policy_pushes_total{outcome="applied"}"#),
        Some(&1.0)
    );
    assert_eq!(
        m.get(r#"egress_policy_pushes_total{outcome="rejected"}"#),
        Some(&1.0)
    );
    assert_eq!(m.get("egress_active_connections"), Some(&0.0));
    assert_eq!(
        m.get("egress_peek_seconds_count"),
        Some(&1.0),
        "one flow was peeked"
    );
    assert_eq!(
        m.get("egress_upstream_connect_seconds_count"),
        Some(&1.0),
        "one origin was dialled"
    );
    for name in [
        "egress_dns_queries_total",
        "egress_attribution_entries",
        "egress_certificates_minted_total",
        "egress_certificates_cached",
    ] {
        assert!(m.contains_key(name), "{name} missing from {m:?}");
    }
}

#[tokio::test]
async fn deploy_files_name_only_metrics_the_gateway_exports() {
    let dir = tempfile::tempdir().expect("dir");
    let gw = start(config(dir.path(), ""), echo().await).await;
    let a = gw.bound().admin;
    // Labelled families appear once they have a sample: push, reject, and run a flow.
    let doc = format!(
        r#"{{"addresses": ["{SANDBOX}"], "policy": {{"allow": [{{"ip": "{ECHO_IP}"}}]}}}}"#
    );
    assert_eq!(
        http(a, "PUT", "/v1/sandboxes/sb", None, Some(&doc)).await.0,
        200
    );
    assert_eq!(
        http(a, "PUT", "/v1/sandboxes/sb", None, Some("{}")).await.0,
        400
    );
    assert!(flow(&gw, SANDBOX, b"x").await.is_some());
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let (_, text) = http(a, "GET", "/metrics", None, None).await;
    let families: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert!(families.len() >= 10, "{families:?}");
    let known = |name: &str| {
        families.iter().any(|f| {
            name == *f
                || ["_total", "_bucket", "_sum", "_count"]
                    .iter()
                    .any(|s| name.strip_suffix(s) == Some(f))
        })
    };
    let deploy = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    let mut checked = 0;
    for file in [
        "prometheus/egress-gateway.rules.yml",
        "grafana/egress-gateway.json",
    ] {
        let body = std::fs::read_to_string(deploy.join(file)).expect("deploy file");
        if file.ends_with(".json") {
            serde_json::from_str::<serde_json::Value>(&body).expect("the dashboard is valid JSON");
        }
        let mut rest = body.as_str();
        while let Some(i) = rest.find("egress_") {
            let name: String = rest[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            rest = &rest[i + name.len()..];
            if name == "egress_gateway" {
                continue; // the job and dashboard names, not a metric
            }
            assert!(
                known(&name),
                "{file} names {name}, which /metrics does not export"
            );
            checked += 1;
        }
    }
    assert!(checked > 10);
}
