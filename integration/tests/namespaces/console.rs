//! The operator console (docs/console.md) in headless Chromium, against the
//! controller's API and dispatcher processes on PostgreSQL and the real
//! gateway, with traffic from a sandbox's namespace: log in with a tenant's
//! token, find the sandbox, read a rule's provenance, see a denial appear
//! without a reload after the sandbox is blocked, approve its proposal,
//! and the sandbox reaches the destination; another tenant's token sees
//! nothing and cannot approve.
//!
//! Chromium runs in the gateway's namespace (where the API listens on
//! loopback) and is driven over the DevTools protocol on a pipe
//! (`--remote-debugging-pipe`: JSON messages ended by NUL on fds 3 and 4,
//! here the child's stdin and stdout), so no port crosses namespaces.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::Duration;

use serde_json::{json, Value};

use crate::controller::*;
use crate::topology::*;

/// The longest one DevTools command may take (generous: the first, while
/// the browser starts on a loaded machine, is slow).
const WAIT: Duration = Duration::from_secs(90);
const CONSOLE: &str = "http://127.0.0.1:8080/console/";

/// Headless Chromium in a namespace, its one page driven over the pipe.
struct Browser {
    child: Child,
    to: ChildStdin,
    from: Receiver<Vec<u8>>,
    next_id: u64,
    session: String,
}

