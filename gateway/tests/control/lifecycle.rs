//! Restart from the snapshot, a corrupt snapshot, draining on shutdown.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use egress_gateway::flowlog::FlowLog;
use egress_gateway::Gateway;
use std::sync::Arc;

use crate::support::*;

#[tokio::test]
async fn a_restart_enforces_the_last_push_before_any_new_one() {
    let dir = tempfile::tempdir().expect("dir");
    let origin = echo().await;
    let gw = start(config(dir.path(), ""), origin).await;
    let doc = format!(
        r#"{{"addresses": ["{SANDBOX}"], "policy": {{"allow": [{{"ip": "{ECHO_IP}"}}]}}}}"#
    );
    assert_eq!(
        http(
            gw.bound().admin,
            "PUT",
            "/v1/sandboxes/sb",
            None,
            Some(&doc)
        )
        .await
        .0,
        200
    );
    assert!(flow(&gw, SANDBOX, b"before").await.is_some());
    gw.run_until(async {}).await;

    // A new process on the same state directory, and no push yet.
    let gw = start(config(dir.path(), ""), origin).await;
    assert_eq!(
        gw.registry().ids().len(),
        1,
        "the snapshot was loaded before serving"
    );
    assert_eq!(
        flow(&gw, SANDBOX, b"after").await.as_deref(),
        Some(&b"after"[..]),
        "allowed as before"
    );
    assert_eq!(
        flow(&gw, "127.0.0.3", b"other").await,
        None,
        "still denied as before"
    );
    gw.run_until(async {}).await;

    // A push that denies it survives a restart too.
    let gw = start(config(dir.path(), ""), origin).await;
    let deny = format!(
        r#"{{"addresses": ["{SANDBOX}"], "policy": {{"allow": [{{"ip": "{ECHO_IP}"}}], "deny": [{{"ip": "{ECHO_IP}"}}]}}}}"#
    );
    assert_eq!(
        http(
            gw.bound().admin,
            "PUT",
            "/v1/sandboxes/sb",
            None,
            Some(&deny)
        )
        .await
        .0,
        200
    );
    gw.run_until(async {}).await;
    let gw = start(config(dir.path(), ""), origin).await;
    assert_eq!(flow(&gw, SANDBOX, b"denied").await, None);
}

/// Sandbox `sb` allowed to the echo origin, with `bytes` an hour of budget.
async fn put_budgeted(gw: &Gateway, bytes: u64) {
    let doc = format!(
        r#"{{"addresses": ["{SANDBOX}"], "policy": {{"allow": [{{"ip": "{ECHO_IP}"}}],
            "budgets": [{{"destination": "*", "bytes_per_hour": {bytes}}}]}}}}"#
    );
    let put = http(
        gw.bound().admin,
        "PUT",
        "/v1/sandboxes/sb",
        None,
        Some(&doc),
    )
    .await;
    assert_eq!(put.0, 200, "{put:?}");
}

/// What a sandbox spent of its budgets is still spent after a stop and a
/// start on the same state directory; it started full again before.
#[tokio::test]
async fn budget_states_survive_a_restart() {
    let dir = tempfile::tempdir().expect("dir");
    let origin = echo().await;
    let gw = start(config(dir.path(), ""), origin).await;
    put_budgeted(&gw, 1024).await;
    assert!(
        flow(&gw, SANDBOX, b"small").await.is_some(),
        "within the budget"
    );
    assert_eq!(
        flow(&gw, SANDBOX, &[b'x'; 4096]).await,
        None,
        "cut at the budget"
    );
    assert_eq!(
        flow(&gw, SANDBOX, b"spent").await,
        None,
        "refused once spent"
    );
    gw.run_until(async {}).await;
    let saved = dir.path().join("budgets.json");
    assert!(saved.exists(), "written at the stop");

    let gw = start(config(dir.path(), ""), origin).await;
    assert_eq!(
        flow(&gw, SANDBOX, b"after").await,
        None,
        "still spent after the restart"
    );
    assert!(!saved.exists(), "taken once");
    gw.run_until(async {}).await;
}

