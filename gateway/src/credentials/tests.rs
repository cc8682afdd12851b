use super::*;
use crate::test_util::header_map as headers;

const VALUE: &str = "ghp_real-value-0123456789";
/// The default `limits.max_request_head`.
const HEAD: usize = 64 * 1024;

/// [`super::apply`] within the default head limit, for a verified name
/// (`None`: an unverified request that names nothing).
fn apply(
    list: &[Credential],
    secrets: &Secrets,
    host: Option<&Hostname>,
    target: &str,
    headers: &mut HeaderMap,
) -> Result<usize, Refused> {
    let names = host.map_or(Names::Unverified(&[]), Names::Verified);
    super::apply(list, secrets, names, target, headers, HEAD).map(|a| a.injected)
}

fn creds(json: &str) -> Vec<Credential> {
    let list: Vec<Credential> = serde_json::from_str(json).expect(json);
    validate(&list).expect("valid");
    list
}

fn h(s: &str) -> Hostname {
    Hostname::parse(s).expect(s)
}

/// A file holding the value, and secrets loaded from it.
/// Secrets that read files under the temporary directory, any variable.
fn under_tmp() -> Secrets {
    Secrets::new(CredentialSources {
        files_under: vec![std::env::temp_dir()],
        env_prefix: String::new(),
    })
}

fn loaded(list: &[Credential]) -> Secrets {
    let s = under_tmp();
    s.load(list).expect("readable");
    s
}

fn value_file(dir: &tempfile::TempDir) -> String {
    let p = dir.path().join("github");
    std::fs::write(&p, format!("{VALUE}\n")).expect("write");
    p.display().to_string()
}

fn github(path: &str, require: bool) -> Vec<Credential> {
    creds(&format!(
        r#"[{{"name": "github", "placeholder": "EGRESS_PH_GITHUB", "hosts": ["api.github.test", "*.githubusercontent.test"],
             "inject": {{"header": "authorization", "format": "Bearer {{value}}"}},
             "source": {{"file": "{path}"}}, "require": {require}}}]"#
    ))
}

#[test]
fn the_value_replaces_the_placeholder_only_for_its_hosts() {
    let dir = tempfile::tempdir().expect("tmp");
    let list = github(&value_file(&dir), false);
    let secrets = loaded(&list);
    let mut hs = headers(&[("authorization", "Bearer EGRESS_PH_GITHUB")]);
    let out = apply(
        &list,
        &secrets,
        Some(&h("api.github.test")),
        "/user",
        &mut hs,
    );
    assert_eq!(out, Ok(1));
    assert_eq!(hs["authorization"], format!("Bearer {VALUE}").as_str());
    assert!(hs["authorization"].is_sensitive());
    // The header is added when the sandbox sent none.
    let mut hs = headers(&[]);
    apply(
        &list,
        &secrets,
        Some(&h("raw.githubusercontent.test")),
        "/",
        &mut hs,
    )
    .expect("added");
    assert_eq!(hs["authorization"], format!("Bearer {VALUE}").as_str());
    // The placeholder to any other host, or over plain HTTP, is refused.
    for (host, target, hdrs) in [
        (
            Some("evil.test"),
            "/",
            vec![("authorization", "Bearer EGRESS_PH_GITHUB")],
        ),
        (Some("evil.test"), "/?k=EGRESS_PH_GITHUB", vec![]),
        // Written in escapes, as an origin that decodes the target reads it.
        (Some("evil.test"), "/?k=EGRESS%5FPH%5fGITHUB", vec![]),
        (Some("evil.test"), "/%45GRESS_PH_GITHUB/x", vec![]),
        (Some("evil.test"), "/?k=%2545GRESS_PH_GITHUB", vec![]),
        // Raw, but decoding would change it: the raw reading counts too.
        (Some("evil.test"), "/?k=%4EGRESS_PH_GITHUB", vec![]),
        // The placeholder at the first decoding only.
        (Some("evil.test"), "/?k=%254%45GRESS_PH_GITHUB", vec![]),
        (
            Some("evil.test"),
            "/",
            vec![("cookie", "t=EGRESS%5FPH_GITHUB")],
        ),
        (
            Some("evil.test"),
            "/",
            vec![("x-note", "see EGRESS_PH_GITHUB here")],
        ),
        (
            None,
            "/",
            vec![("authorization", "Bearer EGRESS_PH_GITHUB")],
        ),
    ] {
        let mut hs = headers(&hdrs);
        let before = hs.clone();
        let out = apply(&list, &secrets, host.map(h).as_ref(), target, &mut hs);
        assert_eq!(
            out,
            Err(Refused {
                why: Refusal::HostMismatch,
                index: 0
            }),
            "{host:?} {target} {hdrs:?}"
        );
        assert_eq!(hs, before, "nothing changes on a refusal");
    }
    // A request to another host without the placeholder is untouched.
    let mut hs = headers(&[("authorization", "Bearer own")]);
    assert_eq!(
        apply(&list, &secrets, Some(&h("evil.test")), "/", &mut hs),
        Ok(0)
    );
    assert_eq!(hs["authorization"], "Bearer own");
}

