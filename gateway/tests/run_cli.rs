//! `egress-gateway run` with no arguments starts on the built-in defaults.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Ends the child by its PID when the test ends, pass or fail.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn get(path: &str) -> Option<String> {
    let mut s =
        TcpStream::connect_timeout(&"127.0.0.1:15000".parse().ok()?, Duration::from_millis(200))
            .ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

#[test]
fn run_without_arguments_serves_healthz_and_creates_the_ca() {
    let dir = tempfile::tempdir().expect("temp dir");
    // A stand-in for systemd's notify socket: what a Type=notify unit hears.
    let notify_at = dir.path().join("notify");
    let systemd = std::os::unix::net::UnixDatagram::bind(&notify_at).expect("bind");
    systemd
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    let child = Command::new(env!("CARGO_BIN_EXE_egress-gateway"))
        .arg("run")
        .current_dir(dir.path())
        .env("RUST_LOG", "info")
        .env("NOTIFY_SOCKET", &notify_at)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starts");
    let mut running = Running(child);
    let deadline = Instant::now() + Duration::from_secs(20);
    let health = loop {
        if let Some(r) = get("/healthz") {
            break r;
        }
        assert!(Instant::now() < deadline, "no /healthz within 20 s");
        assert!(
            running.0.try_wait().expect("status").is_none(),
            "the gateway exited early"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    // Alive before it is ready: the admin listener answers while the last
    // listeners start.
    let ready = loop {
        let ready = get("/readyz").expect("readyz");
        if ready.starts_with("HTTP/1.1 200") || Instant::now() >= deadline {
            break ready;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(ready.starts_with("HTTP/1.1 200"), "{ready}");
    assert!(
        dir.path().join(".egress-gateway/ca/ca.crt").exists(),
        "CA created in the default state dir"
    );
    // The announcement follows readiness: read until its last line (or 20 s).
    let stderr = read_until(&mut running, "no sandboxes are registered yet", deadline);
    assert!(stderr.contains("interception CA"), "{stderr}");
    assert!(stderr.contains("0.0.0.0:15001"), "{stderr}");
    assert!(
        stderr.contains("no sandboxes are registered yet"),
        "{stderr}"
    );
    // SIGTERM: the unit is told it stops, and to wait for the drain (30 s
    // by default) and what follows it, past a shorter stop timeout.
    let heard = |what: &str| {
        let mut buf = [0u8; 512];
        loop {
            let n = systemd.recv(&mut buf).expect("a notice");
            let notice = String::from_utf8_lossy(&buf[..n]).into_owned();
            if notice.contains(what) {
                return notice;
            }
        }
    };
    assert!(heard("READY=1").contains("READY=1"));
    let pid = running.0.id().to_string();
    let _ = Command::new("kill").args(["-TERM", &pid]).status();
    let stopping = heard("STOPPING=1");
    assert!(
        stopping.contains("EXTEND_TIMEOUT_USEC=45000000"),
        "{stopping:?}"
    );
}

/// `command` (the gateway, or what runs it) with `run --config config`,
/// its stderr piped: ended by its PID when the test ends.
fn run_with(mut command: Command, config: &std::path::Path) -> Running {
    let child = command
        .args(["run", "--config"])
        .arg(config)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starts");
    Running(child)
}

/// A configuration on loopback ports the kernel picks, with `state` as its
/// state directory and no flow log: for tests that start `run`.
fn loopback_config(state: &std::path::Path) -> String {
    format!(
        "state_dir = \"{}\"\n[listen]\ntransparent = \"127.0.0.1:0\"\ndns = \"127.0.0.1:0\"\ndns_alt = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n[log]\nflow_log = \"off\"\n[dns]\nmax_sandboxes = 1000\n",
        state.display()
    )
}

/// The child's stderr up to a line holding `needle`, or what came of it by
/// `deadline` (the child runs on; it is ended when the test ends).
fn read_until(running: &mut Running, needle: &str, deadline: Instant) -> String {
    use std::io::BufRead;
    let stderr = running.0.stderr.take().expect("stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let mut out = String::new();
    while let Ok(line) = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        out.push_str(&line);
        out.push('\n');
        if line.contains(needle) {
            break;
        }
    }
    out
}

/// A restart with pushed state recovers it, and then does not claim that no
/// sandbox is registered.
#[test]
fn a_restart_with_pushed_state_does_not_say_none_are_registered() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().expect("temp dir");
    let state = dir.path().join("state");
    std::fs::create_dir(&state).expect("state dir");
    std::fs::write(
        state.join("snapshot.json"),
        r#"{"version": 1, "seq": 1, "sandboxes": [{"id": "sb-1", "addresses": ["100.64.1.2"], "policy": {"default": "deny"}}]}"#,
    )
    .expect("write snapshot");
    let config = dir.path().join("gw.toml");
    std::fs::write(&config, loopback_config(&state)).expect("write config");
    let mut running = run_with(Command::new(env!("CARGO_BIN_EXE_egress-gateway")), &config);
    let mut stderr = std::io::BufReader::new(running.0.stderr.take().expect("stderr"));
    // Up to the redirect hint, which announce() logs just before it checks
    // the registry; then the rest, once the process is gone.
    let mut log = String::new();
    while !log.contains("redirect a sandbox interface") {
        let n = stderr.read_line(&mut log).expect("read stderr");
        assert!(
            n > 0,
            "the gateway exited before it announced itself: {log}"
        );
    }
    std::thread::sleep(Duration::from_millis(500));
    let _ = running.0.kill();
    let _ = running.0.wait();
    stderr.read_to_string(&mut log).expect("read stderr");
    assert!(
        log.contains("recovered pushed state") && log.contains("sandboxes=1"),
        "{log}"
    );
    assert!(!log.contains("no sandboxes are registered yet"), "{log}");
    // Fewer DNS tables than sandboxes it registers: said at start.
    assert!(
        log.contains("dns.max_sandboxes is below limits.max_sandboxes")
            && log.contains("dns_max_sandboxes=1000"),
        "{log}"
    );
}

#[test]
fn run_with_a_bad_config_names_the_key() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("gw.toml");
    std::fs::write(&path, "[dns]\nmin_ttl = \"soon\"\n").expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_egress-gateway"))
        .args(["run", "--config"])
        .arg(&path)
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("min_ttl") && err.contains("\"soon\""), "{err}");
    // `--check` reads every table as a start would, and starts nothing.
    let check = |text: &str| {
        std::fs::write(&path, text).expect("write");
        Command::new(env!("CARGO_BIN_EXE_egress-gateway"))
            .args(["run", "--check", "--config"])
            .arg(&path)
            .current_dir(dir.path())
            .output()
            .expect("runs")
    };
    let out = check("[limits]\nmax_conections = 10\n");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("max_conections"), "{err}");
    let out = check("[dns]\nmin_ttl = \"5s\"\n");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("loads"));
    assert!(
        !dir.path().join(".egress-gateway").exists(),
        "a check made state"
    );
}