/// A successor that took the budget states over and then failed to start
/// leaves them for the next cold start: the gateway it replaced handed them
/// over and wrote none. (Before, every state started full again.)
#[tokio::test]
async fn budget_states_survive_a_takeover_that_fails() {
    let dir = tempfile::tempdir().expect("dir");
    let origin = echo().await;
    let gw = start(config(dir.path(), ""), origin).await;
    put_budgeted(&gw, 2048).await;
    assert!(
        flow(&gw, SANDBOX, &[b'x'; 300]).await.is_some(),
        "within the budget: 600 bytes of 2048 spent"
    );
    let running = tokio::spawn(gw.run_until(std::future::pending()));
    // The successor's machine egress cannot start (its nft fails).
    let broken = config(
        dir.path(),
        "[machine_egress]\nnft = [\"sh\", \"-c\", \"exit 1\", \"nft\"]",
    );
    let asked = broken.clone();
    let taken = tokio::task::spawn_blocking(move || egress_gateway::handover::take_over(&asked))
        .await
        .expect("thread")
        .expect("taken over");
    let dst = Arc::new(FixedDst(origin));
    let failed = Gateway::take_over(broken, dst, FlowLog::off(), taken).await;
    let Err(why) = failed else {
        panic!("the successor started")
    };
    eprintln!("the successor failed: {why}");
    tokio::time::timeout(Duration::from_secs(30), running)
        .await
        .expect("the predecessor ends")
        .expect("task");
    assert!(
        dir.path().join("budgets.json").exists(),
        "kept by the successor"
    );
    let gw = start(config(dir.path(), ""), origin).await;
    assert_eq!(
        flow(&gw, SANDBOX, &[b'x'; 800]).await,
        None,
        "1600 bytes more would fit a full budget, not what was left"
    );
    gw.run_until(async {}).await;
}

