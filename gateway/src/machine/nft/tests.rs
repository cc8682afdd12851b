use super::*;

fn policy(text: &str) -> MachineEgress {
    MachineEgress::from_json(text).expect("valid policy")
}

/// Where `rule` starts in `chain`; panics when it is missing, so an ordering
/// check cannot pass because one side is absent (`None` orders first).
fn at(chain: &str, rule: &str) -> usize {
    chain
        .find(rule)
        .unwrap_or_else(|| panic!("no `{rule}` in {chain}"))
}

fn addrs() -> Vec<IpAddr> {
    vec![
        "100.64.3.2".parse().expect("ip"),
        "2001:db8::2".parse().expect("ip"),
    ]
}

#[test]
fn table_names_never_collide() {
    assert_eq!(table_name("vm1"), "egress_vm_vm1");
    assert_eq!(table_name("a-b"), "egress_vm_a_2db");
    assert_eq!(table_name("a_b"), "egress_vm_a_5fb");
    assert_eq!(table_name("a.b"), "egress_vm_a_2eb");
    assert_ne!(table_name("a-b"), table_name("a_b"));
}

#[test]
fn an_allowlist_compiles_into_interval_and_concatenated_sets() {
    let p = policy(
        r#"{"mode": "allowlist", "rules": [
            {"cidr": "10.0.0.0/8", "proto": "tcp", "port": 5151},
            {"cidr": "91.189.88.0/21", "proto": "tcp"},
            {"cidr": "0.0.0.0/0", "proto": "udp", "port": 53},
            {"cidr": "198.51.100.7"}]}"#,
    );
    let r = ruleset("vm1", &addrs(), &p, 4096);
    assert!(r.starts_with("# egress-gateway"));
    // Declared, deleted and declared again: one transaction replaces it whole.
    assert!(r.contains(
        "table inet egress_vm_vm1\ndelete table inet egress_vm_vm1\ntable inet egress_vm_vm1 {"
    ));
    assert!(r.contains("set src4 { type ipv4_addr; elements = { 100.64.3.2 }; }"));
    assert!(r.contains("set src6 { type ipv6_addr; elements = { 2001:db8::2 }; }"));
    assert!(
        r.contains("set any { type ipv4_addr; flags interval; elements = { 198.51.100.7/32 }; }")
    );
    assert!(r.contains("elements = { 91.189.88.0/21 . tcp }"));
    assert!(r.contains("10.0.0.0/8 . tcp . 5151"));
    assert!(r.contains("0.0.0.0/0 . udp . 53"));
    assert!(r.contains("size 4096"));
    let egress4 = &r[r.find("chain egress4").expect("chain")..];
    assert!(egress4.contains("ip daddr @any accept"));
    // Open flows keep their verdict: the conntrack fast path comes first.
    let forward = &r[r.find("chain forward").expect("chain")..];
    assert!(
        at(forward, "ct state established,related accept") < at(forward, "ip saddr @src4"),
        "{forward}"
    );
    // Recording comes before the drop, in its own rule.
    assert!(at(egress4, "update @observed") < at(egress4, "counter name refused drop"));
    // IPv6 from the VM: rules are IPv4 only, so nothing passes.
    let egress6 = &r[r.find("chain egress6").expect("chain")..];
    assert!(egress6.contains("counter name refused drop"));
}

