use std::net::IpAddr;
use std::time::Instant;

use egress_policy::{AttributionGap, PlatformDenies, Policy};

use super::*;

fn registry(sandboxes: &[(&str, &str)]) -> Registry {
    let r = Registry::new(Arc::new(PlatformDenies::new(Vec::new())));
    for (id, addr) in sandboxes {
        put(
            &r,
            id,
            addr,
            r#"{"allow": [{"domain": "api.example.test"}]}"#,
        );
    }
    r
}

fn put(r: &Registry, id: &str, addr: &str, policy: &str) {
    let ip: IpAddr = addr.parse().expect("ip");
    let policy = Policy::from_json(policy).expect("policy");
    r.put(SandboxId::new(id), vec![ip], policy).expect("put");
}

/// Whether `dst` is denied to sb-c on `r` as a sandbox's address (the
/// registries here have no other platform denies).
fn denied(r: &Registry, dst: &str) -> bool {
    let dst: IpAddr = dst.parse().expect("ip");
    let claims = crate::decide::Claims {
        dst: std::net::SocketAddr::new(dst, 22),
        protocol: egress_policy::Protocol::Opaque(None),
        sni: None,
        host: None,
        ech: false,
    };
    let s = r.get(&SandboxId::new("sb-c")).expect("sb-c");
    let doh = crate::doh::DohNames::empty();
    let v = crate::decide::judge(&s.policy, &claims, &[], AttributionGap::NoDnsSeen, &doh);
    v.code() == "platform_deny"
}

fn has(r: &Registry, id: &str) -> bool {
    r.get(&SandboxId::new(id)).is_some()
}

/// Each of the predecessor's sandboxes changed or taken out on the
/// successor is taken out of the predecessor's registry (which ends its
/// draining flows); the others stay; when the successor stops telling, the
/// predecessor hears the connection end.
#[test]
fn the_predecessor_drops_each_sandbox_the_successor_changes() {
    let had = [
        ("sb-a", "100.64.0.2"),
        ("sb-b", "100.64.0.3"),
        ("sb-c", "100.64.0.4"),
    ];
    let (pred, succ) = (Arc::new(registry(&had)), Arc::new(registry(&had)));
    let (theirs, ours) = UnixStream::pair().expect("pair");
    let stop = ours.try_clone().expect("clone");
    let telling = {
        let (succ, had) = (succ.clone(), succ.checkpoint());
        std::thread::spawn(move || tell(ours, &succ, had))
    };
    let hearing = {
        let pred = pred.clone();
        std::thread::spawn(move || listen(theirs, &pred))
    };
    // The same document pushed again (as a resync after the restart
    // does) changes nothing the predecessor enforces.
    put(
        &succ,
        "sb-c",
        "100.64.0.4",
        r#"{"allow": [{"domain": "api.example.test"}]}"#,
    );
    succ.remove(&SandboxId::new("sb-a"));
    put(&succ, "sb-b", "100.64.0.3", r#"{"allow": []}"#);
    put(&succ, "sb-d", "100.64.0.5", r#"{"allow": []}"#);
    let deadline = Instant::now() + Duration::from_secs(10);
    while (has(&pred, "sb-a") || has(&pred, "sb-b")) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!has(&pred, "sb-a"), "taken out on the successor");
    assert!(!has(&pred, "sb-b"), "pushed again on the successor");
    assert!(has(&pred, "sb-c"), "pushed again as it was");
    assert!(!has(&pred, "sb-d"), "the successor's own");
    // Its address is denied here now, as the predecessor's own sandboxes'.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !denied(&pred, "100.64.0.5") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(denied(&pred, "100.64.0.5"), "sb-d's address");
    assert!(!denied(&pred, "100.64.0.9"), "no one's");
    // An address a VM claims there is denied here too.
    succ.claim_for_vm("vm1", &["100.64.0.9".parse().expect("ip")])
        .expect("claimed");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !denied(&pred, "100.64.0.9") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(denied(&pred, "100.64.0.9"), "vm1's address");
    // A change after the first is told too.
    put(&succ, "sb-c", "100.64.0.4", r#"{"allow": []}"#);
    let deadline = Instant::now() + Duration::from_secs(10);
    while has(&pred, "sb-c") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!has(&pred, "sb-c"), "the second change");
    stop.shutdown(std::net::Shutdown::Both).expect("shutdown");
    telling.join().expect("the successor stops telling");
    let why = hearing.join().expect("the predecessor hears it");
    assert!(why.contains("closed"), "{why}");
}

/// A resync that registers many addresses at once is told in lines the
/// predecessor reads whole.
#[test]
fn many_addresses_registered_at_once_are_told_in_lines_read_whole() {
    let (pred, succ) = (Arc::new(registry(&[])), Arc::new(registry(&[])));
    let had = succ.checkpoint();
    let many: Vec<Arc<crate::registry::Sandbox>> = (0..3_000u32)
        .map(|i| {
            let ip = IpAddr::V6(std::net::Ipv6Addr::from(
                0x2001_0db8_ffff_ffff_ffff_ffff_0000_0000u128 | u128::from(i),
            ));
            let policy = Policy::from_json(r#"{"allow": []}"#).expect("policy");
            succ.prepare(SandboxId::new(&format!("sb-{i}")), vec![ip], policy)
        })
        .collect();
    succ.replace_prepared(many).expect("resync");
    put(&pred, "sb-c", "100.64.0.4", r#"{"allow": []}"#);
    let (theirs, ours) = UnixStream::pair().expect("pair");
    let stop = ours.try_clone().expect("clone");
    let telling = std::thread::spawn(move || tell(ours, &succ, had));
    let hearing = {
        let pred = pred.clone();
        std::thread::spawn(move || listen(theirs, &pred))
    };
    let last = "2001:db8:ffff:ffff:ffff:ffff:0:bb7";
    let deadline = Instant::now() + Duration::from_secs(10);
    while !denied(&pred, last) && !hearing.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(denied(&pred, last), "the 3,000th address");
    assert!(!hearing.is_finished(), "still hearing");
    stop.shutdown(std::net::Shutdown::Both).expect("shutdown");
    telling.join().expect("told");
    hearing.join().expect("heard");
}

/// A line that names no sandbox (or one cut short) ends the hearing: the
/// predecessor cannot know what changed.
#[test]
fn a_line_that_names_no_sandbox_ends_the_hearing() {
    for (line, said) in [
        ("\"not an id!\"\n", "named no sandbox"),
        ("{}\n", "does not read"),
        ("{\"addresses\": [\"no address\"]}\n", "does not read"),
        ("\"sb-a\"", "cut short"),
    ] {
        let pred = registry(&[("sb-a", "100.64.0.2")]);
        let (theirs, mut ours) = UnixStream::pair().expect("pair");
        ours.write_all(line.as_bytes()).expect("write");
        drop(ours);
        let why = listen(theirs, &pred);
        assert!(has(&pred, "sb-a"), "{line:?}");
        assert!(why.contains(said), "{line:?}: {why}");
    }
}