/// A VM's change in flight when a successor takes over finishes before the
/// gateway it replaces lets go of the state directory, and that gateway
/// makes none after: the successor's table and files are the last word.
/// Before, a change whose nft run outlasted the handover put its rules and
/// its file over what the successor had loaded and acknowledged since.
#[tokio::test]
async fn a_vm_change_in_flight_at_a_handover_is_done_before_the_successor_starts() {
    let dir = tempfile::tempdir().expect("dir");
    let (slow, log) = (dir.path().join("slow"), dir.path().join("nft.log"));
    // The stand-in for nft: each transaction is logged as the port vm1's
    // rule allows in it (`-` for none); one started while `slow` exists
    // takes 2 s, and makes `done` once logged.
    let done = dir.path().join("done");
    let script = format!(
        r#"case "$*" in *-f*) t=$(cat); s=; if [ -e '{slow}' ]; then rm -f '{slow}'; sleep 2; s=1; fi; p=$(echo "$t" | grep -o 'port_vm1 {{[^}}]*' | grep -o '44[34]' | head -n 1); echo "${{p:--}}" >> '{log}'; if [ -n "$s" ]; then touch '{done}'; fi ;; *) echo '{{"nftables": []}}' ;; esac"#,
        slow = slow.display(),
        log = log.display(),
        done = done.display()
    );
    let extra = format!(
        "[machine_egress]\nobserve = \"sampled\"\nlink_check = \"prerouting\"\nnft = [\"sh\", \"-c\", {script:?}, \"nft\"]"
    );
    let origin = echo().await;
    let gw = start(config(dir.path(), &extra), origin).await;
    let admin = gw.bound().admin;
    let vm = r#"{"addresses": ["100.64.9.2"]}"#;
    assert_eq!(
        http(admin, "PUT", "/v1/vms/vm1", None, Some(vm)).await.0,
        200
    );
    let policy = |port: u16| {
        format!(
            r#"{{"mode": "allowlist", "rules": [{{"cidr": "203.0.113.0/24", "proto": "tcp", "port": {port}}}]}}"#
        )
    };
    let egress = "/v1/vms/vm1/network/egress";
    std::fs::write(&slow, "").expect("slow");
    let late = policy(443);
    let in_flight =
        tokio::spawn(async move { http(admin, "PUT", egress, None, Some(&late)).await });
    while slow.exists() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let running = tokio::spawn(gw.run_until(std::future::pending()));
    let asked = config(dir.path(), &extra);
    let taken = tokio::task::spawn_blocking(move || egress_gateway::handover::take_over(&asked))
        .await
        .expect("thread")
        .expect("taken over");
    let dst = Arc::new(FixedDst(origin));
    let next = Gateway::take_over(config(dir.path(), &extra), dst, FlowLog::off(), taken)
        .await
        .expect("the successor starts");
    let put = http(next.bound().admin, "PUT", egress, None, Some(&policy(444))).await;
    assert_eq!(put.0, 200, "{put:?}");
    // Reset, as every admin request in flight at a handover is.
    let _ = in_flight.await;
    tokio::time::timeout(Duration::from_secs(30), running)
        .await
        .expect("the predecessor ends")
        .expect("task");
    // The slow change has finished, wherever it did.
    for _ in 0..500 {
        if done.exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(done.exists(), "the slow nft run never ended");
    let file = std::fs::read_to_string(dir.path().join("machines/vm-vm1.json")).expect("file");
    assert!(file.contains("444") && !file.contains("443"), "{file}");
    let runs = std::fs::read_to_string(&log).expect("log");
    assert_eq!(runs.lines().last(), Some("444"), "nft runs: {runs}");
    next.run_until(async {}).await;
}

/// A successor checks, before it asks for a takeover, that the pushed state
/// reads in its build, while the running gateway writes on: a journal
/// record it cannot replay refuses the takeover (naming the record and its
/// offset) and the running gateway serves on; nothing is changed on disk.
/// Before, the successor found out only after it took the sockets: it
/// exited, the gateway it replaced drained and exited, and a restart on
/// the same state failed again.
#[tokio::test]
async fn a_successor_checks_that_the_pushed_state_reads_before_it_takes_over() {
    use std::io::Write;
    let dir = tempfile::tempdir().expect("dir");
    let origin = echo().await;
    let gw = start(config(dir.path(), ""), origin).await;
    put_budgeted(&gw, 1 << 20).await;
    egress_gateway::preflight(&config(dir.path(), "")).expect("the state reads");
    // A record this build cannot replay (an id it refuses), whole.
    let journal = dir.path().join("journal.log");
    let json = br#"{"seq": 1000000, "change": {"put": {"id": "not an id!", "addresses": ["127.0.0.9"], "policy": {"default": "deny"}}}}"#;
    let mut record = Vec::new();
    record.extend_from_slice(&(json.len() as u32).to_le_bytes());
    record.extend_from_slice(&crc32fast::hash(json).to_le_bytes());
    record.extend_from_slice(json);
    let offset = std::fs::metadata(&journal).expect("journal").len();
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(&journal)
        .expect("journal");
    file.write_all(&record).expect("appended");
    drop(file);
    let before = std::fs::read(&journal).expect("journal");
    let refused = egress_gateway::preflight(&config(dir.path(), ""));
    let why = refused.expect_err("the takeover is refused").to_string();
    assert!(
        why.contains(&format!("record 1000000 at offset {offset}")),
        "{why}"
    );
    assert_eq!(
        std::fs::read(&journal).expect("journal"),
        before,
        "unchanged"
    );
    // The running gateway serves on.
    assert!(flow(&gw, SANDBOX, b"still here").await.is_some());
    gw.run_until(async {}).await;
}

/// The successor's check reads the machine egress state too: a VM file
/// this build cannot read refuses the takeover, naming the file, before it
/// would have failed the successor's start; so does a VM holding an
/// address a pushed sandbox holds, as the start claims each VM's addresses
/// against the sandboxes'.
#[tokio::test]
async fn a_successor_checks_that_the_machine_egress_state_reads_before_it_takes_over() {
    let dir = tempfile::tempdir().expect("dir");
    let gw = start(config(dir.path(), ""), echo().await).await;
    put_budgeted(&gw, 1 << 20).await;
    egress_gateway::preflight(&config(dir.path(), "")).expect("the state reads");
    let machines = dir.path().join("machines");
    std::fs::create_dir_all(&machines).expect("machines");
    let vm = |address: &str| {
        format!(
            r#"{{"id": "vm1", "addresses": ["{address}"], "egress": null,
                "effective": {{"mode": "allowlist", "rules": []}}}}"#
        )
    };
    std::fs::write(machines.join("vm-vm1.json"), vm("127.0.0.77")).expect("written");
    let vms = egress_gateway::preflight(&config(dir.path(), ""));
    vms.expect("a VM of its own address reads");
    std::fs::write(machines.join("vm-vm1.json"), vm(SANDBOX)).expect("written");
    let refused = egress_gateway::preflight(&config(dir.path(), ""));
    let why = refused.expect_err("the takeover is refused").to_string();
    assert!(why.contains(SANDBOX) && why.contains("sb"), "{why}");
    std::fs::write(machines.join("vm-vm1.json"), "{not json").expect("written");
    let refused = egress_gateway::preflight(&config(dir.path(), ""));
    let why = refused.expect_err("the takeover is refused").to_string();
    assert!(why.contains("vm-vm1.json"), "{why}");
    gw.run_until(async {}).await;
}

