//! The whole control path: a sandbox created through the controller's API
//! with `X-Space-Egress-Profiles`, composed and pushed by its dispatcher,
//! and traffic from that sandbox's namespace obeying the composed policy;
//! then the gateway restarts with its state lost and the controller resyncs
//! it. The controller runs in the gateway's namespace (it reaches the
//! gateway's admin API on loopback there) and reaches PostgreSQL over its
//! unix socket (the test cluster of `.ci/pg.sh`), which crosses namespaces.

use std::process::{Child, Command, Stdio};

use serde_json::json;

use crate::topology::*;

pub const TENANT_TOKEN: &str = "tenant-token-0123456789";
pub const ADMIN_TOKEN: &str = "admin-token-0123456789";
/// A second tenant's token.
pub const OTHER_TOKEN: &str = "other-tenant-token-0123456789";
const PROFILES: &str = r#"{"sensor": {
    "allow": [{"domain": "api.example.test"}, {"domain": "other.example.test"}, {"domain": "turn.example.test"}],
    "tls_interception_exemptions": [{"domain": "turn.example.test"}]}}"#;

/// The test cluster's socket directory and port, or `None` (skip) when
/// there is none here.
pub fn postgres() -> Option<(String, String)> {
    match std::env::var("EGRESS_PG_DIR") {
        Ok(dir) => Some((
            dir,
            std::env::var("PGPORT_TEST").unwrap_or_else(|_| "54329".into()),
        )),
        Err(_) => {
            egress_testkit::skip(
                "the controller in namespaces",
                "EGRESS_PG_DIR is not set: start a PostgreSQL test cluster with eval \"$(.ci/pg.sh start)\"",
            );
            None
        }
    }
}

/// The controller's two processes, ended by PID when the test ends.
pub struct Controller(Vec<Child>);

impl Drop for Controller {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub fn start_controller(t: &Topology, url: &str) -> Controller {
    let tenants = t.path("tenants.json");
    std::fs::write(
        &tenants,
        format!(
            r#"{{"tokens": {{"{TENANT_TOKEN}": {{"tenant": "acme", "federated": true}},
                            "{OTHER_TOKEN}": {{"tenant": "globex"}},
                            "{ADMIN_TOKEN}": {{"tenant": "ops", "admin": true}}}}}}"#
        ),
    )
    .expect("tenants");
    let spawn = |args: &[&str], log: &str| {
        Command::new("ip")
            .args(["netns", "exec", &t.gw])
            .arg(bin("egress-controller"))
            .args(args)
            .arg("--tenants")
            .arg(&tenants)
            .env("DATABASE_URL", url)
            .env("SPACE_EGRESS_PROFILES", PROFILES)
            .env_remove("SPACE_TLS_INTERCEPTION_EXEMPTIONS")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(t.path(log)).expect("log"))
            .spawn()
            .expect("controller")
    };
    let api = spawn(&["api", "--listen", "127.0.0.1:8080"], "api.log");
    let dispatcher = spawn(
        &[
            "dispatcher",
            "--resync-interval",
            "500ms",
            "--metrics-listen",
            "127.0.0.1:9090",
        ],
        "dispatcher.log",
    );
    Controller(vec![api, dispatcher])
}

/// A call to the controller's API from the gateway namespace.
pub fn api(
    t: &Topology,
    method: &str,
    path: &str,
    token: &str,
    headers: &[&str],
    body: Option<&str>,
) -> (u16, serde_json::Value) {
    let auth = format!("authorization: Bearer {token}");
    let mut all = vec![auth.as_str()];
    all.extend_from_slice(headers);
    let (code, body) = t.http_in_gw(method, &format!("http://127.0.0.1:8080{path}"), &all, body);
    (code, serde_json::from_str(&body).unwrap_or(json!(body)))
}