#[test]
fn require_refuses_a_key_of_the_sandboxs_own() {
    let dir = tempfile::tempdir().expect("tmp");
    let list = github(&value_file(&dir), true);
    let secrets = loaded(&list);
    let mut hs = headers(&[("authorization", "Bearer my-own-key")]);
    assert_eq!(
        apply(&list, &secrets, Some(&h("api.github.test")), "/", &mut hs),
        Err(Refused {
            why: Refusal::Required,
            index: 0
        })
    );
    // Its own key in the same value as the placeholder: an origin that
    // takes the first word after the scheme reads its own.
    for value in [
        "Bearer my-own-key EGRESS_PH_GITHUB",
        "Bearer EGRESS_PH_GITHUB my-own-key",
        "Bearer my-own-keyEGRESS_PH_GITHUB",
        "EGRESS_PH_GITHUB",
    ] {
        let mut hs = headers(&[("authorization", value)]);
        assert_eq!(
            apply(&list, &secrets, Some(&h("api.github.test")), "/", &mut hs),
            Err(Refused {
                why: Refusal::Required,
                index: 0
            }),
            "{value}"
        );
    }
    // The scheme in another case is the format still (RFC 9110 11.1).
    let mut hs = headers(&[("authorization", "bearer EGRESS_PH_GITHUB")]);
    assert_eq!(
        apply(&list, &secrets, Some(&h("api.github.test")), "/", &mut hs),
        Ok(1)
    );
    // Its own key beside the placeholder: the origin may read either.
    for both in [
        [
            ("authorization", "Bearer my-own-key"),
            ("authorization", "Bearer EGRESS_PH_GITHUB"),
        ],
        [
            ("authorization", "Bearer EGRESS_PH_GITHUB"),
            ("authorization", "Bearer my-own-key"),
        ],
        // The same two in one line, as a list: what two lines are.
        [
            (
                "authorization",
                "Bearer my-own-key, Bearer EGRESS_PH_GITHUB",
            ),
            ("x-other", "-"),
        ],
        [
            ("authorization", "Bearer EGRESS_PH_GITHUB,Bearer my-own-key"),
            ("x-other", "-"),
        ],
    ] {
        let mut hs = headers(&both);
        assert_eq!(
            apply(&list, &secrets, Some(&h("api.github.test")), "/", &mut hs),
            Err(Refused {
                why: Refusal::Required,
                index: 0
            }),
            "{both:?}"
        );
    }
    // A cookie's pairs are a list too; the format's own separators are not.
    let cookie = |format: &str| {
        creds(&format!(
            r#"[{{"name": "s", "placeholder": "EGRESS_PH_S", "hosts": ["api.github.test"],
                 "inject": {{"header": "cookie", "format": "{format}"}},
                 "source": {{"file": "{}"}}, "require": true}}]"#,
            value_file(&dir)
        ))
    };
    let session = cookie("session={value}");
    let secrets = loaded(&session);
    let mut hs = headers(&[("cookie", "session=EGRESS_PH_S; session=mine")]);
    assert_eq!(
        apply(
            &session,
            &secrets,
            Some(&h("api.github.test")),
            "/",
            &mut hs
        ),
        Err(Refused {
            why: Refusal::Required,
            index: 0
        })
    );
    let mut hs = headers(&[("cookie", "session=EGRESS_PH_S")]);
    assert_eq!(
        apply(
            &session,
            &secrets,
            Some(&h("api.github.test")),
            "/",
            &mut hs
        ),
        Ok(1)
    );
    let pair = cookie("lang=en; session={value}");
    let secrets = loaded(&pair);
    let mut hs = headers(&[("cookie", "lang=en; session=EGRESS_PH_S")]);
    assert_eq!(
        apply(&pair, &secrets, Some(&h("api.github.test")), "/", &mut hs),
        Ok(1)
    );
    // Read by pairs, not by counting separators: other cookies pass, the
    // credential's own named twice or without the placeholder does not.
    for (jar, passes) in [
        ("session=EGRESS_PH_S; _ga=1", true),
        ("_ga=1;session=EGRESS_PH_S", true),
        ("session=EGRESS_PH_S; session=mine", false),
        ("session=mine; other=EGRESS_PH_S", false),
        ("session=mine,EGRESS_PH_S", false),
        ("session=EGRESS_PH_S mine", false),
    ] {
        for (list, format) in [
            (&session, "session={value}"),
            (&pair, "lang=en; session={value}"),
        ] {
            let mut hs = headers(&[("cookie", jar)]);
            let got = apply(
                list,
                &loaded(list),
                Some(&h("api.github.test")),
                "/",
                &mut hs,
            );
            assert_eq!(got.is_ok(), passes, "{jar} under {format}: {got:?}");
        }
    }
    let secrets = loaded(&github(&value_file(&dir), true));
    let optional = github(&value_file(&dir), false);
    let mut hs = headers(&[("authorization", "Bearer my-own-key")]);
    assert_eq!(
        apply(
            &optional,
            &secrets,
            Some(&h("api.github.test")),
            "/",
            &mut hs
        ),
        Ok(0)
    );
}

