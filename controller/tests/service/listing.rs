//! The console's assets and the read-only routes it reads
//! (docs/console.md): served with a strict policy and no data, keyset
//! pages that cover every sandbox once, and the same tenant scope as the
//! rest of the API.

use std::collections::BTreeSet;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use sqlx::Connection;

use crate::db;
use crate::support::*;

/// A `GET` without a token: status, headers and body text.
async fn raw_get(addr: std::net::SocketAddr, path: &str) -> (u16, http::HeaderMap, String) {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .expect("http");
    tokio::spawn(conn);
    let req = hyper::Request::get(path)
        .header("host", "api")
        .body(Full::new(Bytes::new()))
        .expect("request");
    let resp = sender.send_request(req).await.expect("answer");
    let (parts, body) = resp.into_parts();
    let bytes = body.collect().await.expect("body").to_bytes();
    (
        parts.status.as_u16(),
        parts.headers,
        String::from_utf8_lossy(&bytes).into_owned(),
    )
}

/// Queues a create of `token`'s tenant (no dispatcher: it stays `creating`).
async fn queued(api: &ApiProcess, token: &str) -> (String, String) {
    let body = json!({"template": "base"});
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
    (
        v["sandbox"].as_str().expect("id").to_owned(),
        v["operation"].as_str().expect("op").to_owned(),
    )
}

async fn template(api: &ApiProcess) {
    let body = json!({"policy": {"default": "deny"}});
    let (s, b) = call(
        api.addr,
        "PUT",
        "/v1/templates/base",
        Some(ADMIN),
        &[],
        Some(body),
    )
    .await;
    assert_eq!(s, 200, "{b}");
}

/// Every page of `GET /v1/sandboxes?{query}` with `token`, `limit` at a time.
async fn all_pages(api: &ApiProcess, token: &str, query: &str, limit: u32) -> Vec<Value> {
    let (mut out, mut after) = (Vec::new(), String::new());
    for _ in 0..100 {
        let path = format!("/v1/sandboxes?{query}&limit={limit}&after={after}");
        let (s, page) = call(api.addr, "GET", &path, Some(token), &[], None).await;
        assert_eq!(s, 200, "{page}");
        let list = page["sandboxes"].as_array().expect("list").clone();
        assert!(list.len() <= limit as usize, "{page}");
        out.extend(list);
        match page["next"].as_str() {
            Some(next) => after = next.to_owned(),
            None => return out,
        }
    }
    panic!("more than 100 pages");
}

fn ids(list: &[Value]) -> Vec<String> {
    list.iter()
        .map(|s| s["id"].as_str().expect("id").to_owned())
        .collect()
}