#[test]
fn each_mode_has_its_verdict() {
    let chain = |mode: &str| {
        let r = ruleset(
            "vm",
            &addrs(),
            &policy(&format!(r#"{{"mode": "{mode}"}}"#)),
            64,
        );
        let start = r.find("chain egress4").expect("chain");
        let end = r.find("chain egress6").expect("next chain");
        r[start..end].to_owned()
    };
    let loopback = chain("loopback");
    assert!(loopback.contains("update @observed") && loopback.contains("refused drop"));
    assert!(!loopback.contains("accept"));
    let r = ruleset("vm", &addrs(), &policy(r#"{"mode": "loopback"}"#), 64);
    let forward =
        &r[r.find("chain forward").expect("chain")..r.find("chain egress4").expect("chain")];
    // The only conntrack rules left are the return direction's, after the
    // VM's own packets were sent to be judged.
    assert!(
        at(forward, "ip saddr @src4 jump egress4") < at(forward, "established"),
        "loopback cuts open flows too: {forward}"
    );
    let open = chain("open");
    assert!(open.contains("accept") && !open.contains("drop") && !open.contains("@observed"));
    let audit = chain("audit");
    assert!(audit.contains("update @observed") && audit.contains("counter name refused accept"));
    assert!(!audit.contains("drop"));
}

#[test]
fn set_elements_are_read_from_nft_json() {
    let doc: serde_json::Value = serde_json::from_str(
        r#"{"nftables": [{"metainfo": {"version": "1.0.6"}}, {"set": {"family": "inet", "name": "observed",
        "table": "egress_vm_t", "elem": [
          {"elem": {"val": {"concat": ["198.51.100.4", "tcp", 80]}, "expires": 86390, "counter": {"packets": 7, "bytes": 420}}},
          {"elem": {"val": {"concat": ["203.0.113.9", "udp", 53]}, "expires": 86400, "counter": {"packets": 1, "bytes": 60}}},
          {"elem": {"val": {"concat": ["203.0.113.9", 6, 443]}, "counter": {"packets": 2, "bytes": 60}}},
          {"elem": {"val": {"concat": ["not an address", "udp", 53]}}}
        ]}}]}"#,
    )
    .expect("json");
    let got: Vec<KernelObserved> = items(&doc, "set")
        .filter_map(|s| s.get("elem")?.as_array())
        .flatten()
        .filter_map(element)
        .collect();
    assert_eq!(got.len(), 3);
    assert_eq!(got[0].addr, Ipv4Addr::new(198, 51, 100, 4));
    assert_eq!(
        (got[0].proto, got[0].port, got[0].packets),
        (Proto::Tcp, 80, 7)
    );
    assert_eq!(got[0].idle, Duration::from_secs(10));
    assert_eq!((got[1].proto, got[1].port), (Proto::Udp, 53));
    assert_eq!(got[2].proto, Proto::Tcp);
}

/// The kernel accepts what we write: `nft -c` checks every mode's table.
#[test]
fn nft_accepts_every_mode() {
    if std::process::Command::new("nft")
        .arg("--version")
        .output()
        .is_err()
    {
        egress_testkit::skip("nft_accepts_every_mode", "no nft here");
        return;
    }
    let rules: Vec<String> = (0..256)
        .map(|i| {
            format!(
                r#"{{"cidr": "10.{i}.0.0/16", "proto": "tcp", "port": {}}}"#,
                1000 + i
            )
        })
        .collect();
    let big = format!(r#"{{"mode": "allowlist", "rules": [{}]}}"#, rules.join(","));
    for text in [
        r#"{"mode": "loopback"}"#,
        r#"{"mode": "open"}"#,
        r#"{"mode": "audit", "rules": [{"cidr": "0.0.0.0/0", "proto": "udp", "port": 53}]}"#,
        r#"{"rules": [{"cidr": "10.0.0.0/8"}, {"cidr": "10.1.0.0/16", "proto": "udp"}, {"cidr": "10.1.2.0/24", "proto": "tcp", "port": 22}]}"#,
        &big,
    ] {
        let r = ruleset("check-vm", &addrs(), &policy(text), 4096);
        let out = std::process::Command::new("nft")
            .args(["-c", "-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .and_then(|mut child| {
                child.stdin.take().expect("stdin").write_all(r.as_bytes())?;
                child.wait_with_output()
            })
            .expect("nft runs");
        assert!(
            out.status.success(),
            "{text}: {}\n{r}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
