//! The scripted tour: a policy pushed, then what a sandbox sends and what
//! the gateway did with it, one line per step, each checked. A step that
//! does not go as the tour says is an error (the tour exits non-zero), so
//! the tour is also a test of the main job.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::stage::{Stage, SANDBOX_IP};

/// The sandbox's id at the gateway.
const SANDBOX: &str = "demo";
/// What the sandbox holds instead of the API token.
const PLACEHOLDER: &str = "EGRESS_PLACEHOLDER_DEMO";
/// The token itself: only the gateway reads it, from its own file.
const TOKEN: &str = "demo-token-4f1c9a";

/// The policy the tour pushes.
fn policy() -> Value {
    json!({
        "default": "deny",
        "tls_interception": "on",
        "allow": [{"ip": "8.8.8.8"}, {"domain": "api.example.test"},
                  {"domain": "git.example.test"}, {"wildcard_domain": "*.relay.example.test"}],
        "deny": [{"domain": "blocked.example.test"}],
        "tls_interception_exemptions": [{"wildcard_domain": "*.relay.example.test"}]
    })
}

/// Runs every step, printing a line for each; the first step that does not
/// go as described ends the tour with its error.
pub(crate) fn run(stage: &Stage) -> Result<(), String> {
    push(stage)?;
    allowed(stage)?;
    denied(stage)?;
    spliced(stage)?;
    credential(stage)?;
    Ok(())
}

fn push(stage: &Stage) -> Result<(), String> {
    let secret = stage.write_secret("api-token", TOKEN)?;
    let doc = json!({
        "addresses": [SANDBOX_IP],
        "policy": policy(),
        "credentials": [{"name": "api", "placeholder": PLACEHOLDER, "hosts": ["api.example.test"],
            "inject": {"header": "authorization", "format": "Bearer {value}"},
            "source": {"file": secret}}]
    });
    let (status, body) = stage.admin(
        "PUT",
        &format!("/v1/sandboxes/{SANDBOX}"),
        Some(&doc.to_string()),
    );
    expect(status == 200, || {
        format!("the push was refused: {status} {body}")
    })?;
    step(
        "policy",
        &format!("PUT /v1/sandboxes/{SANDBOX}: addresses [{SANDBOX_IP}], default deny, interception on"),
        "200",
        "allow api.example.test, git.example.test, *.relay.example.test (exempt: spliced); deny blocked.example.test; credential `api` bound to api.example.test",
    );
    Ok(())
}

/// DNS through the reserved resolver, then an intercepted request.
fn allowed(stage: &Stage) -> Result<(), String> {
    let answer = dig(stage, "api.example.test")?;
    step(
        "dns",
        "dig @8.8.8.8 api.example.test",
        &answer,
        "answered through the gateway's DNS proxy, which now attributes 203.0.113.10 to api.example.test for this sandbox",
    );
    let (code, body) = curl(
        stage,
        &["--cacert", &path(&stage.gateway_ca())],
        "https://api.example.test/hello",
    )?;
    expect(code == "200", || {
        format!("the allowed request got {code}: {body}")
    })?;
    let flow = flow(stage, |f| f["sni"] == "api.example.test")?;
    step(
        &verdict(&flow),
        "curl https://api.example.test/hello",
        &format!("200 \"{}\"", first_line(&body)),
        &format!(
            "{}; the sandbox saw a certificate minted by the gateway's CA",
            why(&flow)
        ),
    );
    Ok(())
}

/// A denied name: the flow's verdict, and the explain API's account of it.
fn denied(stage: &Stage) -> Result<(), String> {
    dig(stage, "blocked.example.test")?;
    let (code, _) = curl(
        stage,
        &["--cacert", &path(&stage.gateway_ca())],
        "https://blocked.example.test/",
    )?;
    let flow = flow(stage, |f| f["sni"] == "blocked.example.test")?;
    expect(flow["verdict"] == "deny", || {
        format!("blocked.example.test was not denied: {flow}")
    })?;
    step(
        &verdict(&flow),
        "curl https://blocked.example.test/",
        &answer_of(&code),
        &why(&flow),
    );
    let question = json!({"sandbox": SANDBOX, "dst": "203.0.113.44:443", "tls": true, "sni": "blocked.example.test"});
    let (status, body) = stage.admin("POST", "/v1/explain", Some(&question.to_string()));
    let explained: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
    expect(status == 200 && explained["verdict"] == "deny", || {
        format!("explain: {status} {body}")
    })?;
    step(
        "explain",
        "POST /v1/explain {\"dst\": \"203.0.113.44:443\", \"sni\": \"blocked.example.test\"}",
        &format!("verdict {}", explained["verdict"].as_str().unwrap_or("?")),
        &explained_why(&explained),
    );
    Ok(())
}

/// An exempt name, after DNS: spliced, the origin's own certificate.
fn spliced(stage: &Stage) -> Result<(), String> {
    dig(stage, "a.relay.example.test")?;
    // Trusting only the origin's CA: a minted certificate would fail.
    let (code, body) = curl(
        stage,
        &["--cacert", &path(&stage.origin_ca())],
        "https://a.relay.example.test/",
    )?;
    expect(code == "200", || {
        format!("the exempt request got {code}: {body}")
    })?;
    let flow = flow(stage, |f| f["sni"] == "a.relay.example.test")?;
    expect(flow["verdict"] == "splice", || {
        format!("a.relay.example.test was not spliced: {flow}")
    })?;
    step(
        &verdict(&flow),
        "curl https://a.relay.example.test/",
        "200",
        &format!(
            "{}; encrypted end to end: the sandbox verified the origin's own certificate",
            why(&flow)
        ),
    );
    Ok(())
}