/// One credential `k` for `api.test`, placeholder `PH_KEY_0001`, its value
/// in `path`, put in as `inject` says.
fn api_key(path: &str, inject: &str, require: bool) -> Vec<Credential> {
    creds(&format!(
        r#"[{{"name": "k", "placeholder": "PH_KEY_0001", "hosts": ["api.test"],
             "inject": {inject}, "source": {{"file": "{path}"}}, "require": {require}}}]"#
    ))
}

/// A required credential's header beside one that reads as it to an
/// origin taking `_` for `-` (`x_api_key`, a key of the sandbox's own):
/// refused, whether the sandbox sent the placeholder or no header at all.
#[test]
fn require_refuses_a_header_that_reads_as_the_credentials() {
    let dir = tempfile::tempdir().expect("tmp");
    let list = api_key(
        &value_file(&dir),
        r#"{"header": "x-api-key", "format": "{value}"}"#,
        true,
    );
    let secrets = loaded(&list);
    for sent in [
        vec![("x-api-key", "PH_KEY_0001"), ("x_api_key", "my-own-key")],
        vec![("X_Api_Key", "my-own-key")],
    ] {
        let mut hs = headers(&sent);
        assert_eq!(
            apply(&list, &secrets, Some(&h("api.test")), "/", &mut hs),
            Err(Refused {
                why: Refusal::Required,
                index: 0
            }),
            "{sent:?}"
        );
    }
    let mut hs = headers(&[("x-api-key", "PH_KEY_0001"), ("x_trace", "1")]);
    assert_eq!(
        apply(&list, &secrets, Some(&h("api.test")), "/", &mut hs),
        Ok(1)
    );
}

