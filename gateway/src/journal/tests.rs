use std::sync::Arc;

use egress_policy::{PlatformDenies, Policy};

use super::*;

fn doc(id: &str, addr: &str) -> SandboxDoc {
    SandboxDoc {
        id: id.into(),
        addresses: vec![addr.parse().expect("ip")],
        policy: Policy::from_json(r#"{"default": "allow"}"#).expect("policy"),
        credentials: Vec::new(),
        upstream_proxy: None,
        shadow: None,
        revision: None,
    }
}

fn put(seq: u64, id: &str, addr: &str) -> Record {
    Record {
        seq,
        change: Change::Put(Box::new(doc(id, addr))),
    }
}

fn registry() -> Registry {
    Registry::new(Arc::new(PlatformDenies::builtin()))
}

fn write(dir: &Path, records: &[Record]) -> u64 {
    let (mut j, existing) = Journal::open(dir, 0).expect("open");
    assert!(existing.is_empty());
    j.append(records).expect("append");
    j.bytes()
}

#[test]
fn records_replay_in_order_on_top_of_the_snapshot() {
    let dir = tempfile::tempdir().expect("dir");
    write(
        dir.path(),
        &[
            put(1, "a", "100.64.0.1"),
            put(2, "b", "100.64.0.2"),
            Record {
                seq: 3,
                change: Change::Delete("a".into()),
            },
        ],
    );
    let r = registry();
    let (_, seq, n) = recover(&r, dir.path()).expect("recover");
    assert_eq!((seq, n), (3, 1));
    assert!(r.get(&SandboxId::new("b")).is_some());
    assert!(r.get(&SandboxId::new("a")).is_none());
}

#[test]
fn a_torn_tail_is_dropped_at_every_cut_and_appends_continue_after_it() {
    let dir = tempfile::tempdir().expect("dir");
    let first = write(dir.path(), &[put(1, "a", "100.64.0.1")]) as usize;
    let (mut j, _) = Journal::open(dir.path(), 0).expect("open");
    j.append(&[put(2, "b", "100.64.0.2")]).expect("append");
    drop(j);
    let full = std::fs::read(path(dir.path())).expect("read");
    for cut in first..full.len() {
        std::fs::write(path(dir.path()), &full[..cut]).expect("cut");
        let r = registry();
        let (mut j, seq, n) = recover(&r, dir.path()).expect("a torn tail is not fatal");
        assert_eq!((seq, n), (1, 1), "cut at {cut}");
        assert_eq!(
            std::fs::metadata(path(dir.path())).expect("meta").len() as usize,
            first,
            "the tail is cut off"
        );
        j.append(&[put(2, "b", "100.64.0.2")])
            .expect("append after");
        drop(j);
        let (_, seq, n) = recover(&registry(), dir.path()).expect("recover");
        assert_eq!((seq, n), (2, 2), "cut at {cut}");
    }
}

/// A tail of zeros (the file extended by a crash, its data never written)
/// is torn like a cut one: its first "record" has a length of 0, whose
/// empty payload passes its checksum, and it stopped the startup.
#[test]
fn a_tail_of_zeros_is_dropped() {
    let dir = tempfile::tempdir().expect("dir");
    let whole = write(dir.path(), &[put(1, "a", "100.64.0.1")]) as usize;
    for zeros in [8, 9, 64, 4096] {
        let mut bytes = std::fs::read(path(dir.path())).expect("read");
        bytes.truncate(whole);
        bytes.resize(whole + zeros, 0);
        std::fs::write(path(dir.path()), &bytes).expect("zeros");
        let (_, seq, n) = recover(&registry(), dir.path()).expect("a tail of zeros is torn");
        assert_eq!((seq, n), (1, 1), "{zeros} zeros");
    }
}

/// A batch is one write: a crash inside it can leave zeros from the middle
/// of its first record to its end. Torn, not corrupt: the start goes on
/// with what was acknowledged before it.
#[test]
fn a_batch_torn_inside_its_first_record_is_a_torn_tail() {
    let dir = tempfile::tempdir().expect("dir");
    let (mut j, _) = Journal::open(dir.path(), 0).expect("open");
    j.append(&[put(1, "a", "100.64.0.1")]).expect("append");
    let acknowledged = j.bytes() as usize;
    j.append(&[put(2, "b", "100.64.0.2"), put(3, "c", "100.64.0.3")])
        .expect("append");
    drop(j);
    let mut bytes = std::fs::read(path(dir.path())).expect("read");
    let from = acknowledged + 8 + 10;
    let len = bytes.len();
    bytes[from..len].fill(0);
    std::fs::write(path(dir.path()), &bytes).expect("torn");
    let (_, seq, n) = recover(&registry(), dir.path()).expect("a torn batch is a torn tail");
    assert_eq!((seq, n), (1, 1));
    assert_eq!(
        std::fs::metadata(path(dir.path())).expect("meta").len() as usize,
        acknowledged,
        "cut back to what was acknowledged"
    );
}

#[test]
fn a_bad_checksum_at_the_end_is_torn_but_in_the_middle_stops_startup() {
    let dir = tempfile::tempdir().expect("dir");
    write(
        dir.path(),
        &[put(1, "a", "100.64.0.1"), put(2, "b", "100.64.0.2")],
    );
    let full = std::fs::read(path(dir.path())).expect("read");
    let mut tail = full.clone();
    let last = tail.len() - 2;
    tail[last] ^= 0x40;
    std::fs::write(path(dir.path()), &tail).expect("write");
    let (_, seq, _) = recover(&registry(), dir.path()).expect("tail");
    assert_eq!(seq, 1);
    let mut middle = full;
    middle[10] ^= 0x40;
    std::fs::write(path(dir.path()), &middle).expect("write");
    let e = recover(&registry(), dir.path()).expect_err("a corrupt middle is fatal");
    let text = e.to_string();
    assert!(
        text.contains(JOURNAL_FILE) && text.contains("offset 0") && text.contains("Do not remove"),
        "{text}"
    );
}

#[test]
fn records_the_snapshot_covers_are_not_replayed() {
    let dir = tempfile::tempdir().expect("dir");
    // A resync wrote a snapshot covering seq 3 (only "c"), then the process
    // died before the journal was emptied: its older records must not come back.
    write(
        dir.path(),
        &[put(1, "a", "100.64.0.1"), put(2, "b", "100.64.0.2")],
    );
    let snap = registry();
    snap.put(
        SandboxId::new("c"),
        vec!["100.64.0.3".parse().expect("ip")],
        Policy::default(),
    )
    .expect("put");
    persist::save(dir.path(), &snap, 3).expect("snapshot");
    let r = registry();
    let (_, seq, n) = recover(&r, dir.path()).expect("recover");
    assert_eq!((seq, n), (3, 1));
    assert!(r.get(&SandboxId::new("c")).is_some());
}

#[test]
fn credentials_are_kept_as_references_and_recovered() {
    let dir = tempfile::tempdir().expect("dir");
    let mut d = doc("c", "100.64.0.3");
    d.credentials = serde_json::from_str(
        r#"[{"name": "gh", "placeholder": "EGRESS_PH_GH", "hosts": ["api.github.test"],
             "inject": {"header": "authorization", "format": "token {value}"},
             "source": {"env": "GH_TOKEN"}, "require": true}]"#,
    )
    .expect("credentials");
    write(
        dir.path(),
        &[Record {
            seq: 1,
            change: Change::Put(Box::new(d.clone())),
        }],
    );
    let bytes = std::fs::read(dir.path().join(JOURNAL_FILE)).expect("journal");
    let on_disk = String::from_utf8_lossy(&bytes);
    assert!(
        on_disk.contains(r#""source":{"env":"GH_TOKEN"}"#),
        "{on_disk}"
    );
    let r = registry();
    recover(&r, dir.path()).expect("recover");
    let s = r.get(&SandboxId::new("c")).expect("recovered");
    assert_eq!(s.credentials, d.credentials);
    // Their hosts are never spliced: the compiled policy knows them.
    assert!(s.policy.has_request_rules());
}

