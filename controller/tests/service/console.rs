//! The operator console in headless Chromium against a real controller on
//! PostgreSQL and a real gateway: log in with a tenant's token, find the
//! sandbox, read a rule's provenance, see a denial appear without a
//! reload, approve its proposal, see the sandbox's flow allowed by the
//! gateway; another tenant's token sees and approves nothing.
//!
//! With `EGRESS_CONSOLE_SCREENSHOTS=<dir>` it also writes a 1280×800 PNG
//! of each page there (docs/console/ holds the committed ones).

use std::net::SocketAddr;
use std::sync::Arc;

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::browser::Browser;
use crate::db;
use crate::support::*;

/// Every transparent connection "to" this fake origin (never dialled:
/// the denied flow is answered by the gateway).
struct ToOrigin;

impl egress_gateway::OriginalDst for ToOrigin {
    fn original_dst(&self, _: &tokio::net::TcpStream) -> std::io::Result<SocketAddr> {
        Ok("198.51.100.7:80".parse().expect("addr"))
    }
}

struct Setup {
    gw: egress_gateway::Gateway,
    api: ApiProcess,
    _dispatcher: DispatcherTask,
    _dir: tempfile::TempDir,
}

/// Sandboxes on loopback (`127.0.0.0/29`), a deny-by-default template with
/// one rule of its own, and the test deployment's profiles and exemptions.
async fn setup_world(url: String) -> Setup {
    let dir = tempfile::tempdir().expect("dir");
    let gw = gateway_with(dir.path(), "127.0.0.1:0", Arc::new(ToOrigin)).await;
    let d = deployment(Some(PROFILES), Some(EXEMPTIONS));
    let api = api(&url, d.clone()).await;
    let template = json!({"default": "deny", "tls_interception": "on",
                          "allow": [{"domain": "docs.example.test"},
                                    {"domain": "git.example.test", "streams": ["ssh"]}]});
    setup(&api, template, gw.bound().admin, "127.0.0.0/29").await;
    let dispatcher = dispatcher(&url, d, limits(5, 60_000, 100)).await;
    Setup {
        gw,
        api,
        _dispatcher: dispatcher,
        _dir: dir,
    }
}

/// A running sandbox of the federated tenant `t1`: its id and address.
async fn sandbox(w: &Setup) -> (String, String) {
    let (s, v) = call(
        w.api.addr,
        "POST",
        "/v1/sandboxes",
        Some(FEDERATED),
        &[],
        Some(json!({"template": "base"})),
    )
    .await;
    assert_eq!(s, 202, "{v}");
    settled(&w.api, FEDERATED, v["operation"].as_str().expect("op")).await;
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
    s.write_all(b"GET /v1/items HTTP/1.1\r\nHost: api.example.test\r\n\r\n")
        .await
        .expect("write");
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer).await;
    assert!(answer.starts_with(b"HTTP/1.1 403"), "{answer:?}");
}

/// Where the screenshots go, if anywhere.
fn shots() -> Option<std::path::PathBuf> {
    std::env::var_os("EGRESS_CONSOLE_SCREENSHOTS").map(Into::into)
}

/// A screenshot of the page named `name`, scrolled to the element `at`
/// (an id; empty: the top).
async fn shot(b: &mut Browser, name: &str, at: &str) {
    if let Some(dir) = shots() {
        b.eval(&format!(
            "(document.getElementById('{at}') || document.body).scrollIntoView(); 1"
        ))
        .await;
        b.screenshot(&dir.join(format!("{name}.png"))).await;
    }
}

/// The text of the policy row whose rule names `what`.
fn row_of(what: &str) -> String {
    format!(
        "[...document.querySelectorAll('[data-list]')].map(r => r.innerText).find(t => t.includes('{what}'))"
    )
}