/// The credential: injected for its host, refused for another.
fn credential(stage: &Stage) -> Result<(), String> {
    let ca = path(&stage.gateway_ca());
    let header = format!("authorization: Bearer {PLACEHOLDER}");
    let (code, body) = curl(
        stage,
        &["--cacert", &ca, "-H", &header],
        "https://api.example.test/whoami",
    )?;
    expect(code == "200", || {
        format!("the credential's host got {code}: {body}")
    })?;
    let seen = seen_by_origin(stage, "/whoami")?;
    expect(
        seen.contains(&format!("authorization=Bearer {TOKEN}")),
        || format!("the origin saw: {seen}"),
    )?;
    step(
        "inject",
        &format!("curl -H 'authorization: Bearer {PLACEHOLDER}' https://api.example.test/whoami"),
        "200",
        "the origin received the real token in place of the placeholder; the sandbox never held it",
    );
    dig(stage, "git.example.test")?;
    let (code, _) = curl(
        stage,
        &["--cacert", &ca, "-H", &header],
        "https://git.example.test/",
    )?;
    let flow = flow(stage, |f| f["sni"] == "git.example.test")?;
    let refused = flow["request_denied"].as_str().unwrap_or("");
    expect(
        code == "403" && refused.starts_with("credential_host_mismatch"),
        || format!("the placeholder to git.example.test got {code}: {flow}"),
    )?;
    step(
        "refuse",
        &format!("curl -H 'authorization: Bearer {PLACEHOLDER}' https://git.example.test/"),
        "403",
        "credential_host_mismatch: the placeholder is bound to api.example.test; sent anywhere else it is an exfiltration attempt, and nothing was forwarded",
    );
    Ok(())
}

// === the sandbox's tools ===

/// `dig +short @8.8.8.8 name` in the sandbox: its answer.
fn dig(stage: &Stage, name: &str) -> Result<String, String> {
    let out = stage.exec(
        &stage.sandbox,
        "dig",
        &["+short", "+time=3", "+tries=1", "@8.8.8.8", name],
    )?;
    let answer = String::from_utf8_lossy(&out.stdout)
        .trim()
        .replace('\n', " ");
    expect(!answer.is_empty(), || format!("dig {name}: no answer"))?;
    Ok(answer)
}

/// `curl` in the sandbox: (HTTP status or `000`, body and errors).
fn curl(stage: &Stage, extra: &[&str], url: &str) -> Result<(String, String), String> {
    let mut args = vec!["-sS", "--max-time", "8", "-w", "\n%{http_code}"];
    args.extend_from_slice(extra);
    args.push(url);
    let out = stage.exec(&stage.sandbox, "curl", &args)?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "000"));
    let errors = String::from_utf8_lossy(&out.stderr);
    Ok((code.trim().to_owned(), format!("{body}{errors}")))
}

/// The first flow-log line that `matches`, waiting up to 5 s (a flow's line
/// is written as it ends).
fn flow(stage: &Stage, matches: impl Fn(&Value) -> bool) -> Result<Value, String> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let text = std::fs::read_to_string(stage.flow_log()).unwrap_or_default();
        let found = text
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|f| matches(f));
        match found {
            Some(f) => return Ok(f),
            None if Instant::now() > deadline => {
                return Err("no flow-log line for the step".to_owned())
            }
            None => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// What the origin saw for `path` (its request log, read from the worker).
fn seen_by_origin(stage: &Stage, path: &str) -> Result<String, String> {
    let out = stage.exec(
        &stage.worker,
        "curl",
        &["-s", "--max-time", "5", "http://203.0.113.10/_seen"],
    )?;
    let seen: Vec<String> = serde_json::from_slice(&out.stdout).unwrap_or_default();
    Ok(seen
        .into_iter()
        .filter(|l| l.contains(path))
        .collect::<Vec<_>>()
        .join("; "))
}

// === printing ===

fn step(what: &str, sent: &str, answer: &str, why: &str) {
    println!("  {what:<9} {sent}\n            -> {answer}: {why}");
}

fn verdict(flow: &Value) -> String {
    flow["verdict"].as_str().unwrap_or("?").to_owned()
}

/// The flow's reason code and its readable detail.
fn why(flow: &Value) -> String {
    format!(
        "{} ({})",
        flow["reason"].as_str().unwrap_or("?"),
        flow["detail"].as_str().unwrap_or("")
    )
}

fn explained_why(v: &Value) -> String {
    let reason = v["reason"].as_str().unwrap_or("?");
    let detail = v["detail"]
        .as_str()
        .or_else(|| v["rule"].as_str())
        .unwrap_or("");
    format!("{reason} {detail}").trim().to_owned()
}

fn answer_of(code: &str) -> String {
    if code == "000" {
        "connection reset, no answer".to_owned()
    } else {
        code.to_owned()
    }
}

fn first_line(body: &str) -> &str {
    body.lines().next().unwrap_or("").trim()
}

fn path(p: &std::path::Path) -> String {
    p.to_string_lossy().into_owned()
}

fn expect(ok: bool, err: impl FnOnce() -> String) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(err())
    }
}