#[tokio::test]
async fn the_console_is_served_from_the_binary_with_a_strict_policy_and_no_data() {
    let api = api(&db!(), deployment(None, None)).await;
    for path in [
        "/console/",
        "/console",
        "/console/app.js",
        "/console/app.css",
    ] {
        let (s, h, body) = raw_get(api.addr, path).await;
        assert_eq!(s, 200, "{path}");
        let csp = h["content-security-policy"].to_str().expect("csp");
        assert!(csp.contains("default-src 'self'"), "{csp}");
        assert!(csp.contains("frame-ancestors 'none'"), "{csp}");
        assert!(!csp.contains("unsafe-inline"), "{csp}");
        assert_eq!(h["x-content-type-options"], "nosniff");
        assert!(h.get("set-cookie").is_none());
        assert!(
            !body.contains("http://") && !body.contains("https://"),
            "{path}: an external asset"
        );
    }
    let (_, h, page) = raw_get(api.addr, "/console/").await;
    assert!(h["content-type"]
        .to_str()
        .expect("type")
        .starts_with("text/html"));
    assert!(page.contains(r#"<script src="/console/app.js" defer></script>"#));
    // No inline script: the only <script> element names a file.
    assert_eq!(page.matches("<script").count(), 1);
    let (_, h, _) = raw_get(api.addr, "/console/app.js").await;
    assert!(h["content-type"]
        .to_str()
        .expect("type")
        .starts_with("text/javascript"));
    let (s, _, codes) = raw_get(api.addr, "/console/reason-codes.md").await;
    assert_eq!(s, 200);
    assert!(codes.contains("| `tenant_deny` |"));
    assert_eq!(raw_get(api.addr, "/console/secrets").await.0, 404);
    // The data routes still want a token.
    assert_eq!(raw_get(api.addr, "/v1/sandboxes").await.0, 401);
}

#[tokio::test]
async fn sandbox_pages_cover_each_sandbox_once_and_stay_in_the_tenant() {
    let api = api(&db!(), deployment(None, None)).await;
    template(&api).await;
    let mut mine = BTreeSet::new();
    for _ in 0..7 {
        mine.insert(queued(&api, FEDERATED).await.0);
    }
    let mut theirs = BTreeSet::new();
    for _ in 0..3 {
        theirs.insert(queued(&api, PLAIN).await.0);
    }
    let pages = all_pages(&api, FEDERATED, "", 3).await;
    let seen = ids(&pages);
    assert_eq!(seen.len(), 7, "{seen:?}");
    assert_eq!(seen.iter().cloned().collect::<BTreeSet<_>>(), mine);
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "in id order: {seen:?}"
    );
    assert!(pages
        .iter()
        .all(|s| s["tenant"] == "t1" && s["state"] == "creating"));

    let (s, first) = call(
        api.addr,
        "GET",
        "/v1/sandboxes?limit=3",
        Some(FEDERATED),
        &[],
        None,
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(
        first["counts"],
        json!({"total": 7, "by_state": {"creating": 7}})
    );
    // Another tenant's sandboxes are not there, and cannot be asked for.
    assert_eq!(
        ids(&all_pages(&api, PLAIN, "", 2).await)
            .into_iter()
            .collect::<BTreeSet<_>>(),
        theirs
    );
    let (s, e) = call(
        api.addr,
        "GET",
        "/v1/sandboxes?tenant=t2",
        Some(FEDERATED),
        &[],
        None,
    )
    .await;
    assert_eq!(s, 403, "{e}");
    assert!(
        e["error"].as_str().expect("error").contains("tenant"),
        "{e}"
    );
    // An admin sees every tenant, and filters by one.
    assert_eq!(all_pages(&api, ADMIN, "", 4).await.len(), 10);
    let t2 = ids(&all_pages(&api, ADMIN, "tenant=t2", 4).await);
    assert_eq!(t2.into_iter().collect::<BTreeSet<_>>(), theirs);
    assert!(all_pages(&api, FEDERATED, "state=running", 5)
        .await
        .is_empty());
    assert!(all_pages(&api, FEDERATED, "profile=sensor", 5)
        .await
        .is_empty());
    assert!(all_pages(&api, FEDERATED, "worker=w9", 5).await.is_empty());
}

#[tokio::test]
async fn list_queries_refuse_what_they_do_not_know() {
    let api = api(&db!(), deployment(None, None)).await;
    for (path, field) in [
        ("/v1/sandboxes?limit=0", "limit"),
        ("/v1/sandboxes?limit=501", "limit"),
        ("/v1/sandboxes?colour=red", "colour"),
        ("/v1/sandboxes?state=sleeping", "state"),
        ("/v1/sandboxes?tenant=%zz", "tenant"),
        ("/v1/operations?limit=x", "limit"),
    ] {
        let (s, e) = call(api.addr, "GET", path, Some(ADMIN), &[], None).await;
        assert_eq!(s, 400, "{path}: {e}");
        assert!(
            e["error"].as_str().expect("error").contains(field),
            "{path}: {e}"
        );
    }
    assert_eq!(
        call(api.addr, "GET", "/v1/sandboxes", None, &[], None)
            .await
            .0,
        401
    );
}

#[tokio::test]
async fn operations_show_each_tenant_its_queue_and_failures() {
    let url = db!();
    let api = api(&url, deployment(None, None)).await;
    template(&api).await;
    let (_, failed_op) = queued(&api, FEDERATED).await;
    queued(&api, FEDERATED).await;
    queued(&api, PLAIN).await;
    let mut conn = sqlx::PgConnection::connect(&url).await.expect("connect");
    sqlx::query(
        "UPDATE operations SET state = 'failed', last_error = 'worker w1: boom' WHERE id = $1",
    )
    .bind(&failed_op)
    .execute(&mut conn)
    .await
    .expect("fail it");
    let (s, t1) = call(
        api.addr,
        "GET",
        "/v1/operations",
        Some(FEDERATED),
        &[],
        None,
    )
    .await;
    assert_eq!(s, 200, "{t1}");
    assert_eq!(
        (t1["queued"].clone(), t1["failed"].clone()),
        (json!(1), json!(1))
    );
    assert_eq!(t1["failures"][0]["id"], json!(failed_op));
    assert_eq!(t1["failures"][0]["error"], "worker w1: boom");
    assert!(t1.get("push_lag_s").is_none(), "{t1}");
    let (_, t2) = call(api.addr, "GET", "/v1/operations", Some(PLAIN), &[], None).await;
    assert_eq!(
        (t2["queued"].clone(), t2["failures"].clone()),
        (json!(1), json!([]))
    );
    let (_, all) = call(api.addr, "GET", "/v1/operations", Some(ADMIN), &[], None).await;
    assert_eq!(all["queued"], 2);
    assert!(all["push_lag_s"].is_number(), "{all}");
}

#[tokio::test]
async fn workers_are_for_admins_and_show_their_gateway_probed() {
    let w = world(&db!(), deployment(None, None), json!({"default": "deny"})).await;
    let (s, doc) = call(w.api.addr, "GET", "/v1/workers", Some(ADMIN), &[], None).await;
    assert_eq!(s, 200, "{doc}");
    let w1 = &doc["workers"][0];
    assert_eq!(w1["id"], "w1");
    assert_eq!(w1["gateway"]["ready"], true, "{doc}");
    assert!(w1["gateway"]["detail"]
        .as_str()
        .expect("detail")
        .starts_with("ready epoch="));
    assert!(w1.get("token").is_none(), "{doc}");
    let (s, _) = call(w.api.addr, "GET", "/v1/workers", Some(FEDERATED), &[], None).await;
    assert_eq!(s, 403);
}

#[tokio::test]
async fn explain_asks_the_sandboxs_gateway_about_that_sandbox_only() {
    let template = json!({"default": "deny", "tls_interception": "on",
                          "allow": [{"domain": "api.example.test"}]});
    let w = world(&db!(), deployment(None, None), template).await;
    let (id, op) = queued(&w.api, FEDERATED).await;
    settled(&w.api, FEDERATED, &op).await;
    on_gateway(&w.gw, &id).await;
    let path = format!("/v1/sandboxes/{id}/explain");
    let ask = |sni: &str| json!({"dst": "198.51.100.7:443", "tls": true, "sni": sni});
    let (s, v) = call(
        w.api.addr,
        "POST",
        &path,
        Some(FEDERATED),
        &[],
        Some(ask("api.example.test")),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["verdict"], "intercept", "{v}");
    let (_, v) = call(
        w.api.addr,
        "POST",
        &path,
        Some(FEDERATED),
        &[],
        Some(ask("other.example.test")),
    )
    .await;
    assert_eq!(v["verdict"], "deny", "{v}");
    assert!(v["reason"].is_string(), "{v}");
    // Another tenant's token does not learn the sandbox exists.
    let (s, _) = call(
        w.api.addr,
        "POST",
        &path,
        Some(PLAIN),
        &[],
        Some(ask("api.example.test")),
    )
    .await;
    assert_eq!(s, 404);
    // The question cannot name another sandbox.
    let mut other = ask("api.example.test");
    other["sandbox"] = json!("sb-else");
    let (s, e) = call(w.api.addr, "POST", &path, Some(FEDERATED), &[], Some(other)).await;
    assert_eq!(s, 400, "{e}");
    assert!(
        e["error"].as_str().expect("error").contains("sandbox"),
        "{e}"
    );
}