/// A damaged length is not a torn tail when a whole record follows it:
/// cutting there would drop acknowledged records (a length above what a
/// writer writes, or one pointing past the end).
#[test]
fn a_damaged_length_with_a_record_after_it_stops_startup() {
    let dir = tempfile::tempdir().expect("dir");
    write(
        dir.path(),
        &[put(1, "a", "100.64.0.1"), put(2, "b", "100.64.0.2")],
    );
    let full = std::fs::read(path(dir.path())).expect("read");
    for byte in [3, 2] {
        let mut damaged = full.clone();
        damaged[byte] ^= 0x08;
        std::fs::write(path(dir.path()), &damaged).expect("write");
        let e = recover(&registry(), dir.path()).expect_err("acknowledged records follow");
        let text = e.to_string();
        assert!(
            text.contains("offset 0") && text.contains("a whole record at offset"),
            "{text}"
        );
        assert_eq!(
            std::fs::read(path(dir.path())).expect("read"),
            damaged,
            "nothing cut"
        );
    }
}

/// What an older build accepted and a push refuses now is not recovered as
/// it was: a link-local address (the same on every link) is left out, so a
/// flow from another link sent from it is no sandbox's; a sandbox whose
/// credentials a push refuses is left out whole, from the snapshot and from
/// a record alike, its traffic denied. Neither stops the start.
#[test]
fn recovery_takes_only_what_a_push_takes_now() {
    let dir = tempfile::tempdir().expect("dir");
    let bad_credentials: Vec<egress_api::gateway::credentials::Credential> = serde_json::from_str(
        r#"[{"name": "gh", "placeholder": "X", "hosts": ["api.github.test"],
                 "inject": {"header": "authorization", "format": "token {value}"},
                 "source": {"env": "GH_TOKEN"}}]"#,
    )
    .expect("credentials");
    let older = registry();
    let ips = |list: &[&str]| list.iter().map(|a| a.parse().expect("ip")).collect();
    older
        .put(
            SandboxId::new("a"),
            ips(&["169.254.0.5", "100.64.0.9"]),
            Policy::default(),
        )
        .expect("put");
    let c = older.prepare_with(
        SandboxId::new("c"),
        ips(&["100.64.0.11"]),
        Policy::default(),
        crate::registry::Extras {
            credentials: bad_credentials.clone(),
            upstream_proxy: None,
            shadow: None,
            revision: None,
        },
    );
    older.put_prepared(c).expect("put");
    persist::save(dir.path(), &older, 0).expect("snapshot");
    let mut b = doc("b", "fe80::a");
    b.addresses.push("100.64.0.10".parse().expect("ip"));
    let mut d = doc("d", "100.64.0.12");
    d.credentials = bad_credentials;
    let (mut j, _) = Journal::open(dir.path(), 0).expect("open");
    j.append(&[
        Record {
            seq: 1,
            change: Change::Put(Box::new(b)),
        },
        put(2, "d", "100.64.0.13"),
        Record {
            seq: 3,
            change: Change::Put(Box::new(d)),
        },
    ])
    .expect("append");
    drop(j);
    let r = registry();
    let (_, seq, _) = recover(&r, dir.path()).expect("the start goes on");
    assert_eq!(seq, 3);
    let at = |a: &str| r.lookup(a.parse().expect("ip")).map(|s| s.id.to_string());
    assert_eq!(at("169.254.0.5"), None, "a link-local address came back");
    assert_eq!(at("fe80::a"), None, "a link-local address came back");
    assert_eq!(at("100.64.0.9").as_deref(), Some("a"));
    assert_eq!(at("100.64.0.10").as_deref(), Some("b"));
    assert_eq!(r.ids(), vec![SandboxId::new("a"), SandboxId::new("b")]);
}

