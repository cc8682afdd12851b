//! A browser that upgrades its resolver to DNS over HTTPS on its own:
//! headless Chromium in a sandbox, DoH forced to `dns.google` by managed
//! policy, behind the real redirect. The gateway answers the DoH, the names
//! are attributed, and an exemption by name splices. Needs Debian's
//! `chromium` and `libnss3-tools` (certutil); skips without them (a failure
//! under `EGRESS_E2E_REQUIRED=1`).

use std::path::Path;
use std::process::Command;

use serde_json::json;

use crate::topology::{available, Topology, SB1_IP};

/// Chromium's managed policy folder on Debian; the test's file is removed
/// at the end (and by name only: other files there are left alone).
const POLICY_DIR: &str = "/etc/chromium/policies/managed";

/// Chromium reads every file of the managed folder, so the tests that
/// write one take turns.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The test's managed policy, in force while it lives.
struct ManagedPolicy(
    std::path::PathBuf,
    #[allow(dead_code)] std::sync::MutexGuard<'static, ()>,
);

impl ManagedPolicy {
    fn write(json: &str) -> Self {
        let turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let path = Path::new(POLICY_DIR).join(format!("egress-test-{}.json", std::process::id()));
        std::fs::create_dir_all(POLICY_DIR).expect("policy dir");
        std::fs::write(&path, json).expect("policy");
        Self(path, turn)
    }
}