#[test]
fn replace_mode_replaces_in_every_header_and_unreadable_values_refuse() {
    let dir = tempfile::tempdir().expect("tmp");
    let path = value_file(&dir);
    let list = api_key(&path, r#"{"replace": "headers"}"#, false);
    let secrets = loaded(&list);
    let mut hs = headers(&[
        ("x-api-key", "PH_KEY_0001"),
        ("cookie", "a=1; k=PH_KEY_0001"),
    ]);
    apply(&list, &secrets, Some(&h("api.test")), "/", &mut hs).expect("replaced");
    assert_eq!(hs["x-api-key"], VALUE);
    assert_eq!(hs["cookie"], format!("a=1; k={VALUE}").as_str());
    // SIGHUP after the file went away: the value is dropped, requests refused.
    std::fs::remove_file(&path).expect("rm");
    let failed = secrets.reload(list.iter().map(|c| &c.source));
    assert_eq!(failed.len(), 1);
    assert!(failed[0].contains(&path), "{failed:?}");
    let mut hs = headers(&[("x-api-key", "PH_KEY_0001")]);
    assert_eq!(
        apply(&list, &secrets, Some(&h("api.test")), "/", &mut hs),
        Err(Refused {
            why: Refusal::Unavailable,
            index: 0
        })
    );
    // And a push that names an unreadable source is refused, naming it.
    let e = under_tmp().load(&list).expect_err("unreadable");
    assert!(
        e.starts_with("credentials[0].source: file") && e.contains(&path),
        "{e}"
    );
}

/// Where the name is not verified (plain HTTP, an address), a request that
/// may be for a required credential's hosts is refused: no value would go
/// in, so the sandbox would use a key of its own there, in clear.
#[test]
fn require_holds_where_the_name_is_not_verified() {
    let dir = tempfile::tempdir().expect("tmp");
    let list = github(&value_file(&dir), true);
    let secrets = loaded(&list);
    let api = h("api.github.test");
    let other = h("example.test");
    let required = Err(Refused {
        why: Refusal::Required,
        index: 0,
    });
    for may_be in [vec![&api], vec![&other, &api]] {
        let mut hs = headers(&[("authorization", "Bearer my-own-key")]);
        let names = Names::Unverified(&may_be);
        assert_eq!(
            super::apply(&list, &secrets, names, "/", &mut hs, HEAD).map(|a| a.injected),
            required,
            "{may_be:?}"
        );
    }
    // A request that cannot be for its hosts is not its business.
    let mut hs = headers(&[("authorization", "Bearer my-own-key")]);
    let names = Names::Unverified(&[&other]);
    assert_eq!(
        super::apply(&list, &secrets, names, "/", &mut hs, HEAD).map(|a| a.injected),
        Ok(0)
    );
    // Not required: the request passes as sent, nothing put in.
    let optional = github(&value_file(&dir), false);
    let mut hs = headers(&[("authorization", "Bearer my-own-key")]);
    let names = Names::Unverified(&[&api]);
    assert_eq!(
        super::apply(&optional, &secrets, names, "/", &mut hs, HEAD).map(|a| a.injected),
        Ok(0)
    );
    assert_eq!(hs["authorization"], "Bearer my-own-key");
}

/// A placeholder repeated in a head within the limit would grow it by the
/// value's length each time: past the limit, the request is refused whole.
#[test]
fn a_head_the_values_would_grow_past_the_limit_is_refused() {
    let dir = tempfile::tempdir().expect("tmp");
    let big = dir.path().join("big");
    std::fs::write(&big, "v".repeat(8 * 1024)).expect("write");
    let list = creds(&format!(
        r#"[{{"name": "big", "placeholder": "EGRESS_PH_BIG", "hosts": ["api.test"],
             "inject": {{"replace": "headers"}}, "source": {{"file": "{}"}}}}]"#,
        big.display()
    ));
    let secrets = loaded(&list);
    // 2,000 placeholders: 26 KiB as sent, 16 MiB with the values in.
    let sent = "EGRESS_PH_BIG ".repeat(2000);
    let mut hs = headers(&[("x-many", sent.as_str())]);
    assert_eq!(
        apply(&list, &secrets, Some(&h("api.test")), "/", &mut hs),
        Err(Refused {
            why: Refusal::TooLarge,
            index: 0
        }),
        "grown to {} bytes",
        hs["x-many"].len()
    );
    assert_eq!(hs["x-many"], sent.as_str(), "nothing changed");
    // Seven of them fit: 56 KiB and the rest of the head.
    let seven = "EGRESS_PH_BIG ".repeat(7);
    let mut hs = headers(&[("x-many", seven.as_str())]);
    apply(&list, &secrets, Some(&h("api.test")), "/", &mut hs).expect("within the limit");
    assert_eq!(hs["x-many"].len(), 7 * (8 * 1024 + 1));
    // A header added whole counts too.
    let added = github(&big.display().to_string(), false);
    let secrets = loaded(&added);
    let filler = "f".repeat(HEAD - 8 * 1024);
    let mut hs = headers(&[("x-filler", filler.as_str())]);
    assert_eq!(
        apply(&added, &secrets, Some(&h("api.github.test")), "/", &mut hs),
        Err(Refused {
            why: Refusal::TooLarge,
            index: 0
        })
    );
    assert!(!hs.contains_key("authorization"));
    // So does the request line: a long target and the header added whole.
    let target = format!("/{}", "p".repeat(HEAD - 4 * 1024));
    let mut hs = headers(&[("x-other", "-")]);
    assert_eq!(
        apply(
            &added,
            &secrets,
            Some(&h("api.github.test")),
            &target,
            &mut hs
        ),
        Err(Refused {
            why: Refusal::TooLarge,
            index: 0
        })
    );
}

