//! docs/api.md cannot drift from the binaries:
//!
//! - every route table (`<!-- routes: NAME -->`) lists exactly the routes
//!   that router's source dispatches, read out of the router by pattern
//!   (the match arms `(&Method::GET, ["v1", "sandboxes", id])`, the literal
//!   paths of the small listeners);
//! - every shell example of README.md and docs/api.md runs, in order, as
//!   one script per document (a block preceded by `<!-- not run: why -->`
//!   is skipped, and must say why): README.md from the repository root,
//!   docs/api.md in an empty folder inside a throwaway network namespace
//!   (only loopback: nothing it starts can reach anything else). Both with
//!   the workspace's built binaries first on `PATH`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use regex::Regex;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// `METHOD /path` with every `{param}` as `{}` and no query.
type Routes = BTreeSet<String>;

fn route(method: &str, path: &str) -> String {
    let params = Regex::new(r"\{[^}]*\}").expect("regex");
    let path = path.split('[').next().unwrap_or(path);
    format!("{method} {}", params.replace_all(path, "{}"))
}

// === what docs/api.md says ===

/// The routes in the first column of the table after `<!-- routes: name -->`.
fn documented(doc: &str, name: &str) -> Routes {
    let marker = format!("<!-- routes: {name} -->");
    let at = doc
        .find(&marker)
        .unwrap_or_else(|| panic!("docs/api.md has no {marker}"));
    let cell = Regex::new(r"`(GET|PUT|POST|DELETE|PATCH) (/[^`]*)`").expect("regex");
    doc[at + marker.len()..]
        .lines()
        .skip(1)
        .take_while(|l| l.starts_with('|'))
        .filter_map(|l| l.split('|').nth(1))
        .flat_map(|first| {
            cell.captures_iter(first)
                .map(|c| route(&c[1], &c[2]))
                .collect::<Vec<_>>()
        })
        .collect()
}

// === what the routers dispatch ===

/// Match arms on (method, path segments): a literal segment stays, a
/// binding (`id`, `_`) is a parameter.
fn slice_arms(source: &str) -> Routes {
    let arm =
        Regex::new(r#"\(\s*(?:&Method::|")(GET|PUT|POST|DELETE|PATCH)"?\s*,\s*\[([^\]]*)\]\s*\)"#)
            .expect("regex");
    arm.captures_iter(source)
        .map(|c| {
            let path: String = c[2]
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(
                    |s| match s.strip_prefix('"').and_then(|s| s.strip_suffix('"')) {
                        Some(literal) => format!("/{literal}"),
                        None => "/{}".to_owned(),
                    },
                )
                .collect();
            route(&c[1], &path)
        })
        .collect()
}

/// The body of `fn name` (up to the next top-level `fn`).
fn function<'a>(source: &'a str, name: &str) -> &'a str {
    let start = source
        .find(&format!("fn {name}("))
        .unwrap_or_else(|| panic!("no fn {name}"));
    let rest = &source[start..];
    let end = rest[1..]
        .find("\nfn ")
        .or_else(|| rest[1..].find("\npub fn "))
        .or_else(|| rest[1..].find("\nasync fn "));
    &rest[..end.map_or(rest.len(), |e| e + 1)]
}

