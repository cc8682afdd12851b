//! The redirect ruleset, applied and removed inside a network namespace made here.

use std::process::Command;

/// A network namespace with one veth pair, deleted when dropped (also on failure).
struct Netns(String);

impl Netns {
    fn new() -> Self {
        let name = format!("egtest-{}", std::process::id());
        run("ip", &["netns", "add", &name]);
        let ns = Self(name);
        run(
            "ip",
            &[
                "-n", &ns.0, "link", "add", "sb-veth0", "type", "veth", "peer", "name", "sb-veth1",
            ],
        );
        ns
    }

    fn exec(&self, program: &str, args: &[&str]) -> std::process::Output {
        Command::new("ip")
            .args(["netns", "exec", &self.0, program])
            .args(args)
            .output()
            .expect("ip netns exec")
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

fn run(program: &str, args: &[&str]) {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!("{program}: {e} (the tests need iproute2 and nftables, as root)")
        });
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn redirect_rules_apply_and_remove_in_a_namespace() {
    let ns = Netns::new();
    let gw = env!("CARGO_BIN_EXE_egress-gateway");
    let out = ns.exec(gw, &["redirect", "--sandbox-iface", "sb-veth0", "--apply"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Applying twice replaces the table rather than doubling it.
    let out = ns.exec(gw, &["redirect", "--sandbox-iface", "sb-veth0", "--apply"]);
    assert!(out.status.success());
    let listed = ns.exec("nft", &["list", "table", "inet", "egress_gw_sb-veth0"]);
    let text = String::from_utf8_lossy(&listed.stdout);
    assert_eq!(
        text.matches(r#"iifname "sb-veth0" meta l4proto tcp redirect to :15001"#)
            .count(),
        1,
        "{text}"
    );
    assert!(
        text.contains("ip daddr 8.8.8.8 meta l4proto { tcp, udp } th dport 53 redirect to :15053"),
        "{text}"
    );
    assert!(
        text.contains("ip daddr 1.1.1.1 meta l4proto { tcp, udp } th dport 53 redirect to :15054"),
        "{text}"
    );
    assert!(
        text.contains(r#"iifname "sb-veth0" meta l4proto udp counter"#) && text.contains("drop"),
        "{text}"
    );

    let out = ns.exec(gw, &["redirect", "--sandbox-iface", "sb-veth0", "--remove"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed = ns.exec("nft", &["list", "ruleset"]);
    assert!(!String::from_utf8_lossy(&listed.stdout).contains("egress_gw_sb-veth0"));
    // Detaching is idempotent (a VM manager's teardown may run twice): the
    // second removal succeeds and leaves nothing behind either.
    let out = ns.exec(gw, &["redirect", "--sandbox-iface", "sb-veth0", "--remove"]);
    assert!(
        out.status.success(),
        "removing twice: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed = ns.exec("nft", &["list", "ruleset"]);
    let text = String::from_utf8_lossy(&listed.stdout);
    assert!(
        !text.contains("egress_gw_sb-veth0") && !text.contains("\"sb-veth0\""),
        "{text}"
    );
}

#[test]
fn redirect_prints_the_ruleset_with_configured_ports() {
    let dir = tempfile::tempdir().expect("dir");
    let cfg = dir.path().join("gw.toml");
    std::fs::write(&cfg, "[listen]\ntransparent = \"0.0.0.0:25001\"\ndns = \"0.0.0.0:25053\"\ndns_alt = \"0.0.0.0:25054\"\n").expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_egress-gateway"))
        .args(["redirect", "--sandbox-iface", "tap0", "--config"])
        .arg(&cfg)
        .output()
        .expect("runs");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("redirect to :25001")
            && text.contains("redirect to :25053")
            && text.contains("redirect to :25054"),
        "{text}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_egress-gateway"))
        .args(["redirect", "--sandbox-iface", "bad name"])
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(1));
}
