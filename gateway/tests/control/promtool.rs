//! `/metrics` as an operator's Prometheus reads it: `promtool check metrics`
//! (Debian's `prometheus` package) parses the scrape and lints it — HELP on
//! every family, `_total` on counters and only there, base units in names —
//! and must have nothing to say. With `EGRESS_E2E_REQUIRED=1` (set by CI) a
//! missing promtool is a failure, not a skip.
//!
//! promtool reads only the Prometheus text format 0.0.4, and the admin
//! listener serves OpenMetrics 1.0. The two name a counter differently: in
//! OpenMetrics the family `x` has HELP and TYPE lines for `x` and samples
//! `x_total`; promtool would take `x_total` for a second, untyped family
//! without HELP. [`as_text_0_0_4`] applies exactly that renaming and nothing
//! else, so every other finding (a family without HELP, a non-counter named
//! `_total`, a unit that is not a base unit) still reaches the lint.

use std::collections::HashSet;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::support::*;

/// Whether promtool is installed; [`egress_testkit::skip`] when not.
fn promtool_available() -> bool {
    let ok = Command::new("promtool")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        egress_testkit::skip(
            "the metrics lint",
            "no promtool here (apt-get install prometheus)",
        );
    }
    ok
}

/// An OpenMetrics scrape in the text format 0.0.4's names: a counter family
/// `x` is announced as `x_total`, the name its samples carry. A scrape that
/// is not OpenMetrics (no `# EOF` terminator) is returned as it is.
fn as_text_0_0_4(scrape: &str) -> String {
    if !scrape.ends_with("# EOF\n") {
        return scrape.to_owned();
    }
    let counters: HashSet<&str> = scrape
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(scrape.len() + 16 * counters.len());
    for line in scrape.lines() {
        let descriptor = ["# HELP ", "# TYPE "].into_iter().find_map(|kw| {
            let rest = line.strip_prefix(kw)?;
            let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
            counters
                .contains(name)
                .then(|| format!("{kw}{name}_total {tail}"))
        });
        out.push_str(descriptor.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

/// `promtool check metrics` on `text`: its exit status and everything it printed.
fn promtool_check(text: &str) -> (std::process::ExitStatus, String) {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn promtool");
    let mut stdin = child.stdin.take().expect("piped stdin");
    let input = text.to_owned();
    // A thread, so a promtool that answers before reading everything cannot
    // block the write against its full stdout pipe.
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let out = child.wait_with_output().expect("promtool runs");
    let wrote = writer.join().expect("writer thread");
    let mut said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if let Err(e) = wrote {
        said.push_str(&format!("(writing the scrape to promtool: {e})\n"));
    }
    (out.status, said)
}

#[test]
fn counters_are_renamed_and_nothing_else() {
    let om = "# HELP a_bytes Bytes.\n# TYPE a_bytes counter\na_bytes_total 1\n\
              # HELP a_up Up.\n# TYPE a_up gauge\na_up 1\n# EOF\n";
    assert_eq!(
        as_text_0_0_4(om),
        "# HELP a_bytes_total Bytes.\n# TYPE a_bytes_total counter\na_bytes_total 1\n\
         # HELP a_up Up.\n# TYPE a_up gauge\na_up 1\n# EOF\n"
    );
    let text = "# HELP a_bytes_total Bytes.\n# TYPE a_bytes_total counter\na_bytes_total 1\n";
    assert_eq!(as_text_0_0_4(text), text, "0.0.4 passes through");
}

#[tokio::test]
async fn metrics_pass_promtool_check() {
    if !promtool_available() {
        return;
    }
    let dir = tempfile::tempdir().expect("dir");
    let gw = start(config(dir.path(), ""), echo().await).await;
    let a = gw.bound().admin;
    // Traffic, so labelled families have samples and histograms observations:
    // a push applied and one rejected, a flow spliced to the echo origin.
    let doc = format!(
        r#"{{"addresses": ["{SANDBOX}"], "policy": {{"default": "deny", "allow": [{{"cidr": "127.0.0.16/28"}}]}}}}"#
    );
    assert_eq!(
        http(a, "PUT", "/v1/sandboxes/sb", None, Some(&doc)).await.0,
        200
    );
    assert_eq!(
        http(a, "PUT", "/v1/sandboxes/bad", None, Some("not json"))
            .await
            .0,
        400
    );
    assert_eq!(
        flow(&gw, SANDBOX, b"hello").await.as_deref(),
        Some(&b"hello"[..]),
        "the allowed flow is spliced to the echo origin"
    );
    // The flow is counted when it ends, after the echo came back.
    tokio::time::sleep(Duration::from_millis(200)).await;

    let (status, text) = http(a, "GET", "/metrics", None, None).await;
    assert_eq!(status, 200, "{text}");
    assert!(
        metrics(&text)
            .keys()
            .any(|k| k.starts_with("egress_flows_total{")),
        "the flow was counted:\n{text}"
    );
    let linted = as_text_0_0_4(&text);
    let (exit, said) = promtool_check(&linted);
    assert!(
        exit.success() && said.trim().is_empty(),
        "promtool check metrics: {exit}\n{said}\n--- what promtool read ---\n{linted}"
    );
}