/// Submits the explain form for TLS to `api.example.test` and waits for
/// the answer; its text.
async fn explain(b: &mut Browser) -> String {
    b.eval(
        "document.getElementById('explain-result').replaceChildren();
         document.getElementById('explain-dst').value = '198.51.100.7:443';
         document.getElementById('explain-sni').value = 'api.example.test';
         document.getElementById('explain-method').value = 'GET';
         document.getElementById('explain-path').value = '/v1/items';
         document.querySelector('#explain-result').closest('section').querySelector('form').requestSubmit(); 1",
    )
    .await;
    let v = b
        .until("document.getElementById('explain-result').innerText")
        .await;
    v.as_str().unwrap_or_default().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_finds_a_sandbox_reads_provenance_sees_a_denial_and_approves_it() {
    let w = setup_world(db!()).await;
    let Some(mut b) = Browser::start().await else {
        return;
    };
    let (id, addr) = sandbox(&w).await;
    let base = format!("http://{}/console/", w.api.addr);
    b.viewport(1280, 800).await;

    // Log in (the token in the fragment is kept in the tab, then dropped
    // from the address) and find the sandbox.
    b.navigate(&format!("{base}#token={FEDERATED}&then=sandboxes"))
        .await;
    // Waited for as it should read: the page may still show, or draw again,
    // what it showed before (`until` fails with the page's text).
    b.until(&counts_are("1 sandboxes")).await;
    assert_eq!(b.eval("location.hash").await, json!("#sandboxes"));
    assert_eq!(
        b.eval("sessionStorage.getItem('egress-console-token')")
            .await,
        json!(FEDERATED)
    );
    assert_eq!(b.eval("document.cookie").await, json!(""));
    shot(&mut b, "sandboxes", "").await;
    b.eval(&format!(
        "document.querySelector('a[href=\"#sandbox/{id}\"]').click(); 1"
    ))
    .await;

    // Each rule with where it came from.
    b.until(&row_of("audit.example.test")).await;
    let audit = b.eval(&row_of("audit.example.test")).await;
    assert!(
        audit.as_str().expect("row").contains("profile\taudit"),
        "{audit}"
    );
    let docs = b.eval(&row_of("docs.example.test")).await;
    assert!(docs.as_str().expect("row").contains("tenant"), "{docs}");
    // A rule's qualifiers are shown with it: what it lets through.
    let git = b.eval(&row_of("git.example.test")).await;
    assert!(
        git.as_str().expect("row").contains(r#"streams=["ssh"]"#),
        "{git}"
    );
    let relay = b.eval(&row_of("relay.example.test")).await;
    assert!(
        relay
            .as_str()
            .expect("row")
            .contains("deployment exemption"),
        "{relay}"
    );

    // A denial appears without a reload, with its reason code linked.
    b.eval("window.notReloaded = true").await;
    b.until("document.querySelector('button.approve') === null")
        .await;
    denied_request(&w, &addr).await;
    b.until("document.querySelector('#denials a[href^=\"#reasons/\"]')")
        .await;
    let denials = b.eval("document.getElementById('denials').innerText").await;
    let denials = denials.as_str().expect("text");
    assert!(
        denials.contains("api.example.test") && denials.contains("no_dns_seen"),
        "{denials}"
    );
    assert_eq!(b.eval("window.notReloaded").await, json!(true));

    // Explained as denied now.
    let before = explain(&mut b).await;
    assert!(before.contains("deny"), "{before}");
    shot(&mut b, "sandbox", "").await;

    // Approve the proposal; the gateway lets the flow through.
    // By keyboard: Tab from the top of the page reaches Approve, Enter presses it.
    b.until("document.querySelector('button.approve')").await;
    b.eval("document.activeElement.blur(); window.scrollTo(0, 0); 1")
        .await;
    let mut reached = false;
    for _ in 0..80 {
        b.key("Tab").await;
        let on = b
            .eval("document.activeElement.classList.contains('approve')")
            .await;
        if on == json!(true) {
            reached = true;
            break;
        }
    }
    assert!(reached, "Tab never reached Approve");
    b.key("Enter").await;
    b.until("document.getElementById('proposals').innerText.includes('Approved (')")
        .await;
    shot(&mut b, "sandbox-denials-proposals", "h-denials").await;
    let mut answer = String::new();
    for _ in 0..100 {
        answer = explain(&mut b).await;
        if answer.contains("intercept") {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(answer.contains("intercept"), "{answer}");
    b.navigate(&format!("{base}#sandboxes")).await;
    b.until("document.getElementById('counts')").await;
    b.navigate(&format!("{base}#sandbox/{id}")).await;
    b.until(&row_of("api.example.test")).await;
    let approved = b.eval(&row_of("api.example.test")).await;
    assert!(
        approved.as_str().expect("row").contains("approval"),
        "{approved}"
    );
    // The skip link moves the focus and stays on the page.
    let hash = b.eval("location.hash").await;
    b.eval("document.querySelector('a.skip').click(); 1").await;
    assert_eq!(b.eval("document.activeElement.id").await, json!("main"));
    assert_eq!(b.eval("location.hash").await, hash);
    promote_a_shadow(&mut b, &w, &id).await;

    another_tenant_sees_nothing(&mut b, &w, &base, &id).await;
    admin_pages(&mut b, &base, &id).await;
}

/// A shadow put through the API shows on the open page with its report;
/// Promote makes it the policy.
async fn promote_a_shadow(b: &mut Browser, w: &Setup, id: &str) {
    let candidate = json!({"policy": {"default": "deny", "tls_interception": "on",
        "allow": [{"domain": "docs.example.test"}, {"domain": "extra.example.test"}]}});
    let path = format!("/v1/sandboxes/{id}/shadow");
    let (s, v) = call(
        w.api.addr,
        "PUT",
        &path,
        Some(FEDERATED),
        &[],
        Some(candidate),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    b.until("document.getElementById('promote')").await;
    shot(b, "sandbox-shadow-explain", "h-shadow").await;
    b.eval("document.getElementById('promote').click(); 1")
        .await;
    b.until("document.getElementById('shadow').innerText.includes('Promoted')")
        .await;
    let (_, doc) = call(
        w.api.addr,
        "GET",
        &format!("/v1/sandboxes/{id}"),
        Some(FEDERATED),
        &[],
        None,
    )
    .await;
    assert!(
        doc["policy"].to_string().contains("extra.example.test"),
        "{doc}"
    );
    assert_eq!(
        call(
            w.api.addr,
            "GET",
            &format!("{path}/report"),
            Some(FEDERATED),
            &[],
            None
        )
        .await
        .0,
        404
    );
}

/// Tenant `t2`'s token: no sandbox in the list, none to open, nothing to approve.
async fn another_tenant_sees_nothing(b: &mut Browser, w: &Setup, base: &str, id: &str) {
    // A link with another token does not switch a logged-in tab unseen
    // (the page has had a second to render whoever it is for).
    b.navigate(&format!("{base}#token={PLAIN}&then=sandboxes"))
        .await;
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    let counts = b.until("document.getElementById('counts').innerText").await;
    assert!(
        !counts.as_str().expect("text").starts_with("0 sandboxes"),
        "a link switched the tab to another tenant: {counts}"
    );
    b.eval("sessionStorage.clear(); 1").await;
    b.navigate(&format!("{base}#token={PLAIN}&then=sandboxes"))
        .await;
    b.until(&counts_are("0 sandboxes")).await;
    b.navigate(&format!("{base}#sandbox/{id}")).await;
    b.until("document.querySelector('[role=alert]')").await;
    let text = b.text().await;
    assert!(
        text.contains("no sandbox") && !text.contains("audit.example.test"),
        "{text}"
    );
    let (_, doc) = call(
        w.api.addr,
        "GET",
        &format!("/v1/sandboxes/{id}/proposals"),
        Some(FEDERATED),
        &[],
        None,
    )
    .await;
    let pid = doc["proposals"]
        .as_array()
        .and_then(|l| l.first())
        .map(|p| p["id"].clone());
    let pid = pid.unwrap_or(Value::String("p-any".into()));
    let status = b
        .eval(&format!(
            "fetch('/v1/sandboxes/{id}/proposals/' + {pid} + '/approve', {{method: 'POST',
               headers: {{'Authorization': 'Bearer ' + sessionStorage.getItem('egress-console-token')}},
               body: JSON.stringify({{scope: 'tenant'}})}}).then(r => r.status)"
        ))
        .await;
    assert_eq!(status, json!(404));
}

/// The admin's pages: every tenant's sandboxes, workers, operations, a
/// reason code; narrow screens do not scroll sideways.
async fn admin_pages(b: &mut Browser, base: &str, id: &str) {
    b.eval("sessionStorage.clear(); 1").await;
    b.navigate(&format!("{base}#token={ADMIN}&then=workers"))
        .await;
    b.until("document.querySelector('main table')").await;
    let text = b.text().await;
    assert!(text.contains("w1") && text.contains("ready"), "{text}");
    shot(b, "workers", "").await;
    b.navigate(&format!("{base}#operations")).await;
    b.until("document.getElementById('queue-depth')").await;
    assert_eq!(
        b.eval("document.getElementById('queue-depth').innerText")
            .await,
        json!("0")
    );
    shot(b, "operations", "").await;
    b.navigate(&format!("{base}#reasons/no_allow_match")).await;
    b.until("document.querySelector('tr.chosen')").await;
    shot(b, "reason-code", "").await;
    b.viewport(390, 800).await;
    for page in [
        "sandboxes".to_owned(),
        format!("sandbox/{id}"),
        "operations".to_owned(),
    ] {
        b.navigate(&format!("{base}#{page}")).await;
        b.until("document.querySelector('main table') || document.querySelector('main dl')")
            .await;
        let fits = b
            .eval("document.documentElement.scrollWidth <= window.innerWidth")
            .await;
        assert_eq!(fits, json!(true), "{page} scrolls sideways at 390 px");
    }
    shot(b, "narrow", "").await;
}

/// A page expression: the sandbox counts are drawn and start with `text`.
fn counts_are(text: &str) -> String {
    format!("(document.getElementById('counts')?.innerText ?? '').startsWith('{text}')")
}