/// A state directory others may read (a Kubernetes hostPath is made
/// 0755) is closed to them at start: it holds the pushed policies, the
/// sandboxes' addresses and the CA's key.
#[tokio::test]
async fn the_state_directory_is_the_gateways_alone() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("dir");
    let state = dir.path().join("state");
    std::fs::create_dir(&state).expect("state");
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o755)).expect("0755");
    let gw = start(config(&state, ""), echo().await).await;
    let mode = std::fs::metadata(&state)
        .expect("state")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o700, "{mode:o}");
    gw.run_until(async {}).await;
}

#[tokio::test]
async fn a_corrupt_snapshot_fails_loudly() {
    let dir = tempfile::tempdir().expect("dir");
    for bad in [
        "{not json",
        r#"{"version": 1, "sandboxes": [{"id": "a", "addresses": [], "policy": {"allow": [{"cidr": "10.0.0.1/8"}]}}]}"#,
        r#"{"version": 7, "sandboxes": []}"#,
    ] {
        std::fs::write(dir.path().join("snapshot.json"), bad).expect("write");
        let dst = std::sync::Arc::new(FixedDst("127.0.0.1:1".parse().expect("addr")));
        let err = start_again(&config(dir.path(), ""), dst)
            .await
            .err()
            .expect("refuses to start");
        let text = err.to_string();
        assert!(
            text.contains("snapshot.json") && text.contains("corrupt snapshot"),
            "{text}"
        );
    }
}

#[tokio::test]
async fn shutdown_drains_open_flows_up_to_the_deadline() {
    // One runtime, and a worker thread per core with listeners of its own.
    for layout in ["", "[limits]\nthread_per_core = true\nworker_threads = 2"] {
        drains_open_flows_up_to_the_deadline(layout).await;
    }
}