/// A record that reads but cannot be replayed (an id no push passes) stops
/// the start naming its offset, where the operator may cut the journal:
/// the message says to cut it at that offset. Before, it named only the
/// record's sequence number.
#[test]
fn a_record_that_cannot_be_replayed_is_named_by_its_offset() {
    let dir = tempfile::tempdir().expect("dir");
    let first = write(dir.path(), &[put(1, "a", "100.64.0.1")]);
    let (mut j, _) = Journal::open(dir.path(), 0).expect("open");
    j.append(&[put(2, "bad id", "100.64.0.2")]).expect("append");
    drop(j);
    let e = recover(&registry(), dir.path()).expect_err("refused");
    let text = e.to_string();
    assert!(
        text.contains(&format!("record 2 at offset {first}:")),
        "{text}"
    );
}

/// The successor's check reads what recovery reads, a torn tail (the record
/// the running gateway is appending) included, and changes no file:
/// recovery would cut the tail off.
#[test]
fn a_check_reads_as_recovery_does_and_changes_nothing() {
    let dir = tempfile::tempdir().expect("dir");
    write(
        dir.path(),
        &[put(1, "a", "100.64.0.1"), put(2, "b", "100.64.0.2")],
    );
    let mut bytes = std::fs::read(path(dir.path())).expect("journal");
    bytes.extend_from_slice(&[40, 0, 0, 0, 1, 2]);
    std::fs::write(path(dir.path()), &bytes).expect("torn");
    let r = registry();
    assert_eq!(check(&r, dir.path()).expect("reads"), (2, 2));
    assert_eq!(std::fs::read(path(dir.path())).expect("journal"), bytes);
    // One that recovery would refuse, the check refuses alike.
    let (mut j, _) = Journal::open(dir.path(), 0).expect("open");
    j.append(&[put(3, "c", "100.64.0.1")]).expect("append");
    drop(j);
    let checked = check(&registry(), dir.path())
        .expect_err("refused")
        .to_string();
    let recovered = recover(&registry(), dir.path())
        .expect_err("refused")
        .to_string();
    assert_eq!(checked, recovered);
    assert!(checked.contains("record 3 at offset"), "{checked}");
}