impl Browser {
    fn start(t: &Topology) -> Self {
        let profile = t.path("chromium-profile");
        let script = "exec chromium \"$@\" 3<&0 4>&1 </dev/null >/dev/null";
        let mut child = Command::new("ip")
            .args(["netns", "exec", &t.gw, "sh", "-c", script, "chromium"])
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-extensions",
                "--disable-background-networking",
                "--remote-debugging-pipe",
                "--window-size=1280,800",
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(t.path("chromium.log")).expect("log"))
            .spawn()
            .expect("chromium");
        let to = child.stdin.take().expect("stdin");
        let out = child.stdout.take().expect("stdout");
        let (tx, from) = channel();
        std::thread::spawn(move || {
            let mut out = BufReader::new(out);
            loop {
                let mut msg = Vec::new();
                match out.read_until(0, &mut msg) {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {
                        msg.pop();
                        if tx.send(msg).is_err() {
                            return;
                        }
                    }
                }
            }
        });
        let mut b = Self {
            child,
            to,
            from,
            next_id: 0,
            session: String::new(),
        };
        b.attach();
        b
    }

    /// Attaches to a new page target (flattened: commands carry its session).
    fn attach(&mut self) {
        let target = self.call("Target.createTarget", json!({"url": "about:blank"}));
        let id = target["targetId"].clone();
        let attached = self.call(
            "Target.attachToTarget",
            json!({"targetId": id, "flatten": true}),
        );
        self.session = attached["sessionId"]
            .as_str()
            .expect("a session")
            .to_owned();
        self.call("Page.enable", json!({}));
        self.call("Runtime.enable", json!({}));
    }

    /// One command (to the page once attached); the whole answer.
    fn exchange(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let mut msg = json!({"id": id, "method": method, "params": params});
        if !self.session.is_empty() {
            msg["sessionId"] = json!(self.session);
        }
        let mut bytes = msg.to_string().into_bytes();
        bytes.push(0);
        self.to.write_all(&bytes).expect("write to chromium");
        loop {
            let raw = self
                .from
                .recv_timeout(WAIT)
                .unwrap_or_else(|_| panic!("{method}: no answer within {WAIT:?}"));
            let v: Value = serde_json::from_slice(&raw).expect("DevTools JSON");
            if v["id"] == json!(id) {
                return v;
            }
        }
    }

    fn call(&mut self, method: &str, params: Value) -> Value {
        let answer = self.exchange(method, params);
        assert!(answer.get("error").is_none(), "{method}: {answer}");
        answer["result"].clone()
    }

    fn navigate(&mut self, url: &str) {
        self.call("Page.navigate", json!({"url": url}));
    }

    fn eval(&mut self, expression: &str) -> Value {
        let p = json!({"expression": expression, "returnByValue": true, "awaitPromise": true});
        let r = self.call("Runtime.evaluate", p);
        assert!(r.get("exceptionDetails").is_none(), "{expression}: {r}");
        r["result"]["value"].clone()
    }

    /// Polls `expression` until it is truthy (≤ 30 s); its value.
    fn until(&mut self, expression: &str) -> Value {
        let wrapped =
            format!("(() => {{ try {{ return {expression}; }} catch (e) {{ return null; }} }})()");
        for _ in 0..300 {
            let p = json!({"expression": wrapped, "returnByValue": true});
            let v = self.exchange("Runtime.evaluate", p)["result"]["result"]["value"].clone();
            if !(v.is_null() || v == json!(false) || v == json!("") || v == json!(0)) {
                return v;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let text = self.eval("document.body.innerText");
        panic!("never true: {expression}\npage:\n{text}");
    }

    fn text_of(&mut self, id: &str) -> String {
        let v = self.eval(&format!("document.getElementById('{id}').innerText"));
        v.as_str().unwrap_or_default().to_owned()
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn chromium_present() -> bool {
    let present = Command::new("sh")
        .args(["-c", "command -v chromium"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !present {
        egress_testkit::skip("the console in a browser", "needs Debian's chromium");
    }
    present
}

/// sb1's `GET http://plain.example.test/`: the HTTP status (the gateway's
/// `403` when denied).
fn reach(t: &Topology) -> u16 {
    let args = ["-4", "-o", "/dev/null", "-w", "%{http_code}"];
    let (_, out) = t.curl(&t.sb1, "gateway", "http://plain.example.test/", &args);
    out.trim().parse().unwrap_or(0)
}

/// The policy row whose rule names `what`, as text.
fn row_of(what: &str) -> String {
    format!("[...document.querySelectorAll('[data-list]')].map(r => r.innerText).find(t => t.includes('{what}'))")
}

#[test]
fn an_operator_sees_a_denial_in_the_console_approves_it_and_the_sandbox_gets_through() {
    if !available() || !chromium_present() {
        return;
    }
    let Some((socket_dir, port)) = postgres() else {
        return;
    };
    let t = Topology::new();
    let url = fresh_database(&socket_dir, &port, "console");
    let _controller = start_controller(&t, &url);
    base_and_worker(&t);
    let body = r#"{"template": "base", "policy": {"default": "deny", "tls_interception": "on",
        "allow": [{"ip": "8.8.8.8"}]}}"#;
    let profiles = ["X-Space-Egress-Profiles: +sensor"];
    let (s, v) = api(
        &t,
        "POST",
        "/v1/sandboxes",
        TENANT_TOKEN,
        &profiles,
        Some(body),
    );
    assert_eq!(s, 202, "{v}");
    let id = v["sandbox"].as_str().expect("id").to_owned();
    eventually("the push", || {
        t.admin("GET", &format!("/v1/sandboxes/{id}"), None).0 == 200
    });
    let mut b = Browser::start(&t);

    // Log in with the tenant's token and find the sandbox.
    b.navigate(&format!("{CONSOLE}#token={TENANT_TOKEN}&then=sandboxes"));
    b.until("document.getElementById('counts')");
    assert!(b.text_of("counts").starts_with("1 sandboxes"));
    b.eval(&format!(
        "document.querySelector('a[href=\"#sandbox/{id}\"]').click(); 1"
    ));
    // A rule and where it came from: the profile, and the tenant's own.
    let sensor = b.until(&row_of("api.example.test"));
    assert!(
        sensor.as_str().expect("row").contains("profile\tsensor"),
        "{sensor}"
    );
    let own = b.eval(&row_of("8.8.8.8"));
    assert!(own.as_str().expect("row").contains("tenant"), "{own}");

    // A shadow that would deny what the profile allows: the flow passes,
    // and shows on the page as a would-deny with the shadow's reason.
    let shadow = r#"{"policy": {"default": "deny", "tls_interception": "on",
        "allow": [{"ip": "8.8.8.8"}], "deny": [{"domain": "api.example.test"}]}}"#;
    let path = format!("/v1/sandboxes/{id}/shadow");
    let (s, v) = api(&t, "PUT", &path, TENANT_TOKEN, &[], Some(shadow));
    assert_eq!(s, 200, "{v}");
    let (code, body) = t.curl(&t.sb1, "gateway", "https://api.example.test/hello", &["-4"]);
    assert_eq!(code, 0, "the shadow enforced something: {body}");
    b.until("document.getElementById('denials').innerText.includes('would deny (shadow)')");
    let denials = b.text_of("denials");
    assert!(
        denials.contains("api.example.test") && denials.contains("tenant_deny"),
        "{denials}"
    );
    assert!(b.eval("document.getElementById('promote') !== null") == json!(true));

    // Blocked: the denial shows up on the open page, no reload.
    b.eval("window.notReloaded = true");
    assert_eq!(reach(&t), 403, "before the approval");
    b.until("document.getElementById('denials').innerText.includes('plain.example.test')");
    assert_eq!(b.eval("window.notReloaded"), json!(true));

    // Approved from the console: the sandbox gets through.
    let button = "[...document.querySelectorAll('#proposals tr')]
        .find(r => r.innerText.includes('plain.example.test'))?.querySelector('button.approve')";
    b.until(button);
    b.eval(&format!("{button}.click(); 1"));
    b.until("document.getElementById('proposals').innerText.includes('Approved (')");
    eventually("the approval pushed", || reach(&t) == 200);

    // Another tenant's token: no sandbox, and the approve route says 404.
    let (_, doc) = api(
        &t,
        "GET",
        &format!("/v1/sandboxes/{id}/proposals"),
        TENANT_TOKEN,
        &[],
        None,
    );
    let pid = doc["proposals"][0]["id"]
        .as_str()
        .expect("a proposal")
        .to_owned();
    let _ = b.eval("sessionStorage.clear(); 1");
    b.navigate(&format!("{CONSOLE}#token={OTHER_TOKEN}&then=sandboxes"));
    b.until("document.getElementById('counts')");
    assert!(b.text_of("counts").starts_with("0 sandboxes"));
    let status = b.eval(&format!(
        "fetch('/v1/sandboxes/{id}/proposals/{pid}/approve', {{method: 'POST',
           headers: {{'Authorization': 'Bearer ' + sessionStorage.getItem('egress-console-token')}},
           body: JSON.stringify({{scope: 'tenant'}})}}).then(r => r.status)"
    ));
    assert_eq!(status, json!(404));
}