async fn drains_open_flows_up_to_the_deadline(layout: &str) {
    let dir = tempfile::tempdir().expect("dir");
    let origin = echo().await;
    let gw = start(
        config(dir.path(), &format!("drain = \"5s\"\n{layout}")),
        origin,
    )
    .await;
    let doc = format!(
        r#"{{"addresses": ["{SANDBOX}"], "policy": {{"allow": [{{"ip": "{ECHO_IP}"}}]}}}}"#
    );
    assert_eq!(
        http(
            gw.bound().admin,
            "PUT",
            "/v1/sandboxes/sb",
            None,
            Some(&doc)
        )
        .await
        .0,
        200
    );
    let mut open = connect_from(&gw, SANDBOX).await;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    open.write_all(b"ping").await.expect("write");
    let mut buf = [0u8; 4];
    open.read_exact(&mut buf).await.expect("echo");
    let transparent = gw.bound().transparent;
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let stopping = tokio::spawn(gw.run_until(async move {
        let _ = rx.await;
    }));
    tx.send(()).expect("signal");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!stopping.is_finished(), "waits for the open flow");
    assert!(
        tokio::net::TcpStream::connect(transparent).await.is_err(),
        "no new flows are accepted"
    );
    open.write_all(b"pong")
        .await
        .expect("the open flow still works");
    open.read_exact(&mut buf)
        .await
        .expect("echo while draining");
    assert_eq!(&buf, b"pong");
    drop(open);
    let left = tokio::time::timeout(Duration::from_secs(5), stopping)
        .await
        .expect("drained")
        .expect("task");
    assert_eq!(left, 0);

    // With a flow that never ends, the deadline wins and says so; the
    // flow is reset, not closed.
    let gw = start(
        config(dir.path(), &format!("drain = \"300ms\"\n{layout}")),
        origin,
    )
    .await;
    let mut stuck = connect_from(&gw, SANDBOX).await;
    stuck.write_all(b"ping").await.expect("write");
    stuck.read_exact(&mut buf).await.expect("echo");
    assert_eq!(gw.run_until(async {}).await, 1);
    let after = stuck.read(&mut buf).await;
    assert!(
        after
            .as_ref()
            .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
        "{after:?}"
    );
}

#[tokio::test]
async fn reload_applies_timeouts_and_reports_what_needs_a_restart() {
    let dir = tempfile::tempdir().expect("dir");
    let gw = start(config(dir.path(), ""), echo().await).await;
    let dp = gw.dataplane();
    assert_eq!(dp.config().timeouts.peek, Duration::from_millis(300));
    let mut next = config(dir.path(), "idle = \"42s\"");
    next.timeouts.peek = Duration::from_secs(2);
    next.listen.admin = "127.0.0.1:1".parse().expect("addr");
    let restart = dp.reload(&next);
    assert_eq!(restart, ["listen.admin"]);
    let now = dp.config();
    assert_eq!(
        (now.timeouts.peek, now.timeouts.idle),
        (Duration::from_secs(2), Duration::from_secs(42))
    );
    assert_eq!(
        now.listen.admin,
        "127.0.0.1:0".parse().expect("addr"),
        "listen keeps its running value"
    );
}