/// Literal paths compared with `path ==` or matched as `"/x" =>`, as GETs.
fn literal_gets(source: &str) -> Routes {
    let lit = Regex::new(r#"(?:path == "(/[a-z]+)"|"(/[a-z]+)" =>)"#).expect("regex");
    lit.captures_iter(source)
        .map(|c| {
            route(
                "GET",
                c.get(1).or_else(|| c.get(2)).map_or("", |m| m.as_str()),
            )
        })
        .collect()
}

fn gateway_routes() -> Routes {
    let admin = read("gateway/src/admin.rs");
    let mut routes = slice_arms(&admin);
    routes.extend(literal_gets(function(&admin, "route")));
    routes.extend(slice_arms(&read("machine/src/api.rs")));
    routes
}

fn webhook_routes() -> Routes {
    let source = read("cluster/src/webhook.rs");
    let paths = Regex::new(r#"matches!\(req\.uri\(\)\.path\(\), ([^)]*)\)"#).expect("regex");
    let found = paths.captures(&source).expect("the webhook's path match");
    assert!(
        source.contains("req.method() != Method::POST"),
        "the webhook takes POST only"
    );
    let lit = Regex::new(r#""(/[a-z]*)""#).expect("regex");
    lit.captures_iter(&found[1])
        .map(|c| route("POST", &c[1]))
        .collect()
}

/// The relay's table: `("/prefix/", &METHODS, …)` per VM route, and the
/// defaults path with its method list.
fn relay_routes() -> Routes {
    let source = read("cluster/src/relay.rs");
    let target = function(&source, "target");
    let consts = Regex::new(r"const (\w+): \[Method; \d+\] = \[([^\]]*)\]").expect("regex");
    let methods = |list: &str| -> Vec<String> {
        list.split(',')
            .filter_map(|m| m.trim().strip_prefix("Method::"))
            .map(str::to_owned)
            .collect()
    };
    let named: Vec<(String, Vec<String>)> = consts
        .captures_iter(target)
        .map(|c| (c[1].to_owned(), methods(&c[2])))
        .collect();
    let resolve = |m: &str| -> Vec<String> {
        match m.strip_prefix('[') {
            Some(list) => methods(list.trim_end_matches(']')),
            None => named
                .iter()
                .find(|(n, _)| n == m)
                .map(|(_, v)| v.clone())
                .unwrap_or_default(),
        }
    };
    let per_vm = Regex::new(r#"\(\s*"(/[a-z-]+)/",\s*&(\w+|\[[^\]]*\])"#).expect("regex");
    let mut routes = Routes::new();
    for c in per_vm.captures_iter(target) {
        for m in resolve(&c[2]) {
            routes.insert(route(&m, &format!("{}/{{}}", &c[1])));
        }
    }
    let defaults =
        Regex::new(r#"if path == "(/[a-z-]+)"[^}]*?allowed\(method, &(\w+)\)"#).expect("regex");
    let d = defaults
        .captures(target)
        .expect("the relay's defaults route");
    for m in resolve(&d[2]) {
        routes.insert(route(&m, &d[1]));
    }
    routes
}

#[test]
fn every_route_of_every_binary_is_documented_and_nothing_else() {
    let doc = read("docs/api.md");
    let controller = read("controller/src/api.rs");
    let checks: [(&str, Routes); 5] = [
        ("egress-gateway", gateway_routes()),
        (
            "egress-controller api",
            slice_arms(function(&controller, "route_of")),
        ),
        (
            "egress-controller dispatcher",
            literal_gets(function(&controller, "serve_metrics")),
        ),
        ("egress-cluster webhook", webhook_routes()),
        ("egress-cluster relay", relay_routes()),
    ];
    for (name, served) in checks {
        assert!(
            served.len() >= 2,
            "{name}: read no routes out of the router: {served:?}"
        );
        let listed = documented(&doc, name);
        let missing: Vec<_> = served.difference(&listed).collect();
        let stale: Vec<_> = listed.difference(&served).collect();
        assert!(
            missing.is_empty() && stale.is_empty(),
            "{name}: served but not in docs/api.md: {missing:?}; in docs/api.md but not served: {stale:?}"
        );
    }
}

#[test]
fn the_route_reader_sees_what_a_router_would_add() {
    // The reader itself: a new arm in the gateway's style or the
    // controller's, with literal and bound segments.
    let arms = slice_arms(
        r#"(&Method::PATCH, ["v1", "sandboxes", id, "shadow"]) => x, ("GET", ["v1", "things", _]) => y"#,
    );
    let expected: Routes = ["PATCH /v1/sandboxes/{}/shadow", "GET /v1/things/{}"]
        .into_iter()
        .map(str::to_owned)
        .collect();
    assert_eq!(arms, expected);
}

// === the shell examples ===

/// The ```sh blocks of `doc` that run: (line of the fence, text).
fn examples(doc: &str) -> Vec<(usize, String)> {
    let lines: Vec<&str> = doc.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        if lines[i].trim() == "```sh" {
            let skipped = i > 0 && lines[i - 1].trim_start().starts_with("<!-- not run:");
            let end = (i + 1..lines.len())
                .find(|&j| lines[j].trim() == "```")
                .unwrap_or_else(|| panic!("unclosed block at line {}", i + 1));
            if !skipped {
                let text = lines[i + 1..end].join("\n");
                // A build or a test run inside the test suite would recurse
                // or take minutes: such a block says why it is not run.
                assert!(
                    !text.contains("cargo "),
                    "line {}: a runnable example calls cargo; mark it `<!-- not run: why -->`",
                    i + 1
                );
                out.push((i + 1, text));
            }
            i = end;
        }
        i += 1;
    }
    out
}

/// The script for a document's examples: strict, each block announced,
/// background jobs ended at exit, `sudo` as a no-op (we are root).
fn script(name: &str, blocks: &[(usize, String)]) -> String {
    let mut s = String::from(
        "set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\nsudo() { \"$@\"; }\n",
    );
    for (line, text) in blocks {
        s.push_str(&format!("echo '== {name}:{line}'\n{text}\n"));
    }
    s
}

/// Runs `script` with bash in `cwd` (inside `netns` if given), the
/// workspace's binaries first on PATH; kills its process group after
/// `limit`. Panics with the output unless it succeeds.
fn run(name: &str, script: &str, cwd: &Path, netns: Option<&str>, limit: Duration) {
    use std::os::unix::process::CommandExt;
    let bins = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().and_then(Path::parent).map(Path::to_path_buf))
        .expect("target dir");
    let path = format!(
        "{}:{}",
        bins.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, "bash", "-c", script]);
            c
        }
        None => {
            let mut c = Command::new("bash");
            c.args(["-c", script]);
            c
        }
    };
    // The log goes beside the test's other temporary files, never into
    // the working directory (the repository, for the README).
    let log = std::env::temp_dir().join(format!(
        "egress-examples-{}-{}.log",
        std::process::id(),
        name.replace('/', "_")
    ));
    let out = std::fs::File::create(&log).expect("log");
    let mut child = cmd
        .current_dir(cwd)
        .env("PATH", path)
        .stdin(Stdio::null())
        .stdout(out.try_clone().expect("log"))
        .stderr(out)
        .process_group(0)
        .spawn()
        .expect("bash");
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(s) = child.try_wait().expect("status") {
            break Some(s);
        }
        if Instant::now() > deadline {
            let _ = Command::new("kill")
                .args(["-KILL", &format!("-{}", child.id())])
                .status();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    assert!(
        status.is_some_and(|s| s.success()),
        "{name}'s examples {}:\n{text}",
        if status.is_none() {
            "did not finish in time"
        } else {
            "failed"
        }
    );
}

/// Root and `ip`, or a skip (the examples make namespaces and run the demo).
fn can_run_examples(what: &str) -> bool {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0\n"));
    let ip = Command::new("ip")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    if !(root && ip) {
        egress_testkit::skip(what, format!("needs root and ip (root={root} ip={ip})"));
    }
    root && ip
}

#[test]
fn the_readme_examples_run() {
    if !can_run_examples("the README's examples") {
        return;
    }
    let blocks = examples(&read("README.md"));
    assert!(!blocks.is_empty(), "README.md has no runnable example");
    run(
        "README.md",
        &script("README.md", &blocks),
        &repo(),
        None,
        Duration::from_secs(120),
    );
}

#[test]
fn the_api_examples_run() {
    if !can_run_examples("docs/api.md's examples") {
        return;
    }
    let blocks = examples(&read("docs/api.md"));
    assert!(
        blocks.len() >= 4,
        "docs/api.md: {} runnable examples",
        blocks.len()
    );
    let dir = tempfile::tempdir().expect("dir");
    let ns = format!("egw-docs-{}", std::process::id());
    let sh = |args: &[&str]| {
        assert!(Command::new("ip")
            .args(args)
            .status()
            .is_ok_and(|s| s.success()))
    };
    sh(&["netns", "add", &ns]);
    sh(&["-n", &ns, "link", "set", "lo", "up"]);
    let result = std::panic::catch_unwind(|| {
        run(
            "docs/api.md",
            &script("docs/api.md", &blocks),
            dir.path(),
            Some(&ns),
            Duration::from_secs(60),
        );
    });
    sh(&["netns", "delete", &ns]);
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
}

#[test]
fn a_failing_example_fails_the_run() {
    if !can_run_examples("the example runner's own check") {
        return;
    }
    let doc = "```sh\ntrue\n```\n<!-- not run: shows a skip -->\n```sh\nexit 3\n```\n```sh\nfalse\necho never\n```\n";
    let blocks = examples(doc);
    assert_eq!(blocks.iter().map(|b| b.0).collect::<Vec<_>>(), [1, 8]);
    let dir = tempfile::tempdir().expect("dir");
    let failed = std::panic::catch_unwind(|| {
        run(
            "t.md",
            &script("t.md", &blocks),
            dir.path(),
            None,
            Duration::from_secs(10),
        );
    });
    assert!(failed.is_err(), "`false` in a block must fail the run");
}