impl Drop for ManagedPolicy {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn chromium_present() -> bool {
    let present = Command::new("sh")
        .args(["-c", "command -v chromium && command -v certutil"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !present {
        egress_testkit::skip(
            "chromium with DoH",
            "needs Debian's chromium and libnss3-tools",
        );
    }
    present
}

/// Headless Chromium in the sandbox, trusting the gateway's CA (for DoH)
/// and the fake internet's (for the spliced site) through its own NSS
/// database in `home`, printing the page at `url`.
fn chromium(t: &Topology, home: &Path, url: &str) -> std::process::Output {
    let nss = home.join(".pki/nssdb");
    std::fs::create_dir_all(&nss).expect("nssdb");
    let db = format!("sql:{}", nss.display());
    let run = |args: &[&str]| {
        Command::new("certutil")
            .args(args)
            .output()
            .expect("certutil")
    };
    run(&["-d", &db, "-N", "--empty-password"]);
    for which in ["gateway", "origin"] {
        let ca = t.ca(which);
        let ca = ca.to_str().expect("utf-8");
        let nick = format!("egress-test-{which}");
        assert!(run(&["-d", &db, "-A", "-n", &nick, "-t", "C,,", "-i", ca])
            .status
            .success());
    }
    let profile = home.join("profile");
    Command::new("ip")
        .args(["netns", "exec", &t.sb1, "timeout", "60", "chromium"])
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--virtual-time-budget=10000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(["--dump-dom", url])
        .env("HOME", home)
        .output()
        .expect("chromium")
}

/// Waits (up to 10 s) until the sandbox has no tentative address left: the
/// kernel finishing duplicate address detection on a link-local address
/// while a page loads is a network change to Chromium (`ERR_NETWORK_CHANGED`).
fn settled(t: &Topology) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while std::time::Instant::now() < deadline {
        let out = t.exec(&t.sb1, "ip", &["addr", "show", "tentative"]);
        if out.status.success() && out.stdout.is_empty() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// Loads the relay's page in Chromium under `managed` (a Chromium policy),
/// with the sandbox on `policy`: insists the page arrived, and returns the
/// flow log once the site's flow is in it, and the site's flow.
fn load_the_site(
    t: &Topology,
    policy: &str,
    managed: &str,
) -> (Vec<serde_json::Value>, serde_json::Value) {
    t.push("sb1", SB1_IP, policy);
    settled(t);
    let _policy = ManagedPolicy::write(managed);
    let home = tempfile::tempdir().expect("home");
    let out = chromium(t, home.path(), "https://a.relay.example.test/");
    let page = String::from_utf8_lossy(&out.stdout);
    let flows = t.flows_when(|f| f.iter().any(|l| l["sni"] == "a.relay.example.test"));
    assert!(
        page.contains("fake internet"),
        "page: {page}\nstderr: {}\nflows: {flows:?}",
        String::from_utf8_lossy(&out.stderr)
    );
    let site = flows
        .iter()
        .find(|l| l["sni"] == "a.relay.example.test")
        .cloned()
        .expect("site");
    (flows, site)
}

/// The site's flow: attributed through the DoH the gateway answered, and —
/// Chromium sends GREASE ECH in every ClientHello, which no one can tell
/// from real ECH — terminated (`ech`) though its name is exempt: an
/// exemption granted to the outer name never splices a flow whose real name
/// may be encrypted. The page still loads, through the interception.
#[test]
fn chromium_with_doh_forced_is_attributed_and_its_grease_ech_is_not_spliced() {
    if !available() || !chromium_present() {
        return;
    }
    let t = Topology::new();
    let (flows, site) = load_the_site(
        &t,
        r#"{"default": "deny", "tls_interception": "on",
            "allow": [{"ip": "8.8.8.8"}, {"wildcard_domain": "*.relay.example.test"}],
            "tls_interception_exemptions": [{"wildcard_domain": "*.relay.example.test"}]}"#,
        r#"{"DnsOverHttpsMode": "secure", "DnsOverHttpsTemplates": "https://dns.google/dns-query"}"#,
    );
    let doh: Vec<_> = flows.iter().filter(|l| l["sni"] == "dns.google").collect();
    assert!(!doh.is_empty(), "no DoH flow: {flows:?}");
    assert!(
        doh.iter().any(|l| l["reason"] == json!("doh_answered")),
        "{doh:?}"
    );
    assert_eq!(
        site["attributed"],
        json!(["a.relay.example.test"]),
        "{site}"
    );
    assert_eq!(
        (&site["verdict"], &site["reason"]),
        (&json!("intercept"), &json!("ech")),
        "{site}"
    );
}

/// Automatic DoH (Chromium's default where the system resolver is a known
/// DoH provider) with interception off: the gateway would refuse a DoH flow
/// (`encrypted_dns`), Chromium falls back to (or stays on) port 53, and the
/// site, allowed by name, works on the attribution that DNS made.
#[test]
fn chromium_in_automatic_mode_falls_back_to_port_53_without_interception() {
    if !available() || !chromium_present() {
        return;
    }
    let t = Topology::new();
    let (flows, site) = load_the_site(
        &t,
        r#"{"default": "deny", "allow": [{"ip": "8.8.8.8"}, {"wildcard_domain": "*.relay.example.test"}]}"#,
        r#"{"DnsOverHttpsMode": "automatic"}"#,
    );
    for l in flows.iter().filter(|l| l["dst"] == "8.8.8.8:443") {
        assert_eq!(l["reason"], json!("encrypted_dns"), "{l}");
    }
    assert_eq!(
        (&site["verdict"], &site["reason"]),
        (&json!("splice"), &json!("interception_off")),
        "{site}"
    );
    assert_eq!(
        site["attributed"],
        json!(["a.relay.example.test"]),
        "{site}"
    );
    println!(
        "chromium, automatic DoH, interception off: {} DoH flows refused, the site attributed through port 53",
        flows.iter().filter(|l| l["dst"] == "8.8.8.8:443").count()
    );
}

/// The operator's way to keep a browser's hostname exemptions splicing:
/// Chromium's `EncryptedClientHelloEnabled: false` policy stops its GREASE
/// ECH, and the exempt site, attributed through DoH, is spliced.
#[test]
fn chromium_without_ech_is_spliced_by_its_exemption() {
    if !available() || !chromium_present() {
        return;
    }
    let t = Topology::new();
    let (_, site) = load_the_site(
        &t,
        r#"{"default": "deny", "tls_interception": "on",
            "allow": [{"ip": "8.8.8.8"}, {"wildcard_domain": "*.relay.example.test"}],
            "tls_interception_exemptions": [{"wildcard_domain": "*.relay.example.test"}]}"#,
        r#"{"DnsOverHttpsMode": "secure", "DnsOverHttpsTemplates": "https://dns.google/dns-query",
            "EncryptedClientHelloEnabled": false}"#,
    );
    assert_eq!(
        (&site["verdict"], &site["reason"]),
        (&json!("splice"), &json!("exempt")),
        "{site}"
    );
}