#[test]
fn sigterm_stops_the_binary_cleanly() {
    let dir = tempfile::tempdir().expect("dir");
    let cfg = dir.path().join("gw.toml");
    std::fs::write(
        &cfg,
        format!(
            "state_dir = \"{}\"\n[listen]\ntransparent = \"127.0.0.1:0\"\ndns = \"127.0.0.1:0\"\ndns_alt = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n[log]\nflow_log = \"off\"\n",
            dir.path().join("state").display()
        ),
    )
    .expect("write");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_egress-gateway"))
        .args(["run", "--config"])
        .arg(&cfg)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("starts");
    // Ready once the CA exists and a moment has passed for the listeners.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !dir.path().join("state/ca/ca.crt").exists() {
        assert!(std::time::Instant::now() < deadline, "did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));
    let pid = child.id().to_string();
    // SIGHUP with a broken file: the gateway keeps running on the old configuration.
    std::fs::write(&cfg, "[timeouts]\npeek = \"never\"\n").expect("write");
    assert!(std::process::Command::new("kill")
        .args(["-HUP", &pid])
        .status()
        .expect("kill")
        .success());
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        child.try_wait().expect("status").is_none(),
        "still running after a bad reload"
    );
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(killed.success());
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("status") {
            break s;
        }
        if started.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            panic!("did not stop within 10 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut err)
        .expect("read");
    assert!(
        err.contains("draining") && err.contains("every flow finished"),
        "{err}"
    );
    assert!(
        err.contains("configuration reload failed") && err.contains("never"),
        "the bad reload is logged with its reason: {err}"
    );
}

#[tokio::test]
async fn a_connection_that_was_not_redirected_is_refused() {
    let dir = tempfile::tempdir().expect("dir");
    // The "original destination" is the listener itself, as SO_ORIGINAL_DST
    // reports for a connection that bypassed the redirect.
    let gw = {
        let cfg = config(dir.path(), "");
        let port = egress_testkit::spare_port();
        let mut cfg = cfg;
        cfg.listen.transparent = ([127, 0, 0, 1], port).into();
        start(cfg, ([127, 0, 0, 1], port).into()).await
    };
    let doc = format!(r#"{{"addresses": ["{SANDBOX}"], "policy": {{"default": "allow"}}}}"#);
    assert_eq!(
        http(
            gw.bound().admin,
            "PUT",
            "/v1/sandboxes/sb",
            None,
            Some(&doc)
        )
        .await
        .0,
        200
    );
    assert_eq!(
        flow(&gw, SANDBOX, b"loop?").await,
        None,
        "refused, not looped"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (_, text) = http(gw.bound().admin, "GET", "/metrics", None, None).await;
    let m = metrics(&text);
    let key = r#"egress_flows_total{verdict="deny",reason="not_redirected"}"#;
    assert_eq!(m.get(key), Some(&1.0), "{m:?}");
}

#[tokio::test]
async fn a_connection_that_was_not_redirected_is_refused_on_a_dual_stack_listener() {
    // On `[::]`, an IPv4 connection's local address is IPv4-mapped, and
    // SO_ORIGINAL_DST reports plain IPv4: the same address all the same.
    let dir = tempfile::tempdir().expect("dir");
    let port = egress_testkit::spare_port();
    let mut cfg = config(dir.path(), "");
    cfg.listen.transparent = (std::net::Ipv6Addr::UNSPECIFIED, port).into();
    let gw = start(cfg, ([127, 0, 0, 1], port).into()).await;
    let doc = format!(r#"{{"addresses": ["{SANDBOX}"], "policy": {{"default": "allow"}}}}"#);
    let put = http(
        gw.bound().admin,
        "PUT",
        "/v1/sandboxes/sb",
        None,
        Some(&doc),
    )
    .await;
    assert_eq!(put.0, 200);
    let sock = tokio::net::TcpSocket::new_v4().expect("socket");
    sock.bind((SANDBOX.parse::<std::net::IpAddr>().expect("ip"), 0).into())
        .expect("bind");
    let mut s = sock
        .connect(([127, 0, 0, 1], port).into())
        .await
        .expect("connect");
    let _ = s.write_all(b"loop?").await;
    let mut buf = [0u8; 5];
    let echoed = tokio::time::timeout(Duration::from_secs(3), s.read_exact(&mut buf)).await;
    assert!(!matches!(echoed, Ok(Ok(_))), "refused, not looped");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (_, text) = http(gw.bound().admin, "GET", "/metrics", None, None).await;
    let m = metrics(&text);
    let key = r#"egress_flows_total{verdict="deny",reason="not_redirected"}"#;
    let flows: Vec<_> = m
        .iter()
        .filter(|(k, v)| k.starts_with("egress_flows_total") && **v > 0.0)
        .collect();
    assert_eq!(m.get(key), Some(&1.0), "{flows:?}");
}

#[tokio::test]
async fn a_second_gateway_on_the_same_state_dir_is_refused_while_the_first_runs() {
    let dir = tempfile::tempdir().expect("dir");
    let origin = echo().await;
    // Per core: its listeners use SO_REUSEPORT, so only the lock stops a
    // second gateway from binding beside the first.
    let per_core = "[limits]\nthread_per_core = true\nworker_threads = 2";
    let first = start(config(dir.path(), per_core), origin).await;
    let mut again = config(dir.path(), per_core);
    again.listen.transparent = first.bound().transparent;
    let err = Gateway::start(
        again,
        std::sync::Arc::new(egress_gateway::SoOriginalDst),
        egress_gateway::flowlog::FlowLog::off(),
    )
    .await
    .err()
    .expect("refuses to start");
    let lock = dir.path().join("gateway.lock");
    assert_eq!(
        err.to_string(),
        format!(
            "state_dir: {} is locked by another running gateway; one state directory serves one gateway",
            lock.display()
        )
    );
    first.run_until(async {}).await;
    // Stopped, the lock is free again.
    let second = start(config(dir.path(), per_core), origin).await;
    second.run_until(async {}).await;
}
