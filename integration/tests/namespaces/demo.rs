//! `egress-demo`, the newcomer's tour, as a newcomer runs it: every step
//! goes as it says, everything it made is gone afterwards (also when it is
//! interrupted), and without root it names what is missing.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::topology::{available, run};

const DEMO: &str = env!("CARGO_BIN_EXE_egress-demo");

/// Whether anything the demo with process id `pid` made is still there:
/// its namespaces, its folder, or a process started from its folder.
fn leftovers(pid: u32) -> Vec<String> {
    let suffix = format!("-{pid}");
    let mut left: Vec<String> = String::from_utf8_lossy(
        &Command::new("ip")
            .args(["netns", "list"])
            .output()
            .expect("ip")
            .stdout,
    )
    .lines()
    .filter_map(|l| l.split_whitespace().next())
    .filter(|ns| ns.starts_with("egd-") && ns.ends_with(&suffix))
    .map(str::to_owned)
    .collect();
    let dir = std::env::temp_dir().join(format!("egress-demo-{pid}"));
    if dir.exists() {
        left.push(dir.display().to_string());
    }
    let mark = dir.to_string_lossy().into_owned();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(&mark) {
            left.push(format!("process {}", entry.file_name().to_string_lossy()));
        }
    }
    left
}

#[test]
fn the_tour_shows_every_step_and_leaves_nothing_behind() {
    if !available() {
        return;
    }
    let child = Command::new(DEMO)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("egress-demo");
    let pid = child.id();
    let out = child.wait_with_output().expect("egress-demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // One line per step, in the tour's order, each with its verdict.
    let steps = [
        "policy",
        "dns",
        "intercept",
        "deny",
        "explain",
        "splice",
        "inject",
        "refuse",
    ];
    let starts: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|w| *w != "->")
        .collect();
    assert_eq!(starts, steps, "{stdout}");
    for reason in ["tenant_deny", "exempt", "credential_host_mismatch"] {
        assert!(stdout.contains(reason), "{reason}: {stdout}");
    }
    assert_eq!(leftovers(pid), Vec::<String>::new());
}

#[test]
fn ctrl_c_tears_the_tour_down() {
    if !available() {
        return;
    }
    let mut child = Command::new(DEMO)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("egress-demo");
    let pid = child.id();
    // Interrupted once its world is built and the gateway runs.
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let ready = lines
        .by_ref()
        .map_while(Result::ok)
        .any(|l| l.contains("the gateway is ready"));
    assert!(ready, "the demo did not get as far as a ready gateway");
    assert!(
        !leftovers(pid).is_empty(),
        "the world exists while the tour runs"
    );
    run("kill", &["-INT", &pid.to_string()]);
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = child.try_wait().expect("status") {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "egress-demo did not stop on SIGINT"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(130));
    assert_eq!(leftovers(pid), Vec::<String>::new());
}

#[test]
fn without_root_it_names_what_is_missing() {
    if !available() {
        return;
    }
    // As `nobody`: the demo must refuse before it makes anything.
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", DEMO])
        .output()
        .expect("setpriv");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("missing:") && stderr.contains("root"),
        "{stderr}"
    );
}