#[test]
fn values_never_show() {
    let dir = tempfile::tempdir().expect("tmp");
    let list = github(&value_file(&dir), false);
    let secrets = loaded(&list);
    let secret = secrets.get(&list[0].source).expect("loaded");
    assert_eq!(format!("{secret:?}"), "<redacted>");
    assert!(!format!("{secrets:?}").contains(VALUE));
    let mut hs = headers(&[]);
    apply(&list, &secrets, Some(&h("api.github.test")), "/", &mut hs).expect("added");
    assert!(!format!("{hs:?}").contains(VALUE), "{hs:?}");
}

#[test]
fn documents_are_checked_field_by_field() {
    let ok = r#""name": "a", "hosts": ["a.test"], "inject": {"replace": "headers"}, "source": {"env": "A_KEY"}"#;
    for (doc, needle) in [
        (format!(r#"[{{"placeholder": "short", {ok}}}]"#), "credentials[0].placeholder: invalid placeholder \"short\""),
        (
            format!(r#"[{{"placeholder": "PH_000001", {ok}}}, {{"placeholder": "PH_0000012", {ok}}}]"#),
            "credentials[1].name: name \"a\" is also credentials[0]'s",
        ),
        (
            r#"[{"name": "a", "placeholder": "PH_000001", "hosts": [], "inject": {"replace": "headers"}, "source": {"env": "A"}}]"#.into(),
            "credentials[0].hosts: 1 to 64 hosts",
        ),
    ] {
        let list: Vec<Credential> = serde_json::from_str(&doc).expect(&doc);
        let e = validate(&list).expect_err(&doc);
        assert!(e.contains(needle), "{doc}: {e}");
    }
    for (doc, needle) in [
        (
            r#"{"header": "host", "format": "{value}"}"#,
            "frames or routes",
        ),
        (
            r#"{"header": "authorization", "format": "Bearer"}"#,
            "{value} exactly once",
        ),
        (r#"{"replace": "body"}"#, "unknown replace \"body\""),
        (r#"{"header": "authorization"}"#, "expected"),
    ] {
        let e = serde_json::from_str::<Inject>(doc)
            .expect_err(doc)
            .to_string();
        assert!(e.contains(needle), "{doc}: {e}");
    }
    for (doc, needle) in [
        (r#"{"file": "relative/path"}"#, "absolute path"),
        (r#"{"env": "1BAD"}"#, "invalid environment variable name"),
        (r#"{"file": "/a", "env": "A"}"#, "expected"),
    ] {
        let e = serde_json::from_str::<Source>(doc)
            .expect_err(doc)
            .to_string();
        assert!(e.contains(needle), "{doc}: {e}");
    }
    let e = serde_json::from_str::<HostPattern>(r#""bad_host""#)
        .expect_err("bad")
        .to_string();
    assert!(e.contains("bad_host"), "{e}");
}

/// A source is read with the gateway's rights, so only where the operator
/// said: a file under `credentials.files_under` once its links are
/// resolved, a variable named with `credentials.env_prefix`.
#[test]
fn only_the_allowed_sources_are_read() {
    let allowed = tempfile::tempdir().expect("tmp");
    let outside = tempfile::tempdir().expect("tmp");
    let secrets = Secrets::new(CredentialSources {
        files_under: vec![allowed.path().join("missing"), allowed.path().to_owned()],
        env_prefix: "EGRESS_CREDENTIAL_".into(),
    });
    let inside = value_file(&allowed);
    secrets
        .load(&github(&inside, false))
        .expect("under files_under");

    let elsewhere = value_file(&outside);
    let link = allowed.path().join("link");
    std::os::unix::fs::symlink(&elsewhere, &link).expect("link");
    let dotted = format!("{}/../{}/github", allowed.path().display(), {
        outside.path().file_name().expect("name").to_string_lossy()
    });
    // A path outside, even one that does not exist, says the same: no
    // refusal tells whether a file exists or where a link leads.
    let missing = outside.path().join("missing").display().to_string();
    let real_outside = std::fs::canonicalize(outside.path()).expect("real");
    for path in [elsewhere, link.display().to_string(), dotted, missing] {
        let e = secrets.load(&github(&path, false)).expect_err(&path);
        assert!(
            e.contains("is not under credentials.files_under") && !e.contains(VALUE),
            "{e}"
        );
        if !path.starts_with(&*outside.path().to_string_lossy()) {
            assert!(!e.contains(&*real_outside.to_string_lossy()), "{e}");
        }
    }

    std::env::set_var("EGRESS_TEST_HOME_LIKE", VALUE);
    std::env::set_var("EGRESS_CREDENTIAL_TEST_OK", VALUE);
    let env = |name: &str| {
        creds(&format!(
            r#"[{{"name": "a", "placeholder": "PH_ENV_0001", "hosts": ["a.test"],
                "inject": {{"replace": "headers"}}, "source": {{"env": "{name}"}}}}]"#
        ))
    };
    let e = secrets
        .load(&env("EGRESS_TEST_HOME_LIKE"))
        .expect_err("prefix");
    assert!(e.contains("credentials.env_prefix"), "{e}");
    secrets
        .load(&env("EGRESS_CREDENTIAL_TEST_OK"))
        .expect("the prefix");
    let none = Secrets::new(CredentialSources {
        files_under: Vec::new(),
        env_prefix: String::new(),
    });
    assert!(
        none.load(&github(&inside, false)).is_err(),
        "no directory: no file"
    );
    none.load(&env("EGRESS_TEST_HOME_LIKE"))
        .expect("an empty prefix allows any name");
}

/// A SIGHUP (or two) that read the registry before a push's sandbox was in
/// it keeps the value that push loaded (the push may be committing), read
/// again: rotated meanwhile, the new value; gone, dropped and reported.
#[test]
fn a_reload_keeps_what_a_push_in_flight_loaded() {
    let dir = tempfile::tempdir().expect("tmp");
    let path = value_file(&dir);
    let list = github(&path, false);
    let secrets = under_tmp();
    secrets.load(&list).expect("load");
    let value = || secrets.get(&list[0].source).map(|v| v.0.to_vec());
    let first = value();
    for _ in 0..2 {
        assert!(secrets.reload(std::iter::empty()).is_empty());
        assert_eq!(value(), first, "kept through the reload");
    }
    std::fs::write(&path, "rotated-value-0001").expect("rotate");
    assert!(secrets.reload(std::iter::empty()).is_empty());
    assert_ne!(value(), first, "read again, not kept as it was");
    std::fs::remove_file(&path).expect("rm");
    assert_eq!(secrets.reload(std::iter::empty()).len(), 1, "reported");
    assert!(value().is_none(), "unreadable: dropped");
}

/// Where the thread at `task` (`/proc/<pid>/task/<tid>`) waits in the
/// kernel: `wait_for_partner` while it opens a FIFO no one writes.
fn waits_in(task: &std::path::Path) -> String {
    std::fs::read_to_string(task.join("wchan")).unwrap_or_default()
}

/// Waits until the thread at `task` waits to open the FIFO at `fifo`
/// (`true`), or until `reader` ends (`false`).
fn opening_fifo(
    task: &std::path::Path,
    fifo: &std::path::Path,
    reader: &std::thread::ScopedJoinHandle<'_, Result<(), (usize, String)>>,
) -> bool {
    for _ in 0..1_000 {
        if waits_in(task) == "wait_for_partner" {
            return true;
        }
        if reader.is_finished() {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    // Where the kernel does not tell (no `wchan`), let a reader blocked in
    // its open go (it reads nothing), so the panic ends the test rather
    // than the scope waiting on that thread for good.
    use std::os::unix::fs::OpenOptionsExt;
    let _ = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(fifo);
    panic!(
        "the resync neither opened the FIFO nor ended in 10 s (wchan {:?})",
        waits_in(task)
    );
}

/// A resync read a value, then a SIGHUP read it rotated: the resync reads it
/// again rather than put the old value back over the reload's. A FIFO as a
/// second source holds the resync between its reads, for as long as the
/// test wants.
#[test]
fn a_resync_reads_again_what_a_reload_read_meanwhile() {
    use std::io::Write;
    let dir = tempfile::tempdir().expect("tmp");
    let path = value_file(&dir);
    let fifo = dir.path().join("slow");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    assert!(made.expect("mkfifo").success(), "mkfifo");
    let (plain, slow) = (
        github(&path, false),
        github(&fifo.display().to_string(), false),
    );
    let secrets = under_tmp();
    let feed = |value: &[u8]| {
        let mut w = std::fs::OpenOptions::new()
            .write(true)
            .open(&fifo)
            .expect("open the FIFO");
        w.write_all(value).expect("feed the FIFO");
    };
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel();
        let (plain, slow, secrets) = (&plain, &slow, &secrets);
        let resync = s.spawn(move || {
            let task = std::fs::read_link("/proc/thread-self").expect("/proc/thread-self");
            tx.send(std::path::Path::new("/proc").join(task))
                .expect("send");
            secrets.load_all([plain.as_slice(), slow.as_slice()])
        });
        let task = rx.recv().expect("the resync's thread");
        // The resync has read the plain file and waits on the FIFO: rotate
        // the value and reload it meanwhile, then let the resync go on.
        assert!(
            opening_fifo(&task, &fifo, &resync),
            "the resync reads the FIFO"
        );
        let mut w = std::fs::OpenOptions::new()
            .write(true)
            .open(&fifo)
            .expect("open the FIFO");
        while waits_in(&task) == "wait_for_partner" {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        std::fs::write(&path, "rotated-value-0001").expect("rotate");
        assert!(secrets.reload([&plain[0].source]).is_empty());
        w.write_all(b"slow-value-1").expect("feed");
        drop(w);
        // Read again, the FIFO too: a second value for it.
        let again = opening_fifo(&task, &fifo, &resync);
        if again {
            feed(b"slow-value-2");
        }
        assert_eq!(resync.join().expect("resync"), Ok(()));
        let value = secrets.get(&plain[0].source).map(|v| v.0.to_vec());
        assert_eq!(
            value.as_deref(),
            Some(&b"rotated-value-0001"[..]),
            "the reload's value stands (the FIFO read again: {again})"
        );
        let slow_value = secrets.get(&slow[0].source).map(|v| v.0.to_vec());
        assert_eq!(slow_value.as_deref(), Some(&b"slow-value-2"[..]));
    });
}

/// With `replace: "headers"` the sandbox chooses the header its value
/// goes in, and an origin may keep it (object metadata) and send it back
/// in any later answer: every answer of the host is scrubbed, not only the
/// answer to a request that carried the value. A `header` credential's
/// answers are, when the request carried its value.
#[test]
fn every_answer_of_a_replace_headers_host_is_scrubbed() {
    let dir = tempfile::tempdir().expect("tmp");
    let path = value_file(&dir);
    let scrubbed = |inject: &str, sent: &[(&str, &str)]| {
        let list = api_key(&path, inject, false);
        let secrets = loaded(&list);
        let mut hs = headers(sent);
        let names = Names::Verified(&h("api.test"));
        let applied = super::apply(&list, &secrets, names, "/", &mut hs, HEAD).expect("passes");
        let carried = applied.carried?;
        let mut answer = headers(&[("x-goog-meta-n", VALUE)]);
        assert_eq!(carried.headers(&mut answer), 1);
        Some(answer["x-goog-meta-n"].to_str().expect("text").to_owned())
    };
    let replace = r#"{"replace": "headers"}"#;
    assert_eq!(
        scrubbed(replace, &[("accept", "*/*")]).as_deref(),
        Some("PH_KEY_0001"),
        "a request that carried nothing"
    );
    assert_eq!(
        scrubbed(replace, &[("x-api-key", "PH_KEY_0001")]).as_deref(),
        Some("PH_KEY_0001")
    );
    let header = r#"{"header": "x-api-key", "format": "{value}"}"#;
    assert_eq!(
        scrubbed(header, &[("x-api-key", "mine")]),
        None,
        "nothing of the credential's went"
    );
    // Over plain HTTP, or to the host's address: no value goes in, but
    // one the origin kept still comes back as its placeholder.
    let list = api_key(&path, replace, false);
    let secrets = loaded(&list);
    let name = h("api.test");
    let mut hs = headers(&[("accept", "*/*")]);
    let applied = super::apply(
        &list,
        &secrets,
        Names::Unverified(&[&name]),
        "/",
        &mut hs,
        HEAD,
    )
    .expect("passes");
    assert_eq!(applied.injected, 0);
    let mut answer = headers(&[("x-goog-meta-n", VALUE)]);
    assert_eq!(applied.carried.expect("scrubbed").headers(&mut answer), 1);
    assert_eq!(answer["x-goog-meta-n"], "PH_KEY_0001");
}