#[test]
fn a_sandbox_created_through_the_controller_obeys_its_composed_policy_and_survives_a_gateway_restart(
) {
    if !available() {
        return;
    }
    let Some((socket_dir, port)) = postgres() else {
        return;
    };
    let mut t = Topology::new();
    let url = fresh_database(&socket_dir, &port, "ns");
    let _controller = start_controller(&t, &url);
    base_and_worker(&t);

    // The tenant denies a name the profile allows: the deny wins.
    let tenant = r#"{"template": "base", "policy": {"default": "deny", "tls_interception": "on",
        "deny": [{"domain": "other.example.test"}]}}"#;
    let (s, v) = api(
        &t,
        "POST",
        "/v1/sandboxes",
        TENANT_TOKEN,
        &["X-Space-Egress-Profiles: +sensor"],
        Some(tenant),
    );
    assert_eq!(s, 202, "{v}");
    let id = v["sandbox"].as_str().expect("id").to_owned();
    eventually("the push", || {
        t.admin("GET", &format!("/v1/sandboxes/{id}"), None).0 == 200
    });
    let (_, doc) = api(
        &t,
        "GET",
        &format!("/v1/sandboxes/{id}"),
        TENANT_TOKEN,
        &[],
        None,
    );
    assert_eq!(doc["addresses"], json!([SB1_IP]), "{doc}");
    // The worker's pool is IPv4: the sandbox is known by that address only,
    // so its clients use IPv4 here (IPv6 would be an unknown sandbox: denied).

    // The profile's allow, intercepted (DNS through 8.8.8.8, allowed by composition).
    let (code, body) = t.curl(&t.sb1, "gateway", "https://api.example.test/hello", &["-4"]);
    assert_eq!(code, 0, "{body}");
    assert!(body.contains("host=api.example.test"), "{body}");
    // The tenant's deny beats the profile's allow.
    let (code, _) = t.curl(&t.sb1, "gateway", "https://other.example.test/", &["-4"]);
    assert_ne!(code, 0, "denied");
    // The profile's exemption splices an attributed name: the origin's own certificate.
    assert!(t
        .dig(&t.sb1, "turn.example.test", false)
        .contains("203.0.113.30"));
    let spliced = probe_turn(&t);
    assert_eq!(spliced["issuer_gateway"], json!(false), "{spliced}");

    // The gateway restarts with its state lost: the controller resyncs it.
    t.stop_gateway();
    std::fs::remove_dir_all(t.path("gw-state")).expect("wipe the gateway's state");
    t.start_gateway();
    eventually("the resync", || {
        t.admin("GET", &format!("/v1/sandboxes/{id}"), None).0 == 200
    });
    let (code, body) = t.curl(&t.sb1, "gateway", "https://api.example.test/again", &["-4"]);
    assert_eq!(code, 0, "after the resync: {body}");
    // The gateway says it takes revisions: the controller named one, and
    // a push below it is refused.
    let (_, held) = t.admin("GET", &format!("/v1/sandboxes/{id}"), None);
    let held: serde_json::Value = serde_json::from_str(&held).expect("json");
    let revision = held["revision"].as_u64().expect("a revision");
    let older =
        json!({"addresses": [SB1_IP], "policy": {"default": "allow"}, "revision": revision - 1});
    let (status, body) = t.admin(
        "PUT",
        &format!("/v1/sandboxes/{id}"),
        Some(&older.to_string()),
    );
    assert_eq!(status, 409, "{body}");
}

/// A new database on the test cluster, named after `prefix`, this process
/// and the time (a process id comes again: a cluster kept between runs
/// still holds the databases of earlier ones); its URL (over the cluster's
/// unix socket, which crosses namespaces).
pub fn fresh_database(socket_dir: &str, port: &str, prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let db = format!("{prefix}_{}_{nanos}", std::process::id());
    let created = Command::new("psql")
        .args(["-h", socket_dir, "-p", port, "-U", "postgres", "-q", "-c"])
        .arg(format!("CREATE DATABASE {db}"))
        .output()
        .expect("psql");
    assert!(
        created.status.success(),
        "{}",
        String::from_utf8_lossy(&created.stderr)
    );
    format!("postgres://postgres@localhost:{port}/{db}?host={socket_dir}")
}

/// Once the API answers: the template `base` (deny by default, intercepting)
/// and the worker `w1` (this gateway, sb1's address as its pool).
pub fn base_and_worker(t: &Topology) {
    eventually("the API", || {
        api(t, "GET", "/healthz", TENANT_TOKEN, &[], None).0 == 200
    });
    let (s, v) = api(
        t,
        "PUT",
        "/v1/templates/base",
        ADMIN_TOKEN,
        &[],
        Some(r#"{"policy": {"default": "deny", "tls_interception": "on"}}"#),
    );
    assert_eq!(s, 200, "{v}");
    let worker = format!(r#"{{"admin_url": "http://127.0.0.1:15000", "pool": "{SB1_IP}/32"}}"#);
    let (s, v) = api(t, "PUT", "/v1/workers/w1", ADMIN_TOKEN, &[], Some(&worker));
    assert_eq!(s, 200, "{v}");
}

/// A TLS line to the TURN stand-in: whether the gateway presented the certificate.
fn probe_turn(t: &Topology) -> serde_json::Value {
    let bundle = t.ca("both");
    let out = t.exec(
        &t.sb1,
        env!("CARGO_BIN_EXE_egress-probe"),
        &[
            "line",
            "--connect",
            "203.0.113.30:443",
            "--sni",
            "turn.example.test",
            "--ca",
            bundle.to_str().expect("utf-8"),
            "--send",
            "PING",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("json")
}
