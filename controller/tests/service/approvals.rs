//! Proposals through the controller and their approval: each scope reaches
//! the gateway (the push is observed with the gateway's explain), shows in
//! provenance, is revoked or expires, and is invisible to other tenants.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use sqlx::Connection;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::db;
use crate::support::*;

/// Where every flow in these tests goes: a fake origin the gateway never
/// dials, since each flow here is denied.
const ORIGIN: &str = "198.51.100.7:80";

/// Every transparent connection "to" [`ORIGIN`].
struct ToOrigin;

impl egress_gateway::OriginalDst for ToOrigin {
    fn original_dst(&self, _: &tokio::net::TcpStream) -> std::io::Result<SocketAddr> {
        Ok(ORIGIN.parse().expect("addr"))
    }
}

struct Setup {
    gw: egress_gateway::Gateway,
    api: ApiProcess,
    url: String,
    dispatcher: Option<DispatcherTask>,
    _dir: tempfile::TempDir,
}

/// A gateway whose sandboxes live on loopback (`127.0.0.0/29`), on a
/// deny-by-default template with interception on.
async fn setup_world(url: String) -> Setup {
    let dir = tempfile::tempdir().expect("dir");
    let gw = gateway_with(dir.path(), "127.0.0.1:0", Arc::new(ToOrigin)).await;
    let d = deployment(None, None);
    let api = api(&url, d.clone()).await;
    let template = json!({"default": "deny", "tls_interception": "on"});
    setup(&api, template, gw.bound().admin, "127.0.0.0/29").await;
    let dispatcher = dispatcher(&url, d, limits(5, 60_000, 100)).await;
    Setup {
        gw,
        api,
        url,
        dispatcher: Some(dispatcher),
        _dir: dir,
    }
}

/// A running sandbox of `token`'s tenant, on the gateway: its id and address.
async fn sandbox(w: &Setup, token: &str) -> (String, String) {
    let body = json!({"template": "base"});
    let (s, v) = call(
        w.api.addr,
        "POST",
        "/v1/sandboxes",
        Some(token),
        &[],
        Some(body),
    )
    .await;
    assert_eq!(s, 202, "{v}");
    settled(&w.api, token, v["operation"].as_str().expect("op")).await;
    let id = v["sandbox"].as_str().expect("id").to_owned();
    let on = on_gateway(&w.gw, &id).await;
    (id, on["addresses"][0].as_str().expect("address").to_owned())
}

/// A plain HTTP request for `api.example.test` from `src`: denied.
async fn denied_request(w: &Setup, src: &str) {
    let sock = tokio::net::TcpSocket::new_v4().expect("socket");
    sock.bind((src.parse::<std::net::IpAddr>().expect("ip"), 0).into())
        .expect("bind");
    let mut s = sock
        .connect(w.gw.bound().transparent)
        .await
        .expect("connect");
    s.write_all(b"GET / HTTP/1.1\r\nHost: api.example.test\r\n\r\n")
        .await
        .expect("write");
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer).await;
    assert!(answer.starts_with(b"HTTP/1.1 403"), "{answer:?}");
}