/// The fence and the interfaces' tables are installed at boot from the
/// gateway's own file: a mistake outside `[listen]` and `[redirect]` leaves
/// them as they are, and one inside is named.
#[test]
fn redirect_reads_only_its_own_tables() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("gw.toml");
    let redirect = |text: &str, args: &[&str]| {
        std::fs::write(&path, text).expect("write");
        Command::new(env!("CARGO_BIN_EXE_egress-gateway"))
            .arg("redirect")
            .args(args)
            .arg("--config")
            .arg(&path)
            .output()
            .expect("runs")
    };
    let typo = "[limits]\nmax_conections = 10\n[a_newer_table]\nx = 1\n\
                [listen]\ntransparent = \"127.0.0.1:16001\"\n\
                [redirect]\nfence = [\"sbx*\"]\n";
    let out = redirect(typo, &["--fence"]);
    let rules = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        rules.contains("iifname \"sbx*\" iifname != @attached"),
        "{rules}"
    );
    let out = redirect(typo, &["--sandbox-iface", "sbx0"]);
    let rules = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(rules.contains(":16001"), "{rules}");
    let out = redirect("[redirect]\nfence = [\"t*p\"]\n", &["--fence"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("redirect.fence") && err.contains("t*p"),
        "{err}"
    );
    // A mistake under `[listen]` stops an interface's table (its ports
    // come from there), never the fence (it needs none).
    let listen_typo = "[listen]\ntransparnt = \"127.0.0.1:1\"\n[redirect]\nfence = [\"sbx*\"]\n";
    let out = redirect(listen_typo, &["--sandbox-iface", "sbx0"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("transparnt"), "{err}");
    let out = redirect(listen_typo, &["--fence"]);
    let rules = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "a [listen] typo stopped the fence: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(rules.contains("iifname \"sbx*\""), "{rules}");
}

#[test]
fn a_token_file_open_to_other_users_is_warned_about() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("temp dir");
    let token = dir.path().join("admin.token");
    std::fs::write(&token, "short\n").expect("write");
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let path = dir.path().join("gw.toml");
    let state = dir.path().join("state");
    let config = format!(
        "state_dir = {:?}\n[admin]\ntoken_file = {:?}\n",
        state.display().to_string(),
        token.display().to_string()
    );
    std::fs::write(&path, config).expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_egress-gateway"))
        .args(["run", "--config"])
        .arg(&path)
        .output()
        .expect("runs");
    // Too short a token stops the start, after the warning.
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    let warned = err
        .lines()
        .find(|l| l.contains("the file is open to other users"))
        .unwrap_or_else(|| panic!("no warning: {err}"));
    assert!(
        warned.contains("admin.token_file") && warned.contains("0644"),
        "{warned}"
    );
    assert!(err.contains("at least 16 characters"), "{err}");
}

/// A process handed a low soft limit on open files (a container runtime's
/// 1,024) raises it to the hard one, and says so when even that is below
/// what `limits.max_connections` needs.
#[test]
fn the_open_file_limit_is_raised_and_a_short_one_named() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("gw.toml");
    std::fs::write(&config, loopback_config(&dir.path().join("state"))).expect("write config");
    let mut limited = Command::new("prlimit");
    limited
        .arg("--nofile=1024:4096")
        .arg(env!("CARGO_BIN_EXE_egress-gateway"));
    let mut running = run_with(limited, &config);
    let deadline = Instant::now() + Duration::from_secs(20);
    let stderr = read_until(&mut running, "redirect a sandbox interface", deadline);
    assert!(
        stderr.contains("open-file limit is below") && stderr.contains("open_files=4096"),
        "{stderr}"
    );
    let limits =
        std::fs::read_to_string(format!("/proc/{}/limits", running.0.id())).expect("limits");
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("a line");
    assert_eq!(
        line.split_whitespace().collect::<Vec<_>>()[3..5],
        ["4096", "4096"],
        "{line}"
    );
}