/// The gateway's verdict now for TLS to `api.example.test` from sandbox `id`.
async fn verdict(w: &Setup, id: &str) -> String {
    let body =
        json!({"sandbox": id, "dst": "198.51.100.7:443", "tls": true, "sni": "api.example.test"});
    let (s, v) = call(
        w.gw.bound().admin,
        "POST",
        "/v1/explain",
        None,
        &[],
        Some(body),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    v["verdict"].as_str().expect("verdict").to_owned()
}

/// Waits (≤ 30 s) until the gateway's verdict for `id` is `want`.
async fn until_verdict(w: &Setup, id: &str, want: &str) {
    for _ in 0..600 {
        if verdict(w, id).await == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("sandbox {id} never got {want}: {}", verdict(w, id).await);
}

/// The proposals of `id` through the controller.
async fn proposals(w: &Setup, token: &str, id: &str) -> (u16, Value) {
    let path = format!("/v1/sandboxes/{id}/proposals");
    call(w.api.addr, "GET", &path, Some(token), &[], None).await
}

/// Approves `id`'s only proposal for `scope` (and `until`).
async fn approve(w: &Setup, token: &str, id: &str, body: Value) -> (u16, Value) {
    let (s, doc) = proposals(w, FEDERATED, id).await;
    assert_eq!(s, 200, "{doc}");
    let pid = doc["proposals"][0]["id"].as_str().expect("a proposal");
    let path = format!("/v1/sandboxes/{id}/proposals/{pid}/approve");
    call(w.api.addr, "POST", &path, Some(token), &[], Some(body)).await
}

/// `GET /v1/approvals` as `token`'s tenant.
async fn approvals_of(w: &Setup, token: &str) -> Value {
    let (s, v) = call(w.api.addr, "GET", "/v1/approvals", Some(token), &[], None).await;
    assert_eq!(s, 200, "{v}");
    v
}

#[tokio::test]
async fn an_approved_proposal_reaches_the_gateway_shows_in_provenance_and_is_revoked() {
    let w = setup_world(db!()).await;
    let (id, addr) = sandbox(&w, FEDERATED).await;
    denied_request(&w, &addr).await;
    denied_request(&w, &addr).await;
    let (s, doc) = proposals(&w, FEDERATED, &id).await;
    assert_eq!(s, 200, "{doc}");
    let p = &doc["proposals"][0];
    assert_eq!(p["rule"], json!({"domain": "api.example.test"}));
    assert_eq!(p["count"], 2);
    // Another tenant sees nothing and approves nothing.
    assert_eq!(proposals(&w, PLAIN, &id).await.0, 404);
    let (s, _) = approve(&w, PLAIN, &id, json!({"scope": "sandbox"})).await;
    assert_eq!(s, 404);
    assert_eq!(verdict(&w, &id).await, "deny");

    let (s, a) = approve(&w, FEDERATED, &id, json!({"scope": "sandbox"})).await;
    assert_eq!(s, 201, "{a}");
    assert_eq!(a["principal"], "tenant:t1");
    assert_eq!(a["evidence"]["count"], 2);
    let aid = a["id"].as_str().expect("id").to_owned();
    until_verdict(&w, &id, "intercept").await;
    let path = format!("/v1/sandboxes/{id}");
    let (_, sb) = call(w.api.addr, "GET", &path, Some(FEDERATED), &[], None).await;
    let added = sb["provenance"]
        .as_array()
        .expect("provenance")
        .iter()
        .find(|e| e["source"] == "approval")
        .expect("an approval in the provenance")
        .clone();
    assert_eq!(added["approval"], json!(aid));
    assert_eq!(added["destination"], json!({"domain": "api.example.test"}));
    // Approved again while in force: the same approval, no second row.
    let (s, again) = approve(&w, FEDERATED, &id, json!({"scope": "sandbox"})).await;
    assert_eq!(s, 200, "{again}");
    assert_eq!(again["id"], json!(aid));

    let mine = approvals_of(&w, FEDERATED).await;
    assert_eq!(mine["approvals"].as_array().expect("list").len(), 1);
    assert_eq!(mine["truncated"], json!(false));
    let theirs = approvals_of(&w, PLAIN).await;
    assert_eq!(theirs["approvals"], json!([]));
    let revoke = format!("/v1/approvals/{aid}");
    assert_eq!(
        call(w.api.addr, "DELETE", &revoke, Some(PLAIN), &[], None)
            .await
            .0,
        404
    );
    // A policy this build cannot read (one a newer build wrote): the revoke
    // fails rather than leave the rule in force with the approval gone.
    let mut conn = sqlx::PgConnection::connect(&w.url).await.expect("db");
    let newer =
        "UPDATE sandboxes SET policy = policy || '{\"from_a_newer_build\": 1}' WHERE id = $1";
    sqlx::query(newer)
        .bind(&id)
        .execute(&mut conn)
        .await
        .expect("newer");
    let (s, r) = call(w.api.addr, "DELETE", &revoke, Some(FEDERATED), &[], None).await;
    assert_eq!(s, 503, "{r}");
    let why = r["error"].as_str().unwrap_or_default();
    assert!(
        why.contains(&format!("sandbox {id}: its stored policy does not read")),
        "{r}"
    );
    let mine = approvals_of(&w, FEDERATED).await;
    assert!(mine["approvals"][0]["revoked_at"].is_null(), "{mine}");
    let older = "UPDATE sandboxes SET policy = policy - 'from_a_newer_build' WHERE id = $1";
    sqlx::query(older)
        .bind(&id)
        .execute(&mut conn)
        .await
        .expect("older");
    let (s, r) = call(w.api.addr, "DELETE", &revoke, Some(FEDERATED), &[], None).await;
    assert_eq!(s, 200, "{r}");
    until_verdict(&w, &id, "deny").await;
    let (_, sb) = call(w.api.addr, "GET", &path, Some(FEDERATED), &[], None).await;
    assert!(!sb["provenance"].to_string().contains("approval"), "{sb}");
}

/// An approval that would make a sandbox it reaches larger than a gateway
/// takes (the dispatcher would then have the gateway forget the sandbox,
/// denying all its traffic) is refused with `400` naming the sandbox, and
/// nothing of it stays: no approval, the saved policy as it was.
#[tokio::test]
async fn an_approval_that_would_make_a_policy_too_large_for_a_gateway_is_refused() {
    let w = setup_world(db!()).await;
    let (id, addr) = sandbox(&w, FEDERATED).await;
    denied_request(&w, &addr).await;
    // The saved policy grown (in the database: the API keeps room for
    // composition) until one more rule of the approval's size does not fit.
    let full = |n: usize| {
        let allow: Vec<Value> = (0..n)
            .map(|i| json!({"domain": format!("p{i:06}.t")}))
            .collect();
        let doc = json!({"default": "deny", "tls_interception": "on", "allow": allow});
        egress_policy::Policy::from_json(&doc.to_string()).expect("policy")
    };
    let addresses = vec![addr.clone()];
    let fits = |n: usize| egress_controller::compose::oversized(&full(n), &addresses).is_none();
    let (mut lo, mut hi) = (0, 100_000);
    while lo + 1 < hi {
        let mid = (lo + hi) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let policy = full(lo);
    let mut conn = sqlx::PgConnection::connect(&w.url).await.expect("connect");
    sqlx::query("UPDATE sandboxes SET policy = $2 WHERE id = $1")
        .bind(&id)
        .bind(sqlx::types::Json(
            serde_json::to_value(&policy).expect("json"),
        ))
        .execute(&mut conn)
        .await
        .expect("saved");
    let (s, refused) = approve(&w, FEDERATED, &id, json!({"scope": "sandbox"})).await;
    assert_eq!(s, 400, "{refused}");
    let said = refused["error"].as_str().unwrap_or_default();
    assert!(
        said.contains(&format!("sandbox {id}")) && said.contains("takes at most"),
        "{refused}"
    );
    let mine = approvals_of(&w, FEDERATED).await;
    assert_eq!(mine["approvals"], json!([]), "{mine}");
    let saved: sqlx::types::Json<Value> =
        sqlx::query_scalar("SELECT policy FROM sandboxes WHERE id = $1")
            .bind(&id)
            .fetch_one(&mut conn)
            .await
            .expect("policy");
    assert_eq!(
        saved.0["allow"].as_array().map(Vec::len),
        Some(lo),
        "the saved policy changed"
    );
}

#[tokio::test]
async fn template_and_tenant_approvals_reach_later_sandboxes_of_the_tenant_only() {
    let w = setup_world(db!()).await;
    let (a, addr) = sandbox(&w, FEDERATED).await;
    denied_request(&w, &addr).await;
    let (s, t) = approve(&w, FEDERATED, &a, json!({"scope": "template"})).await;
    assert_eq!(s, 201, "{t}");
    assert_eq!(t["target"], "base");
    until_verdict(&w, &a, "intercept").await;
    let (b, _) = sandbox(&w, FEDERATED).await;
    until_verdict(&w, &b, "intercept").await;
    let (other, _) = sandbox(&w, PLAIN).await;
    assert_eq!(
        verdict(&w, &other).await,
        "deny",
        "another tenant's sandbox"
    );

    let revoke = format!("/v1/approvals/{}", t["id"].as_str().expect("id"));
    assert_eq!(
        call(w.api.addr, "DELETE", &revoke, Some(FEDERATED), &[], None)
            .await
            .0,
        200
    );
    until_verdict(&w, &b, "deny").await;
    let (s, t) = approve(&w, FEDERATED, &a, json!({"scope": "tenant"})).await;
    assert_eq!(s, 201, "{t}");
    assert_eq!(t["target"], "t1");
    until_verdict(&w, &b, "intercept").await;
    let (c, _) = sandbox(&w, FEDERATED).await;
    until_verdict(&w, &c, "intercept").await;
    assert_eq!(
        verdict(&w, &other).await,
        "deny",
        "another tenant's sandbox"
    );
}

/// `GET /v1/approvals` as the federated tenant's token.
async fn approvals_listed(w: &Setup) -> Value {
    call(
        w.api.addr,
        "GET",
        "/v1/approvals",
        Some(FEDERATED),
        &[],
        None,
    )
    .await
    .1
}

#[tokio::test]
async fn an_approval_expires_and_the_gateway_denies_again() {
    let w = setup_world(db!()).await;
    let (id, mut conn, (s, _)) = denied_then_approved(&w, "- interval '1 second'").await;
    assert_eq!(s, 400, "a time in the past");
    // Not RFC 3339, though PostgreSQL reads each: `infinity` would never
    // expire, the others would be read in the server's zone.
    for until in [
        "soon",
        "infinity",
        "tomorrow",
        "2999-01-01",
        "2999-01-01 10:00:00",
    ] {
        let (s, v) = approve(
            &w,
            FEDERATED,
            &id,
            json!({"scope": "sandbox", "until": until}),
        )
        .await;
        assert_eq!(s, 400, "{until}: {v}");
        assert!(
            v["error"].as_str().is_some_and(|e| e.contains("RFC 3339")),
            "{v}"
        );
    }
    // RFC 3339 times PostgreSQL cannot store (an offset past 15 hours, the
    // year 0): refused as the caller's mistake, not a database outage (a
    // `503` its client would retry forever).
    for until in ["2999-01-01T00:00:00+20:00", "0000-06-01T00:00:00Z"] {
        let body = json!({"scope": "sandbox", "until": until});
        let (s, v) = approve(&w, FEDERATED, &id, body).await;
        assert_eq!(s, 400, "{until}: {v}");
        assert!(
            v["error"].as_str().is_some_and(|e| e.contains("until: ")),
            "{v}"
        );
    }
    approved_until(&w, &mut conn, (&id, "sandbox"), "+ interval '2 seconds'").await;
    // Approved again with another until: the new one replaces it.
    let again = "+ interval '3 seconds'";
    let replacing = approved_until(&w, &mut conn, (&id, "sandbox"), again).await;
    let list = approvals_listed(&w).await;
    let in_force: Vec<&Value> = list["approvals"]
        .as_array()
        .expect("a list")
        .iter()
        .filter(|a| a["revoked_at"].is_null())
        .collect();
    assert_eq!(in_force.len(), 1, "{list}");
    assert_eq!(in_force[0]["id"], replacing["id"], "{list}");
    // Another approval (of the tenant) past its until that cannot be taken
    // out (its rule no longer reads): it must not hold the first one in
    // force.
    let broken = approved_until(&w, &mut conn, (&id, "tenant"), "+ interval '1 hour'").await;
    sqlx::query(
        "UPDATE approvals SET until = now() - interval '1 second', rule = '\"garbage\"'::jsonb WHERE id = $1",
    )
    .bind(broken["id"].as_str().expect("id"))
    .execute(&mut conn)
    .await
    .expect("break it");
    until_verdict(&w, &id, "intercept").await;
    until_verdict(&w, &id, "deny").await;
    // (A row that does not read is a 503 for the listing; gone now.)
    sqlx::query("DELETE FROM approvals WHERE id = $1")
        .bind(broken["id"].as_str().expect("id"))
        .execute(&mut conn)
        .await
        .expect("delete");
    // The gateway lapses the rule by its `until` on its own; the
    // controller records the approval removed on its next round.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    let list = loop {
        let list = approvals_listed(&w).await;
        if list["approvals"][0]["removed_at"].is_string() || std::time::Instant::now() > deadline {
            break list;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    assert!(list["approvals"][0]["removed_at"].is_string(), "{list}");
    assert!(list["approvals"][0]["revoked_at"].is_null(), "{list}");
}

/// A revoke that runs while a create is saving a sandbox's policy (the
/// create read the approval in force, and has not committed) takes the
/// approval out of what the create saves. It skipped the sandbox before,
/// still `creating` with no policy, and the revoked rule stayed.
#[tokio::test]
async fn an_approval_revoked_during_a_create_is_not_in_what_it_saves() {
    revoked_during_a_create(false).await;
}

/// The same for a create whose sandbox's row is not committed while the
/// revoke runs (an E2B create inserts it and composes in one transaction):
/// the revoke waits for the tenant's lock the create holds, then finds the
/// sandbox. It found none before, and the revoked rule was saved.
#[tokio::test]
async fn an_approval_revoked_during_a_create_in_one_transaction_is_not_saved() {
    revoked_during_a_create(true).await;
}

/// A template-scope approval, a create run in a transaction of this
/// test's up to its commit (`inserted`: its sandbox's row inserted in that
/// transaction too), the approval revoked meanwhile: the sandbox ends
/// running without the rule.
async fn revoked_during_a_create(inserted: bool) {
    let url = db!();
    let dir = tempfile::tempdir().expect("dir");
    let gw = gateway_with(dir.path(), "127.0.0.1:0", Arc::new(ToOrigin)).await;
    let d = deployment(None, None);
    let api = api(&url, d.clone()).await;
    let template = json!({"default": "deny", "tls_interception": "on"});
    setup(&api, template, gw.bound().admin, "127.0.0.0/29").await;
    let running = dispatcher(&url, d.clone(), limits(5, 60_000, 100)).await;
    let w = Setup {
        gw,
        api,
        url: url.clone(),
        dispatcher: Some(running),
        _dir: dir,
    };
    let (a, addr) = sandbox(&w, FEDERATED).await;
    denied_request(&w, &addr).await;
    let (s, approval) = approve(&w, FEDERATED, &a, json!({"scope": "template"})).await;
    assert_eq!(s, 201, "{approval}");
    // The dispatcher stops: the next create waits in the queue.
    let Setup {
        api, dispatcher, ..
    } = w;
    drop(dispatcher);
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
    let queued = v["sandbox"].as_str().expect("id").to_owned();

    // The create runs in a transaction of this test's, up to its commit.
    let mut conn = sqlx::PgConnection::connect(&url).await.expect("connect");
    let mut tx = conn.begin().await.expect("begin");
    let payload: Value = sqlx::query_scalar::<_, sqlx::types::Json<Value>>(
        "SELECT payload FROM operations WHERE sandbox = $1",
    )
    .bind(&queued)
    .fetch_one(&mut *tx)
    .await
    .expect("the queued create")
    .0;
    let b = if inserted {
        // As the E2B create does: counted under the tenant's lock, inserted.
        let b = &egress_controller::ids::new("sb");
        egress_controller::store::held_by_tenant(&mut tx, "t1")
            .await
            .expect("counted");
        let new = egress_controller::store::NewSandbox {
            id: b,
            tenant: "t1",
            template: "base",
            egress_profiles: &[],
            inherits_template: true,
        };
        egress_controller::store::insert_sandbox(&mut tx, &new)
            .await
            .expect("inserted");
        b.clone()
    } else {
        queued
    };
    let metrics = egress_controller::metrics::Metrics::new();
    egress_controller::ops::create(&mut tx, &d, &metrics, &b, &payload)
        .await
        .expect("created");
    let revoke = format!("/v1/approvals/{}", approval["id"].as_str().expect("id"));
    let addr = api.addr;
    let revoking =
        tokio::spawn(
            async move { call(addr, "DELETE", &revoke, Some(FEDERATED), &[], None).await },
        );
    tokio::time::sleep(Duration::from_millis(500)).await;
    tx.commit().await.expect("commit");
    let (s, revoked) = revoking.await.expect("revoke");
    assert_eq!(s, 200, "{revoked}");
    let (_, doc) = call(
        api.addr,
        "GET",
        &format!("/v1/sandboxes/{b}"),
        Some(FEDERATED),
        &[],
        None,
    )
    .await;
    assert_eq!(doc["state"], json!("running"), "{doc}");
    assert!(
        !doc["provenance"].to_string().contains("approval"),
        "the revoked approval stayed: {doc}"
    );
    assert_eq!(doc["policy"]["allow"], json!([]), "{doc}");
}

/// A shadow is judged as its promotion would run: with the approvals in
/// force laid over. A promotion is refused (409) once the sandbox's policy
/// changed after the shadow was put (here a replacement adding a deny): the
/// report never judged that change, and promoting would undo it.
#[tokio::test]
async fn a_shadow_carries_the_approvals_and_a_later_change_blocks_its_promotion() {
    let w = setup_world(db!()).await;
    let (id, addr) = sandbox(&w, FEDERATED).await;
    denied_request(&w, &addr).await;
    let (s, a) = approve(&w, FEDERATED, &id, json!({"scope": "sandbox"})).await;
    assert_eq!(s, 201, "{a}");
    until_verdict(&w, &id, "intercept").await;

    let shadow = format!("/v1/sandboxes/{id}/shadow");
    let candidate = json!({"default": "deny", "tls_interception": "on",
        "allow": [{"domain": "docs.example.test"}]});
    let put = |c: Value| {
        call(
            w.api.addr,
            "PUT",
            &shadow,
            Some(FEDERATED),
            &[],
            Some(json!({"policy": c})),
        )
    };
    let (s, doc) = put(candidate.clone()).await;
    assert_eq!(s, 200, "{doc}");
    let allow = doc["effective"]["allow"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(
        allow.contains(&json!({"domain": "api.example.test"})),
        "the approval is in the shadow: {doc}"
    );

    let denied = json!({"default": "deny", "tls_interception": "on",
        "deny": [{"domain": "exfil.example.test"}]});
    let network = format!("/v1/sandboxes/{id}/network");
    let (s, v) = call(
        w.api.addr,
        "PUT",
        &network,
        Some(FEDERATED),
        &[],
        Some(json!({"policy": denied})),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let promote = format!("{shadow}/promote");
    let (s, v) = call(w.api.addr, "POST", &promote, Some(FEDERATED), &[], None).await;
    assert_eq!(s, 409, "promoted over a later change: {v}");
    assert!(
        v["error"]
            .as_str()
            .is_some_and(|e| e.contains("put the shadow again")),
        "{v}"
    );
    let (_, sb) = call(
        w.api.addr,
        "GET",
        &format!("/v1/sandboxes/{id}"),
        Some(FEDERATED),
        &[],
        None,
    )
    .await;
    assert_eq!(
        sb["policy"]["deny"],
        json!([{"domain": "exfil.example.test"}]),
        "{sb}"
    );

    // Put again over the policy as it is now: promoted.
    let (s, doc) = put(candidate).await;
    assert_eq!(s, 200, "{doc}");
    let (s, v) = call(w.api.addr, "POST", &promote, Some(FEDERATED), &[], None).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["policy"]["allow"], doc["effective"]["allow"], "{v}");
}

/// A rule approved until a time is not made lasting by an approval that
/// names no `until` (what the console's Approve sends, after a reload):
/// `409`, naming the approval in force and its end, which is kept. Named,
/// `null` lifts the end. With no end in force, an approval naming none is
/// the same one again.
#[tokio::test]
async fn an_end_in_force_is_lifted_only_when_named() {
    let w = setup_world(db!()).await;
    let (id, _conn, (s, bounded)) = denied_then_approved(&w, "+ interval '1 hour'").await;
    assert_eq!(s, 201, "{bounded}");
    let in_force = || async {
        let list = approvals_listed(&w).await;
        let ids: Vec<Value> = list["approvals"]
            .as_array()
            .expect("a list")
            .iter()
            .filter(|a| a["revoked_at"].is_null())
            .map(|a| a["id"].clone())
            .collect();
        ids
    };
    let (s, v) = approve(&w, FEDERATED, &id, json!({"scope": "sandbox"})).await;
    assert_eq!(s, 409, "{v}");
    let why = v["error"].as_str().unwrap_or_default();
    let until = bounded["until"].as_str().expect("until");
    assert!(
        why.contains(bounded["id"].as_str().expect("id")) && why.contains(until),
        "{v}"
    );
    assert_eq!(in_force().await, [bounded["id"].clone()]);
    let (s, lasting) = approve(
        &w,
        FEDERATED,
        &id,
        json!({"scope": "sandbox", "until": null}),
    )
    .await;
    assert_eq!(s, 201, "{lasting}");
    assert!(lasting["until"].is_null(), "{lasting}");
    assert_eq!(in_force().await, [lasting["id"].clone()]);
    let (s, again) = approve(&w, FEDERATED, &id, json!({"scope": "sandbox"})).await;
    assert_eq!((s, &again["id"]), (200, &lasting["id"]), "{again}");
}

/// A sandbox of FEDERATED's, denied once (a proposal), then that proposal
/// approved for the sandbox until the database's clock `offset` from now:
/// the sandbox, a database connection, the approval's answer.
async fn denied_then_approved(
    w: &Setup,
    offset: &str,
) -> (String, sqlx::PgConnection, (u16, Value)) {
    let (id, addr) = sandbox(w, FEDERATED).await;
    denied_request(w, &addr).await;
    let mut conn = sqlx::PgConnection::connect(&w.url).await.expect("db");
    let until = db_time(&mut conn, offset).await;
    let body = json!({"scope": "sandbox", "until": until});
    let answer = approve(w, FEDERATED, &id, body).await;
    (id, conn, answer)
}

/// The database's clock, `offset` from now (`+ interval '2 seconds'`),
/// as RFC 3339.
/// Approves `id`'s only proposal for `scope` until the database's now and
/// `offset`: the approval (`201`).
async fn approved_until(
    w: &Setup,
    conn: &mut sqlx::PgConnection,
    (id, scope): (&str, &str),
    offset: &str,
) -> Value {
    let until = db_time(conn, offset).await;
    let (s, a) = approve(w, FEDERATED, id, json!({"scope": scope, "until": until})).await;
    assert_eq!(s, 201, "{a}");
    a
}

async fn db_time(conn: &mut sqlx::PgConnection, offset: &str) -> String {
    let sql = format!("SELECT to_json(now() {offset}) #>> '{{}}'");
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_one(conn)
        .await
        .expect("time")
}

/// The gateway closes an approval at its `until` by itself: with no
/// dispatcher left to push the rule out (a controller down, a worker cut
/// off), the sandbox is denied again on time. Before, the gateway held the
/// rule until a push came.
#[tokio::test]
async fn an_approval_closes_on_time_with_no_dispatcher_running() {
    let mut w = setup_world(db!()).await;
    let (id, _, (s, a)) = denied_then_approved(&w, "+ interval '3 seconds'").await;
    assert_eq!(s, 201, "{a}");
    until_verdict(&w, &id, "intercept").await;
    drop(w.dispatcher.take());
    until_verdict(&w, &id, "deny").await;
}

/// An expiry sweep begins no approval past its time budget, the first
/// excepted: a burst of approvals expiring together (each refreshing every
/// sandbox it reached) is spread over rounds, the dispatcher's lease
/// renewals between them. Before, one sweep took up to 256 of them. One
/// that failed is left out of the sweeps for a while, or it would be the
/// first of each.
#[tokio::test]
async fn an_expiry_sweep_past_its_budget_leaves_the_rest_to_the_next() {
    let mut w = setup_world(db!()).await;
    let (id, mut conn, (s, a)) = denied_then_approved(&w, "+ interval '1 hour'").await;
    assert_eq!(s, 201, "{a}");
    for scope in ["template", "tenant"] {
        let (s, a) = approve(&w, FEDERATED, &id, json!({"scope": scope})).await;
        assert_eq!(s, 201, "{scope}: {a}");
    }
    // No dispatcher sweeps them: the sweeps are this test's.
    drop(w.dispatcher.take());
    sqlx::query("UPDATE approvals SET until = now() - interval '1 second'")
        .execute(&mut conn)
        .await
        .expect("past");
    let pool = egress_controller::store::connect(&w.url)
        .await
        .expect("store");
    // The earliest one fails (its rule does not read): left out of the
    // next sweeps, so it is not the first, and only, of each.
    let broken = a["id"].as_str().expect("id").to_owned();
    let break_it = "UPDATE approvals SET until = now() - interval '1 hour', rule = '\"garbage\"'::jsonb WHERE id = $1";
    sqlx::query(break_it)
        .bind(&broken)
        .execute(&mut conn)
        .await
        .expect("break it");
    let mut failed = Vec::new();
    let expire = egress_controller::approvals::expire;
    for (left, done) in [(2, (0, 1)), (1, (1, 0)), (0, (1, 0))] {
        let swept = expire(&pool, Duration::ZERO, &mut failed).await;
        assert_eq!(
            swept.expect("sweep"),
            done,
            "one a sweep, {left} left after it"
        );
    }
    let done = expire(&pool, Duration::from_secs(5), &mut failed).await;
    assert_eq!(
        done.expect("sweep"),
        (0, 0),
        "the failed one waits its 10 s"
    );
    // (A row that does not read is a 503 for the listing.)
    let gone = "DELETE FROM approvals WHERE id = $1";
    sqlx::query(gone)
        .bind(&broken)
        .execute(&mut conn)
        .await
        .expect("delete");
    let list = approvals_listed(&w).await;
    let removed = list["approvals"].as_array().expect("list").iter();
    assert!(removed.clone().count() == 2, "{list}");
    assert!(
        removed.into_iter().all(|a| a["removed_at"].is_string()),
        "{list}"
    );
}
